"""CPU checks of verl_mfsdp's lifecycle API: argument errors and checkpoint errors that need no GPU.

The behaviour itself (bitwise offload, export, exact resume) needs CUDA and is tested in
tests/test_gpu_mfsdp_lifecycle.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import verl_mfsdp
from verl_mcore_utils.offload import model_offload_kinds
from verl_mfsdp import checkpoint

EXPECTED = {
    "export_megatron_fsdp_hf_weights",
    "load_megatron_fsdp_checkpoint",
    "offload_megatron_fsdp_model",
    "offload_megatron_fsdp_optimizer",
    "onload_megatron_fsdp_model",
    "onload_megatron_fsdp_optimizer",
    "save_megatron_fsdp_checkpoint",
    "synchronize_megatron_fsdp_params",
    "restart_megatron_fsdp_param_sync",
}


def test_public_names_exported() -> None:
    assert EXPECTED <= set(verl_mfsdp.__all__)
    for name in verl_mfsdp.__all__:
        assert getattr(verl_mfsdp, name) is not None


def test_plain_module_is_refused_with_pointer_to_ddp_offload() -> None:
    with pytest.raises(TypeError, match="not wrapped with Megatron-FSDP.*verl_mcore_utils.offload"):
        verl_mfsdp.offload_megatron_fsdp_model(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="not wrapped with Megatron-FSDP"):
        list(
            verl_mfsdp.export_megatron_fsdp_hf_weights(
                [torch.nn.Linear(2, 2)], hf_config={"model_type": "qwen2"}
            )
        )
    with pytest.raises(ValueError, match="model_chunks is empty"):
        verl_mfsdp.megatron_fsdp_chunks([])


def test_fsdp_flagged_module_with_nccl_ub_is_refused() -> None:
    class Fake(torch.nn.Module):
        class ddp_config:
            use_megatron_fsdp = True
            nccl_ub = True

        param_and_grad_buffer = None

    with pytest.raises(NotImplementedError, match="nccl_ub=True"):
        verl_mfsdp.megatron_fsdp_chunks([Fake()])


def test_nothing_selected_is_an_error() -> None:
    with pytest.raises(ValueError, match="nothing selected"):
        model_offload_kinds(params=False, grads=False)


def test_ddp_offload_still_refuses_fsdp_and_points_at_verl_mfsdp() -> None:
    from verl_mcore_utils.offload import offload_megatron_model

    class FakeFsdp(torch.nn.Module):
        class ddp_config:
            use_megatron_fsdp = True

    with pytest.raises(NotImplementedError, match="verl_mfsdp.offload_megatron_fsdp_model"):
        offload_megatron_model(FakeFsdp())


def test_missing_checkpoint_names_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match=f"no Megatron-FSDP checkpoint at '{missing}'"):
        verl_mfsdp.load_megatron_fsdp_checkpoint([torch.nn.Linear(2, 2)], None, path=missing)


def test_incomplete_checkpoint_names_the_missing_files(tmp_path: Path) -> None:
    (tmp_path / ".metadata").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=f"missing {checkpoint.CHECKPOINT_INFO_FILE}"):
        verl_mfsdp.read_megatron_fsdp_checkpoint_info(tmp_path)


def _write_info(path: Path, **layout: object) -> None:
    (path / ".metadata").write_bytes(b"")
    info = {"format": checkpoint._FORMAT, "layout": layout, "step": 7, "extra": {"k": 1}}
    (path / checkpoint.CHECKPOINT_INFO_FILE).write_text(json.dumps(info))


LAYOUT = {
    "world_size": 2,
    "data_parallel_size": 2,
    "tensor_model_parallel_size": 1,
    "data_parallel_sharding_strategy": "optim_grads_params",
    "num_model_chunks": 1,
    "num_optimizers": 1,
}


def test_info_round_trip(tmp_path: Path) -> None:
    _write_info(tmp_path, **LAYOUT)
    info = verl_mfsdp.read_megatron_fsdp_checkpoint_info(tmp_path)
    assert info["step"] == 7 and info["extra"] == {"k": 1}
    checkpoint._check_layout(info, LAYOUT, path=tmp_path)  # same layout: no error


def test_layout_mismatch_names_keys_and_path(tmp_path: Path) -> None:
    _write_info(tmp_path, **{**LAYOUT, "world_size": 4, "data_parallel_size": 4})
    info = verl_mfsdp.read_megatron_fsdp_checkpoint_info(tmp_path)
    with pytest.raises(ValueError) as err:
        checkpoint._check_layout(info, {**LAYOUT, "data_parallel_sharding_strategy": "optim"}, path=tmp_path)
    msg = str(err.value)
    assert str(tmp_path) in msg
    assert "world_size: checkpoint 4, now 2" in msg
    assert "data_parallel_size: checkpoint 4, now 2" in msg
    assert "data_parallel_sharding_strategy: checkpoint 'optim_grads_params', now 'optim'" in msg


def test_foreign_format_is_refused(tmp_path: Path) -> None:
    (tmp_path / ".metadata").write_bytes(b"")
    (tmp_path / checkpoint.CHECKPOINT_INFO_FILE).write_text(json.dumps({"format": "other"}))
    with pytest.raises(ValueError, match="has format 'other'"):
        verl_mfsdp.read_megatron_fsdp_checkpoint_info(tmp_path)
