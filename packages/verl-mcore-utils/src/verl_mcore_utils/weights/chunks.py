"""This rank's megatron parameters by global name, and its tensor / pipeline-parallel groups."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel

from verl_mcore_utils.grouped_experts import expert_weight_views
from verl_mcore_utils.weights.experts import expert_groups
from verl_mcore_utils.weights.names import MTP_LAYER, TIED_OUTPUT, HFDims, ParamMapping, param_mappings


def unwrap_model_chunks(model_chunks: torch.nn.Module | Sequence[torch.nn.Module]) -> list[GPTModel]:
    """The GPTModel inside each chunk, peeling wrappers (DDP, Float16Module, ...) through ``.module``.

    Accepts one module, a list of chunks (virtual pipeline) or an ``nn.ModuleList`` of them.
    """
    single = isinstance(model_chunks, torch.nn.Module) and not isinstance(model_chunks, torch.nn.ModuleList)
    chunks: list[torch.nn.Module] = (
        [cast(torch.nn.Module, model_chunks)]
        if single
        else list(cast(Iterable[torch.nn.Module], model_chunks))
    )
    if not chunks:
        raise ValueError("model_chunks is empty")
    out = []
    for chunk in chunks:
        inner = chunk
        while not isinstance(inner, GPTModel) and isinstance(getattr(inner, "module", None), torch.nn.Module):
            inner = inner.module  # type: ignore[assignment]  # a Module: checked by the loop condition
        if not isinstance(inner, GPTModel):
            raise TypeError(
                f"expected a megatron-core GPTModel (possibly wrapped), got {type(chunk).__name__}"
            )
        out.append(inner)
    return out


@dataclass(frozen=True)
class ModelParallelGroups:
    tp_rank: int
    tp_size: int
    tp_group: Any
    pp_rank: int
    pp_size: int
    pp_group: Any


def model_parallel_groups() -> ModelParallelGroups:
    if not parallel_state.model_parallel_is_initialized():
        return ModelParallelGroups(0, 1, None, 0, 1, None)
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    if isinstance(pp_group, list):
        raise NotImplementedError(
            "several pipeline groups per rank (encoder-decoder layouts) are not supported"
        )
    return ModelParallelGroups(
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        tp_size=parallel_state.get_tensor_model_parallel_world_size(),
        tp_group=parallel_state.get_tensor_model_parallel_group(),
        pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
        pp_size=parallel_state.get_pipeline_model_parallel_world_size(),
        pp_group=pp_group,
    )


_LAYER_NAME = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
# megatron-core 0.14 to 0.16 name an MTP layer's decoder layer ``transformer_layer``, 0.17+ ``mtp_model_layer``
_MTP_LAYER_NAME = re.compile(r"^(mtp\.layers\.\d+)\.transformer_layer\.")


# megatron-core's MultiTokenPredictionBlock (GPTModel.mtp) and, with pipeline stages, the last stage's copy of the
# word embedding for it (GPTModel.mtp_embedding, kept equal to the first stage's by verl_mcore_utils.mtp)
MTP_PREFIXES = ("mtp.", "mtp_embedding.")


def local_megatron_params(
    chunks: Sequence[GPTModel], dims: HFDims
) -> dict[str, tuple[ParamMapping, torch.Tensor]]:
    """This rank's parameters by global megatron name, each with its mapping; unmapped ones are errors.

    Public so that other exporters (verl_mfsdp) walk the same name table instead of a copy of it.
    Multi-token-prediction layers (``mtp.layers.*``, see :mod:`verl_mcore_utils.mtp`) are included when the
    Hugging Face config declares them (GLM-4.5: :func:`~verl_mcore_utils.weights.names.mtp_param_mappings`), under
    ``mtp.layers.<k>.mtp_model_layer.*`` whatever the megatron-core version; otherwise (Qwen / Llama with MTP
    layers of the engine's own) they are left out: no checkpoint has a place for them. The last stage's copy
    of the embedding (``mtp_embedding``) is never a weight of its own. With expert parallelism local experts
    are named by their global index (:mod:`verl_mcore_utils.weights.experts`).
    """
    experts = expert_groups()
    table = {m.megatron_name: m for m in param_mappings(hf_config=dims, mtp=True)}
    if dims.tie_word_embeddings:
        table[TIED_OUTPUT.megatron_name] = TIED_OUTPUT
    out: dict[str, tuple[ParamMapping, torch.Tensor]] = {}
    for index, chunk in enumerate(chunks):
        for name, param in [*chunk.named_parameters(), *expert_bias_buffers(chunk)]:
            if name.startswith(MTP_PREFIXES) and not (dims.mtp_layers and name.startswith("mtp.layers.")):
                continue
            global_name = _MTP_LAYER_NAME.sub(rf"\1.{MTP_LAYER}.", name)
            match = _LAYER_NAME.match(name)
            if match:
                layer = chunk.decoder.layers[int(match.group(1))]
                global_name = f"decoder.layers.{layer.layer_number - 1}.{match.group(2)}"
            views = expert_weight_views(global_name, param)
            if views is not None:  # stacked experts: one entry per expert slice, SequentialMLP's names
                for view_name, view in views:
                    view_name = experts.global_name(view_name, num_experts=dims.num_experts)
                    _add(out, table, view_name, view, index, name, dims)
                continue
            global_name = experts.global_name(global_name, num_experts=dims.num_experts)
            _add(out, table, global_name, param, index, name, dims)
    return out


def expert_bias_buffers(chunk: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The routers' expert biases (DeepSeek-V3 / GLM-4.5 ``e_score_correction_bias``): buffers, not parameters
    (no gradient; megatron-core moves them after each step), but weights of the checkpoint all the same."""
    return [(n, b) for n, b in chunk.named_buffers() if n.endswith(".router.expert_bias") and b is not None]


def _add(
    out: dict[str, tuple[ParamMapping, torch.Tensor]],
    table: dict[str, ParamMapping],
    global_name: str,
    param: torch.Tensor,
    index: int,
    name: str,
    dims: HFDims,
) -> None:
    """Record ``param`` under ``global_name`` with its table entry; an unmapped or repeated name is an error."""
    mapping = table.get(global_name)
    if mapping is None:
        raise ValueError(
            f"megatron parameter {global_name!r} (chunk {index}, local name {name!r}) has no Hugging Face"
            f" counterpart for {dims.model_type} with this config (num_hidden_layers={dims.num_layers},"
            f" qkv_bias={dims.qkv_bias}, qk_norm={dims.qk_norm}); was the model built from another config?"
        )
    if global_name in out:
        raise ValueError(f"megatron parameter {global_name!r} appears in two model chunks")
    out[global_name] = (mapping, param)


def full_shape(param: torch.Tensor, mapping: ParamMapping, tp_size: int) -> tuple[int, ...]:
    shape = list(param.shape)
    if mapping.tp_dim is not None:
        shape[mapping.tp_dim] *= tp_size
    return tuple(shape)
