"""verl 0.9.1 drives verl-engine: verl's own ``TrainingWorker`` over our engine, on CPU (gloo), 2 ranks, fp32.

The published verl wheel (nox session ``verl``: verl-engine[verl] from uv.lock's verl fork, verl's own pins) constructs ``TrainingWorker`` directly (no
Ray) for the actor (verl's ``ppo_loss``: PPO clip + entropy + KL), the reference (infer only) and the critic
(``value_loss``); it finds our engine through verl's ``EngineRegistry`` with ``VERL_ENGINE_DEVICE=verl_engine``.
Each number is compared with our engine driven directly with our own losses: loss, grad norm, every metric and
every updated weight within 1e-6. Also: offload through ``TrainingWorker.to``, checkpoints through verl's save /
load (``max_ckpt_to_keep``, a refused ``hdfs_path``), the delta weight export after one step, and an actor with
LoRA (one step, verl's adapter-only / base weight sync, ``no_lora_adapter`` reference log-probs).
The CPU patches are test-only (tests/verl_cpu_platform.py); ``VERL_BACKEND_OUT=path`` writes the numbers as JSON
(docs/verl.md's table).
"""

from __future__ import annotations

import json
import os

import pytest
from rl_engine_workers import verl_batch

pytestmark = pytest.mark.verl_backend

TOL = 1e-6
# verl's loss names the KL metrics without the actor/ prefix ours uses
VERL_NAMES = {"kl_loss": "actor/kl_loss", "kl_coef": "actor/kl_coef"}
PERF = ("perf/", "mfu")


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    """One 2-rank run of every TrainingWorker call (each rank builds verl's workers and our engines)."""
    pytest.importorskip("verl.workers.engine_workers", reason="verl 0.9.1 is installed by `nox -s verl`")
    from verl_backend_workers import verl_drives_engine

    from verl_mcore_utils.hf_testing import save_tiny_hf_model
    from verl_mcore_utils.testing import run_distributed

    model_dir = str(save_tiny_hf_model("qwen2", tmp_path_factory.mktemp("qwen2") / "model", seed=3))
    batch = verl_batch(seed=0, prompt_lens=[3, 6, 1, 5], response_lens=[7, 2, 5, 4])
    ckpt = str(tmp_path_factory.mktemp("ckpt"))
    # fresh processes: verl's platform and engine registries are process state the patches change for good
    out = run_distributed(verl_drives_engine, world_size=2, args=(model_dir, batch, ckpt), fresh=True)[0]
    if os.environ.get("VERL_BACKEND_OUT"):
        with open(os.environ["VERL_BACKEND_OUT"], "w") as f:
            json.dump(_table(out), f, indent=2)
    return out


def _metric_diffs(direct: dict, verl: dict) -> dict[str, float]:
    ours = {k: v for k, v in direct.items()}
    theirs = {VERL_NAMES.get(k, k): v for k, v in verl.items() if not k.startswith(PERF)}
    assert ours.keys() == theirs.keys(), (sorted(ours), sorted(theirs))
    return {k: abs(float(ours[k]) - float(theirs[k])) / max(1.0, abs(float(ours[k]))) for k in ours}


def _params_diff(direct: dict, verl: dict) -> float:
    from verl_backend_workers import max_diff

    return max_diff(direct, verl)


def _table(out: dict) -> dict:
    """The numbers of docs/verl.md's table."""
    actor, critic = out["direct"], out["critic"]
    return {
        "ref infer_batch log_probs / entropy": max(out["ref"].values()),
        "actor train_batch loss": abs(actor["loss"] - out["verl"]["loss"]),
        "actor metrics (relative)": max(_metric_diffs(actor["metrics"], out["verl"]["metrics"]).values()),
        "actor weights after the step": _params_diff(actor["params"], out["verl"]["params"]),
        "critic infer_batch values": critic["values_diff"],
        "critic train_batch loss": abs(critic["direct"]["loss"] - critic["verl"]["loss"]),
        "critic metrics (relative)": max(
            _metric_diffs(critic["direct"]["metrics"], critic["verl"]["metrics"]).values()
        ),
        "critic weights after the step": _params_diff(critic["direct"]["params"], critic["verl"]["params"]),
        "to(cpu) then to(device): log_probs": out["offload"]["max_diff"],
        "train_batch with param/optimizer offload: weights": _params_diff(
            out["auto_offload"]["params"], out["verl"]["params"]
        ),
        "load_checkpoint: weights": out["checkpoint"]["load_max_diff"],
        "delta": {k: v for k, v in out["delta"].items()},
    }


