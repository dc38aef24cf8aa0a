"""Key-by-key comparison of our schema with verl's own configuration, and the short list of differences we keep.

:func:`compare_with_verl` lists every mismatch with the pinned verl release (:data:`VERL_REFERENCE`); a test
requires each to be covered by a row of :data:`INTENTIONAL_DIFFERENCES`, and each row to still be needed. The rules
of the comparison are in the package README ("Same keys as verl, checked mechanically").
"""

from __future__ import annotations

import ast
import fnmatch
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields, is_dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf

__all__ = [
    "INTENTIONAL_DIFFERENCES",
    "VERL_REFERENCE",
    "Difference",
    "Mismatch",
    "annotation_kinds",
    "compare_with_verl",
    "differences_markdown",
    "normalize_default",
    "unexplained",
]

# The verl release the schema tracks: its published wheel (verl==0.9.1 on PyPI) is the reference,
# stored by scripts/refresh_verl_reference.py --verl-version 0.9.1 (REFERENCE.json names it).
VERL_REFERENCE = "0.9.1"

MISMATCH_KINDS = ("missing", "ours_only", "default", "type")


@dataclass(frozen=True)
class Difference:
    """One documented difference from verl: which keys (fnmatch patterns), what kind, on which engines, why."""

    keys: tuple[str, ...]
    kind: str
    reason: str
    engines: tuple[str, ...] = ("fsdp", "megatron")

    def covers(self, mismatch: Mismatch) -> bool:
        return (
            mismatch.kind == self.kind
            and mismatch.engine in self.engines
            and any(fnmatch.fnmatchcase(mismatch.key, pattern) for pattern in self.keys)
        )


@dataclass(frozen=True)
class Mismatch:
    """A place where our default tree and verl's differ."""

    kind: str
    engine: str
    key: str
    verl: Any = None
    ours: Any = None

    def __str__(self) -> str:
        return f"[{self.engine}] {self.kind} {self.key}: verl={self.verl!r} ours={self.ours!r}"


_PACKED_KEYS = ("packed_attention_backend", "grad_offload")

# The whole list of intentional differences from verl (README "Differences from verl" renders it).
INTENTIONAL_DIFFERENCES: tuple[Difference, ...] = (
    Difference(
        keys=("model_engine",),
        kind="ours_only",
        reason="the one switch between the FSDP and Megatron sections; verl picks them with --config-name"
        " (ppo_megatron_trainer is accepted here as an alias).",
    ),
    Difference(
        keys=tuple(f"*.megatron.{k}" for k in _PACKED_KEYS),
        kind="ours_only",
        engines=("megatron",),
        reason="the attention kernel of verl-dyncp's packed (THD) path, which verl's Megatron engine does not"
        " have (default auto); grad_offload: verl 0.9 folded gradient offload into param_offload, verl-engine"
        " still offloads gradients on their own (GRPO colocation; default off).",
    ),
    Difference(
        keys=(
            "reward.reward_kwargs",
            "reward_model.reward_kwargs",
            "trainer.remove_previous_ckpt_in_save",
        ),
        kind="ours_only",
        reason="verl reads them with .get() and its yaml lacks them (scripts add them with '+'; DAPO's overlong"
        " buffer lives in reward_kwargs; reward_model.reward_kwargs is the pre-0.9 spelling, which only verl's"
        " fully-async entry still moves there); declared here so they are typed and '+' works as in verl.",
    ),
)

# ${oc.select:key,default}; the default may itself be an interpolation (verl nests a second oc.select as the
# fallback), which is rewritten first since the substitution runs innermost-out.
_OC_SELECT = re.compile(r"\$\{oc\.select:\s*([^,{}]+?)\s*(?:,(?:\{\}|\[\]|\$\{[^{}]*\}|[^{}])*)?\}")
_INTERP = re.compile(r"\$\{(\.+)([^}]*)\}")


def normalize_default(value: Any, *, key: str) -> Any:
    """A default as a comparable value: interpolations become absolute ``${path}``, tuples lists."""
    if isinstance(value, tuple):
        return [normalize_default(v, key=key) for v in value]
    if isinstance(value, list):
        return [normalize_default(v, key=key) for v in value]
    if not isinstance(value, str) or "${" not in value:
        return value
    text, previous = value, None
    while text != previous:
        previous, text = text, _OC_SELECT.sub(lambda m: "${" + m.group(1) + "}", text)
    parent = key.split(".")[:-1]

    def absolute(m: re.Match[str]) -> str:
        up = len(m.group(1)) - 1
        base = parent[: len(parent) - up] if up else parent
        return "${" + ".".join([*base, m.group(2)]) + "}"

    return _INTERP.sub(absolute, text)


