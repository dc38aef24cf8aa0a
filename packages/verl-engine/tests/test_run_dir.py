"""A run directory is checked before any work: an earlier run is never overwritten by accident, a path under a
file or an unwritable one is refused at once (the commands answer with exit code 2 and one line)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from verl_config import ConfigError
from verl_engine.apps.cli import main
from verl_engine.apps.run_dir import prepare_run_dir


def _earlier_run(out: Path) -> None:
    (out / "checkpoints" / "global_step_50").mkdir(parents=True)
    (out / "metrics.jsonl").write_text('{"step": 1}\n' * 150)
    (out / "notes.txt").write_text("mine")


def test_an_earlier_run_is_refused_unless_resumed_or_overwritten(tmp_path: Path) -> None:
    out = tmp_path / "run"
    assert (
        prepare_run_dir(out, flag="--out", resume=False, overwrite=False, can_resume=True) == out
    )  # new: fine
    _earlier_run(out)
    with pytest.raises(ConfigError, match=r"--out .*run already holds a run \(metrics.jsonl, checkpoints\): continue"
                       r" it with --resume, replace it with --overwrite, or choose another --out"):  # fmt: skip
        prepare_run_dir(out, flag="--out", resume=False, overwrite=False, can_resume=True)
    with pytest.raises(
        ConfigError, match=r"holds a run \(metrics.jsonl, checkpoints\): replace it with --overwrite"
    ):
        prepare_run_dir(out, flag="--output-dir", resume=False, overwrite=False, can_resume=False)
    prepare_run_dir(
        out, flag="--out", resume=True, overwrite=False, can_resume=True
    )  # resumed: left as it is
    assert (out / "metrics.jsonl").read_text().count("\n") == 150
    with pytest.raises(ConfigError, match="give one"):
        prepare_run_dir(out, flag="--out", resume=True, overwrite=True, can_resume=True)
    prepare_run_dir(out, flag="--out", resume=False, overwrite=True, can_resume=True)
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]  # the run's files only; the user's stay


def test_a_file_where_a_directory_must_be_is_refused(tmp_path: Path) -> None:
    (tmp_path / "README.md").write_text("x")
    with pytest.raises(ConfigError, match=r"README.md is a file, not a directory; choose another --out"):
        prepare_run_dir(
            tmp_path / "README.md" / "run", flag="--out", resume=False, overwrite=False, can_resume=True
        )


def test_an_unwritable_directory_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    # CI may run as root, which writes anywhere: the permission answer for the locked folder is the kernel's
    # answer for an ordinary user
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if Path(p) == locked else real_access(p, mode))
    with pytest.raises(ConfigError, match="is not writable"):
        prepare_run_dir(locked / "run", flag="--out", resume=False, overwrite=False, can_resume=True)


def test_the_commands_refuse_before_any_work(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    _earlier_run(out)
    assert main(["grpo", "--out", str(out), "--no-plot"]) == 2
    assert "already holds a run" in capsys.readouterr().err
    assert (out / "metrics.jsonl").read_text().count("\n") == 150  # untouched
    assert main(["train", "--output-dir", str(out), "--steps", "1", "optim.lr_warmup_steps=0"]) == 2
    assert "replace it with --overwrite" in capsys.readouterr().err
    (tmp_path / "README.md").write_text("x")
    assert main(["train", "--output-dir", str(tmp_path / "README.md" / "run")]) == 2
    err = capsys.readouterr().err
    assert "is a file, not a directory" in err and "Traceback" not in err


def test_a_misspelt_flag_shows_the_commands_own_usage(capsys: pytest.CaptureFixture[str]) -> None:
    for command in ("grpo", "train"):
        with pytest.raises(SystemExit) as exit_info:
            main([command, "--out", "x", "--stesp", "3"] if command == "grpo" else [command, "--stesp", "3"])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert f"verl-engine {command}: error: unrecognized arguments: --stesp" in err
        assert f"usage: verl-engine {command}" in err


def test_resuming_a_finished_run_with_no_more_steps_is_an_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    (out / "checkpoints" / "latest_checkpointed_iteration.txt").write_text('{"global_step": 150}')
    assert main(["grpo", "--out", str(out), "--resume", "--steps", "50", "--no-plot"]) == 2
    err = capsys.readouterr().err
    assert "is at step 150 (its latest checkpoint) and trainer.total_training_steps (--steps) is 50" in err
