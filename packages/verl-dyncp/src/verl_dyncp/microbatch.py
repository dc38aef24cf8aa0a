"""A planned micro-batch on one rank: its share of the inputs (split), of other per-token tensors (take),
and the whole micro-batch's outputs gathered back in the original order (merge)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from verl_dyncp.groups import CPGroup, CPGroups
from verl_dyncp.plan import DEFAULT_LARGER_CP_MIN_GAIN, CPBlock, DynamicCPPlan, plan_dynamic_cp
from verl_dyncp.thd import THDBatch, _gathered_index, gather_slots, preprocess_thd_engine, thd_alignment
from verl_dyncp.workload import WorkloadModel
from verl_mcore_utils.transfer import to_device_async

__all__ = [
    "DynamicCPMicroBatch",
    "dynamic_cp_merge_output",
    "dynamic_cp_merge_outputs",
    "dynamic_cp_split_batch",
    "dynamic_cp_take",
    "dynamic_cp_take_ahead",
    "global_loss_token_count",
]


@dataclass(frozen=True, eq=False)
class DynamicCPMicroBatch:
    """This rank's part of a planned micro-batch: its CP group, its sequences and its local THD inputs.

    ``batch`` is the :class:`THDBatch` of the group's sequences (in ascending original order) for this
    rank's CP rank; for an idle group it is the dummy sequence (``is_dummy``, loss mask all False).
    """

    plan: DynamicCPPlan
    block: CPBlock
    group: CPGroup
    sequence_indices: tuple[int, ...]
    is_dummy: bool
    batch: THDBatch

    def __post_init__(self) -> None:
        if self.group.size != self.block.size or self.group.index * self.group.size != self.block.offset:
            raise ValueError(
                f"CP group {self.group.index} of size {self.group.size} is not the plan's block at offset"
                f" {self.block.offset} of size {self.block.size}"
            )
        if self.block not in self.plan.blocks:
            raise ValueError("the block is not one of the plan's blocks")
        if self.sequence_indices != self.block.sequences:
            raise ValueError("sequence_indices differ from the plan's assignment for this block")
        if self.is_dummy != (not self.sequence_indices):
            raise ValueError("is_dummy must be True exactly when the group has no sequence")


def _block_of(plan: DynamicCPPlan, position: int) -> CPBlock:
    for b in plan.blocks:
        if b.offset <= position < b.offset + b.size:
            return b
    raise ValueError(f"DP x CP position {position} is outside the plan's {plan.dp_cp_size} ranks")


def _packed_index(seq_lens: Sequence[int], indices: Sequence[int]) -> torch.Tensor:
    cu = [0]
    for n in seq_lens:
        cu.append(cu[-1] + n)
    if not indices:
        return torch.zeros(0, dtype=torch.int64)
    return torch.cat([torch.arange(cu[i], cu[i + 1]) for i in indices])


def dynamic_cp_split_batch(
    input_ids: torch.Tensor,
    *,
    seq_lens: Sequence[int] | torch.Tensor,
    groups: CPGroups,
    max_seqlen_per_dp_cp_rank: int | None = None,
    static_cp_size: int | None = None,
    tp_size: int = 1,
    pad_value: int = 0,
    ignore_index: int = -100,
    label_mask: torch.Tensor | None = None,
    workload: WorkloadModel | None = None,
    larger_cp_min_gain: float | None = DEFAULT_LARGER_CP_MIN_GAIN,
    max_tokens_per_rank: int | None = None,
) -> DynamicCPMicroBatch:
    """Plan the packed micro-batch and return this rank's local THD inputs.

    ``input_ids`` (and ``label_mask``, if given) hold the whole micro-batch packed (dim 0 =
    ``sum(seq_lens)``) on every DP x CP rank; split other per-token tensors of the micro-batch (advantages,
    old log-probs, ...) with :func:`dynamic_cp_take`.
    """
    plan = plan_dynamic_cp(
        seq_lens,
        dp_cp_size=groups.world_size,
        max_seqlen_per_dp_cp_rank=max_seqlen_per_dp_cp_rank,
        static_cp_size=static_cp_size,
        workload=workload,
        larger_cp_min_gain=larger_cp_min_gain,
        max_tokens_per_rank=max_tokens_per_rank,
    )
    if input_ids.dim() == 0 or input_ids.shape[0] != sum(plan.seq_lens):
        raise ValueError(
            f"input_ids must be packed with {sum(plan.seq_lens)} tokens in dim 0, got shape {tuple(input_ids.shape)}"
        )
    block = _block_of(plan, groups.position)
    group = groups.group(block.size)
    layout = {"cp_size": block.size, "cp_rank": group.rank, "tp_size": tp_size}
    layout |= {"pad_value": pad_value, "ignore_index": ignore_index}
    if block.sequences:
        index = to_device_async(_packed_index(plan.seq_lens, block.sequences), input_ids.device)
        batch = preprocess_thd_engine(
            input_ids.index_select(0, index),
            seq_lens=[plan.seq_lens[i] for i in block.sequences],
            label_mask=None
            if label_mask is None
            else label_mask.index_select(0, to_device_async(index, label_mask.device)),
            **layout,
        )
    else:
        batch = _dummy_batch(input_ids, **layout)
    return DynamicCPMicroBatch(
        plan=plan,
        block=block,
        group=group,
        sequence_indices=block.sequences,
        is_dummy=not block.sequences,
        batch=batch,
    )


def _dummy_batch(
    input_ids: torch.Tensor, *, cp_size: int, cp_rank: int, tp_size: int, pad_value: int, ignore_index: int
) -> THDBatch:
    """An idle group's work: one sequence of ``alignment`` pad tokens, every label ignored, no loss token."""
    n = thd_alignment(cp_size=cp_size, tp_size=tp_size)
    batch = preprocess_thd_engine(
        torch.full((n, *input_ids.shape[1:]), pad_value, dtype=input_ids.dtype, device=input_ids.device),
        seq_lens=[n],
        cp_size=cp_size,
        cp_rank=cp_rank,
        tp_size=tp_size,
        pad_value=pad_value,
        ignore_index=ignore_index,
        label_mask=torch.zeros(n, dtype=torch.bool, device=input_ids.device),
    )
    return replace(batch, labels=torch.full_like(batch.labels, ignore_index))


