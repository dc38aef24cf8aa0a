"""Typed config trees on OmegaConf: merge layers, apply overrides, build the dataclasses.

OmegaConf does the type conversion and keeps schema nodes closed; this module turns its
exceptions into ours (full key, the closest valid key, the valid keys of that section) and builds
the dataclasses itself, node by node, so that a ``__post_init__`` error or note carries the path of
the section that raised it.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import re
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, cast

from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict
from omegaconf import errors as oc_errors

from verl_config.errors import ConfigError, ConfigKeyError, ConfigTypeError, ConfigValueError, ErrorCollector
from verl_config.notes import ConfigNote, defaults_only
from verl_config.overrides import Override, format_value, parse_override
from verl_config.verl_keys import verl_yaml_declares

__all__ = [
    "EXPLICIT_ATTR",
    "apply_override",
    "build_typed",
    "explicit_keys",
    "explicit_keys_of",
    "is_given",
    "merge_layer",
    "read_yaml",
    "to_yaml",
    "unknown_key_error",
]

# Called with the full dotted key of an unknown key; returns an extra hint or None
# (the PPO loader uses it to say "exists only with model_engine=megatron").
KeyHint = Callable[[str], str | None]


def _is_schema_node(node: Any) -> bool:
    return isinstance(node, DictConfig) and dataclasses.is_dataclass(OmegaConf.get_type(node))


def _child_keys(cfg: DictConfig, parent: str) -> list[str]:
    node = OmegaConf.select(cfg, parent) if parent else cfg
    return [str(k) for k in node.keys()] if isinstance(node, DictConfig) else []


def unknown_key_error(cfg: DictConfig, full_key: str, *, hint: KeyHint | None = None) -> ConfigKeyError:
    """An error for ``full_key``: the closest valid key ("did you mean") and the valid keys of its section."""
    parent, _, leaf = full_key.rpartition(".")
    # Walk down to the deepest existing ancestor, so a typo in a middle segment is reported there.
    parts = full_key.split(".")
    depth = 0
    node: Any = cfg
    while depth < len(parts) - 1 and isinstance(node, DictConfig) and parts[depth] in node:
        node = node[parts[depth]]
        depth += 1
    if depth < len(parts) - 1:
        parent, leaf = ".".join(parts[:depth]), parts[depth]
    valid = _child_keys(cfg, parent)
    close = difflib.get_close_matches(leaf, valid, n=1, cutoff=0.6)
    bad = f"{parent}.{leaf}" if parent else leaf
    msg = (
        f"unknown config key '{full_key}'"
        if bad == full_key
        else f"unknown config key '{full_key}' ('{bad}' does not exist)"
    )
    if close:
        msg += f"; did you mean '{parent + '.' if parent else ''}{close[0]}'?"
    extra = hint(full_key) if hint is not None else None
    if extra:
        msg += f"; {extra}."
    if valid:
        msg += f" Valid keys under {repr(parent) if parent else 'the top level'}: {', '.join(sorted(valid))}"
    return ConfigKeyError(msg)


def _translate(
    cfg: DictConfig, exc: oc_errors.OmegaConfBaseException, origin: str, hint: KeyHint | None
) -> Exception:
    full_key = str(getattr(exc, "full_key", "") or getattr(exc, "key", "") or "")
    if isinstance(exc, oc_errors.ConfigKeyError | oc_errors.ConfigAttributeError):
        return unknown_key_error(cfg, full_key, hint=hint)
    if isinstance(exc, oc_errors.InterpolationKeyError | oc_errors.InterpolationResolutionError):
        return ConfigValueError(full_key or "<config>", f"{str(exc).splitlines()[0]} (from {origin})")
    first_line = str(exc).splitlines()[0]
    return ConfigTypeError(f"{full_key or '<config>'}: {first_line} (from {origin})")


def read_yaml(
    *, yaml_path: str | Path | None = None, yaml_text: str | None = None
) -> tuple[str, DictConfig] | None:
    """Read the user's YAML layer (file or text); None when neither is given."""
    if yaml_path is not None and yaml_text is not None:
        raise ValueError("give yaml_path or yaml_text, not both")
    if yaml_path is not None:
        path = Path(yaml_path)
        if not path.is_file():
            raise FileNotFoundError(f"config file {str(path)!r} does not exist")
        layer = OmegaConf.load(path)
        origin = str(path)
    elif yaml_text is not None:
        layer = OmegaConf.create(yaml_text)
        origin = "yaml text"
    else:
        return None
    if not isinstance(layer, DictConfig):
        raise ConfigTypeError(
            f"{origin}: the top level of a config file must be a mapping, not a {type(layer).__name__}"
        )
    return origin, layer


