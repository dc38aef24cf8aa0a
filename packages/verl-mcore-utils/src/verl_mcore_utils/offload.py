"""Move a Megatron training state (parameters, gradients, optimizer state) to host memory and back.

In RL the trainer and the rollout engine take turns on the same GPUs: while rollout runs, the trainer's
state leaves the GPU and comes back bit for bit. Each group (``params``, ``grads``, ``optimizer``) is
reduced to the device storages behind its tensors; offload copies each whole storage into one host buffer
that is reused by every later offload (host memory stays 1x) and resizes the storage to 0 bytes in place,
onload resizes it back and copies the bytes in, so every view of it keeps working. The README's design
notes say why each choice was made.

Rules (checked, with clear errors):

* Offloading a group that is already offloaded, or onloading one that is not, raises
  :class:`OffloadStateError` before anything moves (no silent no-op: a mismatched offload/onload pair
  is a bookkeeping bug in the caller, and using an offloaded tensor crashes the process, see below).
* Never read or write an offloaded tensor: its storage has zero bytes and PyTorch kernels do not check
  that (on CPU this is a segmentation fault, on CUDA an illegal memory access). Offload between
  training steps only, not while an autograd graph holds saved tensors.
* Only storages on an accelerator move when the group has any; CPU tensors beside them (torch Adam's
  ``step`` counters) stay where they are. If everything is on the CPU, everything moves.
* Empty storages are skipped, so two owners that share a storage (a DDP model and its inner module)
  cannot free it twice; a storage shared between two groups of one call is refused.
* Copies run on the current CUDA stream. Megatron-FSDP / DTensor parameters and NCCL user-buffer
  registration (``nccl_ub``) are refused: their memory is managed elsewhere.

Buffers of a module (RoPE ``inv_freq`` and the like) are not moved: they are tiny and not training state.
"""

from __future__ import annotations

import logging
import mmap
import time
import warnings
import weakref
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "KINDS",
    "OffloadState",
    "OffloadStateError",
    "OffloadStats",
    "get_offload_state",
    "inner_torch_optimizer",
    "is_offloaded",
    "leaf_optimizers",
    "master_params",
    "model_offload_kinds",
    "offload_megatron_model",
    "offload_megatron_optimizer",
    "offload_tensors",
    "onload_megatron_model",
    "onload_megatron_optimizer",
    "onload_tensors",
]

logger = logging.getLogger(__name__)

KINDS: tuple[str, ...] = ("params", "grads", "optimizer")

# Master copies that megatron's mixed-precision optimizers own (all supported releases):
# Float16OptimizerWithFloat16Params and DistributedOptimizer respectively. The fp32 parameters they
# train directly (fp32_from_fp32_groups, shard_fp32_groups) are the model's own tensors or views into
# the DDP param buffer, so they belong to the model's "params" group and are not listed here.
_MASTER_PARAM_ATTRS = ("fp32_from_float16_groups", "shard_fp32_from_float16_groups")


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


_NO_MEMORY = torch.empty(0, dtype=torch.uint8)


def _page_size() -> int:
    return mmap.PAGESIZE


