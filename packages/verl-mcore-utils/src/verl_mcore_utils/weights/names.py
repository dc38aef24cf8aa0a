"""The name table: the Hugging Face tensors each megatron-core GPTModel parameter holds, and shapes."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from verl_mcore_utils.transformer_config import (
    MOE_MODEL_TYPES,
    SUPPORTED_MODEL_TYPES,
    hf_get,
    hf_mtp_num_layers,
    hf_num_experts,
)

Fusion = Literal["none", "qkv", "gate_up"]


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
    ("mlp.linear_fc1.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"), "gate_up", 0, "dense"),
    ("mlp.linear_fc2.weight", ("mlp.down_proj.weight",), "none", 1, "dense"),
)
# An MoE layer's MLP part: the router (Hugging Face ``mlp.gate``) and, per expert ``{e}``, megatron-core's
# sequential expert MLP (``local_experts.{e}``, one expert per slot without expert parallelism). Hugging Face
# checkpoints store experts one by one (transformers 5 fuses them in memory, not on disk).
_MOE_TABLE: tuple[tuple[str, tuple[str, ...], Fusion, int | None], ...] = (
    ("mlp.router.weight", ("mlp.gate.weight",), "none", None),
    (
        "mlp.experts.local_experts.{e}.linear_fc1.weight",
        ("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight"),
        "gate_up",
        0,
    ),
    ("mlp.experts.local_experts.{e}.linear_fc2.weight", ("mlp.experts.{e}.down_proj.weight",), "none", 1),
)
# DeepSeek-V3-style MoE layers (GLM-4.5) add the router's expert bias (a float32 buffer on both sides) and the
# shared experts (one MLP, no gate); see verl_mcore_utils.moe_glm.
_SHARED_TABLE: tuple[tuple[str, tuple[str, ...], Fusion, int | None], ...] = (
    ("mlp.router.expert_bias", ("mlp.gate.e_score_correction_bias",), "none", None),
    (
        "mlp.shared_experts.linear_fc1.weight",
        ("mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight"),
        "gate_up",
        0,
    ),
    ("mlp.shared_experts.linear_fc2.weight", ("mlp.shared_experts.down_proj.weight",), "none", 1),
)

#: megatron linear module inside a TransformerLayer -> the Hugging Face linear modules it fuses, in the
#: order of the fused rows. This is what a LoRA adapter exporter renames (``lora_A`` / ``lora_B`` of the
#: megatron module become those of each Hugging Face module).
LAYER_MODULE_MAP: Mapping[str, tuple[str, ...]] = {
    meg.removesuffix(".weight"): tuple(h.removesuffix(".weight") for h in hf)
    for meg, hf, _, tp_dim, _ in _LAYER_TABLE  # dense layers (LoRA targets no expert)
    if tp_dim is not None and meg.endswith(".weight")
}

_EMBEDDING = ParamMapping("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "none", 0, True)
_FINAL_NORM = ParamMapping("decoder.final_layernorm.weight", ("model.norm.weight",))
_OUTPUT = ParamMapping("output_layer.weight", ("lm_head.weight",), "none", 0, True)
# With tied embeddings and PP > 1 the last stage keeps its own copy of the embedding as output_layer.weight:
# it is loaded from embed_tokens and never exported (the embedding itself is).
TIED_OUTPUT = ParamMapping("output_layer.weight", ("model.embed_tokens.weight",), "none", 0, True)


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
    num_experts: int = 0
    moe_intermediate_size: int = 0
    first_dense_layers: int = 0  # GLM-4.5 / DeepSeek-V3 ``first_k_dense_replace``
    expert_bias: bool = False  # the router's ``e_score_correction_bias``
    shared_intermediate_size: int = 0  # all shared experts together, 0: none
    mtp_layers: int = 0  # multi-token-prediction layers stored as model.layers.<num_layers + k> (GLM-4.5)

    @property
    def dense(self) -> bool:
        return self.num_experts == 0

    def dense_layer(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` has a dense MLP (every layer of a dense model)."""
        return self.num_experts == 0 or layer < self.first_dense_layers

    @classmethod
    def from_hf_config(cls, hf_config: Mapping[str, Any] | Any) -> HFDims:
        """Read the dims; unsupported architectures fail here rather than with a shape error later."""
        model_type = hf_get(hf_config, "model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        attention_bias = bool(hf_get(hf_config, "attention_bias", False))
        if attention_bias and model_type not in ("qwen2", "glm4_moe"):
            # Llama / Qwen3 put this bias on o_proj too, which the megatron model (add_bias_linear=False) lacks.
            raise ValueError(f"{model_type} with attention_bias=True (o_proj bias) is not supported")
        if bool(hf_get(hf_config, "mlp_bias", False)):
            raise ValueError("mlp_bias=True is not supported (the megatron model has add_bias_linear=False)")
        hidden = int(hf_get(hf_config, "hidden_size"))
        heads = int(hf_get(hf_config, "num_attention_heads"))
        moe = model_type in MOE_MODEL_TYPES
        glm = model_type == "glm4_moe"
        shared = int(hf_get(hf_config, "n_shared_experts", 0) or 0) if glm else 0
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
            qk_norm=model_type in ("qwen3", "qwen3_moe") or bool(hf_get(hf_config, "use_qk_norm", False)),
            tie_word_embeddings=bool(hf_get(hf_config, "tie_word_embeddings", False)),
            num_experts=hf_num_experts(hf_config) if moe else 0,
            moe_intermediate_size=int(hf_get(hf_config, "moe_intermediate_size")) if moe else 0,
            first_dense_layers=int(hf_get(hf_config, "first_k_dense_replace", 0) or 0) if glm else 0,
            expert_bias=glm,
            shared_intermediate_size=shared * int(hf_get(hf_config, "moe_intermediate_size")) if glm else 0,
            mtp_layers=hf_mtp_num_layers(hf_config) if glm else 0,
        )


