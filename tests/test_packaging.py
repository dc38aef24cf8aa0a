"""Workspace packaging rules: versions, typed markers, public API, one-way dependencies."""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {
    "verl-config": "verl_config",
    "verl-mcore-utils": "verl_mcore_utils",
    "verl-dyncp": "verl_dyncp",
    "verl-mfsdp": "verl_mfsdp",
    "verl-engine": "verl_engine",
}
# Which siblings each package may depend on (config <- mcore-utils <- dyncp, mfsdp <- engine).
ALLOWED_SIBLINGS = {
    "verl-config": set(),
    "verl-mcore-utils": {"verl-config"},
    "verl-dyncp": {"verl-mcore-utils"},
    "verl-mfsdp": {"verl-mcore-utils"},
    "verl-engine": {"verl-config", "verl-mcore-utils", "verl-dyncp", "verl-mfsdp"},
}


def _pyproject(dist: str) -> dict:
    return tomllib.loads((ROOT / "packages" / dist / "pyproject.toml").read_text())


@pytest.mark.parametrize("dist", PACKAGES)
def test_package_layout_version_and_api(dist: str) -> None:
    module_name = PACKAGES[dist]
    meta = _pyproject(dist)["project"]
    assert meta["requires-python"] == ">=3.10"
    src = ROOT / "packages" / dist / "src" / module_name
    assert (src / "py.typed").is_file()
    assert (ROOT / "packages" / dist / "README.md").is_file()
    module = importlib.import_module(module_name)
    assert module.__version__ == meta["version"] == importlib.metadata.version(dist)
    for name in module.__all__:
        assert hasattr(module, name), (
            f"{module_name}.__all__ lists {name!r} but the module has no such attribute"
        )


@pytest.mark.parametrize("dist", PACKAGES)
def test_sibling_dependencies_are_versioned_and_one_way(dist: str) -> None:
    deps = _pyproject(dist)["project"]["dependencies"]
    siblings = {}
    for dep in deps:
        name = re.split(r"[<>=!~\[ ;]", dep, maxsplit=1)[0]
        if name in PACKAGES:
            siblings[name] = dep
    assert set(siblings) <= ALLOWED_SIBLINGS[dist], (
        f"{dist} depends on {set(siblings) - ALLOWED_SIBLINGS[dist]}"
    )
    for dep in siblings.values():
        assert re.search(r">=\s*\d", dep), (
            f"{dist}: dependency {dep!r} on a sibling needs a version constraint"
        )


def test_verl_config_has_no_torch_dependency() -> None:
    requires = importlib.metadata.requires("verl-config") or []
    assert not [r for r in requires if r.lower().startswith(("torch", "megatron"))], requires


@pytest.mark.parametrize("dist", PACKAGES)
def test_lazy_public_names_are_written_once(dist: str) -> None:
    """A package that loads names on first use lists each one once, in ``_LAZY`` (name -> module).

    ``__all__`` is derived from it, and the TYPE_CHECKING re-exports (for type checkers and IDEs, where
    present) must import exactly those names from those modules.
    """
    import ast

    module = importlib.import_module(PACKAGES[dist])
    lazy: dict[str, str] = getattr(module, "_LAZY", {})
    assert len(module.__all__) == len(set(module.__all__)), f"{dist}: __all__ repeats a name"
    assert set(lazy) <= set(module.__all__), f"{dist}: lazy names missing from __all__"
    for name, source in lazy.items():
        assert hasattr(importlib.import_module(source), name), f"{dist}: _LAZY says {source}.{name}"
    typed: dict[str, str] = {}
    for node in ast.walk(ast.parse(Path(module.__file__).read_text())):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            for stmt in node.body:
                assert isinstance(stmt, ast.ImportFrom) and stmt.module, ast.dump(stmt)
                typed.update({alias.asname or alias.name: stmt.module for alias in stmt.names})
    if typed:
        assert typed == lazy, f"{dist}: the TYPE_CHECKING imports and _LAZY differ"


def _imports_megatron_at_top(path: Path) -> bool:
    import ast

    for node in ast.parse(path.read_text()).body:
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        if any(name == "megatron" or name.startswith("megatron.") for name in names):
            return True
    return False


def _first_megatron_module_per_package() -> list[str]:
    """One module per package that imports megatron-core at its top (the package __init__ runs before any)."""
    found = []
    for dist, module_name in PACKAGES.items():
        src = ROOT / "packages" / dist / "src" / module_name
        modules = sorted(
            p for p in src.glob("*.py") if p.name != "__init__.py" and _imports_megatron_at_top(p)
        )
        if modules:
            found.append(f"{module_name}.{modules[0].stem}")
    return found


