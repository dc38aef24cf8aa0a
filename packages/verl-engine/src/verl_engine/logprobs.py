"""Per-token log-probabilities and entropy from vocab-parallel logits, in bounded memory.

The token dimension is processed ``chunk_size`` tokens at a time in forward and backward, so float32
temporaries stay within about ``2 x chunk_size x V/tp`` elements; the shards' softmax statistics are combined
with one MAX and one SUM all-reduce. Why and how (vocabulary layout, ignored labels, TP backward): the package
README's "Log-probs and entropy".
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from verl_engine import vocab_kernels

__all__ = ["log_probs_from_logits", "vocab_parallel_log_probs_and_entropy"]

# ``(start, end) -> logits[start:end]`` of this rank's vocabulary shard, any float dtype
ChunkLogits = Callable[[int, int], torch.Tensor]


@dataclass(frozen=True)
class LogitChunks:
    """The logits of this rank's vocabulary shard, ``chunk(start, end)`` at a time (a view of stored logits, or
    computed from hidden states by :mod:`verl_engine.fused_head`), with their flat labels ``[T]``. ``source``
    is what they are computed from: its device holds the statistics, its dtype is the gradient's."""

    chunk: ChunkLogits
    vocab_local: int
    labels: torch.Tensor
    source: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return self.labels.shape[0]


