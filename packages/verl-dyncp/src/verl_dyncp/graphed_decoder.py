"""One CUDA graph of a megatron-core decoder's forward + backward, replayed for every CP-1 micro-batch that fits.

Why: at Megatron-LM's dynamic-CP workload shape the eager decoder is launch-bound (51.6 ms eager against
15.2 ms replayed, docs/benchmarks.md). :mod:`verl_dyncp.graph_layout` pads each micro-batch to fixed
``GraphSlots`` and passes its layout as tensors; this module captures the decoder once over those inputs with
``torch.cuda.make_graphed_callables`` and, per micro-batch, pads the hidden states, copies the layout in and
replays. Outputs and input gradients of the micro-batch's own rows come back; the padding rows are cut.

Scope, stated so that nothing is silently wrong: verl-dyncp's attention (the varlen kernel), one micro-batch in
flight, no dropout RNG inside the graph unless megatron-core's tracker is graph-safe. A graph serves one CP
size: CP 1 by default; with ``cp_group`` (k ranks) it serves that group's CP-k micro-batches
(:class:`~verl_dyncp.graph_layout.CpGraphInputs`: every shape fixed by the slots and k), and its capture and
every replay are collective over the group (the K/V all-gather and its reduce-scatter are NCCL collectives in
the graph): every rank of the group must construct, call and recapture it together.

Decoders wrapped for megatron-core DDP (parameters with ``main_grad``) are supported once DDP's gradient
hooks sit on the parameters (:func:`verl_mcore_utils.ddp_hooks_on_parameters`), and refused otherwise.
Measured: capturing the backward of verl-engine's DDP-wrapped decoder with DDP's hooks in place failed with
``cudaErrorStreamCaptureImplicit`` (1 x H200, megatron-core 0.19.2, torch 2.11): DDP keeps each parameter's
AccumulateGrad node alive, made on the legacy default stream. Two more points of DDP are handled here:

* the fused weight-gradient path (``gradient_accumulation_fusion``) adds a weight's gradient into
  ``main_grad`` inside the backward, which the graph replays at ``main_grad``'s address, and marks the weight
  (``grad_added_to_main_grad``) from Python, which a replay does not redo: the weights one eager pass before
  the capture marked are marked again on every call. The graph returns no gradient for them (a placeholder the
  size of each weight would stay in the graph's pool, and ``AccumulateGrad`` would copy it every backward): they
  are left out of its input surface, and their DDP hooks run after its backward
  (:func:`verl_mcore_utils.ddp_graph_hooks.run_ddp_hook`: the bucket readiness of overlapped reduction);
* the capture's warm-up backward passes add into ``main_grad`` too: it is saved (to host memory) before the
  capture and put back after.

A graph reads parameters (and ``main_grad``) at the addresses of its capture: a call after they moved (an
offload and onload) is an error naming the fix (:meth:`GraphedDecoder.recapture`), checked on every call.
"""

from __future__ import annotations

import gc
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from verl_dyncp.graph_layout import (
    CpGraphInputs,
    GraphSlots,
    graph_cp_packed_seq_params,
    graph_packed_seq_params,
    pad_cp_layout_to_slots,
    pad_cp_micro_batch_to_slots,
    pad_layout_to_slots,
)
from verl_dyncp.layout import thd_layout
from verl_mcore_utils.ddp_graph_hooks import ddp_hook_is_on_parameter, run_ddp_hook

__all__ = ["GraphedDecoder"]


