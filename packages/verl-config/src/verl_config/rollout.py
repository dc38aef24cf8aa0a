"""The rollout section (``actor_rollout_ref.rollout``): generation engine settings, verl's keys and defaults.

The engine itself (vLLM, SGLang, TensorRT-LLM) is not ours; the section is typed so that every
key a verl command line sets is accepted with its type checked, and verl's own rules (no
``sync`` mode, expert parallel = TP x DP, no pipeline parallel in the serving engines) fail here
with the keys named instead of at rollout start-up on a cluster.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

from verl_config.errors import ConfigValueError
from verl_config.profiler import ProfilerConfig, follower_profiler
from verl_config.validation import check_choice, check_positive, check_positive_keys, check_unit_interval

__all__ = [
    "ROLLOUT_NAMES",
    "AgentLoopConfig",
    "CheckpointEngineConfig",
    "DisaggregationConfig",
    "FSDPRolloutConfig",
    "McoreRolloutConfig",
    "MultiTurnConfig",
    "PrometheusConfig",
    "RolloutConfig",
    "SamplingConfig",
    "TraceConfig",
]

# verl's rollout registry (verl/workers/rollout/base.py): the engines a rollout can be served by.
ROLLOUT_NAMES = ("vllm", "sglang", "trtllm")


@dataclass
class SamplingConfig:
    """Sampling parameters for validation generations (``rollout.val_kwargs``)."""

    top_k: int = -1
    top_p: float = 1.0
    temperature: float = 0.0
    n: int = 1
    do_sample: bool = False


@dataclass
class MultiTurnConfig:
    """Multi-turn / tool-calling rollouts (``rollout.multi_turn``)."""

    enable: bool = False
    max_assistant_turns: int | None = None
    tool_config_path: str | None = None
    max_user_turns: int | None = None
    max_parallel_calls: int = 1
    max_tool_response_length: int = 256
    tool_response_truncate_side: str = "middle"
    function_tool_path: str | None = None
    use_inference_chat_template: bool = False
    tokenization_sanity_check_mode: str = "strict"
    format: str = "hermes"
    num_repeat_rollouts: int | None = None

    def __post_init__(self) -> None:
        check_choice(
            "tool_response_truncate_side", self.tool_response_truncate_side, ("left", "right", "middle")
        )
        check_choice(
            "tokenization_sanity_check_mode",
            self.tokenization_sanity_check_mode,
            ("disable", "strict", "ignore_strippable"),
        )


@dataclass
class AgentLoopConfig:
    """Agent loop workers (``rollout.agent``)."""

    num_workers: int = 8
    default_agent_loop: str = "single_turn_agent"
    agent_loop_config_path: str | None = None
    custom_async_server: dict[str, Any] = field(default_factory=lambda: {"path": None, "name": None})

    def __post_init__(self) -> None:
        check_positive("num_workers", self.num_workers)


@dataclass
class CheckpointEngineConfig:
    """How trained weights reach the rollout engine (``rollout.checkpoint_engine``)."""

    backend: str | None = "naive"
    update_weights_bucket_megabytes: int = 2048
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    custom_backend_module: str | None = None

    def __post_init__(self) -> None:
        check_positive("update_weights_bucket_megabytes", self.update_weights_bucket_megabytes)


@dataclass
class TraceConfig:
    """Rollout tracing (``rollout.trace``)."""

    backend: str | None = None
    token2text: bool = False
    max_samples_per_step_per_worker: int | None = None
    project_name: str | None = "${trainer.project_name}"
    experiment_name: str | None = "${trainer.experiment_name}"

    def __post_init__(self) -> None:
        if self.max_samples_per_step_per_worker is not None:
            check_positive(
                "max_samples_per_step_per_worker", self.max_samples_per_step_per_worker, allow_zero=True
            )


@dataclass
class PrometheusConfig:
    """Serving metrics (``rollout.prometheus``)."""

    enable: bool = False
    port: int = 9090
    file: str = "/tmp/ray/session_latest/metrics/prometheus/prometheus.yml"
    served_model_name: str | None = "${actor_rollout_ref.model.path}"


_TRANSFER_BACKENDS = ("nixl", "mooncake", "ascend", "mori", "fake")
_MOONCAKE_PROTOCOLS = ("nvlink", "local", "rdma", "tcp")


@dataclass
class DisaggregationConfig:
    """Prefill / decode disaggregation of the serving engine (``rollout.disaggregation``, off by default).

    The rules apply only when ``enabled`` (as in verl): at least one replica of each kind, a known KV
    transfer backend, a TCP port for the bootstrap server.
    """

    enabled: bool = False
    prefill_replicas: int = 1
    decode_replicas: int = 1
    decode_tensor_model_parallel_size: int | None = None
    transfer_backend: str = "nixl"
    bootstrap_port: int | None = None
    ib_device: str | None = None
    mooncake_protocol: str = "nvlink"

    def __post_init__(self) -> None:
        if not self.enabled:
            return
        check_choice("transfer_backend", self.transfer_backend, _TRANSFER_BACKENDS)
        check_positive_keys(self, "prefill_replicas", "decode_replicas")
        check_positive_keys(self, "decode_tensor_model_parallel_size", optional=True)
        if self.bootstrap_port is not None and not 0 < self.bootstrap_port < 65536:
            raise ConfigValueError(
                "bootstrap_port", f"must be a TCP port (1..65535); got {self.bootstrap_port}"
            )
        if self.transfer_backend == "mooncake":
            check_choice("mooncake_protocol", self.mooncake_protocol, _MOONCAKE_PROTOCOLS)


def _rollout_profiler() -> ProfilerConfig:
    """The rollout's profiler block follows the actor's (verl's default)."""
    return follower_profiler("actor_rollout_ref.actor.profiler")


@dataclass
class RolloutConfig:
    """Generation engine settings common to both training engines."""

    # verl's ??? (mandatory): a config without a rollout loads; built as null, see require_name
    name: str | None = MISSING
    mode: str = "async"
    nnodes: int = 0
    n_gpus_per_node: int = "${trainer.n_gpus_per_node}"  # type: ignore[assignment]
    full_determinism: bool = False
    seed: int = 42
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    prompt_length: int = "${data.max_prompt_length}"  # type: ignore[assignment]
    response_length: int = "${data.max_response_length}"  # type: ignore[assignment]
    dtype: str = "bfloat16"
    gpu_memory_utilization: float = 0.5
    ignore_eos: bool = False
    enforce_eager: bool = False
    cudagraph_capture_sizes: list[int] | None = None
    free_cache_engine: bool = True
    tensor_model_parallel_size: int = 2
    data_parallel_size: int = 1
    # null is accepted for trtllm only: TensorRT-LLM then derives it (as it does from 1)
    expert_parallel_size: int | None = 1
    pipeline_model_parallel_size: int = 1
    # TensorRT-LLM's MoE tensor parallel size (> 1 only with trtllm; null or 1 = derived); verl's yaml lacks it
    moe_tensor_parallel_size: int | None = 1
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None
    max_num_seqs: int = 256
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    logprobs_mode: str | None = "processed_logprobs"
    scheduling_policy: str | None = "fcfs"
    load_format: str = "dummy"
    log_prob_micro_batch_size: int | None = None
    log_prob_micro_batch_size_per_gpu: int | None = None
    log_prob_use_dynamic_bsz: bool = "${actor_rollout_ref.actor.use_dynamic_bsz}"  # type: ignore[assignment]
    log_prob_max_token_len_per_gpu: int | None = "${actor_rollout_ref.actor.ppo_max_token_len_per_gpu}"  # type: ignore[assignment]
    disable_log_stats: bool = True
    do_sample: bool = True
    n: int = 1
    over_sample_rate: float = 0.0
    multi_stage_wake_up: bool = False
    engine_kwargs: dict[str, Any] = field(default_factory=lambda: {"vllm": {}, "sglang": {}, "trtllm": {}})
    val_kwargs: SamplingConfig = field(default_factory=SamplingConfig)
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    calculate_log_probs: bool = True
    agent: AgentLoopConfig = field(default_factory=AgentLoopConfig)
    checkpoint_engine: CheckpointEngineConfig = field(default_factory=CheckpointEngineConfig)
    trace: TraceConfig = field(default_factory=TraceConfig)
    skip_tokenizer_init: bool = True
    enable_rollout_routing_replay: bool = False
    profiler: ProfilerConfig | None = field(default_factory=_rollout_profiler)
    prometheus: PrometheusConfig = field(default_factory=PrometheusConfig)
    quantization: str | None = None
    quantization_config_file: str | None = None
    mtp: Any = "${actor_rollout_ref.model.mtp}"
    layered_summon: bool = False
    router_config_path: str | None = None
    moe_load_balance_metrics_interval: int = 0
    # the actor engine's qat section, whichever engine it is (the FSDP one if present, else the Megatron one)
    qat: Any = "${oc.select:actor_rollout_ref.actor.fsdp_config.qat,${oc.select:actor_rollout_ref.actor.megatron.qat,null}}"
    disaggregation: DisaggregationConfig = field(default_factory=DisaggregationConfig)

    def __post_init__(self) -> None:
        check_positive("nnodes", self.nnodes, allow_zero=True)
        check_positive(
            "moe_load_balance_metrics_interval", self.moe_load_balance_metrics_interval, allow_zero=True
        )
        if self.name not in (None, MISSING):  # unset is accepted as by verl; a rollout needs it to start
            check_choice("name", self.name, ROLLOUT_NAMES)
        if self.mode == "sync":
            raise ConfigValueError(
                "mode",
                "'sync' was removed from verl (only async rollouts exist); set mode=async or remove the key",
            )
        check_choice("mode", self.mode, ("async",))
        check_positive("n", self.n)
        check_positive_keys(
            self, "tensor_model_parallel_size", "data_parallel_size", "pipeline_model_parallel_size"
        )
        check_positive_keys(self, "expert_parallel_size", "moe_tensor_parallel_size", optional=True)
        check_unit_interval("gpu_memory_utilization", self.gpu_memory_utilization, open_low=True)
        check_choice("dtype", self.dtype, ("float32", "bfloat16", "float16"))
        if self.logprobs_mode is not None:
            check_choice(
                "logprobs_mode",
                self.logprobs_mode,
                ("raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits"),
            )
        self._check_moe_parallel()
        if self.pipeline_model_parallel_size > 1:
            raise ConfigValueError(
                "pipeline_model_parallel_size",
                f"is {self.pipeline_model_parallel_size} but rollout {self.name!r} has no pipeline parallel in verl;"
                " use tensor_model_parallel_size / data_parallel_size instead",
            )

    def require_name(self, key: str = "actor_rollout_ref.rollout.name") -> str:
        """The rollout engine's name, for a consumer that starts a rollout; an error naming ``key`` when unset
        (verl's default is ``???``: mandatory, and verl fails only when it reads it)."""
        if self.name in (None, MISSING):
            raise ConfigValueError(
                key,
                f"is not set (verl's default is ??? = mandatory) but a rollout is started; set {key}="
                f"{'|'.join(ROLLOUT_NAMES)} (YAML or override)",
            )
        return str(self.name)

    def _check_moe_parallel(self) -> None:
        """verl's RolloutConfig rules for the MoE layout of the serving engine (TensorRT-LLM has its own)."""
        if self.name == "trtllm":
            # null or 1 leaves a size to TensorRT-LLM; two given sizes must tile the tensor parallel ranks
            ep = None if self.expert_parallel_size in (None, 1) else self.expert_parallel_size
            moe_tp = None if self.moe_tensor_parallel_size in (None, 1) else self.moe_tensor_parallel_size
            if ep is not None and moe_tp is not None and ep * moe_tp != self.tensor_model_parallel_size:
                raise ConfigValueError(
                    "moe_tensor_parallel_size",
                    f"({moe_tp}) x expert_parallel_size ({ep}) must equal tensor_model_parallel_size"
                    f" ({self.tensor_model_parallel_size}) for trtllm",
                )
            return
        if self.expert_parallel_size is None:
            raise ConfigValueError(
                "expert_parallel_size",
                f"is null, which only trtllm accepts (rollout is {self.name!r}); set it (1 = no expert parallel)",
            )
        if self.moe_tensor_parallel_size is not None and self.moe_tensor_parallel_size > 1:
            raise ConfigValueError(
                "moe_tensor_parallel_size",
                f"is {self.moe_tensor_parallel_size} but only trtllm has a MoE tensor parallel size"
                f" (rollout is {self.name!r}); leave it at 1",
            )
        if self.expert_parallel_size > 1:
            expected = self.tensor_model_parallel_size * self.data_parallel_size
            if self.expert_parallel_size != expected:
                raise ConfigValueError(
                    "expert_parallel_size",
                    f"({self.expert_parallel_size}) must equal tensor_model_parallel_size"
                    f" ({self.tensor_model_parallel_size}) x data_parallel_size ({self.data_parallel_size}) = {expected}"
                    " (the serving engine spreads experts over its TP x DP ranks)",
                )


@dataclass
class FSDPRolloutConfig(RolloutConfig):
    """Rollout with the FSDP engine (the same keys; the class marks the engine)."""


@dataclass
class McoreRolloutConfig(RolloutConfig):
    """Rollout with the Megatron engine: names of the fused layers on the rollout side (qkv, gate_up)."""

    layer_name_map: dict[str, Any] = field(
        default_factory=lambda: {"qkv_layer_name": "qkv", "gate_proj_layer_name": "gate_up"}
    )