@pytest.mark.parametrize("module_name", _first_megatron_module_per_package())
def test_megatron_is_imported_only_after_the_package_prepared_it(module_name: str) -> None:
    """Our modules import megatron-core at their top, with no call before the imports: the package
    ``__init__`` (which Python runs first) calls prepare_megatron_import(). Checked in a fresh process at the
    moment megatron-core is first imported (the process stops there, so megatron-core is never loaded)."""
    code = f"""
import os, sys

class StopAtMegatron:
    def find_spec(self, name, path=None, target=None):
        if name == "megatron":
            import torch
            prepared = "TORCH_CUDA_ARCH_LIST" in os.environ or torch.cuda.is_available()
            raise SystemExit(0 if prepared else 3)

sys.meta_path.insert(0, StopAtMegatron())
import {module_name}
raise SystemExit(4)
"""
    env = {k: v for k, v in os.environ.items() if k != "TORCH_CUDA_ARCH_LIST"}
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode != 4, f"{module_name} did not import megatron-core"
    assert result.returncode == 0, (
        f"{module_name} imported megatron-core before prepare_megatron_import ran: {result}"
    )


def test_megatron_core_bounds_agree_everywhere() -> None:
    """compat.MIN_MCORE / MAX_MCORE_EXCLUSIVE, each pyproject's megatron-core range and noxfile's test matrix.

    The supported range is written in six places; a release that widens it in one must widen it in all,
    and the nox matrix must test every minor release inside it (the oldest and newest run in CI).
    """
    import ast

    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    from verl_mcore_utils import compat

    low, high = compat.MIN_MCORE, compat.MAX_MCORE_EXCLUSIVE
    declared = {}
    for dist in PACKAGES:
        for text in _pyproject(dist)["project"]["dependencies"]:
            req = Requirement(text)
            if req.name == "megatron-core":
                declared[dist] = req.specifier
    assert set(declared) == set(PACKAGES) - {"verl-config"}, (
        f"megatron-core is declared by {sorted(declared)}"
    )
    for dist, spec in declared.items():
        bounds = {(s.operator, Version(s.version)) for s in spec}
        assert bounds == {(">=", low), ("<", high)}, (
            f"packages/{dist}/pyproject.toml: megatron-core{spec} but compat.py supports {low} <= version < {high}"
        )
    # The install hint compat.py prints names the same range.
    hints = re.findall(r"megatron-core([<>=][^'\"]*)", Path(compat.__file__).read_text())
    assert hints, "compat.py no longer names the megatron-core range in its install hint"
    for hint in hints:
        assert {(s.operator, Version(s.version)) for s in SpecifierSet(hint)} == {(">=", low), ("<", high)}, (
            hint
        )
    # noxfile.MCORE_VERSIONS, read without importing nox: one release of every minor version in the range.
    tree = ast.parse((ROOT / "noxfile.py").read_text())
    (matrix,) = [
        ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "MCORE_VERSIONS"
    ]
    versions = [Version(v) for v in matrix]
    assert versions == sorted(versions) and all(low <= v < high for v in versions), (matrix, low, high)
    minors = [(v.major, v.minor) for v in versions]
    assert low.major == high.major, (
        "the range spans a major release: say here which minors the matrix must hold"
    )
    expected = [(low.major, m) for m in range(low.minor, high.minor)]
    assert minors == expected, (
        f"noxfile.MCORE_VERSIONS {matrix} should hold one release of each of {expected}"
    )


@pytest.mark.parametrize("dist", PACKAGES)
def test_each_package_ships_the_workspace_license(dist: str) -> None:
    """Every package carries the root Apache-2.0 LICENSE and names it, so wheel and sdist include it."""
    meta = _pyproject(dist)["project"]
    assert meta["license"] == "Apache-2.0" and meta["license-files"] == ["LICENSE"]
    assert (ROOT / "packages" / dist / "LICENSE").read_bytes() == (ROOT / "LICENSE").read_bytes()


# What the GPU host has before the wheelhouse arrives: torch (with triton), transformers, peft, einops, pytest;
# numpy comes with them. The walk stops at these (their own dependencies are the host's business).
GPU_HOST_HAS = {"torch", "numpy"}


def test_the_gpu_wheelhouse_carries_every_runtime_dependency_the_gpu_host_lacks() -> None:
    """scripts/wheelhouse.py's RUNTIME list is the closure, through uv.lock, of the five packages' runtime
    dependencies (no extras) minus the workspace packages and what the GPU host has. Why: a package missing
    there shows up only on the device machine, as an import error of a GPU test (issue 35, item 14:
    tensordict was missing and verl-engine's loss tests could not be imported there)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import wheelhouse
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    from packaging.markers import Marker

    def installed(dep: dict) -> bool:  # no extra chosen (uv.lock marks what an extra alone pulls in)
        return "marker" not in dep or Marker(dep["marker"]).evaluate({"extra": ""})

    lock = tomllib.loads((ROOT / "uv.lock").read_text())
    deps: dict[str, set[str]] = {}
    for package in lock["package"]:
        wanted = (d["name"] for d in package.get("dependencies", []) if installed(d))
        deps.setdefault(package["name"], set()).update(wanted)
    needed: set[str] = set()
    todo = list(PACKAGES)
    while todo:
        name = todo.pop()
        for dep in deps.get(name, set()):
            if dep not in needed and dep not in GPU_HOST_HAS:
                needed.add(dep)
                todo.append(dep)
    needed -= set(PACKAGES)
    assert needed == set(wheelhouse.RUNTIME), (
        f"missing from scripts/wheelhouse.py RUNTIME: {sorted(needed - set(wheelhouse.RUNTIME))};"
        f" not needed there: {sorted(set(wheelhouse.RUNTIME) - needed)}"
    )
