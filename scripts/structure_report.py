#!/usr/bin/env python3
"""How the code of packages/*/src is put together: size, import arrows, layering, circles, long code.

The packages form floors: verl_config (0) <- verl_mcore_utils (1) <- verl_dyncp, verl_mfsdp (2) <-
verl_engine (3), and verl_engine.apps sits one floor above the rest of verl_engine. An import from a lower
floor to a higher one, or between the two floor-2 packages, runs "back up". Imports inside functions count
(they close cycles just the same); those under ``if TYPE_CHECKING:`` never run and are only counted.
``from pkg import name`` goes to the submodule ``pkg.name``, else through ``pkg``'s ``_LAZY`` dict, else to
``pkg/__init__``. Standard library only.

    python scripts/structure_report.py [--root DIR] [--json] [--check]
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FLOORS = {"verl_config": 0, "verl_mcore_utils": 1, "verl_dyncp": 2, "verl_mfsdp": 2, "verl_engine": 3}
APPS = "verl_engine.apps"  # one floor above the rest of verl_engine
MAX_FILE_LINES, MAX_FUNCTION_LINES = 500, 80  # the limits the repo keeps to


def find_modules(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under packages/*/src/<import_name>/."""
    modules = {}
    for pkg_dir in sorted(root.glob("packages/*/src/*/__init__.py")):
        src = pkg_dir.parent.parent
        for path in sorted(pkg_dir.parent.rglob("*.py")):
            parts = list(path.relative_to(src).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def lazy_map(tree: ast.Module) -> dict[str, str]:
    """The ``_LAZY = {"name": "module", ...}`` literal of a package __init__, if it has one."""
    for node in tree.body:
        target = node.target if isinstance(node, ast.AnnAssign) else None
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
        if isinstance(target, ast.Name) and target.id == "_LAZY" and isinstance(node.value, ast.Dict):
            try:
                return dict(ast.literal_eval(node.value))
            except ValueError:
                return {}
    return {}


def imports_in(node: ast.AST, *, in_function: bool = False, type_only: bool = False):
    """Yield (import node, inside a function?, under ``if TYPE_CHECKING:``?) for every import in node."""
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        yield node, in_function, type_only
        return
    in_function = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
    test = getattr(node, "test", None)
    if isinstance(node, ast.If) and "TYPE_CHECKING" in (
        getattr(test, "id", None),
        getattr(test, "attr", None),
    ):
        for stmt in node.body:  # only the body is type-only: the else branch runs
            yield from imports_in(stmt, in_function=in_function, type_only=True)
        for stmt in node.orelse:
            yield from imports_in(stmt, in_function=in_function, type_only=type_only)
        return
    for child in ast.iter_child_nodes(node):
        yield from imports_in(child, in_function=in_function, type_only=type_only)


class Resolver:
    """Maps an imported dotted name to the module of ours that it loads (None when it is not ours)."""

    def __init__(self, *, modules: dict[str, Path], lazies: dict[str, dict[str, str]]) -> None:
        self.modules = modules
        self.lazies = lazies

    def known(self, dotted: str) -> str | None:
        """The longest prefix of ``dotted`` that is one of our modules."""
        parts = dotted.split(".")
        prefixes = (".".join(parts[:n]) for n in range(len(parts), 0, -1))
        return next((prefix for prefix in prefixes if prefix in self.modules), None)

    def from_import(self, base: str, name: str) -> str | None:
        if f"{base}.{name}" in self.modules:
            return f"{base}.{name}"
        if name in self.lazies.get(base, {}):
            return self.known(self.lazies[base][name])
        return self.known(base)

    def targets(self, *, module: str, node: ast.Import | ast.ImportFrom) -> list[str]:
        if isinstance(node, ast.Import):
            found = [self.known(alias.name) for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                parts = module.split(".")
                parts = parts[: len(parts) - node.level + (self.modules[module].name == "__init__.py")]
                base = ".".join(parts + ([node.module] if node.module else []))
            found = [self.from_import(base, alias.name) for alias in node.names]
        return [t for t in found if t and t != module]


def analyse(root: Path) -> dict:
    """Every measure of the report, as plain data (what --json prints)."""
    modules = find_modules(root)
    trees = {name: ast.parse(path.read_text(), filename=str(path)) for name, path in modules.items()}
    resolver = Resolver(modules=modules, lazies={name: lazy_map(tree) for name, tree in trees.items()})
    packages: dict[str, dict[str, int]] = {}
    edges: dict[tuple[str, str], list[str]] = {}
    type_only_count = 0
    long_functions, big_files = [], []
    for name, tree in trees.items():
        path, pkg = modules[name], name.split(".")[0]
        lines = path.read_bytes().count(b"\n")
        stats = packages.setdefault(pkg, {"files": 0, "lines": 0})
        stats.update(files=stats["files"] + 1, lines=stats["lines"] + lines)
        rel = path.relative_to(root).as_posix()
        if lines > MAX_FILE_LINES:
            big_files.append({"file": rel, "lines": lines})
        for node in ast.walk(tree):
            span = getattr(node, "end_lineno", 0) - getattr(node, "lineno", 0) + 1
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and span > MAX_FUNCTION_LINES:
                long_functions.append({"where": f"{rel}:{node.lineno}", "name": node.name, "lines": span})
        for node, in_function, type_only in imports_in(tree):
            type_only_count += type_only
            where = f"{rel}:{node.lineno}" + (" (in function)" if in_function else "")
            for target in [] if type_only else resolver.targets(module=name, node=node):
                edges.setdefault((name, target), []).append(where)
    for found in (long_functions, big_files):
        found.sort(key=lambda f: -f["lines"])
    total = {key: sum(s[key] for s in packages.values()) for key in ("files", "lines")}
    package_edges = sorted(
        {(a.split(".")[0], b.split(".")[0]) for a, b in edges} - {(p, p) for p in packages}
    )
    back_up = [
        {"from": a, "to": b, "where": w[0]} for (a, b), w in sorted(edges.items()) if runs_back_up(a, b)
    ]
    circles = [
        {
            "modules": scc,
            "edges": [f"{a} -> {b} ({edges[a, b][0]})" for a in scc for b in scc if (a, b) in edges],
        }
        for scc in strongly_connected(sorted(modules), edges)
        if len(scc) > 1
    ]
    return {
        "packages": packages,
        "total": total,
        "module_edges": len(edges),
        "package_edges": [f"{a} -> {b}" for a, b in package_edges],
        "type_checking_imports_excluded": type_only_count,
        "back_up": back_up,
        "circles": circles,
        "files_over_limit": big_files,
        "functions_over_limit": long_functions,
        "limits": {"file_lines": MAX_FILE_LINES, "function_lines": MAX_FUNCTION_LINES},
    }


def floor(module: str) -> int:
    """The floor of a module: its package's, doubled so verl_engine.apps can sit half a floor above the core."""
    level = 2 * FLOORS[module.split(".")[0]]
    # a package's ``__main__`` is an entry point (``python -m``): nothing imports it, it may start the apps
    entry = module.endswith(".__main__")
    return level + 1 if entry or module == APPS or module.startswith(APPS + ".") else level


def runs_back_up(src: str, dst: str) -> bool:
    """True when src imports something above its own floor, or across the two floor-2 packages."""
    return floor(src) < floor(dst) or (floor(src) == floor(dst) and src.split(".")[0] != dst.split(".")[0])


def strongly_connected(nodes: list[str], edges: dict[tuple[str, str], list[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components, each sorted, in discovery order."""
    succ: dict[str, list[str]] = {n: [] for n in nodes}
    for a, b in sorted(edges):
        succ[a].append(b)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack, on_stack, result = [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in succ[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            scc = stack[stack.index(node) :]
            del stack[stack.index(node) :]
            on_stack.difference_update(scc)
            result.append(sorted(scc))

    for node in nodes:
        if node not in index:
            visit(node)
    return result


def render(report: dict) -> str:
    """The compact text form of the report."""
    limits = report["limits"]
    out = [f"{'package':<18}{'files':>6}{'lines':>8}"]
    for pkg in sorted(report["packages"], key=lambda p: FLOORS.get(p, 9)):
        stats = report["packages"][pkg]
        out.append(f"{pkg:<18}{stats['files']:>6}{stats['lines']:>8}")
    out.append(f"{'total':<18}{report['total']['files']:>6}{report['total']['lines']:>8}")
    out.append(
        f"import arrows: {report['module_edges']} module edges, {len(report['package_edges'])} package edges"
        f" ({report['type_checking_imports_excluded']} TYPE_CHECKING imports left out)"
    )
    out += [f"  {edge}" for edge in report["package_edges"]]
    out.append(f"arrows back up: {len(report['back_up'])}")
    out += [f"  {b['from']} -> {b['to']} ({b['where']})" for b in report["back_up"]]
    out.append(f"circles: {len(report['circles'])}")
    for circle in report["circles"]:
        out.append("  " + " <-> ".join(circle["modules"]))
        out += [f"    {edge}" for edge in circle["edges"]]
    out.append(f"files over {limits['file_lines']} lines: {len(report['files_over_limit'])}")
    out += [f"  {f['lines']:>5}  {f['file']}" for f in report["files_over_limit"]]
    out.append(f"functions over {limits['function_lines']} lines: {len(report['functions_over_limit'])}")
    out += [f"  {f['lines']:>5}  {f['name']}  {f['where']}" for f in report["functions_over_limit"]]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=ROOT, help="checkout to measure (default: this one)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument(
        "--check", action="store_true", help="exit 1 on any arrow back up, circle or long code"
    )
    args = parser.parse_args(argv)
    report = analyse(args.root.resolve())
    print(json.dumps(report, indent=2) if args.json else render(report))
    keys = ("back_up", "circles", "files_over_limit", "functions_over_limit")
    return 1 if args.check and any(report[key] for key in keys) else 0


if __name__ == "__main__":
    sys.exit(main())
