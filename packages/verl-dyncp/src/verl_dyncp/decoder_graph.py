"""A decoder that replays one CUDA graph for the training micro-batches that fit it and runs the rest eagerly.

Why: :class:`~verl_dyncp.graphed_decoder.GraphedDecoder` serves CP-1 micro-batches of a token budget, but a
trainer's step also has micro-batches it cannot serve: CP > 1 under dynamic CP, forward-only passes (log-probs),
micro-batches over the budget, a second forward before a backward. :func:`install_decoder_graph` puts a
dispatcher in the decoder's ``forward`` so the model (``GPTModel``) calls it as before; each call goes to the
graph or to the decoder's own forward, and :attr:`DecoderGraph.counts` says how many went where and why.

The graph is captured at install (a capture is seconds of eager warm-up, better paid before the first step) and
again on the first call after the parameters or gradient buffers moved (an offload and onload);
:meth:`DecoderGraph.release` drops its memory pool (before an offload) and :meth:`DecoderGraph.uninstall`
restores the decoder. Configurations a graph of one micro-batch cannot hold are refused at install, naming the
setting: tensor or pipeline parallelism (several micro-batches in flight, collectives inside the graph),
activation recompute, mixture of experts (token counts per expert vary), dropout (RNG inside the graph), FP8.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

from verl_dyncp.cp_context import get_cp_context
from verl_dyncp.graph_layout import GraphSlots
from verl_dyncp.graphed_decoder import GraphedDecoder

__all__ = ["DecoderGraph", "install_decoder_graph"]

# why a call ran eagerly: the keys of DecoderGraph.counts besides "graph"
EAGER_REASONS = ("forward_only", "not_thd", "cp_size", "too_large", "backward_due", "extra_inputs")


def install_decoder_graph(
    decoder: torch.nn.Module, *, slots: GraphSlots, hidden_size: int, dtype: torch.dtype
) -> DecoderGraph:
    """Dispatch ``decoder``'s calls between one graph for ``slots`` and its own forward; see the module doc.

    ``decoder``: megatron-core's TransformerBlock with verl-dyncp's attention, on CUDA; under DDP its hooks must
    be on the parameters (:func:`verl_mcore_utils.ddp_hooks_on_parameters`). Raises ValueError naming the
    setting for what a graph cannot hold, and for a decoder that already has a dispatcher.
    """
    if isinstance(decoder.__dict__.get("forward"), _Dispatch):
        raise ValueError(
            "install_decoder_graph: this decoder already has a graph dispatcher; uninstall() it first"
        )
    refuse_unsupported(decoder)
    return DecoderGraph(decoder, slots=slots, hidden_size=hidden_size, dtype=dtype)


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
    """The dispatcher :func:`install_decoder_graph` returns: counts, release, recapture, uninstall."""

    def __init__(
        self, decoder: torch.nn.Module, *, slots: GraphSlots, hidden_size: int, dtype: torch.dtype
    ) -> None:
        self.decoder, self.slots = decoder, slots
        self._forward = type(decoder).forward.__get__(decoder)  # the decoder's own forward
        self._static_cp = int(getattr(decoder.config, "context_parallel_size", 1))
        self.counts: Counter[str] = Counter()
        self.graph = GraphedDecoder(
            decoder, slots=slots, hidden_size=hidden_size, dtype=dtype, forward=self._forward
        )
        decoder.forward = _Dispatch(self)

    def release(self) -> None:
        """Drop the graph's memory (before an offload); the next call that fits captures again."""
        self.graph.release()

    def uninstall(self) -> None:
        """Release the graph and give the decoder its own forward back."""
        self.graph.release()
        if isinstance(self.decoder.__dict__.get("forward"), _Dispatch):
            del self.decoder.forward

    def _static_group(self) -> Any:
        """The static CP group, as verl-dyncp's attention finds it (a batch's attached context comes first)."""
        if self._static_cp <= 1:
            return None
        from megatron.core import parallel_state

        return parallel_state.get_context_parallel_group()

    def eager_reason(self, hidden_states: Any, packed_seq_params: Any, extra: dict[str, Any]) -> str | None:
        """Why this call runs eagerly (a key of :attr:`counts`), or None when it replays the graph.

        ``extra``: every other argument of the call (attention mask, RoPE tables, inference context...); the
        graph takes none of them, so any that is set sends the call to the eager forward.
        """
        if not (torch.is_grad_enabled() and self.decoder.training):
            return "forward_only"
        if any(value is not None for value in extra.values()):
            return "extra_inputs"
        if packed_seq_params is None or getattr(packed_seq_params, "qkv_format", "thd") != "thd":
            return "not_thd"
        if get_cp_context(packed_seq_params, static_cp_group=self._static_group()).size != 1:
            return "cp_size"
        if self.graph.backward_due:
            return "backward_due"
        if not self.graph.fits(packed_seq_params):
            return "too_large"
        return None

    def dispatch(
        self,
        hidden_states: torch.Tensor,
        attention_mask: Any = None,
        *,
        packed_seq_params: Any = None,
        **extra: Any,
    ) -> Any:
        reason = self.eager_reason(
            hidden_states, packed_seq_params, {**extra, "attention_mask": attention_mask}
        )
        if reason is not None:
            self.counts[reason] += 1
            return self._forward(
                hidden_states=hidden_states, attention_mask=attention_mask, packed_seq_params=packed_seq_params,
                **extra,
            )  # fmt: skip
        if self.graph.moved():
            self.graph.recapture()
            self.counts["captures"] += 1
        self.counts["graph"] += 1
        return self.graph(hidden_states, packed_seq_params=packed_seq_params)
