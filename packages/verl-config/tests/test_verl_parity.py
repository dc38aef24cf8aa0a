"""Our schema against verl's own configuration, key by key, for both engines (verl_config.verl_parity).

The reference is verl's generated full configs and its config dataclasses of the pinned release
(data/verl_reference/, refreshed by scripts/refresh_verl_reference.py). Every verl key must exist here
with the same default and a type that admits verl's values; every difference must be a row of
INTENTIONAL_DIFFERENCES, and every row must still be needed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from verl_config import default_tree
from verl_config.verl_parity import (
    INTENTIONAL_DIFFERENCES,
    VERL_REFERENCE,
    Mismatch,
    annotation_kinds,
    compare_with_verl,
    differences_markdown,
    normalize_default,
    unexplained,
)

DATA = Path(__file__).resolve().parent / "data" / "verl_reference"
YAML_OF = {"fsdp": "_generated_ppo_trainer.yaml", "megatron": "_generated_ppo_megatron_trainer.yaml"}
README = Path(__file__).resolve().parents[1] / "README.md"


def _reference(engine: str) -> tuple[dict, dict, dict]:
    name = YAML_OF[engine]
    verl_tree = yaml.safe_load((DATA / name).read_text())
    targets = json.loads((DATA / "targets.json").read_text())[name]
    classes = json.loads((DATA / "dataclasses.json").read_text())
    return verl_tree, targets, classes


def _mismatches(engine: str, ours=None) -> list[Mismatch]:
    verl_tree, targets, classes = _reference(engine)
    return compare_with_verl(
        engine=engine,
        verl_tree=verl_tree,
        ours=default_tree(engine) if ours is None else ours,
        targets=targets,
        classes=classes,
    )


def test_reference_release_is_the_stored_one() -> None:
    stored = json.loads((DATA / "REFERENCE.json").read_text())
    assert stored["release"] == VERL_REFERENCE
    assert stored["wheel"] == f"verl-{VERL_REFERENCE}-py3-none-any.whl"


@pytest.mark.parametrize("engine", ["fsdp", "megatron"])
def test_every_verl_key_default_and_type_matches_or_is_documented(engine: str) -> None:
    left = unexplained(_mismatches(engine))
    assert not left, "differences from verl not in INTENTIONAL_DIFFERENCES:\n" + "\n".join(map(str, left))


def test_every_documented_difference_is_still_needed() -> None:
    found = [m for engine in YAML_OF for m in _mismatches(engine)]
    for row in INTENTIONAL_DIFFERENCES:
        assert row.reason.strip(), row
        for engine in row.engines:
            for pattern in row.keys:
                single = type(row)(keys=(pattern,), kind=row.kind, reason=row.reason, engines=(engine,))
                assert any(single.covers(m) for m in found), f"stale row: {pattern} ({row.kind}, {engine})"


def test_no_default_differs_from_verl() -> None:
    """Issue 33: every default equals verl's; only keys verl lacks may be documented differences."""
    assert not [row for row in INTENTIONAL_DIFFERENCES if row.kind == "default"]
    assert not [m for engine in YAML_OF for m in _mismatches(engine) if m.kind == "default"]


def test_the_differences_table_is_short_and_in_the_readme() -> None:
    assert len(INTENTIONAL_DIFFERENCES) <= 10
    text = README.read_text()
    start = text.index("| key(s) | engines | kind | why |")
    table = text[start : text.index("\n\n", start) + 1]
    assert table == differences_markdown(), "README's differences table is not differences_markdown()"


def test_comparison_catches_a_missing_key_a_changed_default_and_an_extra_key() -> None:
    tree = OmegaConf.create(OmegaConf.to_container(default_tree("megatron"), resolve=False))
    del tree.actor_rollout_ref.actor.policy_loss["loss_mode"]
    tree.actor_rollout_ref.rollout.n = 4
    tree.critic.megatron.made_up_knob = 1
    got = {(m.kind, m.key) for m in _mismatches("megatron", tree)}
    assert ("missing", "actor_rollout_ref.actor.policy_loss.loss_mode") in got
    assert ("default", "actor_rollout_ref.rollout.n") in got
    assert ("ours_only", "critic.megatron.made_up_knob") in got
    assert all(m.kind == "missing" for m in unexplained([Mismatch("missing", "megatron", "model_engine")]))


@pytest.mark.parametrize(
    ("annotation", "kinds"),
    [
        ("Optional[int]", {"int", "none"}),
        ("int | None", {"int", "none"}),
        ("Optional[str | float]", {"str", "float", "none"}),
        ("tuple[float, float]", {"list"}),
        ("list[str]", {"list"}),
        ("dict[str, Any]", {"dict"}),
        ("Optional[ProfilerConfig]", {"dict", "none"}),
        ("Any", None),
        ("Optional[Any]", None),
    ],
)
def test_annotation_kinds(annotation: str, kinds: set[str] | None) -> None:
    assert annotation_kinds(annotation) == (None if kinds is None else frozenset(kinds))


def test_interpolations_are_compared_by_the_key_they_follow() -> None:
    key = "critic.forward_max_token_len_per_gpu"
    assert normalize_default("${oc.select:a.b,1}", key=key) == "${a.b}"
    assert normalize_default("${oc.select:a.b, null}", key=key) == "${a.b}"
    assert normalize_default("${oc.select:a.b,{}}", key=key) == "${a.b}"
    assert (
        normalize_default("${.ppo_max_token_len_per_gpu}", key=key) == "${critic.ppo_max_token_len_per_gpu}"
    )
    assert normalize_default("${..x}", key="a.b.c") == "${a.x}"
    assert normalize_default((0.9, 0.999), key=key) == [0.9, 0.999]