def _group_tokens(tensor: torch.Tensor, micro_batch: DynamicCPMicroBatch) -> torch.Tensor | None:
    """The rows of the group's sequences in a packed per-token tensor; None for an idle group."""
    if micro_batch.is_dummy:
        return None
    index = to_device_async(
        _packed_index(micro_batch.plan.seq_lens, micro_batch.sequence_indices), tensor.device
    )
    return tensor.index_select(0, index)


def _filled(tensor: torch.Tensor, micro_batch: DynamicCPMicroBatch, fill: float | bool) -> torch.Tensor:
    n = micro_batch.batch.meta.local_tokens
    return torch.full((n, *tensor.shape[1:]), fill, dtype=tensor.dtype, device=tensor.device)


def dynamic_cp_take(
    tensor: torch.Tensor, *, micro_batch: DynamicCPMicroBatch, pad_value: float | bool = 0
) -> torch.Tensor:
    """This rank's local share of another packed per-token tensor of the whole micro-batch (e.g. advantages)."""
    mine = _group_tokens(tensor, micro_batch)
    if mine is None:
        return _filled(tensor, micro_batch, pad_value)
    return micro_batch.batch.meta.take(mine, pad_value=pad_value)


def dynamic_cp_take_ahead(
    tensor: torch.Tensor, *, micro_batch: DynamicCPMicroBatch, shift: int, fill: float | bool = 0
) -> torch.Tensor:
    """This rank's local share of the value ``shift`` tokens ahead in the same sequence (``fill`` where none).

    ``tensor`` is packed over the whole micro-batch, like :func:`dynamic_cp_take`'s; ``shift=1`` gives
    the next-token labels. Multi-token prediction takes its inputs and targets this way.
    """
    mine = _group_tokens(tensor, micro_batch)
    if mine is None:
        return _filled(tensor, micro_batch, fill)
    return micro_batch.batch.meta.take_ahead(mine, shift=shift, fill=fill)


def _merge_index(plan: DynamicCPPlan, *, tp_size: int) -> tuple[list[int], torch.Tensor]:
    """Local length of every DP x CP rank and, per original packed token, its index in the gathered buffer."""
    lens: list[int] = []
    index = torch.empty(sum(plan.seq_lens), dtype=torch.int64)
    offset = 0
    for block in plan.blocks:
        k = block.size
        if not block.sequences:
            local = thd_alignment(cp_size=k, tp_size=tp_size) // k
        else:
            local, gathered = _gathered_index(
                seq_lens=[plan.seq_lens[i] for i in block.sequences], cp_size=k, tp_size=tp_size
            )
            index[_packed_index(plan.seq_lens, block.sequences)] = offset + gathered
        lens.extend([local] * k)
        offset += local * k
    return lens, index


