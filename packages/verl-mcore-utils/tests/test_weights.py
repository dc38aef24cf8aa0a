"""Hugging Face <-> megatron-core weights: parity with transformers, exact export round trip, TP=2, PP=2.

Real transformers and real megatron-core, fp32 on CPU. Logit error is the relative max error
``max|megatron - hf| / max|hf|`` over all batch x position x vocabulary entries; the bound is 1e-5.
Exported tensors must equal the safetensors originals bit for bit (torch.equal).

Spawning a process costs ~8 s (the megatron import), so there is one spawned run of 2 gloo processes that
does every distributed check (TP=1 x DP=2, then TP=2, then PP=2) and returns plain numpy arrays / strings
(torch tensors in the result queue would need the worker alive to be read); the tests assert on those.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from verl_mcore_utils.hf_testing import save_tiny_hf_model
from verl_mcore_utils.testing import run_distributed
from verl_mcore_utils.weights import (
    LAYER_MODULE_MAP,
    hf_tensor_shapes,
    merge_gate_up,
    merge_qkv,
    param_mappings,
    split_gate_up,
    split_qkv,
)

REL_TOL = 1e-5  # max|megatron - hf| / max|hf|
VOCAB = 128
# key -> (model_type, tie_word_embeddings)
CASES: dict[str, tuple[str, bool]] = {
    "qwen2": ("qwen2", False),
    "qwen2_tied": ("qwen2", True),
    "qwen3": ("qwen3", False),
    "llama": ("llama", False),
}
TOKENS = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(7))


def _rel_err(got: np.ndarray, ref: torch.Tensor) -> float:
    return float((torch.from_numpy(got) - ref).abs().max() / ref.abs().max())


# ----------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Tiny random checkpoints, their tensors, configs (plain dicts) and transformers' reference logits."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file

    root = tmp_path_factory.mktemp("hf")
    out: dict[str, dict[str, Any]] = {}
    for seed, (key, (model_type, tied)) in enumerate(CASES.items()):
        path = save_tiny_hf_model(model_type, root / key, tie_word_embeddings=tied, seed=seed)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path, torch_dtype=torch.float32, attn_implementation="eager"
        ).eval()
        with torch.no_grad():
            ref = model(input_ids=TOKENS).logits
        out[key] = {
            "path": str(path),
            "config": model.config.to_dict(),
            "tensors": load_file(str(path / "model.safetensors")),
            "ref_logits": ref,
        }
    return out


@pytest.fixture(scope="module")
def ranks(
    checkpoints: dict[str, dict[str, Any]], tmp_path_factory: pytest.TempPathFactory
) -> list[dict[str, Any]]:
    """Per-rank results of the one spawned 2-process run (TP=1 x DP=2, then TP=2, then PP=2)."""
    cases = {k: {"path": v["path"], "config": v["config"]} for k, v in checkpoints.items()}
    out_dir = tmp_path_factory.mktemp("saved")
    results = run_distributed(_worker, world_size=2, args=(cases, str(out_dir)), timeout_s=300)
    for result in results:
        result["single"]["out_dir"] = str(out_dir)
    return results


@pytest.fixture(scope="module")
def single(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """Rank 0's TP=1 results (rank 1's are checked equal in test_data_parallel_replicas_agree)."""
    return ranks[0]["single"]


# ----------------------------------------------------------------------------------------------- workers


def _build(case: dict[str, Any], *, dtype: str = "float32", **kwargs: Any) -> Any:
    from verl_mcore_utils.model import build_gpt_model
    from verl_mcore_utils.transformer_config import hf_to_transformer_config

    pp = kwargs.pop("pipeline_model_parallel_size", 1)
    tf = hf_to_transformer_config(
        case["config"],
        dtype=dtype,
        tensor_model_parallel_size=kwargs.pop("tensor_model_parallel_size", 1),
        pipeline_model_parallel_size=pp,
        # megatron-core requires pipeline_dtype with PP > 1; hf_to_transformer_config does not set it
        overrides={"pipeline_dtype": torch.float32} if pp > 1 else None,
    )
    return build_gpt_model(hf_config=case["config"], tf_config=tf, device="cpu", **kwargs).eval()


def _forward(model: Any, input_ids: torch.Tensor | None) -> torch.Tensor:
    positions = torch.arange(TOKENS.shape[1]).expand_as(TOKENS)
    with torch.no_grad():
        return model(input_ids=input_ids, position_ids=positions, attention_mask=None)


def _export(model: Any, config: dict[str, Any]) -> dict[str, np.ndarray]:
    from verl_mcore_utils.weights import export_hf_weights

    out: dict[str, np.ndarray] = {}
    for name, tensor in export_hf_weights(model, hf_config=config):
        assert name not in out, f"{name} exported twice"
        out[name] = tensor.float().numpy().copy()
    return out


def _error(fn: Any) -> str:
    try:
        fn()
    except (ValueError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _tp1_checks(cases: dict[str, dict[str, Any]], out_dir: str) -> dict[str, Any]:
    """TP=1, PP=1 (each rank a data-parallel replica): parity, export, save, wrapper, errors."""
    from megatron.core.transformer.module import Float16Module
    from safetensors.torch import load_file

    from verl_mcore_utils.transformer_config import hf_to_transformer_config
    from verl_mcore_utils.weights import load_hf_weights, save_hf_weights

    result: dict[str, Any] = {"logits": {}, "export": {}, "errors": {}}
    for key, case in cases.items():
        torch.manual_seed(100)  # megatron's own random init, overwritten by the load
        model = _build(case)
        load_hf_weights(model, case["path"], hf_config=case["config"])
        result["logits"][key] = _forward(model, TOKENS).numpy()
        result["export"][key] = _export([model], case["config"])
        # every rank calls save_hf_weights; global rank 0 writes
        if key == "qwen2_tied":  # one file, tied: HF must re-tie lm_head on load
            save_hf_weights(model, Path(out_dir) / key, hf_config=case["config"])
        if key == "llama":  # several shards + index, read back by our own loader
            saved = save_hf_weights(
                model, Path(out_dir) / key, hf_config=case["config"], max_shard_bytes=40_000
            )
            reloaded = _build(case)
            load_hf_weights(reloaded, saved, hf_config=case["config"])
            result["sharded_reload_logits"] = _forward(reloaded, TOKENS).numpy()

    # Float16Module wrapper, bf16 parameters: unwrapped through .module, dtype kept (values rounded once).
    qwen3 = cases["qwen3"]
    bf16 = Float16Module(hf_to_transformer_config(qwen3["config"], dtype="bfloat16"), _build(qwen3))
    load_hf_weights(bf16, qwen3["path"], hf_config=qwen3["config"])
    dtypes = {str(p.dtype) for p in bf16.parameters()}
    exported = dict(_export_raw(torch.nn.ModuleList([bf16]), qwen3["config"]))  # chunks as a ModuleList
    originals = load_file(str(Path(qwen3["path"]) / "model.safetensors"))
    result["bf16"] = {
        "param_dtypes": sorted(dtypes),
        "export_dtypes": sorted({str(t.dtype) for t in exported.values()}),
        "mismatch": sorted(n for n, t in exported.items() if not torch.equal(t, originals[n].bfloat16())),
    }

    # Error cases, from a Mapping source built from the real checkpoint.
    llama = cases["llama"]
    tensors = load_file(str(Path(llama["path"]) / "model.safetensors"))
    model = _build(llama)
    missing = {k: v for k, v in tensors.items() if k != "model.layers.1.mlp.up_proj.weight"}
    bad_shape = {**tensors, "model.layers.0.self_attn.k_proj.weight": torch.zeros(33, 64)}
    unexpected = {**tensors, "model.layers.2.mlp.up_proj.weight": torch.zeros(160, 64)}
    result["errors"]["missing"] = _error(lambda: load_hf_weights(model, missing, hf_config=llama["config"]))
    result["errors"]["shape"] = _error(lambda: load_hf_weights(model, bad_shape, hf_config=llama["config"]))
    result["errors"]["unexpected"] = _error(
        lambda: load_hf_weights(model, unexpected, hf_config=llama["config"])
    )
    qwen2_model = _build(cases["qwen2"])  # has QKV biases that a llama config does not describe
    result["errors"]["model_mismatch"] = _error(
        lambda: load_hf_weights(qwen2_model, tensors, hf_config=llama["config"])
    )
    result["errors"]["not_gpt"] = _error(
        lambda: load_hf_weights(torch.nn.Linear(2, 2), tensors, hf_config=llama["config"])
    )
    # a good Mapping load still works after the failed ones
    load_hf_weights(model, tensors, hf_config=llama["config"])
    result["mapping_load_logits"] = _forward(model, TOKENS).numpy()
    return result


def _export_raw(model: Any, config: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
    from verl_mcore_utils.weights import export_hf_weights

    return [(n, t.clone()) for n, t in export_hf_weights(model, hf_config=config)]


def _gather_vocab(logits: torch.Tensor) -> torch.Tensor:
    """GPTModel returns this TP rank's vocabulary slice; concatenate the slices.

    A plain all_gather, not megatron's gather_from_tensor_model_parallel_region (parallel_output=False):
    that one allocates its output on torch.cuda.current_device() and fails on a CPU-only host.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    parts = [torch.empty_like(logits) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, logits.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def _worker(rank: int, world_size: int, cases: dict[str, dict[str, Any]], out_dir: str) -> dict[str, Any]:
    """All multi-process checks in one spawned run (the megatron import is paid once per process)."""
    import time

    import torch.distributed as dist
    from megatron.core import parallel_state

    from verl_mcore_utils.parallel import init_parallel
    from verl_mcore_utils.weights import load_hf_weights

    seconds: dict[str, float] = {}
    start = time.perf_counter()
    init_parallel(device="cpu")  # TP=1, PP=1, DP=2
    out: dict[str, Any] = {"single": _tp1_checks(cases, out_dir), "tp": {}, "pp": {}, "seconds": seconds}
    parallel_state.destroy_model_parallel()
    seconds["tp1"] = time.perf_counter() - start

    # TP=2 (sequence_parallel stays off: the local spec's torch norms need it off).
    start = time.perf_counter()
    init_parallel(tensor_model_parallel_size=2, device="cpu")
    for key, case in cases.items():
        torch.manual_seed(100 + rank)
        model = _build(case, tensor_model_parallel_size=2)
        load_hf_weights(model, case["path"], hf_config=case["config"])
        out["tp"][key] = {
            "logits": _gather_vocab(_forward(model, TOKENS)).numpy(),
            "export": _export(model, case["config"]),
        }
    # megatron-style padded vocabulary: 132 rows = 66 per rank, 4 padding rows.
    llama = cases["llama"]
    padded = _build(llama, tensor_model_parallel_size=2, vocab_size=132)
    load_hf_weights(padded, llama["path"], hf_config=llama["config"])
    out["tp_padded"] = {
        "logits": _gather_vocab(_forward(padded, TOKENS)).numpy(),
        "export": _export(padded, llama["config"]),
    }
    parallel_state.destroy_model_parallel()
    seconds["tp2"] = time.perf_counter() - start

    # PP=2: stage 0 holds the embedding and layer 0, stage 1 layer 1, final norm and lm_head. The pipeline
    # schedules need CUDA, so the activation is passed by hand. Tied embeddings are left out: with PP > 1
    # megatron-core's setup_embeddings_and_output_layer moves the last stage's embedding copy to CUDA.
    start = time.perf_counter()
    init_parallel(pipeline_model_parallel_size=2, device="cpu")
    first = parallel_state.is_pipeline_first_stage()
    for key, case in cases.items():
        if case["config"]["tie_word_embeddings"]:
            continue
        model = _build(case, pipeline_model_parallel_size=2, pre_process=first, post_process=not first)
        load_hf_weights(model, case["path"], hf_config=case["config"])
        entry: dict[str, Any] = {"layers": [layer.layer_number for layer in model.decoder.layers]}
        if first:
            hidden = _forward(model, TOKENS)
            dist.send(hidden.contiguous(), dst=1)
        else:
            hidden = torch.empty(TOKENS.shape[1], TOKENS.shape[0], model.config.hidden_size)
            dist.recv(hidden, src=0)
            model.set_input_tensor(hidden)
            entry["logits"] = _forward(model, None).numpy()
        entry["export"] = _export(model, case["config"])
        out["pp"][key] = entry
    seconds["pp2"] = time.perf_counter() - start
    return out


# ----------------------------------------------------------------------------------------------- tests


def test_qkv_layout_is_interleaved_per_query_group() -> None:
    # 4 query heads, 2 groups, head_dim 1: rows q0 q1 k0 v0 | q2 q3 k1 v1.
    q = torch.tensor([[10.0], [11.0], [12.0], [13.0]])
    k = torch.tensor([[20.0], [21.0]])
    v = torch.tensor([[30.0], [31.0]])
    fused = merge_qkv(q, k, v, num_heads=4, num_query_groups=2, head_dim=1)
    assert fused.flatten().tolist() == [10, 11, 20, 30, 12, 13, 21, 31]
    for got, want in zip(
        split_qkv(fused, num_heads=4, num_query_groups=2, head_dim=1), (q, k, v), strict=True
    ):
        assert torch.equal(got, want)
    bias = torch.arange(12.0)  # 1-D (bias) tensors, head_dim 2
    parts = split_qkv(bias, num_heads=2, num_query_groups=2, head_dim=2)
    assert torch.equal(merge_qkv(*parts, num_heads=2, num_query_groups=2, head_dim=2), bias)
    with pytest.raises(ValueError, match="num_heads=3 is not a multiple of num_query_groups=2"):
        merge_qkv(q, k, v, num_heads=3, num_query_groups=2, head_dim=1)
    gate, up = torch.randn(6, 4), torch.randn(6, 4)
    fc1 = merge_gate_up(gate, up)
    assert torch.equal(fc1[:6], gate) and torch.equal(fc1[6:], up)
    assert all(torch.equal(a, b) for a, b in zip(split_gate_up(fc1), (gate, up), strict=True))


def test_mapping_table(checkpoints: dict[str, dict[str, Any]]) -> None:
    assert LAYER_MODULE_MAP == {
        "self_attention.linear_qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        "self_attention.linear_proj": ("self_attn.o_proj",),
        "mlp.linear_fc1": ("mlp.gate_proj", "mlp.up_proj"),
        "mlp.linear_fc2": ("mlp.down_proj",),
    }
    for key, ckpt in checkpoints.items():  # the expected names/shapes are exactly what transformers saves
        shapes = hf_tensor_shapes(hf_config=ckpt["config"])
        assert shapes == {n: tuple(t.shape) for n, t in ckpt["tensors"].items()}, key
    names = [m.megatron_name for m in param_mappings(hf_config=checkpoints["qwen3"]["config"])]
    assert names[0] == "embedding.word_embeddings.weight" and names[-1] == "output_layer.weight"
    assert "decoder.layers.1.self_attention.q_layernorm.weight" in names
    assert "decoder.layers.0.self_attention.linear_qkv.bias" not in names  # qwen3: no QKV bias


@pytest.mark.parametrize("key", list(CASES))
def test_tp1_logits_match_transformers(
    key: str, checkpoints: dict[str, dict[str, Any]], single: dict[str, Any]
) -> None:
    err = _rel_err(single["logits"][key], checkpoints[key]["ref_logits"])
    assert err <= REL_TOL, f"{key}: max|mcore - hf| / max|hf| = {err:.3e}"


@pytest.mark.parametrize("key", list(CASES))
def test_tp1_export_round_trip_is_exact(
    key: str, checkpoints: dict[str, dict[str, Any]], single: dict[str, Any]
) -> None:
    _assert_exact(single["export"][key], checkpoints[key]["tensors"], tied=CASES[key][1])


def _assert_exact(exported: dict[str, np.ndarray], originals: dict[str, torch.Tensor], *, tied: bool) -> None:
    expected = set(originals) - ({"lm_head.weight"} if tied else set())
    assert set(exported) == expected
    if tied:
        assert "lm_head.weight" not in exported  # tied: omitted, Hugging Face re-ties it
    bad = [n for n in expected if not torch.equal(torch.from_numpy(exported[n]), originals[n])]
    assert not bad, f"exported tensors differ from the checkpoint: {bad}"


def test_save_hf_weights(checkpoints: dict[str, dict[str, Any]], single: dict[str, Any]) -> None:
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file

    tied_dir = Path(single["out_dir"]) / "qwen2_tied"
    assert sorted(p.name for p in tied_dir.iterdir()) == ["config.json", "model.safetensors"]
    _assert_exact(
        {n: t.numpy() for n, t in load_file(str(tied_dir / "model.safetensors")).items()},
        checkpoints["qwen2_tied"]["tensors"],
        tied=True,
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(
        tied_dir, torch_dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        logits = model(input_ids=TOKENS).logits
    assert torch.equal(logits, checkpoints["qwen2_tied"]["ref_logits"])  # same weights, same code: bitwise

    llama_dir = Path(single["out_dir"]) / "llama"
    shards = sorted(p.name for p in llama_dir.glob("*.safetensors"))
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert (llama_dir / "model.safetensors.index.json").exists()
    reloaded: dict[str, np.ndarray] = {}
    for shard in shards:
        reloaded.update({n: t.numpy() for n, t in load_file(str(llama_dir / shard)).items()})
    _assert_exact(reloaded, checkpoints["llama"]["tensors"], tied=False)
    # the sharded checkpoint (index + shards) loads back through load_hf_weights
    assert _rel_err(single["sharded_reload_logits"], checkpoints["llama"]["ref_logits"]) <= REL_TOL


def test_mapping_source_and_wrapped_bf16_model(
    checkpoints: dict[str, dict[str, Any]], single: dict[str, Any]
) -> None:
    assert _rel_err(single["mapping_load_logits"], checkpoints["llama"]["ref_logits"]) <= REL_TOL
    bf16 = single["bf16"]  # Float16Module(bf16) around the GPTModel: peeled via .module, dtype kept
    assert bf16["param_dtypes"] == ["torch.bfloat16"] and bf16["export_dtypes"] == ["torch.bfloat16"]
    assert bf16["mismatch"] == []  # every exported tensor == original rounded to bf16


def test_load_errors_name_the_tensor(single: dict[str, Any]) -> None:
    errors = single["errors"]
    assert (
        errors["missing"].startswith("ValueError")
        and "missing tensors: 'model.layers.1.mlp.up_proj.weight'" in errors["missing"]
    )
    assert "'model.layers.0.self_attn.k_proj.weight' has shape (33, 64)" in errors["shape"]
    assert "config implies (32, 64)" in errors["shape"]
    assert "unexpected tensors: 'model.layers.2.mlp.up_proj.weight'" in errors["unexpected"]
    assert "'decoder.layers.0.self_attention.linear_qkv.bias'" in errors["model_mismatch"]
    assert errors["not_gpt"].startswith("TypeError") and "GPTModel" in errors["not_gpt"]


@pytest.mark.parametrize("key", list(CASES))
def test_tp2_logits_and_export(
    key: str, checkpoints: dict[str, dict[str, Any]], ranks: list[dict[str, Any]]
) -> None:
    ckpt = checkpoints[key]
    for rank, result in enumerate(ranks):
        err = _rel_err(result["tp"][key]["logits"], ckpt["ref_logits"])
        assert err <= REL_TOL, f"{key} rank {rank}: max|mcore - hf| / max|hf| = {err:.3e}"
        _assert_exact(result["tp"][key]["export"], ckpt["tensors"], tied=CASES[key][1])


def test_tp2_padded_vocabulary(checkpoints: dict[str, dict[str, Any]], ranks: list[dict[str, Any]]) -> None:
    ckpt = checkpoints["llama"]
    for result in ranks:
        logits = result["tp_padded"]["logits"]
        assert logits.shape[-1] == 132
        assert _rel_err(logits[..., :VOCAB], ckpt["ref_logits"]) <= REL_TOL
        assert not logits[..., VOCAB:].any()  # padding rows of lm_head are zero
        _assert_exact(result["tp_padded"]["export"], ckpt["tensors"], tied=False)  # padding cut off


@pytest.mark.parametrize("key", [k for k, (_, tied) in CASES.items() if not tied])
def test_pp2_logits_and_export(
    key: str, checkpoints: dict[str, dict[str, Any]], ranks: list[dict[str, Any]]
) -> None:
    ckpt = checkpoints[key]
    stage0, stage1 = (r["pp"][key] for r in ranks)
    assert stage0["layers"] == [1] and stage1["layers"] == [2]  # megatron's global 1-based layer numbers
    err = _rel_err(stage1["logits"], ckpt["ref_logits"])
    assert err <= REL_TOL, f"{key}: max|mcore - hf| / max|hf| = {err:.3e}"
    for stage in (stage0, stage1):  # every stage receives every tensor
        _assert_exact(stage["export"], ckpt["tensors"], tied=False)


def test_data_parallel_replicas_agree(ranks: list[dict[str, Any]]) -> None:
    first, second = (r["single"] for r in ranks)
    for key in CASES:
        assert np.array_equal(first["logits"][key], second["logits"][key])
        assert first["export"][key].keys() == second["export"][key].keys()
        assert all(np.array_equal(v, second["export"][key][n]) for n, v in first["export"][key].items())
