"""Save and resume a Megatron-FSDP training state with torch.distributed.checkpoint (fsdp_dtensor format).

Why this format: megatron-core's DistributedOptimizer refuses every other sharding type for Megatron-FSDP.
Resume is exact (the compute weights are re-derived from the loaded main weights). Save and load are
collectives. What is saved and why: the package README.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from verl_mcore_utils.compat import import_megatron_core
from verl_mcore_utils.offload import leaf_optimizers
from verl_mfsdp.offload import megatron_fsdp_chunks
from verl_mfsdp.wrap import restart_megatron_fsdp_param_sync, synchronize_megatron_fsdp_params

__all__ = [
    "CHECKPOINT_INFO_FILE",
    "load_megatron_fsdp_checkpoint",
    "read_megatron_fsdp_checkpoint_info",
    "save_megatron_fsdp_checkpoint",
]

CHECKPOINT_INFO_FILE = "verl_mfsdp_checkpoint.json"
_FORMAT = "verl_mfsdp/fsdp_dtensor/1"
_SHARDING = {"distrib_optim_sharding_type": "fsdp_dtensor"}
# Layout keys that must match between save and load (a mismatch would load wrong shards or fail deep
# inside DCP with an unhelpful message).
_LAYOUT_KEYS = (
    "world_size",
    "data_parallel_size",
    "tensor_model_parallel_size",
    "data_parallel_sharding_strategy",
    "num_model_chunks",
    "num_optimizers",
)


def read_megatron_fsdp_checkpoint_info(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The layout, ``step`` and ``extra`` of a checkpoint written by :func:`save_megatron_fsdp_checkpoint`.

    Raises FileNotFoundError naming the path when there is no checkpoint there, or when it is
    incomplete (DCP metadata or the info file missing: a save that did not finish).
    """
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"no Megatron-FSDP checkpoint at {str(root)!r}: the directory does not exist")
    info_path = root / CHECKPOINT_INFO_FILE
    if not (root / ".metadata").is_file() or not info_path.is_file():
        missing = [n for n in (".metadata", CHECKPOINT_INFO_FILE) if not (root / n).is_file()]
        raise FileNotFoundError(
            f"{str(root)!r} is not a complete Megatron-FSDP checkpoint: missing {', '.join(missing)}"
            " (an interrupted save, or not written by verl_mfsdp.save_megatron_fsdp_checkpoint)"
        )
    info = json.loads(info_path.read_text())
    if info.get("format") != _FORMAT:
        raise ValueError(f"{str(info_path)!r} has format {info.get('format')!r}; expected {_FORMAT!r}")
    return info


def _check_layout(
    saved: Mapping[str, Any], current: Mapping[str, Any], *, path: str | os.PathLike[str]
) -> None:
    """Raise ValueError naming every layout key where the checkpoint and the running job differ."""
    diffs = [
        f"{key}: checkpoint {saved.get('layout', {}).get(key)!r}, now {current[key]!r}"
        for key in _LAYOUT_KEYS
        if saved.get("layout", {}).get(key) != current[key]
    ]
    if diffs:
        raise ValueError(
            f"Megatron-FSDP checkpoint {str(path)!r} was saved with another layout ({'; '.join(diffs)});"
            " resume with the same world size, parallel sizes, sharding strategy and model chunks"
        )


def _layout(chunks: Sequence[torch.nn.Module], optimizers: Sequence[Any]) -> dict[str, Any]:
    from megatron.core import parallel_state

    return {
        "world_size": torch.distributed.get_world_size(),
        "data_parallel_size": parallel_state.get_data_parallel_world_size(with_context_parallel=True),
        "tensor_model_parallel_size": parallel_state.get_tensor_model_parallel_world_size(),
        # the chunk's megatron-core DDPConfig (nn.Module.__getattr__ reads it as Tensor | Module)
        "data_parallel_sharding_strategy": (
            chunks[0].ddp_config.data_parallel_sharding_strategy  # type: ignore[union-attr]
        ),
        "num_model_chunks": len(chunks),
        "num_optimizers": len(optimizers),
    }


def _keys(prefix: str, n: int) -> list[str]:
    return [prefix] if n == 1 else [f"{prefix}{i}" for i in range(n)]


def _local_numel(t: torch.Tensor) -> int:
    local = getattr(t, "_local_tensor", None) if type(t).__name__ == "DTensor" else t
    return local.numel() if isinstance(local, torch.Tensor) else 0


def _complete_optimizer_state(optimizer: Any) -> None:
    """Give every parameter of ``optimizer`` a state entry on this rank, as the other ranks have.

    Why: Megatron-FSDP shards unevenly, so a small parameter (a norm weight, a bias) can have an empty
    local shard on a rank; that rank never gets a gradient for it and torch's Adam creates no state
    there, while the rank owning the shard does. DCP and the uneven-DTensor offsets need the same keys
    on every rank (otherwise the collectives hang), so the entries of empty shards are (re)written:
    zero-size moments and the step counter this rank's other parameters have (they all step
    together), so the replicated ``step`` values agree across ranks whichever rank DCP writes them
    from. Adam skips parameters without a gradient, so these entries change no update.
    """
    inner = optimizer if isinstance(optimizer, torch.optim.Optimizer) else optimizer.optimizer
    params = [p for group in inner.param_groups for p in group["params"]]
    template = next((inner.state[p] for p in params if inner.state.get(p) and _local_numel(p) > 0), None)
    if template is None:
        return  # no step yet: no rank has state
    for param in params:
        if _local_numel(param) > 0 and inner.state.get(param):
            continue
        entry: dict[str, Any] = {}
        for key, value in template.items():
            if key == "step":
                entry[key] = value.clone() if isinstance(value, torch.Tensor) else value
            elif isinstance(value, torch.Tensor):
                entry[key] = torch.zeros_like(param, dtype=value.dtype)
            else:
                entry[key] = value
        inner.state[param] = entry


