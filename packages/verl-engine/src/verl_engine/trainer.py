"""The SFT loop behind ``verl-engine train``: data -> engine.train_step -> metrics.

Rank 0 shows a progress bar, prints a summary and writes one JSON line per step to
``<default_local_dir>/metrics.jsonl`` (plus ``summary.json`` at the end).
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from verl_config import SFTConfig
from verl_engine.demo import ArithmeticDataset, CharTokenizer
from verl_engine.engine import build_engine, lr_at_step
from verl_engine.packed import cp_layout_from_config
from verl_mcore_utils.compat import mcore_version
from verl_mcore_utils.parallel import destroy_parallel, init_parallel
from verl_mcore_utils.presets import qwen2_preset

__all__ = ["RunSummary", "resolve_device", "train"]


@dataclass(frozen=True)
class RunSummary:
    steps: int
    first_loss: float  # mean of the first 5 steps
    last_loss: float  # mean of the last 5 steps
    tokens_per_s: float  # global tokens (all positions) per second, steps after the first
    peak_memory_gib: float
    backend: str
    world_size: int
    dp: int
    metrics_path: str


def resolve_device(name: str) -> torch.device:
    """'auto' -> CUDA when a GPU is visible, else CPU; 'cuda' without a GPU is a clear error."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(
                "trainer.device=cuda but no CUDA device is visible; use trainer.device=cpu (debug mode)"
            )
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def _peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def train(cfg: SFTConfig) -> RunSummary:
    """Run ``cfg.trainer.total_training_steps`` SFT steps; return the run summary (on every rank)."""
    device = resolve_device(cfg.trainer.device)
    m = cfg.megatron
    dims = init_parallel(
        tensor_model_parallel_size=m.tensor_model_parallel_size,
        pipeline_model_parallel_size=m.pipeline_model_parallel_size,
        # packed (CP) runs keep megatron's CP at 1: verl-dyncp's groups split the DP x CP pool
        context_parallel_size=1 if _packed(cfg) else m.context_parallel_size,
        device=device.type,
    )
    try:
        return _train(cfg, device=device, dims=dims)
    finally:
        destroy_parallel()


def _packed(cfg: SFTConfig) -> bool:
    """Context parallelism (static > 1 or dynamic) runs on packed sequences."""
    return cfg.megatron.dynamic_context_parallel or cfg.megatron.context_parallel_size > 1


