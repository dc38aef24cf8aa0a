"""Expert parallelism (EP) and expert tensor parallelism (ETP) in the engine: which layouts it runs, refused by
name before anything is built.

Where the expert groups come from: megatron-core carves them out of the data-parallel ranks (its expert rank
generator has no CP dimension: ``expert data parallel = world / (ETP x EP x PP)``). The engine builds the
model at CP 1 and verl-dyncp runs context parallelism (static or dynamic) over the whole DP x CP pool, so
megatron-core's data-parallel group *is* that pool and the EP groups are consecutive ranks of it. That is
the right pool: every rank of it holds different tokens of the step (other sequences, or other pieces of
them), which is what expert parallelism distributes; the routers' statistics are already over the pool
(:mod:`verl_engine.moe`), whatever the EP size. Gradients: an expert receives the gradient of every token
its EP group dispatched to it, so it is summed over the expert-data-parallel group only and divided by the
pool, megatron-core's DDP rule (``allreduce=False`` parameters), which the CPU backend follows too.

ETP splits every expert's fc1 / fc2 over an expert-TP group (megatron-core's layout; the name table splits them
like TP). At TP 1 the ETP ranks are ranks of the pool: the dispatcher gathers
tokens over ETP x EP, each rank computes its slice of every local expert for all of them, and the reduce-scatter
sums the slices' partial outputs.

Dispatch: on CUDA megatron-core's all-to-all dispatcher; on the CPU its all-gather dispatcher with gloo
collectives (:mod:`verl_mcore_utils.moe_dispatch`). Pipeline stages: megatron-core's expert groups are per stage
(its expert rank generator has a PP dimension), so each stage's EP groups exchange that stage's layers' tokens;
the pool, and what EP must divide, is world / (TP x PP).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

__all__ = ["check_expert_parallel", "expert_data_parallel_group", "expert_sizes"]

_KEY = "megatron.expert_model_parallel_size"
_ETP = "megatron.expert_tensor_parallel_size"


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))


def expert_sizes(engine: Any) -> dict[str, Any]:
    """The engine section's expert sizes as keyword arguments (``init_parallel``, ``hf_to_transformer_config``)."""
    return {
        "expert_model_parallel_size": engine.expert_model_parallel_size,
        "expert_tensor_parallel_size": engine.expert_tensor_parallel_size,
    }


def expert_data_parallel_group() -> Any:
    """megatron-core's expert-data-parallel group when experts are split (EP > 1 or ETP other than TP), else
    None (experts are reduced over the whole pool like every other parameter)."""
    from megatron.core import parallel_state as ps

    ep, etp = ps.get_expert_model_parallel_world_size(), ps.get_expert_tensor_parallel_world_size()
    if ep == 1 and etp == ps.get_tensor_model_parallel_world_size():
        return None
    return ps.get_expert_data_parallel_group()


def _mcore_version() -> tuple[int, int]:
    from verl_mcore_utils.compat import mcore_version

    version = mcore_version()
    return (version.major, version.minor)


def check_expert_parallel(engine: Any, *, hf: Mapping[str, Any], model_name: str) -> None:
    """Raise (ValueError / NotImplementedError naming the key and the fix) unless this role's EP and ETP
    sizes run here; nothing to check at EP 1 without expert tensor parallelism."""
    from verl_mcore_utils.transformer_config import MOE_MODEL_TYPES, hf_num_experts

    ep = int(engine.expert_model_parallel_size)
    tp, pp = engine.tensor_model_parallel_size, engine.pipeline_model_parallel_size
    etp = engine.expert_tensor_parallel_size
    if ep == 1 and etp in (None, tp):
        return
    if ep < 1 or (etp is not None and etp < 1):
        raise ValueError(f"{_KEY}={ep} and {_ETP}={etp} must be >= 1")
    what = f"{_KEY}={ep}" + (f", {_ETP}={etp}" if etp is not None else "")
    if hf.get("model_type") not in MOE_MODEL_TYPES:
        raise ValueError(
            f"{what} with the dense model {model_name}: expert parallelism needs a mixture-of-experts model"
            f" ({', '.join(MOE_MODEL_TYPES)}); set {_KEY}=1 and {_ETP}=null"
        )
    experts = hf_num_experts(hf)
    if experts % ep:
        raise ValueError(
            f"{_KEY}={ep} does not divide the {experts} experts of {model_name}; every EP rank holds the same"
            f" number of experts: choose a divisor of {experts}"
        )
    etp = etp or tp
    width = int(hf.get("moe_intermediate_size") or 0)
    if width % etp:
        raise ValueError(
            f"{_ETP}={etp} does not divide the experts' moe_intermediate_size={width} of {model_name}: choose a"
            " divisor"
        )
    problems = []
    if engine.use_megatron_fsdp:
        problems.append(
            f"{what} with megatron.use_megatron_fsdp=true is not supported yet; set use_megatron_fsdp=false"
        )
    if problems:
        raise NotImplementedError(f"model {model_name}: " + "; ".join(problems))
    stage = _world_size() // pp
    if stage % (ep * etp):
        raise ValueError(
            f"{_KEY}={ep} x {_ETP}={etp} does not divide the {stage} ranks of a pipeline stage (world size / PP);"
            f" megatron-core carves the expert groups out of them: choose sizes whose product divides {stage}"
        )
    if etp != tp and _mcore_version() < (0, 19):
        raise NotImplementedError(
            f"{_ETP}={etp} (expert tensor parallelism other than TP) needs megatron-core >= 0.19 here: on 0.14 the"
            " expert gradients came out wrong in this repository's parity test; upgrade megatron-core or set"
            f" {_ETP}=null"
        )
