"""Rollout correction and the bypass_mode policy loss without verl: the errors a bad spec gives, the weights' and
masks' definitions on hand-made ratios, and the rejection changing which tokens count (the verl-reference parity is
test_verl_loss_parity.py)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from verl_engine.losses import (
    REJECTION_OPTIONS,
    RolloutCorrection,
    importance_weights,
    parse_is_threshold,
    parse_rejection,
    policy_loss,
    ppo_loss,
    rejection_mask,
)

DT = torch.float64
RC = "algorithm.rollout_correction"


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        (
            True,
            rf"{RC}.rollout_is_threshold must be a positive number .* or a \"lower_upper\" string .*; got True",
        ),
        ("abc", rf"{RC}.rollout_is_threshold must be a positive number .*; got 'abc'"),
        (0, rf"{RC}.rollout_is_threshold must be a positive number .*; got 0"),
        ("2.0_0.5", rf"{RC}.rollout_is_threshold: the lower bound is above the upper one in '2.0_0.5'"),
        ("0_2", rf"{RC}.rollout_is_threshold: both bounds must be positive; got '0_2'"),
        ([2.0], rf"{RC}.rollout_is_threshold must be .*; got \[2.0\]"),
    ],
)
def test_a_bad_is_threshold_names_the_key_and_the_form(spec: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_is_threshold(spec)


def test_is_threshold_forms() -> None:
    assert parse_is_threshold(2) == (None, 2.0)
    assert parse_is_threshold(" 3.5 ") == (None, 3.5)
    assert parse_is_threshold("0.5_2") == (0.5, 2.0)


@pytest.mark.parametrize(
    ("options", "thresholds", "match"),
    [
        ("token_k4", 1.0, rf"{RC}.rollout_rs has unknown option\(s\) token_k4; valid: token_k1, token_k2"),
        (" , ", 1.0, rf"{RC}.rollout_rs names no option"),
        (5, 1.0, rf"{RC}.rollout_rs must be null or a comma-separated string"),
        ("token_k2", None, rf"{RC}.rollout_rs_threshold is null but {RC}.rollout_rs='token_k2'"),
        ("token_k2", True, rf"{RC}.rollout_rs_threshold must be one threshold for all options"),
        (
            "token_k2,seq_sum_k3",
            "1,2,3",
            r"gives 3 thresholds for 2 .*rollout_rs options \(token_k2, seq_sum_k3\)",
        ),
        ("token_k2", "0.5_2.0", r"\(option token_k2\) takes one upper bound, not a range; got '0.5_2.0'"),
        (
            "seq_sum_k1",
            0.5,
            r"\(option seq_sum_k1\): one number u means the ratio range 1/u..u, so it must be >= 1",
        ),
        ("seq_mean_k1", "x_2", rf"{RC}.rollout_rs_threshold \(option seq_mean_k1\) must be .*; got 'x'"),
        ("seq_max_k3", "-1", r"\(option seq_max_k3\) must be positive; got '-1'"),
    ],
)
def test_a_bad_rejection_spec_names_the_key_and_the_form(options: Any, thresholds: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_rejection(options, thresholds)


def test_rejection_grammar() -> None:
    """One threshold is shared; repeated options count once; a k1 number u is the range 1/u..u."""
    criteria = parse_rejection("token_k1, seq_max_k2,token_k1", "4")
    assert [(c.option, c.lower, c.upper) for c in criteria] == [
        ("token_k1", 0.25, 4.0),
        ("seq_max_k2", None, 4.0),
    ]
    criteria = parse_rejection("seq_sum_k1,token_k3", "0.1_2,0.5")
    assert [(c.option, c.lower, c.upper) for c in criteria] == [
        ("seq_sum_k1", 0.1, 2.0),
        ("token_k3", None, 0.5),
    ]
    assert parse_rejection(None, None) == ()


@pytest.mark.parametrize(
    ("section", "match"),
    [
        ({"loss_type": "ppo"}, rf"{RC}.loss_type must be one of ppo_clip, reinforce; got 'ppo'"),
        (
            {"rollout_is": "seq"},
            rf"{RC}.rollout_is must be null \(no importance weights\) or one of token, sequence",
        ),
    ],
)
def test_a_bad_section_names_the_key(section: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        RolloutCorrection.from_config(section)


def test_section_defaults_are_verls() -> None:
    """A null threshold computes no weights, as in verl; the other keys default to verl's values."""
    assert RolloutCorrection.from_config({}) == RolloutCorrection()
    assert (
        RolloutCorrection.from_config({"rollout_is": "token", "rollout_is_threshold": None}).is_level is None
    )


