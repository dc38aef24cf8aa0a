"""verl's configuration facts stored as test data (data/verl_reference/) and the script that refreshes them.

The data come from scripts/refresh_verl_reference.py run on the verl release named in REFERENCE.json.
These tests need neither verl nor torch. That the stored data are what the script makes from the pinned
release's wheel is checked with `scripts/refresh_verl_reference.py --verl-version <release> --check` (it
downloads the wheel from the package index, which CI does not reach).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
import sys
import textwrap
import zipfile
from pathlib import Path
from types import ModuleType

import pytest

REPO_ROOT = Path(__file__).resolve().parents[3]
SCRIPT = REPO_ROOT / "scripts" / "refresh_verl_reference.py"
DATA = Path(__file__).resolve().parent / "data" / "verl_reference"
YAMLS = ("_generated_ppo_trainer.yaml", "_generated_ppo_megatron_trainer.yaml")
STORED = (*YAMLS, "dataclasses.json", "targets.json", "registries.json", "REFERENCE.json")

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
UNRESOLVABLE_TARGETS: dict[str, str] = {}


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


def test_reference_names_a_release_wheel_and_the_stored_files_hashes() -> None:
    ref = _json("REFERENCE.json")
    assert ref["repository"] == "https://github.com/volcengine/verl"
    assert "commit" not in ref
    assert re.fullmatch(r"[0-9]+(\.[0-9]+)+", ref["release"])
    assert ref["wheel"] == f"verl-{ref['release']}-py3-none-any.whl"
    assert re.fullmatch(r"[0-9a-f]{64}", ref["wheel_sha256"])
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


CORE_ALGOS_PY = """
class AdvantageEstimator(str, Enum):
    GAE = "gae"
    ONLY_IN_ENUM = "only_in_enum"


@register_adv_est(AdvantageEstimator.GAE)
def gae(): ...


@register_adv_est("by_name")
def by_name(): ...


@register_policy_loss("vanilla")
def vanilla(): ...


