"""Build an :class:`~verl_engine.engine.RLEngine` for one role from verl-config's sections, in named steps:
model config, parallel state, transformer config, model chunks (DDP or Megatron-FSDP wrap), optimizer,
schedule. The sections are verl's own (``actor_rollout_ref.actor.megatron`` / ``.optim``, ``...model``,
``critic.megatron``); ``model.path`` is a Hugging Face model directory. Design notes: the package README.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from verl_engine.backends import DebugBackend, MegatronBackend
from verl_engine.engine import RLEngine
from verl_engine.expert_parallel import check_expert_parallel, expert_data_parallel_group, expert_sizes
from verl_engine.micro_batching import MicroBatching
from verl_engine.moe import MoeRouting, moe_routing
from verl_engine.mtp import MtpSettings
from verl_engine.optimizer import training_state
from verl_engine.packed import CPLayout, cp_layout_from_config
from verl_engine.refusals import check_supported
from verl_engine.router_replay import (
    install_router_replay,
    refuse_router_replay_layout,
    router_replay_settings,
)

__all__ = ["ROLES", "build_rl_engine", "load_hf_config", "rl_engine_from_config"]

ROLES = ("actor", "ref", "critic")
_NO_BUDGET = 1 << 40  # the CP layout's token budget is not used: MicroBatching cuts the micro-batches
# verl 0.9.1's DDP defaults below override_ddp_config (make_megatron_module); megatron-core's default is bf16
VERL_DDP_DEFAULTS: Mapping[str, Any] = {"grad_reduce_in_fp32": True}


@dataclass(frozen=True)
class _Model:
    """What the model will be: its Hugging Face config (overrides applied), MTP layers, LoRA, role."""

    hf: dict[str, Any]
    path: str | None
    mtp_layers: int
    lora: Any
    value_model: bool


@dataclass(frozen=True)
class _Parallel:
    """The parallel layout megatron-core runs with, and the role's CP layout over the DP x CP pool."""

    tp: int
    pp: int
    vpp: int | None
    pool: int
    layout: CPLayout


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
    engine_class: type[RLEngine] = RLEngine,
) -> RLEngine:
    """Build one role's engine from a megatron engine section (verl-config's ``McoreEngineConfig``).

    ``optim`` (``McoreOptimConfig`` or the SFT section) None = forward only. ``hf_config`` replaces reading
    ``model_path``'s config; weights load from ``model_path`` when given. megatron-core's parallel state is
    initialised here if it is not yet (CP runs in verl-dyncp's groups). ``mtp``: ``MtpConfig`` or None; ``lora``:
    the model's ``LoraConfig``; ``fused_lm_head``: ``model.use_fused_kernels``; ``engine_class``: an
    :class:`RLEngine` subclass a trainer adapter uses to speak its trainer's loss convention.
    """
    model = _model_config(
        engine=engine,
        model_path=model_path,
        hf_config=hf_config,
        override_model_config=override_model_config,
        mtp=mtp,
        lora=lora,
        value_model=value_model,
    )
    debug = device.type == "cpu"
    refuse_router_replay_layout(engine, trains=optim is not None and not engine.forward_only)
    parallel = _parallel_state(engine, model=model, device=device, debug=debug)
    trains = optim is not None and not engine.forward_only
    tf_config = _transformer_config(engine, model=model, parallel=parallel, device=device, trains=trains)
    moe = moe_routing(
        tf_config,
        pool_size=parallel.pool,
        trains=trains,
        padded_rows=not engine.use_remove_padding,
        model_name=f"{model.path or '(hf_config)'} ({model.hf.get('model_type')!r})",
    )
    replay = router_replay_settings(engine.router_replay, tf_config=tf_config, trains=trains)
    chunks = _model_chunks(engine, model=model, tf_config=tf_config, device=device, trains=trains)
    if moe is not None:
        from megatron.core import parallel_state

        from verl_engine.moe import route_over_pool

        group = parallel_state.get_tensor_and_data_parallel_group()
        route_over_pool(chunks, group=group, mtp_layers=model.mtp_layers)
    optimizer, lr_schedule = training_state(
        chunks,
        engine=engine,
        optim=optim if trains else None,
        mtp_pipeline=bool(model.mtp_layers) and parallel.pp > 1,
        debug=debug,
        tf_config=tf_config,
        total_training_steps=total_training_steps,
    )
    rl = _assemble(
        chunks,
        engine=engine,
        model=model,
        parallel=parallel,
        tf_config=tf_config,
        optimizer=optimizer,
        lr_schedule=lr_schedule,
        backend=_backend(optim, debug=debug, pool=parallel.pool),
        micro_batching=micro_batching,
        device=device,
        fused_lm_head=fused_lm_head,
        mtp=mtp if trains and model.mtp_layers and mtp.enable_train else None,  # type: ignore[union-attr]  # mtp is set
        moe=moe,
        engine_class=engine_class,
    )
    return install_router_replay(rl, replay)


