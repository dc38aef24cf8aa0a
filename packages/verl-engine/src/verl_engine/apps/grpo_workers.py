"""Where the GRPO run's engines live: this process (:class:`InProcessWorkers`, a group of one or one rank of
a torchrun launch) or the actors of a Ray worker group (:class:`RayWorkers`); the loop is the same code."""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import torch

__all__ = ["InProcessWorkers", "RayWorkers", "Workers", "init_process_group", "is_rank0"]


class Workers(Protocol):
    """Where the engines live: this process (:class:`InProcessWorkers`) or Ray actors (:class:`RayWorkers`)."""

    def build(self, role: str, overrides: Sequence[str], hf_config: dict[str, Any] | None = None) -> None: ...

    def drop(self, role: str) -> None: ...

    def call(
        self, role: str, method: str, data: Any = None, *, loss: str | None = None, **kw: Any
    ) -> Any: ...

    def export_weights(self, role: str) -> Iterable[tuple[str, torch.Tensor]]: ...


class InProcessWorkers:
    """The engines in this process: a group of one, or one rank of a torchrun launch (every rank runs the
    loop; rollout, rewards and advantages are computed identically on each, only rank 0 writes files)."""

    def __init__(self, *, device: str) -> None:
        from verl_engine.apps.ray_workers import EngineWorker

        self.worker = EngineWorker()
        self.device = device

    def build(self, role: str, overrides: Sequence[str], hf_config: dict[str, Any] | None = None) -> None:
        self.worker.build(role=role, overrides=overrides, device=self.device, hf_config=hf_config)

    def drop(self, role: str) -> None:
        self.worker.drop(role)

    def call(self, role: str, method: str, data: Any = None, *, loss: str | None = None, **kw: Any) -> Any:
        return self.worker.call_local(role, method, data, loss=loss, **kw)

    def export_weights(self, role: str) -> Iterable[tuple[str, torch.Tensor]]:
        weights, _ = self.worker.engines[role].get_per_tensor_param()  # streamed, no second copy
        return weights


class RayWorkers:
    """The engines in the actors of a :class:`~verl_engine.apps.ray_workers.RayWorkerGroup`; the loop (rollout,
    reward, advantages) runs in the driver and sends each phase's whole batch to every rank."""

    def __init__(self, group: Any, *, device: str) -> None:
        self.group = group
        self.device = device

    def build(self, role: str, overrides: Sequence[str], hf_config: dict[str, Any] | None = None) -> None:
        self.group.build(roles=[role], overrides=overrides, device=self.device, hf_config=hf_config)

    def drop(self, role: str) -> None:
        self.group.run("drop", role)

    def call(self, role: str, method: str, data: Any = None, *, loss: str | None = None, **kw: Any) -> Any:
        return self.group.call(role, method, data, loss=loss, **kw)

    def export_weights(self, role: str) -> Iterable[tuple[str, torch.Tensor]]:
        return self.group.run("export_weights", role)[0]


def init_process_group(device: str) -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        return
    if "RANK" not in os.environ:  # one process without torchrun: a group of one
        from verl_mcore_utils.testing import free_port

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
        os.environ.setdefault("LOCAL_RANK", "0")
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if device == "cuda" else "gloo")


def is_rank0() -> bool:
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0
