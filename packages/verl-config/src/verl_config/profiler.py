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

__all__ = [
    "PROFILER_TOOLS",
    "GlobalProfilerConfig",
    "ProfilerConfig",
    "follower_profiler",
    "role_tool_config",
]

# The profilers verl drives (null = off).
PROFILER_TOOLS = (None, "nsys", "npu", "torch", "torch_memory", "precision_debugger")
_GLOBAL_TOOLS = "global_profiler.global_tool_config"


def role_tool_config() -> dict[str, Any]:
    """A role's ``tool_config``: per-tool options, nsys / torch_memory following the global ones."""
    return {
        "nsys": {"discrete": "${global_profiler.global_tool_config.nsys.discrete}"},
        "npu": {"contents": [], "level": "level0", "analysis": True, "discrete": False},
        "torch": {
            "contents": [],
            "discrete": False,
            "schedule": {"skip_first": 0, "wait": 0, "warmup": 0, "active": 0, "repeat": 0},
        },
        "torch_memory": {
            key: f"${{{_GLOBAL_TOOLS}.torch_memory.{key}}}"
            for key in ("trace_alloc_max_entries", "stack_depth", "memory_snapshot_num_steps")
        },
        "precision_debugger": {
            "config_path": f"${{{_GLOBAL_TOOLS}.precision_debugger.config_path}}",
            "steps": None,
            "stages": f"${{{_GLOBAL_TOOLS}.precision_debugger.stages}}",
            "strict": f"${{{_GLOBAL_TOOLS}.precision_debugger.strict}}",
        },
    }


def follower_profiler(leader: str) -> ProfilerConfig:
    """A profiler block whose switches and tool options follow the block at ``leader`` (the rollout's follow
    the actor's in verl); the tool and the save path follow ``global_profiler`` as everywhere."""

    def follow(key: str) -> str:
        return f"${{{leader}.{key}}}"

    tools = f"{leader}.tool_config"
    tool_config = {
        "npu": {
            **{k: f"${{{tools}.npu.{k}}}" for k in ("contents", "level", "analysis", "discrete")},
            "profile_token_start": None,
            "profile_token_end": None,
        },
        "torch": {
            **{k: f"${{{tools}.torch.{k}}}" for k in ("contents", "discrete")},
            "profile_token_start": None,
            "profile_token_end": None,
        },
        "precision_debugger": {
            "config_path": f"${{{tools}.precision_debugger.config_path}}",
            "steps": None,
            "stages": f"${{{tools}.precision_debugger.stages}}",
            "strict": f"${{{tools}.precision_debugger.strict}}",
        },
    }
    keys = ("enable", "all_ranks", "ranks", "relocate_results", "finish_hook_cmd", "finish_hook_all_ranks")
    return ProfilerConfig(
        **{k: follow(k) for k in (*keys, "finish_hook_ranks")},  # type: ignore[arg-type]
        tool_config=tool_config,
    )


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
            "memory_snapshot_num_steps": 1,
            "context": "all",
            "stacks": "all",
            "kw_args": {},
        },
        "precision_debugger": {"config_path": None, "steps": None, "stages": None, "strict": False},
    }


@dataclass
class ProfilerConfig:
    """A role's profiler block (``actor_rollout_ref.actor.profiler``, ``critic.profiler`` ...)."""

    tool: str | None = "${global_profiler.tool}"
    enable: bool = False
    all_ranks: bool = False
    ranks: list[int] = field(default_factory=list)
    save_path: str | None = "${global_profiler.save_path}"
    relocate_results: bool = "${global_profiler.relocate_results}"  # type: ignore[assignment]
    finish_hook_cmd: str | None = "${global_profiler.finish_hook_cmd}"
    finish_hook_all_ranks: bool = "${global_profiler.finish_hook_all_ranks}"  # type: ignore[assignment]
    finish_hook_ranks: list[int] = "${global_profiler.finish_hook_ranks}"  # type: ignore[assignment]
    tool_config: dict[str, Any] | None = field(default_factory=role_tool_config)

    def __post_init__(self) -> None:
        check_choice("tool", self.tool, PROFILER_TOOLS)
        for key in ("ranks", "finish_hook_ranks"):
            value = getattr(self, key)
            if isinstance(value, list) and any(r < 0 for r in value):
                raise ConfigValueError(key, f"must be global ranks (>= 0); got {list(value)}")


@dataclass
class GlobalProfilerConfig:
    """``global_profiler``: which tool, which steps, where to write."""

    tool: str | None = None
    steps: list[int] | None = None
    profile_continuous_steps: bool = False
    save_path: str | None = "outputs/profile"
    relocate_results: bool = False
    finish_hook_cmd: str | None = None
    finish_hook_all_ranks: bool = False
    finish_hook_ranks: list[int] = field(default_factory=list)
    global_tool_config: dict[str, Any] = field(default_factory=_global_tool_config)

    def __post_init__(self) -> None:
        check_choice("tool", self.tool, PROFILER_TOOLS)
        if any(r < 0 for r in self.finish_hook_ranks):
            raise ConfigValueError(
                "finish_hook_ranks", f"must be global ranks (>= 0); got {list(self.finish_hook_ranks)}"
            )
