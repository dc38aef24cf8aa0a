"""mbridge without Transformer Engine: load tiny HF checkpoints, compare logits with transformers, export.

Real mbridge, megatron-core and transformers; fp32 on CPU with gloo. Each test spawns fresh
processes (megatron-core import dominates the runtime), so each runs many checks at once and the
assertions happen here, on the results the ranks send back.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from verl_mcore_utils.hf_testing import save_tiny_hf_model
from verl_mcore_utils.testing import run_distributed

pytest.importorskip("mbridge")

MAX_REL_ERR = 1e-5
SEQ, BATCH = 12, 2

# model name -> (model_type, tied embeddings, config overrides). Llama 3.2-like: tied and llama3 RoPE.
CASES: dict[str, tuple[str, bool, dict[str, Any]]] = {
    "qwen2_tied": ("qwen2", True, {}),
    "qwen2": ("qwen2", False, {}),
    "qwen3": ("qwen3", False, {}),
    "llama": ("llama", False, {}),
    "llama3_tied": (
        "llama",
        True,
        {
            "max_position_embeddings": 16384,
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        },
    ),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tiny_hf")
    return {
        name: str(save_tiny_hf_model(mt, root / name, tie_word_embeddings=tied, seed=i, **extra))
        for i, (name, (mt, tied, extra)) in enumerate(CASES.items())
    }


def _tokens() -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 128, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    return tokens, torch.arange(SEQ).expand(BATCH, SEQ)


def _hf_logits(path: str, tokens: torch.Tensor) -> torch.Tensor:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=tokens).logits


def _megatron_logits(chunk: torch.nn.Module, device: str, gather_tp: bool = False) -> torch.Tensor:
    tokens, positions = (t.to(device) for t in _tokens())
    with torch.no_grad():
        logits = chunk.eval()(input_ids=tokens, position_ids=positions, attention_mask=None)
    if gather_tp:  # the output layer is vocab-parallel: each TP rank has a slice of the vocabulary
        from megatron.core import parallel_state

        group = parallel_state.get_tensor_model_parallel_group()
        parts = [torch.empty_like(logits) for _ in range(torch.distributed.get_world_size(group))]
        torch.distributed.all_gather(parts, logits.contiguous(), group=group)
        logits = torch.cat(parts, dim=-1)
    return logits.float().cpu()


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _export_report(
    bridge: Any, chunks: list, path: str, dtype: torch.dtype = torch.float32
) -> dict[str, Any]:
    """Compare bridge.export_weights(chunks) with the checkpoint's tensors (names, exact values)."""
    from safetensors.torch import load_file

    saved = {k: v.to(dtype) for k, v in load_file(str(Path(path) / "model.safetensors")).items()}
    exported: dict[str, torch.Tensor] = {}
    duplicates = []
    for name, tensor in bridge.export_weights(chunks):
        if name in exported:
            duplicates.append(name)
        exported[name] = tensor.detach().to("cpu", copy=True)
    return {
        "missing": sorted(set(saved) - set(exported)),
        "extra": sorted(set(exported) - set(saved)),
        "duplicates": duplicates,
        "unequal": sorted(k for k in set(saved) & set(exported) if not torch.equal(saved[k], exported[k])),
    }


