#!/usr/bin/env python3
"""Refresh the verl reference data that verl-config's tests compare against.

    uv run python scripts/refresh_verl_reference.py --verl-version 0.9.1 [--wheel verl-0.9.1-py3-none-any.whl]
        [--out packages/verl-config/tests/data/verl_reference] [--check]
    uv run python scripts/refresh_verl_reference.py --verl /tmp/verl [--commit SHA]
        [--git-dir /path/to/verl.git] [--out packages/verl-config/tests/data/verl_reference] [--check]

verl (volcengine/verl) is the reference for verl-config's schema. The reference is a published
release (--verl-version: its wheel is fetched with ``pip download verl==VERSION --no-deps`` from the
configured package index, or taken from --wheel, and unpacked; a wheel has the same ``verl/`` layout
as a checkout) or a checkout of any commit (--verl). This script reads the verl tree without
importing it (verl needs torch and ray) and stores, under --out:

* ``_generated_ppo_trainer.yaml`` / ``_generated_ppo_megatron_trainer.yaml``: byte copies of
  verl/trainer/config/ of that checkout;
* ``dataclasses.json``: every ``@dataclass`` of verl's config modules as parsed by ``ast``, with
  its fields (own and inherited, in dataclass order), their annotations and defaults;
* ``targets.json``: for each generated yaml, the ``_target_`` of every section, the class it
  resolves to in dataclasses.json, and the keys on which the yaml and the dataclass disagree;
* ``REFERENCE.json``: where the data come from (the release with its wheel's file name and sha256,
  or the commit with its date) and the sha256 of every stored file.

For a checkout: if --commit is not given, the commit is the checkout's ``git rev-parse HEAD`` (for a plain
work tree such as a ``git archive`` extract, pass --commit; --git-dir names a git directory,
e.g. a bare mirror, to read the commit date from). Output is deterministic: re-running on the
same checkout gives no diff. --check regenerates into a temporary folder and exits 1 with a
unified diff when the stored data differ.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import hashlib
import json
import re
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "packages" / "verl-config" / "tests" / "data" / "verl_reference"
REPOSITORY = "https://github.com/volcengine/verl"

YAML_DIR = "verl/trainer/config"
YAML_FILES = ("_generated_ppo_trainer.yaml", "_generated_ppo_megatron_trainer.yaml")
# Where verl's config dataclasses live. verl/base_config.py is included because every config class
# derives from its BaseConfig, whose one field ``_target_`` every yaml section carries; without it
# that inherited field would be missing from all classes.
SOURCE_PATTERNS = (
    "verl/base_config.py",
    "verl/workers/config/*.py",
    "verl/trainer/config/*.py",
    "verl/utils/profiler/config.py",
    "verl/utils/skip/config.py",  # the top-level ``skip`` section (verl 0.9)
)
DATACLASSES_JSON = "dataclasses.json"
TARGETS_JSON = "targets.json"
REFERENCE_JSON = "REFERENCE.json"
REGISTRIES_JSON = "registries.json"
# The module whose registries (policy losses, advantage estimators) user code can extend: verl-config accepts
# any name there but notes one that is not built in, so the built-in names are reference data too.
REGISTRY_MODULE = "verl/trainer/ppo/core_algos.py"
OMEGACONF_MISSING = ("MISSING", "omegaconf.MISSING")
# Annotations that dataclasses do not turn into fields.
NON_FIELD_ANNOTATIONS = ("ClassVar", "InitVar", "KW_ONLY")
SHA_RE = re.compile(r"[0-9a-f]{40}")
# A release as pip spells one (PEP 440 public versions: 0.9.1, 0.10.0rc1, 1.0.post2 ...).
VERSION_RE = re.compile(r"[0-9]+(\.[0-9]+)*((a|b|rc)[0-9]+)?(\.post[0-9]+)?(\.dev[0-9]+)?")


# ---------------------------------------------------------------------------------------------
# Parsing one module
# ---------------------------------------------------------------------------------------------


def module_name(*, verl_root: Path, path: Path) -> str:
    """Dotted module name of ``path``, as verl's own imports and ``_target_`` strings spell it."""
    parts = list(path.relative_to(verl_root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def source_files(*, verl_root: Path, patterns: Iterable[str] = SOURCE_PATTERNS) -> list[Path]:
    """The python files to scan, sorted so that the output never depends on directory order."""
    found = {p for pattern in patterns for p in verl_root.glob(pattern) if p.is_file()}
    return sorted(found, key=lambda p: p.relative_to(verl_root).as_posix())


def _dotted(node: ast.expr) -> str | None:
    """``a.b.c`` for a Name/Attribute chain, None for anything else (calls, subscripts)."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = _dotted(node.value)
        return None if head is None else f"{head}.{node.attr}"
    return None


def _last_name(dotted: str | None) -> str | None:
    return None if dotted is None else dotted.rsplit(".", 1)[-1]


def is_dataclass_decorator(node: ast.expr) -> bool:
    """True for ``@dataclass``, ``@dataclass(...)`` and the ``dataclasses.``-qualified forms."""
    target = node.func if isinstance(node, ast.Call) else node
    return _last_name(_dotted(target)) == "dataclass"


def _annotation_head(node: ast.expr) -> str | None:
    """Last name of an annotation's outer type: ``ClassVar`` for ``typing.ClassVar[set]``.

    String annotations (``"ClassVar[int]"``) are parsed first, since dataclasses honour them too.
    """
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        try:
            node = ast.parse(node.value, mode="eval").body
        except SyntaxError:
            return None
    if isinstance(node, ast.Subscript):
        node = node.value
    return _last_name(_dotted(node))


def is_field_annotation(node: ast.expr) -> bool:
    """False for the annotations that dataclasses skip (ClassVar, InitVar, the KW_ONLY marker)."""
    return _annotation_head(node) not in NON_FIELD_ANNOTATIONS


def _jsonable(value: Any) -> Any:
    """A literal as plain JSON (tuples and sets become lists); ValueError where JSON cannot hold it."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            raise ValueError("non-finite float")
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted((_jsonable(v) for v in value), key=lambda v: json.dumps(v, sort_keys=True))
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise ValueError("non-string dict key")
        return {k: _jsonable(v) for k, v in value.items()}
    raise ValueError(f"no JSON form for {type(value).__name__}")


def literal_default(node: ast.expr) -> Any:
    """The JSON value of a literal default (``-1``, ``None``, ``(1, 2)``); None if not a literal.

    Whether None means "the literal None" or "not a literal" is told by default_source.
    """
    try:
        return _jsonable(ast.literal_eval(node))
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return None


def _is_field_call(node: ast.expr | None) -> bool:
    return isinstance(node, ast.Call) and _last_name(_dotted(node.func)) == "field"


def describe_field(*, stmt: ast.AnnAssign, source: str, owner: str) -> dict[str, Any]:
    """What a dataclass knows of one annotated assignment: its type text and its default.

    ``required`` is True where ``__init__`` needs an argument (no default and no factory).
    ``omegaconf_missing`` marks verl's ``= MISSING`` defaults: not required to construct, but
    omegaconf refuses to read them until set.
    """

    def text(node: ast.expr | None) -> str | None:
        return None if node is None else ast.get_source_segment(source, node)

    value = stmt.value
    default_node = None
    factory_node = None
    init = True
    if _is_field_call(value):
        for kw in value.keywords:
            if kw.arg == "default":
                default_node = kw.value
            elif kw.arg == "default_factory":
                factory_node = kw.value
            elif kw.arg == "init" and isinstance(kw.value, ast.Constant):
                init = bool(kw.value.value)
    else:
        default_node = value
    default_source = text(default_node)
    name = stmt.target.id
    return {
        "annotation": text(stmt.annotation),
        "default": None if default_node is None else literal_default(default_node),
        "default_source": default_source,
        "default_factory": text(factory_node),
        "required": init and default_node is None and factory_node is None,
        "init": init,
        "private": name.startswith("_"),
        "omegaconf_missing": default_source in OMEGACONF_MISSING,
        "defined_in": owner,
    }


def _own_fields(*, node: ast.ClassDef, source: str, owner: str) -> dict[str, dict[str, Any]]:
    """The fields a class body declares itself, in source order (later re-declarations win)."""
    fields: dict[str, dict[str, Any]] = {}
    for stmt in node.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        if not is_field_annotation(stmt.annotation):
            continue
        fields[stmt.target.id] = describe_field(stmt=stmt, source=source, owner=owner)
    return fields


def _plain_assignments(node: ast.ClassDef) -> list[str]:
    """Names a class body assigns without annotation: no dataclass fields, but they may shadow one."""
    names = []
    for stmt in node.body:
        if isinstance(stmt, ast.Assign):
            names += [t.id for t in stmt.targets if isinstance(t, ast.Name)]
    return names


def _import_map(*, tree: ast.Module, module: str, is_package: bool) -> dict[str, str]:
    """Local name -> dotted origin for a module's top-level imports (relative ones made absolute).

    Used only to tell apart two extracted classes of the same name.
    """
    package = module if is_package else module.rpartition(".")[0]
    names: dict[str, str] = {}
    for stmt in tree.body:
        if isinstance(stmt, ast.ImportFrom):
            base = stmt.module or ""
            if stmt.level:
                parts = package.split(".")
                parts = parts[: len(parts) - (stmt.level - 1)]
                base = ".".join([*parts, base] if base else parts)
            for alias in stmt.names:
                if alias.name != "*":
                    names[alias.asname or alias.name] = f"{base}.{alias.name}"
        elif isinstance(stmt, ast.Import):
            for alias in stmt.names:
                names[alias.asname or alias.name.split(".")[0]] = (
                    alias.name if alias.asname else alias.name.split(".")[0]
                )
    return names


def parse_module(*, path: Path, module: str) -> list[dict[str, Any]]:
    """Every top-level dataclass of one file, with its own fields and the text of its bases."""
    source = path.read_text(encoding="utf-8")
    tree = ast.parse(source, filename=str(path))
    imports = _import_map(tree=tree, module=module, is_package=path.name == "__init__.py")
    classes = []
    for node in tree.body:
        if not isinstance(node, ast.ClassDef):
            continue
        if not any(is_dataclass_decorator(d) for d in node.decorator_list):
            continue
        classes.append(
            {
                "name": node.name,
                "module": module,
                "bases": [ast.get_source_segment(source, b) for b in node.bases],
                "own": _own_fields(node=node, source=source, owner=f"{module}.{node.name}"),
                "plain": _plain_assignments(node),
                "imports": imports,
            }
        )
    return classes


# ---------------------------------------------------------------------------------------------
# Linking classes: keys, bases, dataclass field order
# ---------------------------------------------------------------------------------------------


def assign_keys(classes: list[dict[str, Any]]) -> dict[str, list[str]]:
    """Give each class its key: the bare name, or ``module.Name`` where two modules share the name.

    Returns the shared names and the keys they got, so that callers can note them.
    """
    by_name: dict[str, list[dict[str, Any]]] = {}
    for cls in classes:
        by_name.setdefault(cls["name"], []).append(cls)
    shared: dict[str, list[str]] = {}
    for name, group in by_name.items():
        if len(group) == 1:
            group[0]["key"] = name
            continue
        for cls in group:
            cls["key"] = f"{cls['module']}.{name}"
        shared[name] = sorted(c["key"] for c in group)
    return shared


def _pick(candidates: list[dict[str, Any]], *, origin: str | None) -> dict[str, Any] | None:
    """One class among same-named candidates: the only one, or the one whose module the reference names.

    A reference through a package (``verl.workers.config.X`` re-exported from
    ``verl.workers.config.actor``) matches by module prefix.
    """
    if len(candidates) == 1:
        return candidates[0]
    if origin is None:
        return None
    exact = [c for c in candidates if origin == c["module"]]
    if len(exact) == 1:
        return exact[0]
    nested = [c for c in candidates if c["module"].startswith(origin + ".")]
    return nested[0] if len(nested) == 1 else None


def resolve_base(*, text: str, cls: dict[str, Any], by_name: dict[str, list[dict[str, Any]]]) -> str | None:
    """Key of the extracted class a base expression names, or None (not extracted, or ambiguous)."""
    name = _last_name(text)
    candidates = by_name.get(name or "", [])
    if not candidates:
        return None
    same_module = [c for c in candidates if c["module"] == cls["module"] and "." not in text]
    if len(same_module) == 1:
        return same_module[0]["key"]
    head = text.split(".", 1)[0]
    origin = cls["imports"].get(head)
    if origin is not None and "." in text:
        origin = f"{origin}.{text.split('.', 1)[1]}"
    origin_module = None if origin is None else origin.rpartition(".")[0]
    picked = _pick(candidates, origin=origin_module)
    return None if picked is None else picked["key"]


def c3_mro(*, key: str, bases: dict[str, list[str]], _seen: tuple[str, ...] = ()) -> list[str]:
    """C3 linearisation over the extracted classes only (other bases carry no dataclass fields)."""
    if key in _seen:
        raise ValueError(f"inheritance cycle through {key}")
    seqs = [c3_mro(key=b, bases=bases, _seen=(*_seen, key)) for b in bases[key]]
    seqs.append(list(bases[key]))
    result = [key]
    while any(seqs):
        seqs = [s for s in seqs if s]
        for seq in seqs:
            head = seq[0]
            if not any(head in s[1:] for s in seqs):
                break
        else:
            raise ValueError(f"no consistent MRO for {key}")
        result.append(head)
        seqs = [s[1:] if s[0] == head else s for s in seqs]
    return result


def all_fields(
    *, key: str, classes: dict[str, dict[str, Any]], mro: dict[str, list[str]], memo: dict[str, dict]
) -> dict[str, dict[str, Any]]:
    """A class's complete fields, in the order ``dataclasses.fields()`` gives them.

    Like the dataclass machinery: walk the MRO from the root, take each base's complete fields
    (a re-declared name keeps its first position and takes the newer definition), then the
    class's own annotations.
    """
    if key in memo:
        return memo[key]
    merged: dict[str, dict[str, Any]] = {}
    for base in reversed(mro[key][1:]):
        merged.update(all_fields(key=base, classes=classes, mro=mro, memo=memo))
    merged.update(classes[key]["own"])
    memo[key] = merged
    return merged


def _shadowed(*, cls: dict[str, Any], fields: dict[str, dict[str, Any]]) -> list[str]:
    """Inherited fields that the class body re-assigns without annotation.

    Such an assignment does not change the field's ``__init__`` default; it is worth a flag.
    """
    own = cls["own"]
    return sorted({n for n in cls["plain"] if n in fields and n not in own})


def extract_dataclasses(*, verl_root: Path, patterns: Iterable[str] = SOURCE_PATTERNS) -> dict[str, Any]:
    """dataclasses.json's content for the checkout at ``verl_root``."""
    classes = [
        cls
        for path in source_files(verl_root=verl_root, patterns=patterns)
        for cls in parse_module(path=path, module=module_name(verl_root=verl_root, path=path))
    ]
    shared = assign_keys(classes)
    by_name: dict[str, list[dict[str, Any]]] = {}
    for cls in classes:
        by_name.setdefault(cls["name"], []).append(cls)
    by_key = {cls["key"]: cls for cls in classes}
    bases = {}
    for cls in classes:
        resolved = [resolve_base(text=b, cls=cls, by_name=by_name) for b in cls["bases"]]
        bases[cls["key"]] = [k for k in resolved if k is not None]
    mro = {key: c3_mro(key=key, bases=bases) for key in by_key}
    memo: dict[str, dict] = {}
    out: dict[str, Any] = {}
    for key, cls in by_key.items():
        fields = all_fields(key=key, classes=by_key, mro=mro, memo=memo)
        entry = {
            "name": cls["name"],
            "module": cls["module"],
            "bases": cls["bases"],
            "dataclass_bases": bases[key],
            "mro": mro[key],
            "fields": fields,
            "field_order": list(fields),
            "own_fields": list(cls["own"]),
            "shadowed_by_plain_assignment": _shadowed(cls=cls, fields=fields),
        }
        if cls["name"] in shared:
            entry["shares_name_with"] = [k for k in shared[cls["name"]] if k != key]
        out[key] = entry
    return out


# ---------------------------------------------------------------------------------------------
# _target_ sections of the generated yamls
# ---------------------------------------------------------------------------------------------


def iter_targets(node: Any, *, path: tuple[str, ...] = ()) -> Iterator[tuple[str, Any, dict]]:
    """(dotted path, _target_ value, section) of every mapping in a yaml tree that has ``_target_``.

    List items appear in the path as their index.
    """
    if isinstance(node, dict):
        if "_target_" in node:
            yield ".".join(path), node["_target_"], node
        for k, v in node.items():
            yield from iter_targets(v, path=(*path, str(k)))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from iter_targets(v, path=(*path, str(i)))


def resolve_target(*, target: str, dataclasses: dict[str, Any]) -> str | None:
    """Key in dataclasses.json for a ``_target_`` string, by its last name component.

    Where several classes share that name, the one whose module the target's prefix names wins.
    """
    name = _last_name(target)
    candidates = [{"key": k, **v} for k, v in dataclasses.items() if v["name"] == name]
    picked = _pick(candidates, origin=target.rpartition(".")[0])
    return None if picked is None else picked["key"]


def extract_targets(*, yaml_texts: dict[str, str], dataclasses: dict[str, Any]) -> dict[str, Any]:
    """targets.json's content: per yaml, each ``_target_`` section, its class and the key mismatches.

    ``yaml_only_keys`` are keys of the section that the class has no field for (verl's loader then
    fails or drops them); ``dataclass_only_fields`` are fields the section leaves to the default.
    """
    out: dict[str, Any] = {}
    for name, text in sorted(yaml_texts.items()):
        tree = yaml.safe_load(text)
        sections: dict[str, Any] = {}
        for path, target, section in iter_targets(tree):
            key = resolve_target(target=str(target), dataclasses=dataclasses) if target else None
            entry: dict[str, Any] = {"target": target, "class_key": key}
            if key is not None:
                fields = dataclasses[key]["fields"]
                entry["yaml_only_keys"] = sorted(str(k) for k in section if k not in fields)
                entry["dataclass_only_fields"] = sorted(f for f in fields if f not in section)
            sections[path] = entry
        out[name] = sections
    return out


# ---------------------------------------------------------------------------------------------
# Commit, output, check
# ---------------------------------------------------------------------------------------------


def _git(*args: str) -> str | None:
    """stdout of a git command, or None where git or the repository is not there."""
    try:
        done = subprocess.run(["git", *args], capture_output=True, text=True, check=False)
    except OSError:
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def checkout_head(verl_root: Path) -> str | None:
    """HEAD of ``verl_root`` if it is itself a git work tree's top (not some enclosing repository's)."""
    top = _git("-C", str(verl_root), "rev-parse", "--show-toplevel")
    if top is None or Path(top).resolve() != verl_root.resolve():
        return None
    return _git("-C", str(verl_root), "rev-parse", "HEAD")


def commit_date(*, commit: str, git_dirs: Iterable[Path]) -> str | None:
    """Committer date (ISO 8601) of ``commit`` from the first git directory that knows it."""
    for git_dir in git_dirs:
        date = _git("--git-dir", str(git_dir), "log", "-1", "--format=%cI", commit)
        if date:
            return date
    return None


def _git_dir_of(verl_root: Path) -> Path | None:
    if checkout_head(verl_root) is None:
        return None
    found = _git("-C", str(verl_root), "rev-parse", "--absolute-git-dir")
    return None if found is None else Path(found)


def dump_json(data: Any) -> str:
    """The one JSON spelling used for every stored file: sorted keys, 2-space indent, final newline."""
    return json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False, allow_nan=False) + "\n"


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _decorator_name(node: ast.expr, *, decorator: str, enum: dict[str, str]) -> str | None:
    """``@decorator("x")`` or ``@decorator(Enum.X)`` -> the registered name."""
    if not (isinstance(node, ast.Call) and _last_name(_dotted(node.func)) == decorator and node.args):
        return None
    arg = node.args[0]
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value
    return enum.get(_last_name(_dotted(arg)) or "")


def extract_registries(*, verl_root: Path) -> dict[str, list[str]]:
    """The names verl registers in ``core_algos``: its policy losses and advantage estimators, in source order."""
    tree = ast.parse((verl_root / REGISTRY_MODULE).read_text(encoding="utf-8"))
    enum: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "AdvantageEstimator":
            for stmt in node.body:
                if (
                    isinstance(stmt, ast.Assign)
                    and isinstance(stmt.value, ast.Constant)
                    and isinstance(stmt.value.value, str)
                ):
                    enum.update({t.id: stmt.value.value for t in stmt.targets if isinstance(t, ast.Name)})
    found: dict[str, list[str]] = {"policy_losses": [], "advantage_estimators": []}
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef):
            continue
        for dec in node.decorator_list:
            for registry, decorator in (
                ("policy_losses", "register_policy_loss"),
                ("advantage_estimators", "register_adv_est"),
            ):
                name = _decorator_name(dec, decorator=decorator, enum=enum)
                if name is not None and name not in found[registry]:
                    found[registry].append(name)
    # an estimator of the enum without a decorated function (dispatched elsewhere) is still one verl accepts
    found["advantage_estimators"] += [v for v in enum.values() if v not in found["advantage_estimators"]]
    return found