def as_dims(hf_config: Mapping[str, Any] | Any) -> HFDims:
    return hf_config if isinstance(hf_config, HFDims) else HFDims.from_hf_config(hf_config)


def _layer_mapping(
    layer: int, meg: str, hf: tuple[str, ...], fusion: Fusion, tp_dim: int | None, **fmt: int
) -> ParamMapping:
    """One row of a layer table for decoder layer ``layer``; ``fmt`` fills placeholders such as ``{e}``."""
    return ParamMapping(
        f"decoder.layers.{layer}.{meg.format(**fmt)}",
        tuple(f"model.layers.{layer}.{h.format(**fmt)}" for h in hf),
        fusion,
        tp_dim,
    )


def layer_param_mappings(layer: int, *, hf_config: Mapping[str, Any] | Any) -> list[ParamMapping]:
    """The mappings of decoder layer ``layer`` (global 0-based index), in a fixed order."""
    dims = as_dims(hf_config)
    dense = dims.dense_layer(layer)
    out = [
        _layer_mapping(layer, meg, hf, fusion, tp_dim)
        for meg, hf, fusion, tp_dim, needs in _LAYER_TABLE
        if needs is None or (dense if needs == "dense" else getattr(dims, needs))
    ]
    if dense:
        return out
    router = [row for row in _MOE_TABLE if "{e}" not in row[0]]  # once per layer
    per_expert = [row for row in _MOE_TABLE if "{e}" in row[0]]
    out.extend(_layer_mapping(layer, *row) for row in router)
    if dims.expert_bias:
        out.append(_layer_mapping(layer, *_SHARED_TABLE[0]))
    if dims.shared_intermediate_size:
        out.extend(_layer_mapping(layer, *row) for row in _SHARED_TABLE[1:])
    for expert in range(dims.num_experts):
        out.extend(_layer_mapping(layer, *row, e=expert) for row in per_expert)
    return out


# An MTP layer's own tensors (megatron-core's MultiTokenPredictionLayer, suffix inside ``mtp.layers.<k>``) and
# their names inside the checkpoint's ``model.layers.<num_layers + k>``; its decoder layer follows the layer table
# under ``mtp_model_layer`` (megatron-core 0.14 to 0.16 call it ``transformer_layer``; the chunk walk renames it).
_MTP_TABLE: tuple[tuple[str, str, int | None], ...] = (
    ("enorm.weight", "enorm.weight", None),
    ("hnorm.weight", "hnorm.weight", None),
    (
        "eh_proj.weight",
        "eh_proj.weight",
        0,
    ),  # [hidden, 2 x hidden]: input is [enorm(embedding); hnorm(hidden)]
    ("final_layernorm.weight", "shared_head.norm.weight", None),
)
MTP_LAYER = "mtp_model_layer"
#: tensors a checkpoint may keep inside an MTP layer that megatron-core shares with the model (its embedding and
#: output layer, as DeepSeek-V3 / GLM-4.5 do): read by no parameter on load, not exported.
MTP_SHARED_SUFFIXES = (".embed_tokens.weight", ".shared_head.head.weight")


