"""mbridge's Hugging Face <-> megatron-core bridges, made to work without Transformer Engine.

Subclasses of mbridge's dense ``qwen2``, ``qwen3`` and ``llama`` bridges that build megatron-core's local
layer spec with :class:`SDPACoreAttention` when TE is absent (TE's spec and config when it is installed),
registered with ``mbridge.AutoBridge`` on import. What they fix and why: the package README.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Generator, Iterable, Mapping, Sequence
from typing import Any, cast

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from verl_mcore_utils.compat import hf_rope_parameters
from verl_mcore_utils.model import local_layer_spec
from verl_mcore_utils.rope import make_rope_portable

try:
    from mbridge import AutoBridge
    from mbridge.core import Bridge, register_model
    from mbridge.models.llama import LLaMABridge
    from mbridge.models.qwen2 import Qwen2Bridge
    from mbridge.models.qwen3 import Qwen3Bridge
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        f"verl_mcore_utils.bridges needs mbridge ({exc}); install verl-mcore-utils[mbridge]"
    ) from exc

__all__ = [
    "LOCAL_BRIDGES",
    "LocalLlamaBridge",
    "LocalQwen2Bridge",
    "LocalQwen3Bridge",
    "MBridgeProvider",
    "build_mbridge_model",
    "have_transformer_engine",
    "register_local_bridges",
]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

# TransformerConfig fields that mbridge sets (or megatron-core could default) to kernels that need
# Transformer Engine, apex or a compiled CUDA extension. The local spec's torch norm also asserts
# sequence_parallel off; mbridge turns it on whenever TP > 1.
_NO_TE_CONFIG: dict[str, Any] = {
    "sequence_parallel": False,
    "masked_softmax_fusion": False,
    "bias_activation_fusion": False,
    "bias_dropout_fusion": False,
    "persist_layer_norm": False,
    "apply_rope_fusion": False,
    "gradient_accumulation_fusion": False,
    "cross_entropy_loss_fusion": False,
}

# megatron-core's llama3 RoPE scaling takes only the factor; these are its fixed other parameters.
_MCORE_LLAMA3_ROPE = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

_EMBED = "model.embed_tokens.weight"
_LM_HEAD = "lm_head.weight"


def have_transformer_engine() -> bool:
    """True when megatron-core found Transformer Engine (then mbridge's own TE spec is used)."""
    from megatron.core.extensions import transformer_engine

    return bool(getattr(transformer_engine, "HAVE_TE", False))


def _rope_gpt_model_args(hf_config: Any) -> dict[str, Any]:
    """GPTModel keyword arguments for the RoPE of ``hf_config`` (theta and scaling)."""
    rope = hf_rope_parameters(hf_config)
    args: dict[str, Any] = {"rotary_base": rope["rope_theta"]}
    kind = rope["rope_type"]
    if kind == "default":
        return args
    if kind == "linear":
        args["seq_len_interpolation_factor"] = float(rope["factor"])
        return args
    if kind == "llama3":
        differing = {
            key: rope[key]
            for key, value in _MCORE_LLAMA3_ROPE.items()
            if float(rope.get(key, value)) != value
        }
        if differing:
            raise NotImplementedError(
                f"llama3 RoPE scaling with {differing}: megatron-core fixes these to {_MCORE_LLAMA3_ROPE}"
            )
        args["rope_scaling"] = True
        args["rope_scaling_factor"] = float(rope["factor"])
        return args
    raise NotImplementedError(
        f"rope_type {kind!r} is not supported by the megatron-core bridges here (default, linear, llama3)"
    )


class _LocalSpecBridge(Bridge):
    """What the qwen2 / qwen3 / llama subclasses below add to mbridge's bridges.

    Placed first in their bases, so ``super()`` reaches the mbridge model bridge.
    """

    # mbridge's class dicts, shadowed per instance by _adjust_mapping_for_shared_weights
    _DIRECT_MAPPING: dict[str, str]
    _ATTENTION_MAPPING: dict[str, list[str]]
    _MLP_MAPPING: dict[str, list[str]]
    _OTHER_MAPPING: dict[str, list[str]]

    def _tied(self) -> bool:
        return bool(getattr(self.hf_config, "tie_word_embeddings", False))

    # -- config and spec -------------------------------------------------------------------------

    def _build_base_config(self, text_config_key: str | None = None, **kwargs: Any) -> TransformerConfig:
        # mbridge applies kwargs over its defaults and then set_extra_args() over both, so the
        # no-TE settings beat mbridge's defaults but an explicit user override still wins.
        if not have_transformer_engine():
            kwargs = {**_NO_TE_CONFIG, **kwargs}
        return super()._build_base_config(text_config_key, **kwargs)  # type: ignore[misc]

    def _get_transformer_layer_spec(self, vp_stage: int | None = None) -> ModuleSpec:
        if have_transformer_engine():
            return super()._get_transformer_layer_spec(vp_stage)  # type: ignore[misc]
        # mbridge's provider passes vp_stage to GPTModel only when this flag is set; every
        # supported megatron-core (0.14+) GPTModel takes it.
        self.has_vp_stage = True
        return local_layer_spec(self.config)

    def _get_gptmodel_args(self) -> dict[str, Any]:
        return {
            "vocab_size": self.hf_config.vocab_size,
            "max_sequence_length": self.hf_config.max_position_embeddings,
            "position_embedding_type": "rope",
            **_rope_gpt_model_args(self.hf_config),
        }

    # -- names -----------------------------------------------------------------------------------

    def _adjust_mapping_for_shared_weights(self) -> None:
        # Called once by Bridge.__init__. Instance attributes shadow the class dicts, which stay
        # untouched (mbridge's Qwen2Bridge writes the tied mapping into its class dict instead).
        cls = type(self)
        self._DIRECT_MAPPING = dict(cls._DIRECT_MAPPING)
        self._DIRECT_MAPPING["output_layer.weight"] = _EMBED if self._tied() else _LM_HEAD
        self._ATTENTION_MAPPING = {k: list(v) for k, v in cls._ATTENTION_MAPPING.items()}
        # The local spec keeps the norms as their own modules; TE fuses them into the next linear
        # (linear_qkv.layer_norm_weight / linear_fc1.layer_norm_weight). mbridge dispatches names
        # containing "mlp" to the MLP map and names outside attention / MLP to the "other" map.
        self._MLP_MAPPING = {k: list(v) for k, v in cls._MLP_MAPPING.items()}
        self._MLP_MAPPING["pre_mlp_layernorm.weight"] = [
            "model.layers.{layer_number}.post_attention_layernorm.weight"
        ]
        self._OTHER_MAPPING = {k: list(v) for k, v in cls._OTHER_MAPPING.items()}
        self._OTHER_MAPPING["input_layernorm.weight"] = ["model.layers.{layer_number}.input_layernorm.weight"]

    def _get_hf_shared_weight_keys(self) -> list[str]:
        return [_EMBED] if self._tied() else []

    # -- model construction and weights ----------------------------------------------------------

    def get_model(self, *args: Any, **kwargs: Any) -> list[torch.nn.Module]:
        raise NotImplementedError(
            "mbridge's get_model moves the chunks to CUDA, wraps Float16Module / DDP with its own DDP"
            " defaults and, on megatron-core 0.19, fails on ModelType.encoder_and_decoder; use"
            " verl_mcore_utils.bridges.build_mbridge_model(...) and wrap the chunks yourself"
        )

    def export_weights(
        self, models: list[torch.nn.Module], *, include_tied_lm_head: bool = False
    ) -> Generator[tuple[str, torch.Tensor], None, None]:
        """Yield ``(hf_name, tensor)`` for every weight of the full model, in Hugging Face layout.

        A generator that runs collectives as it goes (all-gather over TP, object all-gather and
        broadcast over PP), so every rank of the model-parallel group must consume it completely
        and in the same order; every rank receives every full (TP-merged) tensor. ``models`` are
        the chunks of this rank, wrapped (Float16Module / DDP) or not. Tensors are on the chunks'
        device in the parameters' dtype, and may be views of live parameters (always at TP=1):
        treat them as read-only and clone what you keep past the next optimizer step.

        Each HF name is yielded once. With tied embeddings only ``model.embed_tokens.weight`` is
        yielded (as transformers saves a tied model); ``include_tied_lm_head=True`` also yields it
        as ``lm_head.weight`` (for consumers that expect both names).
        """
        tied = self._tied()
        seen: set[str] = set()
        for name, tensor in super().export_weights(models):
            if name in seen:  # tied, PP > 1: the last stage's copy of the embedding
                continue
            seen.add(name)
            yield name, tensor
            if include_tied_lm_head and tied and name == _EMBED:
                yield _LM_HEAD, tensor


class LocalQwen2Bridge(_LocalSpecBridge, Qwen2Bridge):
    """mbridge's Qwen2Bridge with the local spec when TE is absent (see the package README)."""


class LocalQwen3Bridge(_LocalSpecBridge, Qwen3Bridge):
    """mbridge's Qwen3Bridge with the local spec when TE is absent (see the package README)."""


class LocalLlamaBridge(_LocalSpecBridge, LLaMABridge):
    """mbridge's LLaMABridge with the local spec when TE is absent (see the package README)."""


LOCAL_BRIDGES: Mapping[str, type[Bridge]] = {
    "qwen2": LocalQwen2Bridge,
    "qwen3": LocalQwen3Bridge,
    "llama": LocalLlamaBridge,
}


def register_local_bridges() -> None:
    """Make ``mbridge.AutoBridge`` pick the bridges of this module for qwen2, qwen3 and llama.

    Idempotent; already done when this module is imported. Calling it again restores the entries
    if something registered other bridges for these model types since.
    """
    for model_type, cls in LOCAL_BRIDGES.items():
        register_model(model_type)(cls)


register_local_bridges()


def _check_overrides(overrides: Mapping[str, Any]) -> None:
    valid = TransformerConfig.__dataclass_fields__
    unknown = sorted(set(overrides) - set(valid))
    if unknown:
        raise ValueError(
            f"tf_overrides: {unknown} are not TransformerConfig fields; valid: {', '.join(sorted(valid))}"
        )
    dtype_fields = sorted(set(overrides) & {"params_dtype", "pipeline_dtype", "bf16", "fp16"})
    if dtype_fields:
        raise ValueError(f"tf_overrides: set the precision with dtype=..., not {dtype_fields}")


def _resolve_device(device: torch.device | str) -> torch.device:
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def _init_on_cpu(dev: torch.device) -> bool:
    """Initialise on the CPU unless on CUDA with megatron-core's CUDA RNG tracker seeded.

    GPU initialisation draws from the tracker's "model-parallel-rng" state, which exists only after
    ``tensor_parallel.model_parallel_cuda_manual_seed(seed)`` (megatron trainers call it at start-up).
    """
    if dev.type != "cuda":
        return True
    return not tensor_parallel.get_cuda_rng_tracker().is_initialized()


def _build_chunks(bridge: Bridge, callbacks: Iterable[Callable[..., None]]) -> list[torch.nn.Module]:
    """The GPTModel chunks of this pipeline rank (one per virtual stage), unwrapped."""
    provider = bridge._model_provider(list(callbacks))
    vpp = bridge.mpu.vpp_size
    stages: list[tuple[bool, bool, int | None]]
    if parallel_state.get_pipeline_model_parallel_world_size() > 1 and vpp is not None:
        stages = [
            (
                parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=i),
                parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=i),
                i,
            )
            for i in range(vpp)
        ]
    else:
        stages = [(parallel_state.is_pipeline_first_stage(), parallel_state.is_pipeline_last_stage(), None)]
    chunks = []
    for pre_process, post_process, vp_stage in stages:
        chunk = provider(pre_process=pre_process, post_process=post_process, vp_stage=vp_stage)
        if vp_stage is not None:
            chunk.vp_stage = vp_stage
        # The optimizer and grad clipping read these attributes on every parameter.
        for param in chunk.parameters():
            tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(param)
        chunks.append(chunk)
    return chunks


