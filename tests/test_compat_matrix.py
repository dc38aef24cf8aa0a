"""scripts/compat_matrix.py: the docs' compatibility matrix is made from the test matrix's junit results.

The committed page must equal what the script renders from the committed summary (a staleness check like
``verl-config generate --check``); the summary is read from junit files that a real pytest run wrote; every test
module of the repository has a feature row, so a new test file cannot drop off the page.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("compat_matrix", ROOT / "scripts" / "compat_matrix.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["compat_matrix"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


cm = _load_script()


def test_committed_page_is_rendered_from_committed_results() -> None:
    results = cm.load_results(cm.RESULTS)
    assert cm.PAGE.read_text() == cm.render(results, versions=cm.mcore_versions()), (
        "docs/compatibility.md is stale: run `uv run python scripts/compat_matrix.py render`"
    )
    assert cm.main(["render", "--check"]) == 0


def test_every_test_module_of_the_repository_has_a_feature() -> None:
    modules = [(p.parent.parent.name, p.stem) for p in ROOT.glob("packages/*/tests/test_*.py")]
    modules += [(cm.CROSS, p.stem) for p in (ROOT / "tests").glob("test_*.py")]
    assert len(modules) > 50
    for group, module in modules:
        cm._feature_of(group, module)  # raises, naming the module and the fix, when a row is missing


def test_columns_are_the_nox_matrix() -> None:
    versions = cm.mcore_versions()
    assert versions[0] == "0.14.0" and len(versions) == len(set(versions)) >= 2
    assert "| feature | " + " | ".join(versions) + " |" in cm.PAGE.read_text().splitlines()


def _pytest_junit(tmp_path: Path, *, junit_name: str) -> Path:
    """A real pytest run over a tests/test_rl_engine_pipeline_cpu.py with one pass, one failure, one skip."""
    project = tmp_path / "project"
    (project / "tests").mkdir(parents=True)
    (project / "pyproject.toml").write_text("")  # the rootdir: classnames become tests.test_...
    (project / "tests" / "test_rl_engine_pipeline_cpu.py").write_text(
        "import pytest\n\n"
        "def test_ok():\n    assert True\n\n"
        "def test_broken():\n    assert 1 == 2\n\n"
        "@pytest.mark.skip(reason='shown as skipped')\ndef test_skipped():\n    pass\n"
    )
    junit = tmp_path / "junit" / junit_name
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}", "tests"],
        cwd=project,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr  # one test fails on purpose
    return junit


def test_junit_to_summary_to_page(tmp_path: Path) -> None:
    junit = _pytest_junit(tmp_path, junit_name="cross-mcore0.19.2.xml")
    run = cm.read_junit(junit)
    assert (run.group, run.column) == ("cross", "0.19.2")
    assert run.counts == {"test_rl_engine_pipeline_cpu": {"passed": 1, "failed": 1, "skipped": 1}}

    results = cm.collect(junit.parent, about="a test run")
    out = tmp_path / "results.json"
    out.write_text(cm.dump_results(results))
    page = cm.render(cm.load_results(out), versions=["0.14.0", "0.19.2"])
    assert "| PP, PP x VPP, PP x TP / CP | not run | **1 passed, 1 failed, 1 skipped** |" in page
    assert "| MTP | not run | not run |" in page
    assert "**Data:** a test run" in page

    # the command line: update writes both files, render --check then agrees, a changed page is stale
    page_path = tmp_path / "compatibility.md"
    args = ["--results", str(out)]
    assert (
        cm.main(
            ["update", *args, "--junit-dir", str(junit.parent), "--about", "cli", "--out", str(page_path)]
        )
        == 0
    )
    assert cm.main(["render", *args, "--out", str(page_path), "--check"]) == 0
    page_path.write_text(page_path.read_text() + "edited by hand\n")
    assert cm.main(["render", *args, "--out", str(page_path), "--check"]) == 1


def test_bad_input_is_named(tmp_path: Path) -> None:
    junit_dir = tmp_path / "junit"
    junit_dir.mkdir()
    with pytest.raises(cm.CompatMatrixError, match="no junit files in .*nox -s config tests"):
        cm.collect(junit_dir, about="x")
    (junit_dir / "results-0.19.xml").write_text("<testsuites/>")
    with pytest.raises(
        cm.CompatMatrixError, match=r"results-0\.19\.xml: not a junit file of the nox sessions"
    ):
        cm.collect(junit_dir, about="x")
    (junit_dir / "results-0.19.xml").unlink()
    (junit_dir / "verl-dyncp-mcore0.19.2.xml").write_text(
        '<testsuites><testsuite><testcase classname="packages.verl-dyncp.tests.test_new_thing" name="t"/>'
        "</testsuite></testsuites>"
    )
    with pytest.raises(
        cm.CompatMatrixError, match=r"packages/verl-dyncp/tests/test_new_thing\.py has no feature"
    ):
        cm.collect(junit_dir, about="x")
    with pytest.raises(cm.CompatMatrixError, match="--about is empty"):
        cm.collect(junit_dir, about=" ")
    with pytest.raises(cm.CompatMatrixError, match="does not exist; make it with"):
        cm.load_results(tmp_path / "missing.json")


def test_gpu_suite_runs_become_gpu_rows(tmp_path: Path) -> None:
    """`compat_matrix.py gpu FOLDER` reads gpu_suite.py's records and junit: a column per machine, rows per
    feature, the package told apart by the test's path; `collect` keeps the GPU runs."""
    import json

    run = tmp_path / "h100x2"
    run.mkdir()
    machine = {"gpu": "NVIDIA H100", "gpus": 2, "megatron_core": "0.19.2", "transformer_engine": None}
    record = {"chunk": "fsdp2", "machine": machine, "commit": "abc1234", "green": False, "timed_out": False}
    (run / "fsdp2.json").write_text(json.dumps(record))
    (run / "fsdp2.xml").write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.test_gpu_mfsdp" name="test_a"/>'
        '<testcase classname="tests.test_gpu_mfsdp" name="test_b"><failure message="x"/></testcase>'
        '<testcase classname="packages.verl-dyncp.tests.test_attention" name="test_c"><skipped/></testcase>'
        "</testsuite></testsuites>"
    )
    column, entry = cm.collect_gpu(run)
    assert column == "h100x2" and entry["commits"] == ["abc1234"] and entry["chunks"] == {"fsdp2": "failed"}
    results = {
        "format": cm.RESULTS_VERSION,
        "about": "x",
        "files": {},
        "runs": {},
        "gpu_runs": {column: entry},
    }
    rows = cm.gpu_rows(results)
    assert rows[("verl-mfsdp", "training, offload, export, checkpoints (GPU)")]["h100x2"]["failed"] == 1
    assert rows[("verl-dyncp", "CP core attention, RoPE kernel")]["h100x2"]["skipped"] == 1
    page = cm.render(results, versions=cm.mcore_versions())
    assert "| `h100x2` | NVIDIA H100 | 2 | 0.19.2 | no | abc1234 | fsdp2 failed |" in page
    with pytest.raises(cm.CompatMatrixError, match="no GPU suite records"):
        cm.collect_gpu(tmp_path / "empty")
