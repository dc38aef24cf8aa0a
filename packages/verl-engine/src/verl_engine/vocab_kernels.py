"""The softmax statistics and the logits' gradient over the vocabulary as Triton kernels (CUDA).

Each row is one program that reads the logits (twice in forward, once in backward) and writes the gradient
once, all arithmetic in float32 registers; the numerics are those of :mod:`verl_engine.logprobs`' torch path
(only the float32 summation order differs). Why: the package README's "Log-probs and entropy".
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, NamedTuple

import torch

from verl_mcore_utils.triton_support import KernelSwitch, triton_runs_on

__all__ = ["RowGrads", "kernels_apply", "logits_grad", "row_statistics", "torch_ops_only"]

_BLOCK = 4096
_SWITCH = KernelSwitch()


class RowGrads(NamedTuple):
    """Per-row inputs of the logits' gradient, float32 ``[rows]``: log-sum-exp, entropy (None: not computed)
    and the incoming gradients of the log-probability ``g`` and of the entropy ``h`` (None: absent)."""

    lse: torch.Tensor
    entropy: torch.Tensor | None
    grad_log_probs: torch.Tensor | None
    grad_entropy: torch.Tensor | None

    def rows(self, start: int, end: int) -> RowGrads:
        return RowGrads(*(None if t is None else t[start:end] for t in self))  # type: ignore[arg-type]  # lse is set


def torch_ops_only() -> contextlib.AbstractContextManager[None]:
    """Within the block the torch path runs on CUDA too: the reference of the tests and benchmarks."""
    return _SWITCH.off()


def kernels_apply(logits: torch.Tensor) -> bool:
    """Whether the kernels can take ``logits`` (``[rows, V]``, CUDA, unit stride along the vocabulary)."""
    return (
        _SWITCH.enabled
        and triton_runs_on(logits)
        and logits.dim() == 2
        and logits.stride(1) == 1
        and logits.dtype in (torch.bfloat16, torch.float16, torch.float32)
    )


@functools.cache
def _kernels() -> tuple[Any, Any]:
    import triton
    import triton.language as tl

    @triton.jit
    def stats_kernel(
        x_ptr, stride_x, vocab, temperature, max_ptr, sum_ptr, sum_s_ptr,
        ENTROPY: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        base = x_ptr + row * stride_x
        cols = tl.arange(0, BLOCK)
        m = tl.full([BLOCK], float("-inf"), tl.float32)
        for off in range(0, vocab, BLOCK):
            mask = off + cols < vocab
            x = tl.load(base + off + cols, mask=mask, other=float("-inf")).to(tl.float32) / temperature
            m = tl.maximum(m, x)
        row_max = tl.max(m, axis=0)
        s = tl.zeros([BLOCK], tl.float32)
        e = tl.zeros([BLOCK], tl.float32)
        for off in range(0, vocab, BLOCK):
            mask = off + cols < vocab
            x = tl.load(base + off + cols, mask=mask, other=0.0).to(tl.float32) / temperature
            d = x - row_max
            ex = tl.where(mask, tl.exp(d), 0.0)
            s += ex
            if ENTROPY:
                e += ex * d
        tl.store(max_ptr + row, row_max)
        tl.store(sum_ptr + row, tl.sum(s, axis=0))
        if ENTROPY:
            tl.store(sum_s_ptr + row, tl.sum(e, axis=0))

    @triton.jit
    def grad_kernel(
        x_ptr, out_ptr, stride_x, stride_o, vocab, temperature, lse_ptr, entropy_ptr, g_ptr, h_ptr, col_ptr,
        HAS_G: tl.constexpr, HAS_H: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        lse = tl.load(lse_ptr + row)
        g = 0.0
        if HAS_G:
            g = tl.load(g_ptr + row)
        if HAS_H:
            h = tl.load(h_ptr + row)
            entropy = tl.load(entropy_ptr + row)
        label_col = tl.load(col_ptr + row)
        cols = tl.arange(0, BLOCK)
        for off in range(0, vocab, BLOCK):
            c = off + cols
            mask = c < vocab
            x = tl.load(x_ptr + row * stride_x + c, mask=mask, other=0.0).to(tl.float32) / temperature
            log_p = x - lse
            p = tl.exp(log_p)
            if HAS_H:
                factor = h * (log_p + entropy) + g
            else:
                factor = tl.zeros([BLOCK], tl.float32) + g
            grad = -p * factor
            grad = tl.where(c == label_col, grad + g, grad) / temperature
            tl.store(out_ptr + row * stride_o + c, grad.to(out_ptr.dtype.element_ty), mask=mask)

    return stats_kernel, grad_kernel


def row_statistics(
    logits: torch.Tensor, *, temperature: float, compute_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Per row of ``s = logits / temperature``: ``max``, ``sum exp(s - max)`` and (entropy)
    ``sum exp(s - max) (s - max)``, float32 ``[rows]`` each."""
    stats_kernel, _ = _kernels()
    rows, vocab = logits.shape
    out = torch.empty((3 if compute_entropy else 2, rows), dtype=torch.float32, device=logits.device)
    if rows:
        stats_kernel[(rows,)](
            logits, logits.stride(0), vocab, float(temperature), out[0], out[1],
            out[2] if compute_entropy else out[1], ENTROPY=compute_entropy, BLOCK=_BLOCK, num_warps=8,
        )  # fmt: skip
    return out[0], out[1], (out[2] if compute_entropy else None)


def logits_grad(
    logits: torch.Tensor, *, out: torch.Tensor, rows: RowGrads, label_column: torch.Tensor, temperature: float
) -> torch.Tensor:
    """Gradient of ``[rows, V]`` logits into ``out`` (may be ``logits`` itself: each element is read
    before it is written, by the same program).

    ``d/d s_j = -p_j (g + h (log p_j + H)) + g 1[j = label]``, divided by ``temperature``; ``g`` / ``h``
    are the per-row gradients of the log-probability / entropy in ``rows``, ``label_column`` the label's
    column in this shard or -1 where this rank does not own it.
    """
    _, grad_kernel = _kernels()
    num_rows, vocab = logits.shape
    if out.shape != logits.shape or out.stride(1) != 1:
        raise ValueError(
            f"out must be a [rows, V] tensor with unit vocabulary stride, got {tuple(out.shape)}"
        )
    strided = [
        name
        for name, t in (*zip(RowGrads._fields, rows, strict=True), ("label_column", label_column))
        if t is not None and t.shape[0] > 1 and t.stride(0) != 1
    ]
    if strided:  # the kernel reads them at ``ptr + row``: a strided view would give other rows' values
        raise ValueError(f"per-row inputs must have unit stride (pass .contiguous()); {strided} do not")
    if num_rows:
        lse, entropy, g, h = rows
        grad_kernel[(num_rows,)](
            logits, out, logits.stride(0), out.stride(0), vocab, float(temperature), lse,
            entropy if entropy is not None else lse, g if g is not None else lse, h if h is not None else lse,
            label_column, HAS_G=g is not None, HAS_H=h is not None, BLOCK=_BLOCK, num_warps=8,
        )  # fmt: skip
    return out
