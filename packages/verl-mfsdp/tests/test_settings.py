"""Megatron-FSDP DDP settings for every combination of flag and overrides, on the installed megatron-core.

The nox matrix runs this file against megatron-core 0.14.0 ... 0.19.2; the expectations that differ
per release (fp32-gradient fields) are derived from what the installed release offers.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from verl_mcore_utils.compat import ddp_config_fields, mcore_version
from verl_mcore_utils.ddp import WrapConfig, build_ddp_config
from verl_mfsdp.settings import megatron_fsdp_ddp_config

FSDP = WrapConfig(use_megatron_fsdp=True)
HAS_DTYPE_FIELDS = "megatron_fsdp_main_grads_dtype" in ddp_config_fields()


def test_dtype_fields_exist_from_0_17() -> None:
    assert HAS_DTYPE_FIELDS is (mcore_version().release >= (0, 17))


def test_defaults() -> None:
    ddp = megatron_fsdp_ddp_config(wrap_config=FSDP)
    assert ddp.use_distributed_optimizer is True and ddp.use_megatron_fsdp is True
    assert ddp.data_parallel_sharding_strategy == "optim_grads_params"
    assert ddp.overlap_grad_reduce is True and ddp.check_for_nan_in_grad is True
    assert ddp.grad_reduce_in_fp32 is True
    if HAS_DTYPE_FIELDS:  # 0.19 reads only these for Megatron-FSDP
        assert ddp.megatron_fsdp_main_grads_dtype == torch.float32
        assert ddp.megatron_fsdp_grad_comm_dtype == torch.float32


OVERRIDES = {
    "data_parallel_sharding_strategy": ["optim", "optim_grads", "no_shard"],
    "overlap_grad_reduce": [False],
    "check_for_nan_in_grad": [False],
    "grad_reduce_in_fp32": [False],
    "bucket_size": [1234567],
}


@pytest.mark.parametrize(
    "combo",
    [
        dict(zip(keys, values, strict=True))
        for r in range(len(OVERRIDES) + 1)
        for keys in itertools.combinations(OVERRIDES, r)
        for values in itertools.product(*(OVERRIDES[k] for k in keys))
    ],
    ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "none",
)
def test_overrides_win_for_everything_else(combo: dict) -> None:
    ddp = megatron_fsdp_ddp_config(wrap_config=FSDP, override_ddp_config=combo)
    expected = {
        "data_parallel_sharding_strategy": "optim_grads_params",
        "overlap_grad_reduce": True,
        "check_for_nan_in_grad": True,
        "grad_reduce_in_fp32": True,
        "bucket_size": None,
        **combo,
    }
    for key, value in expected.items():
        assert getattr(ddp, key) == value, key
    assert ddp.use_distributed_optimizer is True and ddp.use_megatron_fsdp is True
    if HAS_DTYPE_FIELDS:
        want = torch.float32 if expected["grad_reduce_in_fp32"] else None
        assert ddp.megatron_fsdp_main_grads_dtype == want and ddp.megatron_fsdp_grad_comm_dtype == want


def test_dtype_names_from_config_files() -> None:
    if not HAS_DTYPE_FIELDS:  # < 0.17: the field does not exist, and saying so is the right answer
        with pytest.raises(
            ValueError,
            match=r"unknown DistributedDataParallelConfig field\(s\) \['megatron_fsdp_grad_comm_dtype'\]",
        ):
            megatron_fsdp_ddp_config(
                wrap_config=FSDP, override_ddp_config={"megatron_fsdp_grad_comm_dtype": "bf16"}
            )
        return
    ddp = megatron_fsdp_ddp_config(
        wrap_config=FSDP, override_ddp_config={"megatron_fsdp_grad_comm_dtype": "bf16"}
    )
    assert (
        ddp.megatron_fsdp_grad_comm_dtype == torch.bfloat16
        and ddp.megatron_fsdp_main_grads_dtype == torch.float32
    )
    with pytest.raises(ValueError, match="megatron_fsdp_grad_comm_dtype 'fp8' is not a dtype name"):
        megatron_fsdp_ddp_config(
            wrap_config=FSDP, override_ddp_config={"megatron_fsdp_grad_comm_dtype": "fp8"}
        )


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        (
            {"wrap_config": WrapConfig(use_megatron_fsdp=True, use_distributed_optimizer=False)},
            "^use_distributed_optimizer is false",
        ),
        (
            {"wrap_config": FSDP, "override_ddp_config": {"use_distributed_optimizer": False}},
            "override_ddp_config.use_distributed_optimizer is false",
        ),
        (
            {"wrap_config": FSDP, "override_ddp_config": {"use_megatron_fsdp": False}},
            "override_ddp_config.use_megatron_fsdp",
        ),
        ({"wrap_config": FSDP, "pipeline_model_parallel_size": 2}, "pipeline_model_parallel_size is 2"),
        (
            {"wrap_config": FSDP, "override_ddp_config": {"data_parallel_sharding_strategy": "zero3"}},
            "'zero3' is not one of no_shard, optim, optim_grads, optim_grads_params",
        ),
        (
            {"wrap_config": FSDP, "override_ddp_config": {"bucket_sise": 1}},
            r"unknown DistributedDataParallelConfig field\(s\) \['bucket_sise'\]",
        ),
        ({"wrap_config": WrapConfig()}, "needs WrapConfig\\(use_megatron_fsdp=True\\)"),
    ],
)
def test_contradictions_are_clear_errors(kwargs: dict, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        megatron_fsdp_ddp_config(**kwargs)


def test_not_wrapping_means_no_ddp_config() -> None:
    assert (
        megatron_fsdp_ddp_config(wrap_config=WrapConfig(use_megatron_fsdp=True, wrap_with_ddp=False)) is None
    )


def test_plain_ddp_path_is_untouched_by_the_fsdp_defaults() -> None:
    ddp = build_ddp_config(wrap_config=WrapConfig(use_distributed_optimizer=False))
    assert ddp.use_megatron_fsdp is False and ddp.data_parallel_sharding_strategy == "no_shard"


def test_from_the_verl_config_section() -> None:
    from verl_config import load_config

    am = "actor_rollout_ref.actor.megatron"
    cfg = load_config(
        overrides=[
            "model_engine=megatron",
            f"{am}.use_megatron_fsdp=true",
            f"{am}.override_ddp_config.data_parallel_sharding_strategy=optim_grads",
            f"{am}.override_ddp_config.overlap_grad_reduce=false",
            "actor_rollout_ref.actor.use_dynamic_bsz=true",
            "critic.use_dynamic_bsz=true",
            "critic.model.path=${actor_rollout_ref.model.path}",  # GAE (the default) uses the critic: give its model
        ]
    )
    engine = cfg.actor_rollout_ref.actor.megatron
    ddp = megatron_fsdp_ddp_config(
        wrap_config=WrapConfig(**engine.wrap_config_kwargs()),
        override_ddp_config=engine.ddp_config_overrides(),
        pipeline_model_parallel_size=engine.pipeline_model_parallel_size,
    )
    assert (ddp.use_megatron_fsdp, ddp.data_parallel_sharding_strategy, ddp.overlap_grad_reduce) == (
        True,
        "optim_grads",
        False,
    )
    assert ddp.use_distributed_optimizer and ddp.check_for_nan_in_grad


def _unit_sizes(rank: int, world_size: int) -> dict[str, object]:
    """A tiny Qwen2 built on the CPU: our communication-unit size against its layers' parameter counts."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from verl_mcore_utils.model import build_gpt_model
    from verl_mcore_utils.parallel import init_parallel
    from verl_mcore_utils.presets import qwen2_preset
    from verl_mcore_utils.transformer_config import hf_to_transformer_config
    from verl_mfsdp.settings import fsdp_communication_unit_size, with_communication_unit_size

    init_parallel(device="cpu")
    hf = qwen2_preset("tiny", vocab_size=128)
    model = build_gpt_model(
        hf_config=hf, tf_config=hf_to_transformer_config(hf, dtype="float32"), device="cpu"
    )
    layers = [m for m in model.modules() if isinstance(m, TransformerLayer)]
    ddp = megatron_fsdp_ddp_config(wrap_config=FSDP)

    def kept(override: dict) -> object:
        config = megatron_fsdp_ddp_config(wrap_config=FSDP, override_ddp_config=override)
        return with_communication_unit_size(
            config, chunks=[model], override_ddp_config=override
        ).suggested_communication_unit_size

    return {
        "layer_params": [sum(p.numel() for p in layer.parameters()) for layer in layers],
        "model_params": sum(p.numel() for p in model.parameters()),
        "size": fsdp_communication_unit_size([model]),
        "no_units": fsdp_communication_unit_size([torch.nn.Linear(4, 4)]),
        "filled": with_communication_unit_size(ddp, chunks=[model]).suggested_communication_unit_size,
        "kept": kept({"suggested_communication_unit_size": 12345}),
        "kept_null": kept({"suggested_communication_unit_size": None}),
        "default": ddp.suggested_communication_unit_size,
    }


def test_the_communication_unit_is_two_fsdp_units_unless_set() -> None:
    """Megatron-FSDP's reduce-scatter queue and all-gather prefetch are sized by suggested_communication_unit_size;
    megatron-core's default floors it at 1e9 elements, so a model under a few billion parameters queues almost all
    its gradients unsharded. The wrapper fills in twice the mean FSDP unit (a transformer layer); a value the user
    sets, null included, is kept."""
    from verl_mcore_utils.testing import run_distributed

    (got,) = run_distributed(_unit_sizes, world_size=1)
    layers = got["layer_params"]
    assert len(layers) >= 2 and got["size"] == 2 * -(-sum(layers) // len(layers))
    assert got["size"] < got["model_params"]  # a bound the queue can reach, unlike megatron-core's 1e9
    assert got["filled"] == got["size"] and got["no_units"] is None
    assert got["kept"] == 12345 and got["kept_null"] is None and got["default"] is None
