"""Load a typed config: schema defaults <- YAML file <- dotlist overrides (``a.b.c=value``).

OmegaConf does the merging and type conversion; this module turns its exceptions into ours (with
the full key and a "did you mean" hint) and builds the dataclasses itself, section by section, so
that a ``__post_init__`` error is reported with the path of the section that raised it.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from omegaconf import DictConfig, OmegaConf
from omegaconf import errors as oc_errors

from verl_config.errors import ConfigKeyError, ConfigTypeError, ConfigValueError

__all__ = ["load_config", "parse_overrides", "to_yaml"]

T = TypeVar("T")


def _valid_keys(schema: type, full_key: str) -> list[str]:
    """Field names of the dataclass that ``full_key``'s parent path points to inside ``schema``."""
    node: Any = schema
    for part in full_key.split(".")[:-1]:
        hints = typing.get_type_hints(node) if dataclasses.is_dataclass(node) else {}
        node = hints.get(part)
        if node is None or not dataclasses.is_dataclass(node):
            return []
    return [f.name for f in dataclasses.fields(node)] if dataclasses.is_dataclass(node) else []


def _unknown_key(schema: type, full_key: str) -> ConfigKeyError:
    valid = _valid_keys(schema, full_key)
    leaf = full_key.rsplit(".", 1)[-1]
    parent = full_key.rsplit(".", 1)[0] if "." in full_key else ""
    close = difflib.get_close_matches(leaf, valid, n=1, cutoff=0.6)
    where = f"'{parent}'" if parent else "the top level"
    msg = f"unknown config key '{full_key}'"
    if close:
        prefix = f"{parent}." if parent else ""
        msg += f"; did you mean '{prefix}{close[0]}'?"
    if valid:
        msg += f" Valid keys under {where}: {', '.join(sorted(valid))}"
    return ConfigKeyError(msg)


def _translate(schema: type, exc: oc_errors.OmegaConfBaseException, origin: str) -> Exception:
    full_key = str(getattr(exc, "full_key", "") or getattr(exc, "key", "") or "")
    if isinstance(exc, oc_errors.ConfigKeyError | oc_errors.ConfigAttributeError):
        return _unknown_key(schema, full_key)
    if isinstance(exc, oc_errors.ValidationError):
        first_line = str(exc).splitlines()[0]
        return ConfigTypeError(f"{full_key}: {first_line} (from {origin})")
    return ConfigTypeError(f"{full_key or '<config>'}: {exc} (from {origin})")


def parse_overrides(overrides: Sequence[str]) -> DictConfig:
    """Parse ``key=value`` tokens (OmegaConf dotlist syntax; values parsed as YAML)."""
    for token in overrides:
        if "=" not in token:
            raise ConfigKeyError(
                f"override {token!r} has no '='; write overrides as key=value, e.g. optim.lr=1e-4"
            )
    return OmegaConf.from_dotlist(list(overrides))


def _unwrap_optional(tp: Any) -> Any:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def _build(cls: type[T], data: Mapping[str, Any], path: str) -> T:
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.name not in data:
            continue
        value = data[f.name]
        field_type = _unwrap_optional(hints[f.name])
        if dataclasses.is_dataclass(field_type) and isinstance(value, Mapping):
            value = _build(field_type, value, f"{path}.{f.name}" if path else f.name)  # type: ignore[arg-type]
        kwargs[f.name] = value
    try:
        return cls(**kwargs)
    except ConfigValueError as err:
        raise err.with_prefix(path) from None


def load_config(
    schema: type[T],
    *,
    yaml_path: str | Path | None = None,
    yaml_text: str | None = None,
    overrides: Sequence[str] = (),
) -> T:
    """Return an instance of the dataclass ``schema`` from its defaults, a YAML file and overrides.

    Precedence: schema defaults < YAML (``yaml_path`` or ``yaml_text``) < ``overrides``.
    Raises ConfigKeyError for an unknown key, ConfigTypeError for a value of the wrong type and
    ConfigValueError for a value the schema's validation rejects; every message names the key.
    """
    if yaml_path is not None and yaml_text is not None:
        raise ValueError("give yaml_path or yaml_text, not both")
    cfg = OmegaConf.structured(schema)
    layers: list[tuple[str, Any]] = []
    if yaml_path is not None:
        path = Path(yaml_path)
        if not path.is_file():
            raise FileNotFoundError(f"config file {str(path)!r} does not exist")
        layers.append((str(path), OmegaConf.load(path)))
    elif yaml_text is not None:
        layers.append(("yaml text", OmegaConf.create(yaml_text)))
    if overrides:
        layers.append(("command-line overrides", parse_overrides(overrides)))
    for origin, layer in layers:
        try:
            cfg = OmegaConf.merge(cfg, layer)
        except oc_errors.OmegaConfBaseException as exc:
            raise _translate(schema, exc, origin) from None
    try:
        data = OmegaConf.to_container(cfg, resolve=True)
    except oc_errors.OmegaConfBaseException as exc:
        raise _translate(schema, exc, "interpolation") from None
    assert isinstance(data, dict)
    return _build(schema, data, "")


def to_yaml(config: Any) -> str:
    """Render a config dataclass (or mapping) as YAML."""
    return OmegaConf.to_yaml(OmegaConf.structured(config))