class _HostBuffer:
    """Exactly ``nbytes`` of host memory for one device storage, page-locked when ``pin``.

    Pinned buffers are anonymous ``mmap`` memory (page-aligned, pages shared with nothing else)
    registered with ``cudaHostRegister``: the host cost is ``nbytes`` rounded up to a page, where
    torch's pinned allocator would round up to a power of two. The tensor starts at the registered
    address, so ``is_pinned()`` is true and copies are asynchronous DMA. If registration fails (an
    exotic platform), torch's pinned allocator is used instead, with a warning.
    """

    __slots__ = ("_mmap", "_registered_ptr", "nbytes", "pinned", "tensor")

    def __init__(self, nbytes: int, *, pin: bool) -> None:
        self.nbytes = nbytes
        self.pinned = pin
        self._mmap: mmap.mmap | None = None
        self._registered_ptr = 0
        if not pin:
            self.tensor = torch.empty(nbytes, dtype=torch.uint8)
            return
        length = -(-nbytes // _page_size()) * _page_size()
        region = mmap.mmap(-1, length)
        tensor = torch.frombuffer(region, dtype=torch.uint8, count=nbytes)
        cudart = torch.cuda.cudart()
        err = cudart.cudaHostRegister(tensor.data_ptr(), length, 0)
        if int(err) == 0:
            self._mmap, self.tensor, self._registered_ptr = region, tensor, tensor.data_ptr()
            return
        _clear_last_cuda_error()
        warnings.warn(
            f"cudaHostRegister of {nbytes} bytes failed ({cudart.cudaGetErrorString(err)});"
            " falling back to torch's pinned allocator, which may round the allocation up",
            RuntimeWarning,
            stacklevel=4,
        )
        del tensor, region
        self.tensor = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def release(self) -> None:
        """Unregister first, then drop the memory (unmapped once no tensor views it any more)."""
        if self._registered_ptr:
            try:
                torch.cuda.cudart().cudaHostUnregister(self._registered_ptr)
            except Exception:  # interpreter shutdown: the CUDA context may already be gone
                pass
            self._registered_ptr = 0
        self.tensor = _NO_MEMORY
        self._mmap = None
        self.nbytes = 0

    def __del__(self) -> None:
        try:
            self.release()
        except Exception:  # interpreter shutdown: module globals may already be gone
            pass


def _clear_last_cuda_error() -> None:
    """Consume the error a failed cudaHostRegister leaves behind.

    torch's binding returns the error code but does not reset CUDA's "last error", so the next kernel
    launch check anywhere would raise it. A kernel launch here reports (and thereby clears) it.
    """
    try:
        torch.empty(1, device="cuda").fill_(1.0)
    except RuntimeError:
        pass


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
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (storage.nbytes(),))


class _Group:
    """One group's host buffers (kept between cycles) and, while offloaded, its device storages."""

    def __init__(self) -> None:
        # Host buffers by the device address their storage had the last time it was on the device,
        # so the same storage gets the same host buffer every cycle.
        self.buffers: dict[int, _HostBuffer] = {}
        # While offloaded: (storage, host buffer) pairs; the storage objects are held so they can be
        # resized back (they cost nothing while empty). None while on the device: holding storages
        # then would keep memory alive that its owner has dropped (e.g. grads set to None).
        self.offloaded: list[tuple[torch.UntypedStorage, _HostBuffer]] | None = None

    def assign(
        self, storages: Mapping[int, torch.UntypedStorage], *, pin: bool
    ) -> tuple[list[tuple[torch.UntypedStorage, _HostBuffer]], int]:
        """Pair every storage with a host buffer, reusing this group's buffers first.

        Reuse order: the buffer this storage had last time; else a leftover buffer of the same size
        (the storage set changed, e.g. grads were recreated). Leftovers still unused are freed BEFORE
        anything new is allocated, so host memory never exceeds the bytes of one copy of the group.
        Returns the pairs and the number of newly allocated host bytes.
        """
        old = dict(self.buffers)
        chosen: dict[int, _HostBuffer] = {}
        missing: list[int] = []
        spare: list[_HostBuffer] = []
        for key, storage in storages.items():
            buf = old.pop(key, None)
            if buf is not None and buf.nbytes == storage.nbytes() and buf.pinned == pin:
                chosen[key] = buf
            else:
                if buf is not None:
                    spare.append(buf)
                missing.append(key)
        spare.extend(old.values())
        by_size: dict[tuple[int, bool], list[_HostBuffer]] = defaultdict(list)
        for buf in spare:
            by_size[(buf.nbytes, buf.pinned)].append(buf)
        still_missing = []
        for key in missing:
            pool = by_size.get((storages[key].nbytes(), pin))
            if pool:
                chosen[key] = pool.pop()
            else:
                still_missing.append(key)
        for pool in by_size.values():
            for buf in pool:
                buf.release()
        allocated = 0
        for key in still_missing:
            nbytes = storages[key].nbytes()
            chosen[key] = _HostBuffer(nbytes, pin=pin)
            allocated += nbytes
        self.buffers = chosen
        return [(storages[key], chosen[key]) for key in storages], allocated

    def host_bytes(self) -> int:
        return sum(b.nbytes for b in self.buffers.values())

    def release(self) -> None:
        for buf in self.buffers.values():
            buf.release()
        self.buffers = {}


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