class _DecoderOverGraphInputs(torch.nn.Module):
    """The decoder as a function of tensors only: hidden states and the padded layout (what a graph takes).

    ``forward`` is the decoder's own forward, called directly (a caller that replaced ``decoder.forward`` with
    a dispatcher passes the original, so that the graph does not re-enter the dispatcher). The layout tensors
    are ``(cu_seqlens, position_ids, valid)`` at CP 1 and the fields of ``CpGraphInputs`` in order under CP.
    """

    def __init__(
        self, decoder: torch.nn.Module, slots: GraphSlots, forward: Any, cp_group: dist.ProcessGroup | None
    ) -> None:
        super().__init__()
        self.decoder, self.slots, self._decoder_forward = decoder, slots, forward
        self.cp_group = cp_group

    def forward(self, hidden: torch.Tensor, *layout: torch.Tensor) -> torch.Tensor:
        # built on every call (warm-up, capture): a fresh layout, so RoPE tables are computed in the graph
        if self.cp_group is None:
            cu_seqlens, position_ids, valid = layout
            params = graph_packed_seq_params(
                cu_seqlens=cu_seqlens, position_ids=position_ids, valid=valid, slots=self.slots
            )
        else:
            params = graph_cp_packed_seq_params(
                CpGraphInputs(*layout),
                cp_group=self.cp_group,
                cp_size=dist.get_world_size(group=self.cp_group),
                cp_rank=dist.get_rank(group=self.cp_group),
                slots=self.slots,
            )
        return self._decoder_forward(hidden_states=hidden, attention_mask=None, packed_seq_params=params)


