"""Build an :class:`~verl_engine.rl_engine.RLEngine` for one role from verl-config's sections.

The sections are verl's own (``actor_rollout_ref.actor.megatron`` / ``.optim``, ``actor_rollout_ref.model``,
``critic.megatron`` ...): there is no second schema. ``model.path`` is a Hugging Face model directory
(config.json + safetensors): the architecture comes from its config (clear error for an unsupported one),
the weights are loaded into the megatron-core model by verl-mcore-utils (TP-sharded), the tokenizer is
transformers' AutoTokenizer. A value model (critic) is the same backbone with a one-output head, initialised
from the same checkpoint (the LM head is not loaded into it).

Pipeline parallelism builds one model chunk per (virtual) stage through verl-mcore-utils'
``make_megatron_module``; multi-token prediction (``actor_rollout_ref.model.mtp``) attaches megatron-core's
MTP block to the last stage when the model's config declares MTP layers (``num_nextn_predict_layers`` or
``mtp_num_hidden_layers``), and is an error for a model without them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from functools import partial
from pathlib import Path
from typing import Any

import torch

from verl_engine.backends import DebugBackend, MegatronBackend, debug_adamw
from verl_engine.mtp import MtpSettings
from verl_engine.packed import cp_layout_from_config
from verl_engine.rl_engine import MicroBatching, RLEngine

__all__ = ["ROLES", "build_rl_engine", "load_hf_config", "rl_engine_from_config"]

ROLES = ("actor", "ref", "critic")
_NO_BUDGET = 1 << 40  # the CP layout's token budget is not used: MicroBatching cuts the micro-batches


def load_hf_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The Hugging Face ``config.json`` of a model directory, checked against the supported architectures."""
    from verl_mcore_utils.transformer_config import SUPPORTED_MODEL_TYPES

    folder = Path(os.path.expanduser(str(path)))
    file = folder / "config.json"
    if not file.is_file():
        raise FileNotFoundError(
            f"model.path {str(path)!r} is not a Hugging Face model directory (no config.json); give a local"
            " directory saved with save_pretrained (config.json + *.safetensors)"
        )
    config = json.loads(file.read_text())
    if config.get("model_type") not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model.path {str(path)!r}: architecture {config.get('model_type')!r} is not supported by the engine;"
            f" supported model_type values: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    return config