def build_reference(*, verl_root: Path, origin: dict[str, Any]) -> dict[str, bytes]:
    """Every stored file's bytes, keyed by file name; nothing is written here.

    ``origin`` says where ``verl_root`` comes from: ``{"commit": ..., "commit_date": ...}`` for a
    checkout, ``{"release": ..., "wheel": ..., "wheel_sha256": ...}`` for a published wheel.
    """
    yamls = {name: (verl_root / YAML_DIR / name).read_bytes() for name in YAML_FILES}
    dataclasses = extract_dataclasses(verl_root=verl_root)
    targets = extract_targets(
        yaml_texts={n: b.decode("utf-8") for n, b in yamls.items()}, dataclasses=dataclasses
    )
    files = dict(yamls)
    files[DATACLASSES_JSON] = dump_json(dataclasses).encode("utf-8")
    files[TARGETS_JSON] = dump_json(targets).encode("utf-8")
    files[REGISTRIES_JSON] = dump_json(extract_registries(verl_root=verl_root)).encode("utf-8")
    sources = {
        p.relative_to(verl_root).as_posix(): sha256(p.read_bytes()) for p in source_files(verl_root=verl_root)
    }
    reference = {
        "repository": REPOSITORY,
        **origin,
        "generator": "scripts/refresh_verl_reference.py",
        "files": {name: sha256(data) for name, data in files.items()},
        "sources": sources,
    }
    files[REFERENCE_JSON] = dump_json(reference).encode("utf-8")
    return files


