"""A deterministic arithmetic SFT data set and a character tokenizer: nothing to download.

Each sequence packs problems like ``37+45=82`` (one per line) up to the sequence length. The loss is
taken on the answer tokens (what follows ``=``, newline included), as in SFT where only the response
is trained. A model that learns the format and the arithmetic drives the loss down steadily, which
makes it a good smoke test of a training stack.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from verl_engine.packed import PackedBatch

__all__ = ["ArithmeticDataset", "Batch", "CharTokenizer"]


class CharTokenizer:
    """Character-level tokenizer over digits, ``+-*=`` and newline, plus pad/bos/eos."""

    SPECIALS = ("<pad>", "<bos>", "<eos>")
    CHARS = "0123456789+-*=\n"

    def __init__(self) -> None:
        self.itos: list[str] = [*self.SPECIALS, *self.CHARS]
        self.stoi = {s: i for i, s in enumerate(self.itos)}
        self.pad_id, self.bos_id, self.eos_id = 0, 1, 2

    @property
    def vocab_size(self) -> int:
        return len(self.itos)

    def padded_vocab_size(self, multiple: int) -> int:
        """Vocab size rounded up to ``multiple`` (megatron-core shards the vocab over TP ranks)."""
        return -(-self.vocab_size // multiple) * multiple

    def encode(self, text: str) -> list[int]:
        try:
            return [self.stoi[c] for c in text]
        except KeyError as err:
            raise ValueError(
                f"character {err.args[0]!r} is not in the arithmetic vocabulary {self.CHARS!r}"
            ) from None

    def decode(self, ids: list[int]) -> str:
        return "".join(self.itos[i] for i in ids if i >= len(self.SPECIALS))


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


class ArithmeticDataset:
    """Infinite, deterministic stream of global batches: batch ``step`` depends only on (seed, step)."""

    def __init__(self, *, seq_length: int, seed: int, tokenizer: CharTokenizer | None = None) -> None:
        self.seq_length = seq_length
        self.seed = seed
        self.tokenizer = tokenizer or CharTokenizer()

    @staticmethod
    def _problem(rng: random.Random) -> tuple[str, str]:
        op = rng.choice("+-*")
        if op == "*":
            a, b = rng.randint(0, 12), rng.randint(0, 12)
            result = a * b
        else:
            a, b = rng.randint(0, 99), rng.randint(0, 99)
            result = a + b if op == "+" else a - b
        return f"{a}{op}{b}=", f"{result}\n"

    def _sequence(self, rng: random.Random) -> tuple[list[int], list[int]]:
        tok = self.tokenizer
        ids, is_answer = [tok.bos_id], [0]
        while True:
            prompt, answer = self._problem(rng)
            p, a = tok.encode(prompt), tok.encode(answer)
            if len(ids) + len(p) + len(a) > self.seq_length + 1:
                break
            ids += p + a
            is_answer += [0] * len(p) + [1] * len(a)
        pad = self.seq_length + 1 - len(ids)
        return ids + [tok.pad_id] * pad, is_answer + [0] * pad

    def global_batch(self, *, step: int, batch_size: int) -> Batch:
        """The ``step``-th global batch of ``batch_size`` sequences (identical on every rank)."""
        rng = random.Random(self.seed * 1_000_003 + step)
        rows = [self._sequence(rng) for _ in range(batch_size)]
        ids = torch.tensor([r[0] for r in rows], dtype=torch.long)
        answer = torch.tensor([r[1] for r in rows], dtype=torch.float32)
        positions = torch.arange(self.seq_length, dtype=torch.long).expand(batch_size, -1).contiguous()
        return Batch(
            input_ids=ids[:, :-1].contiguous(),
            labels=ids[:, 1:].contiguous(),
            loss_mask=answer[:, 1:].contiguous(),
            position_ids=positions,
        )