def dynamic_cp_merge_output(
    local_output: torch.Tensor, *, micro_batch: DynamicCPMicroBatch, groups: CPGroups
) -> torch.Tensor:
    """Gather every rank's local per-token output and return the whole micro-batch packed, in original order.

    One all-gather over the DP x CP ranks (buffers padded to the longest local length). Every rank gets
    the full result; this rank's slot is ``local_output`` itself, so a loss on the merged output sends
    gradients only into this rank's own tokens (sum of the ranks' gradients = the no-CP gradient).
    Dtype and trailing dims are kept. Dummy ranks' outputs are dropped.
    """
    lens, index = _merge_index_on(micro_batch, local_output.device)
    gathered = gather_slots(local_output, group=groups.full_group, rank=groups.position, lens=lens)
    return gathered.index_select(0, index)


def dynamic_cp_merge_outputs(
    outputs: Mapping[str, torch.Tensor], *, micro_batch: DynamicCPMicroBatch, groups: CPGroups
) -> dict[str, torch.Tensor]:
    """:func:`dynamic_cp_merge_output` of several per-token outputs, one all-gather per dtype.

    Why: every merge is a collective over the whole DP x CP pool, so each one holds every rank until the
    slowest arrives; log-probs and entropy of a micro-batch (same dtype) travel together as columns of one
    ``[T, n]`` tensor. The results equal separate merges bit for bit (bytes are moved, rows are picked the
    same way) and gradients reach each output through its own columns.
    """
    if not outputs:
        return {}
    tokens = {t.shape[0] if t.dim() else None for t in outputs.values()}
    if len(tokens) != 1 or None in tokens:
        shapes = {name: tuple(t.shape) for name, t in outputs.items()}
        raise ValueError(f"outputs to merge must share dim 0 (this rank's tokens); got shapes {shapes}")
    by_dtype: dict[torch.dtype, list[str]] = {}
    for name, tensor in outputs.items():
        by_dtype.setdefault(tensor.dtype, []).append(name)
    merged: dict[str, torch.Tensor] = {}
    for names in by_dtype.values():
        if len(names) == 1:
            merged[names[0]] = dynamic_cp_merge_output(
                outputs[names[0]], micro_batch=micro_batch, groups=groups
            )
            continue
        columns = [outputs[name].reshape(outputs[name].shape[0], -1) for name in names]
        widths = [c.shape[1] for c in columns]
        gathered = dynamic_cp_merge_output(torch.cat(columns, dim=1), micro_batch=micro_batch, groups=groups)
        for name, part in zip(names, gathered.split(widths, dim=1), strict=True):
            merged[name] = part.reshape(part.shape[0], *outputs[name].shape[1:])
    return {name: merged[name] for name in outputs}


_MERGE_CACHE_ATTR = "_verl_merge_index"


def _merge_index_on(micro_batch: DynamicCPMicroBatch, device: torch.device) -> tuple[list[int], torch.Tensor]:
    """:func:`_merge_index` of the micro-batch on ``device``, computed once per micro-batch (an engine merges
    several outputs of each), copied without a host-device synchronisation."""
    cache: dict[str, tuple[list[int], torch.Tensor]] | None = getattr(micro_batch, _MERGE_CACHE_ATTR, None)
    if cache is None:
        cache = {}
        object.__setattr__(micro_batch, _MERGE_CACHE_ATTR, cache)
    key = str(device)
    if key not in cache:
        lens, index = _merge_index(micro_batch.plan, tp_size=micro_batch.batch.meta.tp_size)
        cache[key] = (lens, to_device_async(index, device))
    return cache[key]


def global_loss_token_count(
    local_loss_mask: torch.Tensor, *, group: dist.ProcessGroup | None
) -> torch.Tensor:
    """Number of loss tokens of the whole micro-batch: the LOCAL masks summed over the DP x CP ranks.

    The local masks (from the split) partition the real tokens and dummy ranks contribute 0, so no token
    is counted twice. Returns an int64 scalar on the mask's device (``group`` None: no reduction). Divide
    each rank's token-sum loss by it: the sum over ranks of the gradients is then the no-CP gradient of
    the mean token loss.
    """
    count = local_loss_mask.to(torch.int64).sum()
    if group is not None:
        dist.all_reduce(count, group=group)
    return count
