"""Host-to-device copies that do not stall the GPU's queue.

Why: copying a tensor from ordinary (pageable) host memory makes the host wait until the GPU has finished
everything queued before the copy; an engine that does this per micro-batch (index tensors, layouts) lets
the GPU run dry while the host prepares the next piece of work. A copy from page-locked memory with
``non_blocking=True`` is ordered on the stream instead, and torch's caching host allocator keeps the
page-locked buffer alive until that copy has run.
"""

from __future__ import annotations

import torch

__all__ = ["to_device_async"]


def to_device_async(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``tensor`` on ``device`` without a host-device synchronisation (a plain ``.to`` elsewhere)."""
    device = torch.device(device)
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)
