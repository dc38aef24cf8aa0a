"""Metrics that stay on the device until the step ends, each with its declared reduction.

Why: reading a metric on the host (``float(t)``, ``.item()``) makes the host wait for the GPU, and
between micro-batches that leaves the GPU idle while the host queues the next one. A loss therefore
returns its metrics as device tensors wrapped in :class:`Metric`, which says how the engine reduces them
over the step's micro-batches (verl 0.9.1's ``AggregationType``): ``SUM`` for a micro-batch's share of a
globally normalised loss, ``MEAN`` for a ratio over the micro-batch. The engine collects them in a
:class:`MetricAccumulator` and reads them all with one device-to-host copy when the step is done.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Metric", "MetricAccumulator", "Reduction"]


class Reduction(str, enum.Enum):
    """How the values of one metric over a step's micro-batches become one number."""

    SUM = "sum"  # a share of a globally normalised loss: summed, then averaged over the pool's ranks
    MEAN = "mean"  # a per-micro-batch ratio: averaged over micro-batches


@dataclass(frozen=True)
class Metric:
    """One micro-batch's value of a metric (a 0-dim tensor, kept on its device, or a number)."""

    value: torch.Tensor | float
    reduction: Reduction = Reduction.MEAN

    def __post_init__(self) -> None:
        if not isinstance(self.reduction, Reduction):
            raise ValueError(f"Metric.reduction must be a Reduction (SUM or MEAN); got {self.reduction!r}")
        if isinstance(self.value, torch.Tensor) and self.value.numel() != 1:
            raise ValueError(f"a Metric holds one number; got a tensor of shape {tuple(self.value.shape)}")


class MetricAccumulator:
    """The step's metrics, micro-batch by micro-batch, read once at the end.

    Values that are not :class:`Metric` (plain floats or tensors from a user's loss) are averaged, as verl
    does for metrics without a declared aggregation.
    """

    def __init__(self) -> None:
        self._values: dict[str, list[torch.Tensor | float]] = {}
        self._reductions: dict[str, Reduction] = {}
        self._losses: list[torch.Tensor] = []

    def add_loss(self, loss: torch.Tensor) -> None:
        """Record one micro-batch's loss (its share of the global loss, detached, never read here)."""
        self._losses.append(loss.detach())

    def add(self, metrics: Mapping[str, Any]) -> None:
        """Record one micro-batch's metrics (tensors are detached, never read here)."""
        for name, item in metrics.items():
            metric = item if isinstance(item, Metric) else Metric(value=item)
            known = self._reductions.setdefault(name, metric.reduction)
            if known is not metric.reduction:
                raise ValueError(
                    f"metric {name!r} was declared with reduction {known.value} and then {metric.reduction.value};"
                    " a loss must declare one reduction per metric name"
                )
            value = metric.value.detach() if isinstance(metric.value, torch.Tensor) else float(metric.value)
            self._values.setdefault(name, []).append(value)

    def reduce(self, *, pool_size: int) -> tuple[float, dict[str, float]]:
        """(the step's loss, every metric reduced): SUM -> sum / ``pool_size`` (the loss carries the pool size, as
        the gradient average undoes it; the loss is summed the same way), MEAN -> mean over micro-batches. One
        device-to-host copy per device for all of them."""
        names = list(self._values)
        tensors = [v for name in names for v in self._values[name] if isinstance(v, torch.Tensor)]
        if self._losses:
            tensors.append(torch.stack(self._losses).sum())
        host = iter(_to_host(tensors))
        out: dict[str, float] = {}
        for name in names:
            values = [next(host) if isinstance(v, torch.Tensor) else v for v in self._values[name]]
            total = sum(values)
            out[name] = total / pool_size if self._reductions[name] is Reduction.SUM else total / len(values)
        loss = next(host) / pool_size if self._losses else 0.0
        return loss, out


def _to_host(tensors: list[torch.Tensor]) -> list[float]:
    """All scalars as floats with one copy per device (float64 on the way, so no precision is lost)."""
    if not tensors:
        return []
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        by_device.setdefault(t.device, []).append(i)
    out: list[float] = [0.0] * len(tensors)
    for indices in by_device.values():
        stacked = torch.stack([tensors[i].reshape(()).to(torch.float64) for i in indices])
        for i, value in zip(indices, stacked.tolist(), strict=True):
            out[i] = value
    return out