def test_reference_log_probs_equal_the_direct_engine(results: dict) -> None:
    assert results["ref"]["log_probs"] <= TOL and results["ref"]["entropy"] <= TOL, results["ref"]


def test_actor_ppo_step_equals_the_direct_engine(results: dict) -> None:
    direct, verl = results["direct"], results["verl"]
    assert abs(direct["loss"] - verl["loss"]) <= TOL * max(1.0, abs(direct["loss"]))
    diffs = _metric_diffs(direct["metrics"], verl["metrics"])
    assert {"actor/pg_loss", "actor/entropy_loss", "actor/kl_loss", "grad_norm"} <= diffs.keys()
    assert max(diffs.values()) <= TOL, diffs
    assert _params_diff(direct["params"], verl["params"]) <= TOL


def test_critic_value_step_equals_the_direct_engine(results: dict) -> None:
    critic = results["critic"]
    assert critic["values_diff"] <= TOL
    assert abs(critic["direct"]["loss"] - critic["verl"]["loss"]) <= TOL * max(
        1.0, abs(critic["direct"]["loss"])
    )
    diffs = _metric_diffs(critic["direct"]["metrics"], critic["verl"]["metrics"])
    assert {"critic/vf_loss", "grad_norm"} <= diffs.keys()
    assert max(diffs.values()) <= TOL, diffs
    assert _params_diff(critic["direct"]["params"], critic["verl"]["params"]) <= TOL


def test_offload_through_worker_to_round_trips(results: dict) -> None:
    offload = results["offload"]
    assert all(offload["offloaded"].values()) and not any(offload["onloaded"].values()), offload
    assert offload["max_diff"] == 0.0


def test_auto_offload_in_train_mode_gives_the_same_step(results: dict) -> None:
    auto = results["auto_offload"]
    assert all(auto["after_init"].values()) and all(auto["after_step"].values()), auto
    assert auto["loss"] == results["verl"]["loss"]
    assert _params_diff(auto["params"], results["verl"]["params"]) == 0.0


def test_checkpoint_save_load_through_verl(results: dict) -> None:
    ckpt = results["checkpoint"]
    assert (
        ckpt["moved_after_save"] > 0 and ckpt["moved_before_load"] > 0
    )  # the steps in between changed weights
    assert ckpt["load_max_diff"] == 0.0
    assert ckpt["first_removed"] and ckpt["second_kept"]  # max_ckpt_to_keep=1
    assert "hdfs_path" in ckpt["hdfs_error"]


def test_delta_export_sends_only_changed_elements(results: dict) -> None:
    delta = results["delta"]
    # every sent element changed, every changed element was sent (checked per tensor on each rank), and the
    # rollout side's copy rebuilt from them equals the new weights exactly
    assert delta["rebuilt_max_diff"] == 0.0
    assert 0 < delta["changed_elements"] < delta["total_elements"]
    assert delta["idle_bytes"] == 0  # nothing moved since the last export: nothing sent


@pytest.fixture(scope="module")
def lora_results(tmp_path_factory) -> dict:
    """One 2-rank run of verl's TrainingWorker over a LoRA actor (rank 4) and of our engine directly."""
    pytest.importorskip("verl.workers.engine_workers", reason="verl 0.9.1 is installed by `nox -s verl`")
    pytest.importorskip("peft")
    from verl_backend_lora_workers import verl_drives_lora

    from verl_mcore_utils.hf_testing import save_tiny_hf_model
    from verl_mcore_utils.testing import run_distributed

    model_dir = str(save_tiny_hf_model("qwen2", tmp_path_factory.mktemp("qwen2_lora") / "model", seed=3))
    batch = verl_batch(seed=0, prompt_lens=[3, 6, 1, 5], response_lens=[7, 2, 5, 4])
    return run_distributed(verl_drives_lora, world_size=2, args=(model_dir, batch), fresh=True)[0]


def test_lora_actor_ppo_step_equals_the_direct_engine(lora_results: dict) -> None:
    direct, verl = lora_results["direct"], lora_results["verl"]
    assert verl["trainable"] and all(".lora_A." in n or ".lora_B." in n for n in verl["trainable"])
    assert abs(direct["loss"] - verl["loss"]) <= TOL * max(1.0, abs(direct["loss"]))
    diffs = _metric_diffs(direct["metrics"], verl["metrics"])
    assert {"actor/pg_loss", "actor/kl_loss", "grad_norm"} <= diffs.keys()
    assert max(diffs.values()) <= TOL, diffs
    assert _params_diff(direct["params"], verl["params"]) <= TOL


