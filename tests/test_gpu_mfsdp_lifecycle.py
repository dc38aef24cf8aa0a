"""GPU, 2 ranks: the Megatron-FSDP lifecycle of verl-mfsdp (multi-chunk sync, offload, export, checkpoint).

Equalities are exact (torch.equal / float ==), not tolerances: each comparison is between two states
that must hold the same bits (a restored buffer, a weight and its own cast, two runs from the same
state on the same data and kernels).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from mfsdp_lifecycle_workers import (
    checkpoint_run,
    export_weights,
    offload_cycle,
    random_hf_weights,
    two_chunk_sync,
)
from verl_mcore_utils.testing import run_distributed

pytestmark = pytest.mark.num_gpus(2)


def _run(fn, *args):
    return run_distributed(fn, world_size=2, backend="nccl", args=args, timeout_s=200)


def test_every_chunk_is_synchronised_and_first_chunk_only_sync_is_caught() -> None:
    """Two Megatron-FSDP chunks: after synchronize_megatron_fsdp_params both expose the trained weights.

    Reference: the optimizer's fp32 main-weight shards, gathered and cast to bf16. verl's first-chunk-only
    sync (a local buggy copy in the worker) leaves chunk 2 stale: the same check fails for it.
    """
    out = _run(two_chunk_sync, 3)[0]
    print("two-chunk", out)
    assert out["synced"] == 2
    assert all(n > 0 for n in out["num_params"])
    assert all(c > 0 for c in out["changed"]), "training must change the weights for staleness to be visible"
    assert [r["equal"] for r in out["fixed"]] == [True, True], out["fixed"]
    assert all(r["plain"] == 0 for r in out["fixed"])
    # The bug: chunk 1 fine, chunk 2 stale (plain un-synchronised parameters, old or released weights).
    assert out["buggy_synced"] == 1
    assert out["buggy"][0]["equal"] is True
    assert out["buggy"][1]["equal"] is False
    assert out["buggy"][1]["mismatched"] + out["buggy"][1]["unmaterialised"] > 0
    assert all(x == x and abs(x) < float("inf") for x in out["losses"])


def test_offload_onload_is_bitwise_frees_memory_and_training_continues() -> None:
    res = _run(offload_cycle)
    for rank, out in enumerate(res):
        print("offload rank", rank, out)
        for cycle in out["cycles"]:
            assert cycle["bitwise"] == {"params": True, "grads": True, "optimizer": True}, cycle
            assert set(cycle["bytes_by_kind"]) == {"params", "grads", "optimizer"}
            assert all(b > 0 for b in cycle["bytes_by_kind"].values())
            assert cycle["onloaded_bytes"] == cycle["offloaded_bytes"]
            assert cycle["freed_bytes"] >= 0.9 * cycle["offloaded_bytes"], cycle
        # Host buffers are allocated once and reused by the second cycle.
        assert out["cycles"][0]["host_bytes_allocated"] > 0
        assert out["cycles"][1]["host_bytes_allocated"] == 0
        assert out["losses"] == out["ref_losses"], (out["losses"], out["ref_losses"])


def test_export_equals_loaded_hf_weights() -> None:
    weights = random_hf_weights(1234)
    out = _run(export_weights, weights)[0]
    names = out["expected_names"]
    assert names == sorted(weights)
    for strategy in ("optim_grads_params", "optim"):
        res = out[strategy]
        print(strategy, {k: (len(v) if isinstance(v, list) else v) for k, v in res.items()})
        assert res["names"] == names
        assert res["unequal"] == []
        assert res["dtypes"] == ["torch.bfloat16"]
    assert out["ddp_names"] == names
    assert out["ddp_vs_fsdp_unequal"] == []


def test_checkpoint_resume_is_exact(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    total, save_after = 5, 3
    a = _run(checkpoint_run, path, "save", total, save_after)
    b = _run(checkpoint_run, path, "load", total, save_after)
    print("uninterrupted", a[0]["losses"], "resumed", b[0]["losses"])
    assert (tmp_path / "ckpt" / ".metadata").is_file()
    for rank in range(2):
        assert b[rank]["info"] == {"step": save_after, "extra": {"consumed_samples": 8 * save_after}}
        # Bitwise: the same float on steps 4 and 5.
        assert b[rank]["losses"] == a[rank]["losses"][save_after:], (b[rank]["losses"], a[rank]["losses"])
        # Step counters restored: every parameter with a local shard has taken all 5 steps; entries of
        # empty shards (created for DCP, unused by Adam) match the uninterrupted run's.
        assert b[rank]["adam_steps"] == a[rank]["adam_steps"] == [float(total)]
        assert b[rank]["adam_steps_empty_shard"] == a[rank]["adam_steps_empty_shard"]
        assert (
            "_missing" in b[rank]["missing_error"]
            and "no Megatron-FSDP checkpoint" in b[rank]["missing_error"]
        )
        assert (
            "data_parallel_sharding_strategy" in b[rank]["layout_error"] and path in b[rank]["layout_error"]
        )