def build_mbridge_model(
    *,
    hf_path_or_config: str | os.PathLike[str] | Any,
    tf_overrides: Mapping[str, Any] | None = None,
    device: torch.device | str,
    dtype: str = "float32",
    load_weights: bool = True,
    post_model_creation_callbacks: Sequence[Callable[..., None]] = (),
) -> tuple[Bridge, list[torch.nn.Module]]:
    """Build this rank's GPTModel chunks through mbridge and load the Hugging Face weights.

    ``hf_path_or_config`` is a checkpoint directory or Hub id (config and safetensors weights), or a
    transformers config (then ``load_weights`` must be False and the weights stay randomly
    initialised; whether data-parallel ranks agree depends on their seeds, so broadcast them, as
    megatron's DDP ``broadcast_params`` does, before training).
    Model-parallel state must be initialised first (:func:`verl_mcore_utils.parallel.init_parallel`).

    The TransformerConfig is the bridge's (mbridge's mapping of the HF config) with the TE-only
    fusions off and ``tf_overrides`` (verl's override_transformer_config; TransformerConfig fields)
    applied last. Parameters are initialised on the GPU when ``device`` is CUDA and megatron-core's
    CUDA RNG tracker is seeded (``tensor_parallel.model_parallel_cuda_manual_seed``), else on the CPU
    and then moved (``tf_overrides["use_cpu_initialization"]`` decides explicitly). All parameters are in
    ``dtype`` ("float32" or "bfloat16") on ``device``; RoPE is made to compute on it.

    Returns ``(bridge, chunks)``: one chunk per virtual pipeline stage of this rank, NOT wrapped in
    Float16Module or DDP (the caller wraps them, with the DDP config from
    :func:`verl_mcore_utils.ddp.build_ddp_config`). ``bridge.export_weights(chunks)`` streams the
    weights back in HF layout; ``post_model_creation_callbacks`` are mbridge's (called as
    ``cb(model, pre_process=, post_process=, config=, hf_config=)``, e.g. to make a value head).
    """
    from transformers import AutoConfig

    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(_DTYPES)}")
    overrides = dict(tf_overrides or {})
    _check_overrides(overrides)
    if isinstance(hf_path_or_config, (str, os.PathLike)):
        hf_path: str | None = os.fspath(hf_path_or_config)
        hf_config = AutoConfig.from_pretrained(cast(str, hf_path))  # os.fspath of a str path
    else:
        hf_path, hf_config = None, hf_path_or_config
        if load_weights:
            raise ValueError("load_weights=True needs a checkpoint path, not a config object")
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in LOCAL_BRIDGES:
        raise ValueError(
            f"model_type {model_type!r} has no bridge that runs without Transformer Engine;"
            f" supported: {', '.join(LOCAL_BRIDGES)}"
        )
    register_local_bridges()
    dev = _resolve_device(device)
    bridge = AutoBridge.from_config(hf_config, dtype=_DTYPES[dtype])
    bridge.set_extra_args(**{"use_cpu_initialization": _init_on_cpu(dev), **overrides})
    chunks = _build_chunks(bridge, post_model_creation_callbacks)
    for chunk in chunks:
        make_rope_portable(chunk, dev)
        # megatron-core's torch norms are created in fp32 whatever params_dtype says (mbridge's
        # Float16Module cast hides that); cast here so unwrapped chunks hold one dtype.
        chunk.to(device=dev, dtype=_DTYPES[dtype])
    if load_weights:
        assert hf_path is not None
        bridge.load_weights(chunks, hf_path)
    return bridge, chunks


