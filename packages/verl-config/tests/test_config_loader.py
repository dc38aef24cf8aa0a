"""verl_config: loading YAML + dotlist overrides into typed dataclasses, and clear errors."""

from __future__ import annotations

import subprocess
import sys

import pytest

from verl_config import (
    ConfigKeyError,
    ConfigTypeError,
    ConfigValueError,
    McoreEngineConfig,
    SFTConfig,
    check_parallel_layout,
    load_config,
)
from verl_config.cli import main as config_main


def test_defaults_are_typed_dataclasses() -> None:
    cfg = load_config(SFTConfig)
    assert isinstance(cfg, SFTConfig)
    assert isinstance(cfg.megatron, McoreEngineConfig)  # one schema per concept
    assert cfg.megatron.use_distributed_optimizer is True
    assert cfg.megatron.override_ddp_config == {}
    # verl's rule: sequence_parallel is forced off when TP == 1
    assert cfg.megatron.sequence_parallel is False


def test_yaml_then_overrides_precedence(tmp_path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(
        "optim:\n  lr: 0.5\n  min_lr: 0.1\n  lr_warmup_steps: 2\ndata:\n  max_length: 64\ntrainer:\n  total_training_steps: 7\n"
    )
    cfg = load_config(
        SFTConfig,
        yaml_path=path,
        overrides=["optim.lr=0.25", "megatron.override_ddp_config.bucket_size=1000", "model.preset=tiny"],
    )
    assert cfg.optim.lr == 0.25  # override beats YAML
    assert cfg.optim.min_lr == 0.1  # YAML beats default
    assert cfg.data.max_length == 64
    assert cfg.trainer.total_training_steps == 7
    assert cfg.megatron.override_ddp_config == {"bucket_size": 1000}
    assert cfg.model.preset == "tiny"


def test_list_and_null_values() -> None:
    cfg = load_config(SFTConfig, overrides=["optim.betas=[0.8,0.9]", "model.path=null"])
    assert cfg.optim.betas == [0.8, 0.9]
    assert cfg.model.path is None


def test_unknown_key_names_full_path_and_suggests() -> None:
    with pytest.raises(ConfigKeyError) as exc:
        load_config(SFTConfig, overrides=["megatron.tensor_model_paralel_size=2"])
    msg = str(exc.value)
    assert "megatron.tensor_model_paralel_size" in msg
    assert "did you mean 'megatron.tensor_model_parallel_size'" in msg


def test_unknown_top_level_section() -> None:
    with pytest.raises(
        ConfigKeyError,
        match=r"unknown config key 'optimm.lr' \('optimm' does not exist\); did you mean 'optim'",
    ):
        load_config(SFTConfig, overrides=["optimm.lr=1"])


def test_unknown_key_in_yaml(tmp_path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("data:\n  micro_batch_size: 4\n")
    with pytest.raises(
        ConfigKeyError, match="data.micro_batch_size'.*did you mean 'data.micro_batch_size_per_gpu'"
    ):
        load_config(SFTConfig, yaml_path=path)


def test_wrong_type_names_key_and_value() -> None:
    with pytest.raises(ConfigTypeError) as exc:
        load_config(SFTConfig, overrides=["data.micro_batch_size_per_gpu=eight"])
    msg = str(exc.value)
    assert "data.micro_batch_size_per_gpu" in msg and "'eight'" in msg


def test_invalid_value_names_section_path() -> None:
    with pytest.raises(ConfigValueError, match=r"megatron\.tensor_model_parallel_size: must be > 0, got 0"):
        load_config(SFTConfig, overrides=["megatron.tensor_model_parallel_size=0"])
    with pytest.raises(ConfigValueError, match=r"megatron\.dtype: must be one of"):
        load_config(SFTConfig, overrides=["megatron.dtype=fp8"])
    with pytest.raises(
        ConfigValueError,
        match=r"megatron\.packed_attention_backend: must be one of 'auto', 'varlen', 'cudnn', 'sdpa', 'te'; got 'flash'",
    ):
        load_config(SFTConfig, overrides=["megatron.packed_attention_backend=flash"])
    with pytest.raises(ConfigValueError, match=r"optim\.min_lr: must not exceed lr"):
        load_config(SFTConfig, overrides=["optim.lr=1e-4", "optim.min_lr=1e-3"])


def test_override_without_equals_is_rejected() -> None:
    with pytest.raises(ConfigKeyError, match="has no '='"):
        load_config(SFTConfig, overrides=["optim.lr"])


def test_impossible_parallel_layout_names_numbers() -> None:
    with pytest.raises(ConfigValueError) as exc:
        check_parallel_layout(
            world_size=6,
            tensor_model_parallel_size=4,
            pipeline_model_parallel_size=1,
            context_parallel_size=1,
        )
    msg = str(exc.value)
    assert "world size 6" in msg and "tensor_model_parallel_size (4)" in msg and "= 4" in msg
    assert check_parallel_layout(world_size=8, tensor_model_parallel_size=2, context_parallel_size=2) == 2


def test_batch_not_divisible_by_micro_batch_times_dp() -> None:
    cfg = load_config(SFTConfig, overrides=["data.train_batch_size=12", "data.micro_batch_size_per_gpu=4"])
    assert cfg.check_world_size(3) == 3
    with pytest.raises(
        ConfigValueError,
        match=r"data\.train_batch_size: 12 is not divisible by .* \(4\) x data-parallel size \(2\) = 8",
    ):
        cfg.check_world_size(2)


def test_cli_show_and_validate(capsys) -> None:
    assert config_main(["show", "--entry", "sft", "optim.lr=0.5"]) == 0
    assert "lr: 0.5" in capsys.readouterr().out
    assert (
        config_main(
            ["validate", "--entry", "sft", "--world-size", "4", "megatron.tensor_model_parallel_size=3"]
        )
        == 2
    )
    assert "world size 4 is not divisible" in capsys.readouterr().err


def test_no_torch_import() -> None:
    """verl-config must stay importable (and light) without torch."""
    code = "import sys, verl_config; verl_config.load_config(verl_config.SFTConfig); assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize(
    "overrides",
    [
        ["megatron.override_ddp_config.use_distributed_optimizer=false"],
        [
            "megatron.use_distributed_optimizer=false",
            "megatron.override_ddp_config.use_distributed_optimizer=true",
        ],
    ],
)
def test_ddp_and_optimizer_read_one_distributed_optimizer_setting(overrides: list[str]) -> None:
    """The field and override_ddp_config must agree: DDP's buffers and the optimizer are built from them."""
    with pytest.raises(ConfigValueError) as err:
        load_config(SFTConfig, overrides=overrides)
    message = str(err.value)
    assert (
        "override_ddp_config.use_distributed_optimizer" in message and "use_distributed_optimizer=" in message
    )
    agreeing = load_config(
        SFTConfig,
        overrides=[
            "megatron.use_distributed_optimizer=false",
            "megatron.override_ddp_config.use_distributed_optimizer=false",
        ],
    )
    assert agreeing.megatron.use_distributed_optimizer is False


def test_sft_warm_up_must_end_before_the_last_step() -> None:
    with pytest.raises(
        ConfigValueError, match=r"optim.lr_warmup_steps: is 10 but trainer.total_training_steps is 3"
    ):
        load_config(SFTConfig, overrides=["trainer.total_training_steps=3"])
    cfg = load_config(SFTConfig, overrides=["trainer.total_training_steps=3", "optim.lr_warmup_steps=0"])
    assert cfg.optim.lr_warmup_steps == 0
