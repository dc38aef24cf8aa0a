"""The docs site's package pages: every example runs as written, and every public name has an API entry.

Each ``docs/packages/<name>.md`` holds one example fenced as plain ```` ```python ```` that a user can paste into a
file and run on a CPU; this test does exactly that, in a fresh interpreter, so the examples cannot rot. Snippets
that need CUDA are fenced ```` ```python title="..." ```` and are not run. mkdocs' strict build (``nox -s docs``)
checks that every ``::: name`` directive resolves; this test checks the other direction: each name of the
package's ``__all__`` is covered by a directive (the packages load most names lazily, which the docs' static
analysis cannot follow, so the pages list those by their defining module).
"""

from __future__ import annotations

import ast
import doctest
import importlib
import importlib.util
import os
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = ROOT / "docs" / "packages"
PACKAGES = {
    "verl-config": "verl_config",
    "verl-mcore-utils": "verl_mcore_utils",
    "verl-dyncp": "verl_dyncp",
    "verl-mfsdp": "verl_mfsdp",
    "verl-engine": "verl_engine",
}
EXAMPLE_TIMEOUT_S = 300
# ::: dotted.name, optionally followed by an indented options block
DIRECTIVE = re.compile(r"^::: ([\w.]+)\n((?:    .*\n)*)", flags=re.M)


def page(dist: str) -> str:
    return (PAGES / f"{dist}.md").read_text()


def example(dist: str) -> str:
    blocks = re.findall(r"^```python\n(.*?)^```", page(dist), flags=re.S | re.M)
    assert len(blocks) == 1, f"docs/packages/{dist}.md must hold exactly one runnable ```python example"
    return blocks[0]


def printed(dist: str) -> str:
    """The output the page shows right after its example (a ```text title="prints"``` block)."""
    blocks = re.findall(
        r'^```python\n.*?^```\n\n[^\n]*\n\n```text title="prints"\n(.*?)^```', page(dist), flags=re.S | re.M
    )
    assert len(blocks) == 1, (
        f"docs/packages/{dist}.md must show what its example prints right after it, fenced"
        ' ```text title="prints"``` (after one sentence), with ... where digits vary'
    )
    return blocks[0]


def test_every_package_has_a_page() -> None:
    pages = {p.stem for p in PAGES.glob("*.md")}
    packages = {p.name for p in (ROOT / "packages").iterdir() if (p / "pyproject.toml").exists()}
    assert pages == packages == set(PACKAGES)


@pytest.mark.parametrize("dist", list(PACKAGES))
def test_a_package_readme_runs_the_tested_example(dist: str) -> None:
    """A package README (its PyPI page) shows one runnable example: exactly its docs page's, which
    test_example_runs executes; any other code block is fenced ```python title="..."``` as an excerpt."""
    readme = (ROOT / "packages" / dist / "README.md").read_text()
    blocks = re.findall(r"^```python\n(.*?)^```", readme, flags=re.S | re.M)
    assert blocks == [example(dist)], (
        f"packages/{dist}/README.md: its one plain ```python block must be docs/packages/{dist}.md's example"
    )


def _free_ports(n: int) -> list[int]:
    """n distinct ports on 127.0.0.1 that were free a moment ago (held open together, so no repeats)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()


@pytest.fixture(scope="module")
def running_examples(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, subprocess.Popen[str]]]:
    """Every page's example started at once, each in a fresh interpreter in its own empty folder.

    Each one spends most of its ~15 s importing megatron-core; started together they share the machine's
    cores instead of queueing behind one another.
    """
    procs: dict[str, subprocess.Popen[str]] = {}
    ports = _free_ports(len(PACKAGES))
    for dist, port in zip(PACKAGES, ports, strict=True):
        folder = tmp_path_factory.mktemp(dist)
        (folder / "example.py").write_text(example(dist))
        procs[dist] = subprocess.Popen(
            [sys.executable, "example.py"],
            cwd=folder,
            # a single-process example rendezvouses on MASTER_PORT (default 29512): one port each, or two
            # examples running side by side would race for it
            env={**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    yield procs
    for proc in procs.values():  # a failed or timed-out test must not leave its example running
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


@pytest.mark.above_engine  # ~15 s of CPU each (megatron-core import): against the newest megatron-core only
@pytest.mark.parametrize("dist", list(PACKAGES))
def test_example_runs(dist: str, running_examples: dict[str, subprocess.Popen[str]]) -> None:
    proc = running_examples[dist]
    stdout, stderr = proc.communicate(timeout=EXAMPLE_TIMEOUT_S)
    assert proc.returncode == 0, f"docs/packages/{dist}.md's example failed:\n{stdout}\n{stderr}"
    want = printed(dist)
    checker = doctest.OutputChecker()
    flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    assert checker.check_output(want, stdout, flags), (
        f"docs/packages/{dist}.md shows other output than its example prints:\n"
        + checker.output_difference(doctest.Example("", want), stdout, flags)
    )


def _module_file(module: str) -> Path | None:
    """The source file of a dotted module name inside one of our packages, without importing it."""
    top, *rest = module.split(".")
    spec = importlib.util.find_spec(top)
    assert spec is not None and spec.origin is not None, f"{top} is not importable"
    base = Path(spec.origin).parent.joinpath(*rest)
    for candidate in (base / "__init__.py", base.with_suffix(".py")):
        if candidate.is_file():
            return candidate
    return None


def _bound_names(path: Path) -> set[str]:
    """Names a module binds statically: imports (also under ``if TYPE_CHECKING``), defs, classes, assignments."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    return names