def _label(owner: Any) -> str:
    return type(owner).__name__


class OffloadState:
    """The host side of one owner (a model chunk or an optimizer): one :class:`_Group` per kind.

    Obtain it with :func:`get_offload_state` so that every offload of the same owner finds the same
    host buffers. It keeps no reference to the owner itself.
    """

    def __init__(self, *, label: str = "owner", pin_memory: bool | None = None) -> None:
        self.label = label
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self._groups: dict[str, _Group] = {}

    def _group(self, kind: str) -> _Group:
        return self._groups.setdefault(kind, _Group())

    def is_offloaded(self, kind: str) -> bool:
        group = self._groups.get(kind)
        return group is not None and group.offloaded is not None

    def host_bytes(self, kind: str | None = None) -> int:
        """Bytes of host memory held for ``kind`` (all kinds when None)."""
        groups = self._groups.values() if kind is None else [self._groups.get(kind, _Group())]
        return sum(g.host_bytes() for g in groups)

    def host_buffers(self, kind: str) -> tuple[torch.Tensor, ...]:
        """The host buffers of ``kind`` (uint8, one per storage): for inspection, do not write."""
        group = self._groups.get(kind)
        return tuple(b.tensor for b in group.buffers.values()) if group else ()

    def offload(
        self, tensors_by_kind: Mapping[str, Iterable[torch.Tensor | None]], *, empty_cache: bool = True
    ) -> OffloadStats:
        """Offload each kind's tensors (any kind names; see the module docstring for the rules)."""
        return _offload([(self, kind, tensors) for kind, tensors in tensors_by_kind.items()], empty_cache)

    def onload(self, kinds: Iterable[str]) -> OffloadStats:
        """Bring the given kinds back to the device, bit for bit."""
        return _onload([(self, kind) for kind in kinds])

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


def get_offload_state(owner: Any, *, pin_memory: bool | None = None) -> OffloadState:
    """The :class:`OffloadState` of ``owner`` (a model chunk or an optimizer), created on first use.

    Held in a weak registry so host buffers live exactly as long as their owner.
    """
    state = _STATES.get(owner)
    if state is None:
        state = OffloadState(label=_label(owner), pin_memory=pin_memory)
        _STATES[owner] = state
    elif pin_memory is not None and pin_memory != state.pin_memory:
        if any(state.is_offloaded(k) for k in state._groups):
            raise OffloadStateError(f"{state.label}: cannot change pin_memory while offloaded")
        state.pin_memory = pin_memory
    return state


def is_offloaded(owner: Any, kind: str) -> bool:
    """Whether ``owner``'s group ``kind`` ("params", "grads", "optimizer") is on the host now."""
    state = _STATES.get(owner)
    return state is not None and state.is_offloaded(kind)


def _offload(
    jobs: Sequence[tuple[OffloadState, str, Iterable[torch.Tensor | None]]], empty_cache: bool
) -> OffloadStats:
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
    bytes_by_kind: dict[str, int] = defaultdict(int)
    for state, kind, pairs in assigned:
        state._group(kind).offloaded = pairs
        bytes_by_kind[kind] += sum(buf.nbytes for _, buf in pairs)
    if empty_cache and any(s.device.type == "cuda" for s in all_storages):
        _release_cuda_cache()
    stats = OffloadStats(
        direction="offload",
        bytes_by_kind=dict(bytes_by_kind),
        num_storages=len(all_storages),
        seconds=t2 - t1,
        setup_seconds=t1 - t0,
        host_bytes_allocated=allocated,
    )
    logger.debug("offload %s", stats.as_dict())
    return stats


