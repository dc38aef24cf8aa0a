"""Load a Hugging Face safetensors checkpoint into a (TP-sharded, PP-stage) megatron-core GPTModel."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from verl_mcore_utils.weights.chunks import (
    MTP_PREFIXES,
    local_megatron_params,
    model_parallel_groups,
    unwrap_model_chunks,
)
from verl_mcore_utils.weights.experts import expert_groups
from verl_mcore_utils.weights.fused import hf_to_megatron, tp_shard
from verl_mcore_utils.weights.names import MTP_SHARED_SUFFIXES, HFDims, as_dims, few_names, hf_tensor_shapes

# Checkpoint tensors that are not weights of the model and are skipped on load: old Llama checkpoints
# saved the rotary ``inv_freq`` buffer, which megatron recomputes from rope_theta.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


class _Source:
    """Read access to named tensors, from a Mapping or a safetensors checkpoint directory / file."""

    def __init__(
        self, source: str | os.PathLike[str] | Mapping[str, torch.Tensor], stack: contextlib.ExitStack
    ):
        self._mapping: Mapping[str, torch.Tensor] | None = None
        self._files: dict[str, Any] = {}
        self._where: dict[str, Path] = {}
        if isinstance(source, Mapping):
            self._mapping = source
            return
        from safetensors import safe_open

        path = Path(source)
        if path.is_file():
            files = [path]
            index = None
        elif path.is_dir():
            index_path = path / "model.safetensors.index.json"
            index = json.loads(index_path.read_text())["weight_map"] if index_path.exists() else None
            files = (
                sorted({path / f for f in index.values()}) if index else sorted(path.glob("*.safetensors"))
            )
        else:
            raise FileNotFoundError(f"weight source {str(path)!r} does not exist")
        if not files:
            raise FileNotFoundError(
                f"no *.safetensors in {str(path)!r} (only safetensors checkpoints are read; convert .bin first)"
            )
        for file in files:
            if not file.exists():
                raise FileNotFoundError(f"{str(file)!r}, listed in the checkpoint index, does not exist")
            handle = stack.enter_context(safe_open(str(file), framework="pt", device="cpu"))
            self._files[str(file)] = handle
            for key in handle.keys():
                if key in self._where:
                    raise ValueError(f"tensor {key!r} is in both {self._where[key].name} and {file.name}")
                if index is not None and index.get(key) != file.name:
                    raise ValueError(
                        f"tensor {key!r} is in {file.name} but the index says {index.get(key)!r}"
                    )
                self._where[key] = file
        if index is not None and set(index) != set(self._where):
            missing = sorted(set(index) - set(self._where))
            raise ValueError(
                f"tensors listed in the index are absent from the shard files: {few_names(missing)}"
            )

    def names(self) -> set[str]:
        return set(self._mapping) if self._mapping is not None else set(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        if self._mapping is not None:
            return tuple(self._mapping[name].shape)
        return tuple(self._files[str(self._where[name])].get_slice(name).get_shape())

    def get(self, name: str) -> torch.Tensor:
        if self._mapping is not None:
            return self._mapping[name]
        return self._files[str(self._where[name])].get_tensor(name)


def mtp_tensor_prefixes(hf_config: Mapping[str, Any] | Any) -> tuple[str, ...]:
    """Where a checkpoint keeps the multi-token-prediction layers its config declares (none: no prefix, so such
    tensors stay unexpected): DeepSeek-V3 / GLM-4.5 as extra decoder layers ``model.layers.<num_hidden_layers +
    k>.``, MiMo as ``model.mtp_layers.``. transformers skips them on load."""
    from verl_mcore_utils.transformer_config import hf_get, hf_mtp_num_layers

    mtp = hf_mtp_num_layers(hf_config)
    if not mtp:
        return ()
    layers = int(hf_get(hf_config, "num_hidden_layers"))
    return (*(f"model.layers.{layers + k}." for k in range(mtp)), "model.mtp_layers.")


def _check_source(src: _Source, dims: HFDims, *, mtp_prefixes: tuple[str, ...], builds_mtp: bool) -> bool:
    """Name set and shapes of the whole checkpoint against hf_config (same verdict on every rank); returns
    whether the checkpoint's multi-token-prediction layers are to be loaded.

    A checkpoint's MTP layers are all there or absent (transformers drops them when it saves). Absent, or the
    model has no MTP block: skipped, as transformers does, and MTP layers keep their initialisation. Present and
    built: checked like the rest and loaded, except the tensors an MTP layer shares with the model
    (``MTP_SHARED_SUFFIXES``). Present, built, but of a layout we have no table for: refused, rather than start
    the MTP layers from initialisation while the checkpoint has trained weights for them.
    """
    names = {n for n in src.names() if not n.endswith(_IGNORED_SUFFIXES)}
    mtp = sorted(n for n in names if n.startswith(mtp_prefixes))
    load_mtp = bool(mtp) and builds_mtp
    if load_mtp and not dims.mtp_layers:
        raise NotImplementedError(
            f"the checkpoint holds multi-token-prediction layer weights ({few_names(mtp)}) in a layout verl-mcore-utils"
            f" cannot map for model_type {dims.model_type!r} (GLM-4.5's model.layers.<num_hidden_layers + k> is"
            " supported); they would start from initialisation instead: set actor_rollout_ref.model.mtp.enable=false"
            " (the checkpoint's MTP tensors are then skipped, as transformers does)"
        )
    if not load_mtp:
        names -= set(mtp)
    else:
        names -= {n for n in mtp if n.endswith(MTP_SHARED_SUFFIXES)}
    expected = hf_tensor_shapes(hf_config=dims, mtp=load_mtp)
    if dims.tie_word_embeddings:
        names.discard("lm_head.weight")  # some tied checkpoints store the (identical) head anyway
    missing = sorted(set(expected) - names)
    unexpected = sorted(names - set(expected))
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing tensors: {few_names(missing)}")
        if unexpected:
            parts.append(f"unexpected tensors: {few_names(unexpected)}")
        raise ValueError(f"checkpoint does not match the {dims.model_type} config: " + "; ".join(parts))
    for name, shape in expected.items():
        got = src.shape(name)
        if got != shape:
            raise ValueError(f"tensor {name!r} has shape {got} in the checkpoint; the config implies {shape}")
    return load_mtp


@torch.no_grad()
def load_hf_weights(
    model_chunks: torch.nn.Module | Sequence[torch.nn.Module],
    source: str | os.PathLike[str] | Mapping[str, torch.Tensor],
    *,
    hf_config: Mapping[str, Any] | Any,
) -> None:
    """Fill a (TP-sharded, PP-stage, possibly wrapped) megatron GPTModel from Hugging Face tensors.

    ``source`` is a safetensors checkpoint directory (single file or sharded with
    ``model.safetensors.index.json``), a single ``.safetensors`` file, or a Mapping name -> tensor. Each
    rank reads only the tensors of its own PP layers and keeps only its own TP slice, so no communication
    is needed. Strict, because a silently half-loaded model trains without error: the checkpoint must hold
    exactly the tensors ``hf_config`` implies (``*.rotary_emb.inv_freq`` buffers and, when tied, a
    redundant ``lm_head.weight`` are ignored), with the implied shapes, and every parameter of the model
    must have a counterpart. Values are copied into the existing parameters (their dtype and device are
    kept). If megatron padded the vocabulary (vocab rows x TP > vocab_size), the padding rows are zeros.
    A value head (critic / reward model, :class:`~verl_mcore_utils.module.ValueHead` in place of the output
    layer) has no counterpart in a causal-LM checkpoint: it keeps its own initialisation, the backbone is
    loaded, and the checkpoint's ``lm_head.weight`` is read by no parameter. A checkpoint's multi-token-prediction
    layers (:func:`mtp_tensor_prefixes`) are loaded into the model's MTP block when it has one (GLM-4.5's
    layout; others are refused by name) and skipped when it has none or the checkpoint has no MTP tensors (the
    MTP layers then keep their initialisation).

    With a distributed optimizer, reload its fp32 main copies from the model afterwards.
    """
    from verl_mcore_utils.module import ValueHead

    dims = as_dims(hf_config)
    chunks = unwrap_model_chunks(model_chunks)
    all_groups = model_parallel_groups()
    experts = expert_groups()
    heads = {
        id(p)
        for c in chunks
        if isinstance(getattr(c, "output_layer", None), ValueHead)
        for p in c.output_layer.parameters()
    }
    local = {k: v for k, v in local_megatron_params(chunks, dims).items() if id(v[1]) not in heads}
    with contextlib.ExitStack() as stack:
        src = _Source(source, stack)
        builds_mtp = any(n.startswith(MTP_PREFIXES) for c in chunks for n, _ in c.named_parameters())
        load_mtp = _check_source(
            src, dims, mtp_prefixes=mtp_tensor_prefixes(hf_config), builds_mtp=builds_mtp
        )
        for meg_name, (mapping, param) in local.items():
            if meg_name.startswith("mtp.") and not load_mtp:
                continue
            groups = experts.for_param(meg_name, all_groups)  # experts: split over ETP
            full = hf_to_megatron(mapping, [src.get(n) for n in mapping.hf_names], hf_config=dims)
            if mapping.vocab_parallel:
                padded = param.shape[0] * groups.tp_size
                if padded < full.shape[0]:
                    raise ValueError(
                        f"megatron parameter {meg_name!r} has {padded} vocabulary rows over TP={groups.tp_size};"
                        f" the checkpoint has {full.shape[0]}"
                    )
                if padded > full.shape[0]:
                    full = torch.cat([full, full.new_zeros(padded - full.shape[0], *full.shape[1:])])
            if mapping.tp_dim is not None and full.shape[mapping.tp_dim] % groups.tp_size:
                raise ValueError(
                    f"megatron parameter {meg_name!r}: dim {mapping.tp_dim} of {tuple(full.shape)} is not"
                    f" divisible by TP={groups.tp_size}"
                )
            shard = tp_shard(full, mapping, groups.tp_rank, groups.tp_size)
            if shard.shape != param.shape:
                raise ValueError(
                    f"megatron parameter {meg_name!r} has shape {tuple(param.shape)} but its TP slice of "
                    f"{', '.join(mapping.hf_names)} has {tuple(shard.shape)}; was the model built from another config?"
                )
            param.copy_(shard)