def _model_config(
    *,
    engine: Any,
    model_path: str | None,
    hf_config: Mapping[str, Any] | None,
    override_model_config: Mapping[str, Any] | None,
    mtp: Any | None,
    lora: Any | None,
    value_model: bool,
) -> _Model:
    """The Hugging Face config with the role's overrides; MTP and LoRA resolved and checked together."""
    if hf_config is None:
        if not model_path:
            raise ValueError("give model.path (a Hugging Face model directory) or an hf_config")
        hf_config = load_hf_config(model_path)
    hf = {**dict(hf_config), **dict(override_model_config or {})}
    mtp_layers = _mtp_layers(mtp, hf=hf, model_path=model_path, value_model=value_model)
    lora = lora if lora is not None and lora.enabled else None
    if lora is not None and mtp_layers and mtp.enable_train:  # type: ignore[union-attr]  # mtp is set
        raise NotImplementedError(
            "actor_rollout_ref.model.mtp.enable_train=true with LoRA (model.lora.rank > 0): the adapters cover"
            " the decoder only, so the MTP layers would stay frozen and their loss would train nothing; set"
            " mtp.enable_train=false or lora.rank=0"
        )
    if lora is not None and engine.use_megatron_fsdp:
        raise NotImplementedError(
            "LoRA (model.lora.rank > 0) with megatron.use_megatron_fsdp=true is not supported by verl-engine yet;"
            " LoRA trains only the adapters, so plain DDP (use_megatron_fsdp=false) holds little optimizer state"
        )
    return _Model(hf=hf, path=model_path, mtp_layers=mtp_layers, lora=lora, value_model=value_model)


def _parallel_state(engine: Any, *, model: _Model, device: torch.device, debug: bool) -> _Parallel:
    """megatron-core's parallel state (initialised here if needed, else checked) and the role's CP layout."""
    from megatron.core import parallel_state as ps

    from verl_mcore_utils.parallel import init_parallel, seed_cuda_rng_tracker

    check_expert_parallel(engine, hf=model.hf, model_name=model.path or "(hf_config)")
    wanted = (
        engine.tensor_model_parallel_size,
        engine.pipeline_model_parallel_size,
        engine.virtual_pipeline_model_parallel_size,
        engine.expert_model_parallel_size,
        engine.expert_tensor_parallel_size or engine.tensor_model_parallel_size,
    )
    if not ps.model_parallel_is_initialized():
        init_parallel(
            tensor_model_parallel_size=wanted[0],
            pipeline_model_parallel_size=wanted[1],
            virtual_pipeline_model_parallel_size=wanted[2],
            **expert_sizes(engine),
            device=device.type,
        )
    initialised = (
        ps.get_tensor_model_parallel_world_size(),
        ps.get_pipeline_model_parallel_world_size(),
        ps.get_virtual_pipeline_model_parallel_world_size(),
        ps.get_expert_model_parallel_world_size(),
        ps.get_expert_tensor_parallel_world_size(),
    )
    if initialised != wanted:
        raise ValueError(
            f"megatron-core is initialised with TP / PP / VPP / EP / ETP sizes {initialised} but this"
            f" role's section asks for {wanted}; roles sharing a process group must share the model-parallel layout"
        )
    seed_cuda_rng_tracker(seed=engine.seed, device=device)  # SP / TP forwards fork its states
    if debug and wanted[1] > 1 and model.hf.get("tie_word_embeddings") and not model.value_model:
        raise NotImplementedError(
            "tie_word_embeddings with pipeline_model_parallel_size > 1 needs CUDA: megatron-core copies the last"
            " stage's tied output weight to the GPU when it builds the model; run on GPUs, or untie the embeddings"
            " (model.override_config.model_config.tie_word_embeddings=false) for the CPU backend"
        )
    pool = ps.get_data_parallel_world_size()
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
    return _Parallel(tp=initialised[0], pp=initialised[1], vpp=initialised[2], pool=pool, layout=layout)