def _onload(jobs: Sequence[tuple[OffloadState, str]]) -> OffloadStats:
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
    bytes_by_kind: dict[str, int] = defaultdict(int)
    for state, kind in jobs:
        group = state._group(kind)
        # Re-key by the new device addresses so the next offload finds the same host buffers.
        group.buffers = {storage.data_ptr(): buf for storage, buf in group.offloaded or ()}
        bytes_by_kind[kind] += sum(buf.nbytes for _, buf in group.offloaded or ())
        group.offloaded = None
    stats = OffloadStats(
        direction="onload",
        bytes_by_kind=dict(bytes_by_kind),
        num_storages=len(pairs),
        seconds=t1 - t_alloc,
        setup_seconds=t_alloc - t0,
    )
    logger.debug("onload %s", stats.as_dict())
    return stats


# ---------------------------------------------------------------------------------------------------
# What belongs to each group
# ---------------------------------------------------------------------------------------------------


def _ddp_buffers(chunk: torch.nn.Module) -> list[Any]:
    """megatron DDP's ``_ParamAndGradBuffer``s (``buffers`` + ``expert_parallel_buffers``), else [].

    megatron's DistributedDataParallel assigns a list to ``self.buffers``, shadowing
    ``nn.Module.buffers()``; a plain module has the method there.
    """
    found = []
    for name in ("buffers", "expert_parallel_buffers"):
        value = getattr(chunk, name, None)
        if isinstance(value, (list, tuple)):
            found.extend(value)
    return found


def _check_model_supported(chunk: torch.nn.Module) -> None:
    ddp_config = getattr(chunk, "ddp_config", None)
    if ddp_config is not None:
        if getattr(ddp_config, "use_megatron_fsdp", False) or getattr(ddp_config, "use_custom_fsdp", False):
            raise NotImplementedError(
                "offloading a Megatron-FSDP model is not supported here: its sharded parameters and buffers"
                " are managed by Megatron-FSDP (verl had the same gap: 'invalid python storage'); use"
                " verl_mfsdp.offload_megatron_fsdp_model / offload_megatron_fsdp_optimizer"
            )
        if getattr(ddp_config, "nccl_ub", False):
            raise NotImplementedError(
                "offloading with nccl_ub=True is not supported: the DDP buffers are registered with NCCL"
                " and reallocating them would invalidate the registration"
            )


def _model_params(chunk: torch.nn.Module) -> list[torch.Tensor]:
    tensors: list[torch.Tensor] = list(chunk.parameters())
    # With the distributed optimizer every param.data is a view into buffer.param_data; the buffer
    # itself is listed too so padding between buckets moves with it (one copy per buffer).
    tensors.extend(b.param_data for b in _ddp_buffers(chunk) if getattr(b, "param_data", None) is not None)
    return tensors


def _model_grads(chunk: torch.nn.Module) -> list[torch.Tensor | None]:
    tensors: list[torch.Tensor | None] = [b.grad_data for b in _ddp_buffers(chunk)]
    for p in chunk.parameters():
        # main_grad: a view into grad_data, or (megatron-core 0.17+, fp32 accumulation of selected
        # params) a separate fp32 tensor; .grad: unwrapped modules (DDP leaves it None).
        tensors.append(getattr(p, "main_grad", None))
        tensors.append(p.grad)
    return tensors


def _as_chunks(model_chunks: torch.nn.Module | Sequence[torch.nn.Module]) -> list[torch.nn.Module]:
    chunks = [model_chunks] if isinstance(model_chunks, torch.nn.Module) else list(model_chunks)
    if not chunks or not all(isinstance(c, torch.nn.Module) for c in chunks):
        raise TypeError("model_chunks must be an nn.Module or a non-empty sequence of nn.Modules")
    return list({id(c): c for c in chunks}.values())  # the same chunk twice is one chunk


