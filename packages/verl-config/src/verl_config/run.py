"""Run control: the ``trainer`` section (logging, checkpoints, cluster size, verl 0.9's ``v1`` trainer),
``transfer_queue`` and ``ray_kwargs``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from verl_config.errors import ConfigValueError
from verl_config.validation import check_choice, check_positive

__all__ = [
    "HybridRolloutSwitchConfig",
    "RayKwargsConfig",
    "RunConfig",
    "TrainerV1Config",
    "TransferQueueConfig",
]


@dataclass
class HybridRolloutSwitchConfig:
    """``trainer.v1.separate_async.hybrid_rollout``: lend trainer GPUs to rollout while the trainer waits."""

    enable_switch: bool = False
    switch_threshold_ratio: float = 0.4
    adaptive_switch_threshold: bool = True
    switch_threshold_step_up: float = 0.05
    switch_threshold_step_down: float = 0.03
    switch_threshold_release_steps: int = 2
    switch_cost_window_size: int = 3

    def __post_init__(self) -> None:
        if not 0.0 < self.switch_threshold_ratio <= 1.0:
            raise ConfigValueError(
                "switch_threshold_ratio", f"must be in (0, 1]; got {self.switch_threshold_ratio}"
            )
        check_positive("switch_cost_window_size", self.switch_cost_window_size)


@dataclass
class ColocateAsyncConfig:
    num_warmup_batches: int = 1


@dataclass
class SeparateAsyncConfig:
    num_warmup_batches: int = 1
    parameter_sync_step: int = 4
    hybrid_rollout: HybridRolloutSwitchConfig = field(default_factory=HybridRolloutSwitchConfig)

    def __post_init__(self) -> None:
        check_positive("parameter_sync_step", self.parameter_sync_step)


@dataclass
class V1SamplerConfig:
    """``trainer.v1.sampler``: how stale (off-policy) samples are treated; ``custom_sampler`` replaces it."""

    max_off_policy_threshold: int | None = 8
    max_off_policy_strategy: str = "drop"
    sync_refill_failed_groups: bool = False
    custom_sampler: dict[str, Any] = field(default_factory=lambda: {"path": None, "name": None})
    sampler_kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_choice("max_off_policy_strategy", self.max_off_policy_strategy, ("drop", "wait"))


@dataclass
class TrainerV1Config:
    """``trainer.v1``: verl 0.9's trainer (``trainer.use_v1``); ``trainer_mode`` picks one of its schedules."""

    trainer_mode: str = "sync"
    sync: dict[str, Any] = field(default_factory=dict)
    colocate_async: ColocateAsyncConfig = field(default_factory=ColocateAsyncConfig)
    separate_async: SeparateAsyncConfig = field(default_factory=SeparateAsyncConfig)
    sampler: V1SamplerConfig = field(default_factory=V1SamplerConfig)

    def __post_init__(self) -> None:
        check_choice("trainer_mode", self.trainer_mode, ("sync", "colocate_async", "separate_async"))


@dataclass
class RunConfig:
    """The ``trainer`` section: run control, logging, checkpoints, cluster size.

    ``logger`` takes a list or one name (``trainer.logger=console`` means ``[console]``, as in verl).
    """

    balance_batch: bool = True
    total_epochs: int = 30
    total_training_steps: int | None = None
    project_name: str = "verl_examples"
    experiment_name: str = "gsm8k"
    logger: Any = field(default_factory=lambda: ["console", "wandb"])
    log_val_generations: int = 0
    rollout_data_dir: str | None = None
    validation_data_dir: str | None = None
    nnodes: int = 1
    n_gpus_per_node: int = 8
    save_freq: int = -1
    esi_redundant_time: int = 0
    resume_mode: str = "auto"
    resume_from_path: str | None = None
    checkpoint_callback_class: str | None = None
    val_before_train: bool = True
    val_only: bool = False
    test_freq: int = -1
    critic_warmup: int = 0
    default_hdfs_dir: str | None = None
    del_local_ckpt_after_load: bool = False
    default_local_dir: str = "checkpoints/${trainer.project_name}/${trainer.experiment_name}"
    max_actor_ckpt_to_keep: int | None = None
    max_critic_ckpt_to_keep: int | None = None
    remove_previous_ckpt_in_save: bool | None = None
    ray_wait_register_center_timeout: int = 300
    device: str = "cuda"
    use_v1: bool = True
    v1: TrainerV1Config = field(default_factory=TrainerV1Config)

    def __post_init__(self) -> None:
        check_positive("nnodes", self.nnodes)
        check_positive("n_gpus_per_node", self.n_gpus_per_node)
        check_positive("total_epochs", self.total_epochs)
        if self.total_training_steps is not None:
            check_positive("total_training_steps", self.total_training_steps)
        check_choice("resume_mode", self.resume_mode, ("auto", "disable", "resume_path"))
        if self.resume_mode == "resume_path" and not self.resume_from_path:
            raise ConfigValueError(
                "resume_from_path", "is null but resume_mode is 'resume_path'; give the checkpoint folder"
            )
        check_choice("device", self.device, ("cuda", "npu", "cpu"))
        if isinstance(self.logger, str) and "${" not in self.logger:
            self.logger = [self.logger]
        if not isinstance(self.logger, list | tuple):
            raise ConfigValueError("logger", f"must be a logger name or a list of them; got {self.logger!r}")
        for item in self.logger:
            check_choice(
                "logger",
                item,
                (
                    "console",
                    "wandb",
                    "tensorboard",
                    "mlflow",
                    "swanlab",
                    "vemlp_wandb",
                    "clearml",
                    "trackio",
                    "file",
                ),
            )

    @property
    def world_size(self) -> int:
        """Training processes: nnodes x n_gpus_per_node."""
        return self.nnodes * self.n_gpus_per_node


def _transfer_queue_backend() -> dict[str, Any]:
    """verl's transfer-queue storage: the in-process SimpleStorage, or a Mooncake store."""
    return {
        "storage_backend": "SimpleStorage",
        "SimpleStorage": {"total_storage_size": 100000, "num_data_storage_units": 8},
        "MooncakeStore": {
            "auto_init": False,
            "metadata_server": "localhost:50123",
            "master_server_address": "localhost:50124",
            "local_hostname": "localhost",
            "protocol": "tcp",
            "global_segment_size": 4294967296,
            "local_buffer_size": 1073741824,
            "device_name": "",
        },
    }


@dataclass
class TransferQueueConfig:
    """``transfer_queue``: verl's experimental data plane between roles."""

    enable: bool = False
    metrics: dict[str, Any] = field(default_factory=lambda: {"enabled": False, "port": 0})
    backend: dict[str, Any] = field(default_factory=_transfer_queue_backend)

    def __post_init__(self) -> None:
        storage = self.backend.get("storage_backend") if isinstance(self.backend, dict) else None
        if storage is not None:
            check_choice("backend.storage_backend", storage, ("SimpleStorage", "MooncakeStore"))


@dataclass
class RayKwargsConfig:
    """``ray_kwargs``: arguments of ``ray.init`` and the timeline dump."""

    ray_init: dict[str, Any] = field(
        default_factory=lambda: {"num_cpus": None, "runtime_env": {"py_executable": None}}
    )
    timeline_json_file: str | None = None
