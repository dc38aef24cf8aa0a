"""scripts/gpu_suite.py: every GPU test is in a chunk of the GPU count it needs; chunk selection and the report."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import gpu_suite  # noqa: E402

pytestmark = pytest.mark.newest_mcore  # a standard-library script: the megatron-core release does not enter


def test_every_gpu_test_is_in_a_chunk_of_its_gpu_count() -> None:
    inventory = gpu_suite.gpu_inventory()
    # the collection saw the multi-GPU tests with their counts (the conftest's num_gpus marker)
    assert inventory["tests/test_gpu_engine_packed.py"] == [1, 2, 4]
    assert inventory["tests/test_gpu_mfsdp_lifecycle.py"] == [2]
    assert gpu_suite.uncovered(inventory) == []
    assert gpu_suite.uncovered({"tests/test_new_gpu.py": [1, 4]}) == [
        "tests/test_new_gpu.py (1 GPUs)",
        "tests/test_new_gpu.py (4 GPUs)",
    ]


def test_a_machine_runs_the_chunks_its_gpu_count_allows() -> None:
    assert {c.gpus for c in gpu_suite.chunks_for(1)} == {1}
    assert {c.gpus for c in gpu_suite.chunks_for(4)} == {1, 2, 4}
    assert [c.name for c in gpu_suite.select("lifecycle2,engine1", gpus=2)] == ["lifecycle2", "engine1"]
    with pytest.raises(gpu_suite.SuiteError, match="chunk 'packed4' needs 4 GPUs, this machine has 2"):
        gpu_suite.select("packed4", gpus=2)
    with pytest.raises(gpu_suite.SuiteError, match="unknown chunk 'nope'"):
        gpu_suite.select("nope", gpus=4)
    assert gpu_suite.gpu_tag({"gpu": "NVIDIA H200", "gpus": 4}) == "h200x4"


def test_a_machine_without_the_wheels_is_refused_before_any_chunk_starts() -> None:
    """The lost command of 2026-11-28: a bare machine, every chunk failing at import in seconds."""
    machine = gpu_suite._machine(dict(os.environ))  # this environment has both
    assert machine["megatron_core"] and machine["verl_engine"]
    gpu_suite.check_installed(machine)
    bare = {**machine, "megatron_core": None, "verl_engine": None}
    with pytest.raises(
        gpu_suite.SuiteError, match="megatron-core and verl-engine not installed.*--install wheelhouse"
    ):
        gpu_suite.check_installed(bare)


def _record(folder: Path, name: str, *, gpus: int, green: bool, failed: int = 0) -> None:
    counts = {"passed": 3, "failed": failed, "skipped": 0}
    record = {"chunk": name, "machine": {"gpus": gpus}, "green": green, "timed_out": False, "counts": counts,
              "seconds": 1.0, "commit": "abc"}  # fmt: skip
    (folder / f"{name}.json").write_text(json.dumps(record))


def test_the_report_is_green_only_when_every_chunk_of_the_machine_ran_green(tmp_path: Path) -> None:
    for chunk in gpu_suite.chunks_for(2):
        _record(tmp_path, chunk.name, gpus=2, green=True)
    assert gpu_suite.report(tmp_path) == 0
    _record(tmp_path, "lifecycle2", gpus=2, green=False, failed=1)
    assert gpu_suite.report(tmp_path) == 1
    (tmp_path / "lifecycle2.json").unlink()
    assert gpu_suite.report(tmp_path) == 1  # a chunk not run is not green
    with pytest.raises(gpu_suite.SuiteError, match="no chunk records"):
        gpu_suite.report(tmp_path / "empty")


def test_a_chunk_that_cannot_finish_in_the_budget_left_is_not_started(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    started: list[str] = []

    class Done:  # a chunk's pytest process that has already exited
        returncode = 0

        def poll(self) -> int:
            return 0

    def fake_start(chunk: gpu_suite.Chunk, ids: list[int], *, out: Path, env: dict[str, str]) -> Done:
        started.append(chunk.name)
        return Done()

    monkeypatch.setattr(gpu_suite, "_start", fake_start)
    monkeypatch.setattr(gpu_suite.time, "sleep", lambda seconds: None)  # the poll interval
    # two 2-GPU chunks on 2 GPUs run one after the other, the longer first
    first, second = sorted(
        (c for c in gpu_suite.CHUNKS if c.name in ("lifecycle2", "fsdpmem2")), key=lambda c: -c.seconds
    )
    assert second.seconds > 100
    machine = {"gpu": "NVIDIA H200", "gpus": 2}
    # the first chunk starts whatever its time; the second does not fit the ~98 s left
    rc = gpu_suite.run(out=tmp_path, chunk_names="lifecycle2,fsdpmem2", commit="abc", budget_s=100, env={},
                       machine=machine)  # fmt: skip
    assert rc == 1 and started == [first.name]
    assert (
        f"{second.name}: not started (its last green run took {second.seconds} s" in capsys.readouterr().out
    )
    assert not (tmp_path / f"{second.name}.json").exists()  # no record: the report counts it as not run
    started.clear()
    gpu_suite.run(out=tmp_path / "b", chunk_names="lifecycle2,fsdpmem2", commit="abc", budget_s=1000, env={},
                  machine=machine)  # fmt: skip
    assert started == [first.name, second.name]
