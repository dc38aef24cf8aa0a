"""Engine sections (``fsdp_config`` / ``megatron``); their optimizer sections are in :mod:`verl_config.optim`
(re-exported here).

Defaults are verl's, so a verl command line means the same here. Each section validates itself and
converts to the plain keyword arguments the lower layers take (:meth:`McoreEngineConfig.wrap_config_kwargs`
for verl-mcore-utils' WrapConfig, ...), so no trainer re-derives them and drops one (see the README's
design notes).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from verl_config.errors import ConfigValueError
from verl_config.notes import adjusting, note
from verl_config.optim import FSDPOptimConfig, McoreOptimConfig, megatron_optimizer_kwargs
from verl_config.validation import (
    check_choice,
    check_dynamic_context_parallel,
    check_positive,
    check_positive_keys,
)

__all__ = [
    "DTYPES",
    "MEGATRON_FSDP_SHARDING_STRATEGIES",
    "QAT_MODES",
    "FSDPEngineConfig",
    "FSDPOptimConfig",
    "McoreEngineConfig",
    "McoreLayoutConfig",
    "McoreOptimConfig",
    "QATEngineConfig",
    "RouterReplayConfig",
    "megatron_optimizer_kwargs",
]

DTYPES = ("float32", "bfloat16", "float16")
MEGATRON_FSDP_SHARDING_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
_RECOMPUTE_GRANULARITY = (None, "full", "selective")
_RECOMPUTE_METHOD = (None, "uniform", "block")
_ATTENTION_BACKENDS = ("flash", "fused", "unfused", "local", "auto")
# Attention of the packed (THD) path (verl-dyncp): torch kernels, or Transformer Engine's when installed.
PACKED_ATTENTION_BACKENDS = ("auto", "varlen", "cudnn", "sdpa", "te")


QAT_MODES = ("w4a16", "w4a4")
_QAT_OBSERVERS = (None, "static_minmax", "memoryless_minmax", "minmax")


@dataclass
class QATEngineConfig:
    """Quantization-aware training of an engine (``fsdp_config.qat`` / ``megatron.qat``, off by default).

    ``mode`` is w4a16 (4-bit weights) or w4a4 (4-bit weights and activations); weights are quantized in
    blocks of ``group_size``; modules matching ``ignore_patterns`` stay in full precision;
    ``activation_observer`` sets the activations' global scale (w4a4 only); ``quantization_config_path``
    is the JSON the rollout engine reads.
    """

    enable: bool = False
    mode: str = "w4a16"
    group_size: int = 16
    ignore_patterns: list[str] = field(default_factory=lambda: ["lm_head", "embed_tokens", "re:.*mlp.gate$"])
    activation_observer: str | None = "static_minmax"
    quantization_config_path: str | None = None

    def __post_init__(self) -> None:
        check_choice("mode", self.mode, QAT_MODES)
        check_positive("group_size", self.group_size)


@dataclass
class RouterReplayConfig:
    """MoE router replay of an engine (``megatron.router_replay``): record / replay expert routing (R2, R3)."""

    mode: str = "disabled"
    record_file: str | None = None
    replay_file: str | None = None

    def __post_init__(self) -> None:
        check_choice("mode", self.mode, ("disabled", "R2", "R3"))


def _mcore_qat() -> QATEngineConfig:
    """verl's megatron yaml: the gate pattern in megatron's module naming, no activation observer."""
    return QATEngineConfig(ignore_patterns=["lm_head", "*mlp.gate"], activation_observer=None)


def _default_turbo_config() -> dict[str, Any]:
    """verl's ``fsdp_config.turbo_config`` (the layout of its fsdp_turbo strategy)."""
    return {
        "distributed": {
            "fully_shard_parallel_size": 16,
            "tensor_parallel_size": 1,
            "expert_parallel_size": 1,
            "expert_fully_shard_parallel_size": 1,
            "ulysses_parallel_size": 1,
            "fsdp_plan": {
                "param_dtype": "bf16",
                "reduce_dtype": "fp32",
                "output_dtype": "bf16",
                "fsdp_implementation": "native",
                "num_to_forward_prefetch": 1,
                "num_to_backward_prefetch": 1,
            },
        }
    }


def _default_override_transformer_config() -> dict[str, Any]:
    return {
        "recompute_granularity": None,
        "recompute_modules": ["core_attn"],
        "recompute_method": None,
        "recompute_num_layers": None,
        "attention_backend": "flash",
    }


@dataclass
class _McoreParamOffload:
    param_offload: bool = False