def _ratio_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """log r per token of 3 sequences (lengths 4, 2, 0)."""
    log_ratio = torch.tensor(
        [[0.0, math.log(3.0), -0.1, 0.2], [-25.0, 0.1, 7.0, 7.0], [1.0, 1.0, 1.0, 1.0]], dtype=DT
    )
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)
    return log_ratio, mask


def test_token_weights_truncate_or_zero_and_padding_is_zero() -> None:
    log_ratio, mask = _ratio_batch()
    log_ratio = torch.where(mask, log_ratio, float("nan"))  # NaN padding must not leak
    tis, metrics = importance_weights(log_ratio=log_ratio, response_mask=mask, level="token", upper=2.0)
    want = torch.tensor(
        [[1.0, 2.0, math.exp(-0.1), math.exp(0.2)], [math.exp(-20.0), math.exp(0.1), 0, 0], [0] * 4], dtype=DT
    )
    torch.testing.assert_close(tis, want, rtol=1e-15, atol=0)
    assert float(metrics["rollout_corr/rollout_is_max"].value) == 2.0
    assert float(metrics["rollout_corr/rollout_is_ratio_fraction_high"].value) == pytest.approx(1 / 6)
    assert float(metrics["rollout_corr/rollout_is_ratio_fraction_low"].value) == pytest.approx(1 / 6)  # < 1/2
    icepop, metrics = importance_weights(
        log_ratio=log_ratio, response_mask=mask, level="token", upper=2.0, lower=0.95
    )
    assert icepop[0, 1] == 0 and icepop[0, 2] == 0 and icepop[1, 0] == 0 and icepop[0, 3] == tis[0, 3]
    assert float(metrics["rollout_corr/rollout_is_oob_ratio"].value) == pytest.approx(3 / 6)


def test_sequence_weights_are_the_product_on_every_token_and_normalise_to_mean_one() -> None:
    log_ratio, mask = _ratio_batch()
    weights, _ = importance_weights(log_ratio=log_ratio, response_mask=mask, level="sequence", upper=5.0)
    first = math.exp(math.log(3.0) + 0.1)
    torch.testing.assert_close(weights[0], torch.full((4,), first, dtype=DT), rtol=1e-15, atol=0)
    torch.testing.assert_close(
        weights[1, :2], torch.full((2,), math.exp(-20.0), dtype=DT), rtol=1e-15, atol=0
    )
    assert not weights[1, 2:].any() and not weights[2].any()
    normalised, metrics = importance_weights(
        log_ratio=log_ratio, response_mask=mask, level="sequence", upper=5.0, batch_normalize=True
    )
    factor = (first + math.exp(-20.0)) / 2  # the mean over the two non-empty sequences
    assert float(metrics["rollout_corr/rollout_is_batch_norm_factor"].value) == pytest.approx(
        factor, rel=1e-15
    )
    torch.testing.assert_close(normalised, weights / factor, rtol=1e-15, atol=0)


