"""The ``skip`` section (verl 0.9): replay dumped rollouts instead of generating them (debugging, off by default).

Each generator (``rollout``, ``rollout_tq``, ``async_rollout``) dumps its outputs to ``dump_dir``; on the
listed ``steps`` (all steps when empty) ``action`` is ``cache`` (generate once, then load the dump) or
``repeat`` (reuse the last dump).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from verl_config.errors import ConfigValueError
from verl_config.validation import check_choice

__all__ = ["RolloutSkipConfig", "SkipConfig"]


@dataclass
class RolloutSkipConfig:
    """One generator's skip switch (``skip.rollout``, ``skip.rollout_tq``, ``skip.async_rollout``)."""

    enable: bool = False
    dump_dir: str = "~/.verl/rollout_dump"
    steps: list[int] = field(default_factory=list)
    action: str = "cache"

    def __post_init__(self) -> None:
        check_choice("action", self.action, ("cache", "repeat"))
        if any(step < 0 for step in self.steps):
            raise ConfigValueError("steps", f"must be training steps (>= 0); got {list(self.steps)}")


@dataclass
class SkipConfig:
    """``skip``: per-generator rollout skipping."""

    rollout: RolloutSkipConfig = field(default_factory=RolloutSkipConfig)
    rollout_tq: RolloutSkipConfig = field(default_factory=RolloutSkipConfig)
    async_rollout: RolloutSkipConfig = field(default_factory=RolloutSkipConfig)
