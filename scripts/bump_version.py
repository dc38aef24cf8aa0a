#!/usr/bin/env python3
"""Bump one package's version and every dependant's range on it, or check that all ranges agree.

    python scripts/bump_version.py --package verl-config --version 0.1.0
    python scripts/bump_version.py --package verl-config --version 0.2.0 --breaking
    python scripts/bump_version.py --check

The version lives only in the package's ``pyproject.toml`` (``__version__`` is read from the installed
metadata). A requirement on a sibling is always ``>=V,<U``: ``V`` is the sibling's current version (the
one the workspace tests against, so no older, untested pairing is claimed) and ``U`` the next
compatible boundary (next minor for 0.x, next major from 1.0). A version that leaves the current
compatible range breaks every dependant's existing range, so it is refused unless ``--breaking`` says
that is meant (the dependants then need a release too). Run ``uv lock`` after a bump.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version
from workspace_packages import ROOT, Package, read_packages, sibling_requirements, split_requirement


class BumpError(ValueError):
    """A version or range that the rules above refuse; the message names the file and the fix."""


def compatible_upper(version: str) -> str:
    """The exclusive upper bound of the range compatible with ``version``: 0.x -> 0.(x+1), else major+1."""
    parsed = Version(version)
    return f"0.{parsed.minor + 1}" if parsed.major == 0 else str(parsed.major + 1)


def sibling_range(version: str) -> str:
    """The range a dependant declares on a sibling at ``version``."""
    return f">={version},<{compatible_upper(version)}"


def _check_version(text: str, *, where: str) -> Version:
    try:
        parsed = Version(text)
    except InvalidVersion:
        raise BumpError(
            f"{where}: {text!r} is not a PEP 440 version (e.g. 0.1.0, 0.2.0rc1, 0.1.1.dev0)"
        ) from None
    if str(parsed) != text:
        raise BumpError(f"{where}: write {text!r} in its normal form {str(parsed)!r}")
    if parsed.local is not None:
        raise BumpError(f"{where}: {text!r} has a local part (+...); package indexes refuse those")
    return parsed


def check(root: Path) -> list[str]:
    """Every broken rule in the workspace under ``root``, one message each (empty when all agree)."""
    packages = read_packages(root)
    problems = []
    for package in packages.values():
        try:
            _check_version(package.version, where=f"{package.pyproject.relative_to(root)} [project] version")
        except BumpError as err:
            problems.append(str(err))
    for req in sibling_requirements(packages):
        sibling = packages[req.name]
        where = f"{packages[req.owner].pyproject.relative_to(root)} [project.{req.section}] {req.text!r}"
        try:
            declared = SpecifierSet(req.spec)
        except InvalidSpecifier:
            problems.append(f"{where}: cannot read the range {req.spec!r}")
            continue
        expected = sibling_range(sibling.version)
        if declared != SpecifierSet(expected):
            problems.append(
                f"{where}: {req.name} is at {sibling.version}, so the range must be {expected!r}"
                f" (fix: python scripts/bump_version.py --package {req.name} --version {sibling.version}"
                " rewrites every range on it)"
            )
    return problems


def _set_project_version(text: str, *, where: Path, old: str, new: str) -> str:
    """Rewrite ``version = "old"`` inside the [project] table only, keeping the rest of the file as written."""
    start = re.search(r"(?m)^\[project\]\s*$", text)
    if start is None:
        raise BumpError(f"{where}: no [project] table")
    end = re.search(r"(?m)^\[", text[start.end() :])
    stop = start.end() + (end.start() if end else len(text) - start.end())
    table, count = re.subn(
        rf'(?m)^version\s*=\s*"{re.escape(old)}"\s*$', f'version = "{new}"', text[start.end() : stop]
    )
    if count != 1:
        raise BumpError(f'{where}: expected one line version = "{old}" in [project], found {count}')
    return text[: start.end()] + table + text[stop:]


def _replace_requirement(text: str, *, where: Path, old: str, new: str) -> str:
    if f'"{old}"' not in text:
        raise BumpError(f'{where}: the requirement "{old}" is not written as a plain string; edit it by hand')
    return text.replace(f'"{old}"', f'"{new}"')


def bump(root: Path, *, package: str, version: str, breaking: bool = False) -> list[Path]:
    """Set ``package`` to ``version`` and every dependant's range on it; returns the files changed."""
    packages = read_packages(root)
    if package not in packages:
        raise BumpError(f"unknown package {package!r}; the workspace has {', '.join(sorted(packages))}")
    target: Package = packages[package]
    new = _check_version(version, where="--version")
    current = Version(target.version)
    if new <= current:
        raise BumpError(f"--version {version} is not above {package}'s current version {target.version}")
    problems = check(root)
    if problems:
        raise BumpError("the ranges disagree before the bump; fix these first:\n  " + "\n  ".join(problems))
    dependants = sorted({r.owner for r in sibling_requirements(packages) if r.name == package})
    if compatible_upper(version) != compatible_upper(target.version) and not breaking:
        raise BumpError(
            f"{package} {version} is outside the range {sibling_range(target.version)!r} that"
            f" {', '.join(dependants) or 'no package'} declare(s): that breaks their existing range rule."
            f" For a compatible release stay below {compatible_upper(target.version)};"
            " for a breaking one pass --breaking (the dependants then need a release too)"
        )
    # Every new file text is made in memory first, so a refusal half-way leaves nothing written.
    texts = {target.pyproject: target.pyproject.read_text()}
    texts[target.pyproject] = _set_project_version(
        texts[target.pyproject], where=target.pyproject, old=target.version, new=version
    )
    # The same requirement may appear in several extras: each (file, text) is rewritten once.
    for owner, old in dict.fromkeys(
        (r.owner, r.text) for r in sibling_requirements(packages) if r.name == package
    ):
        pyproject = packages[owner].pyproject
        _name, extras, _spec = split_requirement(old)
        texts[pyproject] = _replace_requirement(
            texts.get(pyproject) or pyproject.read_text(),
            where=pyproject,
            old=old,
            new=f"{package}{extras}{sibling_range(version)}",
        )
    for pyproject, text in texts.items():
        pyproject.write_text(text)
    changed = list(texts)
    problems = check(root)
    if problems:  # the rewrite itself went wrong: say so rather than leave a half-bumped tree unnoticed
        raise BumpError("after the bump the ranges still disagree:\n  " + "\n  ".join(problems))
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=ROOT, help="workspace root (default: this checkout)")
    parser.add_argument("--check", action="store_true", help="only check that every sibling range agrees")
    parser.add_argument("--package", help="the package to bump, e.g. verl-config")
    parser.add_argument("--version", help="its new version, e.g. 0.1.0")
    parser.add_argument("--breaking", action="store_true", help="allow leaving the current compatible range")
    args = parser.parse_args(argv)
    root = args.root.resolve()
    if args.check:
        problems = check(root)
        for problem in problems:
            print(f"error: {problem}", file=sys.stderr)
        if not problems:
            print(f"ok: every sibling range matches the versions under {root / 'packages'}")
        return 1 if problems else 0
    if not args.package or not args.version:
        parser.error("give --package and --version (or --check)")
    try:
        changed = bump(root, package=args.package, version=args.version, breaking=args.breaking)
    except BumpError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    for path in changed:
        print(f"updated {path.relative_to(root)}")
    print(f"next: uv lock, and a '## [{args.version}]' section in {args.package}'s CHANGELOG.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
