"""The attention kernels of one rank once K and V are in place: dense fused SDPA, torch's varlen kernel,
and the per-sequence SDPA reference path; :func:`pick_kernel` chooses, :func:`attend` runs the choice."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import itertools
import logging
from typing import Any, cast

import torch
import torch.nn.functional as F

from verl_dyncp.layout import ThdLayout
from verl_mcore_utils.transfer import to_device_async

__all__ = ["DENSE_MIN_TOKENS", "DENSE_WINDOW_MULTIPLE", "attend", "pick_kernel", "varlen_kernel_available"]

logger = logging.getLogger(__name__)


@functools.cache
def _varlen_fn() -> Any:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


@functools.cache
def _varlen_params() -> frozenset[str]:
    """The keyword names this torch release's varlen_attn takes (read once: the call runs per layer)."""
    return frozenset(inspect.signature(_varlen_fn()).parameters)


def varlen_kernel_available() -> bool:
    """True when the installed torch has ``torch.nn.attention.varlen.varlen_attn``."""
    return _varlen_fn() is not None


_warned: set[str] = set()


def _log_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        logger.warning(message)


def _varlen_call(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    max_k: int,
    *,
    scale: float | None,
) -> torch.Tensor:
    """torch's varlen kernel, causal and bottom-right aligned, with the arguments this torch release takes."""
    fn = _varlen_fn()
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()  # k/v may be views of the gathered kv buffer
    params = _varlen_params()
    kwargs: dict[str, Any] = {"scale": scale}
    if "window_size" in params:
        kwargs["window_size"] = (-1, 0)
    else:  # older releases spelled causality as a flag
        kwargs["is_causal"] = True
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:
            reps = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(reps, dim=1), v.repeat_interleave(reps, dim=1)
    return fn(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    layout: ThdLayout,
    path: str,
    scale: float | None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Causal attention of this rank's queries; under CP ``k`` / ``v`` are already gathered, in the order the
    path reads them (the key stream for varlen, the whole batch for SDPA).

    ``path``: "dense" (CP 1: a dense fused call per long sequence, varlen per run of short ones), "varlen"
    (every chunk bottom-right aligned on its key prefix) or "sdpa" (the reference path).
    """
    if path == "dense":
        return _segmented_attention(q, k, v, layout=layout, scale=scale)
    if path == "varlen":
        cu_k = layout.cu_seqlens_q if layout.cp_size == 1 else layout.cu_seqlens_k
        return _varlen_call(
            q, k, v, layout.cu_seqlens_q, cu_k, layout.max_seqlen_q, layout.max_seqlen_k, scale=scale
        )
    return _sdpa_attention(q, k, v, layout=layout, scale=scale, dropout_p=dropout_p)


# Sequences at least this long take one dense SDPA call each (cuDNN's fused attention on Hopper), the rest
# of a row one varlen call per run of shorter sequences: the dense call is faster per long sequence, short
# sequences are cheaper together in one varlen call (docs/benchmarks.md).
DENSE_MIN_TOKENS = 2048
# Dense windows are rounded up to this many tokens where the row allows, so that cuDNN, which builds one
# execution plan per shape, sees few distinct shapes when lengths vary from batch to batch.
DENSE_WINDOW_MULTIPLE = 256


@dataclasses.dataclass(frozen=True)
class _DenseSegment:
    start: int
    length: int  # the sequence's (padded) tokens
    window: int  # tokens given to the kernel: length, rounded up within the row


@dataclasses.dataclass(frozen=True)
class _VarlenSegment:
    start: int
    end: int
    cu_seqlens: torch.Tensor
    max_seqlen: int


def _segment_plan(layout: ThdLayout) -> tuple[Any, ...]:
    """Split a CP-1 row into dense segments (long sequences) and varlen runs (the rest), once per micro-batch.

    A dense window may reach past its sequence into the next tokens of the row: under causal masking a
    query never sees later keys, and the extra query rows are cut from the output, so their gradient is
    zero and gives the keys they saw nothing. No sequence's result depends on the rounding.
    """
    if layout.segment_plan is not None:
        return layout.segment_plan
    total = layout.num_local_tokens
    plan: list[Any] = []
    run: list[tuple[int, int]] = []

    def close_run() -> None:
        if run:
            start = run[0][0]
            offsets = [0, *itertools.accumulate(n for _, n in run)]
            # from page-locked memory, queued on the stream: a plain copy would make the host wait for the GPU
            cu = to_device_async(torch.tensor(offsets, dtype=torch.int32), layout.cu_seqlens_q.device)
            plan.append(_VarlenSegment(start, start + offsets[-1], cu, max(n for _, n in run)))
            run.clear()

    for start, length in zip(layout.local_starts, layout.padded_lens, strict=True):
        if length >= DENSE_MIN_TOKENS:
            close_run()
            rounded = -(-length // DENSE_WINDOW_MULTIPLE) * DENSE_WINDOW_MULTIPLE
            plan.append(_DenseSegment(start, length, min(rounded, total - start)))
        else:
            run.append((start, length))
    close_run()
    object.__setattr__(layout, "segment_plan", tuple(plan))  # a cache on the frozen layout, like rope_cache
    return cast("tuple[Any, ...]", layout.segment_plan)  # just set (mypy keeps the None narrowing)


@functools.cache
def _dense_backends() -> list[Any]:
    """The fused SDPA kernels a dense call may use, cuDNN first (built once: this runs per layer and call)."""
    from torch.nn.attention import SDPBackend

    return [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]


def _segmented_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    layout: ThdLayout,
    scale: float | None,
) -> torch.Tensor:
    """CP size 1: dense fused SDPA per long sequence, varlen per run of short ones, outputs in row order."""
    from torch.nn.attention import sdpa_kernel

    gqa = k.shape[1] != q.shape[1]
    outputs = []
    for seg in _segment_plan(layout):
        if isinstance(seg, _DenseSegment):
            window = slice(seg.start, seg.start + seg.window)
            qi, ki, vi = (t[window].transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, heads, s, d] views
            with sdpa_kernel(_dense_backends()):
                out = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale, enable_gqa=gqa)
            outputs.append(out.squeeze(0).transpose(0, 1)[: seg.length])
        else:
            part = slice(seg.start, seg.end)
            outputs.append(
                _varlen_call(
                    q[part],
                    k[part],
                    v[part],
                    seg.cu_seqlens,
                    seg.cu_seqlens,
                    seg.max_seqlen,
                    seg.max_seqlen,
                    scale=scale,
                )
            )
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=0)


def _sdpa_attention(
    q: torch.Tensor,
    k_full: torch.Tensor,
    v_full: torch.Tensor,
    *,
    layout: ThdLayout,
    scale: float | None,
    dropout_p: float,
) -> torch.Tensor:
    """Reference path: one SDPA call per sequence with an explicit position mask (any device, any dtype)."""
    outputs = []
    gqa = k_full.shape[1] != q.shape[1]
    for p, ls, fs in zip(layout.padded_lens, layout.local_starts, layout.full_starts, strict=True):
        n_local = p // layout.cp_size
        q_i = q[ls : ls + n_local].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        if layout.cp_size == 1:
            k_i, v_i = (t[fs : fs + p].transpose(0, 1).unsqueeze(0) for t in (k_full, v_full))
            out = F.scaled_dot_product_attention(
                q_i, k_i, v_i, dropout_p=dropout_p, is_causal=True, scale=scale, enable_gqa=gqa
            )
        else:
            h = p // (2 * layout.cp_size)
            k_end = p - layout.cp_rank * h  # the last key any local query of this sequence sees
            k_i, v_i = (t[fs : fs + k_end].transpose(0, 1).unsqueeze(0) for t in (k_full, v_full))
            q_pos = layout.position_ids[ls : ls + n_local]
            mask = torch.arange(k_end, device=q.device)[None, :] <= q_pos[:, None]
            out = F.scaled_dot_product_attention(
                q_i, k_i, v_i, attn_mask=mask, dropout_p=dropout_p, scale=scale, enable_gqa=gqa
            )
        outputs.append(out.squeeze(0).transpose(0, 1))
    return torch.cat(outputs, dim=0)


def pick_kernel(q: torch.Tensor, *, kernel: str = "auto", dropout_p: float = 0.0) -> str:
    """ "varlen" (torch's varlen flash kernel) where it applies, else "sdpa" (logged once on CUDA).

    varlen_attn needs CUDA, fp16/bf16 and no dropout; ``kernel`` "sdpa" or "varlen" forces a path
    ("varlen" raises when it cannot run).
    """
    if kernel == "sdpa":
        return "sdpa"
    fast_ok = q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and dropout_p == 0.0
    if kernel in ("varlen", "cudnn"):
        if not (fast_ok and varlen_kernel_available()):
            raise RuntimeError(
                f"kernel={kernel!r} needs torch.nn.attention.varlen, a CUDA tensor in fp16/bf16 and no dropout"
            )
        return "varlen"
    if fast_ok and varlen_kernel_available():
        return "varlen"
    if q.is_cuda:
        _log_once(
            "verl_dyncp attention: using the per-sequence SDPA path on CUDA (varlen_attn available="
            f"{varlen_kernel_available()}, dtype={q.dtype}, dropout={dropout_p}); expect lower throughput"
        )
    return "sdpa"
