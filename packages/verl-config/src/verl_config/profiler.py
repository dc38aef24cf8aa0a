"""Profiler sections: ``global_profiler`` and the per-role ``profiler`` blocks (verl's keys and defaults).

We do not run a profiler; these sections exist so that a verl launch command that sets them is
accepted and typed (a typo is an unknown-key error, not a silently ignored setting), and so that
a trainer built on us can read them. A role's block follows ``global_profiler`` for the tool and
the save path, as verl's does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from verl_config.errors import ConfigValueError
from verl_config.validation import check_choice

__all__ = ["PROFILER_TOOLS", "GlobalProfilerConfig", "ProfilerConfig", "role_tool_config"]

# The profilers verl drives (null = off).
PROFILER_TOOLS = (None, "nsys", "npu", "torch", "torch_memory")


def role_tool_config() -> dict[str, Any]:
    """A role's ``tool_config``: per-tool options, nsys / torch_memory following the global ones."""
    return {
        "nsys": {"discrete": "${global_profiler.global_tool_config.nsys.discrete}"},
        "npu": {"contents": [], "level": "level0", "analysis": True, "discrete": False},
        "torch": {"contents": [], "discrete": False},
        "torch_memory": {
            "trace_alloc_max_entries": "${global_profiler.global_tool_config.torch_memory.trace_alloc_max_entries}",
            "stack_depth": "${global_profiler.global_tool_config.torch_memory.stack_depth}",
        },
    }


def _global_tool_config() -> dict[str, Any]:
    nsight = {"trace": "cuda,nvtx,cublas,ucx", "cuda-memory-usage": "true", "cuda-graph-trace": "graph"}
    return {
        "nsys": {
            "discrete": False,
            "controller_nsight_options": dict(nsight),
            "worker_nsight_options": {
                **nsight,
                "capture-range": "cudaProfilerApi",
                "capture-range-end": None,
                "kill": "none",
            },
        },
        "torch_memory": {
            "trace_alloc_max_entries": 100000,
            "stack_depth": 32,
            "context": "all",
            "stacks": "all",
            "kw_args": {},
        },
    }


@dataclass
class ProfilerConfig:
    """A role's profiler block (``actor_rollout_ref.actor.profiler``, ``critic.profiler`` ...)."""

    tool: str | None = "${global_profiler.tool}"
    enable: bool = False
    all_ranks: bool = False
    ranks: list[int] = field(default_factory=list)
    save_path: str | None = "${global_profiler.save_path}"
    tool_config: dict[str, Any] | None = field(default_factory=role_tool_config)

    def __post_init__(self) -> None:
        check_choice("tool", self.tool, PROFILER_TOOLS)
        if isinstance(self.ranks, list) and any(r < 0 for r in self.ranks):
            raise ConfigValueError("ranks", f"must be global ranks (>= 0); got {list(self.ranks)}")


@dataclass
class GlobalProfilerConfig:
    """``global_profiler``: which tool, which steps, where to write."""

    tool: str | None = None
    steps: list[int] | None = None
    profile_continuous_steps: bool = False
    save_path: str | None = "outputs/profile"
    global_tool_config: dict[str, Any] = field(default_factory=_global_tool_config)

    def __post_init__(self) -> None:
        check_choice("tool", self.tool, PROFILER_TOOLS)
