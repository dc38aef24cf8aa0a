"""Write a megatron-core GPTModel as a (sharded) Hugging Face safetensors checkpoint."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from verl_mcore_utils.weights.export import export_hf_weights


def _write_config(hf_config: Mapping[str, Any] | Any, path: Path) -> None:
    if hasattr(hf_config, "save_pretrained"):
        hf_config.save_pretrained(str(path))
    elif isinstance(hf_config, Mapping):
        (path / "config.json").write_text(json.dumps(dict(hf_config), indent=2, sort_keys=True) + "\n")
    else:
        raise TypeError(f"cannot write a config.json from {type(hf_config).__name__}")


def save_hf_weights(
    model_chunks: torch.nn.Module | Sequence[torch.nn.Module],
    path: str | os.PathLike[str],
    *,
    hf_config: Mapping[str, Any] | Any,
    save_config: bool = True,
    max_shard_bytes: int = 5 * 1024**3,
    weights: Iterable[tuple[str, torch.Tensor]] | None = None,
) -> Path:
    """Write the model as a Hugging Face safetensors checkpoint (global rank 0 writes; every rank must call).

    Shards of at most ``max_shard_bytes`` are written as the export streams, so rank 0 holds at most one
    shard in host memory; more than one shard gets HF's ``model-0000i-of-0000n.safetensors`` names and a
    ``model.safetensors.index.json``. Weight files of an earlier save in ``path`` are removed first so
    that loaders cannot mix two saves. ``config.json`` is written from ``hf_config`` unless
    ``save_config=False``. ``weights`` replaces :func:`export_hf_weights` as the source of ``(name, tensor)``
    pairs (e.g. LoRA-merged weights; the same collective contract). Returns ``path`` after all ranks are done
    (a barrier).
    """
    from safetensors.torch import save_file

    path = Path(path)
    writer = not dist.is_initialized() or dist.get_rank() == 0
    shard_files: list[Path] = []
    weight_map: dict[str, int] = {}
    pending: dict[str, torch.Tensor] = {}
    pending_bytes = 0
    total_bytes = 0

    def flush() -> None:
        nonlocal pending, pending_bytes
        if pending:
            file = path / f".tmp-model-{len(shard_files):05d}.safetensors"
            save_file(pending, str(file), metadata={"format": "pt"})
            shard_files.append(file)
            pending, pending_bytes = {}, 0

    if writer:
        path.mkdir(parents=True, exist_ok=True)
        for old in _old_weight_files(path):
            old.unlink()
    if weights is None:
        weights = export_hf_weights(model_chunks, hf_config=hf_config)
    for name, tensor in weights:
        if not writer:
            continue
        # An own contiguous CPU copy: safetensors refuses tensors that share memory (split q/k/v do).
        tensor = tensor.detach().to("cpu", copy=True).contiguous()
        size = tensor.numel() * tensor.element_size()
        if pending and pending_bytes + size > max_shard_bytes:
            flush()
        pending[name] = tensor
        weight_map[name] = len(shard_files)
        pending_bytes += size
        total_bytes += size
    if writer:
        flush()
        if len(shard_files) == 1:
            shard_files[0].rename(path / "model.safetensors")
        else:
            names = [
                f"model-{i + 1:05d}-of-{len(shard_files):05d}.safetensors" for i in range(len(shard_files))
            ]
            for file, final in zip(shard_files, names, strict=True):
                file.rename(path / final)
            index = {
                "metadata": {"total_size": total_bytes},
                "weight_map": {name: names[i] for name, i in sorted(weight_map.items())},
            }
            (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        if save_config:
            _write_config(hf_config, path)
    if dist.is_initialized():
        dist.barrier()
    return path


def _old_weight_files(path: Path) -> Iterable[Path]:
    pattern = re.compile(
        r"^(model\.safetensors|model-\d{5}-of-\d{5}\.safetensors|model\.safetensors\.index\.json)$"
    )
    return [p for p in path.iterdir() if pattern.match(p.name) or p.name.startswith(".tmp-model-")]
