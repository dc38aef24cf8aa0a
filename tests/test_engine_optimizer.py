"""One optimizer path: megatron-core's parameter groups (no weight decay on biases and 1-D parameters such
as norm weights) on the CPU debug backend and on GPUs, with the section's weight decay on the rest."""

from __future__ import annotations

import pytest
from optimizer_workers import weight_decay_by_name

from verl_mcore_utils.testing import run_distributed


def _check(out: dict) -> None:
    decay = out["decay"]
    assert decay, "no trainable parameters"
    for name, (wd, ndim) in decay.items():
        name = name.removeprefix("module.").removeprefix("module.")
        if name.endswith(".bias") or ndim == 1:
            assert wd == 0.0, f"{name} (bias or 1-D) is decayed with {wd}"
        else:
            assert wd == pytest.approx(0.1), f"{name} has weight decay {wd}, the section says 0.1"
    assert any(w == 0.0 for w, _ in decay.values()) and any(w and w > 0 for w, _ in decay.values())


def test_cpu_optimizer_groups_follow_megatron() -> None:
    (out,) = run_distributed(weight_decay_by_name, world_size=1, args=("cpu", ["trainer.device=cpu"]))
    assert out["optimizer"] == ["AdamW"]
    _check(out)


@pytest.mark.num_gpus(1)
@pytest.mark.parametrize("distributed", [True, False], ids=["dist-opt", "plain-opt"])
def test_gpu_optimizer_groups_follow_megatron(distributed: bool) -> None:
    """The megatron optimizer's no-decay groups carry weight_decay 0 (megatron leaves wd_mult to its scheduler)."""
    overrides = ["trainer.device=cuda", f"megatron.use_distributed_optimizer={str(distributed).lower()}"]
    (out,) = run_distributed(weight_decay_by_name, world_size=1, backend="nccl", args=("cuda", overrides))
    _check(out)
