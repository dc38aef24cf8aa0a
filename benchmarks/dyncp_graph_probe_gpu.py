"""What CUDA graphs could take off a dynamic-CP micro-batch: its decoder forward + backward, eager vs graphed.

    cd benchmarks && python3 -m torch.distributed.run --standalone --nproc-per-node 1 \
        dyncp_graph_probe_gpu.py --out results/dyncp_graph_probe_h100.json

Why: on Megatron-LM's dynamic-CP workload (issue 36, part 4) both our static CP 4 and our dynamic CP spend
about 0.8 s of host time on a step whose GPU work is done 3-4 ms after the host returns (docs/benchmarks.md,
"Dynamic CP: the host, not the GPU, sets the step time"), so dynamic CP's halved GPU time cannot show.
Capturing the transformer layers of a micro-batch in a CUDA graph replaces their Python with one launch.
Before building that into the engine (fixed token budgets, layouts as graph inputs, one graph per CP size),
this measures the prize and the first obstacle on one GPU: the workload's model (the ``1b`` preset cut to 12
layers, hidden 2048, vocab 32000, bf16, no recompute) and one CP-1 micro-batch of the workload's 2048-token
budget, its decoder (every transformer layer, megatron-core's TransformerBlock with verl-dyncp's THD
attention) run forward + backward:

* eager: host milliseconds until ``backward()`` returns, and wall milliseconds per call with the GPU drained;
* graphed: the same decoder through ``torch.cuda.make_graphed_callables`` (the batch's layout, RoPE tables and
  kernel plan built in the warm-up calls and baked in: one fixed micro-batch), its wall milliseconds, and its
  largest difference to the eager output and input gradient;
* the GPU time (CUDA events over back-to-back calls) of each: the floor both approach.

* replay: :class:`verl_dyncp.graphed_decoder.GraphedDecoder` captured once for ``GraphSlots(2048, 16)`` and
  replayed for micro-batches of other layouts (``REPLAY_BATCHES``: 1 to 12 sequences, 1850 to 2048 tokens),
  each against the eager decoder on the same micro-batch (wall ms, output / input-gradient differences):
  what the engine would run.

A capture that fails is a result too: the record keeps the error, which names what in the layer is not
capturable (a host sync, an RNG-state change). ``--device cpu`` runs the eager half only (a dry run of the
script). Megatron-core's RNG tracker is seeded graph-safe (``use_cudagraphable_rng``) where the release has
it.
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from _record import results_path, write_record

LENGTHS = (640, 512, 384, 256, 160, 96)  # one CP-1 micro-batch of the workload's 2048-token budget


def _setup(args: argparse.Namespace) -> tuple[Any, Any, torch.Tensor, torch.Tensor]:
    """The workload's decoder in bf16, one packed micro-batch's PackedSeqParams, an input, an output grad."""
    from megatron.core.tensor_parallel import random as mcore_random

    from verl_dyncp.model import build_thd_gpt_model
    from verl_mcore_utils.parallel import init_parallel
    from verl_mcore_utils.presets import qwen2_preset
    from verl_mcore_utils.transformer_config import hf_to_transformer_config

    cuda = args.device == "cuda"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    init_parallel(device=args.device)
    if cuda:
        # graph-safe generator states, replacing a tracker init_parallel may have made (force_reset_rng)
        accepted = inspect.signature(mcore_random.model_parallel_cuda_manual_seed).parameters
        seed_kwargs = {k: True for k in ("use_cudagraphable_rng", "force_reset_rng") if k in accepted}
        mcore_random.model_parallel_cuda_manual_seed(1234, **seed_kwargs)
    torch.manual_seed(0)
    hf = qwen2_preset("1b", vocab_size=32000, num_hidden_layers=args.layers, max_position_embeddings=32768)
    tf = hf_to_transformer_config(hf, dtype="bfloat16" if cuda else "float32")
    model = build_thd_gpt_model(hf_config=hf, tf_config=tf, device=device)
    model = model.to(dtype=torch.bfloat16 if cuda else torch.float32)
    tokens = torch.randint(0, 32000, (sum(LENGTHS),), generator=torch.Generator().manual_seed(1)).to(device)
    # on the device, so is its layout; one GPU: CP 1, the micro-batch's 2048 tokens its budget
    params, rows = _cp1_params(tokens, LENGTHS)
    gen = torch.Generator(device=device).manual_seed(2)
    dtype = next(model.parameters()).dtype
    x = torch.randn(rows, 1, hf["hidden_size"], device=device, dtype=dtype, generator=gen)
    grad_out = torch.randn(x.shape, device=device, dtype=dtype, generator=gen) * 1e-2
    return model.decoder, params, x, grad_out


def _cp1_params(tokens: torch.Tensor, lens: tuple[int, ...]) -> tuple[Any, int]:
    """PackedSeqParams of one CP-1 micro-batch of ``tokens`` in sequences of ``lens`` (layout on their device),
    and its number of rows."""
    from verl_dyncp.groups import CPGroups
    from verl_dyncp.layout import thd_packed_seq_params
    from verl_dyncp.planner import dynamic_cp_split_batch

    mb = dynamic_cp_split_batch(tokens, seq_lens=lens, groups=CPGroups(), static_cp_size=1)
    return thd_packed_seq_params(mb.batch.meta, cp_group=None), int(mb.batch.input_ids.shape[0])


class _Decoder(torch.nn.Module):
    """The decoder of one fixed micro-batch as a function of its input only (what a CUDA graph can take)."""

    def __init__(self, decoder: Any, params: Any) -> None:
        super().__init__()
        self.decoder, self.params = decoder, params

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.decoder(hidden_states=hidden, attention_mask=None, packed_seq_params=self.params)


def _timed(fn: Any, x: torch.Tensor, grad_out: torch.Tensor, *, iters: int, cuda: bool) -> dict[str, float]:
    """Per call: host ms until backward returns (GPU not drained), wall ms with the GPU drained each call."""
    host, wall = [], []
    for _ in range(iters):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn(x).backward(grad_out)
        host.append((time.perf_counter() - start) * 1e3)
        if cuda:
            torch.cuda.synchronize()
        wall.append((time.perf_counter() - start) * 1e3)
    return {"host_ms": statistics.median(host), "wall_ms": statistics.median(wall)}


def _gpu_ms(fn: Any, x: torch.Tensor, grad_out: torch.Tensor, *, iters: int) -> float:
    """GPU milliseconds per call from CUDA events over ``iters`` back-to-back calls."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn(x).backward(grad_out)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--out", type=Path, default=results_path("dyncp_graph_probe.json"))
    args = parser.parse_args()
    cuda = args.device == "cuda"
    decoder, params, x, grad_out = _setup(args)
    eager = _Decoder(decoder, params)
    x_eager = x.detach().clone().requires_grad_(True)
    for _ in range(3):  # warm-up: the layout's RoPE tables and kernel plan are built and cached here
        eager(x_eager).backward(grad_out)
    numbers: dict[str, Any] = {"eager": _timed(eager, x_eager, grad_out, iters=args.iters, cuda=cuda)}
    if cuda:
        numbers["eager"]["gpu_ms"] = _gpu_ms(eager, x_eager, grad_out, iters=args.iters)
        try:
            x_graph = x.detach().clone().requires_grad_(True)
            # a second wrapper of the same decoder: make_graphed_callables replaces its module's forward
            graphed = torch.cuda.make_graphed_callables(
                _Decoder(decoder, params), (x_graph,), num_warmup_iters=3
            )
        except Exception as err:  # the obstacle is the finding: keep its text
            numbers["graphed"] = {"capture_error": f"{type(err).__name__}: {err}"[:2000]}
        else:
            numbers["graphed"] = _timed(graphed, x_graph, grad_out, iters=args.iters, cuda=True)
            numbers["graphed"]["gpu_ms"] = _gpu_ms(graphed, x_graph, grad_out, iters=args.iters)
            numbers["graphed"].update(_agreement(eager, graphed, x, grad_out))
            numbers["wall_ms_saved_per_layer"] = (
                numbers["eager"]["wall_ms"] - numbers["graphed"]["wall_ms"]
            ) / args.layers
            numbers["replay"] = _replay(decoder, args)
    config = {"model": f"qwen2 preset 1b, {args.layers} layers, vocab 32000", "layers": args.layers,
              "lengths": list(LENGTHS), "tokens": sum(LENGTHS), "cp_size": 1,
              "dtype": "bfloat16" if cuda else "float32", "recompute": False, "iters": args.iters,
              "device": args.device}  # fmt: skip
    record = write_record(args.out, benchmark="dyncp_graph_probe", config=config, numbers=numbers)
    print({k: record[k] for k in ("eager", "graphed") if k in record})
    for row in record.get("replay", {}).get("batches", []):
        print(row)