def merge_layer(
    cfg: DictConfig, layer: DictConfig, *, origin: str, hint: KeyHint | None = None
) -> DictConfig:
    """Merge ``layer`` (a YAML file) into ``cfg``; unknown keys and bad types raise our errors."""
    try:
        return OmegaConf.merge(cfg, layer)  # type: ignore[return-value]
    except oc_errors.OmegaConfBaseException as exc:
        raise _translate(cfg, exc, origin, hint) from None


def apply_override(cfg: DictConfig, override: Override | str, *, hint: KeyHint | None = None) -> None:
    """Apply one command-line override in place (semantics in :mod:`verl_config.overrides`).

    Schema sections are closed: ``key=value`` may only set existing keys there, ``+``/``~`` are
    refused with the reason. Open dicts (``override_ddp_config``, ``override_config`` ...) accept new
    keys with or without ``+``, as verl users write both.
    """
    ov = parse_override(override) if isinstance(override, str) else override
    try:
        _apply(cfg, ov, hint)
    except oc_errors.OmegaConfBaseException as exc:
        raise _translate(cfg, exc, f"override {ov.text!r}", hint) from None


def _apply(cfg: DictConfig, ov: Override, hint: KeyHint | None) -> None:
    parent_key, _, leaf = ov.key.rpartition(".")
    parent = OmegaConf.select(cfg, parent_key, throw_on_missing=False) if parent_key else cfg
    if parent_key and parent is None and ov.kind in ("set", "add", "force_add"):
        parent = _create_in_open_dict(cfg, parent_key, ov, hint)
    if not isinstance(parent, DictConfig):
        if parent is None:
            raise unknown_key_error(cfg, ov.key, hint=hint)
        raise ConfigTypeError(
            f"override {ov.text!r}: '{parent_key}' holds a {type(parent).__name__} value, not a section"
        )
    exists = leaf in parent or OmegaConf.is_missing(parent, leaf)  # `in` is false for a ??? value
    closed = _is_schema_node(parent)
    where = f"'{parent_key}'" if parent_key else "the top level"
    if ov.kind == "delete":
        if not exists:
            raise unknown_key_error(cfg, ov.key, hint=hint)
        if closed:
            raise ConfigKeyError(
                f"override {ov.text!r}: cannot delete '{ov.key}', a key of the typed section {where};"
                f" set it instead ({ov.key}=VALUE)"
            )
        if ov.has_value and _plain(parent[leaf]) != ov.value:
            raise ConfigValueError(
                ov.key,
                f"override {ov.text!r} deletes it only if it equals {format_value(ov.value)}, but it is {parent[leaf]!r}",
            )
        with open_dict(parent):
            del parent[leaf]
        return
    if ov.kind == "add" and exists and not _plus_allowed(parent, leaf, ov):
        raise ConfigKeyError(
            f"override {ov.text!r}: '{ov.key}' already exists; use {ov.key}=VALUE to change it (or"
            f" ++{ov.key}=VALUE): verl's Hydra refuses '+' on a key that holds a value"
        )
    if not exists and closed:
        if ov.kind in ("add", "force_add"):
            err = unknown_key_error(cfg, ov.key, hint=hint)
            raise ConfigKeyError(f"cannot add a key to the typed section {where}: {err}")
        raise unknown_key_error(cfg, ov.key, hint=hint)
    if exists and _is_schema_node(parent._get_node(leaf)) and isinstance(ov.value, dict):
        parent[leaf] = OmegaConf.merge(parent[leaf], ov.value)
    else:
        with open_dict(parent):
            parent[leaf] = ov.value


def _plus_allowed(parent: DictConfig, leaf: str, ov: Override) -> bool:
    """Whether ``+key=value`` may set the existing ``key``, by Hydra's rule where verl's yaml has the key.

    Hydra (verl's launcher) accepts ``+key`` on an existing key only when the key holds null or the value is a
    dict or a list (then merged), and refuses it otherwise ("Could not append to config"). A key this schema
    declares but verl's yaml lacks (:mod:`verl_config.verl_keys`: a field of verl's dataclasses, a key verl reads
    with ``.get()``, or one of ours) is added by verl's command lines with '+': that sets it while it still holds
    its default.
    """
    if not verl_yaml_declares(ov.key):
        return _holds_default(parent, leaf)
    node = parent._get_node(leaf)  # Hydra selects a ??? value as None: '+' sets it
    return node is None or node._is_none() or node._is_missing() or isinstance(ov.value, dict | list)


