"""Mixture-of-experts: a Hugging Face Qwen3-MoE checkpoint as megatron-core MoE layers, fp32 on CPU.

Real transformers and real megatron-core (router, sequential experts, the all-gather token dispatcher on
gloo), one process. Checked, for both routings of Qwen3-MoE (``norm_topk_prob`` true: the top-k weights
renormalised; false: raw softmax weights):

* logits equal transformers' on the same checkpoint, ``max|megatron - hf| / max|hf|`` <= 1e-5;
* exporting the loaded model gives back every tensor of the checkpoint bit for bit, and the export saved as a
  checkpoint loads in transformers with the same logits;
* the router's load-balancing loss reaches the router's weight in backward (megatron-core adds it through
  its aux-loss scaler), and the model's routers run on the CPU (megatron-core's move them to CUDA);
* what is not supported is refused by name: dense layers inside a Qwen3-MoE model, TP > 1 without sequence parallelism.

The router weights of the tiny checkpoint are drawn wide (``save_tiny_hf_model``) so that no top-k choice
is a near tie that fp32 rounding could flip between the two implementations.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from verl_mcore_utils.hf_testing import save_tiny_hf_model
from verl_mcore_utils.testing import run_distributed

REL_TOL = 1e-5
TOKENS = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(3))


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.double() - ref.double()).abs().max() / ref.double().abs().max())


def _hf_logits(path: str) -> torch.Tensor:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=TOKENS).logits


def _megatron_worker(rank: int, world_size: int, path: str, out_dir: str) -> dict[str, Any]:
    import json

    from megatron.core import parallel_state
    from safetensors.torch import load_file, save_file

    from verl_mcore_utils.model import build_gpt_model
    from verl_mcore_utils.moe import PortableTopKRouter
    from verl_mcore_utils.parallel import init_parallel
    from verl_mcore_utils.transformer_config import hf_to_transformer_config
    from verl_mcore_utils.weights import export_hf_weights, load_hf_weights

    init_parallel(device="cpu")
    config = json.loads((Path(path) / "config.json").read_text())
    tf = hf_to_transformer_config(config, dtype="float32")
    model = build_gpt_model(hf_config=config, tf_config=tf, device="cpu")
    load_hf_weights(model, path, hf_config=config)
    routers = [m for m in model.modules() if isinstance(m, PortableTopKRouter)]
    positions = torch.arange(TOKENS.shape[1]).expand_as(TOKENS)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=TOKENS, position_ids=positions, attention_mask=None)
    exported = dict(export_hf_weights(model, hf_config=config))
    originals = load_file(str(Path(path) / "model.safetensors"))
    exact = sorted(n for n in originals if n in exported and torch.equal(exported[n], originals[n]))
    export_dir = Path(out_dir)
    export_dir.mkdir(parents=True, exist_ok=True)
    save_file({n: t.contiguous() for n, t in exported.items()}, str(export_dir / "model.safetensors"))
    (export_dir / "config.json").write_text((Path(path) / "config.json").read_text())
    # the aux loss alone: with every other gradient path cut, only the load-balancing loss reaches the router
    model.train()
    out = model(input_ids=TOKENS, position_ids=positions, attention_mask=None)
    (out.sum() * 0.0).backward()
    router_grads = [float(r.weight.grad.abs().max()) if r.weight.grad is not None else 0.0 for r in routers]
    parallel_state.destroy_model_parallel()
    return {
        "logits": logits.detach().clone(),
        "routers": len(routers),
        "experts_per_layer": tf.num_moe_experts,
        "exported": sorted(exported),
        "originals": sorted(originals),
        "exact": exact,
        "router_grads": router_grads,
    }


@pytest.mark.parametrize("norm_topk_prob", [True, False], ids=["renormalised", "raw"])
def test_qwen3_moe_logits_export_and_reload_match_transformers(tmp_path: Path, norm_topk_prob: bool) -> None:
    path = str(save_tiny_hf_model("qwen3_moe", tmp_path / "hf", seed=11, norm_topk_prob=norm_topk_prob))
    (got,) = run_distributed(_megatron_worker, world_size=1, args=(path, str(tmp_path / "export")))
    ref = _hf_logits(path)
    err = _rel_err(got["logits"], ref)
    print(
        f"\nqwen3_moe norm_topk_prob={norm_topk_prob}: logits rel. error {err:.2e}, router grads {got['router_grads']}"
    )
    assert err <= REL_TOL, err
    assert got["routers"] == 2 and got["experts_per_layer"] == 4
    assert got["exported"] == got["originals"]  # every tensor, router and each expert's three projections
    assert got["exact"] == got["originals"]
    reloaded = _hf_logits(str(tmp_path / "export"))
    assert torch.equal(reloaded, ref)
    assert all(g > 0 for g in got["router_grads"]), got["router_grads"]


def test_routing_choice_matters(tmp_path: Path) -> None:
    """The two routings give different logits: the parity above tells them apart."""
    a = _hf_logits(str(save_tiny_hf_model("qwen3_moe", tmp_path / "a", seed=11, norm_topk_prob=True)))
    b = _hf_logits(str(save_tiny_hf_model("qwen3_moe", tmp_path / "b", seed=11, norm_topk_prob=False)))
    assert _rel_err(a, b) > 1e-2


@pytest.mark.parametrize(
    ("overrides", "tp", "message"),
    [
        ({"decoder_sparse_step": 2}, 1, "decoder_sparse_step=2"),
        ({"mlp_only_layers": [0]}, 1, "mlp_only_layers=[0]"),
        ({}, 2, "tensor_model_parallel_size=2"),
    ],
    ids=["sparse-step", "dense-layers", "tp2"],
)
def test_unsupported_moe_settings_are_refused_by_name(overrides: dict, tp: int, message: str) -> None:
    from verl_mcore_utils.hf_testing import tiny_hf_config
    from verl_mcore_utils.transformer_config import hf_to_transformer_config

    config = tiny_hf_config("qwen3_moe", **overrides)
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        hf_to_transformer_config(config, dtype="float32", tensor_model_parallel_size=tp)