class GraphedDecoder:
    """A megatron-core TransformerBlock captured once for ``slots``; call it like the block on a micro-batch.

    ``decoder``: the block (``GPTModel.decoder``) with verl-dyncp's attention, on the current CUDA device, in
    training mode if it will train. ``hidden_size`` and ``dtype``: of its input. Capture runs the forward and
    backward ``num_warmup_iters + 1`` times on a sample batch (``torch.autograd.grad``: parameters' ``.grad``
    is left alone). ``forward``: the decoder's forward to capture, default its class's (a caller that
    replaced ``decoder.forward`` on the instance passes the one it replaced). ``cp_group``: a graph of that
    group's CP-k micro-batches (the module doc; every rank of the group constructs it at the same point).
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
        cp_group: dist.ProcessGroup | None = None,
    ) -> None:
        self.cp_group = cp_group
        self.cp_size = 1 if cp_group is None else dist.get_world_size(group=cp_group)
        self.cp_rank = 0 if cp_group is None else dist.get_rank(group=cp_group)
        if self.cp_size > 1 and slots.tokens % 2:
            raise ValueError(
                f"GraphedDecoder: GraphSlots.tokens={slots.tokens} must be even for a CP-{self.cp_size} graph (a"
                " rank holds two chunks of every sequence)"
            )
        self._ddp_params = ddp_parameters(decoder)
        self._fused: list[torch.nn.Parameter] = []  # weights whose gradient the graph adds to main_grad
        self._surface: tuple[torch.nn.Parameter, ...] = ()  # the parameters whose gradient the graph returns
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

    def release(self) -> None:
        """Drop the graph and its memory pool (before an offload); the next call needs :meth:`recapture`.

        The graphs sit in reference cycles (the autograd Function class ``make_graphed_callables`` builds), so
        only the cycle collector frees them, run here. Measured why it matters (2 x H200, NCCL 2.28): a CP
        graph still alive holds its group's NCCL communicator, and the engine's ``close()`` then hung in
        ``destroy_process_group`` on both ranks.
        """
        held = self._graphed is not None
        self._graphed = None
        self._backward_due = False
        if held:
            gc.collect()

    @property
    def released(self) -> bool:
        """No graph held (released, or a capture that failed): the next call needs :meth:`recapture`."""
        return self._graphed is None

    def moved(self) -> bool:
        """Whether the parameters or their ``main_grad`` moved since the capture (or there is no graph)."""
        return self._graphed is None or self._current_addresses() != self._addresses

    def _current_addresses(self) -> tuple[int, ...]:
        # main_grad: set on each Parameter by megatron-core DDP
        grads = tuple(p.main_grad.data_ptr() for p in self._ddp_params)  # type: ignore[attr-defined]
        return tuple(p.data_ptr() for p in self._params) + grads

    def recapture(self) -> None:
        """Capture (again): after the decoder's parameters moved, or to start over."""
        self.release()  # the old graph's memory goes back before the new capture takes its own
        slots, device = self.slots, self._device
        hidden = torch.zeros(
            slots.tokens, 1, self._hidden_size, dtype=self._dtype, device=device, requires_grad=True
        )
        if self.cp_group is None:
            cu = torch.full((slots.sequences + 1,), slots.tokens, dtype=torch.int32, device=device)
            cu[0] = 0  # one sequence of the whole budget, then empty slots: a valid layout
            layout: tuple[torch.Tensor, ...] = (
                cu,
                torch.arange(slots.tokens, device=device),
                torch.ones(slots.tokens, dtype=torch.bool, device=device),
            )
        else:  # one sequence of the group's whole budget
            whole = [self.cp_size * slots.tokens]
            inputs = pad_cp_micro_batch_to_slots(
                seq_lens=whole, padded_lens=whole, cp_size=self.cp_size, cp_rank=self.cp_rank, slots=slots,
                device=device,
            )  # fmt: skip
            layout = inputs.tensors()
        sample = (hidden, *layout)
        module = _DecoderOverGraphInputs(self.decoder, slots, self._forward, self.cp_group)
        ddp = self._ddp_params
        flags = [bool(getattr(p, "grad_added_to_main_grad", False)) for p in ddp]
        # the warm-up backward adds into them (main_grad: megatron-core DDP's attribute)
        grads = [p.main_grad.to("cpu", copy=True) for p in ddp]  # type: ignore[attr-defined]
        for p in ddp:
            p.grad_added_to_main_grad = False  # type: ignore[attr-defined]  # megatron-core DDP's attribute
        try:
            self._fused = _fused_weights(module, sample, ddp)
            fused = {id(p) for p in self._fused}
            # the graph's input surface: its inputs and the parameters whose gradient it returns; a fused weight's
            # gradient is added into main_grad inside the graph, and its DDP hook is run after the backward
            self._surface = tuple(p for p in self._params if id(p) not in fused)
            self._graphed = torch.cuda.make_graphed_callables(
                _Tensors(module, inputs=len(sample)), (*sample, *self._surface), num_warmup_iters=self._warmup
            )
        finally:
            for p, flag, grad in zip(ddp, flags, grads, strict=True):
                p.grad_added_to_main_grad = flag  # type: ignore[attr-defined]  # megatron-core DDP's attribute
                p.main_grad.copy_(grad)  # type: ignore[attr-defined]  # megatron-core DDP's attribute
        self._addresses = self._current_addresses()
        self._backward_due = False
        self.captures += 1

    @property
    def backward_due(self) -> bool:
        """True between a forward that needs a backward and that backward (the graph holds its activations)."""
        return self._backward_due

    def fits(self, packed_seq_params: Any) -> bool:
        """Whether a micro-batch of this graph's CP size fits the slots (host numbers of its cached layout).

        Under CP the answer depends only on the whole micro-batch (its padded lengths), so every rank of the
        group gives the same one: the group replays together or runs eagerly together.
        """
        return self.slots.holds(self._layout(packed_seq_params))

    def _layout(self, packed_seq_params: Any) -> Any:
        return thd_layout(packed_seq_params, cp_size=self.cp_size, cp_rank=self.cp_rank, device=self._device)

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
        if hidden.dtype != self._dtype or hidden.shape[1:] != (1, self._hidden_size):
            raise ValueError(  # the graph's input buffer would convert silently (copy_ casts)
                f"hidden is {hidden.dtype} {tuple(hidden.shape)} but the graph was captured for {self._dtype}"
                f" [tokens, 1, {self._hidden_size}]"
            )
        layout = self._layout(packed_seq_params)
        if hidden.shape[0] != layout.num_local_tokens:
            raise ValueError(
                f"hidden has {hidden.shape[0]} rows but the micro-batch's layout has {layout.num_local_tokens}"
            )
        if self.cp_group is None:
            inputs: tuple[torch.Tensor, ...] = pad_layout_to_slots(layout, slots=self.slots)
        else:
            inputs = pad_cp_layout_to_slots(layout, slots=self.slots).tensors()
        if self.moved():
            raise RuntimeError(
                "GraphedDecoder: no graph, or the decoder's parameters (or their main_grad) moved since the"
                " graph was captured (an offload and onload?): the graph would read the old addresses; call"
                " recapture() first (a CP graph: release() it on every rank of its group, as the engine's"
                " offload does, so that the group captures again together)"
            )
        used = hidden.shape[0]
        padded = F.pad(hidden, (0, 0, 0, 0, 0, self.slots.tokens - used))
        if (
            torch.is_grad_enabled() and not padded.requires_grad
        ):  # the backward's hook needs a gradient to fire on
            padded = padded.detach().requires_grad_()
        out = self._graphed(padded, *inputs, *self._surface)
        if torch.is_grad_enabled():
            for p in self._fused:  # what the eager backward's Python would have marked (module doc)
                p.grad_added_to_main_grad = True  # type: ignore[attr-defined]  # megatron-core DDP's attribute
        if padded.requires_grad and torch.is_grad_enabled():
            self._backward_due = True
            padded.register_hook(self._backward_ran)
        return out[:used]

    def _backward_ran(self, grad: torch.Tensor) -> None:
        self._backward_due = False
        if self._fused:
            for p in self._fused:  # the hooks AccumulateGrad would have run (the graph returns no gradient)
                run_ddp_hook(p)