@pytest.mark.parametrize(
    ("options", "threshold", "kept"),
    [
        ("token_k2", 0.5, [[1, 0, 1, 1], [0, 1, 0, 0]]),  # (log 3)^2/2 = 0.60 and the clamped 20^2/2 fail
        ("token_k1", "0.5_2.0", [[1, 0, 1, 1], [0, 1, 0, 0]]),  # -log r within [log 0.5, log 2]
        ("seq_sum_k1", 4.0, [[1, 1, 1, 1], [0, 0, 0, 0]]),  # sums of -log r: -1.2 and 19.9 (clamped -25)
        ("seq_sum_k1", 2.0, [[0, 0, 0, 0], [0, 0, 0, 0]]),  # -1.2 < log(1/2)
        ("seq_mean_k3", 0.25, [[1, 1, 1, 1], [0, 0, 0, 0]]),  # means 0.23 and 9.5
        ("seq_max_k2", 0.7, [[1, 1, 1, 1], [0, 0, 0, 0]]),
        ("seq_max_k2", 0.5, [[0, 0, 0, 0], [0, 0, 0, 0]]),
        ("token_k3,seq_sum_k2", "0.5,0.7", [[1, 0, 1, 1], [0, 0, 0, 0]]),
    ],
)
def test_rejection_keeps_the_tokens_every_option_passes(options: str, threshold: Any, kept: list) -> None:
    log_ratio, mask = _ratio_batch()
    keep, metrics = rejection_mask(
        log_ratio=log_ratio, response_mask=mask, criteria=parse_rejection(options, threshold)
    )
    want = torch.tensor([*kept, [0, 0, 0, 0]], dtype=torch.bool)
    assert torch.equal(keep, want), keep
    assert float(metrics["rollout_corr/rollout_rs_masked_fraction"].value) == pytest.approx(
        1 - want.sum() / 6
    )
    rows_hit = sum(bool((mask[i] & ~want[i]).any()) for i in range(3))
    assert float(metrics["rollout_corr/rollout_rs_seq_masked_fraction"].value) == pytest.approx(rows_hit / 3)


def _bypass_config(**correction: Any) -> dict[str, Any]:
    return {
        "clip_ratio": 0.2,
        "clip_ratio_low": 0.2,
        "clip_ratio_high": 0.28,
        "clip_ratio_c": 3.0,
        "loss_agg_mode": "token-mean",
        "entropy_coeff": 0.0,
        "use_kl_loss": False,
        "policy_loss": {"loss_mode": "bypass_mode", "rollout_correction": correction},
    }


def _loss_batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(4, 5, generator=g, dtype=DT) * 2
    log_prob = old + torch.randn(4, 5, generator=g, dtype=DT) * 0.1
    log_prob[0, 1] = old[0, 1] + 3.0  # the one token token_k2 < 1 rejects
    return {
        "log_prob": log_prob,
        "old_log_prob": old,
        "advantages": torch.randn(4, 5, generator=g, dtype=DT),
        "response_mask": torch.tensor(
            [[1, 1, 1, 1, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]], dtype=torch.bool
        ),
    }


def _bypass(
    batch: dict[str, torch.Tensor],
    config: dict,
    *,
    agg: str = "token-mean",
    rows: slice = slice(None),
    dp: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, dict]:
    mask = batch["response_mask"]
    log_prob = batch["log_prob"].clone().requires_grad_(True)
    loss, metrics = policy_loss(
        loss_mode=config["policy_loss"]["loss_mode"],
        log_prob=log_prob[rows],
        old_log_prob=batch["old_log_prob"][rows],
        advantages=batch["advantages"][rows],
        response_mask=mask[rows],
        loss_agg_mode=agg,
        config=config,
        agg_kwargs={
            "dp_size": dp,
            "batch_num_tokens": int(mask.sum()),
            "global_batch_size": mask.shape[0],
            "loss_scale_factor": None,
        },
    )
    (grad,) = torch.autograd.grad(loss, log_prob)
    return loss.detach(), grad, metrics


