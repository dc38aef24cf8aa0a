"""Pipeline stages of the RL engine: the layout, a CPU schedule, and sharing the last stage's results.

Every rank of a pipeline runs the same micro-batches (the plan depends on the batch's lengths only and
on the rank's DP x CP position, which the stages of one pipeline share), so the ranks of a pipeline
exchange activations of matching shapes without any negotiation beyond the shape itself.

On CUDA the engine runs megatron-core's schedules (1F1B, interleaved 1F1B for virtual stages). Those
allocate their receive buffers and token counters on the CUDA device, so the CPU debug backend uses
:func:`run_cpu_pipeline` instead: every micro-batch's forward through the stages in order (chunk by
chunk for virtual stages), then the backwards in reverse. The gradients are the same as 1F1B's (only
the order in which activations are kept differs), which is what the CPU parity tests compare.

Only the last stage computes outputs and losses; :func:`share_from_last_stage` sends them to the other
stages so that every rank's call returns the same result.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["PipelineLayout", "run_cpu_pipeline", "share_from_last_stage"]

_HEADER = 8  # ndim + up to 7 dims of the tensor that follows


@dataclass(frozen=True)
class PipelineLayout:
    """This rank's place in its pipeline: ``size`` stages, ``num_chunks`` model chunks per stage."""

    size: int
    rank: int
    num_chunks: int
    group: Any
    ranks: tuple[int, ...]  # global ranks of the stages, in stage order

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size or len(self.ranks) != self.size:
            raise ValueError(f"pipeline rank {self.rank} / size {self.size} / ranks {self.ranks} disagree")
        if self.num_chunks < 1:
            raise ValueError(f"num_chunks must be >= 1, got {self.num_chunks}")

    @classmethod
    def single_stage(cls) -> PipelineLayout:
        """No pipeline: this rank holds the whole model as one chunk."""
        return cls(
            size=1, rank=0, num_chunks=1, group=None, ranks=(dist.get_rank() if dist.is_initialized() else 0,)
        )

    @classmethod
    def from_parallel_state(cls) -> PipelineLayout:
        from megatron.core import parallel_state as ps

        size = ps.get_pipeline_model_parallel_world_size()
        if size == 1:
            return cls.single_stage()
        group = ps.get_pipeline_model_parallel_group()
        return cls(
            size=size,
            rank=ps.get_pipeline_model_parallel_rank(),
            num_chunks=ps.get_virtual_pipeline_model_parallel_world_size() or 1,
            group=group,
            ranks=tuple(dist.get_process_group_ranks(group)),
        )

    @property
    def is_last_stage(self) -> bool:
        """This rank holds the last stage (its last chunk computes the outputs and the loss)."""
        return self.rank == self.size - 1

    def is_first(self, chunk: int) -> bool:
        return self.rank == 0 and chunk == 0

    def is_last(self, chunk: int) -> bool:
        return self.rank == self.size - 1 and chunk == self.num_chunks - 1

    @property
    def prev_rank(self) -> int:
        return self.ranks[(self.rank - 1) % self.size]

    @property
    def next_rank(self) -> int:
        return self.ranks[(self.rank + 1) % self.size]


def _send(tensor: torch.Tensor, dst: int, pending: list[Any]) -> None:
    header = torch.zeros(_HEADER, dtype=torch.int64)
    header[0] = tensor.dim()
    header[1 : 1 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
    payload = tensor.detach().contiguous()
    pending.append((dist.isend(header, dst), header))
    pending.append((dist.isend(payload, dst), payload))


def _recv(src: int, *, dtype: torch.dtype) -> torch.Tensor:
    header = torch.zeros(_HEADER, dtype=torch.int64)
    dist.recv(header, src)
    shape = tuple(int(d) for d in header[1 : 1 + int(header[0])])
    out = torch.empty(shape, dtype=dtype)
    dist.recv(out, src)
    return out


def run_cpu_pipeline(
    chunks: Sequence[torch.nn.Module],
    micro_batches: Sequence[Any],
    forward: Callable[[Any, torch.nn.Module], torch.Tensor | None],
    *,
    layout: PipelineLayout,
    forward_only: bool,
    dtype: torch.dtype = torch.float32,
) -> None:
    """All forwards through the stages, then all backwards in reverse (gloo point-to-point).

    ``forward(micro_batch, chunk)`` returns the chunk's output: activations on every chunk but the
    pipeline's last, the loss (or None when there is nothing to back-propagate) on the last. Inputs of
    non-first chunks arrive through ``chunk.set_input_tensor`` as megatron-core's schedules do it.
    Items are processed in one global order (micro-batch, chunk, stage) on every rank, each waiting
    only for its predecessor's send, so the exchange cannot deadlock.
    """
    pending: list[Any] = []
    saved: list[tuple[torch.Tensor | None, torch.Tensor | None]] = []
    for mb in micro_batches:
        for c, chunk in enumerate(chunks):
            x = None
            if not layout.is_first(c):
                x = _recv(layout.prev_rank, dtype=dtype).requires_grad_(not forward_only)
                chunk.set_input_tensor(x)  # type: ignore[operator]  # megatron-core's method (nn.Module.__getattr__)
            with torch.set_grad_enabled(not forward_only):
                out = forward(mb, chunk)
            if not layout.is_last(c):
                assert out is not None
                _send(out, layout.next_rank, pending)
            if not forward_only:
                saved.append((x, out))
    if not forward_only:
        index = len(saved)
        for _ in reversed(micro_batches):
            for c in reversed(range(len(chunks))):
                index -= 1
                x, out = saved[index]
                if layout.is_last(c):
                    if out is not None:
                        out.backward()
                else:
                    assert out is not None
                    grad = _recv(layout.next_rank, dtype=out.dtype)
                    torch.autograd.backward(out, grad)
                if x is not None:
                    _send(x.grad if x.grad is not None else torch.zeros_like(x), layout.prev_rank, pending)
                saved[index] = (None, None)
    for work, _ in pending:
        work.wait()


def share_from_last_stage(
    layout: PipelineLayout,
    *,
    tensors: dict[str, torch.Tensor] | None,
    sizes: dict[str, int],
    extra: Any,
    device: torch.device,
) -> tuple[dict[str, torch.Tensor], Any]:
    """Send the last stage's flat float32 outputs (``sizes``: key -> length) and a small object to every stage.

    On the last stage ``tensors`` holds them; elsewhere it is None and they are received. ``extra``
    (losses and metrics: plain Python numbers) travels with torch's object broadcast inside the pipeline.
    """
    if layout.size == 1:
        assert tensors is not None
        return tensors, extra
    src = layout.ranks[-1]
    out: dict[str, torch.Tensor] = {}
    for key, n in sizes.items():
        buf = (
            tensors[key].to(device=device, dtype=torch.float32).contiguous()
            if tensors is not None
            else torch.empty(n, dtype=torch.float32, device=device)
        )
        dist.broadcast(buf, src=src, group=layout.group)
        out[key] = buf
    box = [extra]
    dist.broadcast_object_list(
        box, src=src, group=layout.group, device=device if device.type == "cuda" else None
    )
    return out, box[0]
