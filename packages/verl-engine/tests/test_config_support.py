"""Every key of verl 0.9.1's engine sections is honoured (a test shows it), refused at build, or not an engine's.

Walks the loaded schema under actor_rollout_ref.{actor,ref,model} and critic (critic.model included) against
verl_engine.config_support.RULES; docs/refused-keys.md is the table rendered by scripts/refused_keys_doc.py.
"""

from __future__ import annotations

import ast
import fnmatch
import importlib.util
import re
import warnings
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch

from verl_config import load_config
from verl_engine import rl_engine_from_config
from verl_engine.config_support import (
    EVIDENCE_TODO,
    ROLE_SECTIONS,
    RULES,
    SECTIONS,
    Kind,
    Rule,
    flatten_section,
    rule_for,
)
from verl_engine.refusals import check_supported

ROOT = Path(__file__).resolve().parents[3]
BASE = [
    "model_engine=megatron",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1",
    "critic.ppo_micro_batch_size_per_gpu=1",
    "critic.model.path=${actor_rollout_ref.model.path}",  # GAE: the critic needs its model
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=1",
]


@cache
def _keys() -> tuple[tuple[str, str], ...]:
    cfg = load_config(overrides=BASE)
    return tuple((section, key) for section in SECTIONS for key, _ in flatten_section(cfg, section))


def test_every_key_matches_exactly_one_rule_and_every_rule_matches_a_key() -> None:
    keys = _keys()
    assert len(keys) > 400  # the walk saw the whole schema
    unclassified = []
    for section, key in keys:
        try:
            rule_for(key, section)
        except KeyError as e:
            unclassified.append(str(e))
    assert not unclassified, "\n".join(unclassified)
    stale = [
        f"{section}: {pattern}"
        for rule in RULES
        for section in rule.sections
        for pattern in rule.keys
        if not any(s == section and fnmatch.fnmatchcase(k, pattern) for s, k in keys)
    ]
    assert not stale, f"rules that match no key of verl 0.9.1's schema: {stale}"


@cache
def _test_functions(path: Path) -> frozenset[str]:
    tree = ast.parse(path.read_text())
    return frozenset(n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef))


def _evidence_problem(node_id: str) -> str | None:
    file, _, name = node_id.partition("::")
    path = ROOT / file
    if not path.is_file():
        return f"{node_id}: no file {file}"
    if name.split("[")[0] not in _test_functions(path):
        return f"{node_id}: {file} defines no {name}"
    return None


def test_every_honoured_rule_names_existing_tests_or_is_listed_as_todo() -> None:
    problems = []
    todo_seen = set()
    for rule in RULES:
        for node_id in rule.evidence:
            problem = _evidence_problem(node_id)
            if problem:
                problems.append(problem)
        if rule.kind is Kind.HONOURED and not rule.evidence:
            listed = {(s, k) for s in rule.sections for k in rule.keys}
            missing = listed - EVIDENCE_TODO
            problems += [
                f"{s}.{k}: honoured without evidence and not in EVIDENCE_TODO" for s, k in sorted(missing)
            ]
            todo_seen |= listed
        if rule.kind is Kind.REFUSED:
            assert rule.example and rule.reason and rule.supported, rule.keys
        if rule.kind is Kind.NOT_ENGINE:
            assert rule.reason, rule.keys
    assert not problems, "\n".join(problems)
    assert todo_seen == EVIDENCE_TODO, f"stale EVIDENCE_TODO entries: {sorted(EVIDENCE_TODO - todo_seen)}"
    if EVIDENCE_TODO:
        warnings.warn(
            f"{len(EVIDENCE_TODO)} honoured keys still lack a test of their effect: "
            + ", ".join(f"{s}.{k}" for s, k in sorted(EVIDENCE_TODO)),
            stacklevel=1,
        )


REFUSALS = [
    pytest.param(section, rule, id=f"{section}:{rule.keys[0]}")
    for rule in RULES
    if rule.kind is Kind.REFUSED
    for section in rule.sections
]


@pytest.mark.parametrize(("section", "rule"), REFUSALS)
def test_a_refused_setting_loads_and_is_refused_at_build(section: str, rule: Rule) -> None:
    overrides = [f"{'+' if o.startswith('+') else ''}{section}.{o.lstrip('+')}" for o in rule.example]
    cfg = load_config(overrides=[*BASE, *overrides])  # valid verl: the config loads
    refused = _leaf(section, rule.example[0].lstrip("+").split("=")[0])
    role = _role(section)
    with pytest.raises(ValueError, match=rf"cannot build the {role}: .*{re.escape(refused)}="):
        # model.path is verl's default (a hub name): the refusal comes first, no model is looked up or built
        rl_engine_from_config(cfg, role=role, device=torch.device("cpu"))


def _leaf(section: str, key: str) -> str:
    """The full name of the schema key an override sets (a dict leaf for ``fused_kernel_options.impl_backend``)."""
    leaves = [k for s, k in _keys() if s == section and (key == k or key.startswith(k + "."))]
    assert len(leaves) == 1, (section, key, leaves)
    return f"{section}.{leaves[0]}"


def _role(section: str) -> str:
    return next(role for role, sections in ROLE_SECTIONS.items() if section in sections)


def test_the_default_config_passes_the_check_for_every_role() -> None:
    cfg = load_config(overrides=BASE)
    for role in ROLE_SECTIONS:
        check_supported(cfg, role=role)


def _doc_script() -> Any:
    spec = importlib.util.spec_from_file_location(
        "refused_keys_doc", ROOT / "scripts" / "refused_keys_doc.py"
    )
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_committed_refused_keys_page_is_the_rendered_table() -> None:
    page = ROOT / "docs" / "refused-keys.md"
    assert page.read_text() == _doc_script().render(), "run: python scripts/refused_keys_doc.py"
