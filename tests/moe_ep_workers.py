"""Workers of tests/test_rl_engine_moe_ep_cpu.py (module level, so that run_distributed can pickle them)."""

from __future__ import annotations

import torch


def export_state(
    rank: int, world_size: int, model_dir: str, overrides: list[str]
) -> dict[str, torch.Tensor] | None:
    """The actor's Hugging Face export straight after loading (every rank iterates; rank 0 returns it)."""
    from rl_engine_workers import _engine

    engine, _ = _engine(overrides, "actor", model_dir, "cpu")
    exported = {n: t.clone() for b in engine.export_weight_buckets(bucket_bytes=1 << 20) for n, t in b}
    return exported if rank == 0 else None


def checkpoint_error(rank: int, world_size: int, model_dir: str, overrides: list[str], root: str) -> str:
    """The message loading ``root`` (model and optimizer) into the actor of ``overrides`` raises."""
    from rl_engine_workers import _engine

    from verl_engine.checkpoint_files import CheckpointError

    engine, _ = _engine(overrides, "actor", model_dir, "cpu")
    try:
        engine.load_checkpoint(root, load_optimizer=True)
    except CheckpointError as error:
        return str(error)
    raise AssertionError(f"{root} loaded into the actor of {overrides}")
