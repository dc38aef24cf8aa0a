"""Padded batches of the SFT engine: fixed-length sequences with next-token labels and a loss mask."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from verl_engine.packed import PackedBatch

__all__ = ["Batch"]


@dataclass(frozen=True)
class Batch:
    """A batch of fixed-length sequences; ``labels[t]`` is the token after ``input_ids[t]``."""

    input_ids: torch.Tensor  # [b, s] int64
    labels: torch.Tensor  # [b, s] int64
    loss_mask: torch.Tensor  # [b, s] float32, 1 where labels[t] is an answer token
    position_ids: torch.Tensor  # [b, s] int64

    @property
    def batch_size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum().item())

    def slice(self, start: int, stop: int) -> Batch:
        return Batch(
            *(t[start:stop] for t in (self.input_ids, self.labels, self.loss_mask, self.position_ids))
        )

    def shard(self, *, rank: int, num_shards: int) -> Batch:
        """The contiguous ``rank``-th of ``num_shards`` equal parts (data-parallel split)."""
        if self.batch_size % num_shards:
            raise ValueError(
                f"batch of {self.batch_size} sequences cannot be split into {num_shards} equal shards"
            )
        per = self.batch_size // num_shards
        return self.slice(rank * per, (rank + 1) * per)

    def micro_batches(self, micro_batch_size: int) -> list[Batch]:
        if self.batch_size % micro_batch_size:
            raise ValueError(
                f"batch of {self.batch_size} sequences is not divisible by micro batch size {micro_batch_size}"
            )
        return [self.slice(i, i + micro_batch_size) for i in range(0, self.batch_size, micro_batch_size)]

    def to_packed(self, *, pad_id: int) -> PackedBatch:
        """The same sequences packed back to back without their trailing padding.

        Each row's tokens are ``input_ids`` plus the last label; the training targets are the tokens the
        loss mask selects (the answers), so the packed batch has exactly the padded batch's loss tokens.
        """
        full = torch.cat((self.input_ids, self.labels[:, -1:]), dim=1)
        targets = torch.cat((torch.zeros_like(self.loss_mask[:, :1]), self.loss_mask), dim=1) > 0
        seqs, masks = [], []
        for ids, tgt in zip(full, targets, strict=True):
            real = (ids != pad_id).nonzero()
            n = int(real.max()) + 1 if real.numel() else 1
            seqs.append(ids[:n])
            masks.append(tgt[:n])
        return PackedBatch.from_sequences(seqs, label_masks=masks)

    def to(self, device: torch.device | str) -> Batch:
        return Batch(
            *(
                t.to(device, non_blocking=True)
                for t in (self.input_ids, self.labels, self.loss_mask, self.position_ids)
            )
        )
