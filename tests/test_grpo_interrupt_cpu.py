"""`verl-engine grpo` stopped by SIGTERM (preemption) ends after a step with that step's checkpoint, one line
saying how to continue and exit code 143; `--resume` then continues exactly: the records of every step equal an
uninterrupted run's (timings aside). A real signal to a real process on CPU."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.above_engine

ARGS = [
    "--steps", "6", "--warmup-steps", "5", "--seed", "3", "--no-plot", "--no-progress",
    "data.train_batch_size=8", "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8", "trainer.test_freq=100", "trainer.save_freq=100",
]  # fmt: skip
TIMING = ("seconds", "tokens_per_s", "peak_memory_gib", "memory_gib", "offload")


def _grpo(out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "verl_engine", "grpo", "--out", str(out), *ARGS, *extra]


def _records(out: Path) -> list[dict]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING} for line in lines]


def test_sigterm_stops_after_a_step_with_its_checkpoint_and_resume_continues_exactly(tmp_path: Path) -> None:
    straight = subprocess.run(_grpo(tmp_path / "straight"), capture_output=True, text=True, timeout=900)
    assert straight.returncode == 0, straight.stderr[-3000:]
    # without a progress bar every phase still reports as it goes: the warm start, each evaluation
    lines = straight.stdout.splitlines()
    assert "warm start: step 5/5" in " ".join(lines)
    assert [line for line in lines if ": held-out accuracy " in line][:1] == [
        line for line in lines if line.startswith("step 0/6: held-out accuracy ")
    ]

    run = tmp_path / "run"
    proc = subprocess.Popen(_grpo(run), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 600
    while not ((run / "metrics.jsonl").is_file() and (run / "metrics.jsonl").read_text().count("\n") >= 1):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)  # during step 2 or later: the run stops after that step
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 143, err[-3000:]
    done = len(_records(run)) - 1  # the first record is step 0's evaluation
    assert 1 <= done < 6
    latest = json.loads((run / "checkpoints" / "latest_checkpointed_iteration.txt").read_text())[
        "global_step"
    ]
    assert latest == done and (run / "checkpoints" / f"global_step_{done}").is_dir()
    expected = (
        f"interrupted by SIGTERM after step {done}; checkpoint: {run / 'checkpoints' / f'global_step_{done}'};"
        f" continue with: verl-engine grpo --out {run} --resume"
    )
    assert expected in err and "Traceback" not in err, err[-3000:]

    resumed = subprocess.run(_grpo(run, "--resume"), capture_output=True, text=True, timeout=900)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _records(run) == _records(tmp_path / "straight")