def build_rl_engine(
    *,
    engine: Any,
    model_path: str | None,
    optim: Any | None,
    micro_batching: MicroBatching,
    device: torch.device,
    value_model: bool = False,
    hf_config: Mapping[str, Any] | None = None,
    override_model_config: Mapping[str, Any] | None = None,
    total_training_steps: int | None = None,
    mtp: Any | None = None,
    lora: Any | None = None,
    fused_lm_head: bool = False,
) -> RLEngine:
    """Build one role's engine from a megatron engine section (verl-config's ``McoreEngineConfig``).

    ``optim`` (``McoreOptimConfig``) None = forward only (reference policy). ``hf_config`` replaces
    reading ``model_path``'s config (presets / tests); weights are loaded from ``model_path`` when given.
    megatron-core's parallel state is initialised here if it is not yet (``context_parallel_size=1``:
    CP runs in verl-dyncp's groups over the DP x CP pool). ``mtp`` is verl-config's ``MtpConfig``
    (``actor_rollout_ref.model.mtp``) or None. ``lora`` is verl-config's ``LoraConfig`` (the model section's
    ``lora`` block): with ``rank > 0`` peft LoRA adapters are inserted before DDP (verl-mcore-utils'
    pre-wrap hook), only they (and a critic's value head) train, and the base weights come from
    ``model_path``; ``lora.adapter_path`` loads a PEFT adapter directory. ``fused_lm_head``
    (``model.use_fused_kernels``) computes log-probs / entropy from the last hidden states with the LM
    head inside the chunk loop (verl_engine.fused_head); a value model has no LM head and ignores it.
    """
    from megatron.core import parallel_state

    from verl_mcore_utils.ddp import WrapConfig
    from verl_mcore_utils.module import make_megatron_module
    from verl_mcore_utils.parallel import init_parallel
    from verl_mcore_utils.transformer_config import hf_to_transformer_config
    from verl_mcore_utils.wgrad_fusion import with_wgrad_fusion

    if hf_config is None:
        if not model_path:
            raise ValueError("give model.path (a Hugging Face model directory) or an hf_config")
        hf_config = load_hf_config(model_path)
    hf = {**dict(hf_config), **dict(override_model_config or {})}
    mtp_layers = _mtp_layers(mtp, hf=hf, model_path=model_path, value_model=value_model)
    lora = lora if lora is not None and lora.enabled else None
    if lora is not None and mtp_layers and mtp.enable_train:
        raise NotImplementedError(
            "actor_rollout_ref.model.mtp.enable_train=true with LoRA (model.lora.rank > 0): the adapters cover"
            " the decoder only, so the MTP layers would stay frozen and their loss would train nothing; set"
            " mtp.enable_train=false or lora.rank=0"
        )
    debug = device.type == "cpu"
    pp, vpp = engine.pipeline_model_parallel_size, engine.virtual_pipeline_model_parallel_size
    if not parallel_state.model_parallel_is_initialized():
        init_parallel(
            tensor_model_parallel_size=engine.tensor_model_parallel_size,
            pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=vpp,
            device=device.type,
        )
    tp = parallel_state.get_tensor_model_parallel_world_size()
    initialised = (
        tp,
        parallel_state.get_pipeline_model_parallel_world_size(),
        parallel_state.get_virtual_pipeline_model_parallel_world_size(),
    )
    if initialised != (engine.tensor_model_parallel_size, pp, vpp):
        raise ValueError(
            "megatron-core is initialised with tensor / pipeline / virtual pipeline sizes"
            f" {initialised} but this role's section asks for {(engine.tensor_model_parallel_size, pp, vpp)};"
            " roles sharing a process group must share the model-parallel layout"
        )
    if debug and pp > 1 and hf.get("tie_word_embeddings") and not value_model:
        raise NotImplementedError(
            "tie_word_embeddings with pipeline_model_parallel_size > 1 needs CUDA: megatron-core copies the last"
            " stage's tied output weight to the GPU when it builds the model; run on GPUs, or untie the embeddings"
            " (model.override_config.model_config.tie_word_embeddings=false) for the CPU backend"
        )
    pool = parallel_state.get_data_parallel_world_size()
    layout = cp_layout_from_config(engine, max_tokens_per_rank=_NO_BUDGET)
    if not layout.dynamic and pool % layout.static_cp_size:
        raise ValueError(
            f"context_parallel_size={layout.static_cp_size} does not divide the {pool} ranks of the DP x CP pool"
            " (world size / tensor_model_parallel_size)"
        )
    if not engine.use_remove_padding and (layout.dynamic or layout.static_cp_size > 1):
        raise ValueError(
            "use_remove_padding=false (padded batches) cannot run context parallelism; set"
            " use_remove_padding=true or context_parallel_size=1 and dynamic_context_parallel=false"
        )
    dtype = "float32" if debug else engine.dtype
    trains = optim is not None and not engine.forward_only
    fsdp = bool(engine.use_megatron_fsdp) and not debug
    tf_config = hf_to_transformer_config(
        hf,
        dtype=dtype,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        context_parallel_size=1,
        sequence_parallel=engine.sequence_parallel and tp > 1,
        # weight gradients accumulated into DDP's main_grad inside the GEMM, where the chunks get megatron DDP
        overrides=with_wgrad_fusion(
            engine.given_transformer_overrides(),
            device=device,
            megatron_ddp=trains and not debug and not fsdp,
        ),
    )
    torch.manual_seed(engine.seed)
    from verl_dyncp.model import THDGPTModelProvider

    provider = THDGPTModelProvider(
        hf_config=hf,
        transformer_config=tf_config,
        device=device,
        kernel=engine.packed_attention_backend,
        mtp_num_layers=mtp_layers,
    )
    # DDP only for a role that trains on the megatron backend (the CPU debug backend takes the bare chunk).
    wrap = WrapConfig(
        **{**engine.wrap_config_kwargs(is_value_model=value_model), "wrap_with_ddp": trains and not debug}
    )
    if fsdp and lora is not None:
        raise NotImplementedError(
            "LoRA (model.lora.rank > 0) with megatron.use_megatron_fsdp=true is not supported by verl-engine yet;"
            " LoRA trains only the adapters, so plain DDP (use_megatron_fsdp=false) holds little optimizer state"
        )
    hooks: list[Any] = []
    if lora is not None:
        from verl_mcore_utils.lora import peft_pre_wrap_hook

        # adapters seeded by engine.seed and the module name: the same adapter at every TP / PP layout
        hooks.append(peft_pre_wrap_hook(lora, hf_config=hf, seed=engine.seed, verbose=False))
    if model_path:
        # before wrapping: Megatron-FSDP shards the parameters when it wraps them (a critic's value head
        # keeps its initialisation: load_hf_weights skips it)
        hooks.append(partial(_load_weights, model_path=model_path, hf_config=hf, lora=lora))
    if fsdp:  # Megatron-FSDP: on the CPU debug backend the same math runs without it (plain autograd)
        from verl_mfsdp.wrap import make_megatron_fsdp_module

        chunks = make_megatron_fsdp_module(
            provider, wrap_config=wrap, override_ddp_config=engine.override_ddp_config, pre_wrap_hooks=hooks
        )
    else:
        chunks = make_megatron_module(
            provider, wrap_config=wrap, override_ddp_config=engine.override_ddp_config, pre_wrap_hooks=hooks
        )
    if mtp_layers and pp > 1:  # the last stage's copy of the word embedding starts as the first stage's
        from verl_mcore_utils.mtp import sync_mtp_embedding

        sync_mtp_embedding(chunks, grads=False)
    optimizer, lr_schedule = None, None
    if trains:
        optimizer = _optimizer(chunks, optim=optim, engine=engine, debug=debug, tf_config=tf_config)
        if mtp_layers and pp > 1 and not debug:
            _sum_mtp_embedding_grads_in_finalize(chunks)
        from verl_engine.lr_schedule import lr_schedule_from_config

        lr_schedule = lr_schedule_from_config(optim, total_training_steps=total_training_steps)
        lr_schedule.apply(optimizer)  # step 0's learning rate (warm-up starts below optim.lr)
    else:
        for chunk in chunks:
            for p in chunk.parameters():
                p.requires_grad_(False)
    from verl_dyncp.planner import MEASURED_ATTENTION_COST_FACTOR, WorkloadModel
    from verl_engine.engine import _pool_cp_groups
    from verl_engine.pipeline import PipelineLayout

    backend: Any
    if debug:
        backend = DebugBackend(
            clip_grad=float(optim.clip_grad) if optim is not None else 0.0,
            pool_group=parallel_state.get_data_parallel_group(),
            pool_size=pool,
        )
    else:
        backend = MegatronBackend()
    return RLEngine(
        model=chunks,
        optimizer=optimizer,
        backend=backend,
        tp_group=parallel_state.get_tensor_model_parallel_group() if tp > 1 else None,
        tp_size=tp,
        device=device,
        cp_layout=layout,
        cp_groups=_pool_cp_groups(),
        cp_workload=WorkloadModel.from_transformer_config(
            tf_config,
            vocab_size=None if value_model else hf.get("vocab_size"),
            attention_cost_factor=MEASURED_ATTENTION_COST_FACTOR,
        ),
        micro_batching=micro_batching,
        value_model=value_model,
        use_remove_padding=engine.use_remove_padding,
        fused_lm_head=fused_lm_head,
        lr_schedule=lr_schedule,
        tokenizer_path=model_path,
        pipeline=PipelineLayout.from_parallel_state(),
        mtp_embedding_copy=bool(mtp_layers) and pp > 1 and trains,
        hf_config=hf,
        mtp=MtpSettings(
            num_layers=mtp_layers,
            scaling_factor=float(mtp.mtp_loss_scaling_factor),
            detach_encoder=bool(mtp.detach_encoder),
        )
        if trains and mtp_layers and mtp.enable_train
        else None,
        lora=lora,
    )