@dataclass
class McoreLayoutConfig(_McoreParamOffload):
    """The keys every Megatron section shares: parameter offload, the parallel layout, the checkpoint format.

    Declared once for the engine section (:class:`McoreEngineConfig`) and the reward model's
    (``verl_config.reward.McoreRewardEngineConfig``). ``param_offload`` sits in a base of its own so that
    McoreEngineConfig can place its grad / optimizer offload keys right after it: dataclass fields follow
    the bases in reverse MRO order, and both sections keep verl's key order.
    """

    tensor_model_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int | None = None
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int | None = None
    context_parallel_size: int = 1
    sequence_parallel: bool = True
    use_distributed_optimizer: bool = True
    use_dist_checkpointing: bool = False
    dist_checkpointing_path: str | None = None
    dist_checkpointing_prefix: str = ""

    def __post_init__(self) -> None:
        check_positive_keys(
            self,
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "context_parallel_size",
            "expert_model_parallel_size",
        )


@dataclass
class _McoreStateOffload(_McoreParamOffload):
    grad_offload: bool = False
    optimizer_offload: bool = False


@dataclass
class McoreEngineConfig(McoreLayoutConfig, _McoreStateOffload):
    """The Megatron engine section (``actor_rollout_ref.actor.megatron``, ``critic.megatron``, ...).

    Every key of verl's section with verl's defaults, plus Megatron-FSDP and dynamic context
    parallelism. ``use_dynamic_bsz``, ``max_token_len_per_gpu`` and ``micro_batch_size_per_gpu``
    follow the role's own keys inside the PPO config (interpolations); setting them to a different
    value than the role's is an error rather than a silent tie-break.
    """

    dynamic_context_parallel: bool = False
    max_seqlen_per_dp_cp_rank: int | None = None
    packed_attention_backend: str = "auto"
    entropy_from_logits_with_chunking: bool = False
    entropy_from_logits_chunk_size: int = 2048
    pad_bshd_to_minibatch_max: bool = True
    pad_to_length: bool = False
    pad_to_length_bucket: int = 512
    dist_ckpt_optim_fully_reshardable: bool = False
    distrib_optim_fully_reshardable_mem_efficient: bool = False
    seed: int = 42
    override_ddp_config: dict[str, Any] = field(default_factory=dict)
    override_transformer_config: dict[str, Any] = field(default_factory=_default_override_transformer_config)
    override_mcore_model_config: dict[str, Any] = field(default_factory=dict)
    use_mbridge: bool = True
    vanilla_mbridge: bool = False
    use_remove_padding: bool = True
    forward_only: bool = False
    dtype: str = "bfloat16"
    use_megatron_fsdp: bool = False
    router_replay: RouterReplayConfig = field(default_factory=RouterReplayConfig)
    qat: QATEngineConfig = field(default_factory=_mcore_qat)
    use_dynamic_bsz: bool = True
    max_token_len_per_gpu: int | None = None
    micro_batch_size_per_gpu: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive_keys(
            self,
            "expert_tensor_parallel_size",
            "virtual_pipeline_model_parallel_size",
            "micro_batch_size_per_gpu",
            optional=True,
        )
        if self.max_token_len_per_gpu is not None:
            check_positive("max_token_len_per_gpu", self.max_token_len_per_gpu)
        check_choice("dtype", self.dtype, DTYPES)
        check_choice("packed_attention_backend", self.packed_attention_backend, PACKED_ATTENTION_BACKENDS)
        if self.virtual_pipeline_model_parallel_size is not None and self.pipeline_model_parallel_size == 1:
            raise ConfigValueError(
                "virtual_pipeline_model_parallel_size",
                f"is {self.virtual_pipeline_model_parallel_size} but pipeline_model_parallel_size is 1;"
                " virtual (interleaved) pipeline stages need pipeline_model_parallel_size > 1, or set it to null",
            )
        if self.sequence_parallel and self.tensor_model_parallel_size == 1 and adjusting():
            self.sequence_parallel = False
            note(
                "sequence_parallel",
                "forced to false because tensor_model_parallel_size is 1 (it only splits TP work)",
            )
        self._check_dynamic_cp()
        self._check_one_distributed_optimizer_source()
        self._check_megatron_fsdp()
        if self.use_dist_checkpointing and not self.dist_checkpointing_path:
            raise ConfigValueError(
                "dist_checkpointing_path",
                "is null but use_dist_checkpointing is true; point it at the megatron dist checkpoint to load"
                " or set use_dist_checkpointing=false",
            )
        tc = self.override_transformer_config
        for key, allowed in (
            ("recompute_granularity", _RECOMPUTE_GRANULARITY),
            ("recompute_method", _RECOMPUTE_METHOD),
            ("attention_backend", _ATTENTION_BACKENDS),
        ):
            if key in tc:
                check_choice(f"override_transformer_config.{key}", tc[key], allowed)
        self._check_recompute(tc)

    def _check_recompute(self, tc: dict[str, Any]) -> None:
        """megatron-core's recompute rules, checked before a model is built.

        Full recomputation needs a method and a layer count (TransformerConfig raises otherwise);
        a method without full recomputation is accepted by megatron-core and verl but does nothing,
        so it is a note.
        """
        granularity = tc.get("recompute_granularity")
        if granularity == "full":
            for key, example in (("recompute_method", "uniform"), ("recompute_num_layers", "1")):
                if tc.get(key) is None:
                    raise ConfigValueError(
                        f"override_transformer_config.{key}",
                        f"is null but override_transformer_config.recompute_granularity is 'full'; megatron-core"
                        f" needs both: set +override_transformer_config.{key}={example}",
                    )
        elif granularity == "selective" and tc.get("recompute_num_layers") is not None:
            raise ConfigValueError(
                "override_transformer_config.recompute_num_layers",
                f"is {tc['recompute_num_layers']} but recompute_granularity is 'selective'; megatron-core requires it"
                " null there (it counts layers of full recomputation): set it to null",
            )
        if granularity != "full" and tc.get("recompute_method") is not None and adjusting():
            note(
                "override_transformer_config.recompute_method",
                f"{tc['recompute_method']!r} has no effect: recompute_granularity is {granularity!r} (only 'full' uses it)",
            )

    def _check_dynamic_cp(self) -> None:
        check_dynamic_context_parallel(
            dynamic_context_parallel=self.dynamic_context_parallel,
            max_seqlen_per_dp_cp_rank=self.max_seqlen_per_dp_cp_rank,
        )
        if self.dynamic_context_parallel:
            if not self.use_remove_padding:
                raise ConfigValueError(
                    "use_remove_padding",
                    "is false but dynamic_context_parallel is true; dynamic CP works on packed (THD) sequences,"
                    " set use_remove_padding=true",
                )
        elif self.max_seqlen_per_dp_cp_rank is not None and adjusting():
            note(
                "max_seqlen_per_dp_cp_rank",
                f"{self.max_seqlen_per_dp_cp_rank} has no effect because dynamic_context_parallel is false",
            )

    def _check_one_distributed_optimizer_source(self) -> None:
        """DDP lays out its gradient buffers for the distributed optimizer or not, and the optimizer is built
        for one of the two: both read ``use_distributed_optimizer``, so an override that says otherwise is an
        error rather than a silent disagreement."""
        given = self.override_ddp_config.get("use_distributed_optimizer")
        if given is not None and bool(given) != bool(self.use_distributed_optimizer):
            raise ConfigValueError(
                "override_ddp_config.use_distributed_optimizer",
                f"is {str(bool(given)).lower()} but use_distributed_optimizer is"
                f" {str(bool(self.use_distributed_optimizer)).lower()}; DDP and the optimizer"
                f" must agree: set use_distributed_optimizer={str(bool(given)).lower()} and drop"
                " override_ddp_config.use_distributed_optimizer",
            )

    def _check_megatron_fsdp(self) -> None:
        strategy = self.override_ddp_config.get("data_parallel_sharding_strategy")
        if strategy is not None:
            check_choice(
                "override_ddp_config.data_parallel_sharding_strategy",
                strategy,
                MEGATRON_FSDP_SHARDING_STRATEGIES,
            )
        if not self.use_megatron_fsdp:
            return
        if (
            not self.use_distributed_optimizer
            or self.override_ddp_config.get("use_distributed_optimizer") is False
        ):
            key = (
                "use_distributed_optimizer"
                if not self.use_distributed_optimizer
                else "override_ddp_config.use_distributed_optimizer"
            )
            raise ConfigValueError(
                key,
                "is false but use_megatron_fsdp is true; Megatron-FSDP shards the optimizer state, so it requires"
                " the distributed optimizer: remove the setting or set use_megatron_fsdp=false",
            )
        if self.pipeline_model_parallel_size > 1 or self.virtual_pipeline_model_parallel_size is not None:
            raise ConfigValueError(
                "pipeline_model_parallel_size",
                f"is {self.pipeline_model_parallel_size} but use_megatron_fsdp is true; Megatron-FSDP does not support"
                " pipeline parallelism: set pipeline_model_parallel_size=1 (and virtual_pipeline_model_parallel_size=null)",
            )

    @property
    def construction_path(self) -> str:
        """Which model-construction path the flags select: ``plain``, ``mbridge`` or ``provider``."""
        if not self.use_mbridge:
            return "plain"
        return "mbridge" if self.vanilla_mbridge else "provider"

    def model_parallel_size(self) -> int:
        """Ranks one model replica spans: TP x PP x CP."""
        return (
            self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.context_parallel_size
        )

    def parallel_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for megatron-core's ``parallel_state.initialize_model_parallel``."""
        return {
            "tensor_model_parallel_size": self.tensor_model_parallel_size,
            "pipeline_model_parallel_size": self.pipeline_model_parallel_size,
            "virtual_pipeline_model_parallel_size": self.virtual_pipeline_model_parallel_size,
            "context_parallel_size": self.context_parallel_size,
            "expert_model_parallel_size": self.expert_model_parallel_size,
            "expert_tensor_parallel_size": self.expert_tensor_parallel_size,
        }

    def wrap_config_kwargs(
        self, *, is_value_model: bool = False, share_embeddings_and_output_weights: bool = False
    ) -> dict[str, Any]:
        """Keyword arguments for ``verl_mcore_utils.WrapConfig`` (no DDP wrapper when forward_only)."""
        return {
            "is_value_model": is_value_model,
            "share_embeddings_and_output_weights": share_embeddings_and_output_weights,
            "wrap_with_ddp": not self.forward_only,
            "use_distributed_optimizer": self.use_distributed_optimizer,
            "use_megatron_fsdp": self.use_megatron_fsdp,
        }

    def transformer_config_overrides(self) -> dict[str, Any]:
        """TransformerConfig fields this section sets: parallel sizes, sequence_parallel, then the overrides.

        ``attention_backend`` stays a string (this package has no megatron import); verl-mcore-utils
        converts it to megatron-core's enum.
        """
        fields: dict[str, Any] = {
            "tensor_model_parallel_size": self.tensor_model_parallel_size,
            "pipeline_model_parallel_size": self.pipeline_model_parallel_size,
            "context_parallel_size": self.context_parallel_size,
            "expert_model_parallel_size": self.expert_model_parallel_size,
            "sequence_parallel": self.sequence_parallel,
        }
        if self.expert_tensor_parallel_size is not None:
            fields["expert_tensor_parallel_size"] = self.expert_tensor_parallel_size
        if self.virtual_pipeline_model_parallel_size is not None:
            fields["virtual_pipeline_model_parallel_size"] = self.virtual_pipeline_model_parallel_size
        fields.update(self.override_transformer_config)
        return fields

    def given_transformer_overrides(self) -> dict[str, Any]:
        """``override_transformer_config`` without verl's null placeholders (``recompute_method: null`` ...).

        A null there means "not set" in verl's defaults: megatron-core's own default must stay.
        """
        return {k: v for k, v in self.override_transformer_config.items() if v is not None}

    def ddp_config_overrides(self) -> dict[str, Any]:
        """The user's ``override_ddp_config`` (verl-mcore-utils' build_ddp_config applies the precedence)."""
        return dict(self.override_ddp_config)


