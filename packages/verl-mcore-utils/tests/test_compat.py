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


_BUILD_QUIETLY = """
import socket, os, warnings
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
import verl_mcore_utils
from verl_mcore_utils.model import build_gpt_model
from verl_mcore_utils.parallel import init_parallel
from verl_mcore_utils.presets import qwen2_preset
from verl_mcore_utils.transformer_config import hf_to_transformer_config
init_parallel(device="cpu")
hf = qwen2_preset("tiny", vocab_size=128)
build_gpt_model(hf_config=hf, tf_config=hf_to_transformer_config(hf, dtype="float32"), device="cpu")
warnings.warn("the program's own warning")
"""


@pytest.mark.above_engine  # ~35 s each (a fresh interpreter imports megatron-core); the notices are 0.19's
@pytest.mark.parametrize("show", [False, True])
def test_megatron_fallback_notices_are_muted_unless_asked_for(show: bool) -> None:
    """Importing every package and building a model prints none of megatron-core's notices about running
    without Transformer Engine / Apex / absl (our design), while the program's own warnings still show;
    VERL_MEGATRON_NOTICES=1 keeps the notices."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "VERL_MEGATRON_NOTICES": "1" if show else "0", "PYTHONWARNINGS": ""}
    out = subprocess.run(
        [sys.executable, "-c", _BUILD_QUIETLY], capture_output=True, text=True, env=env, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "the program's own warning" in out.stderr
    notices = ("Apex are not installed", "Apex is not installed", "absl.logging", "GPTModel IS DEPRECATED")
    shown = [n for n in notices if n in out.stderr]
    if show:
        assert shown == list(notices), out.stderr[-3000:]
    else:
        assert shown == [], out.stderr[-3000:]