def _mapping_checks(config: dict[str, Any], paths: dict[str, str]) -> dict[str, Any]:
    """Bridge selection and name maps, after polluting mbridge's class-level map on purpose."""
    from mbridge import AutoBridge
    from mbridge.models.qwen2 import Qwen2Bridge
    from mbridge.models.qwen3 import Qwen3Bridge

    # mbridge's own Qwen2Bridge writes the tied mapping into its class dict (shared with Qwen3Bridge).
    Qwen2Bridge(config["qwen2_tied"], dtype=torch.float32)
    out: dict[str, Any] = {
        "mbridge_polluted": (
            Qwen2Bridge._DIRECT_MAPPING["output_layer.weight"],
            Qwen3Bridge._DIRECT_MAPPING["output_layer.weight"],
        )
    }
    # Ours: tied first, untied after, in one process.
    out["output_layer_maps_to"] = {
        name: AutoBridge.from_config(config[name], dtype=torch.float32)._weight_name_mapping_mcore_to_hf(
            "output_layer.weight"
        )
        for name in ("qwen2_tied", "qwen2", "qwen3", "llama3_tied", "llama")
    }
    probe = AutoBridge.from_config(config["qwen2"], dtype=torch.float32)
    out["norm_names"] = [
        probe._weight_name_mapping_mcore_to_hf(f"decoder.layers.1.{n}.weight")
        for n in ("input_layernorm", "pre_mlp_layernorm")
    ]
    out["auto_bridge_classes"] = {
        name: type(AutoBridge.from_pretrained(path, dtype=torch.float32)).__name__
        for name, path in paths.items()
    }
    return out


def _misc_checks(config: dict[str, Any], paths: dict[str, str]) -> dict[str, Any]:
    """bf16, a TransformerConfig override, random init from a config object, and the refusals."""
    from mbridge import AutoBridge

    from verl_mcore_utils.bridges import build_mbridge_model

    bridge, chunks = build_mbridge_model(
        hf_path_or_config=paths["qwen3"],
        device="cpu",
        dtype="bfloat16",
        tf_overrides={"init_method_std": 0.01},
    )
    out: dict[str, Any] = {
        "bf16_dtypes": sorted({str(p.dtype) for p in chunks[0].parameters()}),
        "bf16_override": chunks[0].config.init_method_std,
        "bf16_export": _export_report(bridge, chunks, paths["qwen3"], dtype=torch.bfloat16),
    }
    _, chunks = build_mbridge_model(hf_path_or_config=config["llama"], device="cpu", load_weights=False)
    out["random_init_params"] = sum(p.numel() for p in chunks[0].parameters())
    calls = {
        "bad_override": lambda: build_mbridge_model(
            hf_path_or_config=paths["qwen2"], device="cpu", tf_overrides={"hiden_size": 3}
        ),
        "dtype_override": lambda: build_mbridge_model(
            hf_path_or_config=paths["qwen2"], device="cpu", tf_overrides={"bf16": True}
        ),
        "config_with_load": lambda: build_mbridge_model(hf_path_or_config=config["qwen2"], device="cpu"),
        "bad_dtype": lambda: build_mbridge_model(hf_path_or_config=paths["qwen2"], device="cpu", dtype="fp8"),
        "get_model": lambda: AutoBridge.from_config(config["qwen2"]).get_model(),
    }
    out["errors"] = {}
    for label, call in calls.items():
        try:
            call()
            out["errors"][label] = None
        except Exception as exc:
            out["errors"][label] = f"{type(exc).__name__}: {exc}"
    return out


def _parity_case(
    path: str, *, gather_tp: bool, device: str = "cpu", dtype: str = "float32"
) -> dict[str, Any]:
    from verl_mcore_utils.bridges import build_mbridge_model

    bridge, chunks = build_mbridge_model(hf_path_or_config=path, device=device, dtype=dtype)
    cfg = chunks[0].config
    tokens, _ = _tokens()
    out = {
        "n_chunks": len(chunks),
        "rel_err": _rel_err(_megatron_logits(chunks[0], device, gather_tp), _hf_logits(path, tokens)),
        "export": _export_report(bridge, chunks, path, dtype=chunks[0].config.params_dtype),
        "tp": cfg.tensor_model_parallel_size,
        "te_fusions_off": not (cfg.masked_softmax_fusion or cfg.sequence_parallel),
        "on_device": all(p.device.type == device for p in chunks[0].parameters()),
        "cpu_init": cfg.use_cpu_initialization,
        "qkv_rows": chunks[0].decoder.layers[0].self_attention.linear_qkv.weight.shape[0],
    }
    if bridge.hf_config.tie_word_embeddings:
        both = dict(bridge.export_weights(chunks, include_tied_lm_head=True))
        out["tied_lm_head_equal"] = torch.equal(both["lm_head.weight"], both["model.embed_tokens.weight"])
    return out