def write_files(*, out: Path, files: dict[str, bytes]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (out / name).write_bytes(data)


def diff_folders(*, stored: Path, fresh: Path, names: Iterable[str]) -> str:
    """Unified diff (stored -> fresh) of the named files; a missing file counts as empty."""
    chunks = []
    for name in sorted(names):
        old_path, new_path = stored / name, fresh / name
        old = old_path.read_text(encoding="utf-8").splitlines(keepends=True) if old_path.exists() else []
        new = new_path.read_text(encoding="utf-8").splitlines(keepends=True) if new_path.exists() else []
        chunks += difflib.unified_diff(old, new, fromfile=f"stored/{name}", tofile=f"fresh/{name}")
    return "".join(chunks)


def stored_reference(out: Path) -> dict[str, Any]:
    path = out / REFERENCE_JSON
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}


def choose_commit(*, verl_root: Path, given: str | None, stored: dict[str, Any], check: bool) -> str:
    """The commit the data are labelled with; refuse to label a git checkout with another commit.

    Order: --commit, the checkout's HEAD, and (for --check only) the stored REFERENCE.json commit,
    since checking means "does this checkout still give the stored data".
    """
    head = checkout_head(verl_root)
    if given is not None:
        commit = given.lower()
        if head is not None and head != commit:
            raise SystemExit(f"--commit {commit} but {verl_root} is at {head}")
    elif head is not None:
        commit = head
    elif check and stored.get("commit"):
        commit = stored["commit"]
    else:
        raise SystemExit(f"{verl_root} is not a git checkout: pass --commit SHA")
    if not SHA_RE.fullmatch(commit):
        raise SystemExit(f"--commit must be a full 40-digit hex SHA, got {commit!r}")
    return commit


