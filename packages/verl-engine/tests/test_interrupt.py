"""SIGINT / SIGTERM become a stop request at a step boundary (verl_engine.apps.interrupt)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch

from verl_engine.apps.interrupt import RunInterrupted, StopSignals


def test_a_signal_is_recorded_and_a_second_one_stops_at_once(capsys: pytest.CaptureFixture[str]) -> None:
    previous = signal.getsignal(signal.SIGINT)
    with StopSignals() as stop:
        os.kill(os.getpid(), signal.SIGINT)  # delivered to this (main) thread before the next line runs
        assert stop.received == signal.SIGINT
        assert stop.agreed(torch.device("cpu")) == signal.SIGINT  # no process group: this process's answer
        assert "stopping after the current step" in capsys.readouterr().err
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)
    assert signal.getsignal(signal.SIGINT) is previous  # the handlers are given back


def test_the_exit_code_is_128_plus_the_signal(tmp_path: Path) -> None:
    stopped = RunInterrupted(signal.SIGINT, step=7, checkpoint=tmp_path / "global_step_7")
    assert stopped.exit_code == 130
    assert str(stopped) == f"interrupted by SIGINT after step 7; checkpoint: {tmp_path / 'global_step_7'}"
    assert RunInterrupted(signal.SIGTERM, step=0, checkpoint=None).exit_code == 143