# micro-batches of the workload's 2048-token budget with other layouts: one graph (GraphSlots 2048 x 16) serves all
REPLAY_BATCHES = (
    (640, 512, 384, 256, 160, 96),
    (1500, 300),
    (2048,),
    (900, 700, 100, 50),
    (128,) * 12,
    (1024, 1000),
)


def _replay(decoder: Any, args: argparse.Namespace) -> dict[str, Any]:
    """verl_dyncp.GraphedDecoder captured once, replayed per micro-batch: times and differences to eager."""
    from verl_dyncp.graph_layout import GraphSlots
    from verl_dyncp.graphed_decoder import GraphedDecoder

    dtype = next(decoder.parameters()).dtype
    hidden = decoder.final_layernorm.weight.shape[0]
    graphed = GraphedDecoder(
        decoder, slots=GraphSlots(tokens=2048, sequences=16), hidden_size=hidden, dtype=dtype
    )
    gen = torch.Generator(device="cuda").manual_seed(3)
    rows = []
    for lens in REPLAY_BATCHES:
        params, _ = _cp1_params(torch.zeros(sum(lens), dtype=torch.long, device="cuda"), lens)
        x = torch.randn(sum(lens), 1, hidden, device="cuda", dtype=dtype, generator=gen)
        g = torch.randn(x.shape, device="cuda", dtype=dtype, generator=gen) * 1e-2
        eager = _Decoder(decoder, params)
        replay = lambda h, p=params: graphed(h, packed_seq_params=p)  # noqa: E731
        xe = x.detach().clone().requires_grad_(True)
        row: dict[str, Any] = {"lengths": list(lens), "tokens": sum(lens)}
        row["eager"] = _timed(eager, xe, g, iters=args.iters, cuda=True)
        row["graphed"] = _timed(replay, xe, g, iters=args.iters, cuda=True)
        row.update(_agreement(eager, replay, x, g))
        rows.append(row)
    median = statistics.median
    return {
        "slots": {"tokens": 2048, "sequences": 16},
        "batches": rows,
        "eager_wall_ms_median": median(r["eager"]["wall_ms"] for r in rows),
        "graphed_wall_ms_median": median(r["graphed"]["wall_ms"] for r in rows),
    }


def _agreement(eager: Any, graphed: Any, x: torch.Tensor, grad_out: torch.Tensor) -> dict[str, float]:
    """Largest absolute differences of the graphed output and input gradient to the eager ones (one input)."""
    outs = []
    for fn in (eager, graphed):
        xi = x.detach().clone().requires_grad_(True)
        y = fn(xi)
        y.backward(grad_out)
        outs.append((y.detach().float(), xi.grad.detach().float()))
    (y0, g0), (y1, g1) = outs
    return {
        "max_abs_diff_output": float((y0 - y1).abs().max()),
        "max_abs_diff_input_grad": float((g0 - g1).abs().max()),
    }


if __name__ == "__main__":
    main()