def choose_date(*, commit: str, verl_root: Path, git_dir: Path | None, stored: dict[str, Any]) -> str | None:
    """Commit date from git; without git, the stored date if the stored data are of the same commit.

    A plain extract has no history, and a refresh or check from it should not erase a known date.
    """
    dirs = [d for d in (git_dir, _git_dir_of(verl_root)) if d is not None]
    date = commit_date(commit=commit, git_dirs=dirs)
    if date is None and stored.get("commit") == commit:
        date = stored.get("commit_date")
    return date


# ---------------------------------------------------------------------------------------------
# A published release: its wheel
# ---------------------------------------------------------------------------------------------


def check_version(version: str) -> str:
    if not VERSION_RE.fullmatch(version):
        raise SystemExit(f"--verl-version must be a release such as 0.9.1, got {version!r}")
    return version


def wheel_version(wheel: Path) -> str | None:
    """The version a wheel's file name carries (``verl-0.9.1-py3-none-any.whl`` -> ``0.9.1``)."""
    parts = wheel.name.split("-")
    if len(parts) < 5 or parts[0] != "verl" or not wheel.name.endswith(".whl"):
        return None
    return parts[1]


def download_wheel(*, version: str, dest: Path) -> Path:
    """``pip download verl==VERSION --no-deps`` into ``dest`` (pip's configured index); the wheel's path.

    Only a wheel is accepted (--only-binary): an sdist would need a build, and the wheel is what
    users install.
    """
    cmd = [sys.executable, "-m", "pip", "download", f"verl=={version}", "--no-deps", "--only-binary=:all:"]
    done = subprocess.run([*cmd, "-d", str(dest)], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"pip download verl=={version} failed:\n{done.stdout}{done.stderr}")
    wheels = [w for w in dest.glob("verl-*.whl") if wheel_version(w) == version]
    if len(wheels) != 1:
        raise SystemExit(
            f"pip download verl=={version} left no single wheel in {dest}: {sorted(dest.iterdir())}"
        )
    return wheels[0]


