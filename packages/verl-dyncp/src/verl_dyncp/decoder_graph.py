"""A decoder that replays one CUDA graph for the training micro-batches that fit it and runs the rest eagerly.

Why: :class:`~verl_dyncp.graphed_decoder.GraphedDecoder` serves the micro-batches of one CP size and token
budget, but a trainer's step also has micro-batches no graph serves: forward-only passes (log-probs),
micro-batches over the budget, a second forward before a backward. :func:`install_decoder_graph` puts a
dispatcher in the decoder's ``forward`` so the model (``GPTModel``) calls it as before; each call goes to a
graph or to the decoder's own forward, and :attr:`DecoderGraph.counts` says how many went where and why.

Graphs: one for CP-1 micro-batches, captured at install (a capture is seconds of eager warm-up, better paid before
the first step); with ``cp_graphs`` (default) one per CP size k > 1 and group, captured at that group's first CP-k
micro-batch that fits. A CP-k graph's capture and replays are collectives of its group, so every choice between
graph and eager depends only on what all ranks of the group share: the micro-batch (its CP size, group, lengths),
the autograd mode and the graph's backward state, which the group's ranks step through together, and a release,
which the engine's offload makes on every rank. A graph is captured again on its first call after
:meth:`DecoderGraph.release` (before an offload); a CP-k graph whose parameters moved without a release is an error
(a recapture decided by one rank's addresses would leave its group waiting), a CP-1 graph recaptures.
:meth:`DecoderGraph.uninstall` restores the decoder. Configurations a graph of one micro-batch cannot hold are
refused at install, naming the setting: tensor or pipeline parallelism (several micro-batches in flight,
collectives inside the graph), activation recompute, mixture of experts (token counts per expert vary), dropout
(RNG inside the graph), FP8.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

from verl_dyncp.cp_context import get_cp_context
from verl_dyncp.graph_layout import GraphSlots
from verl_dyncp.graphed_decoder import GraphedDecoder
from verl_dyncp.layout import thd_layout

__all__ = ["DecoderGraph", "install_decoder_graph"]

# why a call ran eagerly: the keys of DecoderGraph.counts besides "graph"
EAGER_REASONS = (
    "forward_only", "not_thd", "cp_size", "cp_group", "too_large", "backward_due", "extra_inputs",
)  # fmt: skip


def install_decoder_graph(
    decoder: torch.nn.Module,
    *,
    slots: GraphSlots,
    hidden_size: int,
    dtype: torch.dtype,
    cp_graphs: bool = True,
) -> DecoderGraph:
    """Dispatch ``decoder``'s calls between graphs for ``slots`` and its own forward; see the module doc.

    ``cp_graphs``: also graph CP > 1 micro-batches (one graph per CP size, captured by its group); False runs
    them eagerly (counted as ``cp_size``).

    ``decoder``: megatron-core's TransformerBlock with verl-dyncp's attention, on CUDA; under DDP its hooks must
    be on the parameters (:func:`verl_mcore_utils.ddp_hooks_on_parameters`). Raises ValueError naming the
    setting for what a graph cannot hold, and for a decoder that already has a dispatcher.
    """
    if isinstance(decoder.__dict__.get("forward"), _Dispatch):
        raise ValueError(
            "install_decoder_graph: this decoder already has a graph dispatcher; uninstall() it first"
        )
    refuse_unsupported(decoder)
    return DecoderGraph(decoder, slots=slots, hidden_size=hidden_size, dtype=dtype, cp_graphs=cp_graphs)


def refuse_unsupported(decoder: torch.nn.Module) -> None:
    """ValueError naming the first setting of ``decoder.config`` that one graph of a micro-batch cannot hold."""
    config = getattr(decoder, "config", None)
    if config is None:
        raise ValueError(
            f"install_decoder_graph needs megatron-core's TransformerBlock, got {type(decoder).__name__}"
        )
    checks = (
        (
            "tensor_model_parallel_size",
            getattr(config, "tensor_model_parallel_size", 1) > 1,
            "TP collectives",
        ),
        (
            "pipeline_model_parallel_size",
            getattr(config, "pipeline_model_parallel_size", 1) > 1,
            "several micro-batches in flight need one graph each",
        ),
        (
            "recompute_granularity",
            getattr(config, "recompute_granularity", None) is not None,
            "recompute reruns the forward inside the backward",
        ),
        (
            "num_moe_experts",
            bool(getattr(config, "num_moe_experts", None)),
            "token counts per expert change with every micro-batch",
        ),
        (
            "hidden_dropout",
            float(getattr(config, "hidden_dropout", 0.0)) > 0,
            "dropout needs RNG in the graph",
        ),
        (
            "attention_dropout",
            float(getattr(config, "attention_dropout", 0.0)) > 0,
            "dropout needs RNG in the graph",
        ),
        ("fp8", bool(getattr(config, "fp8", None)), "FP8 scaling state is updated from the host"),
    )
    for name, bad, why in checks:
        if bad:
            raise ValueError(
                f"install_decoder_graph: {name}={getattr(config, name)!r} is not supported ({why}); set it to"
                " its default or run the decoder eagerly"
            )
    hooked = [
        name
        for name, module in decoder.named_modules()
        if name and (module._forward_pre_hooks or module._forward_hooks)
    ]
    if hooked:
        raise ValueError(
            f"install_decoder_graph: submodule {hooked[0]!r} has forward hooks, which a graph runs once at capture"
            " and never on replay (megatron-core DDP's overlap_param_gather puts its parameter all-gather wait"
            " there): turn overlap_param_gather off or run the decoder eagerly"
        )
    if not torch.cuda.is_available() or not any(p.is_cuda for p in decoder.parameters()):
        raise ValueError("install_decoder_graph: the decoder is not on a CUDA device (CUDA graphs need one)")


class _Dispatch:
    """The object put in ``decoder.forward`` (a class, so a second install can recognise it)."""

    def __init__(self, owner: DecoderGraph) -> None:
        self.owner = owner

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.owner.dispatch(*args, **kwargs)


class DecoderGraph:
    """The dispatcher :func:`install_decoder_graph` returns: counts, release, recapture, uninstall.

    ``counts``: calls per route (``graph``, or a reason from ``EAGER_REASONS``), ``graph_cp<k>`` of those
    replayed by CP-k graphs, and ``captures``, the captures made while dispatching (recaptures after a release,
    first captures of CP-k graphs).
    """

    def __init__(
        self,
        decoder: torch.nn.Module,
        *,
        slots: GraphSlots,
        hidden_size: int,
        dtype: torch.dtype,
        cp_graphs: bool = True,
    ) -> None:
        self.decoder, self.slots, self.cp_graphs = decoder, slots, cp_graphs
        self._hidden_size, self._dtype = hidden_size, dtype
        self._forward = type(decoder).forward.__get__(decoder)  # the decoder's own forward
        self._device = torch.device("cuda", torch.cuda.current_device())  # the key layouts are cached under
        self._static_cp = int(getattr(decoder.config, "context_parallel_size", 1))
        self.counts: Counter[str] = Counter()
        self.graph = GraphedDecoder(
            decoder, slots=slots, hidden_size=hidden_size, dtype=dtype, forward=self._forward
        )
        self.graphs: dict[int, GraphedDecoder] = {1: self.graph}  # by CP size
        decoder.forward = _Dispatch(self)

    def release(self) -> None:
        """Drop every graph's memory (before an offload); each captures again at its next fitting call."""
        for graph in self.graphs.values():
            graph.release()

    def uninstall(self) -> None:
        """Release the graphs and give the decoder its own forward back."""
        self.release()
        if isinstance(self.decoder.__dict__.get("forward"), _Dispatch):
            del self.decoder.forward

    def _static_group(self) -> Any:
        """The static CP group, as verl-dyncp's attention finds it (a batch's attached context comes first)."""
        if self._static_cp <= 1:
            return None
        from megatron.core import parallel_state

        return parallel_state.get_context_parallel_group()

    def route(self, packed_seq_params: Any, extra: dict[str, Any]) -> tuple[str | None, Any]:
        """``(reason, None)`` for a call that runs eagerly (``reason`` a key of :attr:`counts`), else
        ``(None, context)`` with the micro-batch's CP context: it replays (or first captures) that CP size's graph.

        ``extra``: every other argument of the call (attention mask, RoPE tables, inference context...); the
        graph takes none of them, so any that is set sends the call to the eager forward.
        """
        if not (torch.is_grad_enabled() and self.decoder.training):
            return "forward_only", None
        if any(value is not None for value in extra.values()):
            return "extra_inputs", None
        if packed_seq_params is None or getattr(packed_seq_params, "qkv_format", "thd") != "thd":
            return "not_thd", None
        context = get_cp_context(packed_seq_params, static_cp_group=self._static_group())
        if context.size > 1 and not self.cp_graphs:
            return "cp_size", None
        graph = self.graphs.get(context.size)
        if graph is not None and graph.cp_group is not context.cp_group and context.size > 1:
            return "cp_group", None  # another group of this size: its graph's collectives are not ours
        if graph is not None and graph.backward_due:
            return "backward_due", None
        # the micro-batch's own (cached) layout; its padded lengths decide, the same on every rank of the group
        layout = thd_layout(
            packed_seq_params, cp_size=context.size, cp_rank=context.rank, device=self._device
        )
        if not self.slots.holds(layout):
            return "too_large", None
        return None, context

    def _graph_for(self, context: Any) -> GraphedDecoder:
        """The graph of this CP size, captured or recaptured when needed (with its group, at the same call)."""
        graph = self.graphs.get(context.size)
        if graph is None:
            graph = GraphedDecoder(
                self.decoder, slots=self.slots, hidden_size=self._hidden_size, dtype=self._dtype,
                forward=self._forward, cp_group=context.cp_group,
            )  # fmt: skip
            self.graphs[context.size] = graph
            self.counts["captures"] += 1
        elif graph.released or (context.size == 1 and graph.moved()):
            graph.recapture()
            self.counts["captures"] += 1
        return graph

    def dispatch(
        self,
        hidden_states: torch.Tensor,
        attention_mask: Any = None,
        *,
        packed_seq_params: Any = None,
        **extra: Any,
    ) -> Any:
        reason, context = self.route(packed_seq_params, {**extra, "attention_mask": attention_mask})
        if reason is not None:
            self.counts[reason] += 1
            return self._forward(
                hidden_states=hidden_states, attention_mask=attention_mask, packed_seq_params=packed_seq_params,
                **extra,
            )  # fmt: skip
        graph = self._graph_for(context)
        self.counts["graph"] += 1
        if context.size > 1:
            self.counts[f"graph_cp{context.size}"] += 1
        return graph(hidden_states, packed_seq_params=packed_seq_params)
