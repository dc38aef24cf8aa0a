"""Host buffers for device storages: exactly the bytes needed, page-locked in place, reused every cycle."""

from __future__ import annotations

import mmap
import warnings
from collections import defaultdict
from collections.abc import Mapping

import torch

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


class BufferGroup:
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
