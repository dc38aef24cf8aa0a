"""A checkpoint on disk: its paths and latest-step marker, meta.json, file digests, rank files, retention,
and the rank / barrier / gather helpers of its writers."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "FORMAT",
    "LATEST_FILE",
    "CheckpointError",
    "barrier",
    "complete_steps",
    "fsync_dir",
    "gather_objects",
    "global_rank",
    "prune",
    "read_meta",
    "read_rank_file",
    "sha256",
    "step_dir",
    "verified_file",
]

LATEST_FILE = "latest_checkpointed_iteration.txt"
FORMAT = "verl-engine-checkpoint/1"


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as asked: missing, truncated, modified, or of another layout."""


def step_dir(root: str | os.PathLike[str], step: int) -> Path:
    return Path(root) / f"global_step_{step}"


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def global_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def gather_objects(obj: Any) -> list[Any]:
    if not dist.is_initialized():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)  # our own ranks' file digests, at save time (never at load)
    return out


def complete_steps(root: Path) -> list[int]:
    steps = []
    for d in root.glob("global_step_*"):
        suffix = d.name.removeprefix("global_step_")
        if suffix.isdigit() and (d / "meta.json").is_file():
            steps.append(int(suffix))
    return sorted(steps)


def prune(root: Path, *, keep: int) -> None:
    for step in complete_steps(root)[:-keep]:
        shutil.rmtree(step_dir(root, step))


def read_meta(directory: Path) -> dict[str, Any]:
    file = directory / "meta.json"
    try:
        meta = json.loads(file.read_text())
    except ValueError as err:
        raise CheckpointError(f"{file} is not valid JSON ({err}); the checkpoint is damaged") from None
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{file}: format {meta.get('format')!r}, expected {FORMAT!r}")
    return meta


def verified_file(directory: Path, meta: Mapping[str, Any], name: str) -> Path:
    file = directory / name
    expected = meta["files"].get(name)
    if expected is None:
        raise CheckpointError(
            f"{directory}/meta.json lists no {name} (the checkpoint has {sorted(meta['files'])})"
        )
    if not file.is_file():
        raise CheckpointError(f"{file} is missing")
    size = file.stat().st_size
    if size != expected["bytes"] or sha256(file) != expected["sha256"]:
        raise CheckpointError(
            f"{file} does not match meta.json ({size} bytes, expected {expected['bytes']}; or a different SHA-256):"
            " the file is truncated or was modified"
        )
    return file


def read_rank_file(file: Path) -> tuple[dict[str, torch.Tensor], Any]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file, safe_open

    try:
        with safe_open(str(file), framework="pt") as f:
            metadata = f.metadata() or {}
        tensors = load_file(str(file))
    except (SafetensorError, OSError, ValueError) as err:
        raise CheckpointError(f"{file} is not a safetensors file ({err}); it is not loaded") from None
    if "skeleton" not in metadata:
        raise CheckpointError(f"{file} has no verl-engine state skeleton in its metadata")
    return tensors, json.loads(metadata["skeleton"])
