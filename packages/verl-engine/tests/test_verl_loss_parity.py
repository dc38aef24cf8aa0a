"""Every policy loss verl-engine implements against the published verl 0.9.1 wheel's own function.

verl's ``core_algos`` is imported from the wheel (``nox -s "tests(0.19.2)"`` installs it without dependencies; a
plain local run skips this module). For each loss x ``loss_agg_mode`` x with / without rollout importance
weights, in fp64: verl's function on the whole batch against ours on the whole batch, summed over three
micro-batches, and averaged over two data-parallel ranks (each rank's loss scaled by ``dp_size``, gradients
averaged as DP does). ``bypass_mode`` runs once per ``loss_type`` and for each of several rollout-correction
settings (importance weights, rejection options). Loss and gradient must agree to 1e-12 relative; the metrics to
1e-6 (verl casts its clip fractions to float32). ``VERL_LOSS_PARITY_OUT=path`` writes the worst differences as
JSON (the table of docs/engine.md). The rollout-correction weights and rejection masks are compared with verl's
``rollout_corr_helper`` directly too: every rejection option, both importance-weight levels, both threshold forms.

``clip_cov`` and ``kl_cov`` select tokens from the statistics of the micro-batch they are given (verl's definition),
so only the whole batch is compared with verl's whole batch (torch's default generator seeded alike before each
call: ``clip_cov`` draws from it); for micro-batches and ranks, ours equals verl's function applied to each part, which
is what verl's engine does, and differs from the whole batch.
"""

from __future__ import annotations

import functools
import json
import os
from typing import Any

import pytest
import torch

from verl_engine.losses import (
    LOSS_AGG_MODES,
    REJECTION_OPTIONS,
    RolloutCorrection,
    get_policy_loss_fn,
    importance_weights,
    parse_is_threshold,
    parse_rejection,
    policy_loss,
    rejection_mask,
    rollout_correction,
)

pytestmark = pytest.mark.verl_reference