def model_offload_kinds(*, params: bool, grads: bool) -> list[str]:
    """The offload groups a params / grads selection names (at least one; shared with verl_mfsdp)."""
    kinds = [k for k, on in (("params", params), ("grads", grads)) if on]
    if not kinds:
        raise ValueError("nothing selected: pass params=True and/or grads=True")
    return kinds


def offload_megatron_model(
    model_chunks: torch.nn.Module | Sequence[torch.nn.Module],
    *,
    params: bool = True,
    grads: bool = True,
    pin_memory: bool | None = None,
    empty_cache: bool = True,
) -> OffloadStats:
    """Offload the parameters and/or gradients of every model chunk to host memory.

    Works on megatron DDP-wrapped chunks (the flat param/grad buffers move as a whole, views stay
    valid) and on unwrapped modules (parameters and ``.grad`` / ``.main_grad``). All chunks are copied
    with one synchronize. ``pin_memory`` defaults to ``torch.cuda.is_available()``; ``empty_cache``
    returns the freed memory to the driver so another process (a rollout engine) can use it.
    Raises :class:`OffloadStateError` if a selected group is already offloaded (nothing moves then).
    """
    chunks = _as_chunks(model_chunks)
    kinds = model_offload_kinds(params=params, grads=grads)
    jobs = []
    for chunk in chunks:
        _check_model_supported(chunk)
        state = get_offload_state(chunk, pin_memory=pin_memory)
        for kind in kinds:
            jobs.append((state, kind, _model_params(chunk) if kind == "params" else _model_grads(chunk)))
    return _offload(jobs, empty_cache)


def onload_megatron_model(
    model_chunks: torch.nn.Module | Sequence[torch.nn.Module], *, params: bool = True, grads: bool = True
) -> OffloadStats:
    """Bring back what :func:`offload_megatron_model` moved, bit for bit, into the same storages.

    Raises :class:`OffloadStateError` if a selected group is not offloaded (nothing moves then).
    """
    chunks = _as_chunks(model_chunks)
    kinds = model_offload_kinds(params=params, grads=grads)
    jobs = []
    for chunk in chunks:
        state = _STATES.get(chunk)
        if state is None:
            raise OffloadStateError(f"{kinds} of {_label(chunk)} were never offloaded; nothing to onload")
        jobs.extend((state, kind) for kind in kinds)
    return _onload(jobs)


def leaf_optimizers(optimizer: Any) -> list[Any]:
    """The leaf optimizers: ChainedOptimizer's members (recursively), skipping stub optimizers.

    Public because every walker of megatron optimizer state (verl_mfsdp's offload and checkpoints) needs it.
    """
    chained = getattr(optimizer, "chained_optimizers", None)
    if chained is not None:
        return [leaf for member in chained for leaf in leaf_optimizers(member)]
    if getattr(optimizer, "is_stub_optimizer", False):
        return []
    return [optimizer]


def inner_torch_optimizer(leaf: Any) -> torch.optim.Optimizer:
    """The torch optimizer a leaf of :func:`leaf_optimizers` holds its state in (the leaf itself if it is one).

    Public because offload, verl_engine's checkpoints and verl_mfsdp's local state all read that state.
    A leaf wrapping something else (optimizer_cpu_offload's hybrid optimizer) is a TypeError naming it.
    """
    if isinstance(leaf, torch.optim.Optimizer):
        return leaf
    inner = getattr(leaf, "optimizer", None)
    if not isinstance(inner, torch.optim.Optimizer):
        raise TypeError(
            f"{type(leaf).__name__} wraps a {type(inner).__name__}, not a torch optimizer: its state cannot be"
            " offloaded or checkpointed here (megatron-core's optimizer_cpu_offload hybrid optimizer is not supported)"
        )
    return inner