@other_decorator("not_a_loss")
def other(): ...
"""


def _synthetic_checkout(root: Path) -> Path:
    files = {
        "verl/trainer/ppo/core_algos.py": CORE_ALGOS_PY,
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


def test_extraction_of_registries(refresh: ModuleType, tmp_path: Path) -> None:
    found = refresh.extract_registries(verl_root=_synthetic_checkout(tmp_path))
    assert found == {"policy_losses": ["vanilla"], "advantage_estimators": ["gae", "by_name", "only_in_enum"]}


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


def _synthetic_wheel(folder: Path, *, version: str, checkout: Path) -> Path:
    """A wheel of the synthetic checkout's verl/ tree (with the dist-info a wheel carries)."""
    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / f"verl-{version}-py3-none-any.whl"
    info = f"verl-{version}.dist-info"
    with zipfile.ZipFile(wheel, "w") as zf:
        for path in sorted((checkout / "verl").rglob("*")):
            if path.is_file():
                zf.write(path, path.relative_to(checkout).as_posix())
        zf.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: verl\nVersion: {version}\n")
        zf.writestr(
            f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        zf.writestr(f"{info}/RECORD", "")
    return wheel


def test_refresh_from_a_release_wheel_records_the_release(
    refresh: ModuleType, tmp_path: Path, capsys
) -> None:
    checkout = _synthetic_checkout(tmp_path / "verl_checkout")
    wheel = _synthetic_wheel(tmp_path / "wheels", version="9.8.7", checkout=checkout)
    out = tmp_path / "out"
    args = ["--verl-version", "9.8.7", "--wheel", str(wheel), "--out", str(out)]
    assert refresh.main(args) == 0
    ref = json.loads((out / "REFERENCE.json").read_text(encoding="utf-8"))
    assert ref["release"] == "9.8.7" and "commit" not in ref and "commit_date" not in ref
    assert ref["wheel"] == wheel.name
    assert ref["wheel_sha256"] == hashlib.sha256(wheel.read_bytes()).hexdigest()
    assert set(ref["sources"]) == {
        "verl/trainer/config/other.py",
        "verl/workers/config/__init__.py",
        "verl/workers/config/base.py",
        "verl/workers/config/child.py",
    }
    # The same tree as a checkout gives the same data files; only REFERENCE.json says where they came from.
    as_checkout = tmp_path / "out_checkout"
    commit = "0123456789abcdef0123456789abcdef01234567"
    assert refresh.main(["--verl", str(checkout), "--commit", commit, "--out", str(as_checkout)]) == 0
    for name in (*YAMLS, "dataclasses.json", "targets.json"):
        assert (out / name).read_bytes() == (as_checkout / name).read_bytes(), name
    assert refresh.main([*args, "--check"]) == 0
    capsys.readouterr()
    # Another wheel of the same version (a changed default) is stale data, and --check says so.
    (checkout / "verl/workers/config/base.py").write_text(
        textwrap.dedent(BASE_PY).replace("size: int = -1", "size: int = -7"), encoding="utf-8"
    )
    changed = _synthetic_wheel(tmp_path / "wheels2", version="9.8.7", checkout=checkout)
    assert (
        refresh.main(["--verl-version", "9.8.7", "--wheel", str(changed), "--out", str(out), "--check"]) == 1
    )
    diff = capsys.readouterr().out
    assert '"wheel_sha256"' in diff and '"default": -7' in diff


def test_refresh_downloads_the_release_wheel_with_pip(
    refresh: ModuleType, tmp_path: Path, monkeypatch
) -> None:
    """--verl-version without --wheel runs `pip download verl==VERSION --no-deps` (here from a local folder)."""
    checkout = _synthetic_checkout(tmp_path / "verl_checkout")
    wheels = tmp_path / "index"
    wheel = _synthetic_wheel(wheels, version="9.8.7", checkout=checkout)
    _synthetic_wheel(wheels, version="9.8.6", checkout=checkout)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    monkeypatch.delenv("PIP_EXTRA_INDEX_URL", raising=False)
    monkeypatch.delenv("PIP_INDEX_URL", raising=False)
    out = tmp_path / "out"
    assert refresh.main(["--verl-version", "9.8.7", "--out", str(out)]) == 0
    ref = json.loads((out / "REFERENCE.json").read_text(encoding="utf-8"))
    assert ref["release"] == "9.8.7" and ref["wheel"] == wheel.name
    assert ref["wheel_sha256"] == hashlib.sha256(wheel.read_bytes()).hexdigest()
    with pytest.raises(SystemExit, match="pip download verl==9.9.9 failed"):
        refresh.main(["--verl-version", "9.9.9", "--out", str(out)])


def test_refresh_refuses_a_bad_release_or_a_wheel_of_another_one(refresh: ModuleType, tmp_path: Path) -> None:
    checkout = _synthetic_checkout(tmp_path / "verl_checkout")
    wheel = _synthetic_wheel(tmp_path / "wheels", version="9.8.7", checkout=checkout)
    out = str(tmp_path / "out")
    with pytest.raises(SystemExit, match="release such as 0.9.1"):
        refresh.main(["--verl-version", "main", "--out", out])
    with pytest.raises(SystemExit, match="not the wheel of verl 1.0.0"):
        refresh.main(["--verl-version", "1.0.0", "--wheel", str(wheel), "--out", out])
    with pytest.raises(SystemExit):
        refresh.main(["--verl-version", "9.8.7", "--commit", "0" * 40, "--out", out])
    with pytest.raises(SystemExit):
        refresh.main(["--verl", str(checkout), "--verl-version", "9.8.7", "--out", out])


def test_verl_config_knows_every_built_in_name_of_verls_registries() -> None:
    """verl-config notes a policy loss or advantage estimator that is not built into verl (user code may
    register it): its lists of built-ins must be exactly the release's, or a valid name would be noted."""
    from verl_config.algorithm import ADV_ESTIMATORS, POLICY_LOSS_MODES

    registries = _json("registries.json")
    assert sorted(POLICY_LOSS_MODES) == sorted(registries["policy_losses"])
    assert sorted(ADV_ESTIMATORS) == sorted(registries["advantage_estimators"])


def test_the_packages_list_of_verl_yaml_keys_is_the_stored_yamls() -> None:
    """The loader's Hydra rule for '+' reads which keys verl's yaml has from the package
    (verl_config/config/verl_yaml_keys.json); it must be the stored release's (the refresh script writes both)."""
    from verl_config.verl_keys import VERL_YAML_KEYS_FILE, flatten_yaml_keys

    shipped = json.loads(VERL_YAML_KEYS_FILE.read_text())
    assert shipped["keys"] == flatten_yaml_keys((DATA / name).read_text() for name in YAMLS)
    assert shipped["release"] == _json("REFERENCE.json")["release"]