def vocab_parallel_log_probs_and_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None = None,
    temperature: float = 1.0,
    compute_entropy: bool = True,
    chunk_size: int = 4096,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probability of each label and entropy of each token's distribution, from vocab-sharded logits.

    Args:
        logits: ``[..., V_local]``, this rank's vocabulary shard (any float dtype; bf16 is the intended case).
            Contiguous logits are used in place; others are copied once by ``reshape`` (in their dtype).
        labels: ``[...]`` integer ids in the GLOBAL vocabulary ``[0, tp * V_local)``; ids outside it are
            ignored (log-probability 0, no gradient through it).
        tp_group: the tensor-parallel group that shards the vocabulary. ``None`` (not torch's default
            group) or a group of size 1 means the logits hold the whole vocabulary.
        temperature: the logits are divided by it before the softmax (verl's convention).
        compute_entropy: skip the entropy (and its statistic and collective share) when False.
        chunk_size: tokens processed at a time; bounds float32 temporaries to ~2 x chunk_size x V_local.

    Returns:
        ``(log_probs, entropy)``, float32 of shape ``[...]``; ``entropy`` is None when not computed.
        Both are differentiable with respect to ``logits``; the gradient comes back in the logits' dtype.
    """
    check_arguments(logits=logits, labels=labels, temperature=temperature, chunk_size=chunk_size)
    lead_shape = logits.shape[:-1]
    flat_logits = logits.reshape(-1, logits.shape[-1])
    flat_labels = labels.reshape(-1).long()
    options = ChunkOptions(tp_group, float(temperature), compute_entropy, int(chunk_size))
    return lead_shaped(_VocabParallelLogProbsEntropy.apply(flat_logits, flat_labels, options), lead_shape)


def log_probs_from_logits(
    logits: torch.Tensor, labels: torch.Tensor, *, temperature: float = 1.0, chunk_size: int = 4096
) -> torch.Tensor:
    """Log-probabilities of ``labels`` from full-vocabulary logits, without a float32 copy of the logits."""
    log_probs, _ = vocab_parallel_log_probs_and_entropy(
        logits, labels, temperature=temperature, compute_entropy=False, chunk_size=chunk_size
    )
    return log_probs


def check_arguments(
    *, logits: torch.Tensor, labels: torch.Tensor, temperature: float, chunk_size: int
) -> None:
    """Fail early with the offending shapes instead of deep inside a gather or a collective."""
    if logits.dim() < 1 or not logits.is_floating_point():
        raise ValueError(
            f"logits must be a floating tensor [..., V_local], got {logits.dtype} {tuple(logits.shape)}"
        )
    if labels.shape != logits.shape[:-1]:
        raise ValueError(
            f"labels shape {tuple(labels.shape)} != logits shape without vocab {tuple(logits.shape[:-1])}"
        )
    if labels.is_floating_point() or labels.is_complex():
        raise ValueError(f"labels must be integer ids, got {labels.dtype}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")


def _tp_rank_and_size(tp_group: dist.ProcessGroup | None) -> tuple[int, int]:
    """This rank's index in the vocabulary split and the split's size (``None`` = no split)."""
    if tp_group is None:
        return 0, 1
    return dist.get_rank(group=tp_group), dist.get_world_size(group=tp_group)


def _scaled_chunk(chunk: torch.Tensor, *, temperature: float) -> torch.Tensor:
    """A fresh float32 copy of ``chunk / temperature``: fresh so later in-place ops never touch the input."""
    scaled = chunk.to(torch.float32, copy=True)
    if temperature != 1.0:
        scaled.div_(temperature)
    return scaled


class _LabelIndex:
    """Where each label sits in this rank's shard: which tokens count, which this rank owns, and the column."""

    def __init__(self, labels: torch.Tensor, *, rank: int, tp_size: int, vocab_local: int) -> None:
        start = rank * vocab_local
        self.valid = (labels >= 0) & (labels < tp_size * vocab_local)
        self.owned = (labels >= start) & (labels < start + vocab_local)
        self.column = torch.where(self.owned, labels - start, torch.zeros_like(labels))


def _shard_statistics(
    chunks: LogitChunks, index: _LabelIndex, *, temperature: float, compute_entropy: bool, chunk_size: int
) -> dict[str, torch.Tensor]:
    """Per-token statistics of this shard, relative to the shard's own max ``m``, one chunk at a time.

    ``sum_exp = sum exp(s - m)``, ``sum_exp_s = sum exp(s - m) (s - m)`` (entropy only) and ``label = s[label]``
    where this rank owns the label, else 0. Shifting by the local max keeps exp in range without a first
    pass for the global max; :func:`_combine_shards` rescales to the global max afterwards. On CUDA the
    statistics come from :mod:`verl_engine.vocab_kernels` (same values, no float32 copy of the chunk).
    """
    num_tokens = chunks.num_tokens
    stats = {
        name: torch.zeros(num_tokens, dtype=torch.float32, device=chunks.source.device)
        for name in ("max", "sum_exp", "sum_exp_s", "label")
    }
    for start in range(0, num_tokens, chunk_size):
        end = min(start + chunk_size, num_tokens)
        chunk = chunks.chunk(start, end)
        if vocab_kernels.kernels_apply(chunk):  # one read of the chunk per statistic pass
            picked = _scaled_chunk(chunk.gather(1, index.column[start:end, None]), temperature=temperature)
            stats["label"][start:end] = torch.where(index.owned[start:end], picked.squeeze(1), 0.0)
            chunk_max, sum_exp, sum_exp_s = vocab_kernels.row_statistics(
                chunk, temperature=temperature, compute_entropy=compute_entropy
            )
            stats["max"][start:end], stats["sum_exp"][start:end] = chunk_max, sum_exp
            if sum_exp_s is not None:
                stats["sum_exp_s"][start:end] = sum_exp_s
            del chunk
            continue
        scaled = _scaled_chunk(chunk, temperature=temperature)
        del chunk
        picked = scaled.gather(1, index.column[start:end, None]).squeeze(1)
        stats["label"][start:end] = torch.where(index.owned[start:end], picked, torch.zeros_like(picked))
        chunk_max = scaled.amax(dim=1)
        stats["max"][start:end] = chunk_max
        scaled.sub_(chunk_max[:, None])
        exp = torch.exp(scaled)
        stats["sum_exp"][start:end] = exp.sum(dim=1)
        if compute_entropy:
            stats["sum_exp_s"][start:end] = exp.mul_(scaled).sum(dim=1)
        del scaled, exp
    return stats


def _combine_shards(
    stats: dict[str, torch.Tensor], *, tp_group: dist.ProcessGroup | None, tp_size: int
) -> dict[str, torch.Tensor]:
    """Global statistics relative to the global max ``M``: one MAX and one SUM all-reduce over the group.

    A shard's sums move from its max ``m`` to ``M`` by the factor ``exp(m - M)``; ``sum exp(s - M) (s - M)``
    also gains ``(m - M) sum exp(s - M)``. Only the owning rank has a nonzero label logit, so SUM picks it.
    """
    if tp_size == 1:
        return stats
    global_max = stats["max"].clone()
    dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=tp_group)
    shift = stats["max"] - global_max
    scale = torch.exp(shift)
    sums = torch.stack(
        [
            stats["sum_exp"] * scale,
            scale * (stats["sum_exp_s"] + shift * stats["sum_exp"]),
            stats["label"],
        ]
    )
    dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=tp_group)
    return {"max": global_max, "sum_exp": sums[0], "sum_exp_s": sums[1], "label": sums[2]}