def test_lora_weight_sync_adapter_only_and_base(lora_results: dict) -> None:
    """verl's naive sync: base_sync_done=True gives exactly the adapter tensors (PEFT names) and the PEFT config
    with peft enum members; base_sync_done=False the base weights (equal to a model without LoRA)."""
    adapter, base = lora_results["adapter"], lora_results["base"]
    assert adapter["names"] == adapter["direct_names"] and adapter["names"]
    assert all(".lora_A." in n or ".lora_B." in n for n in adapter["names"])
    assert adapter["max_diff"] <= TOL
    peft = adapter["peft"]
    assert peft["peft_type"] == ("peft.utils.peft_types", "LORA"), peft
    assert peft["task_type"] == ("peft.utils.peft_types", "CAUSAL_LM"), peft
    assert peft["r"] == 4 and peft["lora_alpha"] == 8
    assert adapter["base_peft_same"]
    assert base["names_match"] and base["max_diff"] == 0.0


def test_lora_no_adapter_infer_equals_the_base_model(lora_results: dict) -> None:
    got = lora_results["no_lora_adapter"]
    assert got["max_diff"] <= TOL, got
    assert got["adapter_moves"] > 1e-4, got  # the trained adapter changes the policy


def test_plugin_entry_point_selects_our_engine_with_one_variable() -> None:
    """The installed ``verl.plugins`` entry point: plain ``import verl`` registers us; without the variable verl's
    own Megatron engine is what ``megatron`` gets, with ``VERL_ENGINE_DEVICE=verl_engine`` ours."""
    import importlib.metadata
    import subprocess
    import sys

    pytest.importorskip("verl.workers.engine_workers", reason="verl 0.9.1 is installed by `nox -s verl`")
    points = {p.name: p.value for p in importlib.metadata.entry_points(group="verl.plugins")}
    assert points.get("verl_engine") == "verl_engine.integrations.verl", points
    # one process: verl reads VERL_ENGINE_DEVICE at every lookup
    code = (
        "import os, verl\n"
        "from verl.workers.engine import EngineRegistry as R\n"
        "def names(): return [R.get_engine_cls(t, 'megatron').__name__ for t in ('language_model', 'value_model')]\n"
        "plain = names()\n"
        "os.environ['VERL_ENGINE_DEVICE'] = 'verl_engine'\n"
        "print(*plain, *names())\n"
    )
    env = {
        k: v for k, v in os.environ.items() if k not in ("VERL_ENGINE_DEVICE", "VERL_USE_EXTERNAL_MODULES")
    }
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    out = run.stdout.split()
    names = {"": out[:2], "verl_engine": out[2:]}
    assert names[""] == ["MegatronEngineWithLMHead", "MegatronEngineWithValueHead"], names
    assert names["verl_engine"] == ["VerlEngine", "VerlValueEngine"], names


@pytest.mark.parametrize(
    ("engine_kw", "model_kw", "key"),
    [
        ({"pipeline_model_parallel_size": 2}, {}, "pipeline_model_parallel_size"),
        ({"full_determinism": True}, {}, "full_determinism"),
        ({}, {"lora": {"rank": 4, "type": "dora"}}, "model.lora.type"),
        ({}, {"lora": {"rank": 4, "a2a_experimental": True}}, "model.lora.a2a_experimental"),
        ({}, {"lora": {"rank": 4, "no_such_key": 1}}, "model.lora.no_such_key"),
        ({}, {"lora": {"rank": 4, "target_modules": ["q_proj"]}}, "model.lora.target_modules"),
        ({}, {"lora_rank": 4, "lora": {"rank": 4}}, "model.lora_rank"),
        ({}, {"lora_rank": 4, "target_parameters": ["x"]}, "model.target_parameters"),
    ],
)
def test_unsupported_verl_settings_are_refused_naming_the_key(
    tmp_path, engine_kw: dict, model_kw: dict, key: str
) -> None:
    pytest.importorskip("verl.workers.engine_workers", reason="verl 0.9.1 is installed by `nox -s verl`")
    from verl.workers.config import HFModelConfig, McoreEngineConfig, McoreOptimizerConfig

    from verl_engine.integrations.verl.configs import build_args
    from verl_mcore_utils.hf_testing import save_tiny_hf_model

    model_dir = str(save_tiny_hf_model("qwen2", tmp_path / "model", seed=3))
    model = HFModelConfig(path=model_dir, load_tokenizer=False, **model_kw)
    engine = McoreEngineConfig(micro_batch_size_per_gpu=2, **engine_kw)
    with pytest.raises(ValueError, match=key):
        build_args(
            model_config=model,
            engine_config=engine,
            optimizer_config=McoreOptimizerConfig(lr=1e-3),
            value_model=False,
        )
