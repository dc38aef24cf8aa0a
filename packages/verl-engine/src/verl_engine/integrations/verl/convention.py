"""verl's loss convention on top of :class:`~verl_engine.engine.RLEngine`.

verl 0.9.1's loss functions (``verl.workers.utils.losses.ppo_loss`` / ``value_loss``) are called per micro-batch as
``loss_fn(model_output=..., data=..., dp_group=...)`` and read:

* ``model_output[key]``: a jagged nested tensor per whole sequence, in the micro-batch's order, where position ``t``
  holds the output computed at token ``t`` (``no_padding_2_padding`` slices the response out of it);
* ``data``: a TensorDict slice of the caller's batch (every key, non-tensor ones included) plus ``dp_size``,
  ``batch_num_tokens`` and ``global_batch_size``.

Our engine already computes whole-sequence outputs in the micro-batch's order (label-aligned, the same convention),
so only the wrapping changes: the hooks below replace :meth:`RLEngine._call_loss`, ``_record`` and ``_summary``.

Why the loss and ``SUM`` metrics are divided by the pool size: our engine gives every rank of the DP x CP pool the
whole micro-batch (verl's dispatcher sees a data-parallel size of 1), and verl's losses multiply by ``dp_size`` so
that the pool's gradient average is the global mean. Every rank therefore holds ``pool_size`` times the global value,
where verl's own engine holds a ``1 / dp_size`` share on each rank; dividing once here gives the numbers verl's
worker and trainer expect (summed over micro-batches, averaged over a size-1 DP group).
"""

from __future__ import annotations

from typing import Any

import torch

from verl_engine.engine import RLEngine
from verl_engine.rl_batch import read_scalar

__all__ = ["VerlConventionEngine"]


class VerlConventionEngine(RLEngine):
    """:class:`RLEngine` whose loss calls and results follow verl 0.9.1's ``forward_backward_batch`` contract."""

    # the size-1 process group verl's losses and worker get as the data-parallel group (set by the adapter)
    verl_dp_group: Any = None

    def _call_loss(self, call: Any, mb: Any, merged: dict[str, torch.Tensor]) -> tuple[torch.Tensor, Any]:
        from verl.utils import tensordict_utils as tu

        batch = call.batch
        indices = list(mb.indices)
        data = tu.index_select_tensor_dict(call.data, indices)
        data = data.to(self.device) if self.device.type != "cpu" else data
        global_batch_size = read_scalar(call.data, "global_batch_size", None)
        tu.assign_non_tensor(
            data,
            dp_size=self.pool_size,
            batch_num_tokens=call.scalars["batch_num_tokens"],
            global_batch_size=batch.size if global_batch_size is None else global_batch_size,
        )
        lens = torch.tensor([batch.packed.seq_lens[i] for i in indices], dtype=torch.int64)
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)]).to(self.device)
        model_output = {
            key: torch.nested.nested_tensor_from_jagged(values, offsets) for key, values in merged.items()
        }
        return call.loss_function(model_output=model_output, data=data, dp_group=self.verl_dp_group)

    def _record(self, call: Any, loss: torch.Tensor, metrics: Any) -> None:
        call.records.append((loss.detach(), dict(metrics)))

    def _summary(self, call: Any) -> tuple[list[float], dict[str, list[Any]]]:
        """verl's shape: ``loss`` a list (one float per micro-batch), ``metrics`` a list per key (one entry per
        micro-batch, the loss's own ``Metric`` or number), both divided by the pool size where verl sums."""
        from verl.utils.metric import AggregationType, Metric

        pool = self.pool_size
        if not call.records:
            return [], {}
        losses = torch.stack([loss.reshape(()).to(torch.float64) for loss, _ in call.records]).tolist()
        metrics: dict[str, list[Any]] = {}
        for _, record in call.records:
            for key, value in record.items():
                if isinstance(value, Metric):
                    if value.aggregation is AggregationType.SUM:
                        scaled = Metric(aggregation=AggregationType.SUM)
                        scaled.extend([v / pool for v in value.values])
                        value = scaled
                elif isinstance(value, torch.Tensor):
                    value = value.detach().item()
                metrics.setdefault(key, []).append(value)
        return [loss / pool for loss in losses], metrics
