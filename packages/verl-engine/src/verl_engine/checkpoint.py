"""Checkpoints of an RL engine: exact resume, atomic writes, no pickle on load.

Layout under a checkpoint root (verl's names)::

    root/latest_checkpointed_iteration.txt      the step of the newest complete checkpoint (written last)
    root/global_step_<N>/meta.json              layout, step, data position, LR schedule, file sizes + sha256
    root/global_step_<N>/rank_<r>.safetensors   rank r's parameters, optimizer state and RNG states
    root/global_step_<N>/hf/                    the whole model in Hugging Face format (layout-free)
    root/global_step_<N>/lora_adapter/          with LoRA instead of hf/: the adapter in PEFT format

Why this format:

* Exact resume: every rank stores its own parameters, optimizer state (flattened into tensors; the rest of
  the optimizer's state dict, hyper-parameters included, as JSON) and RNG states, so steps after a resume
  are bitwise those of an uninterrupted run at the same layout.
* Another layout (TP / PP change; CP and DP are not part of the model's layout here): the model is read from
  ``hf/`` with verl-mcore-utils' loader, which shards it for the new layout. Optimizer state is per rank and
  cannot follow; asking for it at another layout is an error that says so.
* LoRA: adapter-only. The rank files hold the trainable parameters (adapters, a critic's value head) and
  their optimizer state; the frozen base is the model the engine was built from (``model.path``), so a
  checkpoint is the size of the adapter. ``lora_adapter/`` is a PEFT directory (``PeftModel.from_pretrained``
  loads it) and what another layout loads. Loading a LoRA checkpoint into an engine without LoRA (or with
  another rank / alpha), or the reverse, is an error.
* Safety: tensors are read with safetensors and everything else with ``json``; nothing is unpickled, so a
  checkpoint from elsewhere cannot run code. Sizes and SHA-256 of every file are in ``meta.json``; a truncated,
  modified or missing file is named in the error, never half loaded.
* Atomic: a step is written to ``global_step_<N>.tmp``, ``meta.json`` last, then renamed; the ``latest`` file is
  replaced by a rename after that. A process killed during a save leaves the previous checkpoint and marker as
  they were. ``max_ckpt_to_keep`` removes the oldest complete steps after a successful save.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from verl_mcore_utils.offload import inner_torch_optimizer, leaf_optimizers

__all__ = ["LATEST_FILE", "CheckpointError", "load_checkpoint", "save_checkpoint", "step_dir"]

LATEST_FILE = "latest_checkpointed_iteration.txt"
FORMAT = "verl-engine-checkpoint/1"


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as asked: missing, truncated, modified, or of another layout."""


def step_dir(root: str | os.PathLike[str], step: int) -> Path:
    return Path(root) / f"global_step_{step}"


# ----------------------------------------------------------------------------------------------- flattening
def _flatten(obj: Any, prefix: str, tensors: dict[str, torch.Tensor]) -> Any:
    """A JSON skeleton of ``obj`` with every tensor moved to ``tensors`` (refuses types it cannot restore)."""
    if isinstance(obj, torch.Tensor):
        key = prefix or "_"
        tensors[key] = obj.detach().to("cpu").contiguous()
        return {"__tensor__": key}
    if isinstance(obj, Mapping):
        return {"__dict__": [[k, _flatten(v, f"{prefix}/{k}", tensors)] for k, v in obj.items()]}
    if isinstance(obj, (list, tuple)):
        return [_flatten(v, f"{prefix}/{i}", tensors) for i, v in enumerate(obj)]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(
        f"checkpoint state at {prefix!r} has a {type(obj).__name__}, which is not saved as JSON or a tensor"
    )


