#!/usr/bin/env python3
"""Check what each built wheel and sdist holds before it is published.

    python scripts/check_dist.py dist/            # every artifact in dist/, and all ten must be there
    python scripts/check_dist.py dist/verl_dyncp-0.1.0.dev0-py3-none-any.whl

twine check looks at the metadata only. This looks inside: the package's files are exactly the ones git
tracks under ``packages/<name>/src`` (so no stray or untracked file, no tests, no __pycache__), the
``py.typed`` marker and the LICENSE file are there and named in the metadata, and name and version
agree with the package's pyproject.toml. Every problem is printed with the artifact and the file.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tarfile
import zipfile
from email.parser import HeaderParser
from pathlib import Path, PurePosixPath

from workspace_packages import ROOT, Package, normalize, read_packages

LICENSE_EXPRESSION = "Apache-2.0"
# Never in a published artifact, wherever they sit.
FORBIDDEN_PARTS = {"tests", "test", "__pycache__", ".pytest_cache", ".hypothesis", ".git"}
FORBIDDEN_SUFFIXES = (".pyc", ".pyo", ".rej", "~", ".swp")
# Beside src/ in the sdist. pyproject.toml.orig is uv_build's verbatim copy of the file it normalised.
SDIST_TOP = {"PKG-INFO", "pyproject.toml", "pyproject.toml.orig", "README.md", "LICENSE"}
WHEEL_INFO = {"METADATA", "WHEEL", "RECORD", "entry_points.txt", "licenses/LICENSE"}


def tracked_sources(package: Package, *, root: Path) -> set[str]:
    """Files git tracks under the package's src/<module>, relative to src/."""
    src = package.path / "src"
    out = subprocess.run(
        ["git", "ls-files", "--", str(src.relative_to(root))],
        cwd=root,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    prefix = str(src.relative_to(root)) + "/"
    return {path.removeprefix(prefix) for path in out}


def _forbidden(path: str) -> str | None:
    parts = PurePosixPath(path).parts
    name = parts[-1]
    if set(parts) & FORBIDDEN_PARTS or name.startswith("test_") or name == "conftest.py":
        return "test or cache file"
    if name.endswith(FORBIDDEN_SUFFIXES):
        return "editor, patch or bytecode file"
    if any(p.startswith(".") for p in parts):
        return "hidden file"
    return None


def _check_metadata(headers: str, *, package: Package, what: str) -> list[str]:
    meta = HeaderParser().parsestr(headers)
    problems = []
    if normalize(meta.get("Name", "")) != package.name:
        problems.append(f"{what}: metadata Name {meta.get('Name')!r}, expected {package.name!r}")
    if meta.get("Version") != package.version:
        problems.append(
            f"{what}: metadata Version {meta.get('Version')!r}, pyproject.toml says {package.version!r}"
        )
    if meta.get("License-Expression") != LICENSE_EXPRESSION:
        problems.append(
            f"{what}: License-Expression {meta.get('License-Expression')!r}, expected {LICENSE_EXPRESSION!r}"
        )
    if "LICENSE" not in meta.get_all("License-File", []):
        problems.append(f"{what}: metadata names no License-File LICENSE (license-files in pyproject.toml)")
    return problems


def _check_files(
    names: list[str], *, package: Package, sources: set[str], what: str, base: str, top: set[str]
) -> list[str]:
    """``names`` relative to the artifact root; ``base`` is where src/<module> files sit in it."""
    problems = []
    packaged = set()
    for name in names:
        reason = _forbidden(name)
        if reason:
            problems.append(f"{what}: {name} is a {reason}; it must not be published")
        elif name.startswith(f"{base}{package.module}/"):
            packaged.add(name.removeprefix(base))
        elif name not in top:
            problems.append(f"{what}: {name} is a stray file (not the package's source, metadata or license)")
    for missing in sorted(sources - packaged):
        problems.append(f"{what}: {base}{missing} is tracked by git but missing")
    for extra in sorted(packaged - sources - {p for p in packaged if _forbidden(p)}):
        problems.append(f"{what}: {base}{extra} is not tracked by git (stray file in src/?)")
    if f"{package.module}/py.typed" not in packaged:
        problems.append(f"{what}: no {base}{package.module}/py.typed (typing marker)")
    return problems


def check_wheel(path: Path, *, package: Package, sources: set[str]) -> list[str]:
    with zipfile.ZipFile(path) as archive:
        names = [n for n in archive.namelist() if not n.endswith("/")]
        info = f"{package.module}-{package.version}.dist-info/"
        problems = _check_files(
            [n for n in names if not n.startswith(info)],
            package=package,
            sources=sources,
            what=path.name,
            base="",
            top=set(),
        )
        for name in names:
            if name.startswith(info) and name.removeprefix(info) not in WHEEL_INFO:
                problems.append(f"{path.name}: {name} is a stray file in the .dist-info folder")
        if f"{info}licenses/LICENSE" not in names:
            problems.append(f"{path.name}: no {info}licenses/LICENSE")
        if f"{info}METADATA" not in names:
            return [*problems, f"{path.name}: no {info}METADATA"]
        problems += _check_metadata(archive.read(f"{info}METADATA").decode(), package=package, what=path.name)
    return problems


def check_sdist(path: Path, *, package: Package, sources: set[str]) -> list[str]:
    top = f"{package.module}-{package.version}/"
    with tarfile.open(path) as archive:
        members = [m for m in archive.getmembers() if not m.isdir()]
        outside = [m.name for m in members if not m.name.startswith(top)]
        names = [m.name.removeprefix(top) for m in members if m.name.startswith(top)]
        problems = [f"{path.name}: {name} lies outside the folder {top}" for name in outside]
        problems += [
            f"{path.name}: {m.name} is a link or device, not a file" for m in members if not m.isfile()
        ]
        problems += _check_files(
            names, package=package, sources=sources, what=path.name, base="src/", top=SDIST_TOP
        )
        for required in ("PKG-INFO", "pyproject.toml", "README.md", "LICENSE"):
            if required not in names:
                problems.append(f"{path.name}: no {top}{required}")
        if "PKG-INFO" in names:
            pkg_info = archive.extractfile(top + "PKG-INFO")
            assert pkg_info is not None
            problems += _check_metadata(pkg_info.read().decode(), package=package, what=path.name)
    return problems


def identify(path: Path, packages: dict[str, Package]) -> tuple[Package, str]:
    """The package an artifact belongs to and its kind ("wheel" / "sdist"), from the file name."""
    if path.name.endswith(".whl"):
        kind, stem = "wheel", path.name.split("-")[0]
    elif path.name.endswith(".tar.gz"):
        kind, stem = "sdist", path.name.removesuffix(".tar.gz").rsplit("-", 1)[0]
    else:
        raise ValueError(
            f"{path.name}: not a wheel or sdist; only .whl and .tar.gz files belong in the folder"
        )
    name = normalize(stem)
    if name not in packages:
        raise ValueError(f"{path.name}: no workspace package {name!r} (known: {', '.join(sorted(packages))})")
    package = packages[name]
    expected = (
        f"{package.module}-{package.version}-py3-none-any.whl"
        if kind == "wheel"
        else f"{package.module}-{package.version}.tar.gz"
    )
    if path.name != expected:
        raise ValueError(f"{path.name}: expected {expected} for {name} {package.version} (stale build?)")
    return package, kind


def check_paths(paths: list[Path], *, root: Path = ROOT, require_all: bool = False) -> list[str]:
    """Problems in the given artifacts; ``require_all``: one wheel and one sdist of every package."""
    packages = read_packages(root)
    problems: list[str] = []
    seen: set[tuple[str, str]] = set()
    for path in sorted(paths):
        try:
            package, kind = identify(path, packages)
        except ValueError as err:
            problems.append(str(err))
            continue
        seen.add((package.name, kind))
        sources = tracked_sources(package, root=root)
        check = check_wheel if kind == "wheel" else check_sdist
        problems += check(path, package=package, sources=sources)
    if require_all:
        for name in packages:
            for kind in ("wheel", "sdist"):
                if (name, kind) not in seen:
                    problems.append(
                        f"no {kind} of {name} {packages[name].version} (build it with uv build --package {name})"
                    )
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "paths", nargs="+", type=Path, help="artifacts, or a folder (then all ten must be in it)"
    )
    parser.add_argument("--root", type=Path, default=ROOT, help="workspace root (default: this checkout)")
    args = parser.parse_args(argv)
    paths: list[Path] = []
    require_all = False
    for path in args.paths:
        if path.is_dir():
            require_all = True
            paths += [p for p in path.iterdir() if not p.name.startswith(".")]
        else:
            paths.append(path)
    problems = check_paths(paths, root=args.root.resolve(), require_all=require_all)
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    if problems:
        return 1
    print(f"ok: {len(paths)} artifacts hold their sources, py.typed and LICENSE, and nothing else")
    return 0


if __name__ == "__main__":
    sys.exit(main())
