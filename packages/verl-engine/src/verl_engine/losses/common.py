"""Input checks and masked arithmetic shared by every loss: no host reads, NaN padding never leaks."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = [
    "check_shapes",
    "config_value",
    "global_batch_info",
    "masked",
    "masked_mean",
    "nonzero",
    "optional_tensor",
    "required_tensor",
    "scalar",
]

_MISSING = object()


def masked(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``values * mask`` with masked-out entries forced to 0 first, so NaN/inf padding cannot leak (verl too)."""
    return torch.where(mask.bool(), values, 0.0) * mask.to(values.dtype)


def nonzero(count: Any) -> Any:
    """A divisor that is ``count`` unless it is 0 (then 1): an all-empty batch gives 0, not NaN."""
    if isinstance(count, torch.Tensor):
        return torch.where(count == 0, torch.ones_like(count), count)
    return count if count != 0 else 1


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` over the mask as a float64 0-dim tensor on their device (0 for an empty mask).

    A tensor, not a float: reading it would make the host wait for the micro-batch's forward.
    """
    mask = mask.bool()
    total = torch.where(mask, values.detach().double(), 0.0).sum()
    return total / mask.sum().clamp(min=1)


def config_value(config: Any, key: str, *, loss: str, default: Any = _MISSING) -> Any:
    """``config.key`` for dataclasses, namespaces, DictConfig or plain dicts; a clear error names what is missing."""
    value = config.get(key, default) if isinstance(config, Mapping) else getattr(config, key, default)
    if value is _MISSING:
        raise ValueError(f"{loss} needs config.{key}; the config given ({type(config).__name__}) has none")
    return value


def required_tensor(source: Mapping[str, Any], key: str, *, loss: str, where: str) -> torch.Tensor:
    """``source[key]`` as a tensor; missing (or None) raises a ValueError naming key and loss."""
    value = source[key] if key in source else None
    if value is None:
        raise ValueError(
            f"{loss} needs {where}[{key!r}] (a [micro_batch, response_len] tensor); it is missing"
        )
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{loss} needs {where}[{key!r}] to be a torch.Tensor, got {type(value).__name__}")
    return value


def optional_tensor(source: Mapping[str, Any], key: str) -> torch.Tensor | None:
    """``source[key]`` when present and not None (TensorDicts may hold a None as non-tensor data)."""
    value = source[key] if key in source else None
    return value if isinstance(value, torch.Tensor) else None


def check_shapes(*, loss: str, mask: torch.Tensor, tensors: Mapping[str, torch.Tensor | None]) -> None:
    """Every response-aligned tensor must have the mask's [mb, R] shape; name both sides when one does not."""
    if mask.dim() != 2:
        raise ValueError(
            f"{loss}: data['response_mask'] must be [micro_batch, response_len]; got shape {tuple(mask.shape)}"
        )
    for name, tensor in tensors.items():
        if tensor is not None and tensor.shape != mask.shape:
            raise ValueError(
                f"{loss}: {name} has shape {tuple(tensor.shape)} but data['response_mask'] has shape "
                f"{tuple(mask.shape)}; both must be [micro_batch, response_len], aligned to response tokens"
            )


def scalar(data: Mapping[str, Any], key: str, *, loss: str, required: bool) -> Any:
    """A python scalar of ``data`` (0-dim tensors allowed); a required key that is absent raises ValueError."""
    if key not in data:
        if required:
            raise ValueError(
                f"{loss} needs data[{key!r}] (global normalisation: dp_size, batch_num_tokens, "
                "global_batch_size); it is missing"
            )
        return None
    return data[key]


def global_batch_info(data: Mapping[str, Any], *, loss: str, config: Any) -> dict[str, Any]:
    """The ``agg_kwargs`` of one call: global counts from ``data``, loss_scale_factor from data or config."""
    scale = scalar(data, "loss_scale_factor", loss=loss, required=False)
    if scale is None and config is not None:
        scale = config_value(config, "loss_scale_factor", loss=loss, default=None)
    return {
        "dp_size": int(scalar(data, "dp_size", loss=loss, required=True)),
        "batch_num_tokens": scalar(data, "batch_num_tokens", loss=loss, required=True),
        "global_batch_size": scalar(data, "global_batch_size", loss=loss, required=True),
        "loss_scale_factor": scale,
    }
