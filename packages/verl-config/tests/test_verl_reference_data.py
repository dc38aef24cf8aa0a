"""verl's configuration facts stored as test data (data/verl_reference/) and the script that refreshes them.

The data come from scripts/refresh_verl_reference.py run on the verl commit named in REFERENCE.json.
These tests need neither verl nor torch. That the stored data are what the script makes from the pinned
commit is checked with `scripts/refresh_verl_reference.py --verl <checkout> --check` (no verl checkout in CI).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
import sys
import textwrap
from pathlib import Path
from types import ModuleType

import pytest

REPO_ROOT = Path(__file__).resolve().parents[3]
SCRIPT = REPO_ROOT / "scripts" / "refresh_verl_reference.py"
DATA = Path(__file__).resolve().parent / "data" / "verl_reference"
YAMLS = ("_generated_ppo_trainer.yaml", "_generated_ppo_megatron_trainer.yaml")
STORED = (*YAMLS, "dataclasses.json", "targets.json", "REFERENCE.json")

# Classes verl-config mirrors; each must be in the stored data.
EXPECTED_CLASSES = (
    "McoreEngineConfig",
    "McoreActorConfig",
    "ActorConfig",
    "PolicyLossConfig",
    "RolloutConfig",
    "MtpConfig",
    "HFModelConfig",
    "McoreOptimizerConfig",
    "CheckpointConfig",
    "ProfilerConfig",
    "AlgoConfig",
    "RewardModelConfig",
)

# _target_ strings in verl's generated yamls that name no config dataclass, and why.
UNRESOLVABLE_TARGETS = {
    "verl.workers.config.MegatronEngineConfig": (
        "reward_model.megatron of the megatron yaml (from verl's reward_model/megatron_reward_model.yaml); "
        "verl has no such class, its Megatron engine config is McoreEngineConfig"
    ),
}


@pytest.fixture(scope="module")
def refresh() -> ModuleType:
    """The refresh script as a module (it lives outside any package)."""
    spec = importlib.util.spec_from_file_location("refresh_verl_reference", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _json(name: str) -> dict:
    return json.loads((DATA / name).read_text(encoding="utf-8"))


# ---------------------------------------------------------------------------------------------
# The stored data
# ---------------------------------------------------------------------------------------------


def test_stored_files_exist() -> None:
    missing = [name for name in STORED if not (DATA / name).is_file()]
    assert missing == [], f"run scripts/refresh_verl_reference.py; missing {missing}"


def test_reference_names_a_commit_and_the_stored_files_hashes() -> None:
    ref = _json("REFERENCE.json")
    assert ref["repository"] == "https://github.com/volcengine/verl"
    assert re.fullmatch(r"[0-9a-f]{40}", ref["commit"])
    assert set(ref["files"]) == set(STORED) - {"REFERENCE.json"}
    for name, digest in ref["files"].items():
        assert hashlib.sha256((DATA / name).read_bytes()).hexdigest() == digest, name


def test_stored_json_is_in_its_canonical_spelling(refresh: ModuleType) -> None:
    for name in ("dataclasses.json", "targets.json", "REFERENCE.json"):
        text = (DATA / name).read_text(encoding="utf-8")
        assert text == refresh.dump_json(json.loads(text)), name


def test_expected_classes_are_stored_with_their_fields() -> None:
    classes = _json("dataclasses.json")
    missing = [name for name in EXPECTED_CLASSES if name not in classes]
    assert missing == []
    for name in EXPECTED_CLASSES:
        entry = classes[name]
        assert entry["fields"], name
        assert entry["field_order"] == list(dict.fromkeys(entry["field_order"])), name
        assert set(entry["field_order"]) == set(entry["fields"]), name
        assert set(entry["own_fields"]) <= set(entry["fields"]), name


def test_inherited_fields_follow_dataclass_order() -> None:
    classes = _json("dataclasses.json")
    engine = classes["McoreEngineConfig"]
    assert engine["dataclass_bases"] == ["EngineConfig"]
    assert engine["mro"] == ["McoreEngineConfig", "EngineConfig", "BaseConfig"]
    order = engine["field_order"]
    # BaseConfig's _target_ first, then EngineConfig's fields, then McoreEngineConfig's new ones.
    assert order[0] == "_target_" and engine["fields"]["_target_"]["private"] is True
    assert order.index("param_offload") < order.index("tensor_model_parallel_size")
    # strategy is re-declared by the subclass: it keeps EngineConfig's position, takes the new default.
    assert order.index("strategy") < order.index("seed")
    strategy = engine["fields"]["strategy"]
    assert strategy["default"] == "megatron"
    assert strategy["defined_in"] == "verl.workers.config.engine.McoreEngineConfig"
    assert engine["fields"]["tensor_model_parallel_size"]["default"] == 1
    assert engine["fields"]["override_transformer_config"]["default_factory"] == "dict"
    actor = classes["McoreActorConfig"]["fields"]
    assert actor["strategy"]["default"] == "megatron"
    assert classes["ActorConfig"]["fields"]["strategy"]["omegaconf_missing"] is True
    assert actor["megatron"]["annotation"] == "McoreEngineConfig"


def test_every_target_resolves_to_a_stored_class() -> None:
    classes = _json("dataclasses.json")
    targets = _json("targets.json")
    assert set(targets) == set(YAMLS)
    unresolved = set()
    for yaml_name, sections in targets.items():
        assert sections, yaml_name
        for path, entry in sections.items():
            if entry["class_key"] is None:
                assert entry["target"] in UNRESOLVABLE_TARGETS, f"{yaml_name}: {path} -> {entry['target']}"
                unresolved.add(entry["target"])
            else:
                assert entry["class_key"] in classes, f"{yaml_name}: {path}"
                assert entry["target"].rsplit(".", 1)[-1] == classes[entry["class_key"]]["name"]
    stale = set(UNRESOLVABLE_TARGETS) - unresolved
    assert stale == set(), f"these targets resolve now; drop them from UNRESOLVABLE_TARGETS: {stale}"


# ---------------------------------------------------------------------------------------------
# The extraction, on a tiny synthetic checkout
# ---------------------------------------------------------------------------------------------

BASE_PY = '''
from dataclasses import dataclass, field
from typing import ClassVar, Optional

from omegaconf import MISSING


@dataclass
class Base:
    """Root of the synthetic configs."""

    _mutable_fields = {"size"}
    registry: ClassVar[dict] = {}
    _target_: str = ""
    name: str = MISSING
    size: int = -1
    tags: list[str] = field(default_factory=list)


class NotADataclass:
    skipped: int = 0
'''

CHILD_PY = """
import dataclasses
from dataclasses import field
from typing import Optional

