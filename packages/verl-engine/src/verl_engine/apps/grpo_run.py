"""A GRPO run end to end on the embedded arithmetic task: warm start, then per step weight sync, rollout,
reward, advantages, KL and update; held-out evaluation, checkpoints and exact resume. Every knob is verl's own
key; :class:`GRPORun` holds only what the config has no key for. Design: the package README's "GRPO run".
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from verl_engine.apps.demo import CharTokenizer
from verl_engine.apps.grpo import rollout_batch
from verl_engine.apps.grpo_colocation import Colocation
from verl_engine.apps.grpo_step import StepLoop, grpo_step
from verl_engine.apps.grpo_sync import evaluate
from verl_engine.apps.grpo_task import ArithmeticTask, HFTokens, Tokens, tiny_arithmetic_hf_config, tokens_of
from verl_engine.apps.grpo_workers import InProcessWorkers, RayWorkers, Workers, init_process_group, is_rank0
from verl_engine.apps.interrupt import RunInterrupted, StopSignals
from verl_engine.apps.rollout import HFRollout, RolloutEngine, SamplingParams

__all__ = [
    "ArithmeticTask",
    "GRPORun",
    "HFTokens",
    "InProcessWorkers",
    "RayWorkers",
    "Tokens",
    "Workers",
    "run_grpo",
    "tiny_arithmetic_hf_config",
]


@dataclass
class GRPORun:
    """What a GRPO run needs beyond the verl config. ``overrides`` are verl override strings.

    ``hidden_size`` / ``layers`` size the embedded model (ignored with ``actor_rollout_ref.model.path``).
    ``progress``: a progress bar on rank 0 (else nothing per step); ``plot``: ``<out>/grpo.png`` at the end
    (matplotlib).
    """

    out_dir: str
    overrides: list[str] = field(default_factory=list)
    warmup_steps: int = 1000
    warmup_batch_size: int = 64
    warmup_error_rate: float = 0.7
    warmup_lr: float = 1e-3
    eval_size: int = 64
    operations: str = "+"
    max_operand: int = 20
    hidden_size: int = 128
    layers: int = 2
    seed: int = 0
    resume: bool = False
    device: str = "cpu"
    progress: bool = False
    plot: bool = False

    def __post_init__(self) -> None:
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.warmup_batch_size < 1:
            raise ValueError(f"warmup_batch_size must be >= 1, got {self.warmup_batch_size}")
        if not 0.0 <= self.warmup_error_rate < 1.0:
            raise ValueError(f"warmup_error_rate must be in [0, 1), got {self.warmup_error_rate}")
        if not self.warmup_lr > 0:
            raise ValueError(f"warmup_lr must be > 0, got {self.warmup_lr}")
        if self.eval_size < 1:
            raise ValueError(f"eval_size must be >= 1, got {self.eval_size}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")


_DEFAULTS = [
    "model_engine=megatron",
    "algorithm.adv_estimator=grpo",
    "trainer.n_gpus_per_node=1",
    "trainer.total_training_steps=100",
    "trainer.test_freq=10",
    "trainer.save_freq=50",
    "data.train_batch_size=32",
    "data.max_response_length=4",
    "actor_rollout_ref.rollout.n=8",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=256",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=256",
    "actor_rollout_ref.actor.ppo_mini_batch_size=16",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=128",
    "actor_rollout_ref.actor.optim.lr=3e-4",
    "actor_rollout_ref.actor.optim.total_training_steps=100000",
    "actor_rollout_ref.actor.use_kl_loss=true",
    "actor_rollout_ref.actor.kl_loss_coef=0.01",
    "actor_rollout_ref.actor.calculate_entropy=true",
    "critic.ppo_micro_batch_size_per_gpu=64",
    "actor_rollout_ref.model.use_remove_padding=true",
]
"""The embedded run's verl settings (user overrides go on top)."""