def _static_all(path: Path) -> set[str] | None:
    """A module's ``__all__`` when it is a literal list (what the docs' static analysis can read)."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            try:
                return set(ast.literal_eval(node.value))
            except ValueError:
                return None
    return None


def _documented(dist: str) -> set[str]:
    """The public names of ``dist``'s package that its page's ``:::`` directives render."""
    covered: set[str] = set()
    for target, options in DIRECTIVE.findall(page(dist)):
        if "members: false" in options:
            continue
        path = _module_file(target)
        if path is not None:  # a whole module: the names it lists in __all__ and binds itself
            bound = _bound_names(path)
            exported = _static_all(path)
            covered |= (
                bound & exported if exported is not None else {n for n in bound if not n.startswith("_")}
            )
            continue
        module, _, name = target.rpartition(".")
        path = _module_file(module)
        assert path is not None, f"::: {target}: no module {module}"
        assert name in _bound_names(path), f"::: {target}: {module} defines no {name}"
        covered.add(name)
    return covered


@pytest.mark.parametrize("dist", list(PACKAGES))
def test_api_reference_covers_every_public_name(dist: str) -> None:
    init = _module_file(PACKAGES[dist])
    assert init is not None
    # a literal __all__ is read from the source (verl_mfsdp's import pulls in megatron-core); a computed one
    # (verl_engine's sorted(_LAZY)) from the imported package, whose names load lazily
    public = _static_all(init)
    if public is None:
        public = set(importlib.import_module(PACKAGES[dist]).__all__)
    missing = sorted(public - _documented(dist))
    assert not missing, (
        f"docs/packages/{dist}.md has no API entry for {missing}: add '::: <defining module>.<name>' lines"
    )


# Every fenced code block a reader can copy, and who keeps it true. A plain ```python block must be one the tests
# execute; anything else is titled as an excerpt (or says why it is not run). Shell blocks' verl-engine and
# verl-config commands are parsed by tests/test_docs_commands.py; ```text blocks are output or listings.
DOC_FILES = sorted([ROOT / "README.md", *ROOT.glob("packages/*/README.md"), *ROOT.glob("docs/**/*.md")])
RUN_BY_TESTS = {
    **{f"docs/packages/{dist}.md": "test_example_runs" for dist in PACKAGES},
    **{f"packages/{dist}/README.md": "test_a_package_readme_runs_the_tested_example" for dist in PACKAGES},
    "docs/engine.md": "tests/test_engine_doc.py",
}
FENCE = re.compile(r"^```(\w*)([^\n]*)\n", flags=re.M)


def _fences() -> list[tuple[str, str, str]]:
    """(file, language, title part) of every opening fence (a closing fence has neither)."""
    found = []
    for doc in DOC_FILES:
        opening = True
        for lang, rest in FENCE.findall(doc.read_text()):
            if opening:
                found.append((str(doc.relative_to(ROOT)), lang, rest.strip()))
            opening = not opening
    return found


def test_every_code_block_runs_in_ci_or_says_it_is_an_excerpt() -> None:
    unchecked = []
    for where, lang, title in _fences():
        if lang in ("bash", "sh", "shell", "console", "text", "yaml", "toml", "json", ""):
            continue  # commands: test_docs_commands.py; the rest are listings or printed output
        if not title and where in RUN_BY_TESTS:
            continue  # executed as written (the tests named in RUN_BY_TESTS)
        if "excerpt" in title or "not run" in title:
            continue
        unchecked.append(f"{where}: ```{lang}{(' ' + title) if title else ''}")
    assert not unchecked, (
        "code blocks no test runs: make them runnable examples in a page a test executes, or title them"
        ' as excerpts (```python title="... (an excerpt)"```):\n' + "\n".join(unchecked)
    )
