"""compat: one stable call per megatron-core difference, checked against the installed release."""

from __future__ import annotations

import pytest

from verl_mcore_utils import compat


def test_packed_seq_params_fields_match_the_installed_release() -> None:
    v = compat.mcore_version()
    fields = compat.packed_seq_params_fields()
    assert {"qkv_format", "cu_seqlens_q", "cu_seqlens_kv", "max_seqlen_q"} <= set(fields)
    assert ("local_cp_size" in fields and "cp_group" in fields) is (v.release >= (0, 16))


def test_make_packed_seq_params() -> None:
    import torch

    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    p = compat.make_packed_seq_params(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=4, max_seqlen_kv=4
    )
    assert p.qkv_format == "thd" and p.max_seqlen_q == 4
    with pytest.raises(TypeError, match=r"has no field\(s\) \['not_a_field'\]"):
        compat.make_packed_seq_params(not_a_field=1)


def test_fsdp_sync_refuses_a_non_fsdp_module() -> None:
    import torch

    with pytest.raises(AttributeError, match="not a Megatron-FSDP model"):
        compat.fsdp_synchronize_param_gather(torch.nn.Linear(2, 2))