def _leaves(tree: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(tree, Mapping) and tree:
        for k, v in tree.items():
            if k == "_target_":
                continue
            yield from _leaves(v, f"{prefix}.{k}" if prefix else str(k))
    elif prefix:
        yield prefix, tree


def _sections(tree: Any, prefix: str = "") -> Iterator[str]:
    if isinstance(tree, Mapping):
        if prefix:
            yield prefix
        for k, v in tree.items():
            yield from _sections(v, f"{prefix}.{k}" if prefix else str(k))


_SCALAR_KINDS = {"int": "int", "float": "float", "str": "str", "bool": "bool"}
_LIST_NAMES = {"list", "List", "tuple", "Tuple", "Sequence", "set", "Set"}
_DICT_NAMES = {"dict", "Dict", "Mapping", "MutableMapping"}


def annotation_kinds(annotation: str) -> frozenset[str] | None:
    """The kinds of value an annotation admits (int/float/str/bool/list/dict/none); None for Any."""
    return _kinds(ast.parse(annotation, mode="eval").body)


def _name(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    return ""


def _union(parts: list[frozenset[str] | None]) -> frozenset[str] | None:
    if any(p is None for p in parts):
        return None
    return frozenset().union(*parts)  # type: ignore[arg-type]


def _kinds(node: ast.expr) -> frozenset[str] | None:
    if isinstance(node, ast.Constant) and node.value is None:
        return frozenset({"none"})
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return _union([_kinds(node.left), _kinds(node.right)])
    if isinstance(node, ast.Subscript):
        base = _name(node.value)
        args = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        if base == "Optional":
            return _union([_kinds(args[0]), frozenset({"none"})])
        if base == "Union":
            return _union([_kinds(a) for a in args])
        if base in _LIST_NAMES:
            return frozenset({"list"})
        if base in _DICT_NAMES:
            return frozenset({"dict"})
        return None
    name = _name(node)
    if name == "Any" or not name:
        return None
    if name == "None":
        return frozenset({"none"})
    if name in _SCALAR_KINDS:
        return frozenset({_SCALAR_KINDS[name]})
    if name in _LIST_NAMES:
        return frozenset({"list"})
    return frozenset({"dict"})  # dict itself or a config class (a section)


def _admits(ours: frozenset[str] | None, verl: frozenset[str] | None) -> bool:
    if ours is None or verl is None:
        return True
    return all(k in ours or (k == "int" and "float" in ours) for k in verl)


def _our_field_types(tree: DictConfig, section: str) -> dict[str, str]:
    node = OmegaConf.select(tree, section) if section else tree
    if not isinstance(node, DictConfig):
        return {}
    cls = OmegaConf.get_type(node)
    if cls is None or not is_dataclass(cls):
        return {}
    return {
        f.name: f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        for f in fields(cls)
    }


def compare_with_verl(
    *,
    engine: str,
    verl_tree: Mapping[str, Any],
    ours: DictConfig,
    targets: Mapping[str, Mapping[str, Any]],
    classes: Mapping[str, Mapping[str, Any]],
) -> list[Mismatch]:
    """Every mismatch between verl's generated config (``verl_tree``) and our default tree ``ours``.

    ``targets`` maps a section path of verl's yaml to its dataclass (``class_key``); ``classes``
    holds verl's dataclass fields (both from the stored reference data).
    """
    verl_leaves = dict(_leaves(verl_tree))
    our_leaves = dict(_leaves(OmegaConf.to_container(ours, resolve=False)))
    out: list[Mismatch] = []
    for key, value in verl_leaves.items():
        if key not in our_leaves:
            # a verl leaf may be a section of ours holding the same default (an empty dict vs. a typed block)
            if not any(k.startswith(key + ".") for k in our_leaves):
                out.append(Mismatch("missing", engine, key, verl=value))
            continue
        want, have = normalize_default(value, key=key), normalize_default(our_leaves[key], key=key)
        if want != have:
            out.append(Mismatch("default", engine, key, verl=value, ours=our_leaves[key]))
    verl_sections = set(_sections(verl_tree))
    for key, value in our_leaves.items():
        if key in verl_leaves or any(prefix in verl_leaves for prefix in _prefixes(key)):
            continue
        if not _dataclass_only(key, targets, classes):
            out.append(Mismatch("ours_only", engine, key, ours=value))
    for section, info in targets.items():
        cls = classes.get(info.get("class_key") or "")
        if cls is None or section not in verl_sections:
            continue
        our_types = _our_field_types(ours, section)
        for name, spec in cls["fields"].items():
            if spec.get("private") or name not in our_types:
                continue
            verl_kinds, our_kinds = annotation_kinds(spec["annotation"]), annotation_kinds(our_types[name])
            if not _admits(our_kinds, verl_kinds):
                out.append(
                    Mismatch(
                        "type", engine, f"{section}.{name}", verl=spec["annotation"], ours=our_types[name]
                    )
                )
    return out


def _prefixes(key: str) -> list[str]:
    parts = key.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _dataclass_only(
    key: str, targets: Mapping[str, Mapping[str, Any]], classes: Mapping[str, Mapping[str, Any]]
) -> bool:
    """True when ``key`` falls under a field of verl's dataclass for its nearest targeted section."""
    for section in reversed(_prefixes(key)):
        info = targets.get(section)
        if info is None:
            continue
        cls = classes.get(info.get("class_key") or "")
        if cls is None:
            return False
        first = key[len(section) + 1 :].split(".")[0]
        return first in cls["fields"]
    return False


def unexplained(mismatches: list[Mismatch]) -> list[Mismatch]:
    """The mismatches no row of :data:`INTENTIONAL_DIFFERENCES` covers (``missing`` ones never are)."""
    return [
        m for m in mismatches if m.kind == "missing" or not any(d.covers(m) for d in INTENTIONAL_DIFFERENCES)
    ]


def differences_markdown() -> str:
    """:data:`INTENTIONAL_DIFFERENCES` as the Markdown table the README shows (a test keeps them equal)."""
    kinds = {"ours_only": "only here", "default": "other default", "type": "other type"}
    lines = ["| key(s) | engines | kind | why |", "|---|---|---|---|"]
    for row in INTENTIONAL_DIFFERENCES:
        keys = ", ".join(f"`{k}`" for k in row.keys)
        lines.append(f"| {keys} | {' / '.join(row.engines)} | {kinds[row.kind]} | {row.reason} |")
    return "\n".join(lines) + "\n"
