#!/usr/bin/env python3
"""Collective bandwidth of the lent machine: what NCCL gives the engine's gradient and parameter traffic.

    NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,GRAPH,TUNING torchrun --nproc-per-node 4 \
        benchmarks/nccl_bandwidth_gpu.py --out benchmarks/results/nccl_bandwidth_h200x4.json 2> nccl.log

Why: a profile of the data-parallel step on 4 x H200 (docs/benchmarks.md, issue 36 part 5) showed the
distributed optimizer's parameter all-gathers (~95 MB buckets) at ~10 GB/s with NCCL's ``RING_LL`` kernels,
where NVLink should give hundreds of GB/s. This measures each collective the engine uses (all-gather and
reduce-scatter of a flat bf16 buffer, as megatron-core's distributed optimizer does per bucket; all-reduce,
as DDP without it does) over sizes from 1 MiB to 1 GiB, so a slow transport or protocol shows up without a
model. Per size: median seconds of ``--iters`` calls after warm-up, algorithm bandwidth (bytes of the full
buffer / s) and bus bandwidth (NCCL-tests' convention: x (n - 1) / n for all-gather and reduce-scatter,
x 2 (n - 1) / n for all-reduce), which is comparable with the link's rate. The ``NCCL_*`` environment is
recorded; ``NCCL_DEBUG=INFO`` on stderr names the transport (P2P/CUMEM, SHM, NET) and channels chosen.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from _common import slowest_rank_seconds
from _record import write_record

SIZES_MIB = (1, 4, 16, 64, 96, 256, 1024)


def timed(fn, *, iters: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        dist.barrier()
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return slowest_rank_seconds(seconds=statistics.median(times))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=list(SIZES_MIB))
    args = parser.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    rows = []
    for mib in args.sizes_mib:
        numel = mib * 2**20 // 2 // world * world  # bf16, divisible by the world size
        full = torch.ones(numel, dtype=torch.bfloat16, device="cuda")
        shard = torch.ones(numel // world, dtype=torch.bfloat16, device="cuda")
        nbytes = numel * 2
        calls = {
            "all_gather": (partial(dist.all_gather_into_tensor, full, shard), (world - 1) / world),
            "reduce_scatter": (partial(dist.reduce_scatter_tensor, shard, full), (world - 1) / world),
            "all_reduce": (partial(dist.all_reduce, full), 2 * (world - 1) / world),
        }
        for name, (fn, factor) in calls.items():
            seconds = timed(fn, iters=args.iters)
            rows.append(
                {
                    "collective": name,
                    "mib": mib,
                    "seconds": seconds,
                    "algbw_gb_s": nbytes / seconds / 1e9,
                    "busbw_gb_s": nbytes / seconds / 1e9 * factor,
                }
            )
            if rank == 0:
                print(json.dumps(rows[-1]), flush=True)
        del calls, full, shard
    if rank == 0:
        write_record(
            args.out,
            benchmark="nccl_bandwidth_gpu",
            config={
                "dtype": "bfloat16",
                "iters": args.iters,
                "nccl_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("NCCL_")},
                "nccl_version": ".".join(map(str, torch.cuda.nccl.version())),
            },
            numbers={"gpus": world, "rows": rows},
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