def _all_checks(rank: int, world_size: int, paths: dict[str, str]) -> dict[str, Any]:
    """Phase 1: TP=1 (the two ranks are data-parallel and split the models). Phase 2: TP=2."""
    import transformers
    from mbridge.models.qwen2 import Qwen2Bridge
    from megatron.core import parallel_state

    from verl_mcore_utils.bridges import have_transformer_engine
    from verl_mcore_utils.parallel import init_parallel

    config = {name: transformers.AutoConfig.from_pretrained(path) for name, path in paths.items()}
    out: dict[str, Any] = {"have_te": have_transformer_engine()}
    init_parallel(device="cpu")
    pristine = dict(Qwen2Bridge._DIRECT_MAPPING)
    try:
        out.update(_mapping_checks(config, paths))  # leaves mbridge's class map polluted for what follows
        out["tp1"] = {
            name: _parity_case(paths[name], gather_tp=False) for name in list(paths)[rank::world_size]
        }
        out.update(_misc_checks(config, paths))
    finally:
        Qwen2Bridge._DIRECT_MAPPING.clear()
        Qwen2Bridge._DIRECT_MAPPING.update(pristine)
    parallel_state.destroy_model_parallel()
    init_parallel(tensor_model_parallel_size=2, device="cpu")
    out["tp2"] = {name: _parity_case(paths[name], gather_tp=True) for name in ("qwen2_tied", "qwen3")}
    return out


@pytest.fixture(scope="module")
def ranks(checkpoints: dict[str, str]) -> list[dict[str, Any]]:
    """One spawn of two gloo ranks for the whole file (the megatron-core import dominates)."""
    return run_distributed(_all_checks, world_size=2, args=(checkpoints,), timeout_s=300)


EMPTY_EXPORT_DIFF = {"missing": [], "extra": [], "duplicates": [], "unequal": []}


def test_autobridge_picks_the_local_bridges(ranks: list[dict[str, Any]]) -> None:
    for out in ranks:
        assert not out["have_te"], "these tests exercise the no-TE path"
        assert out["auto_bridge_classes"] == {
            "qwen2_tied": "LocalQwen2Bridge",
            "qwen2": "LocalQwen2Bridge",
            "qwen3": "LocalQwen3Bridge",
            "llama": "LocalLlamaBridge",
            "llama3_tied": "LocalLlamaBridge",
        }
        assert out["norm_names"] == [
            ["model.layers.1.input_layernorm.weight"],
            ["model.layers.1.post_attention_layernorm.weight"],
        ]


def test_tied_bridge_does_not_leak_into_later_untied_ones(ranks: list[dict[str, Any]]) -> None:
    for out in ranks:
        # mbridge's class-level map was polluted (the pitfall), yet every bridge of ours maps per instance.
        assert out["mbridge_polluted"] == ("model.embed_tokens.weight", "model.embed_tokens.weight")
        assert out["output_layer_maps_to"] == {
            "qwen2_tied": ["model.embed_tokens.weight"],
            "qwen2": ["lm_head.weight"],
            "qwen3": ["lm_head.weight"],
            "llama3_tied": ["model.embed_tokens.weight"],
            "llama": ["lm_head.weight"],
        }


def test_logits_match_transformers_and_export_round_trips(ranks: list[dict[str, Any]]) -> None:
    cases = {name: case for out in ranks for name, case in out["tp1"].items()}
    print("TP=1 logits rel err:", {name: f"{case['rel_err']:.1e}" for name, case in cases.items()})
    assert set(cases) == set(CASES)
    for name, case in cases.items():
        assert case["n_chunks"] == 1 and case["tp"] == 1, name
        assert case["rel_err"] <= MAX_REL_ERR, f"{name}: logits rel err {case['rel_err']:.3e}"
        assert case["export"] == EMPTY_EXPORT_DIFF, name
        assert case["te_fusions_off"] and case["on_device"] and case["cpu_init"], name
        if CASES[name][1]:
            assert case["tied_lm_head_equal"], name


