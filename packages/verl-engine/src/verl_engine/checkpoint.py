"""Checkpoints of an RL engine: exact resume, atomic writes, no pickle on load.

``root/global_step_<N>/`` holds ``meta.json``, one ``rank_<r>.safetensors`` per rank and the model in Hugging
Face format (``hf/``, or ``lora_adapter/`` with LoRA); ``root/latest_checkpointed_iteration.txt`` names the
newest complete step. Format and guarantees: the package README's "Checkpoints".
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from verl_engine.checkpoint_files import (
    FORMAT,
    LATEST_FILE,
    CheckpointError,
    barrier,
    fsync_dir,
    gather_objects,
    global_rank,
    prune,
    read_meta,
    read_rank_file,
    sha256,
    step_dir,
    verified_file,
)
from verl_engine.checkpoint_state import (
    engine_layout,
    flatten_state,
    load_optimizer_state,
    lora_meta,
    master_copies,
    model_layout,
    optimizer_state,
    replica_rank,
    restore_master_copies,
    rng_state,
    set_rng_state,
    unflatten_state,
)

__all__ = ["LATEST_FILE", "CheckpointError", "latest_step", "load_checkpoint", "save_checkpoint", "step_dir"]


def _params(engine: Any) -> dict[str, torch.nn.Parameter]:
    """What a rank file stores: every parameter, or with LoRA the trainable ones (the base is frozen)."""
    from verl_mcore_utils.weights.chunks import expert_bias_buffers

    lora = getattr(engine, "lora", None) is not None
    return {
        f"{i}.{n}": p
        for i, chunk in enumerate(engine.chunks)
        for n, p in [*chunk.named_parameters(), *expert_bias_buffers(chunk)]  # routers' expert bias: a buffer
        if not lora or p.requires_grad
    }


def _write_json(path: Path, payload: Any) -> None:
    """``payload`` as ``path``, atomically (a temporary file, fsynced, renamed over it)."""
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as f:
        json.dump(payload, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# ----------------------------------------------------------------------------------------------- save
def save_checkpoint(
    engine: Any,
    root: str | os.PathLike[str],
    *,
    global_step: int,
    data_position: Any = None,
    max_ckpt_to_keep: int | None = None,
) -> Path:
    """Write ``root/global_step_<global_step>`` (every rank calls it) and point the latest marker at it.

    ``data_position``: anything JSON can hold (e.g. the data loader's epoch and index), returned by
    :func:`load_checkpoint`. Returns the step's directory.
    """
    from safetensors.torch import save_file

    if isinstance(global_step, bool) or not isinstance(global_step, int) or global_step < 0:
        raise ValueError(f"global_step must be an int >= 0, got {global_step!r}")
    if max_ckpt_to_keep is not None and max_ckpt_to_keep < 1:
        raise ValueError(f"max_ckpt_to_keep must be >= 1 or None, got {max_ckpt_to_keep}")
    json.dumps(data_position)  # fail before writing anything if it is not JSON
    root = Path(root)
    final = step_dir(root, global_step)
    tmp = final.with_name(final.name + ".tmp")
    rank = global_rank()
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob("global_step_*.tmp"):  # saves that died before their rename: never loadable
            shutil.rmtree(stale)
        tmp.mkdir()
    barrier()
    tensors, skeleton = _rank_state(engine)
    file = tmp / f"rank_{rank:05d}.safetensors"
    save_file(tensors, str(file), metadata={"skeleton": json.dumps(skeleton)})
    digests = gather_objects({"file": file.name, "bytes": file.stat().st_size, "sha256": sha256(file)})
    # the model (or its LoRA adapter) in Hugging Face format, gathered over TP and PP (a collective; rank 0
    # writes): what another layout loads
    if not engine.value_model and engine.hf_config is not None:
        engine.save_hf(str(tmp / ("hf" if lora_meta(engine) is None else "lora_adapter")))
    barrier()
    if rank == 0:
        meta = _meta(engine, tmp, global_step=global_step, data_position=data_position, digests=digests)
        _write_json(tmp / "meta.json", meta)  # last: a step directory without it is incomplete
        fsync_dir(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_dir(root)
        _write_json(root / LATEST_FILE, {"global_step": global_step})
        if max_ckpt_to_keep is not None:
            prune(root, keep=max_ckpt_to_keep)
    barrier()
    return final


def _rank_state(engine: Any) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """This rank's tensors and the JSON skeleton that puts them back together."""
    tensors: dict[str, torch.Tensor] = {}
    skeleton: dict[str, Any] = {}
    if engine.megatron_fsdp:  # this rank's shards of the main weights and of the optimizer state
        from verl_mfsdp.local_state import megatron_fsdp_local_state

        local, skeleton["fsdp"] = megatron_fsdp_local_state(engine.chunks, engine.optimizer)
        tensors.update({f"fsdp/{k}": v for k, v in local.items()})
        skeleton["optimizer"] = None
    else:
        for name, param in _params(engine).items():
            tensors[f"param/{name}"] = param.detach().to("cpu").contiguous()
        for i, master in enumerate(master_copies(engine)):
            tensors[f"master/{i}"] = master.detach().to("cpu").contiguous()
        skeleton["optimizer"] = flatten_state(optimizer_state(engine), "optimizer", tensors)
    skeleton["rng"] = flatten_state(rng_state(), "rng", tensors)
    return tensors, skeleton


def _meta(
    engine: Any, tmp: Path, *, global_step: int, data_position: Any, digests: list[dict[str, Any]]
) -> dict[str, Any]:
    """The step's ``meta.json``: step, data position, layout, LR schedule, LoRA, and every file's digest."""
    files = {d["file"]: {"bytes": d["bytes"], "sha256": d["sha256"]} for d in digests}
    for sub in ("hf", "lora_adapter"):
        for f in sorted((tmp / sub).glob("*")) if (tmp / sub).is_dir() else []:
            files[f"{sub}/{f.name}"] = {"bytes": f.stat().st_size, "sha256": sha256(f)}
    return {
        "format": FORMAT,
        "global_step": global_step,
        "data_position": data_position,
        "layout": engine_layout(engine),
        "lr_schedule": None if engine.lr_schedule is None else engine.lr_schedule.state_dict(),
        "files": files,
        "has_hf": (tmp / "hf").is_dir(),
        "has_adapter": (tmp / "lora_adapter").is_dir(),
        "lora": lora_meta(engine),
    }


# ----------------------------------------------------------------------------------------------- load
def _resolve(path: Path) -> Path:
    """A step directory, or the step the root's latest marker names."""
    if (path / "meta.json").is_file():
        return path
    step = latest_step(path)
    if step is None:
        raise CheckpointError(
            f"{path} is neither a checkpoint step directory (no meta.json) nor a checkpoint root (no {LATEST_FILE})"
        )
    marker = path / LATEST_FILE
    found = step_dir(path, step)
    if not (found / "meta.json").is_file():
        raise CheckpointError(f"{marker} names step {step} but {found}/meta.json does not exist")
    return found


def latest_step(root: str | os.PathLike[str]) -> int | None:
    """The step a checkpoint root's latest marker names; None when the root has no marker."""
    marker = Path(root) / LATEST_FILE
    if not marker.is_file():
        return None
    try:
        return int(json.loads(marker.read_text())["global_step"])
    except (ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"{marker} is not a latest-step marker written by verl-engine: {err}") from None


def load_checkpoint(
    engine: Any, path: str | os.PathLike[str], *, load_optimizer: bool = True
) -> dict[str, Any]:
    """Restore a checkpoint into ``engine`` (every rank calls it); returns ``{"global_step", "data_position"}``.

    ``path`` is a step directory or a root with a latest marker. At the saved model layout (TP, PP, virtual
    PP, backend; the DP x CP pool may differ) parameters, optimizer state, LR schedule and RNG states are
    restored exactly. At another layout only the model can be restored, from the Hugging Face copy:
    ``load_optimizer=False`` says so; otherwise it is an error naming both layouts.
    """
    directory = _resolve(Path(path))
    meta = read_meta(directory)
    position = {"global_step": meta["global_step"], "data_position": meta["data_position"]}
    if meta.get("lora") != lora_meta(engine):
        raise CheckpointError(
            f"{directory} was saved with LoRA {meta.get('lora') or 'off'}; this engine has LoRA"
            f" {lora_meta(engine) or 'off'}: build the engine with the checkpoint's model.lora settings"
        )
    saved, current = meta["layout"], engine_layout(engine)
    same = model_layout(saved) == model_layout(current)
    if engine.megatron_fsdp and not (same and load_optimizer):
        raise CheckpointError(
            f"{directory}: a Megatron-FSDP engine resumes only at the saved layout, model and optimizer shards"
            f" together (load_optimizer=True); to start from the model alone, build the engine with"
            f" model.path={directory / 'hf'}"
        )
    if not same:
        _load_other_layout(engine, directory, meta, current=current, load_optimizer=load_optimizer)
        return position
    sharded = saved.get("distributed_optimizer_dp"), current["distributed_optimizer_dp"]
    if load_optimizer and sharded[0] != sharded[1]:
        raise CheckpointError(
            f"{directory} holds optimizer state {_sharding(sharded[0])}; this engine's is {_sharding(sharded[1])}."
            " The distributed optimizer's shards follow the DP size: resume at the saved DP size and"
            " megatron.use_distributed_optimizer setting, or load with load_optimizer=False (model only)"
        )
    # the rank that held this rank's model shard: same model-parallel position; the pool replicates it
    rank = global_rank()
    name = f"rank_{rank:05d}.safetensors"
    if name not in meta["files"]:  # a smaller or larger DP x CP pool: any replica of this shard will do
        name = f"rank_{replica_rank(saved, current, rank):05d}.safetensors"
    tensors, skeleton = read_rank_file(verified_file(directory, meta, name))
    if engine.megatron_fsdp:
        _load_megatron_fsdp(engine, directory / name, tensors, skeleton)
        _restore_schedule_and_rng(engine, meta, skeleton, tensors)
        return position
    _load_params(engine, directory / name, tensors)
    if load_optimizer:
        _load_optimizer(engine, directory, name=name, skeleton=skeleton, tensors=tensors)
        _restore_schedule_and_rng(engine, meta, skeleton, tensors)
    return position


def _load_other_layout(
    engine: Any, directory: Path, meta: Mapping[str, Any], *, current: Mapping[str, Any], load_optimizer: bool
) -> None:
    """The model alone from the step's Hugging Face copy (another TP / PP layout); optimizer and RNG states are
    per rank and cannot follow."""
    from verl_mcore_utils.weights import load_hf_weights

    saved = meta["layout"]
    if load_optimizer:
        raise CheckpointError(
            f"{directory} was saved at TP={saved['tensor_model_parallel_size']},"
            f" PP={saved['pipeline_model_parallel_size']}, VPP={saved['virtual_pipeline_model_parallel_size']}"
            f" ({saved['backend']}, EP / ETP / world {saved.get('expert_layout')}); this engine runs TP={current['tensor_model_parallel_size']},"
            f" PP={current['pipeline_model_parallel_size']}, VPP={current['virtual_pipeline_model_parallel_size']}"
            f" ({current['backend']}, EP / ETP / world {current.get('expert_layout')}). Optimizer and RNG states are per rank and cannot change layout: load with"
            " load_optimizer=False to restore the model only (from its Hugging Face copy)"
        )
    sub = "lora_adapter" if meta.get("lora") else "hf"
    if not meta.get("has_adapter" if meta.get("lora") else "has_hf"):
        raise CheckpointError(
            f"{directory} has no Hugging Face copy of the model ({sub}/; a critic's value head has none), so"
            " it loads only at its layout"
        )
    if engine.mtp is not None or engine.mtp_embedding_copy:
        raise CheckpointError(
            "MTP layers have no Hugging Face names: load this checkpoint at its saved layout"
        )
    for name in meta["files"]:
        if name.startswith(f"{sub}/"):
            verified_file(directory, meta, name)
    if meta.get("lora"):
        from verl_mcore_utils.lora import load_hf_adapter

        load_hf_adapter(engine.chunks, directory / sub, hf_config=engine.hf_config)
    else:
        load_hf_weights(engine.chunks, directory / sub, hf_config=engine.hf_config)


def _load_megatron_fsdp(
    engine: Any, file: Path, tensors: Mapping[str, torch.Tensor], skeleton: Mapping[str, Any]
) -> None:
    from verl_mfsdp.local_state import load_megatron_fsdp_local_state

    if "fsdp" not in skeleton:
        raise CheckpointError(f"{file} holds no Megatron-FSDP state")
    try:
        load_megatron_fsdp_local_state(
            engine.chunks,
            engine.optimizer,
            tensors={k.removeprefix("fsdp/"): v for k, v in tensors.items() if k.startswith("fsdp/")},
            description=skeleton["fsdp"],
            source=str(file),
        )
    except ValueError as err:
        raise CheckpointError(str(err)) from None


def _load_params(engine: Any, file: Path, tensors: Mapping[str, torch.Tensor]) -> None:
    params = _params(engine)
    stored = {k.removeprefix("param/") for k in tensors if k.startswith("param/")}
    if stored != set(params):
        missing, extra = sorted(set(params) - stored), sorted(stored - set(params))
        raise CheckpointError(
            f"{file} does not hold this model's parameters: missing {missing[:8]}, unexpected {extra[:8]}"
        )
    with torch.no_grad():
        for pname, param in params.items():
            value = tensors[f"param/{pname}"]
            if value.shape != param.shape or value.dtype != param.dtype:
                raise CheckpointError(
                    f"{file}: parameter {pname!r} is {value.dtype} {tuple(value.shape)}, the model's is"
                    f" {param.dtype} {tuple(param.shape)}"
                )
            param.copy_(value)


def _load_optimizer(
    engine: Any,
    directory: Path,
    *,
    name: str,
    skeleton: Mapping[str, Any],
    tensors: Mapping[str, torch.Tensor],
) -> None:
    state = unflatten_state(skeleton["optimizer"], tensors)
    if (state is None) != (engine.optimizer is None):
        raise CheckpointError(
            f"{directory}: the checkpoint has {'no' if state is None else 'an'} optimizer state but this engine"
            f" has {'an' if engine.optimizer is not None else 'no'} optimizer"
        )
    if state is not None:
        load_optimizer_state(engine, state, file=directory / name)
        restore_master_copies(engine, tensors, file=directory / name)


def _restore_schedule_and_rng(
    engine: Any, meta: Mapping[str, Any], skeleton: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]
) -> None:
    if engine.lr_schedule is not None and meta["lr_schedule"] is not None:
        engine.lr_schedule.load_state_dict(meta["lr_schedule"])
    set_rng_state(unflatten_state(skeleton["rng"], tensors))


def _sharding(dp: int | None) -> str:
    return "not sharded" if dp is None else f"sharded over DP={dp} (distributed optimizer)"
