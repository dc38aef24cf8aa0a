"""``close()`` for the engines: give every byte an engine holds back to the device, and say so when it is used.

Why: RL trainers build and drop engines inside one process (actor, reference and critic in turn, a
fresh engine per experiment in a sweep, an evaluation model between steps). Python frees an engine's
GPU memory only when the last reference to every tensor is gone, and megatron-core's objects reference
each other in cycles (DDP's gradient hooks hold the wrapper, the model config holds DDP's sync
functions, the optimizer holds the parameters), so a dropped engine lingers until a full garbage
collection, and its freed blocks stay in torch's caching allocator. Building a second engine beside a
lingering first one is how "two engines in a row" runs out of memory.

:meth:`Closeable.close` therefore drops every attribute of the engine (model chunks, optimizer, DDP
buffers, schedules, offload copies), destroys the process groups the engine created itself (its
verl-dyncp CP groups), empties megatron-core's global memory buffer, collects the cycles and returns
the cached blocks to the device. The process groups of megatron-core's parallel state are left alone:
they are shared by every engine of the process and belong to whoever initialised them.

A closed engine refuses every use with one message instead of an ``AttributeError`` deep inside a step.
Every rank of the engine's groups must call ``close()`` at the same point of the program, as when it
was built.
"""

from __future__ import annotations

import gc
from types import TracebackType
from typing import Any

import torch

from verl_engine.decoder_graphs import release_decoder_graphs
from verl_engine.moe import drop_moe_metrics_tracker

__all__ = ["Closeable", "drop_autograd_graphs"]

# what a closed engine keeps (to say which device it was on, and that it is closed)
_KEEP = ("device", "_closed")


class Closeable:
    """Mixin: ``close()``, ``with engine:``, and a clear error for any use after close."""

    def close(self) -> None:
        """Release everything this engine holds on its device (idempotent)."""
        if self.__dict__.get("_closed"):
            return
        cp_groups = self.__dict__.get("cp_groups")
        release_decoder_graphs(self, uninstall=True)
        drop_autograd_graphs(self.__dict__.get("model"))
        for name in [n for n in vars(self) if n not in _KEEP]:
            delattr(self, name)
        self._closed = True
        if cp_groups is not None and hasattr(cp_groups, "destroy"):
            gc.collect()  # a CUDA graph of a CP group, freed late, holds its NCCL communicator: destroy would hang
            cp_groups.destroy()
        del cp_groups
        _empty_megatron_memory_buffer()
        drop_moe_metrics_tracker()
        gc.collect()
        device = self.__dict__.get("device")
        if isinstance(device, torch.device) and device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()

    @property
    def closed(self) -> bool:
        return bool(self.__dict__.get("_closed"))

    def __enter__(self) -> Any:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def __getattr__(self, name: str) -> Any:
        # Only reached when normal lookup fails: on a closed engine every released attribute lands here.
        if self.__dict__.get("_closed") and not name.startswith("__"):
            raise RuntimeError(
                f"this {type(self).__name__} was closed (close() released its {name!r}); build a new engine"
            )
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")


def drop_autograd_graphs(model: Any) -> int:
    """Drop the graph-attached tensors that modules (and their helper objects) keep after a step.

    Why: megatron-core's MoE token dispatchers keep the last micro-batch's routing probabilities as
    attributes (``self.probs``, ``self.local_probs``...), tensors whose ``grad_fn`` chain reaches the
    router weights' gradient accumulators, where DDP's backward hooks hold the DDP wrapper and so the
    whole model. That cycle runs through autograd's C++ graph, which Python's garbage collector cannot
    follow: a closed MoE engine on a GPU kept all of its weights, gradient buffers and optimizer state
    (``tests/test_gpu_engine_lifetime.py``; dense models and the CPU backend keep no such tensor).
    Parameters and registered buffers are left alone. Returns how many references were dropped.
    """
    chunks = model if isinstance(model, (list, tuple)) else [model]
    dropped = 0
    for chunk in chunks:
        if not isinstance(chunk, torch.nn.Module):
            continue
        for module in chunk.modules():
            helpers = [v for v in vars(module).values() if _is_helper_object(v)]
            for owner in (module, *helpers):
                for name, value in list(vars(owner).items()):
                    if _holds_graph(value):
                        setattr(owner, name, None)
                        dropped += 1
    return dropped


def _is_helper_object(value: Any) -> bool:
    """A plain object hanging off a module (a token dispatcher, a router's helper), not a module or tensor."""
    return (
        hasattr(value, "__dict__")
        and not isinstance(value, (torch.nn.Module, torch.Tensor, type))
        and not callable(value)
    )


def _holds_graph(value: Any) -> bool:
    if isinstance(value, torch.nn.Parameter) or not isinstance(value, torch.Tensor):
        return False
    return value.grad_fn is not None


def _empty_megatron_memory_buffer() -> None:
    """megatron-core's process-wide scratch buffer (sequence-parallel gathers) keeps its largest tensors."""
    try:
        from megatron.core import parallel_state
    except ImportError:  # pragma: no cover - the engines always have megatron-core
        return
    buffer = getattr(parallel_state, "_GLOBAL_MEMORY_BUFFER", None)
    tensors = getattr(buffer, "buffer", None)
    if isinstance(tensors, dict):
        tensors.clear()
