"""Process groups: torch.distributed from the launcher's environment, then megatron-core's groups."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from verl_config.validation import check_parallel_layout

__all__ = ["ParallelDims", "destroy_parallel", "init_parallel", "seed_cuda_rng_tracker"]


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of every parallel dimension; ``dp`` is derived and checked (like torchtitan's ParallelDims)."""

    world_size: int
    tp: int = 1
    pp: int = 1
    cp: int = 1

    def __post_init__(self) -> None:
        check_parallel_layout(
            world_size=self.world_size,
            tensor_model_parallel_size=self.tp,
            pipeline_model_parallel_size=self.pp,
            context_parallel_size=self.cp,
        )

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp * self.cp)


def init_parallel(
    *,
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    context_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: int | None = None,
    expert_model_parallel_size: int = 1,
    expert_tensor_parallel_size: int | None = None,
    device: str = "cuda",
    timeout_s: int = 600,
) -> ParallelDims:
    """Initialise torch.distributed (NCCL on CUDA, gloo on CPU) and megatron-core's parallel state.

    Reads RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT as torchrun sets them; without
    them, runs as a single process. The layout is checked before any group is created.
    ``virtual_pipeline_model_parallel_size`` (interleaved 1F1B) is the number of model chunks per stage.
    ``expert_model_parallel_size`` (EP): megatron-core carves the expert groups out of the data-parallel
    ranks, so EP x ETP must divide world / PP; ``expert_tensor_parallel_size`` (ETP, None: equal to TP) splits
    each expert's fc1 / fc2 like TP.
    """
    world_size = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    dims = ParallelDims(
        world_size=world_size,
        tp=tensor_model_parallel_size,
        pp=pipeline_model_parallel_size,
        cp=context_parallel_size,
    )
    if virtual_pipeline_model_parallel_size is not None and (
        virtual_pipeline_model_parallel_size < 2 or dims.pp < 2
    ):
        raise ValueError(
            f"virtual_pipeline_model_parallel_size={virtual_pipeline_model_parallel_size} needs"
            f" pipeline_model_parallel_size > 1 (got {dims.pp}) and a value >= 2; or set it to None"
        )
    expert_tp = expert_tensor_parallel_size or dims.tp
    if expert_model_parallel_size < 1 or (world_size // dims.pp) % (expert_model_parallel_size * expert_tp):
        raise ValueError(
            f"expert_model_parallel_size={expert_model_parallel_size} x expert_tensor_parallel_size={expert_tp}"
            f" must divide the {world_size // dims.pp} ranks of a pipeline stage (world size / PP); expert groups"
            " are carved out of them"
        )
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29512")
        os.environ.setdefault("RANK", "0")
        if device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(
            backend="nccl" if device == "cuda" else "gloo",
            world_size=world_size,
            rank=int(os.environ["RANK"]),
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=dims.tp,
        pipeline_model_parallel_size=dims.pp,
        context_parallel_size=dims.cp,
        virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
        expert_model_parallel_size=expert_model_parallel_size,
        expert_tensor_parallel_size=expert_tensor_parallel_size,
    )
    return dims


def seed_cuda_rng_tracker(*, seed: int, device: torch.device | str) -> bool:
    """Seed megatron-core's CUDA RNG tracker on a GPU, unless the trainer has seeded it; True if seeded here.

    megatron-core forks the tracker's "model-parallel-rng" state in every forward under sequence parallelism
    (the embedding's dropout) and tensor-parallel attention dropout; unseeded, the first forward fails with
    "cuda rng state model-parallel-rng is not added". Megatron trainers call
    ``model_parallel_cuda_manual_seed`` at start-up; a library engine cannot assume its caller did. Needs the
    model-parallel groups (TP / EP ranks offset the seeds). A trainer's own seeding is kept, the caller's
    default CUDA generator is left as it was (megatron-core's function reseeds it), and a CPU device leaves
    the tracker alone (it holds CUDA generator states only).
    """
    from megatron.core import tensor_parallel

    if torch.device(device).type != "cuda" or tensor_parallel.get_cuda_rng_tracker().is_initialized():
        return False
    default = torch.cuda.get_rng_state()
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    torch.cuda.set_rng_state(default)
    return True


def destroy_parallel() -> None:
    """Tear down megatron-core's groups and the default process group (safe to call twice)."""
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
