"""How a call's sequences are cut into micro-batches (verl's ``use_dynamic_bsz`` / ``micro_batch_size_per_gpu``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from verl_dyncp.packing import pack_micro_batches
from verl_engine.packed import CPLayout, split_packed_micro_batches

__all__ = ["MicroBatching", "split_to_multiple"]


@dataclass(frozen=True)
class MicroBatching:
    """How a call's sequences are cut into micro-batches (verl's keys of the role / engine section).

    ``use_dynamic_bsz``: micro-batches of at most ``max_token_len_per_gpu`` tokens per rank of the pool
    (first-fit decreasing by length; under dynamic CP packed so that each runs at the CP size its longest
    sequence needs, :func:`verl_dyncp.packing.pack_micro_batches`); else ``micro_batch_size_per_gpu``
    sequences per rank, in input order.
    """

    use_dynamic_bsz: bool
    max_token_len_per_gpu: int | None = None
    micro_batch_size_per_gpu: int | None = None

    def __post_init__(self) -> None:
        if self.use_dynamic_bsz and not (self.max_token_len_per_gpu or 0) > 0:
            raise ValueError(
                f"use_dynamic_bsz needs max_token_len_per_gpu > 0, got {self.max_token_len_per_gpu}"
            )
        if not self.use_dynamic_bsz and not (self.micro_batch_size_per_gpu or 0) > 0:
            raise ValueError(
                "micro_batch_size_per_gpu must be > 0 without use_dynamic_bsz, got"
                f" {self.micro_batch_size_per_gpu}"
            )

    def split(
        self,
        seq_lens: tuple[int, ...],
        *,
        pool: int,
        groups_per_pool: int,
        cp: tuple[CPLayout, Any] | None = None,
    ) -> list[tuple[int, ...]]:
        """Sequence indices of every micro-batch (the same on every rank: it depends on lengths only).

        ``cp``: the engine's CP layout and verl-dyncp workload model; under dynamic CP with ``use_dynamic_bsz``
        the micro-batches are packed for the planner (see the class).
        """
        if self.use_dynamic_bsz:
            assert self.max_token_len_per_gpu is not None
            if cp is not None and cp[0].dynamic:
                assert cp[0].max_seqlen_per_dp_cp_rank is not None
                return pack_micro_batches(
                    seq_lens,
                    dp_cp_size=pool,
                    max_tokens_per_rank=self.max_token_len_per_gpu,
                    max_seqlen_per_dp_cp_rank=cp[0].max_seqlen_per_dp_cp_rank,
                    workload=cp[1],
                )
            return split_packed_micro_batches(seq_lens, max_tokens=self.max_token_len_per_gpu * pool)
        assert self.micro_batch_size_per_gpu is not None
        per = self.micro_batch_size_per_gpu * groups_per_pool
        return [tuple(range(s, min(s + per, len(seq_lens)))) for s in range(0, len(seq_lens), per)]


def split_to_multiple(splits: list[tuple[int, ...]], *, multiple: int) -> list[tuple[int, ...]]:
    """Halve the largest micro-batches until their number is a multiple of ``multiple``.

    megatron-core's interleaved (virtual pipeline) schedule runs micro-batches in groups of the pipeline
    size and refuses a count that is not a multiple of it. Smaller micro-batches change nothing but
    memory and speed (losses are normalised over the whole call), so the engine splits rather than fail.
    """
    out = [tuple(s) for s in splits]
    while len(out) % multiple:
        largest = max(range(len(out)), key=lambda i: len(out[i]))
        if len(out[largest]) < 2:
            raise ValueError(
                f"virtual pipeline stages need a multiple of pipeline_model_parallel_size={multiple} micro-batches"
                f" (megatron-core's interleaved schedule), but this call has only {sum(map(len, out))} sequences in"
                f" {len(out)} micro-batches; give at least {multiple} sequences per call or set"
                " virtual_pipeline_model_parallel_size=null"
            )
        half = len(out[largest]) // 2
        out[largest : largest + 1] = [out[largest][:half], out[largest][half:]]
    return out