def _unflatten(skeleton: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    if isinstance(skeleton, dict):
        if "__tensor__" in skeleton:
            return tensors[skeleton["__tensor__"]]
        return {k: _unflatten(v, tensors) for k, v in skeleton["__dict__"]}
    if isinstance(skeleton, list):
        return [_unflatten(v, tensors) for v in skeleton]
    return skeleton


# ----------------------------------------------------------------------------------------------- engine state
def _layout(engine: Any) -> dict[str, Any]:
    from megatron.core import parallel_state as ps

    return {
        "world_size": dist.get_world_size() if dist.is_initialized() else 1,
        "tensor_model_parallel_size": ps.get_tensor_model_parallel_world_size(),
        "pipeline_model_parallel_size": ps.get_pipeline_model_parallel_world_size(),
        "virtual_pipeline_model_parallel_size": ps.get_virtual_pipeline_model_parallel_world_size(),
        "backend": type(engine.backend).__name__,
        # the distributed optimizer shards its state over DP: its rank files exist for one DP size only
        "distributed_optimizer_dp": ps.get_data_parallel_world_size()
        if _is_distributed_optimizer(engine.optimizer)
        else None,
        # Megatron-FSDP shards the model itself over DP
        "megatron_fsdp_dp": ps.get_data_parallel_world_size() if engine.megatron_fsdp else None,
    }


def _model_layout(layout: Mapping[str, Any]) -> tuple[Any, ...]:
    """What the per-rank files depend on (the DP x CP pool replicates them; its size may change)."""
    return (
        layout["tensor_model_parallel_size"],
        layout["pipeline_model_parallel_size"],
        layout["virtual_pipeline_model_parallel_size"],
        layout["backend"],
        layout.get("megatron_fsdp_dp"),
    )


def _params(engine: Any) -> dict[str, torch.nn.Parameter]:
    """What a rank file stores: every parameter, or with LoRA the trainable ones (the base is frozen)."""
    lora = getattr(engine, "lora", None) is not None
    return {
        f"{i}.{n}": p
        for i, chunk in enumerate(engine.chunks)
        for n, p in chunk.named_parameters()
        if not lora or p.requires_grad
    }


def _lora_meta(engine: Any) -> dict[str, Any] | None:
    lora = getattr(engine, "lora", None)
    return None if lora is None else {"rank": int(lora.rank), "alpha": float(lora.alpha)}


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
        from megatron.core import tensor_parallel

        state["megatron_cuda"] = tensor_parallel.get_cuda_rng_tracker().get_states()
    return state


def _set_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
        from megatron.core import tensor_parallel

        tensor_parallel.get_cuda_rng_tracker().set_states(state["megatron_cuda"])


def _is_distributed_optimizer(optimizer: Any) -> bool:
    return optimizer is not None and any(
        type(leaf).__name__ == "DistributedOptimizer" for leaf in _leaves(optimizer)
    )


def _optimizer_state(engine: Any) -> Any:
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
        for leaf in _leaves(optimizer)
    ]


def _leaves(optimizer: Any) -> list[Any]:
    return leaf_optimizers(optimizer)


def _load_optimizer_state(engine: Any, state: Any, *, file: Path) -> None:
    optimizer = engine.optimizer
    if isinstance(optimizer, torch.optim.Optimizer):
        optimizer.load_state_dict(state)
        return
    leaves = _leaves(optimizer)
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


def _masters(engine: Any) -> list[torch.Tensor]:
    """The fp32 master copies of megatron-core's mixed-precision optimizer (none for a plain torch optimizer).

    Saved and restored explicitly: what the optimizer's own state_dict does with them differs by release, and
    re-deriving them from the bf16 model would lose their low bits (resume would not be exact).
    """
    if engine.optimizer is None:
        return []
    from verl_mcore_utils.offload import master_params

    return master_params(engine.optimizer)


def _restore_masters(engine: Any, tensors: Mapping[str, torch.Tensor], *, file: Path) -> None:
    masters = _masters(engine)
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


