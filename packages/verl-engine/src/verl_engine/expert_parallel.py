"""Expert parallelism (EP) in the engine: which layouts it runs, refused by name before anything is built.

Where the expert groups come from: megatron-core carves them out of the data-parallel ranks (its expert rank
generator has no CP dimension: ``expert data parallel = world / (ETP x EP x PP)``). The engine builds the
model at CP 1 and verl-dyncp runs context parallelism (static or dynamic) over the whole DP x CP pool, so
megatron-core's data-parallel group *is* that pool and the EP groups are consecutive ranks of it. That is
the right pool: every rank of it holds different tokens of the step (other sequences, or other pieces of
them), which is what expert parallelism distributes; the routers' statistics are already over the pool
(:mod:`verl_engine.moe`), whatever the EP size. Gradients: an expert receives the gradient of every token
its EP group dispatched to it, so it is summed over the expert-data-parallel group only and divided by the
pool, megatron-core's DDP rule (``allreduce=False`` parameters), which the CPU backend follows too.

Dispatch: on CUDA megatron-core's all-to-all dispatcher; on the CPU its all-gather dispatcher with gloo
collectives (:mod:`verl_mcore_utils.moe_dispatch`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

__all__ = ["check_expert_parallel"]

_KEY = "megatron.expert_model_parallel_size"


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))


def check_expert_parallel(engine: Any, *, hf: Mapping[str, Any], model_name: str) -> None:
    """Raise (ValueError / NotImplementedError naming the key and the fix) unless this role's EP size runs
    here; nothing to check at EP 1."""
    from verl_mcore_utils.transformer_config import MOE_MODEL_TYPES, hf_num_experts

    ep = int(engine.expert_model_parallel_size)
    if ep == 1:
        return
    if ep < 1:
        raise ValueError(f"{_KEY}={ep} must be >= 1")
    if hf.get("model_type") not in MOE_MODEL_TYPES:
        raise ValueError(
            f"{_KEY}={ep} with the dense model {model_name}: expert parallelism needs a mixture-of-experts model"
            f" ({', '.join(MOE_MODEL_TYPES)}); set {_KEY}=1"
        )
    experts = hf_num_experts(hf)
    if experts % ep:
        raise ValueError(
            f"{_KEY}={ep} does not divide the {experts} experts of {model_name}; every EP rank holds the same"
            f" number of experts: choose a divisor of {experts}"
        )
    problems = []
    if engine.pipeline_model_parallel_size > 1:
        problems.append(
            f"{_KEY}={ep} with megatron.pipeline_model_parallel_size={engine.pipeline_model_parallel_size}:"
            f" expert parallelism with pipeline stages is not supported yet; set {_KEY}=1 or"
            " pipeline_model_parallel_size=1"
        )
    if engine.tensor_model_parallel_size > 1:
        problems.append(
            f"{_KEY}={ep} with megatron.tensor_model_parallel_size={engine.tensor_model_parallel_size}:"
            " mixture-of-experts models run at TP 1 so far; set tensor_model_parallel_size=1"
        )
    if engine.use_megatron_fsdp:
        problems.append(
            f"{_KEY}={ep} with megatron.use_megatron_fsdp=true is not supported yet; set use_megatron_fsdp=false"
        )
    if problems:
        raise NotImplementedError(f"model {model_name}: " + "; ".join(problems))
    pool = _world_size() // (engine.tensor_model_parallel_size * engine.pipeline_model_parallel_size)
    if pool % ep:
        raise ValueError(
            f"{_KEY}={ep} does not divide the {pool} ranks of the DP x CP pool (world size / (TP x PP)); the"
            f" expert groups are carved out of that pool: choose a divisor of {pool} or change the world size"
        )
