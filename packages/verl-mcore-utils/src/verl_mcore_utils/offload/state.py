"""Offload bookkeeping: one :class:`OffloadState` per owner, and the storage moves of every call."""

from __future__ import annotations

import logging
import time
import weakref
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from verl_mcore_utils.offload.buffers import BufferGroup

logger = logging.getLogger(__name__)

KINDS: tuple[str, ...] = ("params", "grads", "optimizer")


class OffloadStateError(RuntimeError):
    """An offload or onload that does not match the group's current state."""


@dataclass(frozen=True)
class OffloadStats:
    """What one offload or onload moved, and how fast.

    ``seconds`` covers the copies and the synchronize (plus the device frees on offload); ``setup_seconds``
    is host-buffer allocation and page-locking on offload (only the first offload of a storage pays it) and
    the device re-allocation on onload, so ``gb_per_s`` is the copy rate in both directions. ``host_bytes_allocated`` is new host memory taken by this
    call: 0 whenever the buffers were reused.
    """

    direction: str  # "offload" | "onload"
    bytes_by_kind: dict[str, int] = field(default_factory=dict)
    num_storages: int = 0
    seconds: float = 0.0
    setup_seconds: float = 0.0
    host_bytes_allocated: int = 0

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_by_kind.values())

    @property
    def gb_per_s(self) -> float:
        """Transfer rate in GB/s (1e9 bytes), excluding host-buffer set-up."""
        return self.total_bytes / self.seconds / 1e9 if self.seconds > 0 else float("nan")

    def as_dict(self) -> dict[str, Any]:
        return {
            "direction": self.direction,
            "bytes_by_kind": dict(self.bytes_by_kind),
            "total_bytes": self.total_bytes,
            "num_storages": self.num_storages,
            "seconds": self.seconds,
            "setup_seconds": self.setup_seconds,
            "host_bytes_allocated": self.host_bytes_allocated,
            "gb_per_s": self.gb_per_s,
        }


def _release_cuda_cache() -> None:
    """Hand cached device memory back to the driver, e.g. for a rollout engine. cuBLAS's workspaces (tens of
    MiB per stream, allocated through PyTorch's caching allocator by the first matmul) are released too:
    ``empty_cache`` keeps them, and the next matmul allocates them again."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()
    torch.cuda.empty_cache()


def _byte_view(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over a whole storage, whatever the dtypes of the tensors that use it."""
    # stride is optional at run time (contiguous); torch's stub lists set_ with all four arguments only
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(  # type: ignore[call-overload]
        storage, 0, (storage.nbytes(),)
    )


def _collect_storages(
    tensors: Iterable[torch.Tensor | None], *, what: str
) -> dict[int, torch.UntypedStorage]:
    """The distinct non-empty device storages behind ``tensors``, keyed by device address.

    If any tensor is on an accelerator, CPU tensors are left out (they are already on the host).
    """
    kept: list[torch.Tensor] = [t for t in tensors if isinstance(t, torch.Tensor) and t.device.type != "meta"]
    if any(t.device.type != "cpu" for t in kept):
        kept = [t for t in kept if t.device.type != "cpu"]
    storages: dict[int, torch.UntypedStorage] = {}
    for t in kept:
        if _is_dtensor(t):
            raise NotImplementedError(
                f"{what}: DTensor (FSDP-sharded) tensors cannot be offloaded here; their storage is"
                " managed by the FSDP wrapper"
            )
        storage = t.untyped_storage()
        if storage.nbytes() == 0:
            continue  # nothing to move, or already offloaded through another owner
        key = storage.data_ptr()
        if key in storages:
            continue
        if not storage.resizable():
            raise ValueError(
                f"{what}: a tensor of shape {tuple(t.shape)} ({t.dtype}, {t.device}) has a non-resizable"
                " storage (e.g. from torch.from_numpy or a foreign allocator); it cannot be released"
            )
        storages[key] = storage
    return storages


def _is_dtensor(t: torch.Tensor) -> bool:
    return type(t).__name__ == "DTensor"


def _synchronize(storages: Iterable[torch.UntypedStorage]) -> None:
    devices = {s.device for s in storages if s.device.type == "cuda"}
    for device in devices:
        torch.cuda.synchronize(device)


def owner_label(owner: Any) -> str:
    return type(owner).__name__