# ----------------------------------------------------------------------------------------------- files
def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json(path: Path, payload: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as f:
        json.dump(payload, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _gather(obj: Any) -> list[Any]:
    if not dist.is_initialized():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)  # our own ranks' file digests, at save time (never at load)
    return out


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
    rank = _rank()
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob("global_step_*.tmp"):  # saves that died before their rename: never loadable
            shutil.rmtree(stale)
        tmp.mkdir()
    _barrier()

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
        for i, master in enumerate(_masters(engine)):
            tensors[f"master/{i}"] = master.detach().to("cpu").contiguous()
        skeleton["optimizer"] = _flatten(_optimizer_state(engine), "optimizer", tensors)
    skeleton["rng"] = _flatten(_rng_state(), "rng", tensors)
    file = tmp / f"rank_{rank:05d}.safetensors"
    save_file(tensors, str(file), metadata={"skeleton": json.dumps(skeleton)})
    digests = _gather({"file": file.name, "bytes": file.stat().st_size, "sha256": _sha256(file)})
    # the model (or its LoRA adapter) in Hugging Face format, gathered over TP and PP (a collective; rank 0
    # writes): what another layout loads
    if not engine.value_model and engine.hf_config is not None:
        engine.save_hf(str(tmp / ("hf" if _lora_meta(engine) is None else "lora_adapter")))
    _barrier()
    if rank == 0:
        files = {d["file"]: {"bytes": d["bytes"], "sha256": d["sha256"]} for d in digests}
        for sub in ("hf", "lora_adapter"):
            for f in sorted((tmp / sub).glob("*")) if (tmp / sub).is_dir() else []:
                files[f"{sub}/{f.name}"] = {"bytes": f.stat().st_size, "sha256": _sha256(f)}
        meta = {
            "format": FORMAT,
            "global_step": global_step,
            "data_position": data_position,
            "layout": _layout(engine),
            "lr_schedule": None if engine.lr_schedule is None else engine.lr_schedule.state_dict(),
            "files": files,
            "has_hf": (tmp / "hf").is_dir(),
            "has_adapter": (tmp / "lora_adapter").is_dir(),
            "lora": _lora_meta(engine),
        }
        _write_json(tmp / "meta.json", meta)  # last: a step directory without it is incomplete
        _fsync_dir(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(root)
        _write_json(root / LATEST_FILE, {"global_step": global_step})
        if max_ckpt_to_keep is not None:
            _prune(root, keep=max_ckpt_to_keep)
    _barrier()
    return final


def _complete_steps(root: Path) -> list[int]:
    steps = []
    for d in root.glob("global_step_*"):
        suffix = d.name.removeprefix("global_step_")
        if suffix.isdigit() and (d / "meta.json").is_file():
            steps.append(int(suffix))
    return sorted(steps)


def _prune(root: Path, *, keep: int) -> None:
    for step in _complete_steps(root)[:-keep]:
        shutil.rmtree(step_dir(root, step))


# ----------------------------------------------------------------------------------------------- load
def _resolve(path: Path) -> Path:
    """A step directory, or the step the root's latest marker names."""
    if (path / "meta.json").is_file():
        return path
    marker = path / LATEST_FILE
    if not marker.is_file():
        raise CheckpointError(
            f"{path} is neither a checkpoint step directory (no meta.json) nor a checkpoint root (no {LATEST_FILE})"
        )
    try:
        step = json.loads(marker.read_text())["global_step"]
    except (ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"{marker} is not a latest-step marker written by verl-engine: {err}") from None
    found = step_dir(path, int(step))
    if not (found / "meta.json").is_file():
        raise CheckpointError(f"{marker} names step {step} but {found}/meta.json does not exist")
    return found


def _read_meta(directory: Path) -> dict[str, Any]:
    file = directory / "meta.json"
    try:
        meta = json.loads(file.read_text())
    except ValueError as err:
        raise CheckpointError(f"{file} is not valid JSON ({err}); the checkpoint is damaged") from None
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{file}: format {meta.get('format')!r}, expected {FORMAT!r}")
    return meta


def _verified(directory: Path, meta: Mapping[str, Any], name: str) -> Path:
    file = directory / name
    expected = meta["files"].get(name)
    if expected is None:
        raise CheckpointError(
            f"{directory}/meta.json lists no {name} (the checkpoint has {sorted(meta['files'])})"
        )
    if not file.is_file():
        raise CheckpointError(f"{file} is missing")
    size = file.stat().st_size
    if size != expected["bytes"] or _sha256(file) != expected["sha256"]:
        raise CheckpointError(
            f"{file} does not match meta.json ({size} bytes, expected {expected['bytes']}; or a different SHA-256):"
            " the file is truncated or was modified"
        )
    return file


def _read_rank_file(file: Path) -> tuple[dict[str, torch.Tensor], Any]:
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


def load_checkpoint(
    engine: Any, path: str | os.PathLike[str], *, load_optimizer: bool = True
) -> dict[str, Any]:
    """Restore a checkpoint into ``engine`` (every rank calls it); returns ``{"global_step", "data_position"}``.

    ``path`` is a step directory or a root with a latest marker. At the saved model layout (TP, PP, virtual
    PP, backend; the DP x CP pool may differ) parameters, optimizer state, LR schedule and RNG states are
    restored exactly. At another layout only the model can be restored, from the Hugging Face copy:
    ``load_optimizer=False`` says so; otherwise it is an error naming both layouts.
    """
    from verl_mcore_utils.weights import load_hf_weights

    directory = _resolve(Path(path))
    meta = _read_meta(directory)
    if meta.get("lora") != _lora_meta(engine):
        raise CheckpointError(
            f"{directory} was saved with LoRA {meta.get('lora') or 'off'}; this engine has LoRA"
            f" {_lora_meta(engine) or 'off'}: build the engine with the checkpoint's model.lora settings"
        )
    saved, current = meta["layout"], _layout(engine)
    same = _model_layout(saved) == _model_layout(current)
    if engine.megatron_fsdp and not (same and load_optimizer):
        raise CheckpointError(
            f"{directory}: a Megatron-FSDP engine resumes only at the saved layout, model and optimizer shards"
            f" together (load_optimizer=True); to start from the model alone, build the engine with"
            f" model.path={directory / 'hf'}"
        )
    if not same:
        if load_optimizer:
            raise CheckpointError(
                f"{directory} was saved at TP={saved['tensor_model_parallel_size']},"
                f" PP={saved['pipeline_model_parallel_size']}, VPP={saved['virtual_pipeline_model_parallel_size']}"
                f" ({saved['backend']}); this engine runs TP={current['tensor_model_parallel_size']},"
                f" PP={current['pipeline_model_parallel_size']}, VPP={current['virtual_pipeline_model_parallel_size']}"
                f" ({current['backend']}). Optimizer and RNG states are per rank and cannot change layout: load with"
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
                _verified(directory, meta, name)
        if meta.get("lora"):
            from verl_mcore_utils.lora import load_hf_adapter

            load_hf_adapter(engine.chunks, directory / sub, hf_config=engine.hf_config)
        else:
            load_hf_weights(engine.chunks, directory / sub, hf_config=engine.hf_config)
        return {"global_step": meta["global_step"], "data_position": meta["data_position"]}

    sharded = saved.get("distributed_optimizer_dp"), current["distributed_optimizer_dp"]
    if load_optimizer and sharded[0] != sharded[1]:
        raise CheckpointError(
            f"{directory} holds optimizer state {_sharding(sharded[0])}; this engine's is {_sharding(sharded[1])}."
            " The distributed optimizer's shards follow the DP size: resume at the saved DP size and"
            " megatron.use_distributed_optimizer setting, or load with load_optimizer=False (model only)"
        )
    # the rank that held this rank's model shard: same model-parallel position; the pool replicates it
    rank = _rank()
    name = f"rank_{rank:05d}.safetensors"
    if name not in meta["files"]:  # a smaller or larger DP x CP pool: any replica of this shard will do
        name = f"rank_{_replica_rank(saved, current, rank):05d}.safetensors"
    tensors, skeleton = _read_rank_file(_verified(directory, meta, name))
    if engine.megatron_fsdp:
        from verl_mfsdp.local_state import load_megatron_fsdp_local_state

        if "fsdp" not in skeleton:
            raise CheckpointError(f"{directory / name} holds no Megatron-FSDP state")
        try:
            load_megatron_fsdp_local_state(
                engine.chunks,
                engine.optimizer,
                tensors={k.removeprefix("fsdp/"): v for k, v in tensors.items() if k.startswith("fsdp/")},
                description=skeleton["fsdp"],
                source=str(directory / name),
            )
        except ValueError as err:
            raise CheckpointError(str(err)) from None
        _restore_schedule_and_rng(engine, meta, skeleton, tensors)
        return {"global_step": meta["global_step"], "data_position": meta["data_position"]}
    params = _params(engine)
    stored = {k.removeprefix("param/") for k in tensors if k.startswith("param/")}
    if stored != set(params):
        missing, extra = sorted(set(params) - stored), sorted(stored - set(params))
        raise CheckpointError(
            f"{directory / name} does not hold this model's parameters: missing {missing[:8]}, unexpected {extra[:8]}"
        )
    with torch.no_grad():
        for pname, param in params.items():
            value = tensors[f"param/{pname}"]
            if value.shape != param.shape or value.dtype != param.dtype:
                raise CheckpointError(
                    f"{directory / name}: parameter {pname!r} is {value.dtype} {tuple(value.shape)}, the model's is"
                    f" {param.dtype} {tuple(param.shape)}"
                )
            param.copy_(value)
    if load_optimizer:
        state = _unflatten(skeleton["optimizer"], tensors)
        if (state is None) != (engine.optimizer is None):
            raise CheckpointError(
                f"{directory}: the checkpoint has {'no' if state is None else 'an'} optimizer state but this engine"
                f" has {'an' if engine.optimizer is not None else 'no'} optimizer"
            )
        if state is not None:
            _load_optimizer_state(engine, state, file=directory / name)
            _restore_masters(engine, tensors, file=directory / name)
        _restore_schedule_and_rng(engine, meta, skeleton, tensors)
    return {"global_step": meta["global_step"], "data_position": meta["data_position"]}


def _restore_schedule_and_rng(
    engine: Any, meta: Mapping[str, Any], skeleton: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]
) -> None:
    if engine.lr_schedule is not None and meta["lr_schedule"] is not None:
        engine.lr_schedule.load_state_dict(meta["lr_schedule"])
    _set_rng_state(_unflatten(skeleton["rng"], tensors))


def _sharding(dp: int | None) -> str:
    return "not sharded" if dp is None else f"sharded over DP={dp} (distributed optimizer)"


def _replica_rank(saved: Mapping[str, Any], current: Mapping[str, Any], rank: int) -> int:
    """The saved rank with this rank's TP / PP position (megatron-core's rank order: TP fastest, then DP x CP,
    then PP)."""
    tp, pp = current["tensor_model_parallel_size"], current["pipeline_model_parallel_size"]
    pool_now = current["world_size"] // (tp * pp)
    pool_then = saved["world_size"] // (tp * pp)
    tp_rank, pp_rank = rank % tp, rank // (tp * pool_now)
    return pp_rank * tp * pool_then + tp_rank  # pool position 0 of the saved run
