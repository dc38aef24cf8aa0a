"""RL losses of verl-engine against plain float64 references written from the formulas (token by token).

The references below loop over sequences and tokens with 0-dim tensors so that autograd gives their
gradient too; they never call the library. Global normalisation and the data-parallel split are checked
by re-cutting one batch into micro-batches / ranks.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from tensordict import TensorDict

from verl_config import load_config
from verl_engine.losses import (
    KL_PENALTIES,
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    PolicyTerms,
    agg_loss,
    get_policy_loss_fn,
    kl_penalty,
    ppo_loss,
    register_policy_loss,
    sft_loss,
    value_loss,
)
from verl_engine.metrics import Metric, Reduction

TOL = {"atol": 1e-6, "rtol": 1e-6}
DT = torch.float64
POLICY_MODES = ("vanilla", "gspo", "gpg", "sapo", "cispo", "dppo_tv", "dppo_kl", "geo_mean")


# ------------------------------------------------------------------------------------------- fixtures
def make_batch(*, seed: int = 0, rows: int = 6, width: int = 7) -> dict[str, Any]:
    """A random batch: varied lengths, one empty sequence, advantages of both signs, ratios that hit every clip.

    Row 0 makes the dual clip bind, row 1 has a sequence log ratio above GSPO's clamp (10) and one token
    above the +-20 clamp; the other rows have ratios well outside 1 +- 0.2.
    """
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, width + 1, (rows,), generator=g)
    lengths[2] = 0  # an empty sequence
    old = -torch.rand(rows, width, generator=g, dtype=DT) * 3.0
    log_probs = old + torch.randn(rows, width, generator=g, dtype=DT) * 0.6  # ratios far outside 1 +- 0.2
    adv = torch.randn(rows, width, generator=g, dtype=DT) * 2.0
    lengths[:2] = width
    log_probs[0, :2] = old[0, :2] + 2.0  # ratio e^2 > clip_ratio_c with A < 0: the dual clip binds
    adv[0, :2] = -1.5
    log_probs[1] = old[1] + 10.5 + 0.2 * torch.randn(width, generator=g, dtype=DT)  # GSPO's clamp at 10
    log_probs[1, 3] = old[1, 3] + 25.0  # the +-20 clamp of the token log ratio
    mask = torch.arange(width)[None, :] < lengths[:, None]
    return {
        "response_mask": mask,
        "old_log_probs": old,
        "log_probs": log_probs,
        "advantages": adv,
        "ref_log_prob": old + torch.randn(rows, width, generator=g, dtype=DT) * 0.5,
        "rollout_is_weights": 0.5 + torch.rand(rows, width, generator=g, dtype=DT),
        "entropy": torch.rand(rows, width, generator=g, dtype=DT) * 2.0,
        "values": torch.randn(rows, width, generator=g, dtype=DT),
        "old_values": torch.randn(rows, width, generator=g, dtype=DT),
        "returns": torch.randn(rows, width, generator=g, dtype=DT),
    }


def actor_config(**overrides: Any) -> SimpleNamespace:
    """An actor config with verl's keys; dual clip, entropy and KL terms all on."""
    cfg = {
        "clip_ratio": 0.2,
        "clip_ratio_low": 0.2,
        "clip_ratio_high": 0.28,
        "clip_ratio_c": 3.0,
        "tau_pos": 1.0,
        "tau_neg": 1.05,
        "policy_loss": SimpleNamespace(loss_mode="vanilla"),
        "loss_agg_mode": "token-mean",
        "loss_scale_factor": None,
        "entropy_coeff": 0.01,
        "use_kl_loss": True,
        "kl_loss_coef": 0.1,
        "kl_loss_type": "low_var_kl",
    }
    cfg.update(overrides)
    return SimpleNamespace(**cfg)