VERL_VERSION = "0.9.1"
MODES = ("vanilla", "gspo", "sapo", "gpg", "cispo", "dppo_tv", "dppo_kl", "geo_mean", "dro")
# losses whose token selection is the micro-batch's (verl's definition): compared as the whole batch only
COV_MODES = ("clip_cov", "kl_cov")
# clip_cov: ratio 0.05 draws some of the window (0.2, 5)'s tokens, not all (PPO clips many); kl_cov: the top 20%
COV_SETTINGS = {
    "clip_cov_ratio": 0.05,
    "clip_cov_lb": 0.2,
    "clip_cov_ub": 5.0,
    "kl_cov_ratio": 0.2,
    "ppo_kl_coef": 0.5,
}
SEED = 1234  # torch's default generator, seeded before verl's call and before ours
# bypass_mode's rollout-correction settings (algorithm.rollout_correction): none, then token / sequence weights
# (TIS and IcePop thresholds) with every rejection option somewhere; batch normalisation only with ppo_clip
# (refused with reinforce: it would depend on the micro-batching). IcePop ranges keep some weight in every batch:
# verl 0.9.1's effective-sample-size metric divides by zero when IcePop zeroes every weight.
CORRECTIONS: tuple[dict[str, Any], ...] = (
    {"rollout_is": None, "rollout_rs": None},
    {
        "rollout_is": "token",
        "rollout_is_threshold": 2.0,
        "rollout_rs": "token_k1",
        "rollout_rs_threshold": 2.0,
    },
    {
        "rollout_is": "sequence",
        "rollout_is_threshold": "0.1_10.0",
        "rollout_rs": "seq_mean_k3,token_k2",
        "rollout_rs_threshold": "0.3,0.5",
    },
    {
        "rollout_is": "token",
        "rollout_is_threshold": "0.3_3.0",
        "rollout_rs": "seq_sum_k1,seq_max_k2",
        "rollout_rs_threshold": "0.01_100.0,1.5",
    },
    {
        "rollout_is": "sequence",
        "rollout_is_threshold": 5.0,
        "rollout_rs": "seq_mean_k1,seq_sum_k2,seq_sum_k3,seq_max_k3,token_k3,seq_mean_k2",
        "rollout_rs_threshold": "2.0",
    },
    {
        "rollout_is": "token",
        "rollout_is_threshold": 2.0,
        "rollout_is_batch_normalize": True,
        "rollout_rs": "token_k3",
        "rollout_rs_threshold": 0.5,
    },
)
# table row -> (loss_mode, the rollout-correction settings it runs with; None: the loss reads none)
CASES: dict[str, tuple[str, tuple[dict[str, Any] | None, ...]]] = {
    **{mode: (mode, (None,)) for mode in MODES + COV_MODES},
    "bypass_mode ppo_clip": ("bypass_mode", tuple({**c, "loss_type": "ppo_clip"} for c in CORRECTIONS)),
    "bypass_mode reinforce": (
        "bypass_mode",
        tuple(
            {**c, "loss_type": "reinforce"} for c in CORRECTIONS if not c.get("rollout_is_batch_normalize")
        ),
    ),
}
RTOL = 1e-12
DT = torch.float64
ROWS, WIDTH = 8, 9
BATCHES = ((0, True), (1, True), (2, False))  # (seed, physical) of each compared batch
MICRO = (slice(0, 3), slice(3, 5), slice(5, ROWS))  # three micro-batches of one rank
RANKS = (slice(0, ROWS // 2), slice(ROWS // 2, ROWS))  # two data-parallel ranks


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


@functools.cache
def _verl_rollout_corr() -> tuple[Any, Any]:
    """verl's rollout_corr_helper and RolloutCorrectionConfig (imported as :func:`_verl_modules` is)."""
    _verl_modules()
    from verl.trainer.config.algorithm import RolloutCorrectionConfig
    from verl.trainer.ppo import rollout_corr_helper

    return rollout_corr_helper, RolloutCorrectionConfig


def _config(mode: str, agg: str, correction: dict[str, Any] | None = None) -> Any:
    """verl's ActorConfig; with ``correction`` its policy_loss.rollout_correction, as verl's apply_bypass_mode
    sets it from algorithm.rollout_correction."""
    _, ActorConfig, PolicyLossConfig = _verl_modules()
    extra = {}
    if correction is not None:
        extra["rollout_correction"] = _verl_rollout_corr()[1](bypass_mode=True, **correction)
    cfg = ActorConfig(
        strategy="megatron",
        clip_ratio=0.2,
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        clip_ratio_c=3.0,
        loss_agg_mode=agg,
        policy_loss=PolicyLossConfig(loss_mode=mode, dro_beta=0.3, **COV_SETTINGS, **extra),
        ppo_micro_batch_size_per_gpu=1,
        rollout_n=1,
    )
    return cfg


def _verl(
    batch: dict[str, torch.Tensor],
    mode: str,
    agg: str,
    weights: bool,
    correction: dict[str, Any] | None,
    *,
    rows: slice = slice(None),
    dp_size: int = 1,
) -> tuple[float, torch.Tensor, dict]:
    """verl's function on the rows ``rows`` as one micro-batch (of one of ``dp_size`` ranks), torch's default
    generator seeded first; normalised by the whole batch's counts."""
    cfg = _config(mode, agg, correction)
    mask = batch["response_mask"]
    info = {
        "dp_size": dp_size,
        "batch_num_tokens": int(mask.sum()),
        "global_batch_size": ROWS,
        "loss_scale_factor": None,
    }
    object.__setattr__(cfg, "global_batch_info", info)  # what verl's ppo_loss sets before the call
    lp = batch["log_prob"].clone().requires_grad_(True)
    torch.manual_seed(SEED)
    loss, metrics = _verl_modules()[0].get_policy_loss_fn(mode)(
        old_log_prob=batch["old_log_prob"][rows],
        log_prob=lp[rows],
        advantages=batch["advantages"][rows],
        response_mask=mask[rows],
        loss_agg_mode=agg,
        config=cfg,
        rollout_is_weights=batch["rollout_is_weights"][rows] if weights else None,
    )
    (grad,) = torch.autograd.grad(loss, lp)
    return float(loss), grad, metrics


def _ours(
    batch: dict[str, torch.Tensor],
    rows: slice,
    mode: str,
    agg: str,
    weights: bool,
    correction: dict[str, Any] | None,
    *,
    dp_size: int,
) -> tuple[float, torch.Tensor, dict]:
    """Our loss of the rows ``rows`` as one micro-batch of one rank, normalised by the whole batch's counts (torch's
    default generator seeded first, as for :func:`_verl`)."""
    mask = batch["response_mask"]
    info = {"dp_size": dp_size, "batch_num_tokens": int(mask.sum()), "global_batch_size": ROWS}
    lp = batch["log_prob"].clone().requires_grad_(True)
    torch.manual_seed(SEED)
    loss, metrics = policy_loss(
        loss_mode=mode,
        log_prob=lp[rows],
        old_log_prob=batch["old_log_prob"][rows],
        advantages=batch["advantages"][rows],
        response_mask=mask[rows],
        loss_agg_mode=agg,
        config=_config(mode, agg, correction),
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
    """Per loss: the worst relative loss / gradient difference of each layout, the worst metric difference
    (None: a layout that is not compared, the micro-batches and ranks of :data:`COV_MODES`)."""
    table: dict[str, dict[str, float]] = {}
    for case, (mode, corrections) in CASES.items():
        whole_only = mode in COV_MODES
        worst: dict[str, float | None] = dict.fromkeys(
            ("whole_loss", "whole_grad", "micro_loss", "micro_grad", "dp2_loss", "dp2_grad", "metrics"), 0.0
        )
        runs = [
            (seed, physical, agg, weights, correction)
            for seed, physical in BATCHES
            for agg in LOSS_AGG_MODES
            for weights in (False, True)
            for correction in corrections
        ]
        for seed, physical, agg, weights, correction in runs:
            batch = _batch(seed, physical=physical)
            args = (mode, agg, weights, correction)
            ref_loss, ref_grad, ref_metrics = _verl(batch, *args)
            loss, grad, metrics = _ours(batch, slice(None), *args, dp_size=1)
            layouts = {"whole": (loss, grad)}
            if not whole_only:
                parts = [_ours(batch, r, *args, dp_size=1) for r in MICRO]
                shards = [_ours(batch, r, *args, dp_size=2) for r in RANKS]
                layouts["micro"] = (sum(p[0] for p in parts), sum(p[1] for p in parts))
                layouts["dp2"] = (sum(s[0] for s in shards) / 2, sum(s[1] for s in shards) / 2)
            for name, (got_loss, got_grad) in layouts.items():
                worst[f"{name}_loss"] = max(worst[f"{name}_loss"], _rel(got_loss, ref_loss))
                worst[f"{name}_grad"] = max(worst[f"{name}_grad"], _rel(got_grad, ref_grad))
            # every verl actor/ metric is ours; of its many rollout_corr/ diagnostics we report the main ones
            assert {k for k in ref_metrics if k.startswith("actor/")} <= set(metrics), (case, sorted(metrics))
            assert {k for k in metrics if k.startswith("rollout_corr/")} <= set(ref_metrics), (
                case,
                correction,
            )
            for key in set(ref_metrics) & set(metrics):
                diff = abs(float(metrics[key].value) - float(ref_metrics[key]))
                worst["metrics"] = max(worst["metrics"], diff)
        if whole_only:
            worst.update(dict.fromkeys(("micro_loss", "micro_grad", "dp2_loss", "dp2_grad")))
        table[case] = worst
    out = os.environ.get("VERL_LOSS_PARITY_OUT")
    if out:
        with open(out, "w") as f:
            json.dump({"verl": VERL_VERSION, "dtype": "float64", "losses": table}, f, indent=1)
    return table


def test_the_wheel_is_verl_0_9_1() -> None:
    from importlib.metadata import version

    _verl_modules()
    assert version("verl") == VERL_VERSION


@pytest.mark.parametrize("case", CASES)
def test_policy_loss_matches_verl_in_every_layout(case: str) -> None:
    worst = _table()[case]
    for key, value in worst.items():
        assert value is None or value <= (1e-6 if key == "metrics" else RTOL), (case, key, worst)
    assert (worst["micro_loss"] is None) == (case in COV_MODES), worst


def test_verl_registers_no_policy_loss_we_neither_implement_nor_refuse() -> None:
    from verl_engine.losses import POLICY_LOSSES
    from verl_engine.refusals import NOT_IMPLEMENTED_POLICY_LOSSES

    registered = set(_verl_modules()[0].POLICY_LOSS_REGISTRY)
    assert registered <= set(POLICY_LOSSES) | set(NOT_IMPLEMENTED_POLICY_LOSSES), registered
    assert {mode for mode, _ in CASES.values()} == registered & set(POLICY_LOSSES)


@pytest.mark.parametrize("mode", COV_MODES)
def test_the_covariance_losses_select_some_tokens_not_all(mode: str) -> None:
    """In every compared batch clip_cov zeroes some of its window's tokens but not all (the tokens PPO does not
    clip whose covariance lies in (clip_cov_lb, clip_cov_ub), computed here from the definition), and kl_cov
    penalises some response tokens but not all: the comparison with verl covers a real selection."""
    for seed, physical in BATCHES:
        batch = _batch(seed, physical=physical)
        log_prob, old, adv, mask = (
            batch[k] for k in ("log_prob", "old_log_prob", "advantages", "response_mask")
        )
        torch.manual_seed(SEED)
        terms = get_policy_loss_fn(mode)(
            log_prob=log_prob,
            old_log_prob=old,
            advantages=adv,
            response_mask=mask,
            config=_config(mode, "token-mean"),
            rollout_is_weights=None,
        )
        ratio = torch.exp(log_prob - old)
        if mode == "clip_cov":
            ppo_clipped = -adv * torch.clamp(ratio, 0.8, 1.28) > -adv * ratio
            cov = (adv - adv[mask].mean()) * (log_prob - log_prob[mask].mean())
            lower, upper = COV_SETTINGS["clip_cov_lb"], COV_SETTINGS["clip_cov_ub"]
            window = mask & ~ppo_clipped & (cov > lower) & (cov < upper)
            chosen = terms.clipped
            assert chosen is not None and not (chosen & ~window).any(), seed
            assert 0 < int(chosen.sum()) < int(window.sum()), (seed, int(chosen.sum()), int(window.sum()))
        else:
            chosen = mask & (terms.losses != -adv * ratio)
            assert 0 < int(chosen.sum()) < int(mask.sum()), (seed, int(chosen.sum()), int(mask.sum()))


@pytest.mark.parametrize("mode", COV_MODES)
def test_the_covariance_losses_are_verls_function_per_micro_batch(mode: str) -> None:
    """clip_cov and kl_cov select tokens from the statistics of the micro-batch they are given (verl's definition):
    a step depends on how the batch is cut into micro-batches and data-parallel ranks, and clip_cov draws from
    each rank's generator. Ours on each micro-batch (three of one rank; two ranks) equals verl's function on that
    micro-batch, which is what verl's engine runs, with the generator in the same state; the sum differs from the
    whole batch's loss in some case."""
    differs = False
    for seed, physical in BATCHES:
        batch = _batch(seed, physical=physical)
        for agg in LOSS_AGG_MODES:
            for weights in (False, True):
                args = (mode, agg, weights, None)
                whole = _verl(batch, *args)[0]
                for layout, dp_size in ((MICRO, 1), (RANKS, 2)):
                    total = 0.0
                    for rows in layout:
                        loss, grad, metrics = _ours(batch, rows, *args, dp_size=dp_size)
                        ref_loss, ref_grad, ref_metrics = _verl(batch, *args, rows=rows, dp_size=dp_size)
                        assert _rel(loss, ref_loss) <= RTOL and _rel(grad, ref_grad) <= RTOL, (
                            seed,
                            agg,
                            rows,
                        )
                        for key, value in ref_metrics.items():
                            assert abs(float(metrics[key].value) - value) <= 1e-6, (seed, agg, rows, key)
                        total += loss / dp_size
                    differs = differs or _rel(total, whole) > 1e-6
    assert differs, mode


def _log_ratios() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(log pi_train - log pi_rollout, response mask) of the loss batches: ratios near 1, far off, and past the
    +-20 clamp; one empty sequence each."""
    out = []
    for seed, physical in ((0, True), (1, True), (2, False)):
        batch = _batch(seed, physical=physical)
        out.append((batch["log_prob"] - batch["old_log_prob"], batch["response_mask"]))
    g = torch.Generator().manual_seed(3)
    mask = out[2][1]
    out.append((torch.randn(ROWS, WIDTH, generator=g, dtype=DT) * 0.3, mask))
    return out


def _same_metrics(ours: dict, ref: dict, where: Any) -> None:
    """Every metric we report is verl's (without the ``rollout_corr/`` prefix its helpers leave off), to 1e-6."""
    for key, metric in ours.items():
        name = key.removeprefix("rollout_corr/")
        assert name in ref, (where, key)
        assert abs(float(metric.value) - float(ref[name])) <= 1e-6 * max(1.0, abs(float(ref[name]))), (
            where,
            key,
            float(metric.value),
            ref[name],
        )


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("threshold", [2.0, 1.5, "0.2_5.0", "0.05_20.0"])
@pytest.mark.parametrize("normalize", [False, True])
def test_importance_weights_match_verl(level: str, threshold: float | str, normalize: bool) -> None:
    helper = _verl_rollout_corr()[0]
    lower, upper = parse_is_threshold(threshold)
    for log_ratio, mask in _log_ratios():
        ref, ref_metrics = helper.compute_rollout_correction_weights(
            log_ratio,
            mask,
            rollout_is=level,
            rollout_is_threshold=threshold,
            rollout_is_batch_normalize=normalize,
        )
        ours, metrics = importance_weights(
            log_ratio=log_ratio,
            response_mask=mask,
            level=level,
            upper=upper,
            lower=lower,
            batch_normalize=normalize,
        )
        assert _rel(ours, ref) <= RTOL, (level, threshold, normalize, _rel(ours, ref))
        _same_metrics(metrics, ref_metrics, (level, threshold, normalize))


def _rs_thresholds(option: str) -> list[Any]:
    """A *_k1 option: one number (the range 1/u..u) and lower_upper ranges; the others: upper bounds."""
    return [2.0, 1.2, "0.5_2.0", "0.1_1.2"] if option.endswith("k1") else [0.05, 0.5, 2.0, 8]


@pytest.mark.parametrize("option", REJECTION_OPTIONS)
def test_rejection_mask_matches_verl_for_every_option(option: str) -> None:
    helper = _verl_rollout_corr()[0]
    kept = rejected = 0
    for threshold in _rs_thresholds(option):
        for log_ratio, mask in _log_ratios():
            ref, ref_metrics = helper.compute_rollout_rejection_mask(
                log_ratio, mask, rollout_rs=option, rollout_rs_threshold=threshold
            )
            ours, metrics = rejection_mask(
                log_ratio=log_ratio, response_mask=mask, criteria=parse_rejection(option, threshold)
            )
            assert torch.equal(ours, ref.bool()), (option, threshold)
            _same_metrics(metrics, ref_metrics, (option, threshold))
            kept, rejected = kept + int(ours.sum()), rejected + int((mask & ~ours).sum())
    assert kept and rejected, (option, kept, rejected)  # the thresholds cut somewhere inside the data


@pytest.mark.parametrize(
    "correction",
    [c for c in CORRECTIONS if c["rollout_rs"]]
    + [
        {
            "rollout_is": "sequence",
            "rollout_rs": "token_k1,token_k1, seq_max_k3",
            "rollout_rs_threshold": "1.5",
        }
    ],
)
def test_rollout_correction_matches_verl(correction: dict[str, Any]) -> None:
    """Weights, chained rejection and metrics together (verl's compute_rollout_correction_and_rejection_mask), from
    the config section as the loss reads it; repeated options count once."""
    helper, config_type = _verl_rollout_corr()
    section = config_type(**correction)
    g = torch.Generator().manual_seed(4)
    for log_ratio, mask in _log_ratios():
        rollout = -torch.rand(ROWS, WIDTH, generator=g, dtype=DT) * 3.0
        ref_weights, ref_mask, ref_metrics = helper.compute_rollout_correction_and_rejection_mask(
            old_log_prob=rollout + log_ratio,
            rollout_log_prob=rollout,
            response_mask=mask,
            rollout_is=section.rollout_is,
            rollout_is_threshold=section.rollout_is_threshold,
            rollout_is_batch_normalize=section.rollout_is_batch_normalize,
            rollout_rs=section.rollout_rs,
            rollout_rs_threshold=section.rollout_rs_threshold,
        )
        weights, keep, metrics = rollout_correction(
            log_ratio=(rollout + log_ratio) - rollout,
            response_mask=mask,
            settings=RolloutCorrection.from_config(section),
        )
        assert torch.equal(keep, ref_mask.bool()), correction
        if ref_weights is None:
            assert weights is None
        else:
            assert weights is not None and _rel(weights, ref_weights.batch["rollout_is_weights"]) <= RTOL
        _same_metrics(
            metrics, {k.removeprefix("rollout_corr/"): v for k, v in ref_metrics.items()}, correction
        )