# mbridge's get_model wraps with DDP defaults {grad_reduce_in_fp32: True, use_distributed_optimizer: True}.
# Only the first is a path default here: use_distributed_optimizer always comes from the wrap config
# (in verl, mbridge's True once silently won over a user's False).
MBRIDGE_DDP_DEFAULTS: dict[str, Any] = {"grad_reduce_in_fp32": True}


class MBridgeProvider:
    """The vanilla mbridge path as a :class:`verl_mcore_utils.module.ModelProvider`.

    Builds (and by default loads) this rank's chunks once with :func:`build_mbridge_model`, then
    hands them to ``make_megatron_module``, which applies hooks and wraps them with the DDP config
    from the one builder; ``ddp_defaults`` carries mbridge's own default below the wrap config.
    Parallel state must be initialised before construction.
    """

    ddp_defaults: Mapping[str, Any] = MBRIDGE_DDP_DEFAULTS

    def __init__(
        self,
        hf_path_or_config: str | os.PathLike[str] | Any,
        *,
        device: torch.device | str,
        dtype: str = "bfloat16",
        tf_overrides: Mapping[str, Any] | None = None,
        load_weights: bool = True,
        post_model_creation_callbacks: Sequence[Callable[..., None]] = (),
    ) -> None:
        self.bridge, self._chunks = build_mbridge_model(
            hf_path_or_config=hf_path_or_config,
            tf_overrides=tf_overrides,
            device=device,
            dtype=dtype,
            load_weights=load_weights,
            post_model_creation_callbacks=post_model_creation_callbacks,
        )
        self.transformer_config: TransformerConfig = self._chunks[0].config

    @classmethod
    def from_pretrained(
        cls, path: str | os.PathLike[str], *, device: torch.device | str, dtype: str = "bfloat16"
    ) -> MBridgeProvider:
        """Chunks of the checkpoint at ``path`` with its weights loaded."""
        return cls(path, device=device, dtype=dtype)

    def provide(
        self, *, pre_process: bool, post_process: bool, vp_stage: int | None = None
    ) -> torch.nn.Module:
        chunk = self._chunks[vp_stage or 0]
        if (chunk.pre_process, chunk.post_process) != (pre_process, post_process):
            raise RuntimeError(
                f"mbridge built chunk {vp_stage} with pre_process={chunk.pre_process}, post_process={chunk.post_process}"
                f" but make_megatron_module expects {pre_process}, {post_process}: parallel state changed in between?"
            )
        return chunk