def _transformer_config(
    engine: Any, *, model: _Model, parallel: _Parallel, device: torch.device, trains: bool
) -> Any:
    """megatron-core's TransformerConfig of the model (float32 on the CPU debug backend)."""
    from verl_mcore_utils.transformer_config import hf_to_transformer_config
    from verl_mcore_utils.wgrad_fusion import with_wgrad_fusion

    debug = device.type == "cpu"
    return hf_to_transformer_config(
        model.hf,
        dtype="float32" if debug else engine.dtype,
        tensor_model_parallel_size=parallel.tp,
        pipeline_model_parallel_size=parallel.pp,
        virtual_pipeline_model_parallel_size=parallel.vpp,
        context_parallel_size=1,
        **expert_sizes(engine),
        sequence_parallel=engine.sequence_parallel and parallel.tp > 1,
        # weight gradients accumulated into DDP's main_grad inside the GEMM, where the chunks get megatron DDP
        overrides=with_wgrad_fusion(
            engine.given_transformer_overrides(),
            device=device,
            megatron_ddp=trains and not debug and not engine.use_megatron_fsdp,
        ),
    )


def _model_chunks(
    engine: Any, *, model: _Model, tf_config: Any, device: torch.device, trains: bool
) -> list[torch.nn.Module]:
    """This rank's model chunks: built, LoRA inserted, weights loaded, then wrapped (DDP or Megatron-FSDP
    for a role that trains on GPUs; the CPU debug backend takes the bare chunks)."""
    from verl_dyncp.model import THDGPTModelProvider
    from verl_mcore_utils.ddp import WrapConfig

    debug = device.type == "cpu"
    torch.manual_seed(engine.seed)  # identical weights whatever the DP / CP layout
    provider = THDGPTModelProvider(
        hf_config=model.hf,
        transformer_config=tf_config,
        device=device,
        kernel=engine.packed_attention_backend,
        mtp_num_layers=model.mtp_layers,
        ddp_defaults=VERL_DDP_DEFAULTS,
    )
    wrap = WrapConfig(
        **{
            **engine.wrap_config_kwargs(is_value_model=model.value_model),
            "wrap_with_ddp": trains and not debug,
        }
    )
    hooks: list[Any] = []
    if model.lora is not None:
        from verl_mcore_utils.lora import peft_pre_wrap_hook

        # adapters seeded by engine.seed and the module name: the same adapter at every TP / PP layout
        hooks.append(peft_pre_wrap_hook(model.lora, hf_config=model.hf, seed=engine.seed, verbose=False))
    if model.path:  # before wrapping: Megatron-FSDP shards the parameters when it wraps them
        hooks.append(partial(_load_weights, model_path=model.path, hf_config=model.hf, lora=model.lora))
    if engine.use_megatron_fsdp and not debug:
        from verl_mfsdp.wrap import make_megatron_fsdp_module as make
    else:
        from verl_mcore_utils.module import make_megatron_module as make
    chunks = make(
        provider, wrap_config=wrap, override_ddp_config=engine.override_ddp_config, pre_wrap_hooks=hooks
    )
    if model.mtp_layers and engine.pipeline_model_parallel_size > 1:
        from verl_mcore_utils.mtp import sync_mtp_embedding

        sync_mtp_embedding(chunks, grads=False)  # the last stage's embedding copy starts as the first stage's
    return chunks


