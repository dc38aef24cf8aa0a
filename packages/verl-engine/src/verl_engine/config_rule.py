"""The vocabulary of :mod:`verl_engine.config_support`'s table: the engine sections of a verl 0.9.1 config,
a :class:`Rule` (key patterns, sections, kind, what is supported) and the flattening of a section into keys.

Why apart from the table: the table is long and only data; how a rule matches a key and judges a value is
the small piece of logic the walk test and ``check_supported`` share.
"""

from __future__ import annotations

import dataclasses
import enum
import fnmatch
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

__all__ = [
    "ACTOR",
    "CRITIC",
    "CRITIC_MODEL",
    "MODEL",
    "REF",
    "ROLE_SECTIONS",
    "SECTIONS",
    "Allowed",
    "Kind",
    "Rule",
    "flatten_section",
    "is_empty",
    "one_of",
    "plain",
    "section_of",
]

ACTOR = "actor_rollout_ref.actor"
REF = "actor_rollout_ref.ref"
MODEL = "actor_rollout_ref.model"
CRITIC = "critic"
CRITIC_MODEL = "critic.model"
SECTIONS = (ACTOR, REF, MODEL, CRITIC, CRITIC_MODEL)
ROLE_SECTIONS = {"actor": (ACTOR, MODEL), "ref": (REF, MODEL), "critic": (CRITIC, CRITIC_MODEL)}
"""The sections whose refused rules apply when a role's engine is built."""


class Kind(enum.Enum):
    """What the engine does with a key."""

    HONOURED = "honoured"  # the engine reads it; tests show its effect
    REFUSED = "refused"  # valid verl, not implemented: refused at build when not the supported value
    NOT_ENGINE = "not-engine"  # read by verl's trainer / worker / rollout, not by a training engine


Allowed = Callable[[Any, Any, str], bool]
"""``allowed(value, cfg, section)``: whether a refused rule's key holds a supported value."""


@dataclass(frozen=True, kw_only=True)
class Rule:
    """One row of the table: key patterns (``fnmatch``, relative to the section) in some sections.

    ``reason``: refused: why and what to do instead; not-engine: who reads it; honoured: an optional note.
    ``evidence``: pytest node ids showing the effect (honoured; optional for a refused rule's supported values).
    ``allowed`` (refused; None = verl's default only), ``supported`` (refused: the supported values in words),
    ``example`` (refused: overrides relative to the section, valid verl, that the engine refuses; the first
    sets the refused key), ``describe`` (refused: the message after ``key=value`` when the table's is not enough).
    """

    keys: tuple[str, ...]
    sections: tuple[str, ...]
    kind: Kind
    reason: str = ""
    evidence: tuple[str, ...] = ()
    allowed: Allowed | None = None
    supported: str = "verl's default"
    example: tuple[str, ...] = ()
    describe: Callable[[Any], str] | None = None

    def matches(self, key: str, section: str) -> bool:
        return section in self.sections and any(fnmatch.fnmatchcase(key, p) for p in self.keys)

    def is_supported(self, value: Any, *, cfg: Any, section: str, key: str) -> bool:
        if self.allowed is not None:
            return self.allowed(value, cfg, section)
        return plain(value) == plain(_defaults()[f"{section}.{key}"])

    def problem(self, full_key: str, value: Any) -> str:
        if self.describe is not None:
            return f"{full_key}={plain(value)!r} {self.describe(value)}"
        return f"{full_key}={plain(value)!r} {self.reason}; supported: {self.supported}"


def one_of(*values: Any) -> Allowed:
    return lambda value, cfg, section: plain(value) in values


def is_empty(value: Any, cfg: Any, section: str) -> bool:
    return not value


def plain(value: Any) -> Any:
    """Lists and dicts of a loaded config as plain Python values (comparable, printable)."""
    if isinstance(value, Mapping):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def _node(cfg: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


def section_of(cfg: Any, section: str) -> Any:
    """The section object of a loaded ppo_trainer config (``critic.model`` included)."""
    return _node(cfg, section)


def flatten_section(cfg: Any, section: str) -> Iterator[tuple[str, Any]]:
    """(key relative to the section, value) for every leaf; dicts are leaves; ``critic`` leaves out ``model``."""

    def walk(obj: Any, prefix: str) -> Iterator[tuple[str, Any]]:
        if dataclasses.is_dataclass(obj):
            for f in dataclasses.fields(obj):
                if section == CRITIC and not prefix and f.name == "model":
                    continue
                yield from walk(getattr(obj, f.name), f"{prefix}{f.name}.")
        else:
            yield prefix[:-1], obj

    yield from walk(section_of(cfg, section), "")


@lru_cache(maxsize=1)
def _defaults() -> dict[str, Any]:
    """verl 0.9.1's default of every key of the engine sections (model_engine=megatron)."""
    from verl_config import load_config

    cfg = load_config(
        overrides=[
            "model_engine=megatron",
            f"{ACTOR}.ppo_micro_batch_size_per_gpu=1",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1",
            f"{CRITIC}.ppo_micro_batch_size_per_gpu=1",
            f"{REF}.log_prob_micro_batch_size_per_gpu=1",
            "critic.model.path=~/models/deepseek-llm-7b-chat",  # verl's default, given: GAE uses the critic
        ]
    )
    return {f"{s}.{k}": v for s in SECTIONS for k, v in flatten_section(cfg, s)}
