"""Offload / onload bandwidth of a megatron training state against a plain pinned-memory copy.

    python3 benchmarks/offload_bandwidth.py --out benchmarks/results/offload_bandwidth_h100.json

Builds a bf16 GPTModel (local layer spec, no Transformer Engine, nothing downloaded) wrapped like
verl_engine's megatron backend (Float16Module + megatron-core DDP + get_megatron_optimizer), gives it
gradients and one optimizer step so every piece of state exists, then times
verl_mcore_utils.offload for params, grads and optimizer state separately. The reference is one
cudaMemcpy of the same number of bytes between one device tensor and one
``torch.empty(pin_memory=True)`` host tensor (D2H for offload, H2D for onload). The target is >= 80%
of that reference; ``ratio`` is measured on the wall time of the whole API call.

Two modes: ``keep_cache`` (empty_cache=False: freed memory stays in torch's cache, onload reuses it)
and ``empty_cache`` (the default of the API and what RL needs: memory goes back to the driver, so
onload pays cudaMalloc). Without CUDA the script refuses unless ``--allow-cpu`` (a tiny smoke run of
the same code path on the CPU whose numbers mean nothing).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _record import results_path, write_record

KINDS = ("params", "grads", "optimizer")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="JSON path (default benchmarks/results/offload_bandwidth_<device>.json)",
    )
    p.add_argument(
        "--preset", default="base", help="qwen2 preset (verl_mcore_utils.presets); default base: ~0.2B params"
    )
    p.add_argument("--vocab-size", type=int, default=32768)
    p.add_argument(
        "--no-distributed-optimizer",
        action="store_true",
        help="Float16Optimizer instead of DistributedOptimizer",
    )
    p.add_argument("--grad-fp32", action="store_true", help="grad_reduce_in_fp32=True (fp32 DDP grad buffer)")
    p.add_argument("--repeats", type=int, default=5, help="timed cycles per measurement (median reported)")
    p.add_argument(
        "--allow-cpu", action="store_true", help="without CUDA: tiny CPU smoke run (numbers are meaningless)"
    )
    return p.parse_args(argv)


def _init_single_process(device: str) -> None:
    from verl_mcore_utils.parallel import init_parallel
    from verl_mcore_utils.testing import free_port

    os.environ.setdefault("MASTER_PORT", str(free_port()))
    init_parallel(device=device)


def _build_gpu_state(args: argparse.Namespace) -> tuple[Any, Any, dict[str, Any]]:
    """DDP model + megatron optimizer with gradients and one step taken (all state allocated)."""
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    from verl_mcore_utils.ddp import WrapConfig, build_ddp_config
    from verl_mcore_utils.model import build_gpt_model
    from verl_mcore_utils.presets import qwen2_preset
    from verl_mcore_utils.transformer_config import hf_to_transformer_config

    dist_opt = not args.no_distributed_optimizer
    hf = qwen2_preset(args.preset, vocab_size=args.vocab_size)
    tf_config = hf_to_transformer_config(hf, dtype="bfloat16")
    torch.manual_seed(0)
    device = torch.device("cuda", torch.cuda.current_device())
    model = Float16Module(tf_config, build_gpt_model(hf_config=hf, tf_config=tf_config, device=device))
    ddp_config = build_ddp_config(
        wrap_config=WrapConfig(use_distributed_optimizer=dist_opt),
        override_ddp_config={"grad_reduce_in_fp32": args.grad_fp32},
    )
    ddp_model = DistributedDataParallel(config=tf_config, ddp_config=ddp_config, module=model)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=1e-4,
            bf16=True,
            params_dtype=torch.bfloat16,
            use_distributed_optimizer=dist_opt,
            clip_grad=1.0,
        ),
        [ddp_model],
    )
    # Gradients as the backward would leave them (the bytes matter here, not their values).
    ddp_model.zero_grad_buffer()
    gen = torch.Generator(device=device).manual_seed(0)
    for p in ddp_model.parameters():
        p.main_grad.normal_(generator=gen).mul_(1e-3)
    optimizer.step()
    torch.cuda.synchronize()
    n_params = sum(p.numel() for p in ddp_model.parameters())
    config = {
        "preset": args.preset,
        "vocab_size": args.vocab_size,
        "num_parameters": n_params,
        "dtype": "bfloat16",
        "use_distributed_optimizer": dist_opt,
        "grad_reduce_in_fp32": args.grad_fp32,
        "optimizer": [
            type(o).__name__ for o in getattr(optimizer, "chained_optimizers", None) or [optimizer]
        ],
        "repeats": args.repeats,
    }
    return ddp_model, optimizer, config


def _build_cpu_state() -> tuple[Any, Any, dict[str, Any]]:
    """Tiny unwrapped GPTModel + torch AdamW on the CPU (megatron DDP and optimizers need CUDA)."""
    from verl_mcore_utils.model import build_gpt_model
    from verl_mcore_utils.presets import qwen2_preset
    from verl_mcore_utils.transformer_config import hf_to_transformer_config

    hf = qwen2_preset("tiny", vocab_size=128)
    torch.manual_seed(0)
    model = build_gpt_model(
        hf_config=hf, tf_config=hf_to_transformer_config(hf, dtype="float32"), device="cpu"
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    optimizer.step()
    config = {"preset": "tiny", "vocab_size": 128, "dtype": "float32", "optimizer": ["AdamW"], "smoke": True}
    return model, optimizer, config


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    _sync()
    t0 = time.perf_counter()
    result = fn()
    _sync()
    return time.perf_counter() - t0, result


def _plain_copy_gbps(nbytes: int, repeats: int, on_gpu: bool) -> dict[str, float]:
    """One big device tensor <-> one pinned host tensor of ``nbytes``: the reference rate."""
    if on_gpu:
        dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    else:
        dev = torch.empty(nbytes, dtype=torch.uint8)
        host = torch.empty(nbytes, dtype=torch.uint8)
    dev.fill_(1)
    out: dict[str, float] = {}
    for name, dst, src in (("d2h", host, dev), ("h2d", dev, host)):
        dst.copy_(src, non_blocking=True)  # warm-up
        times = [
            _timed(lambda dst=dst, src=src: dst.copy_(src, non_blocking=True))[0] for _ in range(repeats)
        ]
        out[f"{name}_gbps"] = nbytes / statistics.median(times) / 1e9
    del dev, host
    if on_gpu:
        torch.cuda.empty_cache()
    return out


def _measure(model: Any, optimizer: Any, *, repeats: int, empty_cache: bool) -> dict[str, Any]:
    from verl_mcore_utils import offload as off

    def cycle(kind: str) -> tuple[float, Any, float, Any]:
        if kind == "optimizer":
            t_off, s_off = _timed(lambda: off.offload_megatron_optimizer(optimizer, empty_cache=empty_cache))
            t_on, s_on = _timed(lambda: off.onload_megatron_optimizer(optimizer))
        else:
            sel = {"params": kind == "params", "grads": kind == "grads"}
            t_off, s_off = _timed(lambda: off.offload_megatron_model([model], empty_cache=empty_cache, **sel))
            t_on, s_on = _timed(lambda: off.onload_megatron_model([model], **sel))
        return t_off, s_off, t_on, s_on

    results: dict[str, Any] = {}
    for kind in KINDS:
        first = cycle(kind)  # allocates and page-locks the host buffers once
        walls_off, walls_on, xfer_off, xfer_on = [], [], [], []
        for _ in range(repeats):
            t_off, s_off, t_on, s_on = cycle(kind)
            assert s_off.host_bytes_allocated == 0, "host buffers must be reused"
            walls_off.append(t_off)
            walls_on.append(t_on)
            xfer_off.append(s_off.seconds)
            xfer_on.append(s_on.seconds)
        nbytes = first[1].total_bytes
        results[kind] = {
            "bytes": nbytes,
            "num_storages": first[1].num_storages,
            "first_offload_setup_seconds": first[1].setup_seconds,
            "offload_gbps": nbytes / statistics.median(walls_off) / 1e9,
            "onload_gbps": nbytes / statistics.median(walls_on) / 1e9,
            "offload_transfer_gbps": nbytes / statistics.median(xfer_off) / 1e9,
            "onload_transfer_gbps": nbytes / statistics.median(xfer_on) / 1e9,
        }
    return results


def _memory_check(model: Any, optimizer: Any, on_gpu: bool) -> dict[str, Any]:
    """Everything at once: device memory released, host memory exactly one copy."""
    from verl_mcore_utils import offload as off

    if not on_gpu:
        return {}
    _sync()
    before = torch.cuda.memory_allocated()
    reserved_before = torch.cuda.memory_reserved()
    s_model = off.offload_megatron_model([model])
    s_opt = off.offload_megatron_optimizer(optimizer)
    moved = s_model.total_bytes + s_opt.total_bytes
    check = {
        "offloaded_bytes": moved,
        "allocated_freed_bytes": before - torch.cuda.memory_allocated(),
        "reserved_freed_bytes": reserved_before - torch.cuda.memory_reserved(),
        "host_bytes": off.get_offload_state(model).host_bytes()
        + off.get_offload_state(optimizer).host_bytes(),
    }
    off.onload_megatron_model([model])
    off.onload_megatron_optimizer(optimizer)
    check["host_bytes_equal_device_bytes"] = check["host_bytes"] == moved
    check["freed_fraction"] = check["allocated_freed_bytes"] / moved if moved else float("nan")
    return check


def _device_slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    on_gpu = torch.cuda.is_available()
    if not on_gpu and not args.allow_cpu:
        print(
            "offload_bandwidth: no CUDA device visible; this benchmark measures host<->GPU copies."
            " Run it on a GPU host, or pass --allow-cpu for a meaningless CPU smoke run.",
            file=sys.stderr,
        )
        return 2
    repeats = args.repeats if on_gpu else min(args.repeats, 2)
    _init_single_process("cuda" if on_gpu else "cpu")
    model, optimizer, config = _build_gpu_state(args) if on_gpu else _build_cpu_state()
    device_name = torch.cuda.get_device_name() if on_gpu else "cpu"

    modes: dict[str, Any] = {}
    for mode, empty_cache in (("keep_cache", False), ("empty_cache", True)):
        modes[mode] = _measure(model, optimizer, repeats=repeats, empty_cache=empty_cache)
    reference: dict[str, Any] = {}
    for kind in KINDS:
        reference[kind] = _plain_copy_gbps(modes["keep_cache"][kind]["bytes"], repeats, on_gpu)
        for mode in modes.values():
            r = mode[kind]
            r["offload_ratio"] = r["offload_gbps"] / reference[kind]["d2h_gbps"]
            r["onload_ratio"] = r["onload_gbps"] / reference[kind]["h2d_gbps"]
    memory = _memory_check(model, optimizer, on_gpu)
    ratios = [
        v for mode in modes.values() for r in mode.values() for k, v in r.items() if k.endswith("_ratio")
    ]
    out = args.out or results_path(f"offload_bandwidth_{_device_slug(device_name)}.json")
    write_record(
        out,
        benchmark="offload_bandwidth",
        device=device_name,
        config={**config, "repeats": repeats},
        more_versions={"cuda": torch.version.cuda},
        numbers={
            "smoke_only": not on_gpu,
            "bytes": {kind: modes["keep_cache"][kind]["bytes"] for kind in KINDS},
            "reference_plain_pinned_copy": reference,
            "modes": modes,
            "memory_check": memory,
            "target_ratio": 0.8,
            "min_ratio": min(ratios),
            "min_ratio_keep_cache": min(
                v for r in modes["keep_cache"].values() for k, v in r.items() if k.endswith("_ratio")
            ),
            "unix_time": int(time.time()),
        },
    )
    for mode, per_kind in modes.items():
        for kind, r in per_kind.items():
            print(
                f"{mode:12s} {kind:10s} {r['bytes'] / 1e9:7.3f} GB  offload {r['offload_gbps']:6.2f} GB/s"
                f" ({r['offload_ratio']:.0%})  onload {r['onload_gbps']:6.2f} GB/s ({r['onload_ratio']:.0%})"
            )
    print(f"wrote {out}")
    from verl_mcore_utils.parallel import destroy_parallel

    destroy_parallel()
    return 0


if __name__ == "__main__":
    sys.exit(main())