def _check_same_keys(state: Mapping[str, Any]) -> None:
    """Fail clearly, instead of hanging in a collective, if ranks would save / load different tensors."""
    from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import filter_unflattened_state_dict

    keys = sorted(
        ".".join(map(str, chain))
        for chain in filter_unflattened_state_dict(
            dict(state), visit_condition=lambda x: isinstance(x, torch.Tensor)
        )
    )
    everyone: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, keys)
    for rank, other in enumerate(everyone):
        if other != keys:
            diff = sorted(set(other) ^ set(keys))
            raise RuntimeError(
                f"ranks {torch.distributed.get_rank()} and {rank} hold different checkpoint tensors"
                f" (first differences: {diff[:5]})"
            )


def _state_dict(
    chunks: Sequence[torch.nn.Module], optimizers: Sequence[Any], *, is_loading: bool
) -> dict[str, Any]:
    """The DCP state dict; tensors are the live ones (DCP loads in place)."""
    from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import (
        preprocess_state_dict_for_uneven_dtensor,
    )

    state: dict[str, Any] = {}
    model_sd: dict[str, Any] = {}
    for key, chunk in zip(_keys("model", len(chunks)), chunks, strict=True):
        state[key] = chunk.state_dict()
        model_sd.update(state[key])
    for key, opt in zip(_keys("optimizer", len(optimizers)), optimizers, strict=True):
        if is_loading:
            # megatron-core creates the optimizer state with one dummy step on zero gradients (so DCP has
            # tensors to load into); everything it touches is overwritten by the load.
            opt.sharded_state_dict(model_sd, is_loading=True, metadata=dict(_SHARDING))
        _complete_optimizer_state(opt)
        state[key] = opt.sharded_state_dict(model_sd, is_loading=False, metadata=dict(_SHARDING))
    _check_same_keys(state)
    # Collective (offsets of every uneven shard); keys are visited in sorted order on every rank.
    preprocess_state_dict_for_uneven_dtensor(state)
    return state


def save_megatron_fsdp_checkpoint(
    model_chunks: torch.nn.Module | Sequence[torch.nn.Module],
    optimizer: Any,
    *,
    path: str | os.PathLike[str],
    step: int | None = None,
    extra: Mapping[str, Any] | None = None,
) -> Path:
    """Write model chunks and optimizer to the DCP directory ``path`` (every rank must call it).

    ``step`` and ``extra`` (JSON-serialisable, e.g. data-loader position) are stored in the info file
    and returned by :func:`load_megatron_fsdp_checkpoint`. Returns the directory.
    """
    import_megatron_core()
    import torch.distributed.checkpoint as dcp

    chunks = megatron_fsdp_chunks(model_chunks)
    optimizers = leaf_optimizers(optimizer)
    if not optimizers:
        raise ValueError("optimizer has no (non-stub) member optimizer to save")
    info = {
        "format": _FORMAT,
        "layout": _layout(chunks, optimizers),
        "step": step,
        "extra": dict(extra or {}),
    }
    json.dumps(info)  # fail before writing anything if extra is not JSON-serialisable
    root = Path(path)
    if torch.distributed.get_rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        (root / CHECKPOINT_INFO_FILE).unlink(missing_ok=True)  # overwritten checkpoint: incomplete until done
    torch.distributed.barrier()
    synchronize_megatron_fsdp_params(chunks)
    state = _state_dict(chunks, optimizers, is_loading=False)
    dcp.save(state, checkpoint_id=str(root))
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        tmp = root / (CHECKPOINT_INFO_FILE + ".tmp")
        tmp.write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
        tmp.replace(root / CHECKPOINT_INFO_FILE)
    torch.distributed.barrier()
    return root


def load_megatron_fsdp_checkpoint(
    model_chunks: torch.nn.Module | Sequence[torch.nn.Module],
    optimizer: Any,
    *,
    path: str | os.PathLike[str],
) -> dict[str, Any]:
    """Restore model chunks and optimizer from ``path`` in place; returns ``{"step": ..., "extra": ...}``.

    Build the model and optimizer exactly as for the saved run first (same seeds are not needed: every
    trained number is loaded). Raises FileNotFoundError for a missing / incomplete checkpoint and
    ValueError for a different layout, both naming the path and the keys, before any collective.
    """
    info = read_megatron_fsdp_checkpoint_info(path)
    import_megatron_core()
    import torch.distributed.checkpoint as dcp

    chunks = megatron_fsdp_chunks(model_chunks)
    optimizers = leaf_optimizers(optimizer)
    _check_layout(info, _layout(chunks, optimizers), path=path)
    synchronize_megatron_fsdp_params(chunks)
    state = _state_dict(chunks, optimizers, is_loading=True)
    try:
        dcp.load(state, checkpoint_id=str(Path(path)))
    except Exception as exc:  # DCP's own message names the key; say which checkpoint it was
        raise RuntimeError(f"loading Megatron-FSDP checkpoint {str(path)!r} failed: {exc}") from exc
    for key, opt in zip(_keys("optimizer", len(optimizers)), optimizers, strict=True):
        opt.load_state_dict(state[key])
    for chunk in chunks:
        # Compute weights from the loaded main weights (the optimizer step's cast), then re-gather.
        chunk.module.install_optimized_model_weights()  # type: ignore[union-attr,operator]  # MegatronFSDP's method
    restart_megatron_fsdp_param_sync(chunks, force_sync=True)
    return {"step": info.get("step"), "extra": info.get("extra", {})}
