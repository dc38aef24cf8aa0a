"""The release workflow (.github/workflows/release.yml) and the tag rules it runs (scripts/release_tag.py).

The workflow cannot run here, so it is validated against GitHub's workflow schema (check-jsonschema's
vendored copy, no network) and its release-critical settings are read back from the file. The tag logic
it calls is a script, tested directly.
"""

from __future__ import annotations

import fnmatch
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import release_tag  # noqa: E402
from workspace_packages import read_packages  # noqa: E402

pytestmark = pytest.mark.release
WORKFLOW = ROOT / ".github" / "workflows" / "release.yml"
PACKAGES = read_packages()


def _schema_check(path: Path) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("check-jsonschema", path=os.path.dirname(sys.executable))
    assert exe, "check-jsonschema is not installed next to this python; uv sync --group release"
    cmd = [exe, "--builtin-schema", "vendor.github-workflows", str(path)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def _workflow() -> dict:
    return yaml.safe_load(WORKFLOW.read_text())


def test_workflow_matches_the_github_schema(tmp_path: Path) -> None:
    result = _schema_check(WORKFLOW)
    assert result.returncode == 0, result.stdout + result.stderr
    # the validator does reject a broken workflow (a job without runs-on or steps)
    broken = tmp_path / "broken.yml"
    broken.write_text(WORKFLOW.read_text().replace("    runs-on: ubuntu-latest\n", "    runs-on: 3\n", 1))
    assert _schema_check(broken).returncode != 0


def test_workflow_runs_on_release_tags_only_and_publishes_with_trusted_publishing() -> None:
    flow = _workflow()
    on = flow[True] if True in flow else flow["on"]  # YAML 1.1 reads the key `on` as True
    assert on == {"push": {"tags": ["verl-*-v*"]}}
    assert flow["permissions"] == {}
    build, publish = flow["jobs"]["build"], flow["jobs"]["publish"]
    assert build["permissions"] == {"contents": "read"}
    assert publish["permissions"] == {"id-token": "write"} and publish["needs"] == "build"
    assert publish["environment"]["name"] == "pypi"
    (upload,) = [s for s in publish["steps"] if s.get("uses", "").startswith("pypa/gh-action-pypi-publish@")]
    assert "with" not in upload  # no password / token input: trusted publishing
    text = WORKFLOW.read_text()
    assert "secrets." not in text and "password" not in text.lower()
    runs = "\n".join(s.get("run", "") for s in build["steps"])
    assert 'scripts/release_tag.py "$GITHUB_REF_NAME" --github-output' in runs
    assert 'uv build --package "$PACKAGE" --no-sources --out-dir dist' in runs
    assert "--dist dist" in runs and "twine check --strict" in runs and "scripts/check_dist.py" in runs
    assert "scripts/bump_version.py --check" in runs  # sibling ranges agree with the versions
    assert "${{" not in runs  # values reach the shell through env, never pasted into the script
    for job in flow["jobs"].values():
        for step in job["steps"]:
            if "uses" in step:
                assert "@" in step["uses"], f"{step['uses']} must name a version"


@pytest.mark.parametrize("name", sorted(PACKAGES))
def test_every_packages_current_tag_is_accepted(name: str, tmp_path: Path) -> None:
    package = PACKAGES[name]
    tag = f"{name}-v{package.version}"
    assert fnmatch.fnmatchcase(tag, "verl-*-v*")  # the workflow's trigger fires for it
    release = release_tag.parse_tag(f"refs/tags/{tag}")
    assert (release.package, release.version, release.module) == (name, package.version, package.module)
    out = tmp_path / "github_output"
    assert release_tag.main([tag, "--github-output", str(out)]) == 0
    assert out.read_text() == f"package={name}\nversion={package.version}\nmodule={package.module}\n"


@pytest.mark.parametrize(
    ("tag", "message"),
    [
        ("verl-dyncp-0.1.0", "not of the form verl-<package>-v<version>"),
        ("v0.1.0", "not of the form"),
        ("verl-nope-v0.1.0.dev0", "names no package 'verl-nope'; the packages are verl-config, "),
        ("verl-dyncp-v9.9.9", "says version 9.9.9 but packages/verl-dyncp/pyproject.toml says"),
        ("verl-mcore-utils-v0.1.0", "says version 0.1.0 but packages/verl-mcore-utils/pyproject.toml says"),
    ],
)
def test_bad_tags_are_refused_with_the_reason(tag: str, message: str) -> None:
    with pytest.raises(release_tag.TagError, match=re.escape(message)):
        release_tag.parse_tag(tag)
    assert release_tag.main([tag]) == 1


def test_a_version_without_a_changelog_section_is_refused(tmp_path: Path) -> None:
    for name in PACKAGES:
        dest = tmp_path / "packages" / name
        dest.mkdir(parents=True)
        shutil.copy(PACKAGES[name].pyproject, dest / "pyproject.toml")
    (tmp_path / "packages" / "verl-mfsdp" / "CHANGELOG.md").write_text("# Changelog\n\n## [0.0.1]\n")
    version = PACKAGES["verl-mfsdp"].version
    with pytest.raises(release_tag.TagError, match=rf"CHANGELOG.md has no '## \[{version}\]' section"):
        release_tag.parse_tag(f"verl-mfsdp-v{version}", root=tmp_path)


def test_dist_must_hold_exactly_the_tagged_release(tmp_path: Path) -> None:
    package = PACKAGES["verl-dyncp"]
    release = release_tag.parse_tag(f"verl-dyncp-v{package.version}")
    wheel = f"{package.module}-{package.version}-py3-none-any.whl"
    sdist = f"{package.module}-{package.version}.tar.gz"
    for name in (wheel, sdist, ".gitignore"):
        (tmp_path / name).write_text("")
    release_tag.check_dist(release, tmp_path)
    other = PACKAGES["verl-config"]
    (tmp_path / f"{other.module}-{other.version}-py3-none-any.whl").write_text("")
    (tmp_path / sdist).unlink()
    with pytest.raises(release_tag.TagError, match=rf"missing \['{sdist}'\], not part of this release"):
        release_tag.check_dist(release, tmp_path)
