"""Every policy loss verl-engine implements against the published verl 0.9.1 wheel's own function.

verl's ``core_algos`` is imported from the wheel (``nox -s "tests(0.19.2)"`` installs it without dependencies; a
plain local run skips this module). For each loss x ``loss_agg_mode`` x with / without rollout importance
weights, in fp64: verl's function on the whole batch against ours on the whole batch, summed over three
micro-batches, and averaged over two data-parallel ranks (each rank's loss scaled by ``dp_size``, gradients
averaged as DP does). Loss and gradient must agree to 1e-12 relative; the metrics to 1e-6 (verl casts its clip
fractions to float32). ``VERL_LOSS_PARITY_OUT=path`` writes the worst differences as JSON (the table of
docs/engine.md).
"""

from __future__ import annotations

import functools
import json
import os
from typing import Any

import pytest
import torch

from verl_engine.losses import LOSS_AGG_MODES, policy_loss

pytestmark = pytest.mark.verl_reference

VERL_VERSION = "0.9.1"
MODES = ("vanilla", "gspo", "sapo", "gpg", "cispo", "dppo_tv", "dppo_kl", "geo_mean", "dro")
RTOL = 1e-12
DT = torch.float64
ROWS, WIDTH = 8, 9


def _batch(seed: int, *, physical: bool) -> dict[str, torch.Tensor]:
    """Varied lengths (one empty sequence), advantages of both signs, ratios far outside every clip; with
    ``physical`` every log-prob is <= 0 (else some are > 0, as a clamp test: DPPO's p > 1)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, WIDTH + 1, (ROWS,), generator=g)
    lengths[2] = 0
    old = -torch.rand(ROWS, WIDTH, generator=g, dtype=DT) * 3.0
    log_probs = old + torch.randn(ROWS, WIDTH, generator=g, dtype=DT) * 0.6
    if physical:
        log_probs = -torch.rand(ROWS, WIDTH, generator=g, dtype=DT) * 3.0
    else:
        log_probs[1] = old[1] + 10.5  # GSPO's clamp of the sequence log ratio
        log_probs[1, 3] = old[1, 3] + 25.0  # the +-20 clamp
    return {
        "log_prob": log_probs,
        "old_log_prob": old,
        "advantages": torch.randn(ROWS, WIDTH, generator=g, dtype=DT) * 2.0,
        "response_mask": torch.arange(WIDTH)[None, :] < lengths[:, None],
        "rollout_is_weights": torch.rand(ROWS, WIDTH, generator=g, dtype=DT) * 1.5 + 0.25,
    }


@functools.cache
def _verl_modules() -> tuple[Any, Any, Any]:
    """verl's core_algos, ActorConfig and PolicyLossConfig, imported when a test of this module runs (a session
    that deselects these tests never imports verl, and so never reports a skip)."""
    core_algos = pytest.importorskip(
        "verl.trainer.ppo.core_algos", reason="needs the verl 0.9.1 wheel: run nox -s 'tests(0.19.2)'"
    )
    from verl.workers.config.actor import ActorConfig, PolicyLossConfig

    return core_algos, ActorConfig, PolicyLossConfig


def _config(mode: str, agg: str) -> Any:
    _, ActorConfig, PolicyLossConfig = _verl_modules()
    cfg = ActorConfig(
        strategy="megatron",
        clip_ratio=0.2,
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        clip_ratio_c=3.0,
        loss_agg_mode=agg,
        policy_loss=PolicyLossConfig(loss_mode=mode, dro_beta=0.3),
        ppo_micro_batch_size_per_gpu=1,
        rollout_n=1,
    )
    return cfg


def _verl(
    batch: dict[str, torch.Tensor], mode: str, agg: str, weights: bool
) -> tuple[float, torch.Tensor, dict]:
    cfg = _config(mode, agg)
    mask = batch["response_mask"]
    info = {
        "dp_size": 1,
        "batch_num_tokens": int(mask.sum()),
        "global_batch_size": ROWS,
        "loss_scale_factor": None,
    }
    object.__setattr__(cfg, "global_batch_info", info)  # what verl's ppo_loss sets before the call
    lp = batch["log_prob"].clone().requires_grad_(True)
    loss, metrics = _verl_modules()[0].get_policy_loss_fn(mode)(
        old_log_prob=batch["old_log_prob"],
        log_prob=lp,
        advantages=batch["advantages"],
        response_mask=mask,
        loss_agg_mode=agg,
        config=cfg,
        rollout_is_weights=batch["rollout_is_weights"] if weights else None,
    )
    (grad,) = torch.autograd.grad(loss, lp)
    return float(loss), grad, metrics


def _ours(
    batch: dict[str, torch.Tensor], rows: slice, mode: str, agg: str, weights: bool, *, dp_size: int
) -> tuple[float, torch.Tensor, dict]:
    """Our loss of the rows ``rows`` as one micro-batch of one rank, normalised by the whole batch's counts."""
    mask = batch["response_mask"]
    info = {"dp_size": dp_size, "batch_num_tokens": int(mask.sum()), "global_batch_size": ROWS}
    lp = batch["log_prob"].clone().requires_grad_(True)
    loss, metrics = policy_loss(
        loss_mode=mode,
        log_prob=lp[rows],
        old_log_prob=batch["old_log_prob"][rows],
        advantages=batch["advantages"][rows],
        response_mask=mask[rows],
        loss_agg_mode=agg,
        config=_config(mode, agg),
        agg_kwargs={**info, "loss_scale_factor": None},
        rollout_is_weights=batch["rollout_is_weights"][rows] if weights else None,
    )
    (grad,) = torch.autograd.grad(loss, lp)
    return float(loss), grad, metrics