class OffloadState:
    """The host side of one owner (a model chunk or an optimizer): one :class:`BufferGroup` per kind.

    Obtain it with :func:`get_offload_state` so that every offload of the same owner finds the same
    host buffers. It keeps no reference to the owner itself.
    """

    def __init__(self, *, label: str = "owner", pin_memory: bool | None = None) -> None:
        self.label = label
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self._groups: dict[str, BufferGroup] = {}

    def _group(self, kind: str) -> BufferGroup:
        return self._groups.setdefault(kind, BufferGroup())

    def is_offloaded(self, kind: str) -> bool:
        group = self._groups.get(kind)
        return group is not None and group.offloaded is not None

    def host_bytes(self, kind: str | None = None) -> int:
        """Bytes of host memory held for ``kind`` (all kinds when None)."""
        groups = self._groups.values() if kind is None else [self._groups.get(kind, BufferGroup())]
        return sum(g.host_bytes() for g in groups)

    def host_buffers(self, kind: str) -> tuple[torch.Tensor, ...]:
        """The host buffers of ``kind`` (uint8, one per storage): for inspection, do not write."""
        group = self._groups.get(kind)
        return tuple(b.tensor for b in group.buffers.values()) if group else ()

    def offload(
        self, tensors_by_kind: Mapping[str, Iterable[torch.Tensor | None]], *, empty_cache: bool = True
    ) -> OffloadStats:
        """Offload each kind's tensors (any kind names; the rules are in the package README)."""
        return offload_jobs([(self, kind, tensors) for kind, tensors in tensors_by_kind.items()], empty_cache)

    def onload(self, kinds: Iterable[str]) -> OffloadStats:
        """Bring the given kinds back to the device, bit for bit."""
        return onload_jobs([(self, kind) for kind in kinds])

    def release_host_buffers(self) -> None:
        """Free the host memory of every kind (allowed only while everything is on the device)."""
        offloaded = [k for k in self._groups if self.is_offloaded(k)]
        if offloaded:
            raise OffloadStateError(
                f"{self.label}: cannot release host buffers while {offloaded} are offloaded (their only copy)"
            )
        for group in self._groups.values():
            group.release()


_STATES: weakref.WeakKeyDictionary[Any, OffloadState] = weakref.WeakKeyDictionary()


def offloaded_state(owner: Any, *, what: str, plural: bool = False) -> OffloadState:
    """``owner``'s state for an onload; an owner never offloaded is an :class:`OffloadStateError` naming ``what``."""
    state = _STATES.get(owner)
    if state is None:
        verb = "were" if plural else "was"
        raise OffloadStateError(f"{what} of {owner_label(owner)} {verb} never offloaded; nothing to onload")
    return state


def get_offload_state(owner: Any, *, pin_memory: bool | None = None) -> OffloadState:
    """The :class:`OffloadState` of ``owner`` (a model chunk or an optimizer), created on first use.

    Held in a weak registry so host buffers live exactly as long as their owner.
    """
    state = _STATES.get(owner)
    if state is None:
        state = OffloadState(label=owner_label(owner), pin_memory=pin_memory)
        _STATES[owner] = state
    elif pin_memory is not None and pin_memory != state.pin_memory:
        if any(state.is_offloaded(k) for k in state._groups):
            raise OffloadStateError(f"{state.label}: cannot change pin_memory while offloaded")
        state.pin_memory = pin_memory
    return state


def refuse_offloaded(owner: Any, kinds: Iterable[str]) -> None:
    """Raise :class:`OffloadStateError` if a group of ``owner`` named in ``kinds`` is on the host now.

    For offloads that do something else first (a collective, dropping grads): they check before it.
    """
    state = _STATES.get(owner)
    for kind in kinds:
        if state is not None and state.is_offloaded(kind):
            raise OffloadStateError(
                f"{kind!r} of {state.label} is already offloaded; onload it before offloading again"
            )


def is_offloaded(owner: Any, kind: str) -> bool:
    """Whether ``owner``'s group ``kind`` ("params", "grads", "optimizer") is on the host now."""
    state = _STATES.get(owner)
    return state is not None and state.is_offloaded(kind)


def _stats(
    direction: str,
    moved: Iterable[tuple[str, Sequence[tuple[torch.UntypedStorage, Any]]]],
    *,
    num_storages: int,
    seconds: float,
    setup_seconds: float,
    host_bytes_allocated: int = 0,
) -> OffloadStats:
    """The :class:`OffloadStats` of one call from the (kind, storage / host-buffer pairs) it moved; logged."""
    bytes_by_kind: dict[str, int] = defaultdict(int)
    for kind, pairs in moved:
        bytes_by_kind[kind] += sum(buf.nbytes for _, buf in pairs)
    stats = OffloadStats(
        direction=direction,
        bytes_by_kind=dict(bytes_by_kind),
        num_storages=num_storages,
        seconds=seconds,
        setup_seconds=setup_seconds,
        host_bytes_allocated=host_bytes_allocated,
    )
    logger.debug("%s %s", direction, stats.as_dict())
    return stats