class _Tensors:
    """The graphed module as a function of tensors: ``inputs`` of its own, then parameters.

    Why a function, not the module: ``make_graphed_callables`` adds every parameter of a module to the graph's
    surface, so the graph would return a gradient for each, and for a fused weight that is a placeholder the size
    of the weight, kept in the graph's pool for good. Passed as trailing arguments, the parameters that return a
    gradient are the only ones in the surface (the module reads the same tensors, so nothing is copied).
    """

    def __init__(self, module: torch.nn.Module, *, inputs: int) -> None:
        self.module, self.inputs = module, inputs

    def __call__(self, *tensors: torch.Tensor) -> torch.Tensor:
        return self.module(*tensors[: self.inputs])


def _fused_weights(
    module: torch.nn.Module, sample: tuple[torch.Tensor, ...], ddp: list[torch.nn.Parameter]
) -> list[torch.nn.Parameter]:
    """The DDP parameters whose gradient the backward adds into ``main_grad`` itself (the fused weight-gradient
    path marks them ``grad_added_to_main_grad``): found by one eager forward and backward of ``sample``, since
    the marking happens inside megatron-core's backward (its flags are cleared before, by the caller)."""
    if not ddp:
        return []
    out = module(*sample)
    torch.autograd.grad(out, sample[0], grad_outputs=torch.ones_like(out))
    return [p for p in ddp if p.grad_added_to_main_grad]  # type: ignore[attr-defined]  # megatron-core DDP's attribute


def ddp_parameters(decoder: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The decoder's parameters with ``main_grad`` (megatron-core DDP); refused unless their hooks were moved.

    Without the move the capture fails (cudaErrorStreamCaptureImplicit: the module's doc), so the error says
    what to call instead of letting the capture fail deep inside torch.
    """
    wrapped = [(name, p) for name, p in decoder.named_parameters() if hasattr(p, "main_grad")]
    stuck = [name for name, p in wrapped if not ddp_hook_is_on_parameter(p)]
    if stuck:
        raise ValueError(
            f"GraphedDecoder: parameter {stuck[0]!r} has main_grad (wrapped for megatron-core DDP) but DDP's"
            " gradient hook is still on its AccumulateGrad node, which makes the capture fail with"
            " cudaErrorStreamCaptureImplicit (DDP keeps those nodes on the legacy default stream): call"
            " verl_mcore_utils.ddp_hooks_on_parameters(ddp) on the DDP wrapper first, or run the decoder eagerly"
        )
    return [p for _, p in wrapped]