@dataclass
class _Plan:
    """The run's inputs resolved before any engine exists: paths, overrides, model config, tokenizer, task."""

    out: Path
    overrides: list[str]
    user_path: str | None
    resuming: bool
    hf: dict[str, Any]
    tokens: Tokens
    task: ArithmeticTask

    @property
    def sft_dir(self) -> Path:
        return self.out / "sft"

    @property
    def ckpt_root(self) -> Path:
        return self.out / "checkpoints"

    @property
    def metrics_file(self) -> Path:
        return self.out / "metrics.jsonl"


def run_grpo(
    run: GRPORun,
    *,
    rollout: RolloutEngine | None = None,
    workers: Workers | None = None,
    on_step: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """The whole run (design: the package README); returns the last step's metrics and the held-out accuracies.

    ``workers``: where the engines live (default: this process; :class:`RayWorkers` for Ray). ``rollout``: the
    generation engine (default: :class:`~verl_engine.apps.rollout.HFRollout` on ``run.device``). ``on_step`` sees
    every step's metrics record (tests use it).
    """
    plan = _plan(run)
    with StopSignals() as stop:
        return _run(run, plan, rollout=rollout, workers=workers, on_step=on_step, stop=stop)


def _run(
    run: GRPORun,
    plan: _Plan,
    *,
    rollout: RolloutEngine | None,
    workers: Workers | None,
    on_step: Callable[[dict[str, Any]], None] | None,
    stop: StopSignals,
) -> dict[str, Any]:
    """:func:`run_grpo` once the plan is checked, with SIGINT / SIGTERM turned into a stop at a step boundary."""
    if workers is None:
        init_process_group(run.device)
        workers = InProcessWorkers(device=run.device)
    device = (
        torch.device("cuda", torch.cuda.current_device()) if run.device == "cuda" else torch.device("cpu")
    )
    start_path = _start_model(workers, run, plan, stop=stop, device=device)
    cfg, use_ref = _build_engines(workers, plan, start_path=start_path)
    if rollout is None:
        rollout = _default_rollout(cfg, plan, device)
    start = _resume(workers, plan)
    params = _sampling(cfg)
    colo = Colocation(workers, rollout, cfg=cfg, use_ref=use_ref)
    colo.actor_to(params=False, grads=False, optimizer=False)
    colo.ref_offload(on_device=False)
    loop = StepLoop(
        workers=workers,
        rollout=rollout,
        task=plan.task,
        colo=colo,
        params=params,
        cfg=cfg,
        device=device,
        seed=run.seed,
        use_ref=use_ref,
    )
    history: dict[str, Any] = {"eval": {}}
    if start == 0:
        # the warm start's accuracy is the run's first record (step 0, no training metrics), so a resumed run's
        # file and plot keep it
        history["eval"][0] = evaluate(workers, rollout, plan.task, params, colo)
        _eval_line(run, 0, total=int(cfg.trainer.total_training_steps), accuracy=history["eval"][0])
        if is_rank0():
            with plan.metrics_file.open("a") as f:
                f.write(json.dumps({"eval_accuracy": history["eval"][0], "step": 0}, sort_keys=True) + "\n")
    last = _run_steps(loop, run=run, plan=plan, start=start, history=history, on_step=on_step, stop=stop)
    if run.plot and is_rank0():
        from verl_engine.apps.grpo_plot import plot_grpo_metrics

        plot_grpo_metrics(plan.metrics_file, plan.out / "grpo.png")
    return {"last": last, "eval": history["eval"], "start": start}


def _plan(run: GRPORun) -> _Plan:
    """Paths, overrides, the model's config and tokenizer, the task; the overrides are checked (errors surface
    before any process group)."""
    from verl_config import ConfigError, load_config
    from verl_engine.build import load_hf_config

    out = Path(run.out_dir)
    overrides = [*_DEFAULTS, f"actor_rollout_ref.actor.megatron.seed={run.seed}", *run.overrides]
    user_path = _model_path(run.overrides)
    resuming = run.resume and (out / "checkpoints" / "latest_checkpointed_iteration.txt").is_file()
    if run.resume and not resuming:
        raise FileNotFoundError(f"resume=True but {out / 'checkpoints'} has no checkpoint to resume from")
    if user_path is not None:
        hf = load_hf_config(user_path)
        tokens: Tokens | CharTokenizer = tokens_of(user_path, hf)
    else:
        tokens = CharTokenizer()
        hf = tiny_arithmetic_hf_config(
            vocab_size=tokens.vocab_size, hidden_size=run.hidden_size, layers=run.layers
        )
    task = ArithmeticTask(
        seed=run.seed,
        operations=run.operations,
        max_operand=run.max_operand,
        eval_size=run.eval_size,
        tokenizer=tokens,
    )
    cfg = load_config(overrides=overrides)
    correction = cfg.algorithm.rollout_correction
    if correction is not None and correction.bypass_mode:
        raise ConfigError(
            "algorithm.rollout_correction.bypass_mode=true takes the rollout's log-probs as the old policy's, and"
            " this loop's rollout (verl_engine.apps.rollout) returns none: it recomputes them; set bypass_mode=false"
        )
    if resuming:
        from verl_engine.checkpoint import latest_step

        done = latest_step(out / "checkpoints") or 0
        total = int(cfg.trainer.total_training_steps)
        if done >= total:
            raise ConfigError(
                f"{out} is at step {done} (its latest checkpoint) and trainer.total_training_steps (--steps) is"
                f" {total}: nothing to resume; give more steps (e.g. --steps {done + 50}) to continue the run"
            )
    if (
        user_path is None
        and run.warmup_steps == 0
        and not (resuming and (out / "sft" / "config.json").is_file())
    ):
        raise ConfigError(
            "warmup_steps=0 needs a model: give actor_rollout_ref.model.path=<Hugging Face directory>"
            " (e.g. the sft/ directory of an earlier run, which holds its tokenizer or uses the embedded one)"
        )
    return _Plan(
        out=out, overrides=overrides, user_path=user_path, resuming=resuming, hf=hf, tokens=tokens, task=task
    )


def _model_path(overrides: Sequence[str]) -> str | None:
    found = [o.split("=", 1)[1] for o in overrides if o.startswith("actor_rollout_ref.model.path=")]
    return found[-1] if found else None


def _start_model(
    workers: Workers, run: GRPORun, plan: _Plan, *, stop: StopSignals, device: torch.device
) -> str | None:
    """The model the actor and the reference start from: on resume the run's ``sft/`` if it has one (the warm
    start is done), else the warm start's result, saved as ``sft/`` (verl: the reference is the initial
    policy), else the user's model."""
    sft_dir = plan.sft_dir
    if plan.resuming:
        return str(sft_dir) if (sft_dir / "config.json").is_file() else plan.user_path
    if run.warmup_steps == 0:
        return plan.user_path
    warm = [*plan.overrides, f"actor_rollout_ref.actor.optim.lr={run.warmup_lr}"]
    workers.build("actor", warm, hf_config=None if plan.user_path else plan.hf)
    _warm_start(workers, plan.task, run=run, stop=stop, device=device)
    workers.call("actor", "save_hf", str(sft_dir))
    if isinstance(plan.tokens, HFTokens) and is_rank0():  # sft/ is a complete model directory
        plan.tokens.tokenizer.save_pretrained(str(sft_dir))
    workers.drop("actor")
    return str(sft_dir)


def _warm_start(
    workers: Workers, task: ArithmeticTask, *, run: GRPORun, stop: StopSignals, device: torch.device
) -> None:
    """``run.warmup_steps`` supervised steps on prompt -> demonstrated answer + EOS (response tokens only); a stop
    signal ends it between steps (nothing to checkpoint yet: the GRPO checkpoints start after it). Its progress:
    a bar with ``run.progress``, else a line at every tenth of it (it can take minutes)."""
    report = _PhaseProgress(run, name="warm start", total=run.warmup_steps)
    for step in range(run.warmup_steps):
        signum = stop.agreed(device)
        if signum:
            raise RunInterrupted(
                signum,
                step=0,
                checkpoint=None,
                note=f" (during the warm start, at its step {step} of {run.warmup_steps})",
            )
        problems = task.demonstrations(
            step=step, count=run.warmup_batch_size, error_rate=run.warmup_error_rate
        )
        batch = rollout_batch(
            [task.prompt_ids(p) for p, _ in problems],
            [task.answer_ids(a) for _, a in problems],
            pad_token_id=task.tokenizer.pad_id,
        )
        out = workers.call("actor", "train_batch", batch, loss="sft")
        report.advance(step + 1, loss=_loss_of(out))
    report.close()


def _loss_of(out: Any) -> float | None:
    """The step's loss from a ``train_batch`` result (None where the worker returns none)."""
    loss = out.get("loss") if isinstance(out, Mapping) else None
    return None if loss is None else float(loss)


class _PhaseProgress:
    """A progress bar on rank 0 with ``run.progress``, else a line at every tenth of the phase (on rank 0)."""

    def __init__(self, run: GRPORun, *, name: str, total: int) -> None:
        self.name, self.total = name, total
        self.every = max(1, total // 10)
        self.bar = None
        self.on = is_rank0() and total > 0
        if self.on and run.progress:
            from tqdm import tqdm  # type: ignore[import-untyped]  # no stubs installed (types-tqdm)

            self.bar = tqdm(total=total, desc=name, unit="step", dynamic_ncols=True)

    def advance(self, done: int, *, loss: float | None) -> None:
        if not self.on:
            return
        if self.bar is not None:
            if loss is not None:
                self.bar.set_postfix({"loss": f"{loss:.3f}"})
            self.bar.update(1)
        elif done % self.every == 0 or done == self.total:
            shown = "" if loss is None else f", loss {loss:.3f}"
            print(f"{self.name}: step {done}/{self.total}{shown}", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _build_engines(workers: Workers, plan: _Plan, *, start_path: str | None) -> tuple[Any, bool]:
    """The actor and (with a KL loss or KL in the reward) the reference from ``start_path``; the loaded config
    and whether a reference exists."""
    from verl_config import load_config

    model_overrides = [*plan.overrides, f"actor_rollout_ref.model.path={start_path}"]
    cfg = load_config(overrides=model_overrides)
    workers.build("actor", model_overrides)
    use_ref = bool(cfg.actor_rollout_ref.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward)
    if use_ref:
        workers.build("ref", model_overrides)
    return cfg, use_ref


def _default_rollout(cfg: Any, plan: _Plan, device: torch.device) -> HFRollout:
    # the rollout's dtype is actor_rollout_ref.rollout.dtype on GPU; on CPU (the debug mode) float32
    dtype = (
        getattr(torch, str(cfg.actor_rollout_ref.rollout.dtype)) if device.type == "cuda" else torch.float32
    )
    tokens = plan.tokens
    return HFRollout(
        hf_config=plan.hf, eos_token_id=tokens.eos_id, pad_token_id=tokens.pad_id, device=device, dtype=dtype
    )


def _resume(workers: Workers, plan: _Plan) -> int:
    """The step to start from (the checkpoint's on resume, else 0); the metrics file keeps only the steps
    before it (later ones are run again)."""
    start = 0
    if plan.resuming:
        start = int(workers.call("actor", "load_checkpoint", str(plan.ckpt_root))["global_step"])
    metrics_file = plan.metrics_file
    if is_rank0():
        plan.out.mkdir(parents=True, exist_ok=True)
        kept = []
        if plan.resuming and metrics_file.is_file():
            kept = [
                line for line in metrics_file.read_text().splitlines() if json.loads(line)["step"] <= start
            ]
        metrics_file.write_text("".join(line + "\n" for line in kept))
    return start


def _sampling(cfg: Any) -> SamplingParams:
    rollout = cfg.actor_rollout_ref.rollout
    return SamplingParams(
        max_new_tokens=int(cfg.data.max_response_length),
        n=int(rollout.n),
        temperature=float(rollout.temperature),
        top_p=float(rollout.top_p),
        top_k=max(0, int(rollout.top_k)),
    )


def _run_steps(
    loop: StepLoop,
    *,
    run: GRPORun,
    plan: _Plan,
    start: int,
    history: dict[str, Any],
    on_step: Callable[[dict[str, Any]], None] | None,
    stop: StopSignals,
) -> dict[str, Any]:
    """Steps ``start`` .. ``total_training_steps``, each followed by its evaluation, metrics record and
    checkpoint as ``test_freq`` / ``save_freq`` ask; the last step's metrics. After a step that a stop signal
    reached, every rank writes that step's checkpoint and raises :class:`RunInterrupted`."""
    trainer = loop.cfg.trainer
    total, test_freq, save_freq = (
        int(trainer.total_training_steps),
        int(trainer.test_freq),
        int(trainer.save_freq),
    )
    bar = _progress_bar(run, total=total, start=start)
    last: dict[str, Any] = {}
    for step in range(start, total):
        metrics = grpo_step(loop, step)
        done = step + 1
        if test_freq > 0 and (done % test_freq == 0 or done == total):
            metrics["eval_accuracy"] = history["eval"][done] = evaluate(
                loop.workers, loop.rollout, loop.task, loop.params, loop.colo
            )
            _eval_line(run, done, total=total, accuracy=metrics["eval_accuracy"])
        if is_rank0():
            with plan.metrics_file.open("a") as f:
                f.write(json.dumps(metrics, sort_keys=True) + "\n")
        saved = save_freq > 0 and (done % save_freq == 0 or done == total)
        if saved:
            _save(loop, plan.ckpt_root, step=done)
        if on_step is not None:
            on_step(metrics)
        if bar is not None:
            _show(bar, metrics, history)
        last = metrics
        signum = stop.agreed(loop.device) if done < total else 0
        if signum:
            if not saved:
                _save(loop, plan.ckpt_root, step=done)
            if bar is not None:
                bar.close()
            raise RunInterrupted(signum, step=done, checkpoint=plan.ckpt_root / f"global_step_{done}")
    if bar is not None:
        bar.close()
    return last


def _save(loop: StepLoop, root: Path, *, step: int) -> None:
    loop.colo.actor_to(params=True, grads=True, optimizer=True)
    loop.workers.call("actor", "save_checkpoint", str(root), global_step=step, data_position={"step": step})
    loop.colo.actor_to(params=False, grads=False, optimizer=False)


def _progress_bar(run: GRPORun, *, total: int, start: int) -> Any:
    """A progress bar on rank 0 with ``run.progress`` (else None)."""
    if not (run.progress and is_rank0()):
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=start, desc="grpo", unit="step", dynamic_ncols=True)


def _eval_line(run: GRPORun, step: int, *, total: int, accuracy: float) -> None:
    """One line per evaluation on rank 0 where no progress bar shows it, or where stdout is not a terminal (a
    log file then has every evaluation as it happens, not only at the end)."""
    if is_rank0() and not (run.progress and sys.stdout.isatty()):
        print(f"step {step}/{total}: held-out accuracy {accuracy:.3f}", flush=True)


def _show(bar: Any, metrics: Mapping[str, Any], history: Mapping[str, Any]) -> None:
    shown = {"reward": f"{metrics['reward_mean']:.2f}", "kl": f"{metrics.get('kl', 0.0):.4f}"}
    if history["eval"]:
        shown["held_out"] = f"{history['eval'][max(history['eval'])]:.2f}"
    bar.set_postfix(shown)
    bar.update(1)
