#!/usr/bin/env python3
"""Install each built wheel into a fresh virtualenv, with only what it declares, and use it.

    python scripts/smoke_install.py --dist dist [--work .nox/smoke]

Our packages come only from the wheels in ``--dist`` (``uv pip install --no-index --find-links``); the
third-party packages are installed first at the uv.lock versions (``uv export --no-emit-workspace``), so
they come from uv's cache (hard links) and need no network once cached. A wheel that forgets to declare
a dependency then fails to install or to import, because nothing else is there.

Two venvs keep the cost low (torch + megatron-core are installed once, not four times):

* ``config``: verl-config alone; the check fails if torch ends up installed.
* ``torch``: verl-mcore-utils, then verl-dyncp, then verl-dyncp removed and verl-mfsdp installed, then
  verl-engine. Each package is used while only its declared siblings are present: verl-dyncp and
  verl-mfsdp never see each other, and verl-engine pulls both back from the wheels through its own
  requirements.

Each check runs the venv's python from an empty folder (so this checkout is not on sys.path) and asserts
that the module was imported from the venv.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from workspace_packages import ROOT, read_packages

# What each package is made to do once installed. {version} is the version the wheel must report.
SMOKE = {
    "verl-config": """
import verl_config
assert verl_config.__version__ == "{version}", verl_config.__version__
cfg = verl_config.compose_config(
    "ppo_trainer",
    overrides=["model_engine=megatron", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2"],
)
assert cfg.actor_rollout_ref.actor.megatron.tensor_model_parallel_size == 2
try:
    verl_config.load_config("ppo_trainer")
except verl_config.ConfigError as err:  # ConfigErrors when several keys are missing
    assert "ppo_micro_batch_size_per_gpu" in str(err), err
else:
    raise AssertionError("a config without micro-batch sizes was accepted")
""",
    "verl-mcore-utils": """
import verl_mcore_utils
assert verl_mcore_utils.__version__ == "{version}", verl_mcore_utils.__version__
from verl_mcore_utils.compat import MAX_MCORE_EXCLUSIVE, MIN_MCORE
assert MIN_MCORE <= verl_mcore_utils.mcore_version() < MAX_MCORE_EXCLUSIVE
fields = verl_mcore_utils.ddp_config_fields()
assert "overlap_grad_reduce" in fields, sorted(fields)[:5]
""",
    "verl-dyncp": """
import verl_dyncp
assert verl_dyncp.__version__ == "{version}", verl_dyncp.__version__
plan = verl_dyncp.plan_dynamic_cp([700, 90, 300, 64], dp_cp_size=4, max_seqlen_per_dp_cp_rank=256)
assert plan.cp_size == 4 and sorted(i for a in plan.assignments for i in a) == [0, 1, 2, 3]
verl_dyncp.thd_layer_spec  # the lazily imported megatron-core part loads too
""",
    "verl-mfsdp": """
import verl_mfsdp
assert verl_mfsdp.__version__ == "{version}", verl_mfsdp.__version__
assert "optim_grads_params" in verl_mfsdp.SHARDING_STRATEGIES, verl_mfsdp.SHARDING_STRATEGIES
""",
    "verl-engine": """
import verl_engine
assert verl_engine.__version__ == "{version}", verl_engine.__version__
for name in verl_engine.__all__:
    getattr(verl_engine, name)  # every lazily exported name resolves: all its siblings are installed
""",
}
# A command each package installs, run from the venv.
# verl-config generate --check: the reference YAMLs shipped in the wheel match the schema.
CLIS = {"verl-config": ["verl-config", "generate", "--check"], "verl-engine": ["verl-engine", "--help"]}


class SmokeError(RuntimeError):
    """An install or a check failed; the message names the package and the step."""


def _run(cmd: list[str], *, what: str, cwd: Path | None = None, timeout: float = 600) -> str:
    start = time.monotonic()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    try:
        proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise SmokeError(f"{what}: no result after {timeout:.0f} s: {' '.join(cmd)}") from None
    if proc.returncode != 0:
        raise SmokeError(f"{what} failed ({' '.join(cmd)}):\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    print(f"  ok {what} ({time.monotonic() - start:.1f} s)", flush=True)
    return proc.stdout


def uv() -> str:
    path = shutil.which("uv")
    if path is None:
        raise SmokeError("uv is not on PATH; install it (pip install 'uv>=0.8,<0.14')")
    return path


def create_venv(path: Path, *, seed: bool = False) -> Path:
    """A fresh virtualenv at ``path`` (replaced if there), on this Python; returns its python."""
    shutil.rmtree(path, ignore_errors=True)
    cmd = [uv(), "venv", "--quiet", "--python", sys.executable, *(["--seed"] if seed else []), str(path)]
    _run(cmd, what=f"venv {path.name}")
    return path / "bin" / "python"


def install_third_party(python: Path, *, package: str, root: Path = ROOT) -> None:
    """The third-party requirements of ``package`` at the uv.lock versions (none of our packages)."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as reqs:
        path = Path(reqs.name)
    try:
        export = [uv(), "export", "--frozen", "--package", package, "--no-emit-workspace", "--no-hashes"]
        export += [
            "--no-header",
            "--no-annotate",
            "--no-default-groups",
            "--quiet",
            "--output-file",
            str(path),
        ]
        _run(export, what=f"uv export {package}", cwd=root)
        _run(
            [uv(), "pip", "install", "--quiet", "--python", str(python), "--requirement", str(path)],
            what=f"third-party requirements of {package}",
        )
    finally:
        path.unlink(missing_ok=True)


def install_ours(python: Path, *, package: str, version: str, find_links: Path) -> None:
    """``package`` and the siblings it declares, from the wheels in ``find_links`` only."""
    cmd = [uv(), "pip", "install", "--quiet", "--python", str(python), "--no-index", "--no-build"]
    cmd += ["--find-links", str(find_links), f"{package}=={version}"]
    _run(cmd, what=f"install {package} {version} from {find_links}")


def installed(python: Path) -> set[str]:
    out = _run([uv(), "pip", "list", "--python", str(python), "--format", "freeze"], what="uv pip list")
    return {line.split("==")[0].lower() for line in out.split()}


def check_package(python: Path, *, package: str, version: str, present: set[str], absent: set[str]) -> None:
    """Use ``package`` from the venv, after checking which of our packages are (not) installed."""
    have = installed(python)
    if missing := present - have:
        raise SmokeError(f"{package}: expected {sorted(missing)} installed from the wheels")
    if extra := absent & have:
        raise SmokeError(f"{package}: {sorted(extra)} must not be installed for this check")
    module = package.replace("-", "_")
    venv = python.parent.parent
    code = SMOKE[package].format(version=version)
    code += f"\nassert verl_file.startswith({str(venv)!r}), verl_file\n"
    code = f"import {module}\nverl_file = {module}.__file__\n" + code
    with tempfile.TemporaryDirectory() as empty:
        _run([str(python), "-c", code], what=f"use {package}", cwd=Path(empty))
        if package in CLIS:
            exe, *args = CLIS[package]
            _run([str(venv / "bin" / exe), *args], what=f"{exe} {' '.join(args)}", cwd=Path(empty))


def smoke_config(dist: Path, *, work: Path, root: Path = ROOT) -> None:
    """verl-config alone in its own venv; fails if torch got installed with it."""
    packages = read_packages(root)
    version = packages["verl-config"].version
    print("venv config: verl-config alone", flush=True)
    python = create_venv(work / "config")
    install_third_party(python, package="verl-config", root=root)
    install_ours(python, package="verl-config", version=version, find_links=dist)
    check_package(
        python,
        package="verl-config",
        version=version,
        present={"verl-config"},
        absent=set(packages) - {"verl-config"},
    )
    if "torch" in installed(python):
        raise SmokeError("verl-config: torch was installed with it; verl-config must not depend on torch")


def smoke_torch(dist: Path, *, work: Path, root: Path = ROOT) -> None:
    """The torch packages in one venv, each used with only its declared siblings installed."""
    packages = read_packages(root)
    ours = set(packages)
    print("venv torch: verl-mcore-utils, verl-dyncp, verl-mfsdp, verl-engine in turn", flush=True)
    python = create_venv(work / "torch")
    steps = [
        ("verl-mcore-utils", {"verl-config", "verl-mcore-utils"}),
        ("verl-dyncp", {"verl-config", "verl-mcore-utils", "verl-dyncp"}),
        ("verl-mfsdp", {"verl-config", "verl-mcore-utils", "verl-mfsdp"}),
        ("verl-engine", ours),
    ]
    for package, present in steps:
        if package == "verl-mfsdp":
            _run(
                [uv(), "pip", "uninstall", "--quiet", "--python", str(python), "verl-dyncp"],
                what="remove verl-dyncp",
            )
        version = packages[package].version
        install_third_party(python, package=package, root=root)
        install_ours(python, package=package, version=version, find_links=dist)
        check_package(python, package=package, version=version, present=present, absent=ours - present)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dist", type=Path, default=ROOT / "dist", help="folder with the built wheels")
    parser.add_argument("--work", type=Path, default=ROOT / ".nox" / "smoke", help="where the venvs go")
    args = parser.parse_args(argv)
    start = time.monotonic()
    try:
        smoke_config(args.dist.resolve(), work=args.work.resolve())
        smoke_torch(args.dist.resolve(), work=args.work.resolve())
    except SmokeError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"ok: every wheel installed alone and worked ({time.monotonic() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
