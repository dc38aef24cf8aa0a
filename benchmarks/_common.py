"""Shared pieces of the engine benchmarks: Qwen2.5-shaped models, synthetic batches, timing, engine set-up.

Imported by the benchmark scripts (``from _common import ...``), which run with benchmarks/ on ``sys.path``;
no benchmark imports another benchmark script.
"""

from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

SHAPES = {  # Qwen2.5 shapes (hidden, intermediate, layers, heads, kv heads, vocab, tied embeddings)
    "qwen2.5-0.5b": (896, 4864, 24, 14, 2, 151936, True),
    "qwen2.5-1.5b": (1536, 8960, 28, 12, 2, 151936, True),
    "qwen2.5-7b": (3584, 18944, 28, 28, 4, 152064, False),
}
PEAK_BF16_TFLOPS = 989.0  # H100 / H200 SXM dense bf16


def flops_per_sequence(shape: str, length: int) -> float:
    """Megatron-LM's model FLOPs of one training pass (forward + backward) over one sequence.

    Per token and layer, forward: QKV ``2 h (h + 2 kv_dim)``, attention output ``2 h^2``, SwiGLU MLP
    ``2 * 3 h f``, attention scores and values ``2 * 2 s h`` (full s, as Megatron-LM counts); plus the LM
    head ``2 h V``. Training = 3 x forward.
    """
    hidden, inter, layers, heads, kv, vocab, _ = SHAPES[shape]
    kv_dim = kv * hidden // heads
    per_layer = 2 * hidden * (hidden + 2 * kv_dim) + 2 * hidden * hidden + 6 * hidden * inter
    per_layer += 4 * length * hidden
    forward = length * (layers * per_layer + 2 * hidden * vocab)
    return 3.0 * forward


def hf_config(shape: str, *, seq: int) -> dict:
    """A Hugging Face config.json dict of one of ``SHAPES`` (the engine builds random weights from it)."""
    hidden, inter, layers, heads, kv, vocab, tied = SHAPES[shape]
    return {
        "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": hidden,
        "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv, "vocab_size": vocab, "tie_word_embeddings": tied,
        "max_position_embeddings": max(seq, 4096), "rms_norm_eps": 1e-6, "rope_theta": 1e6,
        "hidden_act": "silu", "torch_dtype": "bfloat16",
    }  # fmt: skip


def lengths_for(kind: str, *, count: int, seq: int, seed: int) -> list[int]:
    """``count`` sequence lengths: all ``seq`` (``fixed``) or log-uniform from 256 to ``seq`` (``varied``)."""
    if kind == "fixed":
        return [seq] * count
    g = torch.Generator().manual_seed(seed)
    # log-uniform from 256 to seq: many short sequences, a long tail
    u = torch.rand(count, generator=g)
    return [int(math.exp(math.log(256) + float(x) * (math.log(seq) - math.log(256)))) for x in u]


def _ppo_batch(
    ids: torch.Tensor, mask: torch.Tensor, *, prompt: int, generator: torch.Generator
) -> dict[str, torch.Tensor]:
    """verl's padded batch around ``ids`` / ``mask`` [n, prompt + response]: PPO tensors of the response part
    (advantages drawn from ``generator`` after the tokens, so each caller's random stream is unchanged)."""
    n, response = ids.shape[0], ids.shape[1] - prompt
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "position_ids": (mask.cumsum(1) - 1).clamp(min=0),
        "response_mask": mask[:, prompt:].clone(),
        "old_log_probs": torch.full((n, response), -11.0),
        "ref_log_prob": torch.full((n, response), -11.0),
        "advantages": torch.randn((n, response), generator=generator),
    }