@dataclass
class FSDPEngineConfig:
    """The FSDP engine section (``actor_rollout_ref.actor.fsdp_config``, ``critic.fsdp`` ...)."""

    wrap_policy: dict[str, Any] = field(default_factory=lambda: {"min_num_params": 0})
    param_offload: bool = False
    optimizer_offload: bool = False
    offload_policy: bool = False
    reshard_after_forward: bool = True
    fsdp_size: int = -1
    forward_prefetch: bool = False
    model_dtype: str = "fp32"
    use_orig_params: bool = False
    seed: int = 42
    full_determinism: bool = False
    ulysses_sequence_parallel_size: int = 1
    entropy_from_logits_with_chunking: bool = False
    entropy_from_logits_chunk_size: int = 2048
    use_torch_compile: bool = True
    entropy_checkpointing: bool = False
    use_no_sync_for_gradient_accumulation: bool = False
    pad_to_length: bool = False
    pad_to_length_bucket: int = 1024
    forward_only: bool = False
    strategy: str = "fsdp"
    dtype: str = "bfloat16"
    qat: QATEngineConfig = field(default_factory=QATEngineConfig)
    turbo_config: dict[str, Any] = field(default_factory=_default_turbo_config)

    def __post_init__(self) -> None:
        check_choice("strategy", self.strategy, ("fsdp", "fsdp2"))
        check_positive_keys(self, "entropy_from_logits_chunk_size", "pad_to_length_bucket")
        check_positive("ulysses_sequence_parallel_size", self.ulysses_sequence_parallel_size)
        if self.fsdp_size != -1:
            check_positive("fsdp_size", self.fsdp_size)
        check_choice("model_dtype", self.model_dtype, ("fp32", "bf16", "fp16", *DTYPES))
        check_choice("dtype", self.dtype, DTYPES)
        if self.offload_policy and self.strategy != "fsdp2":
            raise ConfigValueError(
                "offload_policy", "needs strategy=fsdp2 (FSDP2's CPUOffloadPolicy); set strategy=fsdp2"
            )
