"""CUDA graphs of the decoder for an engine's training micro-batches (opt in: :func:`use_decoder_graphs`).

Why: at Megatron-LM's dynamic-CP workload shape a CP-1 micro-batch's decoder is launch-bound (51.6 ms eager against
15.2 ms replayed from one graph, 1 x H200, docs/benchmarks.md), and dynamic CP runs most micro-batches at CP 1; the
CP-2 / CP-4 micro-batches get one graph per CP size, captured by their group. This module wires
:func:`verl_dyncp.install_decoder_graph` into a built engine: DDP's gradient hooks are moved onto the parameters
(what lets a backward through DDP be captured, :mod:`verl_mcore_utils.ddp_graph_hooks`), each chunk's decoder gets
a dispatcher, the engine's offload releases the graphs' memory and ``close()`` uninstalls them. Micro-batches no
graph can serve (forward-only, over the token budget) run eagerly; :func:`decoder_graph_counts` says how many went
where.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

__all__ = ["decoder_graph_counts", "release_decoder_graphs", "use_decoder_graphs"]

_ATTR = "_decoder_graphs"


def use_decoder_graphs(
    engine: Any, *, tokens: int | None = None, sequences: int = 64, cp_graphs: bool = True
) -> list[Any]:
    """Install one decoder graph dispatcher per model chunk of ``engine`` (an RLEngine); returns them.

    ``tokens``: the graph's token budget per rank, default the engine's ``max_token_len_per_gpu`` (dynamic batch
    size); ``sequences``: at most this many sequences per graphed micro-batch (one slot goes to padding);
    ``cp_graphs``: graph CP > 1 micro-batches too (static or dynamic CP: one graph per CP size, captured by its
    group at its first micro-batch; every rank of the engine must call this). Call between
    steps, with the engine's state on the GPU. Raises ValueError naming the setting for what a graph cannot
    serve (CPU engine, Megatron-FSDP, LoRA, a model chunk without DDP, and the decoder settings
    :func:`verl_dyncp.install_decoder_graph` refuses).
    """
    from verl_dyncp import GraphSlots, install_decoder_graph
    from verl_mcore_utils.ddp_graph_hooks import ddp_hooks_on_parameters

    if getattr(engine, _ATTR, None):
        raise ValueError("use_decoder_graphs: this engine already has decoder graphs")
    refusals = (
        (engine.device.type != "cuda", f"the engine is on {engine.device} (CUDA graphs need a GPU)"),
        (engine.megatron_fsdp, "Megatron-FSDP shards parameters and gathers them from its own hooks"),
        (
            engine.lora is not None,
            "LoRA's adapter switches (disable_adapter) are Python flags a replay ignores",
        ),
    )
    for bad, why in refusals:
        if bad:
            raise ValueError(f"use_decoder_graphs: not supported here: {why}")
    budget = tokens if tokens is not None else engine.micro_batching.max_token_len_per_gpu
    if not budget:
        raise ValueError(
            "use_decoder_graphs: pass tokens= (the graph's token budget); the engine has no"
            " max_token_len_per_gpu (use_dynamic_bsz is off)"
        )
    slots = GraphSlots(tokens=int(budget), sequences=sequences)
    graphs = []
    try:
        for chunk in engine.chunks:
            ddp, model = _ddp_and_model(chunk)
            ddp_hooks_on_parameters(ddp)
            config = model.config
            graphs.append(
                install_decoder_graph(
                    model.decoder,
                    slots=slots,
                    hidden_size=int(config.hidden_size),
                    dtype=_dtype(config),
                    cp_graphs=cp_graphs,
                )
            )
    except BaseException:
        for graph in graphs:
            graph.uninstall()
        raise
    setattr(engine, _ATTR, graphs)
    return graphs


def release_decoder_graphs(engine: Any, *, uninstall: bool = False) -> None:
    """Drop the graphs' memory (the next fitting micro-batch captures again); ``uninstall``: remove them."""
    for graph in engine.__dict__.get(_ATTR) or ():
        graph.uninstall() if uninstall else graph.release()
    if uninstall:
        engine.__dict__.pop(_ATTR, None)


def decoder_graph_counts(engine: Any) -> dict[str, int]:
    """Decoder calls per path over every chunk: ``graph``, ``captures`` and each reason a call ran eagerly."""
    total: Counter[str] = Counter()
    for graph in engine.__dict__.get(_ATTR) or ():
        total.update(graph.counts)
    return dict(total)


def _ddp_and_model(chunk: torch.nn.Module) -> tuple[Any, Any]:
    ddp, module = None, chunk
    while hasattr(module, "module") and not hasattr(module, "decoder"):
        if type(module).__name__ == "DistributedDataParallel":
            ddp = module
        module = module.module  # type: ignore[assignment]  # a wrapper's .module is a Module (nn.Module.__getattr__)
    if ddp is None or not hasattr(module, "decoder"):
        raise ValueError(
            f"use_decoder_graphs: model chunk {type(chunk).__name__} is not megatron-core DDP around a GPTModel"
            " (a role that does not train, or a custom wrapper); graphs are for training chunks"
        )
    return ddp, module


def _dtype(config: Any) -> torch.dtype:
    if getattr(config, "bf16", False):
        return torch.bfloat16
    return torch.float16 if getattr(config, "fp16", False) else torch.float32