def actor_io(
    batch: dict[str, Any],
    rows: slice | list[int],
    *,
    log_probs: torch.Tensor,
    entropy: torch.Tensor,
    **scalars: Any,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(model_output, data) of the chosen rows; ``log_probs`` / ``entropy`` are full-batch tensors with grad."""
    model_output = {"log_probs": log_probs[rows], "entropy": entropy[rows]}
    keys = ("response_mask", "old_log_probs", "advantages", "ref_log_prob", "rollout_is_weights")
    data = {k: batch[k][rows] for k in keys}
    data.update(scalars)
    return model_output, data


def whole_counts(batch: dict[str, Any]) -> dict[str, Any]:
    """The global scalars of the whole batch on one rank."""
    mask = batch["response_mask"]
    return {"dp_size": 1, "batch_num_tokens": int(mask.sum()), "global_batch_size": mask.shape[0]}


# ------------------------------------------------------------------------------------------ references
Scalar = torch.Tensor | float


def ref_agg(
    per_token: Callable[[int, int], Scalar],
    mask: torch.Tensor,
    mode: str,
    *,
    dp_size: int = 1,
    batch_num_tokens: int | None = None,
    global_batch_size: int | None = None,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """Aggregation written from the definitions, with explicit loops; per_token(i, t) is only asked for masked tokens."""
    rows, width = mask.shape
    lengths = [sum(int(mask[i, t]) for t in range(width)) for i in range(rows)]
    seq_sums: list[Scalar] = []
    for i in range(rows):
        s: Scalar = torch.zeros((), dtype=DT)
        for t in range(width):
            if mask[i, t]:
                s = s + per_token(i, t)
        seq_sums.append(s)
    n_tok = batch_num_tokens if batch_num_tokens is not None else sum(lengths)
    n_seq = global_batch_size if global_batch_size is not None else rows
    if mode == "token-mean":
        return sum(seq_sums) / max(n_tok, 1) * dp_size
    if mode == "token-sum":
        return sum(seq_sums) * dp_size
    if mode == "seq-mean-token-mean":
        per_seq = [seq_sums[i] / lengths[i] if lengths[i] > 0 else 0.0 for i in range(rows)]
        return sum(per_seq) / n_seq * dp_size
    loss = sum(seq_sums) / n_seq * dp_size
    if mode == "seq-mean-token-sum-norm":
        loss = loss / (loss_scale_factor if loss_scale_factor is not None else width)
    return loss


def clip(x: Scalar, lo: float, hi: float) -> Scalar:
    """clamp with a zero gradient outside [lo, hi] (python's max/min pick the constant there)."""
    return min(max(x, lo), hi)


def ref_ratio(lp: torch.Tensor, old: float) -> torch.Tensor:
    """exp(clamp(logp - old, -20, 20))."""
    return torch.exp(torch.as_tensor(clip(lp - old, -20.0, 20.0), dtype=DT))


def ref_policy_token(
    mode: str, batch: dict[str, Any], lp: torch.Tensor, cfg: SimpleNamespace, *, weights: bool
) -> tuple[Callable[[int, int], Scalar], str | None]:
    """(per-token policy loss, forced aggregation mode or None) written from each loss's formula."""
    old, adv, w = batch["old_log_probs"], batch["advantages"], batch["rollout_is_weights"]
    mask = batch["response_mask"]

    def weight(i: int, t: int) -> float:
        return float(w[i, t]) if weights else 1.0

    if mode == "vanilla":

        def vanilla(i: int, t: int) -> Scalar:
            a = float(adv[i, t])
            r = ref_ratio(lp[i, t], float(old[i, t]))
            loss = max(-a * r, -a * clip(r, 1 - cfg.clip_ratio_low, 1 + cfg.clip_ratio_high))
            if a < 0:
                loss = min(loss, -a * cfg.clip_ratio_c)
            return loss * weight(i, t)

        return vanilla, None
    if mode == "gpg":
        return (lambda i, t: -lp[i, t] * float(adv[i, t]) * weight(i, t)), None
    if mode == "cispo":  # the clipped ratio is a constant (stopped gradient) times the log-prob

        def cispo(i: int, t: int) -> Scalar:
            r = float(ref_ratio(lp[i, t], float(old[i, t])))
            c = min(max(r, 1 - cfg.clip_ratio_low), 1 + cfg.clip_ratio_high)
            return -c * float(adv[i, t]) * lp[i, t] * weight(i, t)

        return cispo, None
    if mode == "geo_mean":  # one loss per sequence: -mean(A) * exp(mean of the sign-aware clipped log ratios)

        def geo_mean(i: int, _t: int) -> Scalar:
            toks = [t for t in range(mask.shape[1]) if mask[i, t]]
            chosen: Scalar = 0.0
            for t in toks:
                d, a = lp[i, t] - float(old[i, t]), float(adv[i, t])
                sign = (a > 0) - (a < 0)
                chosen = chosen + sign * min(
                    sign * d, sign * clip(d, -cfg.clip_ratio_low, cfg.clip_ratio_high)
                )
            n = max(len(toks), 1)
            loss = -sum(float(adv[i, t]) for t in toks) / n * torch.exp(torch.as_tensor(chosen / n, dtype=DT))
            if weights:  # the sequence's weight: the geometric mean of its tokens'
                loss = loss * math.exp(sum(math.log(float(w[i, t]) + 1e-10) for t in toks) / n)
            return loss

        return geo_mean, "seq-mean-token-mean"
    if mode in (
        "dppo_tv",
        "dppo_kl",
    ):  # only tokens inside the probability trust region, ratio truncated at c

        def dppo(i: int, t: int) -> Scalar:
            a, lo = float(adv[i, t]), float(old[i, t])
            p, p_old = math.exp(float(lp[i, t])), math.exp(lo)
            if mode == "dppo_tv":
                keep = p - p_old <= cfg.clip_ratio_high if a > 0 else p - p_old >= -cfg.clip_ratio_low
            else:
                # torch's log: NaN (never within the bound) where the batch's log-prob > 0 makes p > 1
                q = torch.tensor((1 - p_old + 1e-8) / (1 - p + 1e-8), dtype=DT)
                bkl = p_old * (lo - float(lp[i, t])) + (1 - p_old) * float(torch.log(q))
                keep = (
                    (bkl <= cfg.clip_ratio_high or p <= p_old)
                    if a > 0
                    else (bkl <= cfg.clip_ratio_low or p >= p_old)
                )
            truncated = min(float(ref_ratio(lp[i, t], lo)), cfg.clip_ratio_c)
            return -a * truncated * lp[i, t] * float(keep) * weight(i, t)

        return dppo, None
    if mode == "sapo":

        def sapo(i: int, t: int) -> Scalar:
            a = float(adv[i, t])
            tau = cfg.tau_pos if a > 0 else cfg.tau_neg
            r = ref_ratio(lp[i, t], float(old[i, t]))
            gate = 1.0 / (1.0 + torch.exp(-tau * (r - 1.0))) * (4.0 / tau)
            return -gate * a * weight(i, t)

        return sapo, "seq-mean-token-mean"
    # gspo: value of the sequence ratio, gradient of the token's own log-prob
    seq_log_ratio = {}
    for i in range(mask.shape[0]):
        toks = [t for t in range(mask.shape[1]) if mask[i, t]]
        if toks:
            seq_log_ratio[i] = sum(float(lp[i, t].detach()) - float(old[i, t]) for t in toks) / len(toks)

    def gspo(i: int, t: int) -> Scalar:
        log_s = lp[i, t] - float(lp[i, t].detach()) + seq_log_ratio[i]
        log_s = min(log_s, 10.0)
        s = torch.exp(torch.as_tensor(log_s, dtype=DT))
        a = float(adv[i, t])
        return max(-a * s, -a * clip(s, 1 - cfg.clip_ratio_low, 1 + cfg.clip_ratio_high)) * weight(i, t)

    return gspo, None  # verl 0.9.1 aggregates GSPO with the config's loss_agg_mode


def ref_kl(lp: Scalar, ref: float, kind: str) -> Scalar:
    """Schulman's estimators, one token."""
    if kind in ("kl", "k1"):
        return lp - ref
    if kind == "abs":
        return abs(lp - ref)
    if kind in ("mse", "k2"):
        return 0.5 * (lp - ref) ** 2
    k = clip(ref - lp, -20.0, 20.0)
    return clip(torch.exp(torch.as_tensor(k, dtype=DT)) - k - 1.0, -10.0, 10.0)


def mv(metrics: dict[str, Any], name: str) -> float:
    """A metric's value as a float (losses return :class:`Metric` objects holding device tensors)."""
    item = metrics[name]
    assert isinstance(item, Metric), f"{name} is not a Metric: {item!r}"
    return float(item.value)


def assert_close(a: torch.Tensor | float, b: torch.Tensor | float) -> None:
    """1e-6 absolute + relative, float64."""
    torch.testing.assert_close(torch.as_tensor(a, dtype=DT), torch.as_tensor(b, dtype=DT), **TOL)


def grads(loss: torch.Tensor, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """d loss / d inputs, zeros where the loss does not depend on an input."""
    return torch.autograd.grad(loss, inputs, allow_unused=True, materialize_grads=True)


# ---------------------------------------------------------------------------------------- agg_loss
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("counts", ["local", "global"])
def test_agg_loss_matches_reference(mode: str, counts: str) -> None:
    batch = make_batch(seed=1)
    mask = batch["response_mask"]
    loss_mat = batch["log_probs"].clone().requires_grad_(True)
    kw: dict[str, Any] = {}
    if counts == "global":  # pretend this is one of 4 ranks of a larger batch
        kw = {"dp_size": 4, "batch_num_tokens": 97, "global_batch_size": 23, "loss_scale_factor": 5}
    got = agg_loss(loss_mat=loss_mat, loss_mask=mask, loss_agg_mode=mode, **kw)
    want = ref_agg(lambda i, t: loss_mat[i, t] * 1.0, mask, mode, **kw)
    assert_close(got, want)
    (g_got,) = grads(got, loss_mat)
    (g_want,) = grads(want, loss_mat)
    assert_close(g_got, g_want)
    assert bool((g_got[~mask] == 0).all())  # padding gets no gradient


def test_agg_loss_accepts_float_masks_and_tensor_counts() -> None:
    batch = make_batch(seed=2)
    mask = batch["response_mask"]
    loss_mat = batch["log_probs"]
    as_int = agg_loss(
        loss_mat=loss_mat, loss_mask=mask.long(), loss_agg_mode="token-mean", batch_num_tokens=40
    )
    as_tensor = agg_loss(
        loss_mat=loss_mat, loss_mask=mask, loss_agg_mode="token-mean", batch_num_tokens=torch.tensor(40)
    )
    assert_close(as_int, as_tensor)


@pytest.mark.parametrize(
    ("agg_mode", "missing"),
    [("token-mean", "batch_num_tokens"), ("seq-mean-token-mean", "global_batch_size")],
)
def test_agg_loss_refuses_local_counts_with_several_ranks(agg_mode: str, missing: str) -> None:
    batch = make_batch()
    with pytest.raises(ValueError, match=missing):
        agg_loss(
            loss_mat=batch["log_probs"], loss_mask=batch["response_mask"], loss_agg_mode=agg_mode, dp_size=2
        )


# ------------------------------------------------------------------------------------------ ppo_loss
@pytest.mark.parametrize("loss_mode", POLICY_MODES)
@pytest.mark.parametrize("agg_mode", LOSS_AGG_MODES)
def test_ppo_loss_matches_reference(loss_mode: str, agg_mode: str) -> None:
    batch = make_batch(seed=3)
    cfg = actor_config(
        policy_loss=SimpleNamespace(loss_mode=loss_mode), loss_agg_mode=agg_mode, loss_scale_factor=4
    )
    lp = batch["log_probs"].clone().requires_grad_(True)
    ent = batch["entropy"].clone().requires_grad_(True)
    counts = {"dp_size": 2, "batch_num_tokens": 61, "global_batch_size": 13}  # one rank of two
    model_output, data = actor_io(batch, slice(None), log_probs=lp, entropy=ent, **counts)
    loss, metrics = ppo_loss(config=cfg, model_output=model_output, data=data)

    mask = batch["response_mask"]
    agg = functools.partial(ref_agg, mask=mask, loss_scale_factor=4, **counts)
    token_fn, forced = ref_policy_token(loss_mode, batch, lp, cfg, weights=True)
    ref_pg = agg(token_fn, mode=forced or agg_mode)
    ref_ent = agg(lambda i, t: ent[i, t] * 1.0, mode=agg_mode)
    ref_kl_loss = agg(lambda i, t: ref_kl(lp[i, t], float(batch["ref_log_prob"][i, t]), "k3"), mode=agg_mode)
    want = ref_pg - cfg.entropy_coeff * ref_ent + cfg.kl_loss_coef * ref_kl_loss

    assert_close(loss, want)
    for g_got, g_want in zip(grads(loss, lp, ent), grads(want, lp, ent), strict=True):
        assert_close(g_got, g_want)
    assert_close(mv(metrics, "actor/pg_loss"), ref_pg)
    assert_close(mv(metrics, "actor/entropy_loss"), ref_ent)
    assert_close(mv(metrics, "actor/kl_loss"), ref_kl_loss)
    assert mv(metrics, "actor/kl_coef") == cfg.kl_loss_coef
    assert set(metrics) == {
        "actor/pg_loss",
        "actor/pg_clipfrac",
        "actor/pg_clipfrac_lower",
        "actor/ppo_kl",
        "actor/entropy_loss",
        "actor/kl_loss",
        "actor/kl_coef",
    }
    for name in ("actor/pg_loss", "actor/entropy_loss", "actor/kl_loss"):
        assert metrics[name].reduction is Reduction.SUM  # a share of the global loss
    for name in ("actor/pg_clipfrac", "actor/pg_clipfrac_lower", "actor/ppo_kl", "actor/kl_coef"):
        assert metrics[name].reduction is Reduction.MEAN
    tokens = [(i, t) for i in range(mask.shape[0]) for t in range(mask.shape[1]) if mask[i, t]]
    bound = math.inf if loss_mode in ("gspo", "geo_mean") else 20.0  # verl clamps it except in GSPO and GMPO
    log_ratios = [float(batch["log_probs"][i, t] - batch["old_log_probs"][i, t]) for i, t in tokens]
    ppo_kl = -sum(clip(d, -bound, bound) for d in log_ratios) / len(tokens)
    assert_close(mv(metrics, "actor/ppo_kl"), ppo_kl)


def ref_clip_fractions(batch: dict[str, Any], cfg: SimpleNamespace) -> tuple[float, float]:
    """(pg_clipfrac, pg_clipfrac_lower) of vanilla PPO, counted token by token."""
    mask, adv = batch["response_mask"], batch["advantages"]
    clipped = lower = n = 0
    for i in range(mask.shape[0]):
        for t in range(mask.shape[1]):
            if not mask[i, t]:
                continue
            n += 1
            a = float(adv[i, t])
            r = math.exp(float(batch["log_probs"][i, t] - batch["old_log_probs"][i, t]))
            l1, l2 = -a * r, -a * min(max(r, 1 - cfg.clip_ratio_low), 1 + cfg.clip_ratio_high)
            clipped += l2 > l1
            lower += a < 0 and max(l1, l2) > -a * cfg.clip_ratio_c
    return clipped / n, lower / n


def test_vanilla_clip_fractions_are_active_and_match() -> None:
    batch = make_batch(seed=3)
    # A few ratios far above 1 with A < 0 so the dual clip binds
    batch["log_probs"][0, :2] = batch["old_log_probs"][0, :2] + 2.0
    batch["advantages"][0, :2] = -1.0
    cfg = actor_config(use_kl_loss=False, entropy_coeff=0.0)
    model_output, data = actor_io(
        batch, slice(None), log_probs=batch["log_probs"], entropy=batch["entropy"], **whole_counts(batch)
    )
    _, metrics = ppo_loss(config=cfg, model_output=model_output, data=data)
    clipfrac, lower = ref_clip_fractions(batch, cfg)
    assert clipfrac > 0 and lower > 0
    assert_close(mv(metrics, "actor/pg_clipfrac"), clipfrac)
    assert_close(mv(metrics, "actor/pg_clipfrac_lower"), lower)


def test_gspo_follows_loss_agg_mode_and_sapo_does_not() -> None:
    """verl 0.9.1: GSPO is aggregated with the config's loss_agg_mode (earlier verl forced seq-mean-token-mean,
    a 5.5x different loss at the actor's default token-mean); SAPO still forces seq-mean-token-mean."""
    batch = make_batch(seed=4)
    out = {}
    for loss_mode in ("gspo", "sapo"):
        for mode in ("token-mean", "seq-mean-token-mean"):
            cfg = actor_config(policy_loss=SimpleNamespace(loss_mode=loss_mode), loss_agg_mode=mode)
            model_output, data = actor_io(
                batch,
                slice(None),
                log_probs=batch["log_probs"],
                entropy=batch["entropy"],
                **whole_counts(batch),
            )
            pg = ppo_loss(config=cfg, model_output=model_output, data=data)[1]["actor/pg_loss"].value
            out[loss_mode, mode] = float(pg)
    assert out["gspo", "token-mean"] != pytest.approx(out["gspo", "seq-mean-token-mean"], rel=1e-3)
    assert out["sapo", "token-mean"] == out["sapo", "seq-mean-token-mean"]


def test_ppo_loss_with_verl_config_and_tensordict() -> None:
    cfg = load_config(
        overrides=[
            "model_engine=megatron",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1",
            "critic.enable=false",
        ]
    ).actor_rollout_ref.actor
    batch = make_batch(seed=5)
    lp = batch["log_probs"].clone().requires_grad_(True)
    model_output, data = actor_io(batch, slice(None), log_probs=lp, entropy=batch["entropy"])
    td = TensorDict({k: v for k, v in data.items()}, batch_size=[batch["response_mask"].shape[0]])
    for key, value in whole_counts(batch).items():
        td.set_non_tensor(key, value)
    loss, metrics = ppo_loss(config=cfg, model_output=model_output, data=td)
    token_fn, _ = ref_policy_token("vanilla", batch, lp, cfg, weights=True)
    want = ref_agg(token_fn, batch["response_mask"], "token-mean")  # entropy_coeff 0, no KL loss by default
    assert_close(loss, want)
    assert_close(grads(loss, lp)[0], grads(want, lp)[0])
    assert "actor/kl_loss" not in metrics and "actor/entropy_loss" in metrics


def test_custom_policy_loss_is_selected_by_loss_mode() -> None:
    @register_policy_loss("test_double_pg")
    def double_pg(*, log_prob, advantages, **_):
        return PolicyTerms(losses=-2.0 * log_prob * advantages, log_ratio=torch.zeros_like(log_prob))

    assert POLICY_LOSSES["test_double_pg"] is double_pg and get_policy_loss_fn("test_double_pg") is double_pg
    batch = make_batch(seed=6)
    cfg = actor_config(
        policy_loss=SimpleNamespace(loss_mode="test_double_pg"), use_kl_loss=False, entropy_coeff=0
    )
    model_output, data = actor_io(
        batch, slice(None), log_probs=batch["log_probs"], entropy=batch["entropy"], **whole_counts(batch)
    )
    loss, metrics = ppo_loss(config=cfg, model_output=model_output, data=data)
    cfg_gpg = actor_config(policy_loss=SimpleNamespace(loss_mode="gpg"), use_kl_loss=False, entropy_coeff=0)
    plain, _ = ppo_loss(config=cfg_gpg, model_output=model_output, data=data)
    # the skeleton reports for every mode: no clip -> fractions 0, the mode's log ratio -> ppo_kl
    assert mv(metrics, "actor/pg_clipfrac") == 0.0 and mv(metrics, "actor/ppo_kl") == 0.0
    assert_close(loss, 2.0 * plain)


# ----------------------------------------------------------------------------------------- KL penalty
@pytest.mark.parametrize("kind", KL_PENALTIES)
def test_kl_estimators(kind: str) -> None:
    batch = make_batch(seed=7)
    lp = batch["log_probs"].clone().requires_grad_(True)
    ref = batch["ref_log_prob"]
    ref[0, 0] = lp[0, 0].detach() + 30.0  # k3 clamp of the log ratio at 20 and of the value at 10
    got = kl_penalty(log_prob=lp, ref_log_prob=ref, kl_penalty=kind)
    want = torch.stack(
        [
            torch.as_tensor(ref_kl(lp[i, t], float(ref[i, t]), kind), dtype=DT)
            for i in range(lp.shape[0])
            for t in range(lp.shape[1])
        ]
    ).view_as(lp)
    assert_close(got, want)
    assert_close(grads(got.sum(), lp)[0], grads(want.sum(), lp)[0])
    # straight-through: same value, the gradient of k2
    st = kl_penalty(log_prob=lp, ref_log_prob=ref, kl_penalty=kind + "+")
    assert torch.equal(st, got.detach())
    assert_close(grads(st.sum(), lp)[0], (lp - ref).detach())


def test_k3_straight_through_value_and_gradient() -> None:
    lp = torch.tensor([-1.0, -0.5, -2.0], dtype=DT, requires_grad=True)
    ref = torch.tensor([-1.3, -0.1, -2.0], dtype=DT)
    st = kl_penalty(log_prob=lp, ref_log_prob=ref, kl_penalty="k3+")
    k = (ref - lp).detach()
    assert_close(st, torch.exp(k) - k - 1)
    (g,) = torch.autograd.grad(st.sum(), lp)
    assert_close(g, lp.detach() - ref)  # d/dlp of 0.5 (lp - ref)^2


def test_kl_full_and_unknown() -> None:
    x = torch.zeros(2, 3)
    with pytest.raises(NotImplementedError, match="full"):
        kl_penalty(log_prob=x, ref_log_prob=x, kl_penalty="full")
    with pytest.raises(ValueError, match="low_var_kl"):
        kl_penalty(log_prob=x, ref_log_prob=x, kl_penalty="k4")


# --------------------------------------------------------------------------------------- critic, SFT
@pytest.mark.parametrize("agg_mode", LOSS_AGG_MODES)
def test_value_loss_matches_reference(agg_mode: str) -> None:
    batch = make_batch(seed=8)
    mask = batch["response_mask"]
    vpred = batch["values"].clone().requires_grad_(True)
    old, ret = batch["old_values"], batch["returns"]
    cfg = SimpleNamespace(cliprange_value=0.5, loss_agg_mode=agg_mode)
    counts = {"dp_size": 3, "batch_num_tokens": 71, "global_batch_size": 17}
    data = {"response_mask": mask, "values": old, "returns": ret, **counts}
    loss, metrics = value_loss(config=cfg, model_output={"values": vpred}, data=data)

    def token(i: int, t: int) -> Scalar:
        v, o, r = vpred[i, t], float(old[i, t]), float(ret[i, t])
        vclip = clip(v, o - 0.5, o + 0.5)
        return max((v - r) ** 2, (vclip - r) ** 2)

    want = 0.5 * ref_agg(token, mask, agg_mode, **counts)
    assert_close(loss, want)
    assert_close(grads(loss, vpred)[0], grads(want, vpred)[0])
    tokens = [(i, t) for i in range(mask.shape[0]) for t in range(mask.shape[1]) if mask[i, t]]
    vpred = vpred.detach()
    clipped = [abs(float(vpred[i, t] - old[i, t])) > 0.5 for i, t in tokens]
    further = [
        (float(clip(float(vpred[i, t]), float(old[i, t]) - 0.5, float(old[i, t]) + 0.5)) - float(ret[i, t]))
        ** 2
        > float(vpred[i, t] - ret[i, t]) ** 2
        for i, t in tokens
    ]
    assert any(clipped)
    assert_close(mv(metrics, "critic/vf_clipfrac"), sum(further) / len(tokens))
    assert_close(mv(metrics, "critic/vpred_mean"), sum(float(vpred[i, t]) for i, t in tokens) / len(tokens))
    assert_close(mv(metrics, "critic/vf_loss"), want)


def test_sft_loss_matches_reference() -> None:
    batch = make_batch(seed=9)
    lp = batch["log_probs"].clone().requires_grad_(True)
    data = {"response_mask": batch["response_mask"], "dp_size": 2, "batch_num_tokens": 50}
    loss, metrics = sft_loss(model_output={"log_probs": lp}, data=data)
    want = ref_agg(
        lambda i, t: -lp[i, t], batch["response_mask"], "token-mean", dp_size=2, batch_num_tokens=50
    )
    assert_close(loss, want)
    assert_close(grads(loss, lp)[0], grads(want, lp)[0])
    assert metrics == {}


# --------------------------------------------------------------------------------- global normalisation
SPLITS = (slice(0, 2), slice(2, 3), slice(3, 6))  # three uneven micro-batches, one holding the empty sequence


def run_loss(kind: str, batch: dict[str, Any], rows: slice | list[int], agg_mode: str, **scalars: Any):
    """(loss, metrics) of ``kind`` on ``rows`` with the batch's own leaf tensors."""
    lp, ent = batch["log_probs"], batch["entropy"]
    if kind == "sft":
        return sft_loss(
            model_output={"log_probs": lp[rows]},
            data={"response_mask": batch["response_mask"][rows], **scalars},
        )
    if kind == "value":
        data = {k: batch[k][rows] for k in ("response_mask", "returns")}
        data["values"] = batch["old_values"][rows]
        cfg = SimpleNamespace(cliprange_value=0.3, loss_agg_mode=agg_mode)
        return value_loss(
            config=cfg, model_output={"values": batch["values"][rows]}, data={**data, **scalars}
        )
    cfg = actor_config(policy_loss=SimpleNamespace(loss_mode=kind), loss_agg_mode=agg_mode)
    model_output, data = actor_io(batch, rows, log_probs=lp, entropy=ent, **scalars)
    return ppo_loss(config=cfg, model_output=model_output, data=data)


def leaves(batch: dict[str, Any]) -> list[torch.Tensor]:
    """Make the model outputs leaf tensors with grad, return them."""
    for key in ("log_probs", "entropy", "values"):
        batch[key] = batch[key].detach().clone().requires_grad_(True)
    return [batch["log_probs"], batch["entropy"], batch["values"]]


@pytest.mark.parametrize("kind", [*POLICY_MODES, "value", "sft"])
@pytest.mark.parametrize("agg_mode", LOSS_AGG_MODES)
def test_micro_batch_sum_equals_whole_batch(kind: str, agg_mode: str) -> None:
    batch = make_batch(seed=10)
    inputs = leaves(batch)
    counts = whole_counts(batch)
    whole, _ = run_loss(kind, batch, slice(None), agg_mode, **counts)
    parts = sum(run_loss(kind, batch, rows, agg_mode, **counts)[0] for rows in SPLITS)
    torch.testing.assert_close(parts, whole, atol=1e-9, rtol=1e-9)
    for g_parts, g_whole in zip(grads(parts, *inputs), grads(whole, *inputs), strict=True):
        torch.testing.assert_close(g_parts, g_whole, atol=1e-9, rtol=1e-9)


def test_global_token_mean_differs_from_mean_of_micro_batch_means() -> None:
    batch = make_batch(seed=10)
    mask, lp = batch["response_mask"], batch["log_probs"]
    whole = agg_loss(loss_mat=lp, loss_mask=mask, loss_agg_mode="token-mean")
    global_parts = sum(
        agg_loss(
            loss_mat=lp[r], loss_mask=mask[r], loss_agg_mode="token-mean", batch_num_tokens=int(mask.sum())
        )
        for r in SPLITS
    )
    local_means = [agg_loss(loss_mat=lp[r], loss_mask=mask[r], loss_agg_mode="token-mean") for r in SPLITS]
    mean_of_means = sum(local_means) / len(SPLITS)
    torch.testing.assert_close(global_parts, whole, atol=1e-12, rtol=0)
    assert abs(float(mean_of_means - whole)) > 1e-2  # per-micro-batch means weight short micro-batches up


@pytest.mark.parametrize("kind", [*POLICY_MODES, "value", "sft"])
@pytest.mark.parametrize("agg_mode", LOSS_AGG_MODES)
def test_data_parallel_split_matches_single_rank(kind: str, agg_mode: str) -> None:
    batch = make_batch(seed=11)
    # a shared "model": every output depends on theta, as every rank's outputs depend on the same weights
    theta = torch.zeros(3, dtype=DT, requires_grad=True)
    g = torch.Generator().manual_seed(12)
    for key in ("log_probs", "entropy", "values"):
        feats = torch.randn(*batch[key].shape, 3, generator=g, dtype=DT)
        batch[key] = batch[key] + feats @ theta
    counts = whole_counts(batch)
    single, _ = run_loss(kind, batch, slice(None), agg_mode, **counts)
    ranks = [
        run_loss(kind, batch, rows, agg_mode, **{**counts, "dp_size": 2})[0]
        for rows in ([0, 2, 4], [1, 3, 5])
    ]
    torch.testing.assert_close((ranks[0] + ranks[1]) / 2, single, atol=1e-9, rtol=1e-9)
    rank_grads = [torch.autograd.grad(r, theta, retain_graph=True)[0] for r in ranks]
    (single_grad,) = torch.autograd.grad(single, theta)
    torch.testing.assert_close((rank_grads[0] + rank_grads[1]) / 2, single_grad, atol=1e-9, rtol=1e-9)


# -------------------------------------------------------------------------------------------- errors
def test_missing_key_names_key_and_loss() -> None:
    batch = make_batch()
    model_output, data = actor_io(
        batch, slice(None), log_probs=batch["log_probs"], entropy=batch["entropy"], **whole_counts(batch)
    )
    cfg = actor_config()
    for key in (
        "advantages",
        "old_log_probs",
        "response_mask",
        "ref_log_prob",
        "dp_size",
        "batch_num_tokens",
    ):
        partial = {k: v for k, v in data.items() if k != key}
        with pytest.raises(ValueError, match=rf"ppo_loss needs data\['{key}'\]"):
            ppo_loss(config=cfg, model_output=model_output, data=partial)
    with pytest.raises(ValueError, match=r"ppo_loss needs model_output\['entropy'\]"):
        ppo_loss(config=cfg, model_output={"log_probs": batch["log_probs"]}, data=data)
    with pytest.raises(ValueError, match=r"ppo_loss needs model_output\['log_probs'\]"):
        ppo_loss(config=cfg, model_output={}, data=data)
    with pytest.raises(ValueError, match=r"ppo_loss needs config.loss_agg_mode"):
        ppo_loss(config=SimpleNamespace(), model_output=model_output, data=data)
    with pytest.raises(ValueError, match=r"value_loss needs data\['returns'\]"):
        value_loss(
            config=SimpleNamespace(cliprange_value=0.5, loss_agg_mode="token-mean"),
            model_output={"values": batch["values"]},
            data={"response_mask": batch["response_mask"], "values": batch["old_values"]},
        )
    with pytest.raises(ValueError, match=r"sft_loss needs data\['batch_num_tokens'\]"):
        sft_loss(
            model_output={"log_probs": batch["log_probs"]},
            data={"response_mask": batch["response_mask"], "dp_size": 1},
        )


def test_shape_mismatch_names_both_keys() -> None:
    batch = make_batch()
    model_output, data = actor_io(
        batch, slice(None), log_probs=batch["log_probs"], entropy=batch["entropy"], **whole_counts(batch)
    )
    data["advantages"] = data["advantages"][:, :-1]
    with pytest.raises(
        ValueError,
        match=r"data\['advantages'\] has shape \(6, 6\) but data\['response_mask'\] has shape \(6, 7\)",
    ):
        ppo_loss(config=actor_config(), model_output=model_output, data=data)
    with pytest.raises(ValueError, match=r"model_output\['log_probs'\].*data\['response_mask'\]"):
        sft_loss(model_output={"log_probs": batch["log_probs"][:3]}, data={**data, "dp_size": 1})


@pytest.mark.parametrize("kind", [*POLICY_MODES, "value", "sft"])
@pytest.mark.parametrize("agg_mode", LOSS_AGG_MODES)
def test_all_zero_mask_gives_zero_loss(kind: str, agg_mode: str) -> None:
    batch = make_batch(seed=13)
    batch["response_mask"] = torch.zeros_like(batch["response_mask"])
    for key in ("old_log_probs", "advantages", "ref_log_prob", "returns", "old_values"):
        batch[key][:, -1] = float("nan")  # padding may hold anything
    batch["log_probs"][:, -1] = -float("inf")
    inputs = leaves(batch)
    for counts in ({"dp_size": 1, "batch_num_tokens": None, "global_batch_size": None}, whole_counts(batch)):
        loss, metrics = run_loss(kind, batch, slice(None), agg_mode, **counts)
        assert float(loss.detach()) == 0.0 and loss.requires_grad
        assert all(math.isfinite(mv(metrics, k)) for k in metrics)
        for g in grads(loss, *inputs):
            assert torch.isfinite(g).all() and (g == 0).all()


def test_nan_padding_does_not_leak() -> None:
    batch = make_batch(seed=14)
    clean_inputs = leaves(batch)
    counts = whole_counts(batch)
    clean, _ = run_loss("vanilla", batch, slice(None), "token-mean", **counts)
    clean_grad = grads(clean, *clean_inputs)
    pad = ~batch["response_mask"]
    dirty = dict(batch)
    for key in ("old_log_probs", "advantages", "ref_log_prob", "rollout_is_weights"):
        dirty[key] = batch[key].masked_fill(pad, float("nan"))
    dirty_inputs = leaves(dirty)
    with torch.no_grad():
        dirty["log_probs"].masked_fill_(pad, -float("inf"))
    loss, _ = run_loss("vanilla", dirty, slice(None), "token-mean", **counts)
    assert_close(loss, clean)
    for g_dirty, g_clean in zip(grads(loss, *dirty_inputs), clean_grad, strict=True):
        assert_close(g_dirty, g_clean)


def test_unknown_names_list_the_valid_ones() -> None:
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="token-mean, token-sum, seq-mean-token-sum"):
        agg_loss(loss_mat=x, loss_mask=x.bool(), loss_agg_mode="token-median")
    with pytest.raises(ValueError, match=r"registered: .*gpg, gspo, kl_cov, sapo.*vanilla"):
        get_policy_loss_fn("ppo2")
    batch = make_batch()
    model_output, data = actor_io(
        batch, slice(None), log_probs=batch["log_probs"], entropy=batch["entropy"], **whole_counts(batch)
    )
    with pytest.raises(ValueError, match="unknown policy loss 'nope'"):
        ppo_loss(config=actor_config(policy_loss={"loss_mode": "nope"}), model_output=model_output, data=data)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        ppo_loss(config=actor_config(clip_ratio_c=1.0), model_output=model_output, data=data)


def test_kl_reward_penalty_subtracts_the_masked_kl_from_the_scores() -> None:
    from verl_engine.losses import kl_reward_penalty

    g = torch.Generator().manual_seed(11)
    scores = torch.randn((3, 5), generator=g, dtype=torch.float64)
    old = -torch.rand((3, 5), generator=g, dtype=torch.float64)
    ref = -torch.rand((3, 5), generator=g, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]])
    rewards, metrics = kl_reward_penalty(
        token_level_scores=scores, old_log_prob=old, ref_log_prob=ref, response_mask=mask, kl_coef=0.1
    )
    for i in range(3):
        for t in range(5):
            expected = scores[i, t] - 0.1 * (old[i, t] - ref[i, t]) if mask[i, t] else 0.0
            assert abs(float(rewards[i, t]) - float(expected)) < 1e-12
    kls = [float(old[i, t] - ref[i, t]) for i in range(3) for t in range(5) if mask[i, t]]
    assert abs(float(metrics["kl"].value) - sum(kls) / len(kls)) < 1e-12
    with pytest.raises(ValueError, match="old_log_prob has shape"):
        kl_reward_penalty(
            token_level_scores=scores,
            old_log_prob=old[:, :4],
            ref_log_prob=ref,
            response_mask=mask,
            kl_coef=0.1,
        )