def _load_weights(
    chunks: list[torch.nn.Module], *, model_path: str, hf_config: Mapping[str, Any], lora: Any | None
) -> list[torch.nn.Module]:
    """Pre-wrap hook: the Hugging Face weights of ``model_path`` into the base model (LoRA layers swapped
    for their base linears meanwhile, so that the names fit)."""
    import contextlib

    from verl_mcore_utils.weights import load_hf_weights

    context: Any = contextlib.nullcontext()
    if lora is not None:
        from verl_mcore_utils.lora import without_adapters

        context = without_adapters(chunks)
    with context:
        load_hf_weights(chunks, model_path, hf_config=hf_config)
    return chunks


def _mtp_layers(mtp: Any | None, *, hf: Mapping[str, Any], model_path: str | None, value_model: bool) -> int:
    """MTP layers to build: the model's own count when ``mtp.enable``, else none (verl's check_mtp_config)."""
    from verl_mcore_utils.transformer_config import hf_mtp_num_layers

    if mtp is None or not mtp.enable or value_model:
        return 0
    layers = hf_mtp_num_layers(hf)
    if layers == 0:
        raise ValueError(
            f"actor_rollout_ref.model.mtp.enable=true but the model {model_path or '(hf_config)'} declares no"
            " multi-token-prediction layers (num_nextn_predict_layers / mtp_num_hidden_layers in config.json);"
            " set actor_rollout_ref.model.mtp.enable=false or use a model with MTP layers"
        )
    return layers


