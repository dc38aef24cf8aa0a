"""GLM-4.5 (DeepSeek-V3's router and shared experts) as megatron-core MoE layers, fp32 on CPU.

A tiny random ``Glm4MoeForCausalLM`` (3 layers, the first dense; 8 experts in 2 groups, 1 group chosen, top 2;
one shared expert; ``routed_scaling_factor`` 2.5; partial RoPE 0.5; q/k/v biases; a random non-zero
``e_score_correction_bias``) through real transformers and real megatron-core, one process. Checked, with grouped
experts (the default) and sequential ones:

* logits equal transformers' on the same checkpoint, ``max|megatron - hf| / max|hf|`` <= 1e-5;
* exporting the loaded model gives back every tensor of the checkpoint bit for bit (the expert bias included),
  and the export saved as a checkpoint loads in transformers with the same logits;
* the routers are megatron-core's sigmoid routers with their expert bias on the CPU (0.19 allocates it on CUDA);
* the expert bias and the group limit change the logits (the parity above sees them);
* what megatron-core computes differently is refused by name (group ranking other than the best 2, top-k
  renormalisation other than megatron-core's, TP > 1).
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

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=TOKENS).logits


def _megatron_worker(rank: int, world_size: int, path: str, out_dir: str, grouped: bool) -> dict[str, Any]:
    import json

    from megatron.core import parallel_state
    from safetensors.torch import load_file, save_file

    from verl_mcore_utils.grouped_experts import GroupedExperts
    from verl_mcore_utils.model import build_gpt_model
    from verl_mcore_utils.moe import PortableTopKRouter
    from verl_mcore_utils.parallel import init_parallel
    from verl_mcore_utils.transformer_config import hf_to_transformer_config
    from verl_mcore_utils.weights import export_hf_weights, load_hf_weights

    init_parallel(device="cpu")
    config = json.loads((Path(path) / "config.json").read_text())
    tf = hf_to_transformer_config(config, dtype="float32", overrides={"moe_grouped_gemm": grouped})
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
    layers = [type(layer.mlp).__name__ for layer in model.decoder.layers]
    parallel_state.destroy_model_parallel()
    return {
        "logits": logits.detach().clone(),
        "routers": len(routers),
        "bias_devices": sorted({str(r.expert_bias.device) for r in routers}),
        "bias_nonzero": all(bool(r.expert_bias.abs().sum() > 0) for r in routers),
        "score_functions": sorted({r.score_function for r in routers}),
        "grouped": any(isinstance(m, GroupedExperts) for m in model.modules()),
        "shared": sum(
            getattr(layer.mlp, "shared_experts", None) is not None for layer in model.decoder.layers
        ),
        "layers": layers,
        "exported": sorted(exported),
        "originals": sorted(originals),
        "exact": exact,
    }


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "sequential"])
def test_glm4_moe_logits_export_and_reload_match_transformers(tmp_path: Path, grouped: bool) -> None:
    path = str(save_tiny_hf_model("glm4_moe", tmp_path / "hf", seed=11))
    (got,) = run_distributed(_megatron_worker, world_size=1, args=(path, str(tmp_path / "export"), grouped))
    ref = _hf_logits(path)
    err = _rel_err(got["logits"], ref)
    print(f"\nglm4_moe grouped={grouped}: logits rel. error {err:.2e}")
    assert err <= REL_TOL, err
    assert got["layers"] == ["FusedSwiGLUMLP", "MoELayer", "MoELayer"]  # first_k_dense_replace=1
    assert got["routers"] == 2 and got["shared"] == 2 and got["grouped"] is grouped
    assert got["bias_devices"] == ["cpu"] and got["bias_nonzero"] and got["score_functions"] == ["sigmoid"]
    assert got["exported"] == got["originals"]  # expert bias, shared experts, dense MLP, biases
    assert got["exact"] == got["originals"]
    reloaded = _hf_logits(str(tmp_path / "export"))
    assert torch.equal(reloaded, ref)


def test_expert_bias_and_group_limit_change_the_logits(tmp_path: Path) -> None:
    """The parity above would notice a router that ignored the expert bias or the group limit."""
    import transformers

    path = save_tiny_hf_model("glm4_moe", tmp_path / "hf", seed=11)
    ref = _hf_logits(str(path))
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for layer in model.model.layers[1:]:
        layer.mlp.gate.e_score_correction_bias.zero_()
    with torch.no_grad():
        unbiased = model(input_ids=TOKENS).logits
    ungrouped_path = save_tiny_hf_model("glm4_moe", tmp_path / "ungrouped", seed=11, topk_group=2)
    assert _rel_err(unbiased, ref) > 1e-2
    assert _rel_err(_hf_logits(str(ungrouped_path)), ref) > 1e-2


@pytest.mark.parametrize(
    ("overrides", "tp", "message"),
    [
        ({"n_group": 4, "topk_group": 2, "num_experts_per_tok": 2}, 1, "sum of its 2 best scores"),
        ({"norm_topk_prob": False}, 1, "norm_topk_prob=False"),
        ({"num_experts_per_tok": 1}, 1, "num_experts_per_tok=1"),
        ({"n_group": 3}, 1, "n_group=3"),
    ],
    ids=["group-rank", "no-renorm", "top1-renorm", "groups-divide"],
)
def test_unsupported_glm_settings_are_refused_by_name(overrides: dict, tp: int, message: str) -> None:
    from verl_mcore_utils.hf_testing import tiny_hf_config
    from verl_mcore_utils.transformer_config import hf_to_transformer_config

    config = tiny_hf_config("glm4_moe", **overrides)
    with pytest.raises(ValueError, match=message):
        hf_to_transformer_config(config, dtype="float32", tensor_model_parallel_size=tp)
