"""Test matrix over megatron-core releases, lint, and the offline wheelhouse.

    uv run nox -t ci                 # what CI runs: lint, verl-config alone, oldest + newest megatron-core
    uv run nox -s tests              # every megatron-core version below
    uv run nox -s "tests(0.16.1)"
    uv run nox -s wheelhouse -- --mcore 0.19.2 --out wheelhouse
    uv run nox -s build              # wheel + sdist of each package into dist/, checked, each installed alone
    uv run nox -s release            # release tooling tests, incl. publishing to a local index (in CI)
    uv run nox -s bump -- --package verl-config --version 0.1.0   # then commit pyproject files + uv.lock
    uv run nox -s docs               # the docs site: mkdocs build --strict into site/
    uv run nox -s verl               # verl 0.9.1's TrainingWorker drives verl-engine (CPU), with verl's own pins

Each test session installs the workspace from uv.lock (uv sync --frozen) into its own virtualenv and
then overrides megatron-core (and what an old release needs, e.g. numpy<2 for 0.14 / 0.15).
"""

from __future__ import annotations

import glob
import os
import shutil

import nox

# Bytecode at install time: with PYTHONDONTWRITEBYTECODE set (as on our machines) every process would otherwise
# compile megatron-core and torch from source on import (about 23 s against 9 s per rank on a 2-core machine, and
# the CPU tests start hundreds of ranks).
os.environ.setdefault("UV_COMPILE_BYTECODE", "1")
nox.options.default_venv_backend = "uv"
nox.options.reuse_existing_virtualenvs = True
nox.options.error_on_missing_interpreters = True

PYTHON = "3.12"
MCORE_VERSIONS = ["0.14.0", "0.15.3", "0.16.1", "0.17.1", "0.18.2", "0.19.2"]
CI_MCORE_VERSIONS = {MCORE_VERSIONS[0], MCORE_VERSIONS[-1]}
# What an old megatron-core needs beside it (its wheel declares numpy<2).
EXTRA_PINS = {"0.14.0": ["numpy<2"], "0.15.3": ["numpy<2"]}
PACKAGES = ["verl-config", "verl-mcore-utils", "verl-dyncp", "verl-mfsdp", "verl-engine"]
# The verl release our losses are compared with (`verl_reference` tests): its wheel without dependencies, plus the
# two small modules importing its core_algos needs beyond our test environment.
VERL_REFERENCE = ["verl==0.9.1", "codetiming", "orjson"]
# What verl 0.9.1's TrainingWorker imports beyond its declared dependencies (verl/workers/rollout/utils.py), for the
# `verl` session; verl itself and everything it pins come from uv.lock's verl fork (extra verl-engine[verl]).
VERL_WORKER_IMPORTS = ["fastapi", "uvicorn"]
# The type checker and the stubs it needs (PyYAML ships none), pinned: a new mypy release may find new errors.
MYPY = ["mypy==2.4.1", "types-PyYAML"]


def _sync(session: nox.Session, *args: str) -> None:
    """Install from uv.lock into the session's virtualenv."""
    session.run_install(
        "uv",
        "sync",
        "--frozen",
        "--inexact",
        *args,
        env={"UV_PROJECT_ENVIRONMENT": session.virtualenv.location, "UV_PYTHON_DOWNLOADS": "never"},
    )


def _pytest(session: nox.Session, path: str, name: str, *, marks: str = "not gpu") -> None:
    junit = os.path.join(".nox", "junit", f"{name}.xml")
    session.run("python", "-m", "pytest", path, "-q", "-m", marks, f"--junitxml={junit}", *session.posargs)


@nox.session(python=PYTHON, tags=["ci"])
def lint(session: nox.Session) -> None:
    """ruff check and format check."""
    session.install("ruff>=0.8")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session(python=PYTHON, tags=["ci"])
def config(session: nox.Session) -> None:
    """verl-config alone, with no torch in the environment (it must not need it); its annotations type-check."""
    _sync(session, "--package", "verl-config", "--no-default-groups")
    # pip: the refresh script's `pip download` test; mypy: the package ships py.typed, so its annotations must hold
    session.install("pytest>=8", "hypothesis>=6", "pip>=24", *MYPY)
    session.run(
        "python", "-c", "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is not None)"
    )
    session.run("verl-config", "generate", "--check")  # fails when the checked-in reference configs are stale
    session.run("mypy", "--cache-dir", ".nox/mypy-cache", "packages/verl-config/src/verl_config")
    _pytest(session, "packages/verl-config/tests", "verl-config")


@nox.session(python=PYTHON, tags=["ci"])
def docs(session: nox.Session) -> None:
    """The docs site: the compatibility page is current, then mkdocs build --strict into site/.

    Only the docs group is installed: mkdocstrings reads the packages' sources statically (mkdocs.yml's paths),
    so neither torch nor megatron-core is needed.
    """
    _sync(session, "--only-group", "docs")
    session.run("python", "scripts/compat_matrix.py", "render", "--check")
    session.run("mkdocs", "build", "--strict", "--site-dir", "site", env={"NO_MKDOCS_2_WARNING": "1"})


