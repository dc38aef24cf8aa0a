"""make_megatron_module: build model chunks through a provider, then wrap them, one way for every path.

The paths differ ONLY in how unwrapped chunks are built (a :class:`ModelProvider`); hooks, mixed
precision, value head and DDP wrapping are done by one function, and the DDP config comes from
:func:`verl_mcore_utils.ddp.build_ddp_config` with the provider's ``ddp_defaults`` as the lowest layer
(path defaults < wrap config < override_ddp_config). Why: see the README's design notes.

The provider protocol (also implemented by the mbridge path and by any user object)::

    class MyProvider:
        transformer_config: TransformerConfig      # the config every chunk is built with
        ddp_defaults: Mapping[str, Any]            # this path's DDP defaults (may be empty)
        def provide(self, *, pre_process: bool, post_process: bool, vp_stage: int | None) -> torch.nn.Module:
            ...                                    # one UNWRAPPED chunk (e.g. a GPTModel) on its device

It mirrors Megatron-Bridge's providers (``provide``), without their wrapping logic: wrapping stays here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
from megatron.core import parallel_state
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from verl_mcore_utils.ddp import WrapConfig, build_ddp_config
from verl_mcore_utils.model import build_gpt_model

__all__ = [
    "GPTModelProvider",
    "ModelProvider",
    "PreWrapHook",
    "SpecProvider",
    "ValueHead",
    "attach_training_hooks",
    "get_model_config",
    "make_megatron_module",
    "unwrap_model",
]

PreWrapHook = Callable[[list[torch.nn.Module]], list[torch.nn.Module] | None]


@runtime_checkable
class ModelProvider(Protocol):
    """Builds unwrapped model chunks; see the module docstring."""

    transformer_config: TransformerConfig
    ddp_defaults: Mapping[str, Any]

    def provide(
        self, *, pre_process: bool, post_process: bool, vp_stage: int | None = None
    ) -> torch.nn.Module: ...


@dataclass
class GPTModelProvider:
    """Our own provider: a GPTModel for a Hugging Face config (Qwen2, Qwen3, Llama), local layer spec.

    No Transformer Engine needed (SDPA core attention, portable RoPE); CPU and CUDA.
    """

    hf_config: Mapping[str, Any] | Any
    transformer_config: TransformerConfig
    device: torch.device | str = "cuda"
    layer_spec: ModuleSpec | None = None
    ddp_defaults: Mapping[str, Any] = field(default_factory=dict)

    def provide(
        self, *, pre_process: bool, post_process: bool, vp_stage: int | None = None
    ) -> torch.nn.Module:
        return build_gpt_model(
            hf_config=self.hf_config,
            tf_config=self.transformer_config,
            device=self.device,
            pre_process=pre_process,
            post_process=post_process,
            layer_spec=self.layer_spec,
            vp_stage=vp_stage,
        )


@dataclass
class SpecProvider:
    """The plain megatron-core path: a GPTModel from a layer spec and explicit sizes (no Hugging Face config)."""

    transformer_config: TransformerConfig
    layer_spec: ModuleSpec
    vocab_size: int
    max_sequence_length: int
    device: torch.device | str = "cuda"
    share_embeddings_and_output_weights: bool = False
    rotary_base: float = 10000.0
    ddp_defaults: Mapping[str, Any] = field(default_factory=dict)

    def provide(
        self, *, pre_process: bool, post_process: bool, vp_stage: int | None = None
    ) -> torch.nn.Module:
        hf_like = {
            "vocab_size": self.vocab_size,
            "max_position_embeddings": self.max_sequence_length,
            "tie_word_embeddings": self.share_embeddings_and_output_weights,
            "rope_theta": self.rotary_base,
        }
        provider = GPTModelProvider(
            hf_config=hf_like,
            transformer_config=self.transformer_config,
            device=self.device,
            layer_spec=self.layer_spec,
        )
        return provider.provide(pre_process=pre_process, post_process=post_process, vp_stage=vp_stage)


class ValueHead(torch.nn.Linear):
    """A scalar head in place of the LM output layer (critic / reward models).

    Returns ``(values, None)`` like megatron's ColumnParallelLinear, so GPTModel's forward works
    unchanged; it is replicated on every TP rank (the hidden states reaching it are full size).
    """

    def __init__(self, hidden_size: int, *, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__(hidden_size, 1, bias=False, dtype=dtype, device=device)

    def forward(  # type: ignore[override]
        self, input_: torch.Tensor, weight: torch.Tensor | None = None, **_: Any
    ) -> tuple[torch.Tensor, None]:
        return super().forward(input_), None


def _stage_flags(vp_stage: int | None) -> tuple[bool, bool]:
    if vp_stage is None:
        return parallel_state.is_pipeline_first_stage(), parallel_state.is_pipeline_last_stage()
    return (
        parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
        parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
    )


def _add_value_head(chunk: torch.nn.Module, config: TransformerConfig) -> None:
    if getattr(chunk, "share_embeddings_and_output_weights", False):
        raise ValueError(
            "a value model cannot share its output layer with the embedding (share_embeddings_and_output_weights /"
            " tie_word_embeddings); build the critic with tied embeddings off"
        )
    old: torch.nn.Module = chunk.output_layer  # type: ignore[assignment]  # a submodule, not a Tensor
    device = next(old.parameters()).device if any(True for _ in old.parameters()) else torch.device("cpu")
    head = ValueHead(config.hidden_size, dtype=config.params_dtype, device=device)
    # Initialised from its own generator (seeded with the process's torch seed), like megatron's output layer
    # (normal, init_method_std): the head is then the same whatever the pipeline / virtual-stage layout consumed
    # of the global RNG before it.
    generator = torch.Generator().manual_seed(torch.initial_seed())
    weight = torch.empty(head.weight.shape, dtype=torch.float32).normal_(
        0.0, config.init_method_std, generator=generator
    )
    with torch.no_grad():
        head.weight.copy_(weight)
    chunk.output_layer = head


def make_megatron_module(
    provider: ModelProvider,
    *,
    wrap_config: WrapConfig,
    override_ddp_config: Mapping[str, Any] | None = None,
    pre_wrap_hooks: Sequence[PreWrapHook] = (),
) -> list[torch.nn.Module]:
    """Build this rank's model chunks with ``provider`` and wrap them as ``wrap_config`` says.

    Order: chunks (one per virtual pipeline stage) -> value head when ``is_value_model`` ->
    ``pre_wrap_hooks`` (e.g. LoRA, so DDP buckets and the optimizer see only trainable
    parameters) -> Float16Module for bf16/fp16 -> DDP with the config from build_ddp_config (none
    when ``wrap_with_ddp`` is False). Parallel state must be initialised.
    """
    if not isinstance(provider, ModelProvider):
        raise TypeError(
            f"{type(provider).__name__} is not a model provider: it needs transformer_config, ddp_defaults and"
            " provide(*, pre_process, post_process, vp_stage); see verl_mcore_utils.module"
        )
    config = provider.transformer_config
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    stages: list[int | None] = list(range(vpp)) if vpp else [None]
    chunks: list[torch.nn.Module] = []
    for vp_stage in stages:
        pre, post = _stage_flags(vp_stage)
        chunk = provider.provide(pre_process=pre, post_process=post, vp_stage=vp_stage)
        if wrap_config.is_value_model and post:
            _add_value_head(chunk, config)
        chunks.append(chunk)
    for hook in pre_wrap_hooks:
        result = hook(chunks)
        if result is not None:
            chunks = list(result)
    ddp_config = build_ddp_config(
        wrap_config=wrap_config, override_ddp_config=override_ddp_config, path_defaults=provider.ddp_defaults
    )
    if config.bf16 or config.fp16:
        chunks = [Float16Module(config, c) for c in chunks]
    if ddp_config is None:
        return chunks
    if ddp_config.use_megatron_fsdp:
        raise NotImplementedError(
            "use_megatron_fsdp=True: Megatron-FSDP wrapping is provided by verl-mfsdp (verl_mfsdp), not by"
            " verl_mcore_utils.make_megatron_module; set use_megatron_fsdp=false or use verl_mfsdp"
        )
    from megatron.core.distributed import DistributedDataParallel

    wrapped = [
        # Only the first chunk's buffers are bucketed when there are several (Megatron-LM does the same):
        # later chunks' gradients are reduced together at the end of the step.
        DistributedDataParallel(config=config, ddp_config=ddp_config, module=c, disable_bucketing=i > 0)
        for i, c in enumerate(chunks)
    ]
    for w in wrapped:
        w.broadcast_params()
    return wrapped


_WRAPPER_NAMES = (
    "DistributedDataParallel",
    "FullyShardedDataParallel",
    "MegatronFSDP",  # the module inside megatron-core's FullyShardedDataParallel
    "Float16Module",
    "TorchFullyShardedDataParallel",
)


def unwrap_model(model: torch.nn.Module | Sequence[torch.nn.Module]) -> Any:
    """Peel DDP / Megatron-FSDP / Float16Module wrappers (one module or a list of chunks).

    Matched by class name and ``.module`` because Megatron-FSDP's name is a factory in some
    megatron-core versions (isinstance would not work).
    """
    if isinstance(model, Sequence):
        return [unwrap_model(m) for m in model]
    while type(model).__name__ in _WRAPPER_NAMES and hasattr(model, "module"):
        model = model.module  # type: ignore[assignment]  # a wrapper's .module is a Module
    return model


def get_model_config(model: torch.nn.Module | Sequence[torch.nn.Module]) -> TransformerConfig:
    """The TransformerConfig of a (possibly wrapped) model or of the first chunk."""
    first = model[0] if isinstance(model, Sequence) else model
    return unwrap_model(first).config


def attach_training_hooks(model_chunks: Sequence[torch.nn.Module], optimizer: Any) -> TransformerConfig:
    """Set the hooks megatron-core's forward-backward schedules call on the model config.

    grad_scale_func = optimizer.scale_loss; finalize_model_grads_func (DP/TP gradient reduction,
    layernorm / embedding grads); and when DDP overlaps communication with compute, the
    no_sync / grad_sync / param_sync functions of the chunks. Returns the config.
    """
    from megatron.core.distributed import finalize_model_grads

    config = get_model_config(model_chunks)
    config.grad_scale_func = optimizer.scale_loss
    config.finalize_model_grads_func = finalize_model_grads
    ddp_config = getattr(model_chunks[0], "ddp_config", None)
    if ddp_config is not None and ddp_config.overlap_grad_reduce:
        no_sync = [c.no_sync for c in model_chunks]
        grad_sync = [c.start_grad_sync for c in model_chunks]
        config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
        config.grad_sync_func = grad_sync[0] if len(grad_sync) == 1 else grad_sync
    if ddp_config is not None and ddp_config.overlap_param_gather and ddp_config.align_param_gather:
        param_sync = [c.start_param_sync for c in model_chunks]
        config.param_sync_func = param_sync[0] if len(param_sync) == 1 else param_sync
    return config
