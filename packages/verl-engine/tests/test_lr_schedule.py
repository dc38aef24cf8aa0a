"""LR schedules of verl-engine: hand-computed values, megatron-core's own scheduler, verl's LambdaLR formulas."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from verl_config.engines import FSDPOptimConfig, McoreOptimConfig
from verl_engine.lr_schedule import LRSchedule, lr_schedule_from_config


def sgd(*, lr_mults: tuple[float, ...] = (1.0,)) -> torch.optim.SGD:
    """A CPU optimizer with one param group per lr multiplier."""
    groups = [{"params": [torch.nn.Parameter(torch.zeros(2))], "lr_mult": m} for m in lr_mults]
    return torch.optim.SGD(groups, lr=0.0)


# --------------------------------------------------------------------------------------- megatron style
def test_megatron_hand_values() -> None:
    """lr 1.0, warm-up 0.1 -> 1.0 over 4 steps, decay to 0.2 at step 12, min_lr after."""
    kw = {"lr": 1.0, "lr_warmup_init": 0.1, "lr_warmup_steps": 4, "min_lr": 0.2, "lr_decay_steps": 12}
    linear = lr_schedule_from_config(McoreOptimConfig(lr_decay_style="linear", **kw), total_training_steps=20)
    cosine = lr_schedule_from_config(McoreOptimConfig(lr_decay_style="cosine", **kw), total_training_steps=20)
    constant = lr_schedule_from_config(McoreOptimConfig(lr_decay_style="constant", **kw))
    for sched in (linear, cosine, constant):
        assert sched.lr_at(0) == pytest.approx(0.1)
        assert sched.lr_at(2) == pytest.approx(0.55)  # 0.1 + 0.9 * 2 / 4
        assert sched.lr_at(4) == pytest.approx(1.0)  # megatron: still warm-up at step == warmup
    assert linear.lr_at(8) == pytest.approx(0.6)  # 0.2 + 0.8 * (1 - 4/8)
    assert linear.lr_at(12) == pytest.approx(0.2)
    assert cosine.lr_at(6) == pytest.approx(0.2 + 0.8 * 0.5 * (1 + math.cos(math.pi / 4)))
    assert cosine.lr_at(8) == pytest.approx(0.6)
    for sched in (linear, cosine):
        assert sched.lr_at(13) == sched.lr_at(100) == pytest.approx(0.2)
    assert constant.lr_at(5) == constant.lr_at(1000) == 1.0


@pytest.mark.parametrize("style", ["constant", "linear", "cosine"])
@pytest.mark.parametrize(
    "setting",
    [
        {"lr_warmup_steps": 5, "lr_warmup_init": 1e-5, "min_lr": 1e-5, "lr_decay_steps": 30},
        {"lr_warmup_steps": -1, "lr_warmup_steps_ratio": 0.1, "min_lr": 0.0},  # ratio of the decay steps
        {"lr_warmup_steps": None, "lr_warmup_steps_ratio": 0.0, "min_lr": 2e-5, "lr_decay_steps": 25},
    ],
)
def test_megatron_matches_optimizer_param_scheduler(style: str, setting: dict) -> None:
    cfg = McoreOptimConfig(lr=1e-4, lr_decay_style=style, total_training_steps=40, **setting)
    ours = lr_schedule_from_config(cfg)
    # verl's get_megatron_optimizer_param_scheduler arguments
    decay_steps = cfg.lr_decay_steps if cfg.lr_decay_steps is not None else cfg.total_training_steps
    warmup = cfg.lr_warmup_steps
    if warmup is None or warmup <= 0:
        warmup = int(cfg.lr_warmup_steps_ratio * decay_steps)
    theirs_opt = sgd()
    theirs = OptimizerParamScheduler(
        theirs_opt,
        init_lr=cfg.lr_warmup_init,
        max_lr=cfg.lr,
        min_lr=cfg.min_lr,
        lr_warmup_steps=warmup,
        lr_decay_steps=decay_steps,
        lr_decay_style=style,
        start_wd=0.0,
        end_wd=0.0,
        wd_incr_steps=cfg.total_training_steps,
        wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=False,
        override_opt_param_scheduler=True,
    )
    ours_opt = sgd()
    assert ours.apply(ours_opt) == pytest.approx(theirs_opt.param_groups[0]["lr"], rel=1e-12, abs=0)
    for _ in range(45):  # past lr_decay_steps
        theirs.step(1)
        lr = ours.step(ours_opt)
        assert lr == pytest.approx(theirs_opt.param_groups[0]["lr"], rel=1e-12, abs=0)
        assert ours_opt.param_groups[0]["lr"] == lr


# ------------------------------------------------------------------------------------------ FSDP style
def verl_lambda(
    step: int, *, warmup: int, total: int, style: str, min_lr_ratio: float, num_cycles: float
) -> float:
    """verl's get_constant_schedule_with_warmup / get_cosine_schedule_with_warmup factor (zero-indexed)."""
    if step < warmup:
        return step / max(1, warmup)
    if style == "constant":
        return 1.0
    progress = (step - warmup) / max(1, total - warmup)
    coef, intercept = (1 - min_lr_ratio) * 0.5, (1 + min_lr_ratio) * 0.5
    return max(min_lr_ratio, math.cos(math.pi * num_cycles * 2.0 * progress) * coef + intercept)


