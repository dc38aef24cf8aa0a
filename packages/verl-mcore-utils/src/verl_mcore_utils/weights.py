"""Hugging Face weights <-> megatron-core GPTModel (dense Qwen2 / Qwen3 / Llama): load, export, save.

Why this module exists: a trainer starts from a Hugging Face checkpoint and must hand its weights back in
Hugging Face names (to a rollout engine, or to disk). megatron-core stores the same numbers differently:
q/k/v are one fused ``linear_qkv`` interleaved per query group, gate/up are one ``linear_fc1``, layer norms
live under other names, and every tensor may be split over tensor-parallel (TP) ranks and its layer over
pipeline-parallel (PP) stages. Everything that knows these facts is here, in one table, so that a LoRA
adapter exporter can reuse the same names and the same fused-tensor helpers.

Conventions used throughout:

* A *full megatron tensor* is what one megatron parameter would hold with TP size 1 and the model's own
  (possibly padded) vocabulary. Its layout does not depend on the TP size, so it is what PP stages send
  to each other. QKV rows: ``[q heads of group 0, k0, v0, q heads of group 1, k1, v1, ...]``; fc1 rows:
  ``[gate; up]``.
* TP slicing: column-parallel weights (``linear_qkv``, ``linear_fc1``, embedding and output layer by
  vocabulary rows) split dim 0; row-parallel weights (``linear_proj``, ``linear_fc2``) split dim 1;
  norms are replicated. ``linear_fc1`` is the exception to plain slicing: each rank holds
  ``[gate shard; up shard]``, so gate and up are sliced separately.
* Layers are named by their global index: a megatron ``TransformerLayer.layer_number`` (1-based, with the
  PP / virtual-PP offset already added by megatron-core in every supported release) minus one.

Process groups come from ``megatron.core.parallel_state`` (what :func:`verl_mcore_utils.parallel.init_parallel`
sets up); models built with custom process-group collections are not supported here.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel

from verl_mcore_utils.transformer_config import SUPPORTED_MODEL_TYPES, hf_get

__all__ = [
    "LAYER_MODULE_MAP",
    "Fusion",
    "HFDims",
    "ParamMapping",
    "bucket_tensors",
    "export_hf_weights",
    "hf_tensor_shapes",
    "hf_to_megatron",
    "layer_param_mappings",
    "load_hf_weights",
    "local_megatron_params",
    "megatron_to_hf",
    "merge_gate_up",
    "merge_qkv",
    "param_mappings",
    "save_hf_weights",
    "split_gate_up",
    "split_qkv",
    "tp_unshard",
    "unwrap_model_chunks",
]

Fusion = Literal["none", "qkv", "gate_up"]

# Checkpoint tensors that are not weights of the model and are skipped on load: old Llama checkpoints
# saved the rotary ``inv_freq`` buffer, which megatron recomputes from rope_theta.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


# --------------------------------------------------------------------------------------------------
# The name table
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ParamMapping:
    """One megatron-core parameter and the Hugging Face tensor(s) whose numbers it holds.

    ``megatron_name`` is the name inside a GPTModel with the *global* layer index; ``hf_names`` are full
    Hugging Face names, in the order the fused helpers take them (q, k, v / gate, up). ``tp_dim`` is the
    dimension split over TP ranks (None: replicated) and ``vocab_parallel`` marks vocabulary-row tensors,
    which megatron may pad.
    """

    megatron_name: str
    hf_names: tuple[str, ...]
    fusion: Fusion = "none"
    tp_dim: int | None = None
    vocab_parallel: bool = False


# (megatron suffix inside a TransformerLayer, HF suffixes inside model.layers.{i}, fusion, TP dim, needs)
# ``needs`` names the HFDims flag that must be true for the tensor to exist.
_LAYER_TABLE: tuple[tuple[str, tuple[str, ...], Fusion, int | None, str | None], ...] = (
    ("input_layernorm.weight", ("input_layernorm.weight",), "none", None, None),
    (
        "self_attention.linear_qkv.weight",
        ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
        "qkv",
        0,
        None,
    ),
    (
        "self_attention.linear_qkv.bias",
        ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
        "qkv",
        0,
        "qkv_bias",
    ),
    ("self_attention.q_layernorm.weight", ("self_attn.q_norm.weight",), "none", None, "qk_norm"),
    ("self_attention.k_layernorm.weight", ("self_attn.k_norm.weight",), "none", None, "qk_norm"),
    ("self_attention.linear_proj.weight", ("self_attn.o_proj.weight",), "none", 1, None),
    ("pre_mlp_layernorm.weight", ("post_attention_layernorm.weight",), "none", None, None),
    ("mlp.linear_fc1.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"), "gate_up", 0, None),
    ("mlp.linear_fc2.weight", ("mlp.down_proj.weight",), "none", 1, None),
)

#: megatron linear module inside a TransformerLayer -> the Hugging Face linear modules it fuses, in the
#: order of the fused rows. This is what a LoRA adapter exporter renames (``lora_A`` / ``lora_B`` of the
#: megatron module become those of each Hugging Face module).
LAYER_MODULE_MAP: Mapping[str, tuple[str, ...]] = {
    meg.removesuffix(".weight"): tuple(h.removesuffix(".weight") for h in hf)
    for meg, hf, _, tp_dim, _ in _LAYER_TABLE
    if tp_dim is not None and meg.endswith(".weight")
}

_EMBEDDING = ParamMapping("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "none", 0, True)
_FINAL_NORM = ParamMapping("decoder.final_layernorm.weight", ("model.norm.weight",))
_OUTPUT = ParamMapping("output_layer.weight", ("lm_head.weight",), "none", 0, True)
# With tied embeddings and PP > 1 the last stage keeps its own copy of the embedding as output_layer.weight:
# it is loaded from embed_tokens and never exported (the embedding itself is).
_TIED_OUTPUT = ParamMapping("output_layer.weight", ("model.embed_tokens.weight",), "none", 0, True)


@dataclass(frozen=True)
class HFDims:
    """The sizes of a dense decoder that the weight layouts depend on, read once from a Hugging Face config."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_query_groups: int
    head_dim: int
    qkv_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool

    @classmethod
    def from_hf_config(cls, hf_config: Mapping[str, Any] | Any) -> HFDims:
        """Read the dims; unsupported architectures fail here rather than with a shape error later."""
        model_type = hf_get(hf_config, "model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        attention_bias = bool(hf_get(hf_config, "attention_bias", False))
        if attention_bias and model_type != "qwen2":
            # Llama / Qwen3 put this bias on o_proj too, which the megatron model (add_bias_linear=False) lacks.
            raise ValueError(f"{model_type} with attention_bias=True (o_proj bias) is not supported")
        if bool(hf_get(hf_config, "mlp_bias", False)):
            raise ValueError("mlp_bias=True is not supported (the megatron model has add_bias_linear=False)")
        hidden = int(hf_get(hf_config, "hidden_size"))
        heads = int(hf_get(hf_config, "num_attention_heads"))
        return cls(
            model_type=model_type,
            vocab_size=int(hf_get(hf_config, "vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(hf_get(hf_config, "intermediate_size")),
            num_layers=int(hf_get(hf_config, "num_hidden_layers")),
            num_heads=heads,
            num_query_groups=int(hf_get(hf_config, "num_key_value_heads", None) or heads),
            head_dim=int(hf_get(hf_config, "head_dim", None) or hidden // heads),
            qkv_bias=model_type == "qwen2" or attention_bias,
            qk_norm=model_type == "qwen3",
            tie_word_embeddings=bool(hf_get(hf_config, "tie_word_embeddings", False)),
        )


def _as_dims(hf_config: Mapping[str, Any] | Any) -> HFDims:
    return hf_config if isinstance(hf_config, HFDims) else HFDims.from_hf_config(hf_config)


def layer_param_mappings(layer: int, *, hf_config: Mapping[str, Any] | Any) -> list[ParamMapping]:
    """The mappings of decoder layer ``layer`` (global 0-based index), in a fixed order."""
    dims = _as_dims(hf_config)
    out = []
    for meg, hf, fusion, tp_dim, needs in _LAYER_TABLE:
        if needs is not None and not getattr(dims, needs):
            continue
        out.append(
            ParamMapping(
                f"decoder.layers.{layer}.{meg}",
                tuple(f"model.layers.{layer}.{h}" for h in hf),
                fusion,
                tp_dim,
            )
        )
    return out


def param_mappings(*, hf_config: Mapping[str, Any] | Any) -> list[ParamMapping]:
    """Every mapping of the whole model in export order: embedding, layers 0..N-1, final norm, lm_head.

    With ``tie_word_embeddings`` there is no lm_head entry: Hugging Face ties it to embed_tokens.
    """
    dims = _as_dims(hf_config)
    out = [_EMBEDDING]
    for layer in range(dims.num_layers):
        out.extend(layer_param_mappings(layer, hf_config=dims))
    out.append(_FINAL_NORM)
    if not dims.tie_word_embeddings:
        out.append(_OUTPUT)
    return out


def hf_tensor_shapes(*, hf_config: Mapping[str, Any] | Any) -> dict[str, tuple[int, ...]]:
    """Every Hugging Face tensor a checkpoint of ``hf_config`` holds, with its shape (the strictness reference)."""
    d = _as_dims(hf_config)
    q, kv = d.num_heads * d.head_dim, d.num_query_groups * d.head_dim
    per_layer: dict[str, tuple[int, ...]] = {
        "input_layernorm.weight": (d.hidden_size,),
        "self_attn.q_proj.weight": (q, d.hidden_size),
        "self_attn.k_proj.weight": (kv, d.hidden_size),
        "self_attn.v_proj.weight": (kv, d.hidden_size),
        "self_attn.q_proj.bias": (q,),
        "self_attn.k_proj.bias": (kv,),
        "self_attn.v_proj.bias": (kv,),
        "self_attn.q_norm.weight": (d.head_dim,),
        "self_attn.k_norm.weight": (d.head_dim,),
        "self_attn.o_proj.weight": (d.hidden_size, q),
        "post_attention_layernorm.weight": (d.hidden_size,),
        "mlp.gate_proj.weight": (d.intermediate_size, d.hidden_size),
        "mlp.up_proj.weight": (d.intermediate_size, d.hidden_size),
        "mlp.down_proj.weight": (d.hidden_size, d.intermediate_size),
    }
    top = {
        "model.embed_tokens.weight": (d.vocab_size, d.hidden_size),
        "model.norm.weight": (d.hidden_size,),
        "lm_head.weight": (d.vocab_size, d.hidden_size),
    }
    shapes: dict[str, tuple[int, ...]] = {}
    for mapping in param_mappings(hf_config=d):
        for name in mapping.hf_names:
            shapes[name] = top[name] if name in top else per_layer[name.split(".", 3)[3]]
    return shapes


# --------------------------------------------------------------------------------------------------
# Fused tensors
# --------------------------------------------------------------------------------------------------


def _check_groups(num_heads: int, num_query_groups: int) -> int:
    if num_query_groups <= 0 or num_heads % num_query_groups:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_query_groups={num_query_groups}")
    return num_heads // num_query_groups


def merge_qkv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    num_heads: int,
    num_query_groups: int,
    head_dim: int,
) -> torch.Tensor:
    """Fuse q/k/v projections (weights or biases, rows = output features) into megatron's ``linear_qkv`` rows.

    megatron computes all heads of one query group from one contiguous block ``[q heads of the group, k, v]``
    so that a TP rank owning whole groups needs no communication; that is why the rows are interleaved
    per group rather than concatenated. Also valid on one TP shard if given per-partition head counts.
    """
    per_group = _check_groups(num_heads, num_query_groups)
    rest = q.shape[1:]
    expected = ((num_heads * head_dim, *rest), (num_query_groups * head_dim, *rest))
    if tuple(q.shape) != expected[0] or tuple(k.shape) != expected[1] or tuple(v.shape) != expected[1]:
        raise ValueError(
            f"q/k/v shapes {tuple(q.shape)}/{tuple(k.shape)}/{tuple(v.shape)} do not match "
            f"num_heads={num_heads}, num_query_groups={num_query_groups}, head_dim={head_dim}"
        )
    return torch.cat(
        (
            q.reshape(num_query_groups, per_group * head_dim, *rest),
            k.reshape(num_query_groups, head_dim, *rest),
            v.reshape(num_query_groups, head_dim, *rest),
        ),
        dim=1,
    ).reshape(-1, *rest)


def split_qkv(
    fused: torch.Tensor, *, num_heads: int, num_query_groups: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`merge_qkv`: megatron ``linear_qkv`` rows -> (q, k, v) in Hugging Face row order."""
    per_group = _check_groups(num_heads, num_query_groups)
    rows = num_query_groups * (per_group + 2) * head_dim
    if fused.shape[0] != rows:
        raise ValueError(
            f"fused QKV has {fused.shape[0]} rows; num_heads={num_heads}, num_query_groups={num_query_groups},"
            f" head_dim={head_dim} need {rows}"
        )
    rest = fused.shape[1:]
    grouped = fused.reshape(num_query_groups, (per_group + 2) * head_dim, *rest)
    q, k, v = torch.split(grouped, [per_group * head_dim, head_dim, head_dim], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def merge_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Fuse gate_proj / up_proj into megatron's ``linear_fc1`` rows ``[gate; up]`` (SwiGLU splits it in half).

    On TP shards apply it per rank to the rank's gate and up slices: a shard is ``[gate_r; up_r]``, not a
    slice of the full fused tensor.
    """
    if gate.shape != up.shape:
        raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} shapes differ")
    return torch.cat((gate, up), dim=0)


def split_gate_up(fused: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`merge_gate_up`: ``linear_fc1`` rows -> (gate, up)."""
    if fused.shape[0] % 2:
        raise ValueError(f"fused gate/up has an odd number of rows ({fused.shape[0]})")
    gate, up = torch.chunk(fused, 2, dim=0)
    return gate, up


def hf_to_megatron(
    mapping: ParamMapping, tensors: Sequence[torch.Tensor], *, hf_config: Mapping[str, Any] | Any
) -> torch.Tensor:
    """The full megatron tensor of ``mapping`` from its Hugging Face tensors (in ``mapping.hf_names`` order)."""
    d = _as_dims(hf_config)
    if mapping.fusion == "qkv":
        q, k, v = tensors
        return merge_qkv(
            q, k, v, num_heads=d.num_heads, num_query_groups=d.num_query_groups, head_dim=d.head_dim
        )
    if mapping.fusion == "gate_up":
        gate, up = tensors
        return merge_gate_up(gate, up)
    (tensor,) = tensors
    return tensor


def megatron_to_hf(
    mapping: ParamMapping, full: torch.Tensor, *, hf_config: Mapping[str, Any] | Any
) -> list[tuple[str, torch.Tensor]]:
    """Hugging Face (name, tensor) pairs of a full megatron tensor; vocabulary padding is cut off."""
    d = _as_dims(hf_config)
    if mapping.fusion == "qkv":
        parts: Sequence[torch.Tensor] = split_qkv(
            full, num_heads=d.num_heads, num_query_groups=d.num_query_groups, head_dim=d.head_dim
        )
    elif mapping.fusion == "gate_up":
        parts = split_gate_up(full)
    elif mapping.vocab_parallel:
        parts = (full[: d.vocab_size],)
    else:
        parts = (full,)
    return list(zip(mapping.hf_names, parts, strict=True))


def _tp_shard(full: torch.Tensor, mapping: ParamMapping, rank: int, size: int) -> torch.Tensor:
    """This TP rank's slice of a full megatron tensor."""
    if mapping.tp_dim is None or size == 1:
        return full
    if mapping.fusion == "gate_up":
        gate, up = split_gate_up(full)
        return merge_gate_up(gate.chunk(size, dim=0)[rank], up.chunk(size, dim=0)[rank])
    return full.chunk(size, dim=mapping.tp_dim)[rank]


def tp_unshard(parts: Sequence[torch.Tensor], mapping: ParamMapping) -> torch.Tensor:
    """Inverse of :func:`_tp_shard` over the TP ranks' slices, in rank order (public: wrappers that gather
    TP slices themselves, e.g. verl_mfsdp's Megatron-FSDP export, put them back in megatron's layout)."""
    if mapping.tp_dim is None or len(parts) == 1:
        return parts[0]
    if mapping.fusion == "gate_up":
        halves = [split_gate_up(p) for p in parts]
        return merge_gate_up(torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves]))
    return torch.cat(list(parts), dim=mapping.tp_dim)


# --------------------------------------------------------------------------------------------------
# Model side
# --------------------------------------------------------------------------------------------------


def unwrap_model_chunks(model_chunks: torch.nn.Module | Sequence[torch.nn.Module]) -> list[GPTModel]:
    """The GPTModel inside each chunk, peeling wrappers (DDP, Float16Module, ...) through ``.module``.

    Accepts one module, a list of chunks (virtual pipeline) or an ``nn.ModuleList`` of them.
    """
    single = isinstance(model_chunks, torch.nn.Module) and not isinstance(model_chunks, torch.nn.ModuleList)
    chunks = [model_chunks] if single else list(model_chunks)
    if not chunks:
        raise ValueError("model_chunks is empty")
    out = []
    for chunk in chunks:
        inner = chunk
        while not isinstance(inner, GPTModel) and isinstance(getattr(inner, "module", None), torch.nn.Module):
            inner = inner.module
        if not isinstance(inner, GPTModel):
            raise TypeError(
                f"expected a megatron-core GPTModel (possibly wrapped), got {type(chunk).__name__}"
            )
        out.append(inner)
    return out


@dataclass(frozen=True)
class _Groups:
    tp_rank: int
    tp_size: int
    tp_group: Any
    pp_rank: int
    pp_size: int
    pp_group: Any


def _groups() -> _Groups:
    if not parallel_state.model_parallel_is_initialized():
        return _Groups(0, 1, None, 0, 1, None)
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    if isinstance(pp_group, list):
        raise NotImplementedError(
            "several pipeline groups per rank (encoder-decoder layouts) are not supported"
        )
    return _Groups(
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        tp_size=parallel_state.get_tensor_model_parallel_world_size(),
        tp_group=parallel_state.get_tensor_model_parallel_group(),
        pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
        pp_size=parallel_state.get_pipeline_model_parallel_world_size(),
        pp_group=pp_group,
    )


_LAYER_NAME = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


# megatron-core's MultiTokenPredictionBlock (GPTModel.mtp) and, with pipeline stages, the last stage's copy of the
# word embedding for it (GPTModel.mtp_embedding, kept equal to the first stage's by verl_mcore_utils.mtp)
MTP_PREFIXES = ("mtp.", "mtp_embedding.")


def local_megatron_params(
    chunks: Sequence[GPTModel], dims: HFDims
) -> dict[str, tuple[ParamMapping, torch.Tensor]]:
    """This rank's parameters by global megatron name, each with its mapping; unmapped ones are errors.

    Public so that other exporters (verl_mfsdp) walk the same name table instead of a copy of it.
    Multi-token-prediction layers (``mtp.*``, see :mod:`verl_mcore_utils.mtp`) are left out: the supported
    Hugging Face architectures (Qwen2 / Qwen3 / Llama) have no MTP tensors (transformers drops them), so
    they keep their initialisation on load and are not exported to a rollout engine.
    """
    table = {m.megatron_name: m for m in param_mappings(hf_config=dims)}
    if dims.tie_word_embeddings:
        table[_TIED_OUTPUT.megatron_name] = _TIED_OUTPUT
    out: dict[str, tuple[ParamMapping, torch.Tensor]] = {}
    for index, chunk in enumerate(chunks):
        for name, param in chunk.named_parameters():
            if name.startswith(MTP_PREFIXES):
                continue
            global_name = name
            match = _LAYER_NAME.match(name)
            if match:
                layer = chunk.decoder.layers[int(match.group(1))]
                global_name = f"decoder.layers.{layer.layer_number - 1}.{match.group(2)}"
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
    return out


def _full_shape(param: torch.Tensor, mapping: ParamMapping, tp_size: int) -> tuple[int, ...]:
    shape = list(param.shape)
    if mapping.tp_dim is not None:
        shape[mapping.tp_dim] *= tp_size
    return tuple(shape)


# --------------------------------------------------------------------------------------------------
# Load
# --------------------------------------------------------------------------------------------------


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
            raise ValueError(f"tensors listed in the index are absent from the shard files: {_few(missing)}")

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


def _few(names: Sequence[str], limit: int = 12) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" ... ({len(names)} in all)" if len(names) > limit else "")


def _check_source(src: _Source, dims: HFDims) -> None:
    """Name set and shapes of the whole checkpoint against hf_config (same verdict on every rank)."""
    expected = hf_tensor_shapes(hf_config=dims)
    names = {n for n in src.names() if not n.endswith(_IGNORED_SUFFIXES)}
    if dims.tie_word_embeddings:
        names.discard("lm_head.weight")  # some tied checkpoints store the (identical) head anyway
    missing = sorted(set(expected) - names)
    unexpected = sorted(names - set(expected))
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing tensors: {_few(missing)}")
        if unexpected:
            parts.append(f"unexpected tensors: {_few(unexpected)}")
        raise ValueError(f"checkpoint does not match the {dims.model_type} config: " + "; ".join(parts))
    for name, shape in expected.items():
        got = src.shape(name)
        if got != shape:
            raise ValueError(f"tensor {name!r} has shape {got} in the checkpoint; the config implies {shape}")


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
    loaded, and the checkpoint's ``lm_head.weight`` is read by no parameter.

    With a distributed optimizer, reload its fp32 main copies from the model afterwards.
    """
    from verl_mcore_utils.module import ValueHead

    dims = _as_dims(hf_config)
    chunks = unwrap_model_chunks(model_chunks)
    groups = _groups()
    heads = {
        id(p)
        for c in chunks
        if isinstance(getattr(c, "output_layer", None), ValueHead)
        for p in c.output_layer.parameters()
    }
    local = {k: v for k, v in local_megatron_params(chunks, dims).items() if id(v[1]) not in heads}
    with contextlib.ExitStack() as stack:
        src = _Source(source, stack)
        _check_source(src, dims)
        for meg_name, (mapping, param) in local.items():
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
            shard = _tp_shard(full, mapping, groups.tp_rank, groups.tp_size)
            if shard.shape != param.shape:
                raise ValueError(
                    f"megatron parameter {meg_name!r} has shape {tuple(param.shape)} but its TP slice of "
                    f"{', '.join(mapping.hf_names)} has {tuple(shard.shape)}; was the model built from another config?"
                )
            param.copy_(shard)


# --------------------------------------------------------------------------------------------------
# Export
# --------------------------------------------------------------------------------------------------


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


@torch.no_grad()
def export_hf_weights(
    model_chunks: torch.nn.Module | Sequence[torch.nn.Module],
    *,
    hf_config: Mapping[str, Any] | Any,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hugging_face_name, full_tensor)`` for the whole model, one tensor at a time, on every rank.

    One tensor at a time so that a weight sync to a rollout engine never holds a second copy of the model.
    Each megatron parameter is all-gathered over the TP group by the stage that owns it and broadcast from
    that stage over the PP group, so every rank receives every tensor; fused QKV and gate/up are split back
    and vocabulary padding is cut off. With ``tie_word_embeddings`` no ``lm_head.weight`` is yielded
    (Hugging Face re-ties it to ``model.embed_tokens.weight`` on load).

    The order is fixed (embedding, layers in order, final norm, lm_head) and the same on every rank.
    Collectives run inside the generator: every rank of the model must iterate it to the end, in step.
    Tensors keep the parameters' dtype and device and may share memory with the parameters or with each
    other: clone before modifying, and copy before the next optimizer step if you keep them.
    """
    dims = _as_dims(hf_config)
    chunks = unwrap_model_chunks(model_chunks)
    groups = _groups()
    local = {
        name: entry
        for name, entry in local_megatron_params(chunks, dims).items()
        if entry[0] is not _TIED_OUTPUT
    }
    device = next(p for c in chunks for p in c.parameters()).device
    owned = {
        name: (_full_shape(param, mapping, groups.tp_size), str(param.dtype))
        for name, (mapping, param) in local.items()
    }
    # Which PP stage holds what: one object all-gather, so every rank can post matching broadcasts.
    if groups.pp_size > 1:
        by_stage: list[Any] = [None] * groups.pp_size
        dist.all_gather_object(by_stage, owned, group=groups.pp_group)
    else:
        by_stage = [owned]
    owners: dict[str, tuple[int, tuple[int, ...], str]] = {}
    for stage, stage_owned in enumerate(by_stage):
        for name, (shape, dtype) in stage_owned.items():
            if name in owners:
                raise ValueError(
                    f"megatron parameter {name!r} is held by PP stages {owners[name][0]} and {stage}"
                )
            owners[name] = (stage, shape, dtype)
    mappings = param_mappings(hf_config=dims)
    absent = [m.megatron_name for m in mappings if m.megatron_name not in owners]
    if absent:
        raise ValueError(f"no pipeline stage holds megatron parameters {_few(absent)}")

    for mapping in mappings:
        stage, shape, dtype = owners[mapping.megatron_name]
        if stage == groups.pp_rank:
            param = local[mapping.megatron_name][1].detach()
            if mapping.tp_dim is not None and groups.tp_size > 1:
                # Plain torch.distributed, not megatron's tensor_parallel gather helpers: those allocate
                # on torch.cuda.current_device(), which breaks gloo on CPU hosts.
                parts = [torch.empty_like(param) for _ in range(groups.tp_size)]
                dist.all_gather(parts, param.contiguous(), group=groups.tp_group)
                full = tp_unshard(parts, mapping)
            else:
                full = param
        else:
            full = torch.empty(shape, dtype=_dtype(dtype), device=device)
        if groups.pp_size > 1:
            full = full.contiguous()
            dist.broadcast(full, src=dist.get_global_rank(groups.pp_group, stage), group=groups.pp_group)
        for name, tensor in megatron_to_hf(mapping, full, hf_config=dims):
            yield name, tensor


def bucket_tensors(
    pairs: Iterable[tuple[str, torch.Tensor]], *, bucket_bytes: int, owned: bool = False
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group ``(name, tensor)`` pairs into lists of at most ``bucket_bytes`` (a bigger tensor alone), each
    tensor cloned so that the bucket owns it (the source may reuse or share memory), unless ``owned``: the
    source yields fresh tensors nobody else holds (a second copy would cost one more largest tensor)."""
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be a positive int (bytes per bucket), got {bucket_bytes!r}")
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in pairs:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor.detach() if owned else tensor.detach().clone()))
        size += nbytes
    if bucket:
        yield bucket


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