def _backend(optim: Any | None, *, debug: bool, pool: int) -> DebugBackend | MegatronBackend:
    if not debug:
        return MegatronBackend()
    from megatron.core import parallel_state

    return DebugBackend(
        clip_grad=float(optim.clip_grad) if optim is not None else 0.0,
        pool_group=parallel_state.get_data_parallel_group(),
        pool_size=pool,
        expert_group=expert_data_parallel_group(),
    )


def _assemble(
    chunks: list[torch.nn.Module],
    *,
    engine: Any,
    model: _Model,
    parallel: _Parallel,
    tf_config: Any,
    optimizer: Any,
    lr_schedule: Any,
    backend: Any,
    micro_batching: MicroBatching,
    device: torch.device,
    fused_lm_head: bool,
    mtp: Any | None,
    moe: MoeRouting | None = None,
    engine_class: type[RLEngine] = RLEngine,
) -> RLEngine:
    from megatron.core import parallel_state

    from verl_dyncp.planner import MEASURED_ATTENTION_COST_FACTOR, WorkloadModel
    from verl_engine.pipeline import PipelineLayout

    trains = optimizer is not None
    return engine_class(
        model=chunks,
        optimizer=optimizer,
        backend=backend,
        tp_group=parallel_state.get_tensor_model_parallel_group() if parallel.tp > 1 else None,
        tp_size=parallel.tp,
        device=device,
        cp_layout=parallel.layout,
        cp_groups=_pool_cp_groups(parallel_state.get_data_parallel_group()),
        cp_workload=WorkloadModel.from_transformer_config(
            tf_config,
            vocab_size=None if model.value_model else model.hf.get("vocab_size"),
            attention_cost_factor=MEASURED_ATTENTION_COST_FACTOR,
        ),
        micro_batching=micro_batching,
        value_model=model.value_model,
        use_remove_padding=engine.use_remove_padding,
        fused_lm_head=fused_lm_head,
        lr_schedule=lr_schedule,
        tokenizer_path=model.path,
        pipeline=PipelineLayout.from_parallel_state(),
        mtp_embedding_copy=bool(model.mtp_layers) and parallel.pp > 1 and trains,
        hf_config=model.hf,
        mtp=None
        if mtp is None
        else MtpSettings(
            num_layers=model.mtp_layers,
            scaling_factor=float(mtp.mtp_loss_scaling_factor),
            detach_encoder=bool(mtp.detach_encoder),
        ),
        lora=model.lora,
        moe=moe,
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
    cfg: Any, *, role: str, device: torch.device, hf_config: Mapping[str, Any] | None = None
) -> RLEngine:
    """The engine of ``role`` (actor | ref | critic) from a loaded ``ppo_trainer`` config (model_engine=megatron)."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}; got {role!r}")
    if cfg.model_engine != "megatron":
        raise ValueError(
            f"model_engine is {cfg.model_engine!r}; verl-engine is the Megatron engine: load the config with"
            " model_engine=megatron"
        )
    check_supported(cfg, role=role)  # before any model is built: a valid verl setting we would ignore
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


def _pool_cp_groups(data_parallel_group: Any) -> Any:
    """verl-dyncp CP groups over megatron-core's data-parallel groups (one rank list per TP/PP position)."""
    import torch.distributed as dist

    from verl_dyncp.groups import CPGroups

    mine = dist.get_process_group_ranks(data_parallel_group)
    lists: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(lists, sorted(mine))
    return CPGroups(rank_lists=sorted({tuple(r) for r in lists}))