def test_fsdp_hand_values() -> None:
    constant = lr_schedule_from_config(FSDPOptimConfig(lr=1.0, lr_warmup_steps=4))
    assert [constant.lr_at(s) for s in (0, 2, 4, 50)] == [0.0, 0.5, 1.0, 1.0]
    cfg = FSDPOptimConfig(lr=2.0, lr_scheduler_type="cosine", lr_warmup_steps=2, min_lr_ratio=0.1)
    cosine = lr_schedule_from_config(cfg, total_training_steps=10)
    assert cosine.lr_at(1) == pytest.approx(1.0)  # 2.0 * 1/2
    assert cosine.lr_at(2) == pytest.approx(2.0)
    assert cosine.lr_at(6) == pytest.approx(2.0 * 0.55)  # progress 1/2: cos(pi/2) = 0 -> (1 + 0.1) / 2
    assert cosine.lr_at(10) == pytest.approx(2.0 * 0.1)  # min_lr_ratio at the end
    full = lr_schedule_from_config(
        FSDPOptimConfig(lr=1.0, lr_scheduler_type="cosine", min_lr_ratio=None, num_cycles=1.0),
        total_training_steps=8,
    )
    assert full.lr_at(4) == pytest.approx(0.0)  # one whole cycle: minimum half-way (min_lr_ratio None -> 0)
    assert full.lr_at(8) == pytest.approx(1.0)


@pytest.mark.parametrize("style", ["constant", "cosine"])
@pytest.mark.parametrize("min_lr_ratio", [0.0, 0.25])
@pytest.mark.parametrize("warmup", [-1, 3])
def test_fsdp_matches_verl_formula(style: str, min_lr_ratio: float, warmup: int) -> None:
    cfg = FSDPOptimConfig(
        lr=3e-5,
        lr_scheduler_type=style,
        lr_warmup_steps=warmup,
        lr_warmup_steps_ratio=0.2,
        min_lr_ratio=min_lr_ratio,
        num_cycles=0.5,
    )
    ours = lr_schedule_from_config(cfg, total_training_steps=20)
    resolved = warmup if warmup > 0 else int(0.2 * 20)
    assert ours.warmup_steps == resolved
    for step in range(25):
        want = 3e-5 * verl_lambda(
            step, warmup=resolved, total=20, style=style, min_lr_ratio=min_lr_ratio, num_cycles=0.5
        )
        assert ours.lr_at(step) == pytest.approx(want, rel=1e-12, abs=1e-20)


def test_fsdp_deprecated_warmup_style_and_one_indexed_steps() -> None:
    cfg = SimpleNamespace(
        lr=1.0,
        lr_scheduler_type="constant",
        warmup_style="cosine",
        lr_warmup_steps=0,
        lr_warmup_steps_ratio=0.0,
        min_lr_ratio=0.0,
        num_cycles=0.5,
        total_training_steps=4,
        zero_indexed_step=False,
    )
    sched = lr_schedule_from_config(cfg)
    assert sched.decay_style == "cosine"
    assert sched.lr_at(1) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.5)))  # step counted as 2 of 4


