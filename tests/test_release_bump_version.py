"""scripts/bump_version.py on a copy of the workspace's pyproject files (the real tree is never written)."""

from __future__ import annotations

import shutil
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import bump_version  # noqa: E402
from workspace_packages import read_packages  # noqa: E402

pytestmark = pytest.mark.release


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """packages/*/pyproject.toml copied into a temporary workspace root."""
    for pyproject in (ROOT / "packages").glob("*/pyproject.toml"):
        dest = tmp_path / "packages" / pyproject.parent.name
        dest.mkdir(parents=True)
        shutil.copy(pyproject, dest / "pyproject.toml")
    return tmp_path


def _config_versions(root: Path) -> tuple[str, str, str, str, str]:
    """verl-config's current version, its compatible bump, the range upper bound, a breaking bump and that
    one's upper bound (the tests follow the checked-in version instead of naming one)."""
    current = Version(read_packages(root)["verl-config"].version)
    minor = current.minor
    compatible = current.base_version if current.is_prerelease else f"0.{minor}.{current.micro + 1}"
    return str(current), compatible, f"0.{minor + 1}", f"0.{minor + 1}.0", f"0.{minor + 2}"


def _project(root: Path, name: str) -> dict:
    return tomllib.loads((root / "packages" / name / "pyproject.toml").read_text())["project"]


def _files(root: Path) -> dict[str, str]:
    return {p.parent.name: p.read_text() for p in (root / "packages").glob("*/pyproject.toml")}


def test_the_checked_in_ranges_agree(tree: Path) -> None:
    assert bump_version.check(tree) == []
    assert bump_version.main(["--root", str(tree), "--check"]) == 0


def test_compatible_bump_moves_the_version_and_every_dependants_range(tree: Path) -> None:
    before = _files(tree)
    _, compatible, upper, _, _ = _config_versions(tree)
    changed = bump_version.bump(tree, package="verl-config", version=compatible)
    assert sorted(p.parent.name for p in changed) == ["verl-config", "verl-engine", "verl-mcore-utils"]
    assert _project(tree, "verl-config")["version"] == compatible
    assert f"verl-config>={compatible},<{upper}" in _project(tree, "verl-mcore-utils")["dependencies"]
    assert f"verl-config>={compatible},<{upper}" in _project(tree, "verl-engine")["dependencies"]
    after = _files(tree)
    # only the changed lines differ; the packages that do not depend on verl-config are untouched
    assert after["verl-dyncp"] == before["verl-dyncp"] and after["verl-mfsdp"] == before["verl-mfsdp"]
    for name in ("verl-config", "verl-engine", "verl-mcore-utils"):
        diff = set(before[name].splitlines()) ^ set(after[name].splitlines())
        assert len(diff) == 2, (name, diff)
    assert bump_version.check(tree) == []


def test_bump_rewrites_ranges_with_extras_in_optional_dependencies(tree: Path) -> None:
    bump_version.bump(tree, package="verl-mcore-utils", version="0.1.1")
    engine = _project(tree, "verl-engine")
    assert engine["optional-dependencies"]["hf"] == ["verl-mcore-utils[hf]>=0.1.1,<0.2"]
    assert engine["optional-dependencies"]["lora"] == ["verl-mcore-utils[peft]>=0.1.1,<0.2"]
    assert "verl-mcore-utils>=0.1.1,<0.2" in _project(tree, "verl-dyncp")["dependencies"]
    assert read_packages(tree)["verl-mcore-utils"].version == "0.1.1"


def test_leaving_the_compatible_range_needs_breaking(tree: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = _files(tree)
    current, _, upper, breaking, breaking_upper = _config_versions(tree)
    assert bump_version.main(["--root", str(tree), "--package", "verl-config", "--version", breaking]) == 1
    err = capsys.readouterr().err
    assert f"'>={current},<{upper}'" in err and "verl-engine, verl-mcore-utils" in err and "--breaking" in err
    assert _files(tree) == before  # nothing written
    bump_version.bump(tree, package="verl-config", version=breaking, breaking=True)
    assert f"verl-config>={breaking},<{breaking_upper}" in _project(tree, "verl-mcore-utils")["dependencies"]
    assert bump_version.check(tree) == []


@pytest.mark.parametrize(
    ("package", "version", "message"),
    [
        ("verl-config", "banana", "not a PEP 440 version"),
        ("verl-config", "0.1.0-rc1", "normal form '0.1.0rc1'"),
        ("verl-config", "0.1.0+local", "local part"),
        ("verl-config", "0.1.0.dev0", "not above"),
        ("verl-config", "0.0.9", "not above"),
        ("verl-nope", "0.1.0", "unknown package 'verl-nope'"),
    ],
)
def test_bad_versions_are_refused_by_name(tree: Path, package: str, version: str, message: str) -> None:
    before = _files(tree)
    with pytest.raises(bump_version.BumpError, match=message.replace("+", r"\+")):
        bump_version.bump(tree, package=package, version=version)
    assert _files(tree) == before


def test_check_names_a_hand_edited_range_and_the_fix(tree: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dyncp = tree / "packages" / "verl-dyncp" / "pyproject.toml"
    dyncp.write_text(
        dyncp.read_text().replace("verl-mcore-utils>=0.1.0.dev0,<0.2", "verl-mcore-utils>=0.1.0.dev0")
    )
    assert bump_version.main(["--root", str(tree), "--check"]) == 1
    err = capsys.readouterr().err
    assert "packages/verl-dyncp/pyproject.toml [project.dependencies] 'verl-mcore-utils>=0.1.0.dev0'" in err
    assert "must be '>=0.1.0.dev0,<0.2'" in err and "--package verl-mcore-utils" in err
    with pytest.raises(bump_version.BumpError, match="disagree before the bump"):
        bump_version.bump(tree, package="verl-config", version=_config_versions(tree)[1])


def test_compatible_upper_bound() -> None:
    assert bump_version.compatible_upper("0.1.0.dev0") == "0.2"
    assert bump_version.compatible_upper("0.9.3") == "0.10"
    assert bump_version.compatible_upper("1.4.0rc1") == "2"