def rl_engine_from_config(
    cfg: Any,
    *,
    role: str,
    device: torch.device,
    hf_config: Mapping[str, Any] | None = None,
) -> RLEngine:
    """The engine of ``role`` (actor | ref | critic) from a loaded ``ppo_trainer`` config (model_engine=megatron)."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}; got {role!r}")
    if cfg.model_engine != "megatron":
        raise ValueError(
            f"model_engine is {cfg.model_engine!r}; verl-engine is the Megatron engine: load the config with"
            " model_engine=megatron"
        )
    arr = cfg.actor_rollout_ref
    section = {"actor": arr.actor, "ref": arr.ref, "critic": cfg.critic}[role]
    engine = section.megatron
    model = cfg.critic.model if role == "critic" else arr.model
    optim = None if role == "ref" else section.optim
    steps = None
    if optim is not None and optim.total_training_steps <= 0:
        steps = cfg.trainer.total_training_steps
    return build_rl_engine(
        mtp=None if role == "critic" else model.mtp,
        engine=engine,
        model_path=None if hf_config is not None and not _is_dir(model.path) else model.path,
        optim=optim,
        micro_batching=MicroBatching(
            use_dynamic_bsz=bool(engine.use_dynamic_bsz),
            max_token_len_per_gpu=engine.max_token_len_per_gpu,
            micro_batch_size_per_gpu=engine.micro_batch_size_per_gpu,
        ),
        device=device,
        value_model=role == "critic",
        hf_config=hf_config,
        override_model_config=dict(model.override_config.get("model_config", {}) or {}),
        total_training_steps=steps,
        # the reference policy is the base model (verl's LoRA ref = the actor with its adapter disabled)
        lora=None if role == "ref" else model.lora,
        fused_lm_head=_fused_lm_head(model),
    )


def _is_dir(path: str | None) -> bool:
    return bool(path) and Path(os.path.expanduser(str(path))).is_dir()


def _optimizer(chunks: list[torch.nn.Module], *, optim: Any, engine: Any, debug: bool, tf_config: Any) -> Any:
    if debug:
        extra = dict(optim.override_optimizer_config or {})  # megatron OptimizerConfig names, as on GPU
        return debug_adamw(
            chunks,
            lr=optim.lr,
            weight_decay=optim.weight_decay,
            betas=optim.betas,
            eps=float(extra.get("adam_eps", 1e-8)),
        )
    from megatron.core.optimizer import OptimizerConfig

    from verl_mcore_utils.compat import make_megatron_optimizer
    from verl_mcore_utils.module import attach_training_hooks

    kwargs = optim.optimizer_config_kwargs(
        dtype=engine.dtype, use_distributed_optimizer=engine.use_distributed_optimizer
    )
    kwargs["params_dtype"] = tf_config.params_dtype  # verl-config is torch-free: it names the dtype
    if engine.use_megatron_fsdp:
        from verl_mfsdp.wrap import make_megatron_fsdp_optimizer

        optimizer = make_megatron_fsdp_optimizer(OptimizerConfig(**kwargs), chunks)
    else:
        optimizer = make_megatron_optimizer(OptimizerConfig(**kwargs), chunks)
    # megatron-core puts biases and norm weights in groups with wd_mult 0 but leaves their weight_decay at the
    # config's value: its OptimizerParamScheduler multiplies them in every step. Without that scheduler (the
    # engine has its own LR schedule) set it once, or those parameters would be decayed (the debug backend's
    # AdamW groups do the same split).
    for group in optimizer.param_groups:
        group["weight_decay"] = float(optim.weight_decay) * float(group.get("wd_mult", 1.0))
    attach_training_hooks(chunks, optimizer)
    return optimizer


def _sum_mtp_embedding_grads_in_finalize(chunks: list[torch.nn.Module]) -> None:
    """megatron-core's finalize_model_grads, then the MTP embedding pair's gradients summed (pipeline stages)."""
    from verl_mcore_utils.module import get_model_config
    from verl_mcore_utils.mtp import sync_mtp_embedding

    config = get_model_config(chunks)
    finalize = config.finalize_model_grads_func

    def finalize_with_mtp_embedding(*args: Any, **kwargs: Any) -> Any:
        out = finalize(*args, **kwargs)
        sync_mtp_embedding(chunks, grads=True)
        return out

    config.finalize_model_grads_func = finalize_with_mtp_embedding


def _fused_lm_head(model: Any) -> bool:
    """``model.use_fused_kernels`` with the one implementation we have (``impl_backend=torch``)."""
    if not getattr(model, "use_fused_kernels", False):
        return False
    impl = (getattr(model, "fused_kernel_options", None) or {}).get("impl_backend", "torch")
    if impl != "torch":
        raise ValueError(
            f"actor_rollout_ref.model.fused_kernel_options.impl_backend={impl!r}: verl-engine's fused LM head is"
            " the chunked torch implementation (verl_engine.fused_head); set impl_backend=torch, or"
            " use_fused_kernels=false"
        )
    return True
