"""Generated reference configs (fresh, stale detection), the CLI, README examples, no torch."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from verl_config import GENERATED_DIR, check_generated, generated_yaml, write_generated
from verl_config.cli import main

README = Path(__file__).resolve().parents[1] / "README.md"


def test_checked_in_generated_configs_are_fresh() -> None:
    assert check_generated(GENERATED_DIR) == {}, "run `uv run verl-config generate` and commit the result"
    assert (GENERATED_DIR / "_generated_ppo_trainer.yaml").read_text() == generated_yaml("fsdp")


def test_stale_or_missing_generated_config_is_detected(tmp_path, capsys) -> None:
    write_generated(tmp_path)
    assert check_generated(tmp_path) == {}
    assert main(["generate", "--check", "--dir", str(tmp_path)]) == 0
    path = tmp_path / "_generated_ppo_megatron_trainer.yaml"
    path.write_text(path.read_text().replace("qkv_layer_name: qkv", "qkv_layer_name: qkv_proj"))
    (tmp_path / "_generated_ppo_trainer.yaml").unlink()
    stale = check_generated(tmp_path)
    assert set(stale) == {"_generated_ppo_megatron_trainer.yaml", "_generated_ppo_trainer.yaml"}
    assert "-      qkv_layer_name: qkv_proj" in stale["_generated_ppo_megatron_trainer.yaml"]
    assert main(["generate", "--check", "--dir", str(tmp_path)]) == 1
    assert "is stale; run `verl-config generate`" in capsys.readouterr().err


def test_generated_yaml_loads_back_to_the_same_config() -> None:
    from verl_config import load_config

    for engine, name in (
        ("fsdp", "_generated_ppo_trainer.yaml"),
        ("megatron", "_generated_ppo_megatron_trainer.yaml"),
    ):
        text = (GENERATED_DIR / name).read_text()
        micro = [
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
            "critic.ppo_micro_batch_size_per_gpu=4",
        ]
        cfg = load_config(yaml_text=text, overrides=micro)
        assert cfg.model_engine == engine


def test_cli_show_validate_diff(capsys) -> None:
    assert (
        main(
            [
                "show",
                "model_engine=megatron",
                "actor_rollout_ref.actor.use_dynamic_bsz=true",
                "critic.use_dynamic_bsz=true",
            ]
        )
        == 0
    )
    out = capsys.readouterr()
    assert "strategy: megatron" in out.out and "max_token_len_per_gpu: 16384" in out.out  # resolved
    # show needs no run-time keys (micro-batch sizes); validate applies the rules between keys
    assert main(["show"]) == 0 and "ppo_micro_batch_size_per_gpu: null" in capsys.readouterr().out
    assert main(["show", "--entry", "sft"]) == 0 and "sequence_parallel: true" in capsys.readouterr().out
    assert main(["validate"]) == 2
    assert "ppo_micro_batch_size_per_gpu: is null" in capsys.readouterr().err
    assert main(["show", "actor_rollout_ref.actor.optim.lrr=1"]) == 2  # unknown keys are still refused
    capsys.readouterr()
    assert main(["validate", "model_engine=megatron", "actor_rollout_ref.actor.use_dynamic_bsz=true"]) == 0
    assert "note: actor_rollout_ref.actor.megatron.sequence_parallel" in capsys.readouterr().err
    assert main(["validate", "actor_rollout_ref.actor.optim.lrr=1"]) == 2
    assert "did you mean 'actor_rollout_ref.actor.optim.lr'" in capsys.readouterr().err
    assert main(["diff", "--engines", "fsdp", "megatron"]) == 0
    out = capsys.readouterr().out
    assert "actor_rollout_ref.model.use_remove_padding: fsdp=True megatron=False" in out
    assert "actor_rollout_ref.rollout.layer_name_map.qkv_layer_name: fsdp='<absent>' megatron='qkv'" in out
    assert main(["validate", "--world-size", "8"]) == 2
    assert "--world-size: applies to --entry sft only" in capsys.readouterr().err


def _readme_commands() -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", README.read_text(), re.S)
    return [b.replace("\\\n", " ").strip() for b in blocks]


def test_readme_has_every_example() -> None:
    text = " ".join(_readme_commands())
    for needle in (
        "model_engine=fsdp",
        "pipeline_model_parallel_size",
        "use_megatron_fsdp=true",
        "dynamic_context_parallel=true",
        "lora.rank",
    ):
        assert needle in text


@pytest.mark.parametrize("command", _readme_commands())
def test_readme_example_validates(command: str, capsys) -> None:
    argv = shlex.split(command)
    assert argv[0] == "verl-config"
    rc = main(argv[1:])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert "config is valid" in captured.out


def test_imports_without_torch() -> None:
    code = (
        "import sys, verl_config; verl_config.load_config('ppo_megatron_trainer', overrides=["
        "'actor_rollout_ref.actor.use_dynamic_bsz=true', 'critic.use_dynamic_bsz=true']);"
        " assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-W", "ignore", "-c", code], check=True)
