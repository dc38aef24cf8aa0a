"""The SFT loop behind ``verl-engine train``: demo data -> the engine's ``train_batch`` with ``sft_loss`` -> metrics.

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
from verl_engine.apps.demo import ArithmeticDataset, CharTokenizer
from verl_engine.build import build_rl_engine
from verl_engine.engine import RLEngine
from verl_engine.losses import sft_loss
from verl_engine.micro_batching import MicroBatching
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
        virtual_pipeline_model_parallel_size=m.virtual_pipeline_model_parallel_size,
        context_parallel_size=1,  # CP (static or dynamic) runs in verl-dyncp's groups over the DP x CP pool
        device=device.type,
    )
    try:  # a layout error below still releases the process groups
        if not m.dynamic_context_parallel:
            cfg.check_world_size(dims.world_size)
        engine = build_sft_engine(cfg, device=device)
        with engine:
            return _train(cfg, engine=engine, dims=dims, device=device)
    finally:
        destroy_parallel()


def build_sft_engine(cfg: SFTConfig, *, device: torch.device) -> RLEngine:
    """The engine of the run: the preset model (or ``model.path``) with the SFT optimizer section."""
    m, data = cfg.megatron, cfg.data
    hf_config = None
    if cfg.model.path is None:
        vocab = CharTokenizer().padded_vocab_size(128 * m.tensor_model_parallel_size)
        hf_config = qwen2_preset(cfg.model.preset, vocab_size=vocab, **cfg.model.override_config)
    return build_rl_engine(
        engine=m,
        model_path=cfg.model.path,
        optim=cfg.optim,
        micro_batching=MicroBatching(
            use_dynamic_bsz=bool(m.use_dynamic_bsz),
            max_token_len_per_gpu=m.max_token_len_per_gpu or data.micro_batch_size_per_gpu * data.max_length,
            micro_batch_size_per_gpu=data.micro_batch_size_per_gpu,
        ),
        device=device,
        hf_config=hf_config,
        override_model_config=cfg.model.override_config if cfg.model.path else None,
        total_training_steps=cfg.trainer.total_training_steps,
        fused_lm_head=cfg.model.use_fused_kernels,
    )


def _announce(cfg: SFTConfig, *, engine: RLEngine, dims: Any, device: torch.device, out_dir: Path) -> None:
    """Rank 0's header: what runs, on what, with which versions."""
    n_params = sum(p.numel() for p in engine.model.parameters())
    info = engine.describe()
    if device.type == "cpu":
        print(
            "=" * 78,
            "\nDEBUG MODE (no GPU): gloo process group, no DDP wrapper, torch.optim.AdamW, float32.\n"
            "Same megatron-core model code; speed numbers are not representative.\n" + "=" * 78,
            flush=True,
        )
    print(
        f"verl-engine train: preset={cfg.model.preset} params/rank={n_params / 1e6:.2f}M world={dims.world_size}"
        f" pool={engine.pool_size} tp={dims.tp} backend={info['backend']} device={device}"
        f" megatron-core={mcore_version()} torch={torch.__version__} steps={cfg.trainer.total_training_steps}"
        f" global_batch={cfg.data.train_batch_size} micro_batch={cfg.data.micro_batch_size_per_gpu}"
        f" seq={cfg.data.max_length} out={out_dir}",
        flush=True,
    )
    print(f"engine: {json.dumps(info)}", flush=True)


def _step(engine: RLEngine, batch: dict[str, torch.Tensor], *, device: torch.device) -> dict[str, float]:
    """One optimizer step at the schedule's learning rate; the record of it (identical on every rank)."""
    lr = engine.get_lr()
    start = time.perf_counter()
    with engine.train_mode():
        out = engine.train_batch(batch, sft_loss)
    engine.lr_scheduler_step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = time.perf_counter() - start
    loss, grad_norm = float(out["loss"]), float(out["metrics"]["grad_norm"])
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        raise FloatingPointError(f"loss {loss} / grad norm {grad_norm} is not finite")
    return {
        "loss": loss,
        "grad_norm": grad_norm,
        "loss_tokens": int(batch["response_mask"].sum()),
        "lr": lr,
        "step_time_s": elapsed,
        "peak_memory_gib": _peak_memory_gib(device),
    }