def extract_wheel(*, wheel: Path, dest: Path) -> Path:
    """Unpack a wheel (a zip) into ``dest`` and return it as the verl root; refuses paths leaving ``dest``."""
    root = dest.resolve()
    with zipfile.ZipFile(wheel) as zf:
        for name in zf.namelist():
            target = (root / name).resolve()
            if target != root and root not in target.parents:
                raise SystemExit(f"{wheel.name}: member {name!r} would be written outside {root}")
        zf.extractall(root)
    return root


def release_origin(*, version: str, wheel: Path) -> dict[str, Any]:
    """REFERENCE.json's account of a release: version, wheel file name and the wheel's sha256."""
    return {"release": version, "wheel": wheel.name, "wheel_sha256": sha256(wheel.read_bytes())}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = ap.add_mutually_exclusive_group(required=True)
    source.add_argument("--verl", type=Path, help="root of a verl checkout (holds verl/)")
    source.add_argument("--verl-version", help="a published verl release, e.g. 0.9.1 (its wheel is read)")
    ap.add_argument("--wheel", type=Path, help="with --verl-version: that release's wheel file (no download)")
    ap.add_argument("--commit", help="with --verl: verl commit of that checkout (default: its git HEAD)")
    ap.add_argument("--git-dir", type=Path, help="with --verl: git directory to read the commit date from")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="folder of the stored data")
    ap.add_argument("--check", action="store_true", help="do not write; exit 1 with a diff if stale")
    args = ap.parse_args(argv)
    if args.verl_version is not None and (args.commit or args.git_dir):
        ap.error("--commit and --git-dir describe a checkout; they do not go with --verl-version")
    if args.verl is not None and args.wheel is not None:
        ap.error("--wheel goes with --verl-version")
    return args