def _rel(got: float | torch.Tensor, want: float | torch.Tensor) -> float:
    got_t, want_t = torch.as_tensor(got, dtype=DT), torch.as_tensor(want, dtype=DT)
    scale = want_t.abs().max().clamp(min=1e-30)
    return float((got_t - want_t).abs().max() / scale)


@functools.cache
def _table() -> dict[str, dict[str, float]]:
    """Per loss: the worst relative loss / gradient difference of each layout, the worst metric difference."""
    table: dict[str, dict[str, float]] = {}
    micro = (slice(0, 3), slice(3, 5), slice(5, ROWS))
    ranks = (slice(0, ROWS // 2), slice(ROWS // 2, ROWS))
    for mode in MODES:
        worst = dict.fromkeys(
            ("whole_loss", "whole_grad", "micro_loss", "micro_grad", "dp2_loss", "dp2_grad", "metrics"), 0.0
        )
        for seed, physical in ((0, True), (1, True), (2, False)):
            batch = _batch(seed, physical=physical)
            for agg in LOSS_AGG_MODES:
                for weights in (False, True):
                    ref_loss, ref_grad, ref_metrics = _verl(batch, mode, agg, weights)
                    loss, grad, metrics = _ours(batch, slice(None), mode, agg, weights, dp_size=1)
                    parts = [_ours(batch, r, mode, agg, weights, dp_size=1) for r in micro]
                    shards = [_ours(batch, r, mode, agg, weights, dp_size=2) for r in ranks]
                    layouts = {
                        "whole": (loss, grad),
                        "micro": (sum(p[0] for p in parts), sum(p[1] for p in parts)),
                        "dp2": (sum(s[0] for s in shards) / 2, sum(s[1] for s in shards) / 2),
                    }
                    for name, (got_loss, got_grad) in layouts.items():
                        worst[f"{name}_loss"] = max(worst[f"{name}_loss"], _rel(got_loss, ref_loss))
                        worst[f"{name}_grad"] = max(worst[f"{name}_grad"], _rel(got_grad, ref_grad))
                    for key, value in ref_metrics.items():
                        diff = abs(float(metrics[key].value) - float(value))
                        worst["metrics"] = max(worst["metrics"], diff)
        table[mode] = worst
    out = os.environ.get("VERL_LOSS_PARITY_OUT")
    if out:
        with open(out, "w") as f:
            json.dump({"verl": VERL_VERSION, "dtype": "float64", "losses": table}, f, indent=1)
    return table


def test_the_wheel_is_verl_0_9_1() -> None:
    from importlib.metadata import version

    _verl_modules()
    assert version("verl") == VERL_VERSION


@pytest.mark.parametrize("mode", MODES)
def test_policy_loss_matches_verl_in_every_layout(mode: str) -> None:
    worst = _table()[mode]
    for key, value in worst.items():
        assert value <= (1e-6 if key == "metrics" else RTOL), (mode, key, worst)


def test_verl_registers_no_policy_loss_we_neither_implement_nor_refuse() -> None:
    from verl_engine.losses import POLICY_LOSSES
    from verl_engine.refusals import NOT_IMPLEMENTED_POLICY_LOSSES

    registered = set(_verl_modules()[0].POLICY_LOSS_REGISTRY)
    assert registered <= set(POLICY_LOSSES) | set(NOT_IMPLEMENTED_POLICY_LOSSES), registered
    assert set(MODES) == registered & set(POLICY_LOSSES)
