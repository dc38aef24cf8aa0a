"""One CUDA graph of a megatron-core decoder's forward + backward, replayed for every CP-1 micro-batch that fits.

Why: at Megatron-LM's dynamic-CP workload shape the eager decoder is launch-bound (51.6 ms eager against
15.2 ms replayed, docs/benchmarks.md). :mod:`verl_dyncp.graph_layout` pads each micro-batch to fixed
``GraphSlots`` and passes its layout as tensors; this module captures the decoder once over those inputs with
``torch.cuda.make_graphed_callables`` and, per micro-batch, pads the hidden states, copies the layout in and
replays. Outputs and input gradients of the micro-batch's own rows come back; the padding rows are cut.

Scope, stated so that nothing is silently wrong: CP size 1, verl-dyncp's attention (the varlen kernel), one
micro-batch in flight, no dropout RNG inside the graph unless megatron-core's tracker is graph-safe.

Decoders wrapped for megatron-core DDP (parameters with ``main_grad``) are refused. Measured: capturing the
backward of verl-engine's DDP-wrapped decoder failed with ``cudaErrorStreamCaptureImplicit`` ("operation would
make the legacy stream depend on a capturing blocking stream"; 1 x H200, megatron-core 0.19.2, torch 2.11). The
likely cause, which torch's AccumulateGrad stream warning names: DDP keeps each parameter's AccumulateGrad node
alive (its gradient hooks hang there), created on the legacy default stream. Its fused weight-gradient
accumulation also marks each weight from Python in every backward (``grad_added_to_main_grad``), which a
replay would not redo.

A graph reads parameters at the addresses of its capture: a call after they moved (an offload and onload) is
an error naming the fix (:meth:`GraphedDecoder.recapture`), checked on every call.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from verl_dyncp.graph_layout import GraphSlots, graph_packed_seq_params, pad_layout_to_slots
from verl_dyncp.layout import thd_layout

__all__ = ["GraphedDecoder"]


class _DecoderOverGraphInputs(torch.nn.Module):
    """The decoder as a function of tensors only: hidden states and the padded layout (what a graph takes).

    ``forward`` is the decoder's own forward, called directly (a caller that replaced ``decoder.forward`` with
    a dispatcher passes the original, so that the graph does not re-enter the dispatcher).
    """

    def __init__(self, decoder: torch.nn.Module, slots: GraphSlots, forward: Any) -> None:
        super().__init__()
        self.decoder, self.slots, self._decoder_forward = decoder, slots, forward

    def forward(
        self, hidden: torch.Tensor, cu_seqlens: torch.Tensor, position_ids: torch.Tensor, valid: torch.Tensor
    ) -> torch.Tensor:
        # built on every call (warm-up, capture): a fresh layout, so RoPE tables are computed in the graph
        params = graph_packed_seq_params(
            cu_seqlens=cu_seqlens, position_ids=position_ids, valid=valid, slots=self.slots
        )
        return self._decoder_forward(hidden_states=hidden, attention_mask=None, packed_seq_params=params)


class GraphedDecoder:
    """A megatron-core TransformerBlock captured once for ``slots``; call it like the block on a micro-batch.

    ``decoder``: the block (``GPTModel.decoder``) with verl-dyncp's attention, on the current CUDA device, in
    training mode if it will train. ``hidden_size`` and ``dtype``: of its input. Capture runs the forward and
    backward ``num_warmup_iters + 1`` times on a sample batch (``torch.autograd.grad``: parameters' ``.grad``
    is left alone). ``forward``: the decoder's forward to capture, default its class's (a caller that
    replaced ``decoder.forward`` on the instance passes the one it replaced).
    """

    def __init__(
        self,
        decoder: torch.nn.Module,
        *,
        slots: GraphSlots,
        hidden_size: int,
        dtype: torch.dtype,
        num_warmup_iters: int = 3,
        forward: Any = None,
    ) -> None:
        refuse_ddp_wrapped(decoder)
        self.slots, self.decoder = slots, decoder
        self._hidden_size, self._dtype, self._warmup = hidden_size, dtype, num_warmup_iters
        self._forward = forward if forward is not None else type(decoder).forward.__get__(decoder)
        self._params = [p for p in decoder.parameters() if p.requires_grad]
        self._backward_due = False
        self._device = torch.device("cuda", torch.cuda.current_device())
        self._graphed: Any = None
        self._addresses: tuple[int, ...] = ()
        self.captures = 0
        self.recapture()

    def recapture(self) -> None:
        """Capture (again): after the decoder's parameters moved, or to start over."""
        self._graphed = None  # the old graph's memory goes back before the new capture takes its own
        slots, device = self.slots, self._device
        sample = (
            torch.zeros(
                slots.tokens, 1, self._hidden_size, dtype=self._dtype, device=device, requires_grad=True
            ),
            torch.full((slots.sequences + 1,), slots.tokens, dtype=torch.int32, device=device),
            torch.arange(slots.tokens, device=device),
            torch.ones(slots.tokens, dtype=torch.bool, device=device),
        )
        sample[1][0] = 0  # one sequence of the whole budget, then empty slots: a valid layout
        module = _DecoderOverGraphInputs(self.decoder, slots, self._forward)
        self._graphed = torch.cuda.make_graphed_callables(module, sample, num_warmup_iters=self._warmup)
        self._addresses = tuple(p.data_ptr() for p in self._params)
        self._backward_due = False
        self.captures += 1

    @property
    def backward_due(self) -> bool:
        """True between a forward that needs a backward and that backward (the graph holds its activations)."""
        return self._backward_due

    def fits(self, packed_seq_params: Any) -> bool:
        """Whether a CP-1 micro-batch with these params fits the slots (host numbers of its cached layout)."""
        layout = thd_layout(packed_seq_params, cp_size=1, cp_rank=0, device=self._device)
        return self.slots.fit(tokens=layout.num_local_tokens, sequences=len(layout.padded_lens))

    def __call__(self, hidden: torch.Tensor, *, packed_seq_params: Any) -> torch.Tensor:
        """The decoder's output for ``hidden`` ``[T, 1, hidden]``, autograd-connected; its rows only.

        The output is a view of the graph's output buffer and the graph holds one micro-batch's activations:
        run this micro-batch's backward before the next call (megatron-core's no-pipelining schedule). A
        second forward while a backward is due is refused (checked when ``hidden`` requires grad).
        """
        if self._backward_due:
            raise RuntimeError(
                "GraphedDecoder: the previous micro-batch's backward has not run; the graph holds one"
                " micro-batch's activations (pipeline schedules with several in flight need one graph each)"
            )
        layout = thd_layout(packed_seq_params, cp_size=1, cp_rank=0, device=hidden.device)
        if hidden.shape[0] != layout.num_local_tokens:
            raise ValueError(
                f"hidden has {hidden.shape[0]} rows but the micro-batch's layout has {layout.num_local_tokens}"
            )
        cu, positions, valid = pad_layout_to_slots(layout, slots=self.slots)
        if tuple(p.data_ptr() for p in self._params) != self._addresses:
            raise RuntimeError(
                "GraphedDecoder: the decoder's parameters moved since the graph was captured (an offload and"
                " onload?): the graph would read the old addresses; call recapture() first"
            )
        used = hidden.shape[0]
        padded = F.pad(hidden, (0, 0, 0, 0, 0, self.slots.tokens - used))
        out = self._graphed(padded, cu, positions, valid)
        if padded.requires_grad and torch.is_grad_enabled():
            self._backward_due = True
            padded.register_hook(self._backward_ran)
        return out[:used]

    def _backward_ran(self, grad: torch.Tensor) -> None:
        self._backward_due = False


def refuse_ddp_wrapped(decoder: torch.nn.Module) -> None:
    """A decoder whose parameters have ``main_grad`` (megatron-core DDP) cannot be captured: the module's doc."""
    wrapped = [name for name, p in decoder.named_parameters() if hasattr(p, "main_grad")]
    if wrapped:
        raise ValueError(
            f"GraphedDecoder: parameter {wrapped[0]!r} has main_grad (wrapped for megatron-core DDP), which this"
            " graph does not support yet: capturing a DDP-wrapped decoder's backward failed with"
            " cudaErrorStreamCaptureImplicit (DDP keeps AccumulateGrad nodes on the legacy default stream), and its"
            " fused weight-gradient accumulation marks weights from Python each backward. Under DDP run the"
            " decoder eagerly"
        )
