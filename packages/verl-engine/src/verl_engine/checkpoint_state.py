"""An RL engine's state as a checkpoint stores it: its model layout, optimizer state (torch state dicts of the
leaf optimizers), fp32 master copies and RNG states, flattened into tensors plus a JSON skeleton."""

from __future__ import annotations

import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from verl_engine.checkpoint_files import CheckpointError
from verl_mcore_utils.offload import inner_torch_optimizer, leaf_optimizers

__all__ = [
    "engine_layout",
    "flatten_state",
    "load_optimizer_state",
    "lora_meta",
    "master_copies",
    "model_layout",
    "optimizer_state",
    "replica_rank",
    "restore_master_copies",
    "rng_state",
    "set_rng_state",
    "unflatten_state",
]


def flatten_state(obj: Any, prefix: str, tensors: dict[str, torch.Tensor]) -> Any:
    """A JSON skeleton of ``obj`` with every tensor moved to ``tensors`` (refuses types it cannot restore)."""
    if isinstance(obj, torch.Tensor):
        key = prefix or "_"
        tensors[key] = obj.detach().to("cpu").contiguous()
        return {"__tensor__": key}
    if isinstance(obj, Mapping):
        return {"__dict__": [[k, flatten_state(v, f"{prefix}/{k}", tensors)] for k, v in obj.items()]}
    if isinstance(obj, (list, tuple)):
        return [flatten_state(v, f"{prefix}/{i}", tensors) for i, v in enumerate(obj)]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(
        f"checkpoint state at {prefix!r} has a {type(obj).__name__}, which is not saved as JSON or a tensor"
    )


