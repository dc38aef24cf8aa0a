"""Per-rank function of the no-host-sync tests: one PPO train step whose micro-batches are watched.

A loss function wrapper opens the watch when the first micro-batch's loss is computed and closes it after
the last one's: in between run the forwards of micro-batches 2..n, the backwards of 1..n-1 and every loss.
On CPU the watch counts every Python-level read of a tensor's value on the host (``.item()``, ``float()``,
``int()``, ``bool()``, ``.tolist()``, ``.numpy()``, ``.cpu()``) made by the engine or its losses (verl_engine's
code: on CPU every tensor is a host tensor, so reads of host-side metadata elsewhere, verl-dyncp's layouts
built from Python lists, cannot be told apart from device reads); on CUDA it is
``torch.cuda.set_sync_debug_mode("error")``, which raises at any synchronising call anywhere, and a CUDA profile of
the window in which no copy may touch pageable host memory: such a copy makes the host wait for the work queued
before it as surely as a read, yet sync-debug mode does not report it (PyTorch issues it as an asynchronous copy).
"""

from __future__ import annotations

import contextlib
import functools
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch

_READS = ("item", "__float__", "__int__", "__bool__", "__index__", "tolist", "numpy", "cpu")


@contextlib.contextmanager
def counting_host_reads(found: list[str]) -> Iterator[None]:
    """Every host read of a tensor value inside the block appends the caller's frame to ``found``."""
    originals = {name: getattr(torch.Tensor, name) for name in _READS}

    def counted(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def wrapper(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            caller = traceback.extract_stack(limit=3)[0]
            if "/verl_engine/" in caller.filename:
                found.append(f"{name} at {caller.filename}:{caller.lineno} ({caller.line})")
            return original(self, *args, **kwargs)

        return wrapper

    for name, original in originals.items():
        setattr(torch.Tensor, name, counted(name, original))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


class WatchedLoss:
    """The loss function, with the watch open from the first micro-batch's loss to the end of the last's."""

    def __init__(self, loss_fn: Callable[..., Any], *, micro_batches: int, device: str) -> None:
        self.loss_fn, self.micro_batches, self.device = loss_fn, micro_batches, device
        self.calls, self.found = 0, []  # type: ignore[var-annotated]
        self._watch: contextlib.ExitStack | None = None
        self._profile: Any = None  # the CUDA profile of the window (on CUDA only)

    def __call__(self, **kwargs: Any) -> Any:
        if self.calls == 0:
            self._watch = contextlib.ExitStack()
            if self.device == "cuda":
                # exits run last-in first-out: sync-debug mode off, then the profile stops (it synchronises), then
                # its copies are read
                self._watch.callback(self._pageable_copies)
                self._profile = self._watch.enter_context(
                    torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
                )
                self._watch.callback(torch.cuda.set_sync_debug_mode, "default")
                torch.cuda.set_sync_debug_mode("error")
            else:
                self._watch.enter_context(counting_host_reads(self.found))
        self.calls += 1
        try:
            return self.loss_fn(**kwargs)
        finally:
            if self.calls == self.micro_batches and self._watch is not None:
                self._watch.close()

    def close(self) -> None:
        if self._watch is not None:
            self._watch.close()

    def _pageable_copies(self) -> None:
        """The profile's copies to or from pageable host memory ("Memcpy HtoD (Pageable -> Device)"), counted."""
        counts: dict[str, int] = {}
        for event in self._profile.events():
            if "Pageable" in event.name:
                counts[event.name] = counts.get(event.name, 0) + 1
        self.found.extend(
            f"{n} x {name} (a host wait sync-debug mode does not see)" for name, n in counts.items()
        )


def ppo_step_watched(rank: int, world_size: int, model_dir: str, device: str, overrides: list[str]) -> dict:
    """One actor train step (PPO loss with entropy and KL terms): 4 sequences, one per rank per micro-batch."""
    from rl_engine_workers import _engine, verl_batch

    from verl_engine import loss_config
    from verl_engine.losses import ppo_loss

    engine, cfg = _engine(
        [
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
            "actor_rollout_ref.actor.use_kl_loss=true",
            "actor_rollout_ref.actor.entropy_coeff=0.01",
            f"trainer.n_gpus_per_node={world_size}",
            *overrides,
        ],
        "actor",
        model_dir,
        device,
    )
    batch = {
        **verl_batch(seed=3, prompt_lens=[3, 5, 2, 4], response_lens=[6, 4, 7, 5]),
        "calculate_entropy": True,
    }
    loss = WatchedLoss(
        functools.partial(ppo_loss, config=loss_config(cfg, role="actor")),
        micro_batches=4 // world_size,
        device=device,
    )
    try:
        with engine.train_mode():
            out = engine.train_batch(batch, loss)
    finally:
        loss.close()
    engine.close()
    return {
        "expected": 4 // world_size,
        "calls": loss.calls,
        "found": loss.found,
        "metrics": out["metrics"],
        "loss": out["loss"],
    }
