"""compat: one stable call per megatron-core difference, checked against the installed release."""

from __future__ import annotations

import pytest

from verl_mcore_utils import compat


def test_feature_detection_matches_the_installed_release() -> None:
    v = compat.mcore_version()
    assert compat.has_pg_collection() is (v.release >= (0, 15))
    assert compat.has_hybrid_cp_groups() is (v.release >= (0, 16))
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


def test_mtp_tracker_has_one_name_for_each_function() -> None:
    tracker = compat.mtp_tracker()
    assert all(callable(f) for f in (tracker.save, tracker.clean, tracker.reduce, tracker.track))
    names = {tracker.save.__name__, tracker.clean.__name__}
    expected_new = compat.mcore_version().release >= (0, 19)
    assert ("save_metrics_to_tracker" in names) is expected_new


def test_fsdp_sync_refuses_a_non_fsdp_module() -> None:
    import torch

    with pytest.raises(AttributeError, match="not a Megatron-FSDP model"):
        compat.fsdp_synchronize_param_gather(torch.nn.Linear(2, 2))


def test_megatron_mtp_scale_probe_runs_the_release_schedule() -> None:
    # Megatron-LM #3959 (MTP gradient under-scaled by the CP size) is unfixed in every release of the
    # matrix (0.14.0 to 0.19.2); the probe measures it from the installed schedule, so a release that
    # fixes it flips the answer (and the README's compatibility table must then say so).
    assert compat.megatron_mtp_scale_misses_cp() is True
