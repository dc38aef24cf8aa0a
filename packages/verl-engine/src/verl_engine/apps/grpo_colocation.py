"""What happens between the phases of a GRPO step: per-phase seconds and GPU memory (:class:`Phases`) and
verl's offload keys applied so the trainer and the rollout take turns on the GPU (:class:`Colocation`)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch

from verl_engine.apps.grpo_workers import Workers
from verl_engine.apps.rollout import RolloutEngine

__all__ = ["Colocation", "Phases"]


class Phases:
    """Seconds and (on GPU) memory of each phase of a step: peak allocated during it, allocated at its end."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.seconds: dict[str, float] = {}
        self.memory_gib: dict[str, dict[str, float]] = {}

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        yield
        if self.cuda:
            torch.cuda.synchronize()
            self.memory_gib[name] = {
                "peak": torch.cuda.max_memory_allocated() / 2**30,
                "end": torch.cuda.memory_allocated() / 2**30,
            }
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start


class Colocation:
    """verl's offload keys applied between phases (the trainer's state off the GPU while the rollout runs,
    the rollout asleep while the trainer works)."""

    def __init__(self, workers: Workers, rollout: RolloutEngine, *, cfg: Any, use_ref: bool) -> None:
        m = cfg.actor_rollout_ref.actor.megatron
        self.workers, self.rollout = workers, rollout
        self.actor = {
            "params": bool(m.param_offload),
            "grads": bool(m.grad_offload),
            "optimizer": bool(m.optimizer_offload),
        }
        self.ref = use_ref and bool(cfg.actor_rollout_ref.ref.megatron.param_offload)
        self.rollout_sleeps = bool(cfg.actor_rollout_ref.rollout.free_cache_engine) and hasattr(
            rollout, "sleep"
        )
        self._actor_on = dict.fromkeys(self.actor, True)

    @property
    def enabled(self) -> bool:
        return any(self.actor.values()) or self.ref

    def actor_to(self, *, params: bool, grads: bool, optimizer: bool) -> None:
        """Bring the selected actor state on the device (True) or off it (False), as far as offload is set."""
        want = {"params": params, "grads": grads, "optimizer": optimizer}
        moves: dict[str, dict[str, bool]] = {"onload": {}, "offload": {}}
        for key, on in want.items():
            if self.actor[key] and self._actor_on[key] != on:
                moves["onload" if on else "offload"][key] = True
                self._actor_on[key] = on
        for direction, selected in moves.items():
            if selected:
                # Any: passed as keyword arguments of call (the keys are params, grads, optimizer)
                sel: dict[str, Any] = {k: selected.get(k, False) for k in self.actor}
                self.workers.call("actor", direction, **sel)

    def ref_offload(self, on_device: bool) -> None:
        if self.ref:
            self.workers.call("ref", "onload" if on_device else "offload", grads=False, optimizer=False)

    def rollout_awake(self, awake: bool) -> None:
        if self.rollout_sleeps:
            getattr(self.rollout, "wake_up" if awake else "sleep")()