def _holds_default(parent: DictConfig, leaf: str) -> bool:
    """True when ``parent[leaf]`` is null or, in a typed section, equal to its field's declared default."""
    value = parent._get_node(leaf)
    if value is None or value._is_none() or value._is_missing():
        return True
    cls = OmegaConf.get_type(parent)
    if not dataclasses.is_dataclass(cls):
        return False
    spec = next((f for f in dataclasses.fields(cls) if f.name == leaf), None)
    if spec is None:
        return False
    if spec.default is not dataclasses.MISSING:
        default = spec.default
    elif spec.default_factory is not dataclasses.MISSING:
        with defaults_only():
            default = spec.default_factory()
    else:
        return False
    current = (
        value._value() if not isinstance(value, DictConfig | ListConfig) else OmegaConf.to_container(value)
    )
    if dataclasses.is_dataclass(default):
        return isinstance(value, DictConfig) and current == OmegaConf.to_container(
            OmegaConf.structured(default)
        )
    return bool(current == default)


def _create_in_open_dict(cfg: DictConfig, parent_key: str, ov: Override, hint: KeyHint | None) -> DictConfig:
    """Create missing intermediate dicts, but only below an existing open dict."""
    parts = parent_key.split(".")
    node: Any = cfg
    for part in parts:
        if isinstance(node, DictConfig) and part in node:
            if (
                node[part] is None
            ):  # an optional field that is null: start it empty, or at its section's defaults
                section = _child(node, part)._metadata.ref_type
                if isinstance(section, type) and dataclasses.is_dataclass(section):
                    with defaults_only():
                        node[part] = section()
                else:
                    node[part] = {}
            node = node[part]
            continue
        if not isinstance(node, DictConfig) or _is_schema_node(node):
            raise unknown_key_error(cfg, ov.key, hint=hint)
        with open_dict(node):
            node[part] = {}
        node = node[part]
    return node


def explicit_keys(layer: DictConfig | Mapping[str, Any] | None, overrides: list[Override]) -> set[str]:
    """Dotted leaf keys the user wrote (YAML layer and overrides), to tell "given" from "default"."""
    keys: set[str] = set()

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, Mapping | DictConfig) and value:
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        elif prefix:
            keys.add(prefix)

    if layer is not None:
        walk("", OmegaConf.to_container(layer) if isinstance(layer, DictConfig) else layer)
    for ov in overrides:
        if ov.kind != "delete":
            walk(ov.key, ov.value)
    return keys


# The attribute of a loaded config holding the keys the user gave (see explicit_keys_of).
EXPLICIT_ATTR = "_verl_config_explicit"


def is_given(explicit: set[str] | frozenset[str], key: str) -> bool:
    """Whether the user wrote ``key`` or a key below it."""
    return key in explicit or any(k.startswith(key + ".") for k in explicit)


def explicit_keys_of(config: Any) -> frozenset[str] | None:
    """The dotted keys the user gave when ``config`` was loaded (YAML file or text, overrides; a moved legacy
    spelling counts for its canonical key), to tell "given" from "default"; None when ``config`` was not made by
    :func:`verl_config.load_config`."""
    keys = getattr(config, EXPLICIT_ATTR, None)
    return frozenset(keys) if keys is not None else None


def build_typed(
    cfg: DictConfig,
    *,
    origin: str = "config",
    hint: KeyHint | None = None,
    errors: ErrorCollector | None = None,
    missing_as_none: tuple[str, ...] = (),
) -> tuple[Any, list[str]]:
    """Resolve ``cfg`` and build its dataclasses bottom-up; return (object, notes).

    The concrete dataclass of every section is taken from the node (so an engine-specific
    subclass stays itself), every ``__post_init__`` error gets the section path in front of its
    key, and :class:`~verl_config.notes.ConfigNote` warnings are collected with full keys.
    The keys of ``missing_as_none`` that hold ``???`` (verl's "mandatory") are built as None.
    A section that fails does not stop the others: every error is raised together at the end
    (with those already in ``errors``, e.g. from the overrides), see :class:`ConfigErrors`.
    """
    errors = errors if errors is not None else ErrorCollector()
    unset = [key for key in missing_as_none if _is_missing(cfg, key)]
    for key in unset:  # mandatory (???) only for a consumer: built as null, the tree is left as it was
        OmegaConf.update(cfg, key, None, merge=False)
    try:
        data = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except oc_errors.OmegaConfBaseException as exc:
        errors.add(_translate(cfg, exc, origin, hint))  # type: ignore[arg-type]
        errors.raise_if_any()
    finally:
        for key in unset:
            OmegaConf.update(cfg, key, "???", merge=False)
    notes: list[str] = []
    assert isinstance(data, dict)  # the root of a DictConfig is a mapping
    config = _build_node(cfg, cast(Mapping[str, Any], data), "", notes, errors)
    errors.raise_if_any()
    return config, notes