def _train(cfg: SFTConfig, *, engine: RLEngine, dims: Any, device: torch.device) -> RunSummary:
    is_main = torch.distributed.get_rank() == 0
    dataset = ArithmeticDataset(seq_length=cfg.data.max_length, seed=cfg.data.seed, tokenizer=CharTokenizer())
    out_dir = Path(cfg.trainer.default_local_dir)
    metrics_path = out_dir / "metrics.jsonl"
    steps = cfg.trainer.total_training_steps
    if is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
        metrics_path.write_text("")
        _announce(cfg, engine=engine, dims=dims, device=device, out_dir=out_dir)
    log = _StepLog(cfg, path=metrics_path, enabled=is_main)
    for step in range(steps):
        record = _step(
            engine, dataset.global_batch(step=step, batch_size=cfg.data.train_batch_size), device=device
        )
        log.add(step + 1, record)
    log.close()
    summary = RunSummary(
        steps=steps,
        first_loss=_mean(log.losses[:5]),
        last_loss=_mean(log.losses[-5:]),
        tokens_per_s=log.tokens_per_s(),
        peak_memory_gib=_peak_memory_gib(device),
        backend=engine.describe()["backend"],
        world_size=dims.world_size,
        dp=engine.pool_size,
        metrics_path=str(metrics_path),
    )
    if is_main:
        _write_summary(cfg, summary, engine=engine, device=device, out_dir=out_dir)
    return summary


class _StepLog:
    """Rank 0's per-step output: a JSON line per step, a progress bar or a line per ``log_every`` steps."""

    def __init__(self, cfg: SFTConfig, *, path: Path, enabled: bool) -> None:
        self.cfg, self.path, self.enabled = cfg, path, enabled
        self.losses: list[float] = []
        self.timed_tokens, self.timed_seconds = 0, 0.0
        self.tokens_per_step = cfg.data.train_batch_size * cfg.data.max_length
        self.bar = None
        if enabled and cfg.trainer.progress_bar:
            from tqdm import tqdm  # type: ignore[import-untyped]  # no stubs installed (types-tqdm)

            total = cfg.trainer.total_training_steps
            self.bar = tqdm(total=total, desc="train", unit="step", file=sys.stdout, dynamic_ncols=True)

    def add(self, step: int, record: dict[str, float]) -> None:
        self.losses.append(record["loss"])
        if step > 1:  # the first step includes one-off allocation and kernel selection
            self.timed_tokens += self.tokens_per_step
            self.timed_seconds += record["step_time_s"]
        record = {"step": step, **record, "tokens_per_s": self.tokens_per_step / record["step_time_s"]}
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.bar is not None:
            self.bar.set_postfix(
                loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:.0f}", refresh=False
            )
            self.bar.update(1)
        elif step % self.cfg.trainer.log_every == 0:
            print(
                f"step {step}/{self.cfg.trainer.total_training_steps} loss {record['loss']:.4f}"
                f" grad_norm {record['grad_norm']:.3f} lr {record['lr']:.2e} tokens/s {record['tokens_per_s']:.0f}"
                f" peak_mem {record['peak_memory_gib']:.2f} GiB",
                flush=True,
            )

    def tokens_per_s(self) -> float:
        return self.timed_tokens / self.timed_seconds if self.timed_seconds > 0 else float("nan")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _write_summary(
    cfg: SFTConfig, summary: RunSummary, *, engine: RLEngine, device: torch.device, out_dir: Path
) -> None:
    record = {
        **asdict(summary),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "megatron_core": str(mcore_version()),
        "engine": engine.describe(),
        "config": asdict(cfg),
    }
    (out_dir / "summary.json").write_text(json.dumps(record, indent=2))
    print(
        f"done: loss {summary.first_loss:.4f} -> {summary.last_loss:.4f} (mean of first/last 5 steps), "
        f"{summary.tokens_per_s:.0f} tokens/s, peak memory {summary.peak_memory_gib:.2f} GiB, "
        f"metrics: {summary.metrics_path}",
        flush=True,
    )
