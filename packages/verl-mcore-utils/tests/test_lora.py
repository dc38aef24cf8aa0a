"""LoRA on megatron-core with Hugging Face peft: parity with peft on transformers, HF adapter round trip, TP=2, PP=2.

Real peft, megatron-core and transformers, fp32 on CPU (gloo). The adapters are non-trivial
(``lora_B_init_method="normal"``: B ~ N(0, 0.2), rank 8, alpha 16), so they change the logits a lot; the
megatron model with its adapter must match ``PeftModel.from_pretrained(transformers_model, saved_adapter)``
to a relative max error ``max|megatron - hf| / max|hf|`` of 1e-5.

One spawned run of 2 gloo processes (the megatron import is paid once per process) does every megatron
check: TP=1 x DP=2 (each rank a replica), then TP=2, then PP=2; results come back as numpy arrays.
DDP / optimizer checks need CUDA (megatron's DDP buffers): tests/test_gpu_lora.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from verl_mcore_utils.hf_testing import save_tiny_hf_model
from verl_mcore_utils.testing import run_distributed

pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

REL_TOL = 1e-5  # max|megatron - hf| / max|hf|
ARCHS = ("qwen2", "llama", "qwen3")
TOKENS = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(7))
LORA = {"rank": 8, "alpha": 16, "lora_B_init_method": "normal"}
# layer 0 excluded entirely, linear_fc2 nowhere: the HF target_modules become an exact-name regex
PARTIAL = {**LORA, "exclude_modules": ["linear_fc2", "decoder.layers.0.*"]}


def _rel_err(got: np.ndarray | torch.Tensor, ref: torch.Tensor) -> float:
    got = torch.as_tensor(got)
    return float((got - ref).abs().max() / ref.abs().max())


# ----------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for seed, arch in enumerate(ARCHS):
        path = save_tiny_hf_model(arch, root / arch, seed=seed)
        config = transformers.AutoConfig.from_pretrained(path).to_dict()
        out[arch] = {"path": str(path), "config": config}
    return out


@pytest.fixture(scope="module")
def ranks(
    checkpoints: dict[str, dict[str, Any]], tmp_path_factory: pytest.TempPathFactory
) -> list[dict[str, Any]]:
    out_dir = tmp_path_factory.mktemp("adapters")
    results = run_distributed(_worker, world_size=2, args=(checkpoints, str(out_dir)), timeout_s=300)
    for r in results:
        r["out_dir"] = out_dir
    return results


def _hf_logits(path: str, adapter: Path | None = None, *, merge: bool = False) -> tuple[torch.Tensor, Any]:
    import peft

    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, torch_dtype=torch.float32, attn_implementation="eager"
    ).eval()
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, str(adapter)).eval()
        if merge:
            model = model.merge_and_unload()
    with torch.no_grad():
        return model(input_ids=TOKENS).logits, model


# ----------------------------------------------------------------------------------------------- workers


def _provider(case: dict[str, Any], **tf_kwargs: Any) -> Any:
    from verl_mcore_utils.module import GPTModelProvider
    from verl_mcore_utils.transformer_config import hf_to_transformer_config

    tf = hf_to_transformer_config(case["config"], dtype="float32", **tf_kwargs)
    return GPTModelProvider(hf_config=case["config"], transformer_config=tf, device="cpu")


def _build(case: dict[str, Any], lora: dict[str, Any] | None, **hook_kwargs: Any) -> list[Any]:
    """The production path: make_megatron_module with the LoRA hook, then the base weights loaded."""
    from verl_mcore_utils.ddp import WrapConfig
    from verl_mcore_utils.lora import peft_pre_wrap_hook, without_adapters
    from verl_mcore_utils.module import make_megatron_module
    from verl_mcore_utils.weights import load_hf_weights

    hooks = [peft_pre_wrap_hook(lora, hf_config=case["config"], **hook_kwargs)] if lora else []
    chunks = make_megatron_module(
        _provider(case), wrap_config=WrapConfig(wrap_with_ddp=False), pre_wrap_hooks=hooks
    )
    with without_adapters(chunks):  # the base checkpoint has no lora_A / lora_B / base_layer names
        load_hf_weights(chunks, case["path"], hf_config=case["config"])
    return [c.eval() for c in chunks]


def _forward(model: Any, input_ids: torch.Tensor | None = TOKENS) -> torch.Tensor:
    positions = torch.arange(TOKENS.shape[1]).expand_as(TOKENS)
    with torch.no_grad():
        return model(input_ids=input_ids, position_ids=positions, attention_mask=None)


def _np(tensors: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    return {k: v.float().numpy().copy() for k, v in tensors.items()}


def _error(fn: Any) -> str:
    try:
        fn()
    except (ValueError, TypeError, NotImplementedError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _tp1(arch: str, case: dict[str, Any], out_dir: Path, rank: int) -> dict[str, Any]:
    from verl_mcore_utils.lora import (
        adapter_named_parameters,
        adapter_stats,
        export_hf_adapter,
        save_hf_adapter,
    )

    (model,) = _build(case, LORA, verbose=rank == 0)
    res: dict[str, Any] = {"logits": _forward(model).numpy()}
    from verl_mcore_utils.lora import without_adapters

    with without_adapters([model]):
        res["base_logits"] = _forward(model).numpy()
    adapter_names = {n for n, _ in adapter_named_parameters([model])}
    res["trainable"] = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    res["adapter_names"] = sorted(adapter_names)
    res["frozen_ok"] = all(p.requires_grad == (n in adapter_names) for n, p in model.named_parameters())
    stats = adapter_stats([model])
    res["stats"] = (stats.adapted_modules, stats.trainable_params, stats.total_params)
    res["adapter_numel"] = sum(p.numel() for _, p in adapter_named_parameters([model]))
    res["export"] = _np(export_hf_adapter([model], hf_config=case["config"]))
    save_hf_adapter([model], out_dir / f"{arch}_tp1", hf_config=case["config"], lora=LORA)
    # Round trip: a fresh model (zero-B init, another seed) loads the saved adapter through the hook.
    (fresh,) = _build(
        case, {"rank": 8, "alpha": 16}, seed=1, adapter_path=out_dir / f"{arch}_tp1", verbose=False
    )
    res["round_trip_logits"] = _forward(fresh).numpy()
    return res


def _qwen2_extras(case: dict[str, Any], out_dir: Path, rank: int) -> dict[str, Any]:
    from safetensors.torch import load_file, save_file

    from verl_mcore_utils.lora import (
        apply_lora,
        export_merged_hf_weights,
        load_hf_adapter,
        save_hf_adapter,
        without_adapters,
    )

    res: dict[str, Any] = {}
    (zero_b,) = _build(case, {"rank": 8, "alpha": 16}, verbose=False)  # peft's default: B = 0, no change
    with without_adapters([zero_b]):
        base = _forward(zero_b)
    res["zero_b_diff"] = float((_forward(zero_b) - base).abs().max())

    (model,) = _build(case, LORA, verbose=False)
    res["merged"] = _np(dict(export_merged_hf_weights([model], hf_config=case["config"])))
    res["restored_after_merge"] = type(model.decoder.layers[0].self_attention.linear_qkv).__name__
    # dropout after the adapter ("post"): inactive in eval mode, active in train mode
    (drop,) = _build(case, {**LORA, "dropout": 0.5, "dropout_position": "post"}, verbose=False)
    reference = _forward(model)
    res["dropout_eval_equal"] = bool(torch.equal(_forward(drop), reference))
    res["dropout_train_differs"] = not torch.equal(_forward(drop.train()), reference)

    (partial,) = _build(case, PARTIAL, verbose=False)
    res["partial_adapted"] = sorted(
        n for n, m in partial.named_modules() if type(m).__name__ == "MegatronLoraParallelLinear"
    )
    res["partial_logits"] = _forward(partial).numpy()
    save_hf_adapter([partial], out_dir / "qwen2_partial", hf_config=case["config"])

    if rank == 0:  # error paths: no collectives inside, rank 0 alone
        src = out_dir / "qwen2_tp1"
        tensors = load_file(str(src / "adapter_model.safetensors"))
        config = json.loads((src / "adapter_config.json").read_text())

        def variant(name: str, change: Any, config_change: dict[str, Any] | None = None) -> Path:
            path = out_dir / name
            path.mkdir()
            t = dict(tensors)
            change(t)
            save_file(t, str(path / "adapter_model.safetensors"))
            (path / "adapter_config.json").write_text(json.dumps({**config, **(config_change or {})}))
            return path

        k_a = "base_model.model.model.layers.1.self_attn.k_proj.lora_A.weight"
        separate = variant("separate_a", lambda t: t.__setitem__(k_a, t[k_a] + 1e-3))
        missing = variant(
            "missing", lambda t: t.pop("base_model.model.model.layers.0.mlp.up_proj.lora_B.weight")
        )
        dora = variant("dora", lambda t: None, {"use_dora": True})
        res["errors"] = {
            "separate_a": _error(lambda: load_hf_adapter([model], separate, hf_config=case["config"])),
            "missing": _error(lambda: load_hf_adapter([model], missing)),
            "dora_file": _error(lambda: load_hf_adapter([model], dora)),
            "rank": _error(lambda: load_hf_adapter([partial], out_dir / "qwen2_partial_r4")),
            "unexpected": _error(lambda: load_hf_adapter([partial], src)),
            "twice": _error(lambda: apply_lora([model], LORA)),
            "type": _error(lambda: apply_lora([base_model(case)], {**LORA, "type": "dora"})),
            "rank0": _error(lambda: apply_lora([base_model(case)], {"rank": 0})),
            "all_excluded": _error(
                lambda: apply_lora(
                    [base_model(case)],
                    {**LORA, "exclude_modules": ["linear_qkv", "o_proj", "linear_fc1", "down_proj"]},
                )
            ),
            "half_group": _error(
                lambda: apply_lora([base_model(case)], {**LORA, "exclude_modules": ["q_proj"]})
            ),
        }
    return res


def base_model(case: dict[str, Any]) -> Any:
    from verl_mcore_utils.model import build_gpt_model

    provider = _provider(case)
    return build_gpt_model(hf_config=case["config"], tf_config=provider.transformer_config, device="cpu")


def _gather_vocab(logits: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    parts = [torch.empty_like(logits) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, logits.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def _worker(rank: int, world_size: int, cases: dict[str, dict[str, Any]], out_dir: str) -> dict[str, Any]:
    import time

    from megatron.core import parallel_state

    from verl_mcore_utils.lora import export_hf_adapter, save_hf_adapter
    from verl_mcore_utils.parallel import init_parallel

    out_path = Path(out_dir)
    seconds: dict[str, float] = {}
    start = time.perf_counter()
    init_parallel(device="cpu")  # TP=1, PP=1, DP=2
    out: dict[str, Any] = {"tp1": {a: _tp1(a, c, out_path, rank) for a, c in cases.items()}}
    qwen2 = cases["qwen2"]
    seconds["tp1"] = time.perf_counter() - start

    start = time.perf_counter()
    (r4,) = _build(qwen2, {**PARTIAL, "rank": 4}, verbose=False)  # for the rank-mismatch check
    save_hf_adapter([r4], out_path / "qwen2_partial_r4", hf_config=qwen2["config"])
    out["qwen2"] = _qwen2_extras(qwen2, out_path, rank)
    parallel_state.destroy_model_parallel()
    seconds["extras"] = time.perf_counter() - start

    start = time.perf_counter()
    init_parallel(tensor_model_parallel_size=2, device="cpu")
    (model,) = _build_tp(qwen2, tensor_model_parallel_size=2)
    out["tp2"] = {
        "logits": _gather_vocab(_forward(model)).numpy(),
        "export": _np(export_hf_adapter([model], hf_config=qwen2["config"])),
        "lora_b_qkv_shape": tuple(
            model.decoder.layers[0].self_attention.linear_qkv.lora_B["default"].weight.shape
        ),
        "lora_a_fc2_shape": tuple(model.decoder.layers[0].mlp.linear_fc2.lora_A["default"].weight.shape),
    }
    save_hf_adapter([model], out_path / "qwen2_tp2", hf_config=qwen2["config"])
    parallel_state.destroy_model_parallel()
    seconds["tp2"] = time.perf_counter() - start

    start = time.perf_counter()
    init_parallel(pipeline_model_parallel_size=2, device="cpu")
    first = parallel_state.is_pipeline_first_stage()
    stage = _build_tp(
        qwen2,
        pipeline_model_parallel_size=2,
        overrides={"pipeline_dtype": torch.float32},
        pp_flags=(first, not first),
    )
    out["pp2"] = {
        "export": _np(export_hf_adapter(stage, hf_config=qwen2["config"])),
        "layers": [layer.layer_number for layer in stage[0].decoder.layers],
    }
    seconds["pp2"] = time.perf_counter() - start
    out["seconds"] = seconds
    return out


def _build_tp(case: dict[str, Any], pp_flags: tuple[bool, bool] | None = None, **tf_kwargs: Any) -> list[Any]:
    """A LoRA model under TP / PP (built directly: make_megatron_module picks the stage itself)."""
    from verl_mcore_utils.lora import peft_pre_wrap_hook, without_adapters
    from verl_mcore_utils.model import build_gpt_model
    from verl_mcore_utils.weights import load_hf_weights

    provider = _provider(case, **tf_kwargs)
    pre, post = pp_flags or (True, True)
    torch.manual_seed(123)  # base init is overwritten by the load; the adapter init does not use it
    model = build_gpt_model(
        hf_config=case["config"],
        tf_config=provider.transformer_config,
        device="cpu",
        pre_process=pre,
        post_process=post,
    )
    chunks = peft_pre_wrap_hook(LORA, verbose=False)([model])
    with without_adapters(chunks):
        load_hf_weights(chunks, case["path"], hf_config=case["config"])
    return [c.eval() for c in chunks]


# ----------------------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("arch", ARCHS)
def test_adapter_matches_peft_on_transformers(
    arch: str, checkpoints: dict[str, dict[str, Any]], ranks: list[dict[str, Any]]
) -> None:
    res = ranks[0]["tp1"][arch]
    hf_base, _ = _hf_logits(checkpoints[arch]["path"])
    hf_lora, _ = _hf_logits(checkpoints[arch]["path"], ranks[0]["out_dir"] / f"{arch}_tp1")
    assert _rel_err(res["base_logits"], hf_base) <= REL_TOL  # same base model
    assert _rel_err(hf_lora, hf_base) > 0.05  # the adapter really changes the output
    err = _rel_err(res["logits"], hf_lora)
    print(f"{arch}: megatron+LoRA vs transformers+peft max rel err {err:.2e}")
    assert err <= REL_TOL, f"{arch}: max|megatron - peft| / max|peft| = {err:.3e}"


@pytest.mark.parametrize("arch", ARCHS)
def test_save_load_round_trip_is_exact(arch: str, ranks: list[dict[str, Any]]) -> None:
    res = ranks[0]["tp1"][arch]
    assert np.array_equal(res["round_trip_logits"], res["logits"])  # same numbers, same code: bitwise


def test_saved_adapter_files(checkpoints: dict[str, dict[str, Any]], ranks: list[dict[str, Any]]) -> None:
    from safetensors.torch import load_file

    path = ranks[0]["out_dir"] / "qwen2_tp1"
    assert sorted(p.name for p in path.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    config = json.loads((path / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM"
    assert (config["r"], config["lora_alpha"], config["bias"]) == (8, 16, "none")
    assert sorted(config["target_modules"]) == [
        "down_proj",
        "gate_proj",
        "k_proj",
        "o_proj",
        "q_proj",
        "up_proj",
        "v_proj",
    ]
    tensors = load_file(str(path / "adapter_model.safetensors"))
    assert len(tensors) == 2 * 7 * 2  # layers x HF projections x (A, B)
    q = "base_model.model.model.layers.0.self_attn.q_proj"
    assert tuple(tensors[f"{q}.lora_A.weight"].shape) == (8, 64)
    assert tuple(tensors[f"{q}.lora_B.weight"].shape) == (64, 8)
    assert tuple(tensors["base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight"].shape) == (32, 8)
    assert tuple(tensors["base_model.model.model.layers.0.mlp.down_proj.lora_A.weight"].shape) == (8, 160)
    for i in range(2):  # the fused layers' HF projections share lora_A
        a = [tensors[f"base_model.model.model.layers.{i}.self_attn.{p}_proj.lora_A.weight"] for p in "qkv"]
        assert torch.equal(a[0], a[1]) and torch.equal(a[0], a[2])


def test_only_adapters_are_trainable(ranks: list[dict[str, Any]]) -> None:
    for arch in ARCHS:
        res = ranks[0]["tp1"][arch]
        assert res["frozen_ok"] and res["trainable"] == res["adapter_names"]
        assert all(".lora_A.default." in n or ".lora_B.default." in n for n in res["trainable"])
        assert len(res["trainable"]) == 2 * 4 * 2  # layers x megatron linears x (A, B)
        adapted, trainable, total = res["stats"]
        assert adapted == 8 and trainable == res["adapter_numel"] and 0 < trainable < total


def test_zero_b_init_leaves_the_model_unchanged(ranks: list[dict[str, Any]]) -> None:
    assert ranks[0]["qwen2"]["zero_b_diff"] == 0.0


def test_dropout_after_the_adapter(ranks: list[dict[str, Any]]) -> None:
    assert ranks[0]["qwen2"]["dropout_eval_equal"] and ranks[0]["qwen2"]["dropout_train_differs"]


def test_merged_export_matches_peft_merge_and_unload(
    checkpoints: dict[str, dict[str, Any]], ranks: list[dict[str, Any]]
) -> None:
    _, merged = _hf_logits(checkpoints["qwen2"]["path"], ranks[0]["out_dir"] / "qwen2_tp1", merge=True)
    reference = {n: t for n, t in merged.state_dict().items()}
    exported = ranks[0]["qwen2"]["merged"]
    assert set(exported) == set(reference)
    worst = max(_rel_err(exported[n], reference[n]) for n in exported)
    print(f"merged export vs peft merge_and_unload: worst tensor max rel err {worst:.2e}")
    assert worst <= 1e-6, f"merged weights differ from peft's merge_and_unload: {worst:.2e}"
    assert ranks[0]["qwen2"]["restored_after_merge"] == "MegatronLoraParallelLinear"


def test_partial_targets_load_in_peft(
    checkpoints: dict[str, dict[str, Any]], ranks: list[dict[str, Any]]
) -> None:
    res = ranks[0]["qwen2"]
    assert res["partial_adapted"] == [
        "decoder.layers.1.mlp.linear_fc1",
        "decoder.layers.1.self_attention.linear_proj",
        "decoder.layers.1.self_attention.linear_qkv",
    ]
    path = ranks[0]["out_dir"] / "qwen2_partial"
    target = json.loads((path / "adapter_config.json").read_text())["target_modules"]
    assert isinstance(target, str) and "model\\.layers\\.1\\.self_attn\\.q_proj" in target
    hf_lora, model = _hf_logits(checkpoints["qwen2"]["path"], path)
    adapted = sorted(
        n for n, m in model.named_modules() if hasattr(m, "lora_A") and n.split(".")[-1].endswith("proj")
    )
    assert len(adapted) == 6 and all(".layers.1." in n for n in adapted)
    err = _rel_err(res["partial_logits"], hf_lora)
    print(f"partial adapter (regex target_modules) vs peft: max rel err {err:.2e}")
    assert err <= REL_TOL


def test_errors(ranks: list[dict[str, Any]]) -> None:
    errors = ranks[0]["qwen2"]["errors"]
    assert "have different lora_A" in errors["separate_a"] and "share lora_A" in errors["separate_a"]
    assert "q_proj, k_proj, v_proj" in errors["separate_a"]
    assert "missing: ['model.layers.0.mlp.up_proj.lora_B']" in errors["missing"]
    assert "use_dora=True" in errors["dora_file"]
    assert "adapter rank 4 != the model's LoRA rank 8" in errors["rank"]
    assert "have no LoRA here" in errors["unexpected"] and "model.layers.0." in errors["unexpected"]
    assert "already has LoRA adapters" in errors["twice"]
    assert errors["type"].startswith("NotImplementedError") and "dora" in errors["type"]
    assert "rank is 0" in errors["rank0"]
    assert "linear_qkv" in errors["half_group"] and "k_proj" in errors["half_group"]
    assert "removes every target_modules" in errors["all_excluded"]


def test_data_parallel_replicas_agree(ranks: list[dict[str, Any]]) -> None:
    for arch in ARCHS:
        a, b = (r["tp1"][arch] for r in ranks)
        assert np.array_equal(a["logits"], b["logits"])
        assert all(np.array_equal(v, b["export"][k]) for k, v in a["export"].items())


def test_tp2_gathers_the_same_adapter(ranks: list[dict[str, Any]]) -> None:
    tp1 = ranks[0]["tp1"]["qwen2"]
    for res in (r["tp2"] for r in ranks):
        # same seed -> same full adapters at any TP size; export gathers the shards back exactly
        assert res["export"].keys() == tp1["export"].keys()
        bad = [k for k, v in res["export"].items() if not np.array_equal(v, tp1["export"][k])]
        assert not bad, f"TP=2 export differs from TP=1: {bad[:4]}"
        assert res["lora_b_qkv_shape"] == (64, 8)  # (q 64 + k 32 + v 32) / 2 rows
        assert res["lora_a_fc2_shape"] == (8, 80)  # 160 / 2 input columns
        err = _rel_err(res["logits"], torch.from_numpy(tp1["logits"]))
        print(f"TP=2 vs TP=1 logits (same adapter): max rel err {err:.2e}")
        assert err <= REL_TOL, f"TP=2 vs TP=1 logits: {err:.3e}"


def test_pp2_collects_every_stage(ranks: list[dict[str, Any]]) -> None:
    tp1 = ranks[0]["tp1"]["qwen2"]["export"]
    assert [r["pp2"]["layers"] for r in ranks] == [[1], [2]]
    for res in (r["pp2"] for r in ranks):  # every rank receives every stage's adapter
        assert res["export"].keys() == tp1.keys()
        assert all(np.array_equal(v, tp1[k]) for k, v in res["export"].items())