def make_batch(lengths: list[int], *, vocab: int, seed: int) -> dict[str, torch.Tensor]:
    """verl's padded layout: a 64-token prompt (left-padded) and the rest as the response."""
    g = torch.Generator().manual_seed(seed)
    prompt = 64
    response = max(lengths) - prompt
    n = len(lengths)
    ids = torch.zeros((n, prompt + response), dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for i, length in enumerate(lengths):
        ids[i, :length] = torch.randint(
            1, vocab, (length,), generator=g
        )  # prompt whole, response right-padded
        mask[i, :length] = 1
    return _ppo_batch(ids, mask, prompt=prompt, generator=g)


def synced(fn):
    """``(fn(), seconds)`` with the GPU's queue drained before and after, so the time is the work's own."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - t


def slowest_rank_seconds(*, seconds: float, device: torch.device | str = "cuda") -> float:
    """The largest of every rank's ``seconds`` (an all-reduce MAX on ``device``, in float64).

    A distributed step is as slow as its slowest rank (the others wait for it in the next collective), so a
    time reported for the step is the slowest rank's, not rank 0's own.
    """
    t = torch.tensor([seconds], device=device, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def train_step(engine, loss_fn, data, optimizer_s: list[float]):
    """One optimizer step; the optimizer's own (synchronised) seconds are appended to ``optimizer_s``."""
    engine.optimizer_zero_grad()
    result = engine.forward_backward_batch(data, loss_fn, forward_only=False)
    _, seconds = synced(engine.optimizer_step)
    optimizer_s.append(seconds)
    return result


def build(
    shape: str,
    *,
    seq: int,
    fused: bool,
    sequences: int,
    recompute: bool = False,
    extra: tuple[str, ...] = (),
    max_token_len: int | None = None,
) -> tuple:
    """An RL engine (actor role, megatron backend, random weights) of ``shape`` from verl-config overrides.

    Returns ``(engine, config)``; ``recompute`` turns on full activation recompute, ``extra`` adds overrides.
    """
    from verl_config import load_config
    from verl_engine.build import rl_engine_from_config

    overrides = [
        "model_engine=megatron",
        "actor_rollout_ref.model.path=random-init",
        "critic.model.path=${actor_rollout_ref.model.path}",  # GAE (the default) uses the critic: give its model
        f"actor_rollout_ref.model.use_fused_kernels={str(fused).lower()}",
        "trainer.n_gpus_per_node=1",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "data.max_prompt_length=64",
        f"data.max_response_length={seq - 64}",
        f"data.train_batch_size={sequences}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={sequences}",
        "actor_rollout_ref.actor.use_dynamic_bsz=true",
        f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={max_token_len or seq}",
        "actor_rollout_ref.actor.optim.total_training_steps=100",
        "actor_rollout_ref.actor.entropy_coeff=0.001",
        "actor_rollout_ref.actor.megatron.sequence_parallel=false",
    ]
    if recompute:  # megatron-core's full activation recompute, one layer per checkpoint
        mc = "actor_rollout_ref.actor.megatron.override_transformer_config"
        overrides += [
            f"{mc}.recompute_granularity=full",
            f"{mc}.recompute_method=uniform",
            f"{mc}.recompute_num_layers=1",
        ]
    cfg = load_config(overrides=[*overrides, *extra])
    device = torch.device("cuda", torch.cuda.current_device())
    engine = rl_engine_from_config(cfg, role="actor", device=device, hf_config=hf_config(shape, seq=seq))
    return engine, cfg


QWEN25_05B = {
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}


def save_model(path: Path, *, layers: int, extra: dict | None = None, small_init: bool = True) -> Path:
    """A random Qwen2.5-0.5B-shaped checkpoint (``layers`` decoder layers) saved with save_pretrained.

    ``extra`` adds config.json keys (e.g. ``num_nextn_predict_layers``); ``small_init`` redraws every
    weight as N(0, 0.02) and every norm as 1 + N(0, 0.02), else transformers' own initialisation is kept.
    """
    import transformers

    shape = {**QWEN25_05B, "num_hidden_layers": layers, **(extra or {})}
    config = transformers.Qwen2Config(**shape, torch_dtype="float32")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    if small_init:
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(
                    1.0 + 0.02 * torch.randn_like(p)
                    if name.endswith("norm.weight")
                    else 0.02 * torch.randn_like(p)
                )
    model.save_pretrained(path, safe_serialization=True)
    return path


def rl_batch(*, n: int, prompt: int, response: int, vocab: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    p_lens = torch.randint(prompt // 4, prompt + 1, (n,), generator=g).tolist()
    r_lens = torch.randint(response // 8, response + 1, (n,), generator=g).tolist()
    ids = torch.zeros((n, prompt + response), dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for i, (pl, rl) in enumerate(zip(p_lens, r_lens, strict=True)):
        ids[i, prompt - pl : prompt + rl] = torch.randint(1, vocab, (pl + rl,), generator=g)
        mask[i, prompt - pl : prompt + rl] = 1
    return {
        **_ppo_batch(ids, mask, prompt=prompt, generator=g),
        "values": torch.zeros((n, response)),
        "returns": torch.randn((n, response), generator=g),
    }


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class StepProfile:
    """Where one step's time goes, when ``BENCH_PROFILE_DIR`` is set; without it, nothing (no overhead).

    ``BENCH_PROFILE_KIND=torch`` (default): torch.profiler over the calls wrapped in ``with profile(label):``,
    written per rank to ``<dir>/<label>_rank<r>.txt`` as two operator tables (CUDA time, host time; top 40)
    and, first, the GPU timeline in four numbers (:func:`gpu_timeline`): how long the kernels' window was,
    how much of it no kernel ran (the GPU waited for the host or for another rank), how much NCCL time no
    compute kernel overlapped (exposed communication), and how much compute ran; then the longest idle
    gaps with what the host was doing in each (:func:`idle_gaps`; ``BENCH_PROFILE_STACK=1`` adds the Python
    frames, at some host cost). With
    ``BENCH_PROFILE_TRACE=1`` also the chrome trace, gzipped. ``BENCH_PROFILE_KIND=python``: cProfile of the
    host instead (what Python spends a host-bound step on), top 60 functions by own time and by cumulative
    time, and the callers of the costliest twelve, to ``<dir>/<label>_python_rank<r>.txt``.
    ``BENCH_PROFILE_KIND=memory``: the allocator's history over the step, replayed to its peak
    (:mod:`_memory_peak`): which sites hold the transient memory
    then, as JSON to ``<dir>/<label>_memory_rank<r>.txt``.
    """

    def __init__(self) -> None:
        import os

        self.folder = os.environ.get("BENCH_PROFILE_DIR")
        self.kind = os.environ.get("BENCH_PROFILE_KIND", "torch")
        if self.kind not in ("torch", "python", "memory"):
            raise SystemExit(f"BENCH_PROFILE_KIND={self.kind!r}: use torch, python or memory")

    def __call__(self, label: str):
        import contextlib

        if not self.folder:
            return contextlib.nullcontext()
        if self.kind == "memory":
            return self._memory(label)
        return self._python(label) if self.kind == "python" else self._profiled(label)

    def _memory(self, label: str):
        import contextlib

        from _memory_peak import peak_composition

        @contextlib.contextmanager
        def run():
            _sync()
            # max_allocated_gib is this step's peak; the caller's later max_memory_allocated() is then this
            # step's too (scaling_gpu.py's record): steady-state steps peak alike, so the record means the same.
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            torch.cuda.memory._record_memory_history(context="alloc", stacks="python", max_entries=2_000_000)
            try:
                yield
            finally:
                _sync()
                snapshot = torch.cuda.memory._snapshot()
                torch.cuda.memory._record_memory_history(enabled=None)
                summary = peak_composition(snapshot, device=torch.cuda.current_device())
                summary["allocated_before_gib"] = before / float(1 << 30)
                summary["max_allocated_gib"] = torch.cuda.max_memory_allocated() / float(1 << 30)
                self._path(f"{label}_memory").write_text(json.dumps(summary, indent=1) + "\n")

        return run()

    def _path(self, name: str) -> Path:
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_initialized() else 0
        # letters, digits, '.', '_' and '-' only: a GPU host returns no file named otherwise ("none+graph")
        safe = re.sub(r"[^A-Za-z0-9._-]", "_", name)
        path = Path(self.folder) / f"{safe}_rank{rank}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    def _python(self, label: str):
        import contextlib
        import cProfile
        import io
        import pstats

        @contextlib.contextmanager
        def run():
            prof = cProfile.Profile()
            _sync()
            start = time.perf_counter()
            prof.enable()
            try:
                yield
            finally:
                prof.disable()
                host = time.perf_counter() - start
                _sync()
                wall = time.perf_counter() - start
                text = io.StringIO()
                text.write(
                    f"== {label}: host {host:.3f} s until the call returned, {wall:.3f} s until the GPU finished\n"
                )
                for key in ("tottime", "cumulative"):
                    text.write(f"== by {key}\n")
                    pstats.Stats(prof, stream=text).sort_stats(key).print_stats(60)
                # who called the costliest: a blocking copy shows as Tensor.to's own time, its caller says where
                text.write("== callers of the 12 functions with the most own time\n")
                pstats.Stats(prof, stream=text).sort_stats("tottime").print_callers(12)
                self._path(f"{label}_python").write_text(text.getvalue())

        return run()

    def _profiled(self, label: str):
        import contextlib
        import os

        from torch.profiler import ProfilerActivity, profile

        @contextlib.contextmanager
        def run():
            stack = bool(os.environ.get("BENCH_PROFILE_STACK"))
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=stack) as prof:
                yield
            torch.cuda.synchronize()
            if os.environ.get("BENCH_PROFILE_TRACE"):  # the whole timeline too, for a look at its gaps
                # torch gzips a trace whose path ends in .gz
                prof.export_chrome_trace(str(self._path(f"{label}_trace").with_suffix(".json.gz")))
            table, events = prof.key_averages(), prof.events()
            timeline = gpu_timeline(events)
            gaps = "\n".join(json.dumps(g) for g in idle_gaps(events))
            self._path(label).write_text(
                f"== {label}: GPU timeline (ms) {json.dumps(timeline)}\n"
                f"== {label}: the longest idle gaps (ms from the first kernel; host ops at the gap's middle,"
                f" outermost first; with BENCH_PROFILE_STACK=1 the innermost op's Python frames)\n{gaps}\n"
                f"== {label}: by CUDA time\n{table.table(sort_by='cuda_time_total', row_limit=40)}\n"
                f"== {label}: by host time\n{table.table(sort_by='self_cpu_time_total', row_limit=40)}\n"
            )

        return run()


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in intervals)


def _kernels(events: Any) -> list[tuple[str, float, float]]:
    """(name, start, end) of every GPU kernel of a profile that took time (microseconds)."""
    from torch.autograd import DeviceType

    return [
        (e.name, e.time_range.start, e.time_range.end)
        for e in events
        if e.device_type == DeviceType.CUDA and e.time_range.end > e.time_range.start
    ]


def gpu_timeline(events: Any) -> dict[str, float]:
    """The kernels of a profile as four numbers (ms): window, idle, exposed NCCL, compute.

    ``window``: first kernel start to last kernel end; ``idle``: time in it when no kernel ran (the GPU waited
    for the host, or a stream waited on another); ``nccl``: time some NCCL kernel ran; ``exposed_nccl``: NCCL
    time with no compute kernel beside it (communication the step waits for; it includes a rank waiting for
    slower ranks inside the collective); ``compute``: time some other kernel ran.
    """
    kernels = _kernels(events)
    if not kernels:
        return {}
    nccl = _union([(s, e) for n, s, e in kernels if "nccl" in n.lower()])
    compute = _union([(s, e) for n, s, e in kernels if "nccl" not in n.lower()])
    busy = _union([(s, e) for _, s, e in kernels])
    window = max(e for _, _, e in kernels) - min(s for _, s, _ in kernels)
    ms = 1e-3  # profiler times are microseconds
    return {
        "window": window * ms,
        "idle": (window - _length(busy)) * ms,
        "nccl": _length(nccl) * ms,
        "exposed_nccl": (_length(busy) - _length(compute)) * ms,  # |NCCL \ compute| = |busy| - |compute|
        "compute": _length(compute) * ms,
    }


def idle_gaps(events: Any, *, top: int = 20, min_ms: float = 0.5) -> list[dict[str, Any]]:
    """The ``top`` longest stretches (at least ``min_ms``) in which no kernel ran, each with the host ops open
    at its middle (outermost first) and, where the profile recorded stacks, the innermost op's Python frames.

    Why: :func:`gpu_timeline` says how long the GPU idled, not why; an idle stretch is the host not yet having
    queued the next kernel (or a stream waiting on another), and the host op open at that moment names it.
    """
    import itertools

    from torch.autograd import DeviceType

    kernels = _kernels(events)
    if not kernels:
        return []
    busy = _union([(start, end) for _, start, end in kernels])
    origin = busy[0][0]
    holes = [(a[1], b[0]) for a, b in itertools.pairwise(busy) if (b[0] - a[1]) * 1e-3 >= min_ms]
    holes = sorted(holes, key=lambda h: h[0] - h[1])[:top]
    host = [e for e in events if e.device_type == DeviceType.CPU and e.time_range.end > e.time_range.start]
    out = []
    for start, end in holes:
        mid = (start + end) / 2
        open_ops = sorted(
            (e for e in host if e.time_range.start <= mid < e.time_range.end),
            key=lambda e: e.time_range.start,
        )
        inner = open_ops[-1] if open_ops else None  # nothing open: the host was between ops (Python)
        frames = [f for f in (getattr(inner, "stack", None) or []) if "site-packages/torch" not in f][:8]
        out.append(
            {
                "at_ms": round((start - origin) * 1e-3, 2),
                "ms": round((end - start) * 1e-3, 2),
                "host": [e.name for e in open_ops][-6:],
                **({"frames": frames} if frames else {}),
            }
        )
    return out