def unflatten_state(skeleton: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    if isinstance(skeleton, dict):
        if "__tensor__" in skeleton:
            return tensors[skeleton["__tensor__"]]
        return {k: unflatten_state(v, tensors) for k, v in skeleton["__dict__"]}
    if isinstance(skeleton, list):
        return [unflatten_state(v, tensors) for v in skeleton]
    return skeleton


def engine_layout(engine: Any) -> dict[str, Any]:
    from megatron.core import parallel_state as ps

    return {
        "world_size": dist.get_world_size() if dist.is_initialized() else 1,
        "tensor_model_parallel_size": ps.get_tensor_model_parallel_world_size(),
        "pipeline_model_parallel_size": ps.get_pipeline_model_parallel_world_size(),
        "virtual_pipeline_model_parallel_size": ps.get_virtual_pipeline_model_parallel_world_size(),
        "backend": type(engine.backend).__name__,
        # the distributed optimizer shards its state over DP: its rank files exist for one DP size only
        "distributed_optimizer_dp": ps.get_data_parallel_world_size()
        if is_distributed_optimizer(engine.optimizer)
        else None,
        # Megatron-FSDP shards the model itself over DP
        "megatron_fsdp_dp": ps.get_data_parallel_world_size() if engine.megatron_fsdp else None,
        # expert (tensor) parallelism: the pool's ranks hold different experts or expert slices, so no rank of
        # the pool replicates another's file (None: every rank of the pool holds the same model shard)
        "expert_layout": _expert_layout(),
    }


def _expert_layout() -> list[int] | None:
    from megatron.core import parallel_state as ps

    ep, etp = ps.get_expert_model_parallel_world_size(), ps.get_expert_tensor_parallel_world_size()
    if ep == 1 and etp == ps.get_tensor_model_parallel_world_size():
        return None
    return [ep, etp, dist.get_world_size() if dist.is_initialized() else 1]


def model_layout(layout: Mapping[str, Any]) -> tuple[Any, ...]:
    """What the per-rank files depend on (the DP x CP pool replicates them; its size may change)."""
    return (
        layout["tensor_model_parallel_size"],
        layout["pipeline_model_parallel_size"],
        layout["virtual_pipeline_model_parallel_size"],
        layout["backend"],
        layout.get("megatron_fsdp_dp"),
        layout.get("expert_layout"),
    )


def lora_meta(engine: Any) -> dict[str, Any] | None:
    lora = getattr(engine, "lora", None)
    return None if lora is None else {"rank": int(lora.rank), "alpha": float(lora.alpha)}


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
        from megatron.core import tensor_parallel

        state["megatron_cuda"] = tensor_parallel.get_cuda_rng_tracker().get_states()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
        from megatron.core import tensor_parallel

        tensor_parallel.get_cuda_rng_tracker().set_states(state["megatron_cuda"])


def is_distributed_optimizer(optimizer: Any) -> bool:
    return optimizer is not None and any(
        type(leaf).__name__ == "DistributedOptimizer" for leaf in leaf_optimizers(optimizer)
    )


def optimizer_state(engine: Any) -> Any:
    """This rank's optimizer state, as torch state dicts only.

    A torch optimizer (debug backend): its state dict. A megatron-core optimizer (plain, mixed precision or
    distributed, chained or not): per leaf, the state dict of the torch optimizer it wraps -- over this rank's
    fp32 master copies, i.e. this DP rank's shard with the distributed optimizer -- and its grad scaler's.
    megatron's own ``state_dict`` / ``sharded_state_dict`` are not used: their content and the way the
    distributed optimizer's shards are gathered differ between releases, while the torch state of the
    leaves is what the next step reads, so saving it is exact at the same layout on every release.
    """
    optimizer = engine.optimizer
    if optimizer is None:
        return None
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer.state_dict()
    return [
        {
            "inner": inner_torch_optimizer(leaf).state_dict(),
            "grad_scaler": None
            if getattr(leaf, "grad_scaler", None) is None
            else leaf.grad_scaler.state_dict(),
        }
        for leaf in leaf_optimizers(optimizer)
    ]


def load_optimizer_state(engine: Any, state: Any, *, file: Path) -> None:
    optimizer = engine.optimizer
    if isinstance(optimizer, torch.optim.Optimizer):
        optimizer.load_state_dict(state)
        return
    leaves = leaf_optimizers(optimizer)
    if not isinstance(state, list) or len(state) != len(leaves):
        raise CheckpointError(
            f"{file} holds optimizer state for {len(state) if isinstance(state, list) else 'a torch'} optimizer(s);"
            f" this engine's megatron optimizer has {len(leaves)} leaf optimizer(s)"
        )
    for leaf, saved in zip(leaves, state, strict=True):
        inner = inner_torch_optimizer(leaf)
        if [len(g["params"]) for g in saved["inner"]["param_groups"]] != [
            len(g["params"]) for g in inner.param_groups
        ]:
            raise CheckpointError(
                f"{file}: the saved optimizer's parameter groups do not match this engine's (another model, or"
                " another distributed-optimizer sharding)"
            )
        inner.load_state_dict(saved["inner"])
        if saved["grad_scaler"] is not None:
            leaf.grad_scaler.load_state_dict(saved["grad_scaler"])


def master_copies(engine: Any) -> list[torch.Tensor]:
    """The fp32 master copies of megatron-core's mixed-precision optimizer (none for a plain torch optimizer).

    Saved and restored explicitly: what the optimizer's own state_dict does with them differs by release, and
    re-deriving them from the bf16 model would lose their low bits (resume would not be exact).
    """
    if engine.optimizer is None:
        return []
    from verl_mcore_utils.offload import master_params

    return master_params(engine.optimizer)


def restore_master_copies(engine: Any, tensors: Mapping[str, torch.Tensor], *, file: Path) -> None:
    masters = master_copies(engine)
    stored = sum(1 for k in tensors if k.startswith("master/"))
    if stored != len(masters):
        raise CheckpointError(
            f"{file} holds {stored} fp32 master copies; this engine's optimizer has {len(masters)}"
        )
    with torch.no_grad():
        for i, master in enumerate(masters):
            value = tensors[f"master/{i}"]
            if value.shape != master.shape:
                raise CheckpointError(
                    f"{file}: master copy {i} is {tuple(value.shape)}, the optimizer's {tuple(master.shape)}"
                )
            master.copy_(value)


def replica_rank(saved: Mapping[str, Any], current: Mapping[str, Any], rank: int) -> int:
    """The saved rank with this rank's TP / PP position (megatron-core's rank order: TP fastest, then DP x CP,
    then PP)."""
    tp, pp = current["tensor_model_parallel_size"], current["pipeline_model_parallel_size"]
    pool_now = current["world_size"] // (tp * pp)
    pool_then = saved["world_size"] // (tp * pp)
    tp_rank, pp_rank = rank % tp, rank // (tp * pool_now)
    return pp_rank * tp * pool_then + tp_rank  # pool position 0 of the saved run
