"""verl's own launch commands (data/verl_launch_commands.yaml), loaded through verl_config.

Each command must load with the values verl itself runs with (its ``expect``); a command that fails to load
names, in its error message, what the loader does not accept yet. The data file says how the commands were copied.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from omegaconf import OmegaConf

from verl_config import load_config

DATA = Path(__file__).resolve().parent / "data" / "verl_launch_commands.yaml"


@dataclass(frozen=True)
class LaunchCommand:
    """One verl launch command: where it is written, its entry config and its overrides."""

    name: str
    source: str  # "<path in verl>:<line of `python3 -m verl.trainer.main_ppo`> @ <commit>"
    entry: str  # "ppo_megatron_trainer" or "ppo_trainer"
    overrides: tuple[str, ...]
    expect: dict[str, object] = field(default_factory=dict)


def _read_commands() -> tuple[str, list[LaunchCommand]]:
    data = yaml.safe_load(DATA.read_text())
    commands = [
        LaunchCommand(**{**entry, "overrides": tuple(entry["overrides"])}) for entry in data["commands"]
    ]
    return str(data["verl_commit"]), commands


VERL_COMMIT, COMMANDS = _read_commands()

_MISSING = object()


def lookup(cfg: Any, dotted: str) -> Any:
    """The value at ``dotted`` in a loaded config: attributes of dataclasses, keys of dicts."""
    node = cfg
    parts = dotted.split(".")
    for depth, part in enumerate(parts):
        if isinstance(node, Mapping):
            node = node.get(part, _MISSING)
        else:
            node = getattr(node, part, _MISSING)
        if node is _MISSING:
            parent = ".".join(parts[:depth]) or "<root>"
            raise KeyError(f"no {part!r} under {parent}")
    return node


def plain(value: Any) -> Any:
    """``value`` with OmegaConf containers and tuples turned into plain dicts and lists, for comparison."""
    if OmegaConf.is_config(value):
        value = OmegaConf.to_container(value, resolve=True)
    if isinstance(value, Mapping):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


@contextlib.contextmanager
def entry_warnings(entry: str) -> Iterator[None]:
    """``ppo_megatron_trainer`` is a deprecated alias: it must warn (FutureWarning), which is not a failure."""
    if entry == "ppo_megatron_trainer":
        with pytest.warns(FutureWarning, match="ppo_megatron_trainer"):
            yield
    else:
        yield


def load_command(cmd: LaunchCommand) -> Any:
    with entry_warnings(cmd.entry):
        return load_config(cmd.entry, overrides=list(cmd.overrides))


@pytest.mark.parametrize("cmd", COMMANDS, ids=lambda c: c.name)
def test_verl_launch_command_loads(cmd: LaunchCommand) -> None:
    cfg = load_command(cmd)
    problems = []
    for key, want in cmd.expect.items():
        try:
            got = plain(lookup(cfg, key))
        except KeyError as err:
            problems.append(f"{key}: missing after loading ({err.args[0]})")
            continue
        if got != want:
            problems.append(f"{key}: got {got!r}, verl runs with {want!r}")
    assert not problems, f"{cmd.name} ({cmd.source}):\n  " + "\n  ".join(problems)


# --- what the collection covers ----------------------------------------------------------------------------


def split_override(text: str) -> tuple[str, str, str]:
    """``"+a.b=1"`` -> ``("+", "a.b", "1")``; a delete without value gives an empty value."""
    prefix = text[: len(text) - len(text.lstrip("+~"))]
    key, _, value = text[len(prefix) :].partition("=")
    return prefix, key, value


def parsed(cmd: LaunchCommand) -> list[tuple[str, str, str]]:
    return [split_override(o) for o in cmd.overrides]


def _int(value: str) -> int:
    try:
        return int(value)
    except ValueError:
        return 0


def is_megatron(cmd: LaunchCommand) -> bool:
    keys = {(k, v) for _, k, v in parsed(cmd)}
    return cmd.entry == "ppo_megatron_trainer" or ("model_engine", "megatron") in keys


def is_fsdp(cmd: LaunchCommand) -> bool:
    return cmd.entry == "ppo_trainer" and not is_megatron(cmd)


def _any(cmd: LaunchCommand, test: Callable[[str, str, str], bool]) -> bool:
    return any(test(p, k, v) for p, k, v in parsed(cmd))


def _size_above_one(name: str) -> Callable[[LaunchCommand], bool]:
    return lambda c: (
        is_megatron(c) and _any(c, lambda p, k, v: k.endswith(f".megatron.{name}") and _int(v) > 1)
    )


def _all_true(c: LaunchCommand, *suffixes: str) -> bool:
    return all(_any(c, lambda p, k, v, s=s: k.endswith(s) and v == "True") for s in suffixes)


FEATURES: dict[str, Callable[[LaunchCommand], bool]] = {
    "MoE expert parallel (expert_model_parallel_size > 1)": _size_above_one("expert_model_parallel_size"),
    "pipeline parallel > 1": _size_above_one("pipeline_model_parallel_size"),
    "virtual pipeline parallel > 1": _size_above_one("virtual_pipeline_model_parallel_size"),
    "context parallel > 1": _size_above_one("context_parallel_size"),
    "dist checkpointing (use_dist_checkpointing=True + dist_checkpointing_path)": lambda c: (
        _all_true(c, ".megatron.use_dist_checkpointing")
        and _any(c, lambda p, k, v: k.endswith(".megatron.dist_checkpointing_path"))
    ),
    "policy_loss.loss_mode (GSPO)": lambda c: _any(
        c, lambda p, k, v: k == "actor_rollout_ref.actor.policy_loss.loss_mode" and v == "gspo"
    ),
    "DAPO-style clip_ratio_low/high + loss_agg_mode": lambda c: all(
        _any(c, lambda p, k, v, s=s: k == f"actor_rollout_ref.actor.{s}")
        for s in ("clip_ratio_low", "clip_ratio_high", "loss_agg_mode")
    ),
    "MTP (actor_rollout_ref.model.mtp.*)": lambda c: _any(
        c, lambda p, k, v: k.startswith("actor_rollout_ref.model.mtp.")
    ),
    "LoRA on Megatron (lora.rank > 0)": lambda c: (
        is_megatron(c)
        and _any(c, lambda p, k, v: k.endswith((".model.lora.rank", ".model.lora_rank")) and _int(v) > 0)
    ),
    "+override_transformer_config.recompute_*": lambda c: _any(
        c, lambda p, k, v: p == "+" and ".megatron.override_transformer_config.recompute_" in k
    ),
    "+override_transformer_config.num_layers_in_first_pipeline_stage": lambda c: _any(
        c,
        lambda p, k, v: (
            p == "+" and k.endswith(".override_transformer_config.num_layers_in_first_pipeline_stage")
        ),
    ),
    "+rollout.engine_kwargs.*": lambda c: _any(
        c, lambda p, k, v: p == "+" and k.startswith("actor_rollout_ref.rollout.engine_kwargs.")
    ),
    "++ (set or add) on rollout": lambda c: _any(
        c, lambda p, k, v: p == "++" and k.startswith("actor_rollout_ref.rollout.")
    ),
    "megatron param + grad + optimizer offload": lambda c: _all_true(
        c,
        "actor.megatron.param_offload",
        "actor.megatron.grad_offload",
        "actor.megatron.optimizer_offload",
    ),
    "use_dynamic_bsz with ppo_max_token_len_per_gpu": lambda c: (
        _all_true(c, "actor.use_dynamic_bsz")
        and _any(c, lambda p, k, v: k == "actor_rollout_ref.actor.ppo_max_token_len_per_gpu")
    ),
    "trainer.logger as a plain string": lambda c: _any(
        c, lambda p, k, v: k == "trainer.logger" and not v.startswith("[")
    ),
    "trainer.logger as a list": lambda c: _any(
        c, lambda p, k, v: k == "trainer.logger" and v.startswith("[")
    ),
    "reward_model.* keys": lambda c: _any(c, lambda p, k, v: k.startswith("reward_model.")),
    # verl 0.9 moved custom_reward_function.* to reward.custom_reward_function.* (main_ppo reads only the latter)
    "reward.custom_reward_function.* keys": lambda c: _any(
        c, lambda p, k, v: k.startswith("reward.custom_reward_function.") and v != "null"
    ),
}


@pytest.mark.parametrize("feature", FEATURES)
def test_collection_covers(feature: str) -> None:
    covering = [c.name for c in COMMANDS if FEATURES[feature](c)]
    assert covering, f"no verl launch command in COMMANDS covers: {feature}"


def test_collection_has_fsdp_and_megatron_commands() -> None:
    assert len([c for c in COMMANDS if is_fsdp(c)]) >= 2
    assert len([c for c in COMMANDS if is_megatron(c)]) >= 10


def test_commands_are_well_formed() -> None:
    names = [c.name for c in COMMANDS]
    assert len(names) >= 12
    assert len(set(names)) == len(names), "command names must be unique (they are the test ids)"
    for cmd in COMMANDS:
        assert cmd.entry in ("ppo_trainer", "ppo_megatron_trainer"), cmd.name
        path, _, rest = cmd.source.partition(":")
        assert path.startswith(("examples/", "tests/", "docs/", "recipe/")), cmd.name
        assert rest.split(" @ ")[0].isdigit() and f"@ {VERL_COMMIT}" in rest, cmd.name
        assert cmd.overrides and cmd.expect, cmd.name
        for text in cmd.overrides:
            assert not text.startswith("--"), f"{cmd.name}: {text} (drop --config-path / --config-name)"
            assert "=" in text or text.startswith("~"), f"{cmd.name}: {text}"
