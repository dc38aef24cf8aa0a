"""This rank's Megatron-FSDP training state as plain tensors: for checkpoints that must not unpickle.

torch.distributed.checkpoint (what :mod:`verl_mfsdp.checkpoint` writes) stores its metadata with ``pickle``,
so loading a checkpoint from elsewhere could run code. A resume at the same layout does not need DCP's
resharding: every rank owns fixed local shards of the fp32 main weights and of the Adam state, and restoring
exactly those shards restores the run. :func:`megatron_fsdp_local_state` returns them as CPU tensors (for
safetensors) plus a JSON-able description; :func:`load_megatron_fsdp_local_state` copies them back in place
and re-derives the compute weights the way every optimizer step does.

Names are positional (``main/<chunk>/<name>``, ``optim/<leaf>/<index>/<key>``): they are only valid at the
layout that wrote them, which the caller records and checks (world size, parallel sizes, sharding strategy).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from verl_mcore_utils.compat import import_megatron_core
from verl_mcore_utils.offload import inner_torch_optimizer, leaf_optimizers
from verl_mfsdp.offload import megatron_fsdp_chunks
from verl_mfsdp.wrap import restart_megatron_fsdp_param_sync, synchronize_megatron_fsdp_params

__all__ = ["load_megatron_fsdp_local_state", "megatron_fsdp_local_state"]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if type(t).__name__ == "DTensor" else t  # type: ignore[attr-defined]


def _main_weights(chunks: Sequence[torch.nn.Module]) -> dict[str, torch.Tensor]:
    return {
        f"main/{i}/{name}": _local(param)
        for i, chunk in enumerate(chunks)
        # megatron-fsdp's ParamAndGradBuffer (nn.Module.__getattr__ reads it as Tensor | Module)
        for name, param in chunk.param_and_grad_buffer.optimizer_named_parameters  # type: ignore[union-attr]
    }


def _ensure_optimizer_state(chunks: Sequence[torch.nn.Module], leaves: Sequence[Any]) -> None:
    """Every parameter gets its Adam state entry (megatron-core's dummy step on zero gradients when there is
    none yet; empty local shards get zero-size entries), so that save and load see the same entries."""
    from verl_mfsdp.checkpoint import _SHARDING, _complete_optimizer_state

    model_sd: dict[str, Any] = {}
    for chunk in chunks:
        model_sd.update(chunk.state_dict())
    for leaf in leaves:
        if not inner_torch_optimizer(leaf).state:
            leaf.sharded_state_dict(model_sd, is_loading=True, metadata=dict(_SHARDING))
        _complete_optimizer_state(leaf)


def megatron_fsdp_local_state(
    model_chunks: torch.nn.Module | Sequence[torch.nn.Module], optimizer: Any
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """This rank's main-weight shards and optimizer state: ``(tensors on CPU, JSON-able description)``."""
    import_megatron_core()
    chunks = megatron_fsdp_chunks(model_chunks)
    leaves = leaf_optimizers(optimizer)
    synchronize_megatron_fsdp_params(chunks)
    _ensure_optimizer_state(chunks, leaves)
    tensors = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in _main_weights(chunks).items()}
    described: list[dict[str, Any]] = []
    for j, leaf in enumerate(leaves):
        inner = inner_torch_optimizer(leaf)
        params = [p for group in inner.param_groups for p in group["params"]]
        scalars: list[dict[str, Any]] = []
        for k, param in enumerate(params):
            entry: dict[str, Any] = {}
            for key, value in inner.state[param].items():
                if isinstance(value, torch.Tensor):
                    tensors[f"optim/{j}/{k}/{key}"] = _local(value).detach().to("cpu", copy=True).contiguous()
                else:
                    entry[key] = value
            scalars.append(entry)
        groups = [{k: v for k, v in g.items() if k != "params"} for g in inner.state_dict()["param_groups"]]
        described.append({"num_params": len(params), "scalars": scalars, "param_groups": groups})
    return tensors, {"optimizers": described}


def load_megatron_fsdp_local_state(
    model_chunks: torch.nn.Module | Sequence[torch.nn.Module],
    optimizer: Any,
    *,
    tensors: Mapping[str, torch.Tensor],
    description: Mapping[str, Any],
    source: str = "checkpoint",
) -> None:
    """Copy what :func:`megatron_fsdp_local_state` returned back in place (same layout), then re-derive the
    compute weights from the main weights and restart the parameter all-gather. ``source`` names the file in
    errors."""
    import_megatron_core()
    chunks = megatron_fsdp_chunks(model_chunks)
    leaves = leaf_optimizers(optimizer)
    synchronize_megatron_fsdp_params(chunks)
    _ensure_optimizer_state(chunks, leaves)
    if len(description["optimizers"]) != len(leaves):
        raise ValueError(
            f"{source} holds {len(description['optimizers'])} optimizer(s); this model has {len(leaves)}"
        )
    targets: dict[str, torch.Tensor] = dict(_main_weights(chunks))
    for j, (leaf, saved) in enumerate(zip(leaves, description["optimizers"], strict=True)):
        inner = inner_torch_optimizer(leaf)
        params = [p for group in inner.param_groups for p in group["params"]]
        if len(params) != saved["num_params"] or len(inner.param_groups) != len(saved["param_groups"]):
            raise ValueError(f"{source}: optimizer {j}'s parameters do not match this model's")
        for k, param in enumerate(params):
            state = inner.state[param]
            for key, value in saved["scalars"][k].items():
                state[key] = value
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    targets[f"optim/{j}/{k}/{key}"] = _local(value)
        for group, hyper in zip(inner.param_groups, saved["param_groups"], strict=True):
            group.update(hyper)
    if set(targets) != set(tensors):
        missing, extra = sorted(set(targets) - set(tensors)), sorted(set(tensors) - set(targets))
        raise ValueError(
            f"{source} does not match this model's state: missing {missing[:6]}, unexpected {extra[:6]}"
        )
    with torch.no_grad():
        for name, target in targets.items():
            value = tensors[name]
            if value.shape != target.shape or value.dtype != target.dtype:
                raise ValueError(
                    f"{source}: {name} is {value.dtype} {tuple(value.shape)}, this model's {target.dtype}"
                    f" {tuple(target.shape)}"
                )
            target.copy_(value)
    for chunk in chunks:
        # compute weights from the main weights, as a step does (MegatronFSDP's method: nn.Module.__getattr__)
        chunk.module.install_optimized_model_weights()  # type: ignore[union-attr,operator]
    restart_megatron_fsdp_param_sync(chunks, force_sync=True)
