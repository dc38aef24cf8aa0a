"""The demo data of ``verl-engine train``: a deterministic arithmetic SFT data set and a character tokenizer.

Each sequence packs problems like ``37+45=82`` (one per line) up to the sequence length. The loss is
taken on the answer tokens (what follows ``=``, newline included), as in SFT where only the response
is trained. A model that learns the format and the arithmetic drives the loss down steadily, which
makes it a good smoke test of a training stack.
"""

from __future__ import annotations

import random

import torch

__all__ = ["ArithmeticDataset", "CharTokenizer"]


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

    def global_batch(self, *, step: int, batch_size: int) -> dict[str, torch.Tensor]:
        """The ``step``-th global batch of ``batch_size`` sequences (identical on every rank), in verl's layout.

        Each row is ``<bos>`` as the prompt and the problems as the response (right-padded): ``input_ids`` /
        ``attention_mask`` ``[B, 1 + R]``, ``response_mask`` ``[B, R]`` marking the answer tokens, the
        tokens the loss is taken on.
        """
        rng = random.Random(self.seed * 1_000_003 + step)
        rows = [self._sequence(rng) for _ in range(batch_size)]
        ids = torch.tensor([r[0] for r in rows], dtype=torch.long)
        answer = torch.tensor([r[1] for r in rows], dtype=torch.long)
        valid = ids != self.tokenizer.pad_id
        return {
            "input_ids": ids,
            "attention_mask": valid.long(),
            "response_mask": answer[:, 1:].contiguous(),
        }