# ------------------------------------------------------------------------------ warm-up and total steps
def test_warmup_and_total_resolution() -> None:
    # None and -1 (and 0, as in verl) fall back to the ratio; a positive count wins
    for steps in (None, -1, 0):
        cfg = FSDPOptimConfig(lr_warmup_steps=steps, lr_warmup_steps_ratio=0.25)
        assert lr_schedule_from_config(cfg, total_training_steps=10).warmup_steps == 2
    assert (
        lr_schedule_from_config(FSDPOptimConfig(lr_warmup_steps=7, lr_warmup_steps_ratio=0.25)).warmup_steps
        == 7
    )
    # optim.total_training_steps wins over the argument when set
    cfg = FSDPOptimConfig(lr_scheduler_type="cosine", total_training_steps=30)
    assert lr_schedule_from_config(cfg, total_training_steps=10).decay_steps == 30
    assert (
        lr_schedule_from_config(
            FSDPOptimConfig(lr_scheduler_type="cosine"), total_training_steps=10
        ).decay_steps
        == 10
    )
    # megatron: the ratio applies to lr_decay_steps when given (verl)
    cfg = McoreOptimConfig(lr_decay_style="linear", lr_warmup_steps_ratio=0.5, lr_decay_steps=8)
    assert lr_schedule_from_config(cfg, total_training_steps=100).warmup_steps == 4
    # a constant schedule with an explicit warm-up needs no total
    assert lr_schedule_from_config(McoreOptimConfig(lr_warmup_steps=3)).lr_at(10) == McoreOptimConfig().lr


def test_errors_name_the_keys() -> None:
    with pytest.raises(ValueError, match="total_training_steps"):
        lr_schedule_from_config(FSDPOptimConfig(lr_scheduler_type="cosine"))
    with pytest.raises(ValueError, match="total_training_steps"):
        lr_schedule_from_config(McoreOptimConfig(lr_decay_style="cosine"))
    with pytest.raises(ValueError, match="lr_warmup_steps_ratio.*total_training_steps"):
        lr_schedule_from_config(FSDPOptimConfig(lr_warmup_steps_ratio=0.1))
    with pytest.warns(UserWarning, match="min_lr"):  # verl_config only notes it; megatron-core asserts
        too_high = McoreOptimConfig(lr=1e-5, min_lr=1e-4)
    with pytest.raises(ValueError, match="min_lr"):
        lr_schedule_from_config(too_high, total_training_steps=10)
    with pytest.raises(ValueError, match="lr_warmup_init"):
        lr_schedule_from_config(McoreOptimConfig(lr=1e-5, lr_warmup_init=1e-4), total_training_steps=10)
    with pytest.raises(ValueError, match=r"lr_warmup_steps \(10\) must be below lr_decay_steps \(10\)"):
        lr_schedule_from_config(
            McoreOptimConfig(lr_decay_style="linear", lr_warmup_steps=10), total_training_steps=10
        )
    for style in ("WSD", "inverse-square-root"):
        with pytest.raises(NotImplementedError, match=f"lr_decay_style='{style}'"):
            lr_schedule_from_config(
                McoreOptimConfig(lr_decay_style=style, lr_wsd_decay_steps=2), total_training_steps=10
            )
    with pytest.raises(ValueError, match="lr_decay_style.*lr_scheduler_type"):
        lr_schedule_from_config(SimpleNamespace(lr=1.0))
    with pytest.raises(ValueError, match="step must be >= 0"):
        LRSchedule(flavor="fsdp", decay_style="constant", lr=1.0).lr_at(-1)


# ------------------------------------------------------------------------------- optimizer and state
def test_step_writes_every_group_with_lr_mult_and_resumes() -> None:
    cfg = McoreOptimConfig(lr=1.0, lr_decay_style="linear", lr_warmup_steps=2, total_training_steps=10)
    sched = lr_schedule_from_config(cfg)
    opt = sgd(lr_mults=(1.0, 0.5))
    assert sched.apply(opt) == 0.0
    lrs = [sched.step(opt) for _ in range(3)]
    assert lrs == pytest.approx([0.5, 1.0, 1.0 - 1 / 8])
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([lrs[-1], 0.5 * lrs[-1]])
    state = sched.state_dict()
    resumed = lr_schedule_from_config(cfg)
    resumed.load_state_dict(state)
    opt2 = sgd()
    assert resumed.apply(opt2) == sched.lr_at(3) and resumed.num_steps == 3
    assert resumed.step(opt2) == sched.step(opt)
    with pytest.raises(ValueError, match="num_steps"):
        resumed.load_state_dict({"num_steps": -1})


def test_tensor_lr_is_filled_in_place() -> None:
    param = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.Adam([param], lr=torch.tensor(0.0))
    sched = lr_schedule_from_config(FSDPOptimConfig(lr=0.3))
    lr_tensor = opt.param_groups[0]["lr"]
    sched.step(opt)
    assert opt.param_groups[0]["lr"] is lr_tensor and float(lr_tensor) == pytest.approx(0.3)