def mtp_param_mappings(*, hf_config: Mapping[str, Any] | Any) -> list[ParamMapping]:
    """The mappings of the multi-token-prediction layers ``hf_config`` declares (none for most models).

    Megatron's ``mtp.layers.<k>`` holds the checkpoint's ``model.layers.<num_hidden_layers + k>``: enorm, hnorm,
    eh_proj, ``shared_head.norm`` as the layer's final norm, and a decoder layer of the same table as the others.
    """
    dims = as_dims(hf_config)
    out: list[ParamMapping] = []
    for k in range(dims.mtp_layers):
        hf_layer = dims.num_layers + k
        out.extend(
            ParamMapping(f"mtp.layers.{k}.{meg}", (f"model.layers.{hf_layer}.{hf}",), "none", tp_dim)
            for meg, hf, tp_dim in _MTP_TABLE
        )
        for m in layer_param_mappings(hf_layer, hf_config=dims):
            inner = m.megatron_name.removeprefix(f"decoder.layers.{hf_layer}.")
            out.append(ParamMapping(f"mtp.layers.{k}.{MTP_LAYER}.{inner}", m.hf_names, m.fusion, m.tp_dim))
    return out


def param_mappings(*, hf_config: Mapping[str, Any] | Any, mtp: bool = False) -> list[ParamMapping]:
    """Every mapping of the whole model in export order: embedding, layers 0..N-1, final norm, lm_head, and
    with ``mtp`` the multi-token-prediction layers (:func:`mtp_param_mappings`).

    With ``tie_word_embeddings`` there is no lm_head entry: Hugging Face ties it to embed_tokens.
    """
    dims = as_dims(hf_config)
    out = [_EMBEDDING]
    for layer in range(dims.num_layers):
        out.extend(layer_param_mappings(layer, hf_config=dims))
    out.append(_FINAL_NORM)
    if not dims.tie_word_embeddings:
        out.append(_OUTPUT)
    if mtp:
        out.extend(mtp_param_mappings(hf_config=dims))
    return out


def hf_tensor_shapes(*, hf_config: Mapping[str, Any] | Any, mtp: bool = False) -> dict[str, tuple[int, ...]]:
    """Every Hugging Face tensor a checkpoint of ``hf_config`` holds, with its shape (the strictness reference);
    with ``mtp`` its multi-token-prediction layers' too."""
    d = as_dims(hf_config)
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
        "mlp.gate.weight": (d.num_experts, d.hidden_size),
        "expert.gate_proj.weight": (d.moe_intermediate_size, d.hidden_size),
        "expert.up_proj.weight": (d.moe_intermediate_size, d.hidden_size),
        "expert.down_proj.weight": (d.hidden_size, d.moe_intermediate_size),
        "mlp.gate.e_score_correction_bias": (d.num_experts,),
        "mlp.shared_experts.gate_proj.weight": (d.shared_intermediate_size, d.hidden_size),
        "mlp.shared_experts.up_proj.weight": (d.shared_intermediate_size, d.hidden_size),
        "mlp.shared_experts.down_proj.weight": (d.hidden_size, d.shared_intermediate_size),
        "enorm.weight": (d.hidden_size,),
        "hnorm.weight": (d.hidden_size,),
        "eh_proj.weight": (d.hidden_size, 2 * d.hidden_size),
        "shared_head.norm.weight": (d.hidden_size,),
    }
    top = {
        "model.embed_tokens.weight": (d.vocab_size, d.hidden_size),
        "model.norm.weight": (d.hidden_size,),
        "lm_head.weight": (d.vocab_size, d.hidden_size),
    }
    shapes: dict[str, tuple[int, ...]] = {}
    for mapping in param_mappings(hf_config=d, mtp=mtp):
        for name in mapping.hf_names:
            suffix = name.split(".", 3)[3] if name not in top else name
            if suffix.startswith("mlp.experts."):  # mlp.experts.{e}.gate_proj.weight
                suffix = "expert." + suffix.split(".", 3)[3]
            shapes[name] = top[name] if name in top else per_layer[suffix]
    return shapes


def few_names(names: Sequence[str], limit: int = 12) -> str:
    """Up to ``limit`` names for an error message, with the count when there are more."""
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" ... ({len(names)} in all)" if len(names) > limit else "")
