"""The fused SwiGLU MLP: in the local layer spec on every megatron-core release, and megatron-core's own
forward wherever the Triton kernel does not apply (CPU here; the kernel itself is checked against the
torch form on a GPU in test_gpu_swiglu.py)."""

from __future__ import annotations

import functools

import pytest
import torch
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.spec_utils import ModuleSpec

from verl_mcore_utils.compat import with_mlp_class
from verl_mcore_utils.presets import qwen2_preset
from verl_mcore_utils.swiglu import FusedSwiGLUMLP, fused_swiglu, fused_swiglu_applies
from verl_mcore_utils.testing import run_distributed
from verl_mcore_utils.transformer_config import hf_to_transformer_config


def test_torch_form_off_cuda() -> None:
    x = torch.randn(5, 3, 16, requires_grad=True)
    assert not fused_swiglu_applies(x)
    gate, up = x.detach().chunk(2, dim=-1)
    torch.testing.assert_close(fused_swiglu(x), torch.nn.functional.silu(gate) * up, rtol=0, atol=0)


def test_other_mlp_entries_are_left_alone() -> None:
    class Other(torch.nn.Module):
        pass

    spec = ModuleSpec(module=Other)
    assert with_mlp_class(spec, base=MLP, cls=FusedSwiGLUMLP) is spec
    other = functools.partial(print, "x")
    assert with_mlp_class(other, base=MLP, cls=FusedSwiGLUMLP) is other


def _models(rank: int, world_size: int) -> dict[str, object]:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from verl_mcore_utils.attention import SDPACoreAttention
    from verl_mcore_utils.model import build_gpt_model, local_layer_spec
    from verl_mcore_utils.parallel import init_parallel

    init_parallel(device="cpu")
    hf = qwen2_preset("tiny", vocab_size=128)
    tf = hf_to_transformer_config(hf, dtype="float32")
    plain = get_gpt_layer_local_spec(normalization="RMSNorm")
    plain.submodules.self_attention.submodules.core_attention = SDPACoreAttention
    out: dict[str, object] = {}
    tokens = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(12).expand(2, 12)
    for name, spec in (("fused", local_layer_spec(tf)), ("plain", plain)):
        torch.manual_seed(0)
        model = build_gpt_model(hf_config=hf, tf_config=tf, device="cpu", layer_spec=spec)
        mlp = model.decoder.layers[0].mlp
        loss = model(input_ids=tokens, position_ids=positions, attention_mask=None, labels=tokens).mean()
        loss.backward()
        out[name] = {
            "type": type(mlp).__name__,
            "is_mlp": isinstance(mlp, MLP),
            "loss": float(loss),
            "state_keys": sorted(model.state_dict()),
            "fc1_grad": model.decoder.layers[0].mlp.linear_fc1.weight.grad.clone(),
        }
    return out


def test_local_spec_builds_the_fused_mlp_with_megatrons_math_on_cpu() -> None:
    (out,) = run_distributed(_models, world_size=1)
    fused, plain = out["fused"], out["plain"]
    assert fused["type"] == "FusedSwiGLUMLP" and fused["is_mlp"]
    assert plain["type"] == "MLP"
    assert fused["state_keys"] == plain["state_keys"]  # checkpoints are MLP's
    assert fused["loss"] == plain["loss"]
    torch.testing.assert_close(fused["fc1_grad"], plain["fc1_grad"], rtol=0, atol=0)


_INTERPRETED = """
import torch
from verl_mcore_utils.swiglu import _SwiGLU

g = torch.Generator().manual_seed(0)
for shape in [(7, 2 * 1500), (2, 3, 2 * 5)]:
    x0 = 4 * torch.randn(shape, generator=g)
    grad = torch.randn((*shape[:-1], shape[-1] // 2), generator=g)
    x = x0.clone().requires_grad_()
    y = _SwiGLU.apply(x)
    y.backward(grad)
    xr = x0.clone().requires_grad_()
    gate, up = xr.chunk(2, dim=-1)
    yr = torch.nn.functional.silu(gate) * up
    yr.backward(grad)
    torch.testing.assert_close(y, yr, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-5, atol=1e-5)
print("ok")
"""


@pytest.mark.newest_mcore  # the kernel against its torch form: no megatron-core in it
def test_kernel_matches_the_torch_form_in_triton_interpreter() -> None:
    """The Triton kernels' formulas (forward, both halves of backward) on the CPU: ``TRITON_INTERPRET=1``
    runs them with numpy; it must be set before Triton is imported, hence a fresh process. float32: 1e-6."""
    import os
    import subprocess
    import sys

    import pytest

    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, "-c", _INTERPRETED], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


_MODEL_INTERPRETED = """
import tempfile

import torch
import torch.distributed as dist

from verl_mcore_utils import swiglu
from verl_mcore_utils.lora import peft_pre_wrap_hook
from verl_mcore_utils.model import build_gpt_model
from verl_mcore_utils.parallel import init_parallel
from verl_mcore_utils.presets import qwen2_preset
from verl_mcore_utils.transformer_config import hf_to_transformer_config

dist.init_process_group("gloo", store=dist.FileStore(tempfile.mktemp(), 1), rank=0, world_size=1)
init_parallel(device="cpu")
hf = qwen2_preset("tiny", vocab_size=128)
tokens = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
positions = torch.arange(12).expand(2, 12)
results = {}
for lora in (False, True):
    for name in ("kernel", "torch"):
        torch.manual_seed(0)
        model = build_gpt_model(hf_config=hf, tf_config=hf_to_transformer_config(hf, dtype="float32"), device="cpu")
        if lora:
            (model,) = peft_pre_wrap_hook({"rank": 4, "alpha": 8, "lora_B_init_method": "normal"}, verbose=False)([model])
        run = lambda: model(input_ids=tokens, position_ids=positions, attention_mask=None, labels=tokens).mean()
        if name == "torch":
            with swiglu.torch_form_only():
                loss = run()
                loss.backward()
        else:
            loss = run()
            loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results[(lora, name)] = (float(loss), grads)
    (lk, gk), (lt, gt) = results[(lora, "kernel")], results[(lora, "torch")]
    assert abs(lk - lt) <= 1e-5 * abs(lt), (lora, lk, lt)
    assert gk.keys() == gt.keys() and len(gk) > 0
    for n in gt:
        torch.testing.assert_close(gk[n], gt[n], rtol=1e-5, atol=1e-6, msg=n)
assert swiglu._kernels.cache_info().currsize == 1  # the kernels were built, i.e. the fused path ran
print("ok")
"""


def test_fused_mlp_in_a_model_with_and_without_lora_in_triton_interpreter() -> None:
    """The fused branch of FusedSwiGLUMLP inside a megatron-core GPTModel (fc1 -> kernel -> fc2), with peft's
    LoRA adapters on fc1 / fc2 and without, equals megatron-core's forward in loss and every gradient (fp32,
    1e-5): the plumbing the GPU runs, executed on the CPU by Triton's interpreter in a fresh process."""
    import os
    import subprocess
    import sys

    import pytest

    pytest.importorskip("triton")
    pytest.importorskip("peft")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, "-c", _MODEL_INTERPRETED], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
