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
    assert main(["validate", "model_engine=megatron", "actor_rollout_ref.actor.use_dynamic_bsz=true"]) == 2
    assert "critic.model.path: is not set but the critic is used" in capsys.readouterr().err
    critic_path = "critic.model.path=${actor_rollout_ref.model.path}"
    assert (
        main(
            ["validate", "model_engine=megatron", "actor_rollout_ref.actor.use_dynamic_bsz=true", critic_path]
        )
        == 0
    )
    assert "note: actor_rollout_ref.actor.megatron.sequence_parallel" in capsys.readouterr().err
    assert main(["validate", "actor_rollout_ref.actor.optim.lrr=1"]) == 2
    assert "did you mean 'actor_rollout_ref.actor.optim.lr'" in capsys.readouterr().err
    assert main(["diff", "--engines", "fsdp", "megatron"]) == 0
    out = capsys.readouterr().out
    assert "actor_rollout_ref.actor.optim.optimizer: fsdp='AdamW' megatron='adam'" in out
    # verl 0.9.1 turned remove-padding on for Megatron too: no longer an engine difference
    assert "actor_rollout_ref.model.use_remove_padding:" not in out
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
        "'actor_rollout_ref.actor.use_dynamic_bsz=true', 'critic.use_dynamic_bsz=true',"
        " 'critic.model.path=${actor_rollout_ref.model.path}']);"
        " assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-W", "ignore", "-c", code], check=True)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    """The real ``verl-config`` command in a fresh process (no state shared with the tests)."""
    return subprocess.run(
        [sys.executable, "-m", "verl_config.cli", *args], capture_output=True, text=True, timeout=120
    )


def test_show_needs_no_run_time_keys() -> None:
    """`verl-config show`, bare or with overrides, prints the resolved defaults; the micro-batch sizes a
    run must still set are null there, and only validate asks for them."""
    bare = _cli("show")
    assert bare.returncode == 0, bare.stderr
    assert "ppo_micro_batch_size_per_gpu: null" in bare.stdout and "model_engine: fsdp" in bare.stdout
    assert "error" not in bare.stderr
    megatron = _cli("show", "model_engine=megatron", "actor_rollout_ref.actor.optim.lr=3e-6")
    assert megatron.returncode == 0, megatron.stderr
    assert "strategy: megatron" in megatron.stdout and "lr: 3.0e-06" in megatron.stdout


def test_validate_reports_every_error_at_once() -> None:
    """Three unrelated mistakes (a misspelt key, a value of the wrong type, a missing micro-batch size)
    come back from one run, each on its own line with its key and the fix."""
    result = _cli(
        "validate",
        "critic.enable=false",
        "actor_rollout_ref.actor.optim.lrr=1e-6",
        "actor_rollout_ref.rollout.n=many",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
    )
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("verl-config: error: ")]
    assert len(errors) == 3, result.stderr
    assert "unknown config key 'actor_rollout_ref.actor.optim.lrr'; did you mean" in errors[0]
    assert "actor_rollout_ref.rollout.n: Value 'many'" in errors[1]
    assert errors[2].startswith(
        "verl-config: error: actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu: is null"
    )
    assert "set actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu" in errors[2]
    assert result.stderr.rstrip().endswith("verl-config: 3 errors")
    assert "config is valid" not in result.stdout


def test_load_config_raises_one_error_carrying_the_list() -> None:
    from verl_config import ConfigErrors, ConfigValueError, load_config

    with pytest.raises(ConfigErrors) as caught:
        load_config()  # the defaults lack three run-time keys (actor, rollout, critic micro-batches)
    keys = [err.key for err in caught.value.errors if isinstance(err, ConfigValueError)]
    assert keys == [
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
        "critic.ppo_micro_batch_size_per_gpu",
    ]
    assert str(caught.value).startswith(
        "3 config errors:\n  actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"
    )
    # a layout mistake in the actor is not reported again for the reference policy that copies it
    with pytest.raises(ConfigValueError) as one:
        load_config(
            overrides=[
                "model_engine=megatron",
                "actor_rollout_ref.actor.use_kl_loss=true",
                "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=0",
                "actor_rollout_ref.actor.use_dynamic_bsz=true",
                "actor_rollout_ref.ref.log_prob_use_dynamic_bsz=true",
                "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true",
                "critic.enable=false",
            ]
        )
    assert one.value.key == "actor_rollout_ref.actor.megatron.tensor_model_parallel_size"


def test_diff_into_a_closed_pipe_ends_quietly() -> None:
    """`verl-config diff | head -1`: the reader leaves early; exit 0 and no BrokenPipeError traceback. The pipe's
    read end is closed before the command writes anything, so its first write fails (no race)."""
    import subprocess
    import sys

    code = "import sys; from verl_config.cli import main; sys.exit(main(['diff']))"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0, err
    assert "BrokenPipeError" not in err and "Traceback" not in err, err
