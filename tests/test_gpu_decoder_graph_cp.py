"""GPU, 2 ranks, bf16: CUDA graphs of the decoder for CP-2 micro-batches (static and dynamic CP) train like the
eager engine.

``verl_engine.use_decoder_graphs`` gives each CP size its own graph: the CP-2 one is captured by both ranks of
the group at their first CP-2 micro-batch, and its replays run the K/V all-gather (forward) and reduce-scatter
(backward) inside the graph. The SFT engine on packed batches of 1 to 1000 tokens (a 512-token budget per rank:
CP-2 micro-batches under static CP 2; CP-2 and CP-1 ones under dynamic CP), three optimizer steps with an
offload and onload before the second and third (every graph dropped and captured again by its group), against
the same steps eagerly, each in fresh processes.

Tolerances (bf16), as tests/test_gpu_decoder_graph.py: the graph pads each rank's rows to 512 and adds one
padding sequence, so GEMMs and the attention may pick other kernels (other accumulation order): a few bf16
roundings, well under 1e-2 of a loss and 5e-2 of a gradient's norm. What the test guards against is order one:
a padding row leaking into a true token's attention, a key stream of the wrong rank, a gradient added twice
or lost, a stale graph after the offload. The weights after three Adam steps: within 1e-2 of their norm plus
a tenth of ``lr x steps x sqrt(numel)``. Adam moves each element by about ``lr`` a step whatever the gradient's
size, so an element whose gradient is near zero may step the other way on a bf16 rounding: measured on
2 x H200, the zero-initialised QKV biases (elements of about 2e-3) differed by 6-9% of their norm while losses and
gradients agreed; a real error shows in the losses and step 0's gradients first.
"""

from __future__ import annotations

import pytest

from verl_mcore_utils.testing import run_distributed

LR = 1e-3
COMMON = ["model.preset=small", "megatron.use_distributed_optimizer=false", f"optim.lr={LR}"]
BF16 = [*COMMON, "megatron.dtype=bfloat16"]
LONG = (300, 1, 512, 40, 800, 128, 183, 64)
BATCHES = [(LONG, 21, True), ((96,) * 12, 22, False), ((1000,), 23, False)]
LAYOUTS = {
    "static2": ["megatron.context_parallel_size=2"],
    "dynamic": ["megatron.dynamic_context_parallel=true", "megatron.max_seqlen_per_dp_cp_rank=512"],
}


def _rel(a, b) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.mark.gpu
@pytest.mark.num_gpus(2)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_cp2_decoder_graphs_train_like_the_eager_engine_across_offloads(layout: str) -> None:
    from decoder_graph_workers import cp_graph_or_eager_steps

    args = ([*BF16, *LAYOUTS[layout]], BATCHES, 512)
    eager = run_distributed(
        cp_graph_or_eager_steps, world_size=2, args=(args[0], False, *args[1:]), backend="nccl"
    )
    graph = run_distributed(
        cp_graph_or_eager_steps, world_size=2, args=(args[0], True, *args[1:]), backend="nccl"
    )
    for rank, (e, g) in enumerate(zip(eager, graph, strict=True)):
        counts = g["counts"]
        print(layout, "rank", rank, "plans", g["plans"], "counts", dict(counts))
        assert g["plans"] == e["plans"]
        assert counts.get("graph_cp2", 0) >= 2, counts  # CP-2 micro-batches replayed, not run eagerly
        assert counts.get("cp_size", 0) == 0 and counts.get("cp_group", 0) == 0, counts
        if layout == "dynamic":  # the CP-1 micro-batches replayed their own graph
            assert counts["graph"] > counts["graph_cp2"], counts
        for step, (le, lg) in enumerate(zip(e["losses"], g["losses"], strict=True)):
            assert abs(lg - le) <= 1e-2 * abs(le), (step, lg, le)
        assert e["grads"], "no gradients"
        for name, ref in e["grads"].items():
            err = _rel(g["grads"][name], ref)
            assert err <= 5e-2, (name, err)
        for name, ref in e["params"].items():
            adam = (
                0.1 * LR * len(BATCHES) * ref.numel() ** 0.5
            )  # sign flips of near-zero gradients (module doc)
            diff = float((g["params"][name] - ref).norm())
            assert diff <= 1e-2 * float(ref.norm()) + adam, (name, diff, float(ref.norm()))