from .base import Base


@dataclasses.dataclass(frozen=True)
class Child(Base):
    size: int = 8
    path: Optional[str] = None
    shape: tuple = (1, -2)
    scale: float = field(default=2.5)
    options: dict = dataclasses.field(default_factory=lambda: {"a": 1})
    computed: int = 2**10
    name = "shadow"


@dataclasses.dataclass
class Pair:
    left: int
    right: "Optional[int]" = None


@dataclasses.dataclass
class Shared(Base):
    extra: bool = True
"""

OTHER_PY = """
from dataclasses import dataclass


@dataclass
class Shared:
    other: float = 1e-3
"""

YAML = """\
actor:
  _target_: verl.workers.config.Child
  size: 3
  unknown_key: 1
  nested:
    - _target_: verl.trainer.config.Shared
      other: 0.5
other:
  _target_: verl.workers.config.NoSuchConfig
"""


def _synthetic_checkout(root: Path) -> Path:
    files = {
        "verl/workers/config/__init__.py": "",
        "verl/workers/config/base.py": BASE_PY,
        "verl/workers/config/child.py": CHILD_PY,
        "verl/trainer/config/other.py": OTHER_PY,
        "verl/trainer/config/_generated_ppo_trainer.yaml": YAML,
        "verl/trainer/config/_generated_ppo_megatron_trainer.yaml": YAML.replace("size: 3", "size: 4"),
    }
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip("\n"), encoding="utf-8")
    return root


def test_extraction_of_synthetic_dataclasses(refresh: ModuleType, tmp_path: Path) -> None:
    classes = refresh.extract_dataclasses(verl_root=_synthetic_checkout(tmp_path))
    assert sorted(classes) == [
        "Base",
        "Child",
        "Pair",
        "verl.trainer.config.other.Shared",
        "verl.workers.config.child.Shared",
    ]
    child = classes["Child"]
    assert child["module"] == "verl.workers.config.child"
    assert child["bases"] == ["Base"] and child["dataclass_bases"] == ["Base"]
    assert child["mro"] == ["Child", "Base"]
    assert child["own_fields"] == ["size", "path", "shape", "scale", "options", "computed"]
    # Base's fields first (size overridden in place), ClassVar and plain assignments are no fields.
    assert child["field_order"] == [
        "_target_",
        "name",
        "size",
        "tags",
        "path",
        "shape",
        "scale",
        "options",
        "computed",
    ]
    assert child["shadowed_by_plain_assignment"] == ["name"]
    fields = json.loads(refresh.dump_json(child["fields"]))

    def spec(
        annotation, default, source, factory, *, owner="Child", required=False, missing=False, private=False
    ):
        return {
            "annotation": annotation,
            "default": default,
            "default_source": source,
            "default_factory": factory,
            "required": required,
            "init": True,
            "private": private,
            "omegaconf_missing": missing,
            "defined_in": f"verl.workers.config.{'child' if owner == 'Child' else 'base'}.{owner}",
        }

    assert fields == {
        "_target_": spec("str", "", '""', None, owner="Base", private=True),
        "name": spec("str", None, "MISSING", None, owner="Base", missing=True),
        "size": spec("int", 8, "8", None),
        "tags": spec("list[str]", None, None, "list", owner="Base"),
        "path": spec("Optional[str]", None, "None", None),
        "shape": spec("tuple", [1, -2], "(1, -2)", None),
        "scale": spec("float", 2.5, "2.5", None),
        "options": spec("dict", None, None, 'lambda: {"a": 1}'),
        "computed": spec("int", None, "2**10", None),
    }
    assert classes["Base"]["fields"]["size"]["default"] == -1
    pair = classes["Pair"]["fields"]
    assert pair["left"]["required"] is True and pair["left"]["default_source"] is None
    assert pair["right"]["annotation"] == '"Optional[int]"' and pair["right"]["required"] is False
    shared = classes["verl.workers.config.child.Shared"]
    assert shared["name"] == "Shared" and shared["shares_name_with"] == ["verl.trainer.config.other.Shared"]
    assert shared["field_order"] == ["_target_", "name", "size", "tags", "extra"]
    assert classes["verl.trainer.config.other.Shared"]["fields"]["other"]["default"] == 0.001


def test_targets_of_a_synthetic_yaml(refresh: ModuleType, tmp_path: Path) -> None:
    classes = refresh.extract_dataclasses(verl_root=_synthetic_checkout(tmp_path))
    targets = refresh.extract_targets(yaml_texts={"x.yaml": YAML}, dataclasses=classes)
    sections = targets["x.yaml"]
    assert sorted(sections) == ["actor", "actor.nested.0", "other"]
    actor = sections["actor"]
    assert actor["target"] == "verl.workers.config.Child" and actor["class_key"] == "Child"
    assert actor["yaml_only_keys"] == ["nested", "unknown_key"]
    assert actor["dataclass_only_fields"] == ["computed", "name", "options", "path", "scale", "shape", "tags"]
    # A shared name is told apart by the module the target names.
    assert sections["actor.nested.0"]["class_key"] == "verl.trainer.config.other.Shared"
    assert sections["other"] == {"target": "verl.workers.config.NoSuchConfig", "class_key": None}


def test_refresh_is_deterministic_and_check_finds_drift(refresh: ModuleType, tmp_path: Path, capsys) -> None:
    checkout = _synthetic_checkout(tmp_path / "verl_checkout")
    out = tmp_path / "out"
    commit = "0123456789abcdef0123456789abcdef01234567"
    args = ["--verl", str(checkout), "--out", str(out)]
    assert refresh.main([*args, "--commit", commit]) == 0
    first = {p.name: p.read_bytes() for p in out.iterdir()}
    assert sorted(first) == sorted(STORED)
    for name in YAMLS:
        assert first[name] == (checkout / "verl/trainer/config" / name).read_bytes()
    ref = json.loads(first["REFERENCE.json"])
    assert ref["commit"] == commit and ref["commit_date"] is None
    assert all(data.endswith(b"\n") for data in first.values())

    assert refresh.main([*args, "--commit", commit]) == 0
    assert {p.name: p.read_bytes() for p in out.iterdir()} == first
    # Without --commit, a plain work tree is checked against the commit REFERENCE.json names.
    assert refresh.main([*args, "--check"]) == 0
    capsys.readouterr()

    (checkout / "verl/workers/config/base.py").write_text(
        textwrap.dedent(BASE_PY).replace("size: int = -1", "size: int = -7"), encoding="utf-8"
    )
    assert refresh.main([*args, "--check"]) == 1
    diff = capsys.readouterr().out
    assert "--- stored/dataclasses.json" in diff
    assert any(line.startswith("+") and '"default": -7' in line for line in diff.splitlines())
    assert {p.name: p.read_bytes() for p in out.iterdir()} == first  # --check writes nothing


def test_refresh_needs_a_commit_for_a_plain_work_tree(refresh: ModuleType, tmp_path: Path) -> None:
    checkout = _synthetic_checkout(tmp_path / "verl_checkout")
    with pytest.raises(SystemExit, match="pass --commit"):
        refresh.main(["--verl", str(checkout), "--out", str(tmp_path / "out")])
    with pytest.raises(SystemExit, match="40-digit"):
        refresh.main(["--verl", str(checkout), "--out", str(tmp_path / "out"), "--commit", "abc123"])