def test_bf16_overrides_and_random_init(ranks: list[dict[str, Any]]) -> None:
    for out in ranks:
        assert out["bf16_dtypes"] == ["torch.bfloat16"]  # norms included (megatron makes them fp32)
        assert out["bf16_override"] == 0.01
        assert out["bf16_export"] == EMPTY_EXPORT_DIFF
        assert out["random_init_params"] > 0


def test_clear_errors(ranks: list[dict[str, Any]]) -> None:
    errors = ranks[0]["errors"]
    assert errors["bad_override"].startswith("ValueError") and "'hiden_size'" in errors["bad_override"]
    assert errors["dtype_override"].startswith("ValueError") and "dtype=" in errors["dtype_override"]
    assert (
        errors["config_with_load"].startswith("ValueError")
        and "checkpoint path" in errors["config_with_load"]
    )
    assert errors["bad_dtype"].startswith("ValueError")
    assert (
        errors["get_model"].startswith("NotImplementedError") and "build_mbridge_model" in errors["get_model"]
    )


def test_tensor_parallel_2(ranks: list[dict[str, Any]]) -> None:
    print(
        "TP=2 logits rel err:", [{n: f"{c['rel_err']:.1e}" for n, c in out["tp2"].items()} for out in ranks]
    )
    for rank, out in enumerate(ranks):
        for name, case in out["tp2"].items():
            assert case["tp"] == 2 and case["te_fusions_off"], (rank, name)  # mbridge turns SP on for TP > 1
            assert case["rel_err"] <= MAX_REL_ERR, f"rank {rank} {name}: logits rel err {case['rel_err']:.3e}"
            assert case["export"] == EMPTY_EXPORT_DIFF, (rank, name)
        # Half of the fused QKV rows per rank: 4 q + 2 k + 2 v heads of 16 (qwen2) or 24 (qwen3) dims.
        assert out["tp2"]["qwen2_tied"]["qkv_rows"] == 64
        assert out["tp2"]["qwen3"]["qkv_rows"] == 96
        assert out["tp2"]["qwen2_tied"]["tied_lm_head_equal"]


def _pipeline_logits(chunks: list[torch.nn.Module]) -> torch.Tensor | None:
    """Forward through every (virtual) pipeline stage in order; the logits on the last stage's rank."""
    from megatron.core import parallel_state

    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    group = parallel_state.get_pipeline_model_parallel_group()
    order = [
        (vp, rank) for vp in range(len(chunks)) for rank in range(torch.distributed.get_world_size(group))
    ]
    tokens, positions = (t.cuda() for t in _tokens())
    hidden = None
    for vp, owner in order:
        out = None
        if owner == pp_rank:
            chunk = chunks[vp].eval()
            if hidden is not None:
                chunk.set_input_tensor(hidden)
            with torch.no_grad():
                out = chunk(input_ids=tokens, position_ids=positions, attention_mask=None)
        if (vp, owner) == order[-1]:
            return None if out is None else out.float().cpu()
        hidden = out if out is not None else torch.empty(SEQ, BATCH, 64, device="cuda")
        torch.distributed.broadcast(hidden, src=torch.distributed.get_global_rank(group, owner), group=group)
    return None


def _pipeline_case(path: str) -> dict[str, Any]:
    from verl_mcore_utils.bridges import build_mbridge_model

    bridge, chunks = build_mbridge_model(hf_path_or_config=path, device="cuda")
    logits = _pipeline_logits(chunks)
    tokens, _ = _tokens()
    return {
        "stages": [(c.pre_process, c.post_process, len(c.decoder.layers)) for c in chunks],
        "rel_err": None if logits is None else _rel_err(logits, _hf_logits(path, tokens)),
        "export": _export_report(bridge, chunks, path),
    }


