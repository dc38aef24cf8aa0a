"""A verl batch as the engine reads it: sequences packed, each with its prompt and response extent.

verl hands the engine a TensorDict (or any mapping) whose ``input_ids`` are either padded ``[B, S]``
(prompt left-padded, response right-padded: the last ``R`` columns are the response) or a jagged
nested tensor of the valid tokens, with ``attention_mask [B, S]`` marking the valid columns and
response-level tensors (``response_mask``, ``old_log_probs``, ``advantages``, ``returns``, ``values``
...) of shape ``[B, R]``. The engine works on the valid tokens only (packed, THD), so this module
turns the batch into a :class:`~verl_engine.packed.PackedBatch` plus, per sequence, where its prompt
ends and how many response tokens it has, and maps per-token outputs back:

* to the loss: response-aligned ``[mb, R]`` (entry ``t`` belongs to response token ``t``);
* to the caller: the input's own layout, where position ``c`` holds the output computed at token ``c``
  (for log-probs: ``log p(token c+1)``, verl's convention), zero elsewhere.

Every rule that can fail is checked here, before any collective, with the key named.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from verl_engine.packed import PackedBatch
from verl_mcore_utils.transfer import to_device_async

__all__ = ["RLBatch", "is_jagged", "read_scalar"]


def is_jagged(value: Any) -> bool:
    """A jagged nested tensor (``torch.nested.nested_tensor(..., layout=torch.jagged)``)."""
    return isinstance(value, torch.Tensor) and value.is_nested


def read_scalar(data: Mapping[str, Any], key: str, default: Any) -> Any:
    """A python scalar from ``data`` (TensorDict non-tensor data comes back as the plain value)."""
    if key not in data:
        return default
    value = data[key]
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"data[{key!r}] must be a scalar, got a tensor of shape {tuple(value.shape)}")
        return value.item()
    return getattr(value, "data", value)  # tensordict.NonTensorData


@dataclass(frozen=True)
class RLBatch:
    """The global batch of one call, validated: packed tokens and each sequence's layout.

    ``left_pad[i]``: column of sequence ``i``'s first valid token in the padded layout (0 when jagged);
    ``prompt_lens[i]`` / ``response_lens[i]``: its valid prompt / response tokens; ``response_cols``
    (``R``): width of the response-level tensors (0 when the batch has none).
    """

    packed: PackedBatch
    left_pad: tuple[int, ...]
    prompt_lens: tuple[int, ...]
    response_lens: tuple[int, ...]
    seq_cols: int
    response_cols: int
    jagged: bool
    # response_view's index tensors per (micro-batch, device): see _response_index
    _index_cache: dict[Any, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(
        default_factory=dict, compare=False, repr=False
    )

    @property
    def size(self) -> int:
        return len(self.packed.seq_lens)

    @classmethod
    def from_data(cls, data: Mapping[str, Any]) -> RLBatch:
        """Read ``input_ids`` / ``attention_mask`` (and the response width) from a verl batch."""
        for key in ("input_ids", "attention_mask"):
            if key not in data:
                raise ValueError(
                    f"the batch has no {key!r}; the engine needs input_ids (padded [B, S] or jagged) and"
                    f" attention_mask [B, S] (keys present: {', '.join(sorted(map(str, data.keys())))})"
                )
        ids, mask = data["input_ids"], data["attention_mask"]
        if is_jagged(mask) or mask.dim() != 2:
            raise ValueError(f"attention_mask must be a padded [B, S] tensor, got shape {_shape(mask)}")
        mask = mask.to(torch.bool)
        batch, cols = mask.shape
        if batch == 0:
            raise ValueError("empty batch: input_ids has no sequences; give every call at least one sequence")
        response_cols = _response_cols(data, batch=batch, cols=cols)
        lens = mask.sum(dim=1)
        if int(lens.min()) == 0:
            empty = torch.nonzero(lens == 0).flatten().tolist()
            raise ValueError(f"attention_mask: sequences {empty[:8]} have no valid token")
        first = mask.to(torch.int64).argmax(dim=1)
        if not torch.equal(mask, _contiguous_mask(first, lens, cols)):
            raise ValueError(
                "attention_mask: the valid tokens of a sequence must be one contiguous run (left-padded prompt,"
                " right-padded response), as verl builds them"
            )
        prompt_part = mask[:, : cols - response_cols].sum(dim=1)
        response_part = mask[:, cols - response_cols :].sum(dim=1)
        if response_cols and int(prompt_part.min()) == 0:
            bad = torch.nonzero(prompt_part == 0).flatten().tolist()
            raise ValueError(
                f"sequences {bad[:8]} have no prompt token: the first response token needs a token before it"
                " to be predicted from"
            )
        if is_jagged(ids):
            offsets = ids.offsets()
            seq_lens = (offsets[1:] - offsets[:-1]).cpu()
            if seq_lens.shape[0] != batch or not torch.equal(seq_lens, lens.cpu()):
                raise ValueError(
                    f"jagged input_ids hold sequences of lengths {seq_lens.tolist()[:8]}... but attention_mask"
                    f" marks {lens.tolist()[:8]}...; they must describe the same tokens"
                )
            packed_ids = ids.values()
            left = tuple(0 for _ in range(batch))
        else:
            if ids.shape != mask.shape:
                raise ValueError(
                    f"input_ids {tuple(ids.shape)} and attention_mask {tuple(mask.shape)} differ in shape"
                )
            packed_ids = ids[mask]
            left = tuple(int(v) for v in first.tolist())
        return cls(
            packed=PackedBatch(input_ids=packed_ids.to(torch.int64), seq_lens=tuple(lens.tolist())),
            left_pad=left,
            prompt_lens=tuple(int(v) for v in prompt_part.tolist()),
            response_lens=tuple(int(v) for v in response_part.tolist()),
            seq_cols=cols,
            response_cols=response_cols,
            jagged=is_jagged(ids),
        )

    # ------------------------------------------------------------------------------ outputs
    def response_token_mask(self) -> torch.Tensor:
        """Per packed token: is it a response token (every token when the batch has no response part).

        The targets of multi-token prediction, as verl's label mask: prompt tokens are never predicted.
        """
        if self.response_cols == 0:
            return torch.ones(sum(self.packed.seq_lens), dtype=torch.bool)
        return torch.cat(
            [torch.arange(n) >= p for n, p in zip(self.packed.seq_lens, self.prompt_lens, strict=True)]
        )

    def response_view(self, merged: torch.Tensor, *, indices: Sequence[int]) -> torch.Tensor:
        """``[len(indices), R]`` from a micro-batch's label-aligned packed output (sequences ``indices``).

        Slot ``j`` of a sequence predicts its token ``j + 1``, so response token ``t`` of sequence ``i``
        reads slot ``prompt_lens[i] - 1 + t``. Autograd flows through (index_select).
        """
        if self.response_cols == 0:
            raise ValueError(
                "the batch has no response-level tensors (response_mask [B, R]); a loss on responses needs them"
            )
        rows, cols, src = self._response_index(tuple(indices), merged.device)
        out = merged.new_zeros((len(indices), self.response_cols, *merged.shape[1:]))
        if src.numel():
            out = out.index_put((rows, cols), merged.index_select(0, src))
        return out

    def _response_index(
        self, indices: tuple[int, ...], device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(row, column, packed slot) of every response token of ``indices`` on ``device``: built once per
        micro-batch and device (a loss reads several outputs), copied without a host-device sync."""
        key = (indices, str(device))
        cache = self._index_cache
        if key not in cache:
            rows, cols, src = [], [], []
            offset = 0
            for row, i in enumerate(indices):
                n, p, r = self.packed.seq_lens[i], self.prompt_lens[i], self.response_lens[i]
                rows.append(torch.full((r,), row, dtype=torch.int64))
                cols.append(torch.arange(r, dtype=torch.int64))
                src.append(torch.arange(offset + p - 1, offset + p - 1 + r, dtype=torch.int64))
                offset += n
            cache[key] = tuple(to_device_async(torch.cat(t), device) for t in (rows, cols, src))  # type: ignore[assignment]
        return cache[key]

    def to_input_layout(self, per_sequence: Sequence[torch.Tensor]) -> torch.Tensor:
        """Per-sequence label-aligned outputs (in batch order) back in the input's layout (detached)."""
        if self.jagged:
            return torch.nested.nested_tensor([t.detach() for t in per_sequence], layout=torch.jagged)
        first = per_sequence[0]
        out = first.new_zeros((self.size, self.seq_cols, *first.shape[1:]))
        for i, values in enumerate(per_sequence):
            out[i, self.left_pad[i] : self.left_pad[i] + values.shape[0]] = values.detach()
        return out

    def rows(
        self, data: Mapping[str, Any], indices: Sequence[int], *, device: torch.device | None = None
    ) -> dict[str, Any]:
        """The loss's view of a micro-batch: every padded per-sequence tensor row-selected (moved to
        ``device``), scalars as they are. Jagged tensors are left out.

        Copies to a GPU go through pinned memory (:func:`to_device_async`): a copy from pageable host memory
        makes the host wait for every kernel queued before it, and this runs once per micro-batch, after its
        forward was queued, so the GPU would idle while the host queues the loss and the backward."""
        index = torch.tensor(list(indices), dtype=torch.int64)
        out: dict[str, Any] = {}
        for key in data.keys():
            value = data[key]
            if isinstance(value, torch.Tensor):
                if value.is_nested or value.dim() == 0:
                    continue
                if value.shape[0] == self.size:
                    rows = value.index_select(0, to_device_async(index, value.device))
                    out[key] = rows if device is None else to_device_async(rows, device)
            else:
                out[key] = getattr(value, "data", value)
        return out


def _response_cols(data: Mapping[str, Any], *, batch: int, cols: int) -> int:
    for key in ("response_mask", "responses"):
        if key in data and isinstance(data[key], torch.Tensor) and not data[key].is_nested:
            value = data[key]
            if value.dim() != 2 or value.shape[0] != batch or value.shape[1] > cols:
                raise ValueError(
                    f"{key} must be [B, R] with B = {batch} and R <= {cols} (the input width); got {tuple(value.shape)}"
                )
            return int(value.shape[1])
    return 0


def _contiguous_mask(first: torch.Tensor, lens: torch.Tensor, cols: int) -> torch.Tensor:
    col = torch.arange(cols, device=first.device)[None]
    return (col >= first[:, None]) & (col < (first + lens)[:, None])


def _shape(value: Any) -> str:
    return "jagged" if is_jagged(value) else str(tuple(getattr(value, "shape", ())))