def checkout_origin(*, args: argparse.Namespace, verl_root: Path, stored: dict[str, Any]) -> dict[str, Any]:
    commit = choose_commit(verl_root=verl_root, given=args.commit, stored=stored, check=args.check)
    date = choose_date(commit=commit, verl_root=verl_root, git_dir=args.git_dir, stored=stored)
    return {"commit": commit, "commit_date": date}


def check_root(verl_root: Path, *, what: str) -> Path:
    if not (verl_root / YAML_DIR).is_dir():
        raise SystemExit(f"{what} does not look like verl (no {YAML_DIR}/)")
    return verl_root


def write_verl_yaml_keys(*, out: Path) -> Path:
    """The package's list of the keys verl's yaml declares (``verl_config.verl_keys``: the loader applies Hydra's
    rule for '+' with it), from the yaml files just stored in ``out``."""
    from verl_config.verl_keys import VERL_YAML_KEYS_FILE, flatten_yaml_keys

    keys = flatten_yaml_keys((out / name).read_text(encoding="utf-8") for name in YAML_FILES)
    origin = json.loads((out / REFERENCE_JSON).read_text())
    release = origin.get("release") or origin.get("commit")
    VERL_YAML_KEYS_FILE.write_text(json.dumps({"release": release, "keys": keys}, indent=1) + "\n")
    return VERL_YAML_KEYS_FILE