def master_params(optimizer: Any) -> list[torch.Tensor]:
    """The fp32 master copies of megatron-core's mixed-precision optimizers, in a fixed order (none for torch's).

    Public because checkpoints (verl_engine) must save exactly these tensors too.
    """
    out: list[torch.Tensor] = []
    for leaf in leaf_optimizers(optimizer):
        for attr in _MASTER_PARAM_ATTRS:
            for group in getattr(leaf, attr, None) or ():
                out.extend(t for t in group if isinstance(t, torch.Tensor))
    return out


def _optimizer_tensors(optimizer: Any) -> list[torch.Tensor]:
    """Master copies (megatron mixed precision) and every tensor in the inner optimizer's state."""
    tensors = master_params(optimizer)
    for leaf in leaf_optimizers(optimizer):
        for per_param in inner_torch_optimizer(leaf).state.values():
            tensors.extend(v for v in per_param.values() if isinstance(v, torch.Tensor))
    return tensors


def offload_megatron_optimizer(
    optimizer: Any,
    *,
    pin_memory: bool | None = None,
    empty_cache: bool = True,
    drop_master_grads: bool = True,
) -> OffloadStats:
    """Offload an optimizer's state: master fp32 copies and Adam moments (any torch state tensor).

    ``optimizer`` is a megatron MegatronOptimizer (Float16OptimizerWithFloat16Params,
    DistributedOptimizer, FP32Optimizer, ChainedOptimizer of those) or a plain torch optimizer. The
    model's own parameters are never moved here (offload them with the model).

    ``drop_master_grads``: megatron's mixed-precision optimizers leave an fp32 ``.grad`` on every master
    copy after a step, rebuilt from the DDP grad buffer by every ``step()``; it is set to None so that
    memory is freed too instead of staying on the device.
    """
    state = get_offload_state(optimizer, pin_memory=pin_memory)
    if state.is_offloaded("optimizer"):
        raise OffloadStateError(
            f"optimizer of {state.label} is already offloaded; onload it before offloading again"
        )
    if drop_master_grads:
        for master in master_params(optimizer):
            master.grad = None
    return _offload([(state, "optimizer", _optimizer_tensors(optimizer))], empty_cache)


def onload_megatron_optimizer(optimizer: Any) -> OffloadStats:
    """Bring back what :func:`offload_megatron_optimizer` moved, bit for bit."""
    state = _STATES.get(optimizer)
    if state is None:
        raise OffloadStateError(f"optimizer of {_label(optimizer)} was never offloaded; nothing to onload")
    return _onload([(state, "optimizer")])


# ---------------------------------------------------------------------------------------------------
# Explicit tensors (for wrappers whose memory layout this module does not know, e.g. Megatron-FSDP)
# ---------------------------------------------------------------------------------------------------


def offload_tensors(
    groups: Sequence[tuple[Any, str, Iterable[torch.Tensor | None]]],
    *,
    pin_memory: bool | None = None,
    empty_cache: bool = True,
) -> OffloadStats:
    """Offload explicitly listed tensors, as ``(owner, kind, tensors)`` groups, with one synchronize.

    Why: a wrapper with its own buffers (verl_mfsdp's Megatron-FSDP support) knows which tensors
    hold its state; this lets it reuse the same host buffers, bookkeeping and rules as the DDP
    functions above instead of a second implementation. Pass plain tensors (a DTensor's local shard,
    not the DTensor). All groups are checked before anything moves.
    """
    jobs = [
        (get_offload_state(owner, pin_memory=pin_memory), kind, tensors) for owner, kind, tensors in groups
    ]
    return _offload(jobs, empty_cache)


def onload_tensors(groups: Sequence[tuple[Any, str]]) -> OffloadStats:
    """Bring back the ``(owner, kind)`` groups that :func:`offload_tensors` moved, bit for bit."""
    jobs = []
    for owner, kind in groups:
        state = _STATES.get(owner)
        if state is None:
            raise OffloadStateError(f"{kind!r} of {_label(owner)} was never offloaded; nothing to onload")
        jobs.append((state, kind))
    return _onload(jobs)