def _log_probs_and_entropy(
    stats: dict[str, torch.Tensor], index: _LabelIndex
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(log_probs, entropy, log-sum-exp)`` from the global statistics.

    With ``S = sum exp(s - M)`` and ``E = sum exp(s - M) (s - M)``: ``logsumexp(s) = M + log S``,
    ``log p(label) = s[label] - logsumexp(s)`` and ``H = logsumexp(s) - sum p s = log S - E / S``.
    """
    log_sum = torch.log(stats["sum_exp"])
    lse = stats["max"] + log_sum
    log_probs = torch.where(index.valid, stats["label"] - lse, torch.zeros_like(lse))
    entropy = log_sum - stats["sum_exp_s"] / stats["sum_exp"]
    return log_probs, entropy, lse


def _chunk_grad(
    scaled: torch.Tensor, *, rows: vocab_kernels.RowGrads, label_column: torch.Tensor, temperature: float
) -> torch.Tensor:
    """Gradient of one chunk's logits, computed in place in ``scaled`` (a float32 ``logits / temperature``).

    With ``p = softmax(s)``, ``g`` the log-prob grad and ``h`` the entropy grad (per token):
    ``d log p(label) / d s_j = 1[j = label] - p_j`` and ``dH / d s_j = -p_j (s_j - sum_k p_k s_k)
    = -p_j (log p_j + H)``. So ``d/d s_j = -p_j (g + h (log p_j + H)) + g 1[j = label]``, then ``/ temperature``
    for ``s = z / temperature``. ``g`` is already zero for ignored labels; ``label_column`` is -1 where this
    rank does not own the label.
    """
    lse, entropy, grad_log_probs, grad_entropy = rows
    log_p = scaled.sub_(lse[:, None])
    p = torch.exp(log_p)
    if grad_entropy is not None:
        factor = log_p.add_(entropy[:, None]).mul_(grad_entropy[:, None])  # type: ignore[index]  # saved when h flows
        if grad_log_probs is not None:
            factor.add_(grad_log_probs[:, None])
    else:
        factor = log_p.copy_(grad_log_probs[:, None].expand_as(log_p))  # type: ignore[index]  # g or h is set
    grad = p.mul_(factor).neg_()
    del log_p, factor
    if grad_log_probs is not None:
        owned = label_column >= 0
        picked = torch.where(owned, grad_log_probs, torch.zeros_like(grad_log_probs))
        grad.scatter_add_(1, label_column.clamp(min=0)[:, None], picked[:, None])
    if temperature != 1.0:
        grad.div_(temperature)
    return grad


class ChunkOptions(NamedTuple):
    """The non-tensor arguments of both autograd functions (one ``apply`` argument)."""

    tp_group: dist.ProcessGroup | None
    temperature: float
    compute_entropy: bool
    chunk_size: int


def chunked_forward(
    ctx: Any, chunks: LogitChunks, options: ChunkOptions, *, inputs: tuple[torch.Tensor, ...]
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The forward shared by the stored-logits and the fused-head autograd functions: ``log_probs`` or
    ``(log_probs, entropy)``.

    Saves ``inputs`` then the per-token log-sum-exp and entropy (what :func:`chunked_backward` takes as
    ``saved``) and records on ``ctx`` what backward needs besides the saved tensors.
    """
    tp_group, temperature, compute_entropy, chunk_size = options
    rank, tp_size = _tp_rank_and_size(tp_group)
    index = _LabelIndex(chunks.labels, rank=rank, tp_size=tp_size, vocab_local=chunks.vocab_local)
    stats = _shard_statistics(
        chunks, index, temperature=temperature, compute_entropy=compute_entropy, chunk_size=chunk_size
    )
    stats = _combine_shards(stats, tp_group=tp_group, tp_size=tp_size)
    log_probs, entropy, lse = _log_probs_and_entropy(stats, index)
    ctx.rank, ctx.tp_size = rank, tp_size
    ctx.temperature, ctx.compute_entropy, ctx.chunk_size = temperature, compute_entropy, chunk_size
    # An unused output's grad stays None instead of a zeros tensor: backward then skips its term.
    ctx.set_materialize_grads(False)
    if not compute_entropy:
        ctx.save_for_backward(*inputs, lse, None)
        return log_probs
    # A private copy of the entropy ([T] floats): the caller may then modify the output in place.
    ctx.save_for_backward(*inputs, lse, entropy.clone())
    return log_probs, entropy


def chunked_backward(
    ctx: Any,
    chunks: LogitChunks,
    *,
    saved: tuple[torch.Tensor, torch.Tensor | None],
    grad_outputs: tuple[torch.Tensor | None, ...],
    chunk_out: ChunkLogits | None = None,
    overwrite_chunk: bool = False,
) -> Iterator[tuple[int, int, torch.Tensor]]:
    """``(start, end, gradient of logits[start:end])`` chunk by chunk; nothing when no grad flows. ``saved``:
    the log-sum-exp and entropy :func:`chunked_forward` saved.

    Computed in float32 and rounded once to ``chunks.source``'s dtype. ``chunk_out(start, end)`` names where the
    chunk's gradient may be written (the caller's gradient buffer); ``overwrite_chunk`` lets it replace the
    chunk ``chunks.chunk`` returned (a fresh recomputation); otherwise a new tensor is made. On CUDA one kernel
    (:mod:`verl_engine.vocab_kernels`) reads the chunk and writes the gradient there; elsewhere torch ops in a
    float32 copy.
    """
    lse, entropy = saved
    grad_log_probs = grad_outputs[0]
    grad_entropy = grad_outputs[1] if ctx.compute_entropy else None
    if grad_log_probs is None and grad_entropy is None:
        return
    index = _LabelIndex(chunks.labels, rank=ctx.rank, tp_size=ctx.tp_size, vocab_local=chunks.vocab_local)
    if grad_log_probs is not None:
        grad_log_probs = torch.where(index.valid, grad_log_probs.float(), torch.zeros_like(lse))
    if grad_entropy is not None:
        # unit stride for the kernels: a gradient can arrive as a strided view (the engine merges log-probs
        # and entropy as two columns of one tensor, so each comes back with stride 2)
        grad_entropy = grad_entropy.float().contiguous()
    rows = vocab_kernels.RowGrads(lse, entropy, grad_log_probs, grad_entropy)
    label_column = torch.where(index.owned, index.column, -1)  # -1 where this rank does not own the label
    grad_dtype, temperature = chunks.source.dtype, ctx.temperature
    for start in range(0, chunks.num_tokens, ctx.chunk_size):
        end = min(start + ctx.chunk_size, chunks.num_tokens)
        chunk = chunks.chunk(start, end)
        part, columns = rows.rows(start, end), label_column[start:end]
        if vocab_kernels.kernels_apply(chunk):
            out = chunk_out(start, end) if chunk_out is not None else chunk if overwrite_chunk else None
            if out is None or out.dtype != grad_dtype:
                out = torch.empty(chunk.shape, dtype=grad_dtype, device=chunk.device)
            grad = vocab_kernels.logits_grad(
                chunk, out=out, rows=part, label_column=columns, temperature=temperature
            )
            yield start, end, grad
            continue
        grad = _chunk_grad(
            _scaled_chunk(chunk, temperature=temperature),
            rows=part,
            label_column=columns,
            temperature=temperature,
        )
        del chunk
        yield start, end, grad.to(grad_dtype)


def lead_shaped(
    outputs: torch.Tensor | tuple[torch.Tensor, torch.Tensor], lead_shape: torch.Size
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(log_probs, entropy or None)`` of an autograd function's flat outputs, in the inputs' leading shape."""
    if isinstance(outputs, torch.Tensor):
        return outputs.view(lead_shape), None
    log_probs, entropy = outputs
    return log_probs.view(lead_shape), entropy.view(lead_shape)


def _stored_chunks(logits: torch.Tensor, labels: torch.Tensor) -> LogitChunks:
    return LogitChunks(
        chunk=lambda start, end: logits[start:end], vocab_local=logits.shape[-1], labels=labels, source=logits
    )


class _VocabParallelLogProbsEntropy(torch.autograd.Function):
    """Chunked forward/backward; saves the input logits (no copy), labels and per-token float32 statistics."""

    @staticmethod
    def forward(
        ctx: Any, logits: torch.Tensor, labels: torch.Tensor, options: ChunkOptions
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return chunked_forward(ctx, _stored_chunks(logits, labels), options, inputs=(logits, labels))

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        logits, labels, lse, entropy = ctx.saved_tensors
        grad_logits = torch.empty_like(logits, memory_format=torch.contiguous_format)
        written = False
        chunks = _stored_chunks(logits, labels)
        for start, end, chunk_grad in chunked_backward(
            ctx,
            chunks,
            saved=(lse, entropy),
            grad_outputs=grad_outputs,
            chunk_out=lambda s, e: grad_logits[s:e],
        ):
            written = True
            if chunk_grad.data_ptr() != grad_logits[start:end].data_ptr():
                grad_logits[start:end].copy_(chunk_grad)
            del chunk_grad
        return (grad_logits if written else None), None, None
