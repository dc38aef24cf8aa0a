"""Grouped experts (``torch._grouped_mm``) against megatron-core's sequential experts, fp32 on CPU.

Real megatron-core, real transformers, one gloo process. Checked:

* :class:`GroupedExperts` and megatron-core's ``SequentialMLP`` holding the same weights (both loaded from one
  Hugging Face checkpoint) give the same output and the same gradients of the input, of the routing
  probabilities and of every expert weight, ``max|grouped - sequential| / max|sequential|`` <= 1e-5, with
  uneven token counts and an expert that gets no token (its weight gradient is exactly zero);
* a tiny Qwen3-MoE built with grouped experts (``moe_grouped_gemm=True``, the default for MoE models, as in
  verl) gives transformers' logits (1e-5) and exports the checkpoint's tensors bit for bit: each Hugging
  Face expert tensor is a slice of the stacked parameter, both ways;
* what GroupedExperts does not do is refused by name (expert tensor parallelism, expert biases).

Runs on megatron-core 0.14 and 0.19 (the layer spec keeps experts differently in the two).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from verl_mcore_utils.hf_testing import save_tiny_hf_model
from verl_mcore_utils.testing import run_distributed

REL_TOL = 1e-5
TOKENS = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(3))
# 4 local experts: uneven counts and one expert with no token
TOKENS_PER_EXPERT = [5, 0, 9, 3]


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    scale = ref.double().abs().max()
    return float((got.double() - ref.double()).abs().max() / scale) if scale > 0 else float(got.abs().max())


def _build(path: str, grouped: bool, **overrides: Any) -> Any:
    from verl_mcore_utils.model import build_gpt_model
    from verl_mcore_utils.transformer_config import hf_to_transformer_config
    from verl_mcore_utils.weights import load_hf_weights

    config = json.loads((Path(path) / "config.json").read_text())
    tf = hf_to_transformer_config(
        config, dtype="float32", overrides={"moe_grouped_gemm": grouped, **overrides}
    )
    model = build_gpt_model(hf_config=config, tf_config=tf, device="cpu")
    load_hf_weights(model, path, hf_config=config)
    return model, config


def _expert_step(experts: torch.nn.Module, hidden: torch.Tensor, probs: torch.Tensor) -> dict[str, Any]:
    hidden = hidden.clone().requires_grad_(True)
    probs = probs.clone().requires_grad_(True)
    out, bias = experts(hidden, torch.tensor(TOKENS_PER_EXPERT), probs)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(5)))
    return {"out": out.detach(), "bias": bias, "d_hidden": hidden.grad, "d_probs": probs.grad}


def _modules_worker(rank: int, world_size: int, path: str, overrides: dict[str, Any]) -> dict[str, Any]:
    from megatron.core import parallel_state

    from verl_mcore_utils.grouped_experts import GroupedExperts
    from verl_mcore_utils.parallel import init_parallel

    init_parallel(device="cpu")
    seq_model, _ = _build(path, grouped=False, **overrides)
    grp_model, _ = _build(path, grouped=True, **overrides)
    seq = seq_model.decoder.layers[0].mlp.experts
    grp = grp_model.decoder.layers[0].mlp.experts
    assert isinstance(grp, GroupedExperts) and not isinstance(seq, GroupedExperts)
    gen = torch.Generator().manual_seed(4)
    rows = sum(TOKENS_PER_EXPERT)
    hidden = torch.randn(rows, seq.config.hidden_size, generator=gen)
    probs = torch.rand(rows, generator=gen)
    ref = _expert_step(seq, hidden, probs)
    got = _expert_step(grp, hidden, probs)
    ref["d_fc1"] = torch.stack([e.linear_fc1.weight.grad for e in seq.local_experts])
    ref["d_fc2"] = torch.stack([e.linear_fc2.weight.grad for e in seq.local_experts])
    got["d_fc1"] = grp.linear_fc1_weight.grad
    got["d_fc2"] = grp.linear_fc2_weight.grad
    names = sorted(n for n, _ in grp.named_parameters())
    parallel_state.destroy_model_parallel()
    return {"ref": ref, "got": got, "names": names}


@pytest.mark.parametrize(
    ("hf_overrides", "overrides"),
    [({}, {}), ({"num_experts_per_tok": 1}, {"moe_apply_probs_on_input": True})],
    ids=["top2", "top1-probs-on-input"],
)
def test_grouped_experts_match_sequential_forward_and_backward(
    tmp_path: Path, hf_overrides: dict, overrides: dict
) -> None:
    path = str(save_tiny_hf_model("qwen3_moe", tmp_path / "hf", seed=11, **hf_overrides))
    (res,) = run_distributed(_modules_worker, world_size=1, args=(path, overrides))
    ref, got = res["ref"], res["got"]
    assert res["names"] == ["linear_fc1_weight", "linear_fc2_weight"]
    assert ref["bias"] is None and got["bias"] is None
    errs = {k: _rel_err(got[k], ref[k]) for k in ("out", "d_hidden", "d_probs", "d_fc1", "d_fc2")}
    print(f"\ngrouped vs sequential experts, fp32 CPU, rel. errors: {errs}")
    assert all(e <= REL_TOL for e in errs.values()), errs
    empty = TOKENS_PER_EXPERT.index(0)
    assert not got["d_fc1"][empty].any() and not got["d_fc2"][empty].any()
    assert ref["d_fc1"][empty].abs().max() == 0


def _model_worker(rank: int, world_size: int, path: str) -> dict[str, Any]:
    from megatron.core import parallel_state
    from safetensors.torch import load_file

    from verl_mcore_utils.grouped_experts import GroupedExperts
    from verl_mcore_utils.parallel import init_parallel
    from verl_mcore_utils.weights import export_hf_weights

    init_parallel(device="cpu")
    model, config = _build(path, grouped=True)
    grouped = sum(isinstance(m, GroupedExperts) for m in model.modules())
    positions = torch.arange(TOKENS.shape[1]).expand_as(TOKENS)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=TOKENS, position_ids=positions, attention_mask=None)
    exported = dict(export_hf_weights(model, hf_config=config))
    originals = load_file(str(Path(path) / "model.safetensors"))
    exact = sorted(n for n in originals if n in exported and torch.equal(exported[n], originals[n]))
    parallel_state.destroy_model_parallel()
    return {
        "logits": logits.clone(),
        "grouped": grouped,
        "exported": sorted(exported),
        "originals": sorted(originals),
        "exact": exact,
    }


def test_qwen3_moe_with_grouped_experts_matches_transformers_and_exports_the_checkpoint(
    tmp_path: Path,
) -> None:
    import transformers

    path = str(save_tiny_hf_model("qwen3_moe", tmp_path / "hf", seed=11))
    (got,) = run_distributed(_model_worker, world_size=1, args=(path,))
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(input_ids=TOKENS).logits
    err = _rel_err(got["logits"], ref)
    print(f"\nqwen3_moe with grouped experts: logits rel. error {err:.2e}")
    assert got["grouped"] == 2
    assert err <= REL_TOL, err
    assert got["exported"] == got["originals"]
    assert got["exact"] == got["originals"]


def _swap_worker(rank: int, world_size: int, path: str) -> dict[str, Any]:
    from megatron.core import parallel_state

    from verl_mcore_utils.grouped_experts import swap_in_grouped_experts
    from verl_mcore_utils.parallel import init_parallel
    from verl_mcore_utils.weights import export_hf_weights

    init_parallel(device="cpu")
    model, config = _build(path, grouped=False)
    positions = torch.arange(TOKENS.shape[1]).expand_as(TOKENS)
    model.eval()
    with torch.no_grad():
        before = model(input_ids=TOKENS, position_ids=positions, attention_mask=None)
        swapped = swap_in_grouped_experts(model)
        after = model(input_ids=TOKENS, position_ids=positions, attention_mask=None)
    exported = sorted(dict(export_hf_weights(model, hf_config=config)))
    names = sorted(n for n, _ in model.named_parameters() if ".experts." in n)
    parallel_state.destroy_model_parallel()
    return {"before": before, "after": after, "swapped": swapped, "exported": exported, "names": names}


def test_swap_in_grouped_experts_keeps_the_model(tmp_path: Path) -> None:
    """A model built with sequential experts, swapped after the build: same logits, same HF export names."""
    path = str(save_tiny_hf_model("qwen3_moe", tmp_path / "hf", seed=11))
    (got,) = run_distributed(_swap_worker, world_size=1, args=(path,))
    assert got["swapped"] == 2
    assert got["names"] == [
        f"decoder.layers.{i}.mlp.experts.linear_fc{j}_weight" for i in (0, 1) for j in (1, 2)
    ]
    assert _rel_err(got["after"], got["before"]) <= REL_TOL
    assert len([n for n in got["exported"] if ".experts." in n]) == 2 * 4 * 3


def _config(**overrides: Any) -> SimpleNamespace:
    base = {
        "expert_tensor_parallel_size": 1,
        "add_bias_linear": False,
        "fp8": None,
        "fp4": None,
        "glu_linear_offset": 0.0,
        "activation_func_clamp_value": None,
        "use_te_activation_func": False,
    }
    return SimpleNamespace(**{**base, **overrides})


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"expert_tensor_parallel_size": 2}, "expert_tensor_parallel_size=2"),
        ({"add_bias_linear": True}, "add_bias_linear=True"),
        ({"fp8": "hybrid"}, "fp8"),
    ],
    ids=["etp2", "bias", "fp8"],
)
def test_unsupported_settings_are_refused_by_name(overrides: dict, message: str) -> None:
    from verl_mcore_utils.grouped_experts import GroupedExperts

    with pytest.raises(ValueError, match=message):
        GroupedExperts(4, _config(**overrides))