def emit(*, args: argparse.Namespace, out: Path, files: dict[str, bytes], label: str) -> int:
    """Write the files, or (--check) compare them with the stored ones: 0 when equal, 1 with a diff."""
    if not args.check:
        write_files(out=out, files=files)
        for name in sorted(files):
            print(f"wrote {out / name} ({len(files[name])} bytes)")
        if out == DEFAULT_OUT.resolve():
            print(f"wrote {write_verl_yaml_keys(out=out)}")
        return 0
    with tempfile.TemporaryDirectory(prefix="verl_reference_") as tmp:
        write_files(out=Path(tmp), files=files)
        diff = diff_folders(stored=out, fresh=Path(tmp), names=files)
    if diff:
        sys.stdout.write(diff)
        print(f"\n{out} is stale for verl {label}; rerun without --check", file=sys.stderr)
        return 1
    print(f"{out} matches verl {label}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out: Path = args.out.resolve()
    stored = stored_reference(out)
    if args.verl is not None:
        verl_root = check_root(args.verl.resolve(), what=str(args.verl))
        origin = checkout_origin(args=args, verl_root=verl_root, stored=stored)
        files = build_reference(verl_root=verl_root, origin=origin)
        return emit(args=args, out=out, files=files, label=origin["commit"])
    version = check_version(args.verl_version)
    with tempfile.TemporaryDirectory(prefix="verl_wheel_") as tmp:
        if args.wheel is None:
            wheel = download_wheel(version=version, dest=Path(tmp) / "download")
        else:
            wheel = args.wheel.resolve()
            if wheel_version(wheel) != version:
                raise SystemExit(f"--wheel {wheel.name} is not the wheel of verl {version}")
        verl_root = check_root(extract_wheel(wheel=wheel, dest=Path(tmp) / "root"), what=wheel.name)
        files = build_reference(verl_root=verl_root, origin=release_origin(version=version, wheel=wheel))
    return emit(args=args, out=out, files=files, label=version)


if __name__ == "__main__":
    sys.exit(main())