def _cuda_checks(rank: int, world_size: int, paths: dict[str, str]) -> dict[str, Any]:
    """On CUDA with NCCL: TP=1 (CPU initialisation), then, with the CUDA RNG tracker seeded (GPU
    initialisation), TP=2, PP=2 and PP=2 with two virtual stages."""
    from megatron.core import parallel_state, tensor_parallel

    from verl_mcore_utils.parallel import init_parallel

    init_parallel(device="cuda")
    out: dict[str, Any] = {"tp1": {}}
    for name in list(paths)[rank::world_size]:
        if name != "qwen2_deep_tied":
            out["tp1"][name] = _parity_case(paths[name], gather_tp=False, device="cuda")
    out["bf16"] = _parity_case(paths["qwen3"], gather_tp=False, device="cuda", dtype="bfloat16")
    parallel_state.destroy_model_parallel()
    init_parallel(tensor_model_parallel_size=2, device="cuda")
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    out["tp2"] = {
        name: _parity_case(paths[name], gather_tp=True, device="cuda") for name in ("qwen2_tied", "qwen3")
    }
    parallel_state.destroy_model_parallel()
    init_parallel(pipeline_model_parallel_size=2, device="cuda")
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    out["pp2"] = {name: _pipeline_case(paths[name]) for name in ("qwen2_tied", "llama")}
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2
    )
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    out["vpp2"] = _pipeline_case(paths["qwen2_deep_tied"])
    return out


@pytest.mark.num_gpus(2)
def test_cuda_tp_pp_vpp(checkpoints: dict[str, str], tmp_path: Path) -> None:
    paths = {
        **checkpoints,
        "qwen2_deep_tied": str(
            save_tiny_hf_model("qwen2", tmp_path / "deep", tie_word_embeddings=True, num_hidden_layers=4)
        ),
    }
    ranks = run_distributed(_cuda_checks, world_size=2, args=(paths,), backend="nccl", timeout_s=300)
    print(
        "CUDA logits rel err:",
        [{k: v["rel_err"] for k, v in {**o["tp1"], **o["tp2"]}.items()} for o in ranks],
    )
    print("CUDA bf16 logits rel err:", [o["bf16"]["rel_err"] for o in ranks])
    print(
        "CUDA PP=2 / VPP=2 logits rel err:",
        [({k: v["rel_err"] for k, v in o["pp2"].items()}, o["vpp2"]["rel_err"]) for o in ranks],
    )
    assert {name for out in ranks for name in out["tp1"]} == set(CASES)
    for out in ranks:
        for phase, cpu_init in (("tp1", True), ("tp2", False)):
            for name, case in out[phase].items():
                assert case["on_device"] and case["cpu_init"] is cpu_init, (phase, name)
                assert case["rel_err"] <= MAX_REL_ERR, f"{phase} {name}: logits rel err {case['rel_err']:.3e}"
                assert case["export"] == EMPTY_EXPORT_DIFF, (phase, name)
        assert out["bf16"]["export"] == EMPTY_EXPORT_DIFF
        assert out["bf16"]["rel_err"] < 5e-2  # bf16 weights and activations against the fp32 reference
        for case in (*out["pp2"].values(), out["vpp2"]):
            assert case["export"] == EMPTY_EXPORT_DIFF  # the last stage's tied copy is not yielded twice
    for name in ("qwen2_tied", "llama"):
        assert [out["pp2"][name]["stages"] for out in ranks] == [[(True, False, 1)], [(False, True, 1)]]
        assert ranks[0]["pp2"][name]["rel_err"] is None and ranks[1]["pp2"][name]["rel_err"] <= MAX_REL_ERR
    # Virtual stages: rank 0 holds layers 0 and 2, rank 1 layers 1 and 3 (the last stage).
    assert [out["vpp2"]["stages"] for out in ranks] == [
        [(True, False, 1), (False, False, 1)],
        [(False, False, 1), (False, True, 1)],
    ]
    assert ranks[1]["vpp2"]["rel_err"] <= MAX_REL_ERR
