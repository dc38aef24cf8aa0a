"""The optimizer step without Transformer Engine: torch's foreach Adam (megatron-core's fallback) vs fused.

    cd benchmarks && python3 fused_adam_gpu.py --out results/fused_adam_h100.json

A Qwen2.5-1.5B-shaped (and 0.5B-shaped) megatron-core GPTModel in bf16 with megatron-core's DDP and the
distributed optimizer (one GPU: the shard is everything), gradients filled with random values, then
``optimizer.step()`` timed (median of 10 after 3 warm-up steps) with the torch Adam's param groups set to
foreach and to fused (``verl_mcore_utils.use_fused_torch_adam``). Beside it, in the same run: the device's
copy bandwidth (a 2 GiB device-to-device copy, bytes read + written / time) and each step's
memory-bandwidth bound: Adam reads fp32 weight, gradient and both moments and writes weight and moments
(28 bytes per parameter); megatron's whole step adds the gradient norm (4 B read), the clip (8 B) and the
copy of the fp32 weights into the bf16 model (6 B): 46 bytes per parameter.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from _record import write_record

SHAPES = {  # Qwen2.5 shapes (hidden, intermediate, layers, heads, kv heads, vocab, tied embeddings)
    "qwen2.5-0.5b": (896, 4864, 24, 14, 2, 151936, True),
    "qwen2.5-1.5b": (1536, 8960, 28, 12, 2, 151936, True),
}


def hf_config(shape: str) -> dict:
    hidden, inter, layers, heads, kv, vocab, tied = SHAPES[shape]
    return {
        "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": hidden,
        "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv, "vocab_size": vocab, "tie_word_embeddings": tied,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 1e6, "hidden_act": "silu",
        "torch_dtype": "bfloat16",
    }  # fmt: skip


def copy_bandwidth_gb_s() -> float:
    src = torch.empty(2**29, dtype=torch.float32, device="cuda")  # 2 GiB
    dst = torch.empty_like(src)
    times = []
    for _ in range(5):
        torch.cuda.synchronize()
        t = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return 2 * src.numel() * 4 / min(times) / 1e9


def timed_steps(optimizer, n: int = 10) -> list[float]:
    out = []
    for i in range(n + 3):
        torch.cuda.synchronize()
        t = time.perf_counter()
        optimizer.step()
        torch.cuda.synchronize()
        if i >= 3:
            out.append(time.perf_counter() - t)
    return out


def bench_shape(shape: str, bw: float) -> dict:
    from megatron.core.optimizer import OptimizerConfig

    from verl_mcore_utils.compat import make_megatron_optimizer
    from verl_mcore_utils.ddp import WrapConfig
    from verl_mcore_utils.module import GPTModelProvider, make_megatron_module
    from verl_mcore_utils.offload import inner_torch_optimizer, leaf_optimizers
    from verl_mcore_utils.transformer_config import hf_to_transformer_config

    hf = hf_config(shape)
    chunks = make_megatron_module(
        GPTModelProvider(
            hf_config=hf,
            transformer_config=hf_to_transformer_config(hf, dtype="bfloat16"),
            device=torch.device("cuda"),
        ),
        wrap_config=WrapConfig(use_distributed_optimizer=True),
    )
    config = OptimizerConfig(
        optimizer="adam",
        lr=1e-5,
        clip_grad=1.0,
        bf16=True,
        params_dtype=torch.bfloat16,
        use_distributed_optimizer=True,
    )
    optimizer = make_megatron_optimizer(config, chunks, fused_adam=False)
    n_params = sum(p.numel() for p in chunks[0].parameters())
    for buffer in chunks[0].buffers:
        buffer.grad_data.normal_(0, 1e-3)
    inner = [inner_torch_optimizer(leaf) for leaf in leaf_optimizers(optimizer)]
    out = {"params": n_params}
    for impl in ("foreach", "fused"):
        for opt in inner:
            for group in opt.param_groups:
                group["fused"], group["foreach"] = impl == "fused", impl == "foreach"
            for state in opt.state.values():  # fused needs the step counters on the device
                if "step" in state:
                    state["step"] = (
                        state["step"].to("cuda", torch.float32) if impl == "fused" else state["step"].cpu()
                    )
        whole = timed_steps(optimizer)
        with_grad = sum(p.grad is not None for opt in inner for g in opt.param_groups for p in g["params"])
        total = sum(len(g["params"]) for opt in inner for g in opt.param_groups)
        if with_grad != total:
            raise RuntimeError(
                f"{total - with_grad} of {total} master params have no .grad: Adam alone would skip them"
            )
        adam = []
        for _ in range(13):
            torch.cuda.synchronize()
            t = time.perf_counter()
            for opt in inner:
                opt.step()
            torch.cuda.synchronize()
            adam.append(time.perf_counter() - t)
        out[impl] = {
            "megatron_step_ms": 1e3 * statistics.median(whole),
            "adam_only_ms": 1e3 * statistics.median(adam[3:]),
        }
    out["bound_ms"] = {
        "adam_only": 1e3 * 28 * n_params / (bw * 1e9),
        "megatron_step": 1e3 * 46 * n_params / (bw * 1e9),
    }
    for impl in ("foreach", "fused"):
        out[impl]["adam_x_bound"] = out[impl]["adam_only_ms"] / out["bound_ms"]["adam_only"]
        out[impl]["step_x_bound"] = out[impl]["megatron_step_ms"] / out["bound_ms"]["megatron_step"]
    out["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    del chunks, optimizer, inner
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES))
    args = parser.parse_args()
    import os

    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from verl_mcore_utils.parallel import init_parallel

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    torch.distributed.init_process_group("nccl")
    torch.cuda.set_device(0)
    init_parallel(device="cuda")
    model_parallel_cuda_manual_seed(0)
    bw = copy_bandwidth_gb_s()
    results = {shape: bench_shape(shape, bw) for shape in args.shapes}
    props = torch.cuda.get_device_properties(0)
    report = write_record(
        args.out,
        benchmark="fused_adam_gpu",
        device={"name": props.name, "memory_gib": props.total_memory / 2**30},
        config={k: v for k, v in vars(args).items() if k != "out"},
        numbers={"copy_bandwidth_gb_s": bw, "results": results},
    )
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