def _is_missing(cfg: DictConfig, key: str) -> bool:
    parent_key, _, leaf = key.rpartition(".")
    parent = OmegaConf.select(cfg, parent_key, default=None) if parent_key else cfg
    return isinstance(parent, DictConfig) and OmegaConf.is_missing(parent, leaf)


def _build_node(
    node: DictConfig, data: Mapping[str, Any], path: str, notes: list[str], errors: ErrorCollector
) -> Any:
    cls = OmegaConf.get_type(node)
    if cls is None:
        raise TypeError(f"section {path or 'at the top level'!r} has no dataclass type to build")
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        value = data[f.name]
        if isinstance(value, Mapping):
            child = node[f.name]  # the DictConfig child keeps the concrete (engine-specific) dataclass type
            here = f"{path}.{f.name}" if path else f.name
            if _is_schema_node(child):
                value = _build_node(child, value, here, notes, errors)
            elif isinstance(child, DictConfig):
                # a dict of sections (dict[str, SomeConfig], e.g. distillation.teacher_models): each
                # item is built as its own section
                value = {
                    key: _build_node(child[key], item, f"{here}.{key}", notes, errors)
                    if isinstance(item, Mapping) and _is_schema_node(child._get_node(key))
                    else item
                    for key, item in value.items()
                }
        kwargs[f.name] = value
    already_found = len(errors.errors)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ConfigNote)
        try:
            obj = cls(**kwargs)
        except ConfigError as err:
            root = node._get_root()
            assert isinstance(root, DictConfig)  # a section's root is the whole config
            errors.add(err, prefix=path, source_of=functools.partial(_interpolation_source, root))
            obj = _unchecked(cls, kwargs)
        except Exception:
            # A section whose rules read a value already reported as invalid may fail in other ways
            # (a division by a size of 0): the error to show is the one already reported.
            if not already_found:
                raise
            obj = _unchecked(cls, kwargs)
    for w in caught:
        if isinstance(w.message, ConfigNote):
            notes.append(f"{path + '.' if path else ''}{w.message}")
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return obj


def _interpolation_source(root: DictConfig, full_key: str) -> str | None:
    """The key whose value ``full_key`` copies through an absolute interpolation on its path
    (``${actor_rollout_ref.actor.megatron.seed}``), or None."""
    parts = full_key.split(".")
    current: Any = root
    for depth, part in enumerate(parts):
        if not isinstance(current, DictConfig) or part not in current:
            return None
        if OmegaConf.is_interpolation(current, part):
            match = re.fullmatch(r"\$\{([\w.]+)\}", str(_child(current, part)._value()))
            return ".".join([match.group(1), *parts[depth + 1 :]]) if match else None
        current = current._get_node(part)
    return None


def _child(node: DictConfig, key: str) -> Any:
    """The node under ``key`` of ``node`` (which has it): omegaconf types the lookup as possibly None."""
    child = node._get_node(key)
    if child is None:
        raise KeyError(key)
    return child


def _plain(value: Any) -> Any:
    """``value`` as plain Python (an omegaconf node converted, a scalar as it is)."""
    container = OmegaConf.to_container(OmegaConf.create({"v": value}))
    assert isinstance(container, dict)
    return container["v"]


def _unchecked(cls: type, kwargs: Mapping[str, Any]) -> Any:
    """An instance of ``cls`` with ``kwargs`` set but no ``__post_init__`` run: a stand-in for a section
    that failed its own checks, so that the sections above it can still check theirs."""
    obj: Any = object.__new__(cls)
    for key, value in kwargs.items():
        object.__setattr__(obj, key, value)
    return obj


def to_yaml(config: Any, *, resolve: bool = False) -> str:
    """Render a config (dataclass instance, DictConfig or mapping) as YAML."""
    if isinstance(config, DictConfig | ListConfig):
        node = config
    elif dataclasses.is_dataclass(config):
        node = OmegaConf.structured(config)
    else:
        node = OmegaConf.create(config)
    return OmegaConf.to_yaml(node, resolve=resolve)