def _train(cfg: SFTConfig, *, device: torch.device, dims: Any) -> RunSummary:
    from megatron.core import parallel_state

    # packed runs: the DP x CP pool shares every micro-batch, so the padded micro-batch rule does not apply
    dp = dims.dp if _packed(cfg) else cfg.check_world_size(dims.world_size)
    rank = torch.distributed.get_rank()
    is_main = rank == 0
    tokenizer = CharTokenizer()
    vocab = tokenizer.padded_vocab_size(128 * cfg.megatron.tensor_model_parallel_size)
    hf_config = qwen2_preset(cfg.model.preset, vocab_size=vocab, **cfg.model.override_config)
    layout = None
    if _packed(cfg):
        # The same token budget per rank as a padded micro-batch.
        layout = cp_layout_from_config(
            cfg.megatron, max_tokens_per_rank=cfg.data.micro_batch_size_per_gpu * cfg.data.max_length
        )
    engine = build_engine(cfg, hf_config=hf_config, dims=dims, device=device, cp_layout=layout)
    n_params = sum(p.numel() for p in engine.model.parameters())
    engine_info = engine.describe()
    dataset = ArithmeticDataset(seq_length=cfg.data.max_length, seed=cfg.data.seed, tokenizer=tokenizer)
    dp_rank = parallel_state.get_data_parallel_rank()
    out_dir = Path(cfg.trainer.default_local_dir)
    metrics_path = out_dir / "metrics.jsonl"
    steps = cfg.trainer.total_training_steps
    if is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
        metrics_path.write_text("")
        if engine.debug:
            print(
                "=" * 78,
                "\nDEBUG MODE (no GPU): gloo process group, no DDP wrapper, torch.optim.AdamW, float32.\n"
                "Same megatron-core model code; speed numbers are not representative.\n" + "=" * 78,
                flush=True,
            )
        print(
            f"verl-engine train: preset={cfg.model.preset} params/rank={n_params / 1e6:.2f}M world={dims.world_size}"
            f" dp={dp} tp={dims.tp} backend={engine.backend} device={device} megatron-core={mcore_version()}"
            f" torch={torch.__version__} steps={steps} global_batch={cfg.data.train_batch_size}"
            f" micro_batch={cfg.data.micro_batch_size_per_gpu} seq={cfg.data.max_length}",
            flush=True,
        )
        print(f"engine: {json.dumps(engine_info)}", flush=True)
    bar = None
    if is_main and cfg.trainer.progress_bar:
        from tqdm import tqdm

        bar = tqdm(total=steps, desc="train", unit="step", file=sys.stdout, dynamic_ncols=True)
    losses: list[float] = []
    timed_tokens, timed_seconds = 0, 0.0
    tokens_per_step = cfg.data.train_batch_size * cfg.data.max_length
    for step in range(steps):
        batch = dataset.global_batch(step=step, batch_size=cfg.data.train_batch_size)
        lr = lr_at_step(
            step,
            total_steps=steps,
            lr=cfg.optim.lr,
            min_lr=cfg.optim.min_lr,
            warmup_steps=cfg.optim.lr_warmup_steps,
            style=cfg.optim.lr_decay_style,
        )
        start = time.perf_counter()
        if layout is not None:  # the whole batch on every rank; the planner splits it
            metrics = engine.train_step_packed(batch.to_packed(pad_id=tokenizer.pad_id), lr=lr)
        else:
            local = batch.shard(rank=dp_rank, num_shards=dp).micro_batches(cfg.data.micro_batch_size_per_gpu)
            metrics = engine.train_step(local, lr=lr)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - start
        if step > 0:  # the first step includes one-off allocation and kernel selection
            timed_tokens += tokens_per_step
            timed_seconds += elapsed
        losses.append(metrics.loss)
        record = {
            "step": step + 1,
            **asdict(metrics),
            "step_time_s": elapsed,
            "tokens_per_s": tokens_per_step / elapsed,
            "peak_memory_gib": _peak_memory_gib(device),
        }
        if not (math.isfinite(metrics.loss) and math.isfinite(metrics.grad_norm)):
            raise FloatingPointError(
                f"step {step + 1}: loss {metrics.loss} / grad norm {metrics.grad_norm} is NaN"
            )
        if is_main:
            with metrics_path.open("a") as f:
                f.write(json.dumps(record) + "\n")
            if bar is not None:
                bar.set_postfix(
                    loss=f"{metrics.loss:.4f}", tok_s=f"{record['tokens_per_s']:.0f}", refresh=False
                )
                bar.update(1)
            if (step + 1) % cfg.trainer.log_every == 0 and bar is None:
                print(
                    f"step {step + 1}/{steps} loss {metrics.loss:.4f} grad_norm {metrics.grad_norm:.3f} lr {lr:.2e}"
                    f" tokens/s {record['tokens_per_s']:.0f} peak_mem {record['peak_memory_gib']:.2f} GiB",
                    flush=True,
                )
    if bar is not None:
        bar.close()
    summary = RunSummary(
        steps=steps,
        first_loss=_mean(losses[:5]),
        last_loss=_mean(losses[-5:]),
        tokens_per_s=timed_tokens / timed_seconds if timed_seconds > 0 else float("nan"),
        peak_memory_gib=_peak_memory_gib(device),
        backend=engine.backend,
        world_size=dims.world_size,
        dp=dp,
        metrics_path=str(metrics_path),
    )
    if is_main:
        (out_dir / "summary.json").write_text(
            json.dumps(
                {
                    **asdict(summary),
                    "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                    "torch": torch.__version__,
                    "megatron_core": str(mcore_version()),
                    "engine": engine_info,
                    "config": asdict(cfg),
                },
                indent=2,
            )
        )
        print(
            f"done: loss {summary.first_loss:.4f} -> {summary.last_loss:.4f} (mean of first/last 5 steps), "
            f"{summary.tokens_per_s:.0f} tokens/s, peak memory {summary.peak_memory_gib:.2f} GiB, "
            f"metrics: {metrics_path}",
            flush=True,
        )
    return summary