def test_a_rejected_token_adds_nothing_but_still_counts_in_the_token_mean() -> None:
    """verl 0.9.1 counts batch_num_tokens before the loss, so the denominator keeps the rejected token."""
    batch = _loss_batch()
    cfg = _bypass_config(loss_type="reinforce", rollout_rs="token_k2", rollout_rs_threshold=1.0)
    loss, grad, metrics = _bypass(batch, cfg)
    kept = batch["response_mask"].clone()
    kept[0, 1] = False
    tokens = int(batch["response_mask"].sum())
    want = -(batch["advantages"] * batch["log_prob"])[kept].sum() / tokens
    assert float(loss) == pytest.approx(float(want), rel=1e-14)
    assert grad[0, 1] == 0
    torch.testing.assert_close(grad[kept], -batch["advantages"][kept] / tokens, rtol=1e-14, atol=0)
    assert float(metrics["rollout_corr/rollout_rs_masked_fraction"].value) == pytest.approx(1 / tokens)
    assert float(metrics["rollout_corr/rollout_rs_seq_masked_fraction"].value) == pytest.approx(1 / 4)
    plain, _, _ = _bypass(batch, _bypass_config(loss_type="reinforce"))
    assert float(plain) != pytest.approx(float(loss))


def test_a_rejected_sequence_still_counts_in_the_sequence_mean() -> None:
    batch = _loss_batch()
    cfg = _bypass_config(loss_type="reinforce", rollout_rs="seq_max_k2", rollout_rs_threshold=1.0)
    loss, grad, _ = _bypass(batch, cfg, agg="seq-mean-token-mean")
    mask = batch["response_mask"]
    per_token = -(batch["advantages"] * batch["log_prob"])
    want = sum(float(per_token[i][mask[i]].mean()) for i in (1, 2, 3)) / 4
    assert float(loss) == pytest.approx(want, rel=1e-14)
    assert not grad[0].any()


def test_ppo_clip_on_the_kept_tokens_is_vanilla_over_them() -> None:
    """With ppo_clip the weights feed metrics only: the loss is vanilla PPO restricted to the rejection's mask."""
    batch = _loss_batch()
    cfg = _bypass_config(
        loss_type="ppo_clip",
        rollout_is="token",
        rollout_is_threshold=1.5,
        rollout_rs="token_k2",
        rollout_rs_threshold=1.0,
    )
    loss, grad, metrics = _bypass(batch, cfg)
    kept = {**batch, "response_mask": batch["response_mask"].clone()}
    kept["response_mask"][0, 1] = False
    vanilla = {**cfg, "policy_loss": {"loss_mode": "vanilla"}}
    log_prob = batch["log_prob"].clone().requires_grad_(True)
    want, want_metrics = policy_loss(
        loss_mode="vanilla",
        log_prob=log_prob,
        old_log_prob=batch["old_log_prob"],
        advantages=batch["advantages"],
        response_mask=kept["response_mask"],
        loss_agg_mode="token-mean",
        config=vanilla,
        agg_kwargs={
            "dp_size": 1,
            "batch_num_tokens": int(batch["response_mask"].sum()),
            "global_batch_size": 4,
        },
    )
    (want_grad,) = torch.autograd.grad(want, log_prob)
    assert float(loss) == float(want.detach()) and torch.equal(grad, want_grad)
    for key in ("actor/pg_clipfrac", "actor/ppo_kl"):
        assert float(metrics[key].value) == float(want_metrics[key].value)
    assert 0 < float(metrics["rollout_corr/rollout_is_mean"].value) < 1.5


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "token-sum"])
def test_bypass_steps_agree_for_whole_batch_micro_batches_and_two_ranks(agg: str) -> None:
    batch = _loss_batch()
    cfg = _bypass_config(
        loss_type="reinforce",
        rollout_is="sequence",
        rollout_is_threshold="0.5_3.0",
        rollout_rs="token_k2,seq_mean_k1",
        rollout_rs_threshold="1.0,1.5",
    )
    loss, grad, _ = _bypass(batch, cfg, agg=agg)
    parts = [_bypass(batch, cfg, agg=agg, rows=r) for r in (slice(0, 1), slice(1, 3), slice(3, 4))]
    shards = [_bypass(batch, cfg, agg=agg, rows=r, dp=2) for r in (slice(0, 2), slice(2, 4))]
    assert float(sum(p[0] for p in parts)) == pytest.approx(float(loss), rel=1e-14)
    torch.testing.assert_close(sum(p[1] for p in parts), grad, rtol=1e-14, atol=1e-17)
    assert float(sum(s[0] for s in shards) / 2) == pytest.approx(float(loss), rel=1e-14)
    torch.testing.assert_close(sum(s[1] for s in shards) / 2, grad, rtol=1e-14, atol=1e-17)


