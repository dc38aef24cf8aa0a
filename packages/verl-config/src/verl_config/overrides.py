"""Command-line overrides in the syntax verl users type (Hydra's), parsed without Hydra.

Forms::

    key=value        set an existing key (or add one under an open dict, e.g. override_ddp_config)
    +key=value       add a key that does not exist yet (only under open dicts)
    ++key=value      set or add
    ~key             delete a key of an open dict
    ~key=value       delete it only if its current value equals value

Values follow Hydra's grammar rather than YAML's, because that is what verl command lines are
written in: ``1e-4`` is a float (YAML 1.1 would read a string), ``[a,b]`` a list, ``{a:1,b:2}`` a
dict, ``null`` None, ``true``/``false`` booleans (any case), quoted strings keep their text
verbatim, ``${...}`` interpolations stay strings for OmegaConf to resolve, and anything else is an
unquoted string with surrounding whitespace trimmed.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from verl_config.errors import ConfigKeyError, ConfigTypeError

__all__ = ["Override", "format_value", "parse_override", "parse_value"]

OverrideKind = Literal["set", "add", "force_add", "delete"]

_KEY_RE = re.compile(r"^[A-Za-z_][\w\-]*(\.[\w\-]+)*$")
_INT_RE = re.compile(r"^[+-]?\d+$")
_FLOAT_RE = re.compile(r"^[+-]?(\d+\.\d*|\.\d+|\d+)([eE][+-]?\d+)?$")
_SPECIAL_FLOATS = {"inf": math.inf, "+inf": math.inf, "-inf": -math.inf, "nan": math.nan}


@dataclass(frozen=True)
class Override:
    """One parsed command-line token."""

    kind: OverrideKind
    key: str
    value: Any = None
    has_value: bool = False
    text: str = ""


def parse_override(token: str) -> Override:
    """Parse one command-line token; errors quote the token and show the accepted forms."""
    text = token.strip()
    kind: OverrideKind = "set"
    if text.startswith("++"):
        kind, text = "force_add", text[2:]
    elif text.startswith("+"):
        kind, text = "add", text[1:]
    elif text.startswith("~"):
        kind, text = "delete", text[1:]
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not _KEY_RE.match(key):
        raise ConfigKeyError(
            f"override {token!r}: {key!r} is not a valid key; write key=value, +key=value, ++key=value or ~key"
            " with a dotted key such as actor_rollout_ref.actor.optim.lr=1e-6"
        )
    if not sep and kind != "delete":
        raise ConfigKeyError(
            f"override {token!r} has no '='; write it as {key}=VALUE (or ~{key} to delete an open-dict key)"
        )
    value = parse_value(raw, token=token) if sep else None
    return Override(kind=kind, key=key, value=value, has_value=bool(sep), text=token)


def parse_value(text: str, *, token: str | None = None) -> Any:
    """Parse a Hydra-style value (see module docstring)."""
    parser = _ValueParser(text, token if token is not None else text)
    value = parser.parse_element(top_level=True)
    parser.skip_ws()
    if parser.peek() == ",":
        parser.fail(
            "a comma-separated value is a Hydra sweep (multirun), which is not supported;"
            " write a list as [a,b] or quote a string that contains commas"
        )
    if parser.pos != len(parser.text):
        parser.fail(f"unexpected {parser.text[parser.pos]!r}")
    return value


def format_value(value: Any) -> str:
    """Render ``value`` so that :func:`parse_value` gives it back (strings are always quoted)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        text = repr(value)
        return text if any(c in text for c in ".en") else text + ".0"
    if isinstance(value, str):
        return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
    if isinstance(value, list | tuple):
        return "[" + ",".join(format_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{format_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot render a value of type {type(value).__name__} as an override")


def _scalar(text: str) -> Any:
    lowered = text.lower()
    if lowered == "null":
        return None
    if lowered in ("true", "false"):
        return lowered == "true"
    if _INT_RE.match(text):
        return int(text)
    if _FLOAT_RE.match(text) and any(c in text for c in ".eE"):
        return float(text)
    if lowered in _SPECIAL_FLOATS:
        return _SPECIAL_FLOATS[lowered]
    return text


class _ValueParser:
    """Recursive-descent parser over one value string."""

    def __init__(self, text: str, token: str) -> None:
        self.text = text
        self.token = token
        self.pos = 0

    def fail(self, why: str) -> None:
        raise ConfigTypeError(
            f"override {self.token!r}: cannot parse value {self.text!r} at column {self.pos}: {why}"
        )

    def skip_ws(self) -> None:
        while self.pos < len(self.text) and self.text[self.pos] in " \t":
            self.pos += 1

    def peek(self) -> str:
        return self.text[self.pos] if self.pos < len(self.text) else ""

    def parse_element(self, *, top_level: bool = False, stops: str = ",]}") -> Any:
        self.skip_ws()
        ch = self.peek()
        if ch == "[":
            return self.parse_list()
        if ch == "{":
            return self.parse_dict()
        if ch in ("'", '"'):
            return self.parse_quoted()
        return self.parse_unquoted("," if top_level else stops)

    def parse_list(self) -> list[Any]:
        items: list[Any] = []
        self.parse_items("]", "list", lambda: items.append(self.parse_element()))
        return items

    def parse_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}

        def entry() -> None:
            self.skip_ws()
            key = self.parse_quoted() if self.peek() in ("'", '"') else self.parse_unquoted(":,}")
            if not isinstance(key, str) or not key:
                self.fail("expected a dict key")
            self.skip_ws()
            if self.peek() != ":":
                self.fail(f"expected ':' after dict key {key!r}")
            self.pos += 1
            out[str(key)] = self.parse_element()

        self.parse_items("}", "dict", entry)
        return out

    def parse_items(self, close: str, what: str, parse_item: Callable[[], None]) -> None:
        """The items of a list or dict, separated by ',' up to ``close``; ``pos`` is at the opening bracket."""
        self.pos += 1
        self.skip_ws()
        if self.peek() == close:
            self.pos += 1
            return
        while True:
            parse_item()
            self.skip_ws()
            ch = self.peek()
            self.pos += 1
            if ch == close:
                return
            if ch != ",":
                self.pos -= 1
                self.fail(f"expected ',' or '{close}' in {what}")

    def parse_quoted(self) -> str:
        quote = self.text[self.pos]
        self.pos += 1
        chars: list[str] = []
        while self.pos < len(self.text):
            ch = self.text[self.pos]
            if ch == "\\" and self.pos + 1 < len(self.text) and self.text[self.pos + 1] in (quote, "\\"):
                chars.append(self.text[self.pos + 1])
                self.pos += 2
                continue
            if ch == quote:
                self.pos += 1
                return "".join(chars)
            chars.append(ch)
            self.pos += 1
        self.fail(f"unterminated {quote} string")
        raise AssertionError  # unreachable: fail raises

    def parse_unquoted(self, stops: str) -> Any:
        start = self.pos
        depth = 0  # inside ${...}, which may contain the stop characters
        while self.pos < len(self.text):
            ch = self.text[self.pos]
            if self.text.startswith("${", self.pos):
                depth += 1
                self.pos += 2
                continue
            if depth and ch == "}":
                depth -= 1
            elif not depth and ch in stops:
                break
            elif not depth and ch in "[{" and stops:
                self.fail(f"unexpected {ch!r} inside an unquoted string")
            self.pos += 1
        raw = self.text[start : self.pos].strip()
        if depth:
            self.fail("unterminated ${...} interpolation")
        if raw == "" and stops != ",":
            self.fail("empty element")
        return "" if raw == "" else _scalar(raw)
