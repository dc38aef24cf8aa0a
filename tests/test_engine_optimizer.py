"""One optimizer path: megatron-core's parameter groups (no weight decay on biases and 1-D parameters such
as norm weights) on the CPU debug backend and on GPUs, with the section's weight decay on the rest."""

from __future__ import annotations

import pytest
from optimizer_workers import weight_decay_groups

from verl_mcore_utils.testing import run_distributed


def _check(out: dict) -> None:
    assert any(n.endswith("layernorm.weight") for n in out["exempt_names"]), out["exempt_names"]
    by_decay: dict[float, int] = {}
    for wd, numel in out["groups"]:
        assert wd == 0.0 or wd == pytest.approx(0.1), f"a group has weight decay {wd}; the section says 0.1"
        by_decay[0.0 if wd == 0.0 else 0.1] = by_decay.get(0.0 if wd == 0.0 else 0.1, 0) + numel
    assert by_decay.get(0.0, 0) == out["exempt"], (by_decay, out["exempt"])  # biases and norms: no decay
    assert by_decay.get(0.1, 0) == out["decayed"], (by_decay, out["decayed"])


def test_cpu_optimizer_groups_follow_megatron() -> None:
    (out,) = run_distributed(weight_decay_groups, world_size=1, args=("cpu", ["trainer.device=cpu"]))
    assert out["optimizer"] == ["AdamW"]
    _check(out)


@pytest.mark.num_gpus(1)
@pytest.mark.parametrize("distributed", [True, False], ids=["dist-opt", "plain-opt"])
def test_gpu_optimizer_groups_follow_megatron(distributed: bool) -> None:
    """megatron leaves wd_mult to its own scheduler; the engine applies it, so no-decay groups carry 0."""
    overrides = ["trainer.device=cuda", f"megatron.use_distributed_optimizer={str(distributed).lower()}"]
    (out,) = run_distributed(weight_decay_groups, world_size=1, backend="nccl", args=("cuda", overrides))
    _check(out)
