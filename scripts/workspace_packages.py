"""The published packages of this workspace, read from ``packages/*/pyproject.toml`` (stdlib only).

The release scripts (bump_version.py, release_tag.py, check_dist.py, smoke_install.py) all need the same
facts: which packages exist, their versions, and which sibling each requirement names. They read them
here, from the files, so no list of packages or versions is kept anywhere else.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# A requirement's project name, then optional extras, then the rest (PEP 508, enough for our pyprojects).
_REQUIREMENT = re.compile(
    r"^\s*(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)\s*(?P<extras>\[[^\]]*\])?\s*(?P<spec>[^;]*)"
)


@dataclass(frozen=True, kw_only=True)
class SiblingRequirement:
    """One requirement of a package on another workspace package, where it is declared."""

    owner: str  # the package that declares it
    section: str  # "dependencies" or "optional-dependencies.<extra>"
    text: str  # the requirement as written, e.g. "verl-config>=0.1.0.dev0,<0.2"
    name: str  # the sibling it names
    spec: str  # the version part, e.g. ">=0.1.0.dev0,<0.2"


@dataclass(frozen=True, kw_only=True)
class Package:
    """One workspace member: its distribution name, folder, import name and version."""

    name: str
    path: Path
    version: str
    module: str
    requirements: tuple[tuple[str, str], ...]  # (section, requirement text), in file order

    @property
    def pyproject(self) -> Path:
        return self.path / "pyproject.toml"


def normalize(name: str) -> str:
    """PEP 503 name normalisation, so ``verl_config`` and ``verl-config`` compare equal."""
    return re.sub(r"[-_.]+", "-", name).lower()


def split_requirement(text: str) -> tuple[str, str, str]:
    """(normalised name, extras, version spec) of a requirement string."""
    match = _REQUIREMENT.match(text)
    if match is None:
        raise ValueError(f"cannot read the requirement {text!r}")
    return normalize(match["name"]), match["extras"] or "", match["spec"].strip()


def read_packages(root: Path = ROOT) -> dict[str, Package]:
    """Every ``packages/*/pyproject.toml`` under ``root``, by distribution name."""
    packages: dict[str, Package] = {}
    for pyproject in sorted((root / "packages").glob("*/pyproject.toml")):
        project = tomllib.loads(pyproject.read_text())["project"]
        requirements = [("dependencies", r) for r in project.get("dependencies", [])]
        for extra, reqs in project.get("optional-dependencies", {}).items():
            requirements += [(f"optional-dependencies.{extra}", r) for r in reqs]
        name = normalize(project["name"])
        packages[name] = Package(
            name=name,
            path=pyproject.parent,
            version=project["version"],
            module=name.replace("-", "_"),
            requirements=tuple(requirements),
        )
    if not packages:
        raise FileNotFoundError(f"no packages/*/pyproject.toml under {root}")
    return packages


def sibling_requirements(packages: dict[str, Package]) -> list[SiblingRequirement]:
    """Every requirement of a workspace package on another one."""
    found = []
    for package in packages.values():
        for section, text in package.requirements:
            name, _extras, spec = split_requirement(text)
            if name in packages:
                found.append(
                    SiblingRequirement(owner=package.name, section=section, text=text, name=name, spec=spec)
                )
    return found
