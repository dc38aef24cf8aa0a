"""Sync-free stand-ins for megatron-core's multi-tensor fallbacks (no Apex, no Transformer Engine).

megatron-core's pure-torch l2 norm fallback copies one norm per parameter tensor to the host (a synchronisation
each); these foreach versions take the same arguments, return the same values and stay on the device, and are
installed only where megatron-core still holds its own fallback. Details: the package README.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any

import torch

__all__ = [
    "multi_tensor_l2_norm",
    "multi_tensor_scale",
    "restore_multi_tensor_fallbacks",
    "use_sync_free_multi_tensor_fallbacks",
]

# The megatron-core modules that pick a multi-tensor implementation at import time (0.14 to 0.19). Any attribute
# of theirs that *is* one of megatron.core.utils' local fallbacks is replaced; names may differ between releases.
_TARGET_MODULES = ("megatron.core.optimizer.clip_grads", "megatron.core.optimizer.optimizer")

# (module, attribute, megatron's original) for every replacement in place, for restore_multi_tensor_fallbacks().
_installed: list[tuple[Any, str, Any]] = []


def _group(tensors: Sequence[torch.Tensor]) -> dict[tuple[torch.device, torch.dtype], list[torch.Tensor]]:
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    return groups


def multi_tensor_l2_norm(
    chunk_size: int,
    noop_flag: torch.Tensor | None,
    tensor_lists: Sequence[Sequence[torch.Tensor]],
    per_tensor: bool,
    *args: Any,
) -> tuple[torch.Tensor, None]:
    """The L2 norm of every tensor in ``tensor_lists`` taken as one vector, without leaving the device.

    Drop-in for ``megatron.core.utils.local_multi_tensor_l2_norm`` (itself a stand-in for
    ``amp_C.multi_tensor_l2norm``): returns ``(norm, None)`` with ``norm`` a float32 tensor of shape ``[1]``;
    ``chunk_size``, ``noop_flag`` and ``per_tensor`` are ignored as there. The norm is on the tensors' device (the
    first tensor's, when they are spread over several), or on ``noop_flag``'s when there are no tensors. Norms of
    non-float32 tensors are accumulated in float32.
    """
    tensors = [t for tensor_list in tensor_lists for t in tensor_list]
    if not tensors:
        device = noop_flag.device if isinstance(noop_flag, torch.Tensor) else None
        return torch.zeros(1, dtype=torch.float32, device=device), None
    device = tensors[0].device
    norms: list[torch.Tensor] = []
    for (group_device, _), group in _group(tensors).items():
        group_norms: Sequence[torch.Tensor] = torch._foreach_norm(group, 2.0, dtype=torch.float32)
        if group_device != device:
            group_norms = [n.to(device) for n in group_norms]
        norms.extend(group_norms)
    total = torch.linalg.vector_norm(torch.stack(norms))
    return total.reshape(1), None


def multi_tensor_scale(
    chunk_size: int,
    noop_flag: torch.Tensor | None,
    tensor_lists: Sequence[Sequence[torch.Tensor]],
    scale: float | torch.Tensor,
) -> None:
    """``dst.copy_(src * scale)`` for each pair of ``tensor_lists[0]`` (src) and ``tensor_lists[1]`` (dst).

    Drop-in for ``megatron.core.utils.local_multi_tensor_scale``: the product is taken in the source's dtype and
    cast into the destination; ``chunk_size`` and ``noop_flag`` are ignored as there (megatron's fallback never sets
    the overflow flag, unlike ``amp_C.multi_tensor_scale``). Pairs where src is dst are scaled in place; with
    ``scale == 1.0`` (megatron's "copy this to that") the sources are copied without a multiplication, which gives
    the same bits.
    """
    srcs, dsts = tensor_lists[0], tensor_lists[1]
    groups: dict[tuple[Any, ...], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for src, dst in zip(srcs, dsts, strict=False):  # megatron's fallback zips without checking lengths
        key = (src.device, src.dtype, dst.device, dst.dtype, src is dst)
        group_srcs, group_dsts = groups.setdefault(key, ([], []))
        group_srcs.append(src)
        group_dsts.append(dst)
    is_one = not isinstance(scale, torch.Tensor) and scale == 1.0
    for (*_, in_place), (group_srcs, group_dsts) in groups.items():
        if in_place:
            if not is_one:
                torch._foreach_mul_(group_dsts, scale)
        elif is_one:
            torch._foreach_copy_(group_dsts, group_srcs)
        else:
            torch._foreach_copy_(group_dsts, torch._foreach_mul(group_srcs, scale))


def _megatron_fallbacks() -> list[tuple[Any, Any]]:
    """(megatron.core.utils' local fallback, our replacement) for each fallback this release has."""
    # The package's __init__ has run prepare_megatron_import(), so megatron-core imports directly here
    # (no import of compat, which imports this module to install the replacements).
    from megatron.core import utils

    replacements = {
        "local_multi_tensor_l2_norm": multi_tensor_l2_norm,
        "local_multi_tensor_scale": multi_tensor_scale,
    }
    return [(getattr(utils, name), ours) for name, ours in replacements.items() if hasattr(utils, name)]


def use_sync_free_multi_tensor_fallbacks() -> bool:
    """Install :func:`multi_tensor_l2_norm` / :func:`multi_tensor_scale` where megatron-core uses its own fallbacks.

    Only a module attribute that *is* ``megatron.core.utils.local_multi_tensor_l2_norm`` or
    ``local_multi_tensor_scale`` is replaced, i.e. only when neither Apex's ``amp_C`` nor Transformer Engine's
    kernels were importable when megatron-core loaded. Idempotent: returns whether this call replaced anything
    (False when Apex / TE kernels are in use or when the replacements are already in place). Undo with
    :func:`restore_multi_tensor_fallbacks`.
    """
    fallbacks = _megatron_fallbacks()
    installed = False
    for module_name in _TARGET_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:  # pragma: no cover - every supported release has both modules
            continue
        for attr, value in list(vars(module).items()):
            for original, ours in fallbacks:
                # The selected implementation (e.g. ``l2_norm_impl``), not the imported name of the fallback itself.
                if value is original and attr != original.__name__:
                    setattr(module, attr, ours)
                    _installed.append((module, attr, original))
                    installed = True
    return installed


def restore_multi_tensor_fallbacks() -> int:
    """Put megatron-core's own fallbacks back where :func:`use_sync_free_multi_tensor_fallbacks` replaced them.

    Returns how many module attributes were restored (0 when nothing was installed). An attribute that someone else
    has replaced since is left alone.
    """
    restored = 0
    while _installed:
        module, attr, original = _installed.pop()
        if getattr(module, attr, None) in (multi_tensor_l2_norm, multi_tensor_scale):
            setattr(module, attr, original)
            restored += 1
    return restored