def offload_jobs(
    jobs: Sequence[tuple[OffloadState, str, Iterable[torch.Tensor | None]]], empty_cache: bool
) -> OffloadStats:
    """Move every (state, kind, tensors) job's device storages to host buffers, with one synchronize."""
    for state, kind, _ in jobs:
        if state.is_offloaded(kind):
            raise OffloadStateError(
                f"{kind!r} of {state.label} is already offloaded; onload it before offloading again"
            )
    plans: list[tuple[OffloadState, str, dict[int, torch.UntypedStorage]]] = []
    seen: dict[int, str] = {}
    for state, kind, tensors in jobs:
        storages = _collect_storages(tensors, what=f"{kind} of {state.label}")
        for key in storages:
            if key in seen:
                raise ValueError(
                    f"{kind} of {state.label} and {seen[key]} share device memory; offload them as one group"
                )
            seen[key] = f"{kind} of {state.label}"
        plans.append((state, kind, storages))

    t0 = time.perf_counter()
    assigned = []
    allocated = 0
    for state, kind, storages in plans:
        pin = state.pin_memory and any(s.device.type == "cuda" for s in storages.values())
        pairs, new_bytes = state._group(kind).assign(storages, pin=pin)
        assigned.append((state, kind, pairs))
        allocated += new_bytes
    t1 = time.perf_counter()
    for _, _, pairs in assigned:
        for storage, buf in pairs:
            buf.tensor.copy_(_byte_view(storage), non_blocking=True)
    all_storages = [s for _, _, pairs in assigned for s, _ in pairs]
    _synchronize(all_storages)
    for storage in all_storages:
        storage.resize_(0)
    t2 = time.perf_counter()
    for state, kind, pairs in assigned:
        state._group(kind).offloaded = pairs
    if empty_cache and any(s.device.type == "cuda" for s in all_storages):
        _release_cuda_cache()
    return _stats(
        "offload",
        [(kind, pairs) for _, kind, pairs in assigned],
        num_storages=len(all_storages),
        seconds=t2 - t1,
        setup_seconds=t1 - t0,
        host_bytes_allocated=allocated,
    )


def onload_jobs(jobs: Sequence[tuple[OffloadState, str]]) -> OffloadStats:
    """Resize every offloaded (state, kind) storage back and copy its bytes in (all or none allocated)."""
    for state, kind in jobs:
        if not state.is_offloaded(kind):
            raise OffloadStateError(f"{kind!r} of {state.label} is not offloaded; there is nothing to onload")
    t0 = time.perf_counter()
    pairs = [pair for state, kind in jobs for pair in state._group(kind).offloaded or ()]
    resized: list[torch.UntypedStorage] = []
    try:
        for storage, buf in pairs:
            storage.resize_(buf.nbytes)
            resized.append(storage)
    except BaseException:
        # e.g. out of device memory: give back what was taken; the groups stay offloaded, intact.
        for storage in resized:
            storage.resize_(0)
        raise
    t_alloc = time.perf_counter()
    for storage, buf in pairs:
        _byte_view(storage).copy_(buf.tensor, non_blocking=True)
    _synchronize(resized)
    t1 = time.perf_counter()
    moved = []
    for state, kind in jobs:
        group = state._group(kind)
        group_pairs = group.offloaded or []
        # Re-key by the new device addresses so the next offload finds the same host buffers.
        group.buffers = {storage.data_ptr(): buf for storage, buf in group_pairs}
        group.offloaded = None
        moved.append((kind, group_pairs))
    return _stats("onload", moved, num_storages=len(pairs), seconds=t1 - t_alloc, setup_seconds=t_alloc - t0)


def offload_tensors(
    groups: Sequence[tuple[Any, str, Iterable[torch.Tensor | None]]],
    *,
    pin_memory: bool | None = None,
    empty_cache: bool = True,
) -> OffloadStats:
    """Offload explicitly listed tensors, as ``(owner, kind, tensors)`` groups, with one synchronize.

    Why: a wrapper with its own buffers (verl_mfsdp's Megatron-FSDP support) knows which tensors
    hold its state; this lets it reuse the same host buffers, bookkeeping and rules as the DDP
    functions instead of a second implementation. Pass plain tensors (a DTensor's local shard,
    not the DTensor). All groups are checked before anything moves.
    """
    jobs = [
        (get_offload_state(owner, pin_memory=pin_memory), kind, tensors) for owner, kind, tensors in groups
    ]
    return offload_jobs(jobs, empty_cache)


def onload_tensors(groups: Sequence[tuple[Any, str]]) -> OffloadStats:
    """Bring back the ``(owner, kind)`` groups that :func:`offload_tensors` moved, bit for bit."""
    jobs = []
    for owner, kind in groups:
        jobs.append((offloaded_state(owner, what=repr(kind)), kind))
    return onload_jobs(jobs)