@nox.session(python=PYTHON)
@nox.parametrize(
    "mcore", [nox.param(v, id=v, tags=["ci"] if v in CI_MCORE_VERSIONS else []) for v in MCORE_VERSIONS]
)
def tests(session: nox.Session, mcore: str) -> None:
    """Every torch package's tests and the cross-package tests against one megatron-core release."""
    # the verl extra is locked in a fork of its own (tensordict<=0.10, transformers<5.11): the `verl` session's
    _sync(
        session,
        "--all-packages",
        "--all-extras",
        "--no-extra",
        "verl",
        "--no-default-groups",
        "--group",
        "test",
    )
    session.install(f"megatron-core=={mcore}", *EXTRA_PINS.get(mcore, []))
    session.run(
        "python", "-c", f"import importlib.metadata as m; assert m.version('megatron-core') == '{mcore}'"
    )
    # `above_engine` tests drive the engine only through its public API (the GRPO loop, the Ray launcher, the
    # documented example): what they add per release is covered by the engine's own tests, so they run
    # against the newest megatron-core only.
    # `newest_mcore` tests do not touch megatron-core (the rank harness, interpreted Triton kernels, scripts): a second
    # run against an older release would test the same thing twice. So are controls that show a test can fail
    # (the MTP hang control) and checks of our own code that run before or beside the model (batch checks,
    # checkpoint file atomicity): properties of our code, not of the release.
    # `release` tests need the release tool group and run once, in the `release` session.
    # `verl_reference` tests compare with the published verl wheel, installed here for the newest release only.
    newest = mcore == MCORE_VERSIONS[-1]
    if newest:
        session.install("--no-deps", *VERL_REFERENCE)
        # every package ships py.typed, so its annotations must hold; checked once, against the newest release
        # (verl-config in the `config` session, without torch). pyproject.toml's [tool.mypy] lists the untyped
        # libraries read as Any.
        session.install(*MYPY)
        session.run(
            "mypy",
            "--cache-dir",
            os.path.join(".nox", "mypy-cache-torch"),
            *(f"packages/{pkg}/src/{pkg.replace('-', '_')}" for pkg in PACKAGES if pkg != "verl-config"),
        )
    marks = (
        "not gpu and not release and not verl_backend"
        if newest
        else "not gpu and not above_engine and not newest_mcore and not release and not verl_reference and not verl_backend"
    )
    # verl-config's tests run in the `config` session, without torch (the stricter environment): they touch
    # neither torch nor megatron-core, so a run per release would repeat them.
    for pkg in (p for p in PACKAGES if p != "verl-config"):
        tests_dir = f"packages/{pkg}/tests"
        if any(f.startswith("test_") for f in os.listdir(tests_dir)):
            _pytest(session, tests_dir, f"{pkg}-mcore{mcore}", marks=marks)
    _pytest(session, "tests", f"cross-mcore{mcore}", marks=marks)


@nox.session(python=PYTHON, tags=["ci"])
def verl(session: nox.Session) -> None:
    """verl 0.9.1's own TrainingWorker drives verl-engine on CPU (`verl_backend` tests), newest megatron-core.

    Installed as a user gets it: verl-engine[verl] from uv.lock's verl fork, so verl 0.9.1 with its dependencies and
    its pins (tensordict 0.10.0, transformers 5.10.x), not the test environment's newer ones. Junit files go to
    .nox/junit/verl/ (the compatibility page's columns are the `tests` sessions).
    """
    _sync(
        session,
        "--all-packages",
        "--extra",
        "verl",
        "--extra",
        "ray",
        "--no-default-groups",
        "--group",
        "test",
    )
    session.install(f"megatron-core=={MCORE_VERSIONS[-1]}", *VERL_WORKER_IMPORTS)
    session.run("python", "-c", "import importlib.metadata as m; assert m.version('verl') == '0.9.1'")
    os.makedirs(os.path.join(".nox", "junit", "verl"), exist_ok=True)
    _pytest(session, "tests", os.path.join("verl", "cross"), marks="verl_backend and not gpu")


@nox.session(python=PYTHON, venv_backend="none")
def wheelhouse(session: nox.Session) -> None:
    """Offline wheels for an air-gapped GPU host (see scripts/wheelhouse.py for the options)."""
    session.run("python", "scripts/wheelhouse.py", *session.posargs)


@nox.session(python=PYTHON)
def build(session: nox.Session) -> None:
    """Wheel + sdist of every package into dist/, checked (twine, contents, ranges), each wheel installed alone.

    The smoke installs (scripts/smoke_install.py) take about a minute, mostly importing torch and
    megatron-core; CI runs the cheaper `release` session instead, which builds and checks the same
    artifacts and installs verl-dyncp from a local package index.
    """
    _sync(session, "--only-group", "release")
    shutil.rmtree("dist", ignore_errors=True)
    # --no-sources: build as a plain PEP 517 frontend would, without the workspace's [tool.uv.sources].
    session.run("uv", "build", "--all-packages", "--no-sources", "--out-dir", "dist", external=True)
    artifacts = sorted(glob.glob("dist/*.whl") + glob.glob("dist/*.tar.gz"))
    session.run("twine", "check", "--strict", *artifacts)
    session.run("python", "scripts/check_dist.py", "dist")
    session.run("python", "scripts/bump_version.py", "--check")
    session.run(
        "python", "scripts/smoke_install.py", "--dist", "dist", "--work", os.path.join(".nox", "smoke")
    )


@nox.session(python=PYTHON, tags=["ci"])
def release(session: nox.Session) -> None:
    """Release tooling: version ranges, tag rules, workflow schema, and build + upload + install from a local index."""
    _sync(session, "--only-group", "release")
    junit = os.path.join(".nox", "junit", "release.xml")
    tests = sorted(glob.glob("tests/test_release_*.py"))
    session.run(
        "python", "-m", "pytest", *tests, "-q", "-m", "release", f"--junitxml={junit}", *session.posargs
    )


@nox.session(python=PYTHON, venv_backend="none")
def bump(session: nox.Session) -> None:
    """Bump one package's version and its dependants' ranges (scripts/bump_version.py), then re-lock."""
    session.run("python", "scripts/bump_version.py", *session.posargs)
    if "--check" not in session.posargs:
        session.run("uv", "lock", external=True)
