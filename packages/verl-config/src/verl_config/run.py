"""Run control: the ``trainer`` section (logging, checkpoints, cluster size), ``transfer_queue`` and ``ray_kwargs``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from verl_config.errors import ConfigValueError
from verl_config.validation import check_choice, check_positive

__all__ = ["RayKwargsConfig", "RunConfig", "TransferQueueConfig"]


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
    use_legacy_worker_impl: str = "auto"

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
        check_choice("use_legacy_worker_impl", self.use_legacy_worker_impl, ("auto", "enable", "disable"))
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


@dataclass
class TransferQueueConfig:
    """``transfer_queue``: verl's experimental data plane between roles."""

    enable: bool = False


@dataclass
class RayKwargsConfig:
    """``ray_kwargs``: arguments of ``ray.init`` and the timeline dump."""

    ray_init: dict[str, Any] = field(default_factory=lambda: {"num_cpus": None})
    timeline_json_file: str | None = None
