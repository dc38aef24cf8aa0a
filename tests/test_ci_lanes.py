"""scripts/ci.py: the CI sessions in two lanes (the newest megatron-core's tests beside everything else), both run
to the end, a failure in either fails the run, each lane's output prefixed."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import ci  # noqa: E402

pytestmark = pytest.mark.newest_mcore  # a standard-library script: the megatron-core release does not enter

SESSIONS = ["lint", "config", "docs", "tests(0.14.0)", "tests(0.19.2)", "verl", "release"]


def test_the_newest_tests_session_gets_a_lane_of_its_own() -> None:
    assert ci.lanes(SESSIONS) == [
        ["tests(0.19.2)"],
        ["lint", "config", "docs", "tests(0.14.0)", "verl", "release"],
    ]
    # by release number, not by text: 0.9.0 is older than 0.19.2
    assert ci.lanes(["tests(0.19.2)", "tests(0.9.0)"])[0] == ["tests(0.19.2)"]
    assert ci.lanes(["lint", "docs"]) == [["lint", "docs"]]


def test_the_noxfile_sessions_split_into_two_lanes_each_session_once() -> None:
    # the workspace's nox (`uv run` puts it on PATH): a nox session's own environment does not install nox
    nox = shutil.which("nox")
    assert nox is not None, "nox is not on PATH: run the tests through `uv run` (nox is a dev dependency)"
    sessions = ci.ci_sessions(command=[nox])
    first, second = ci.lanes(sessions)
    assert first == ["tests(0.19.2)"]
    assert sorted(first + second) == sorted(sessions) and len(set(sessions)) == len(sessions)
    assert "tests(0.14.0)" in second


def _fake_nox(tmp_path: Path) -> list[str]:
    """A stand-in for nox that prints its sessions and the MASTER_PORT it got, and fails on a session named bad."""
    script = tmp_path / "fake_nox.py"
    script.write_text(
        "import os, sys, time\n"
        "sessions = sys.argv[2:]\n"
        "time.sleep(0.2)\n"
        "print('ran', *sessions, 'port', os.environ.get('MASTER_PORT'), flush=True)\n"
        "raise SystemExit(1 if 'bad' in sessions else 0)\n"
    )
    return [sys.executable, str(script)]


def test_both_lanes_run_to_the_end_and_a_failure_in_either_fails_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("MASTER_PORT", raising=False)
    fake = _fake_nox(tmp_path)
    assert ci.run_lanes([["tests(0.19.2)"], ["lint", "docs"]], command=fake) == 0
    out = capsys.readouterr().out
    assert "[tests(0.19.2)] ran tests(0.19.2) port None" in out
    # the second lane has its own default rendezvous port
    assert f"[lane2] ran lint docs port {ci.SECOND_LANE_MASTER_PORT}" in out
    assert ci.run_lanes([["bad"], ["lint"]], command=fake) == 1
    out = capsys.readouterr().out
    assert "[lint] ran lint port" in out and "ci: bad finished with exit status 1" in out
    assert ci.run_lanes([["tests(0.19.2)"], ["lint", "bad"]], command=fake) == 1