def test_ppo_loss_runs_bypass_mode_and_ignores_the_batchs_weights() -> None:
    """The actor loss reads policy_loss.rollout_correction from its config; bypass_mode computes its own weights, so
    data['rollout_is_weights'] (the decoupled mode's) changes nothing, as in verl."""
    batch = _loss_batch()
    cfg = _bypass_config(
        loss_type="reinforce", rollout_is="token", rollout_rs="token_k2", rollout_rs_threshold=1.0
    )
    data = {
        "response_mask": batch["response_mask"],
        "old_log_probs": batch["old_log_prob"],
        "advantages": batch["advantages"],
        "dp_size": 1,
        "batch_num_tokens": int(batch["response_mask"].sum()),
        "global_batch_size": 4,
    }
    loss, metrics = ppo_loss(config=cfg, model_output={"log_probs": batch["log_prob"]}, data=data)
    weighted, _ = ppo_loss(
        config=cfg,
        model_output={"log_probs": batch["log_prob"]},
        data={**data, "rollout_is_weights": torch.full_like(batch["log_prob"], 7.0)},
    )
    assert float(loss) == float(weighted)
    assert {
        "rollout_corr/rollout_is_mean",
        "rollout_corr/rollout_rs_masked_fraction",
        "rollout_corr/kl",
    } <= set(metrics)


def test_an_empty_micro_batch_gives_zero_loss_and_finite_metrics() -> None:
    """verl raises on a batch without a valid token; a micro-batch of empty responses is 0 here, as for every loss."""
    batch = {**_loss_batch(), "response_mask": torch.zeros(4, 5, dtype=torch.bool)}
    cfg = _bypass_config(
        loss_type="reinforce", rollout_is="sequence", rollout_rs="seq_max_k3", rollout_rs_threshold=1.0
    )
    loss, grad, metrics = _bypass(batch, cfg)
    assert float(loss) == 0 and not grad.any()
    assert all(math.isfinite(float(m.value)) for m in metrics.values()), metrics


def test_bypass_mode_without_its_section_says_where_it_comes_from() -> None:
    batch = _loss_batch()
    cfg = {**_bypass_config(), "policy_loss": {"loss_mode": "bypass_mode"}}
    with pytest.raises(
        ValueError, match=r"needs config.policy_loss.rollout_correction \(verl's trainer copies"
    ):
        _bypass(batch, cfg)


def test_every_rejection_option_is_reachable_from_the_grammar() -> None:
    for option in REJECTION_OPTIONS:
        (criterion,) = parse_rejection(option, 2.0)
        assert criterion.option == option and (criterion.lower is not None) == option.endswith("k1")


def test_the_grpo_demo_refuses_bypass_mode(tmp_path: Any) -> None:
    """Its rollout returns no log-probs, so it recomputes the old ones: bypass mode would not be verl's."""
    from verl_config import ConfigError
    from verl_engine.apps.grpo_run import GRPORun, run_grpo

    run = GRPORun(out_dir=str(tmp_path), overrides=[f"{RC}.bypass_mode=true"])
    with pytest.raises(ConfigError, match=rf"{RC}.bypass_mode=true takes the rollout's log-probs"):
        run_grpo(run, workers=object())  # type: ignore[arg-type]
