#!/usr/bin/env python3
"""Read a release tag ``verl-<package>-v<version>`` and refuse it unless it matches the package (stdlib only).

    python3 scripts/release_tag.py verl-dyncp-v0.1.0 [--github-output "$GITHUB_OUTPUT"]
    python3 scripts/release_tag.py verl-dyncp-v0.1.0 --dist dist    # dist/ holds exactly that release

.github/workflows/release.yml runs this first, so a tag that names an unknown package, a version other than
the one in the package's pyproject.toml, or a version without a CHANGELOG.md section publishes nothing.
With ``--dist`` it also checks that the folder holds that package's wheel and sdist and nothing else, so
only the tagged package can reach the index.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from workspace_packages import ROOT, Package, read_packages

TAG = re.compile(r"^(?P<package>verl-[a-z0-9]+(?:-[a-z0-9]+)*?)-v(?P<version>[0-9][0-9A-Za-z.+!-]*)$")


class TagError(ValueError):
    """The tag cannot be released; the message says why and what to do."""


@dataclass(frozen=True, kw_only=True)
class Release:
    package: str
    version: str
    module: str
    path: Path


def parse_tag(tag: str, *, root: Path = ROOT) -> Release:
    """The release a tag asks for, after checking it against the package's pyproject.toml and CHANGELOG.md."""
    tag = tag.removeprefix("refs/tags/")
    match = TAG.match(tag)
    if match is None:
        raise TagError(f"tag {tag!r} is not of the form verl-<package>-v<version>, e.g. verl-dyncp-v0.1.0")
    packages = read_packages(root)
    name, version = match["package"], match["version"]
    if name not in packages:
        raise TagError(
            f"tag {tag!r} names no package {name!r}; the packages are {', '.join(sorted(packages))}"
        )
    package: Package = packages[name]
    if version != package.version:
        raise TagError(
            f"tag {tag!r} says version {version} but {package.pyproject.relative_to(root)} says"
            f" {package.version}; bump it (scripts/bump_version.py) and tag that commit, or tag"
            f" {name}-v{package.version}"
        )
    changelog = package.path / "CHANGELOG.md"
    heading = re.compile(rf"(?m)^## \[{re.escape(version)}\]")
    if not changelog.is_file() or not heading.search(changelog.read_text()):
        raise TagError(
            f"{changelog.relative_to(root)} has no '## [{version}]' section; write one before releasing"
        )
    return Release(package=name, version=version, module=package.module, path=package.path)


def check_dist(release: Release, dist: Path) -> None:
    """``dist`` holds this release's wheel and sdist and nothing else."""
    expected = {
        f"{release.module}-{release.version}-py3-none-any.whl",
        f"{release.module}-{release.version}.tar.gz",
    }
    found = {p.name for p in dist.iterdir() if not p.name.startswith(".")}
    if found != expected:
        raise TagError(
            f"{dist} must hold exactly {sorted(expected)}; missing {sorted(expected - found)},"
            f" not part of this release {sorted(found - expected)}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tag", help="the pushed tag, e.g. verl-dyncp-v0.1.0 (refs/tags/ prefix allowed)")
    parser.add_argument("--root", type=Path, default=ROOT, help="workspace root (default: this checkout)")
    parser.add_argument("--github-output", type=Path, help="append package=, version=, module= lines here")
    parser.add_argument("--dist", type=Path, help="also check that this folder holds exactly this release")
    args = parser.parse_args(argv)
    try:
        release = parse_tag(args.tag, root=args.root.resolve())
        if args.dist is not None:
            check_dist(release, args.dist)
    except TagError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    lines = f"package={release.package}\nversion={release.version}\nmodule={release.module}\n"
    if args.github_output is not None:
        with args.github_output.open("a") as out:
            out.write(lines)
    print(lines, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
