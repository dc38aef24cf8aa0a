"""Expert parallelism (EP) through the RL engine on CPU, fp32, gloo: one PPO step at EP 2 equals EP 1 on one rank.

A tiny Qwen3-MoE (4 experts, top 2): at EP 2 each rank holds 2 experts (local expert ``i`` of EP rank ``r`` is
global expert ``2 r + i``), tokens travel through megatron-core's all-gather dispatcher with gloo collectives
(:mod:`verl_mcore_utils.moe_dispatch`), expert gradients are summed over the expert-data-parallel group and
divided by the DP x CP pool. The step (PPO + entropy + KL, load-balancing loss 0.1) at EP 2 with DP 2, static
CP 2 and dynamic CP on 2 ranks gives, gathered per global expert, the gradients and updated weights of the
same step at EP 1 on one rank (1e-5 relative, the dense engine's bound); the weight export at EP 2 is the
checkpoint's, bitwise. Layouts the engine does not run are refused by name before any model is built.
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch
from moe_ep_workers import checkpoint_error, export_state
from test_rl_engine_moe_cpu import TWO_RANK_LAYOUTS, _steps, _supports_padding_mask, _worst

from verl_mcore_utils.testing import run_distributed

AM = "actor_rollout_ref.actor.megatron"
EP2 = f"{AM}.expert_model_parallel_size=2"
_LOCAL = re.compile(r"^(.*\.local_experts\.)(\d+)(\..+)$")
_STACKED = re.compile(r"^(.*\.mlp\.experts\.)linear_fc([12])_weight$")


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> str:
    from verl_mcore_utils.hf_testing import save_tiny_hf_model

    path = tmp_path_factory.mktemp("qwen3_moe_ep") / "model"
    # megatron-core < 0.16 refuses the aux loss over several ranks (no padding mask): EP runs there without it
    coef = 0.1 if _supports_padding_mask() else 0.0
    return str(save_tiny_hf_model("qwen3_moe", path, seed=3, router_aux_loss_coef=coef))


def _per_expert(named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Grouped experts' stacked ``mlp.experts.linear_fc{1,2}_weight`` as SequentialMLP's per-expert names."""
    out = {}
    for name, value in named.items():
        m = _STACKED.match(name)
        if m is None:
            out[name] = value
            continue
        for e in range(value.shape[0]):
            out[f"{m[1]}local_experts.{e}.linear_fc{m[2]}.weight"] = value[e]
    return out


def _global(named: dict[str, torch.Tensor], *, ep_rank: int, local: int) -> dict[str, torch.Tensor]:
    """``named`` with local expert indices turned global (EP rank ``ep_rank`` holding ``local`` experts)."""
    out = {}
    for name, value in _per_expert(named).items():
        m = _LOCAL.match(name)
        out[f"{m[1]}{ep_rank * local + int(m[2])}{m[3]}" if m else name] = value
    return out


def _gathered(per_rank: list[dict], key: str, *, ep: int = 2, etp: int = 1) -> dict[str, torch.Tensor]:
    """Every rank's ``key`` tensors by global name, expert slices of the ETP ranks joined (megatron-core's expert
    rank order: ETP innermost, then EP); replicated tensors must agree between ranks (bitwise)."""
    from verl_mcore_utils.hf_testing import tiny_hf_config
    from verl_mcore_utils.weights.fused import tp_unshard
    from verl_mcore_utils.weights.names import param_mappings

    mappings = {m.megatron_name: m for m in param_mappings(hf_config=tiny_hf_config("qwen3_moe"))}
    out: dict[str, torch.Tensor] = {}
    slices: dict[str, list[torch.Tensor]] = {}
    for rank, result in enumerate(per_rank):
        ep_rank = (rank // etp) % ep
        for name, value in _global(result[key], ep_rank=ep_rank, local=4 // ep).items():
            if ".local_experts." in name and etp > 1:
                slices.setdefault(name, [None] * etp)[rank % etp] = value
            elif name in out and ".local_experts." not in name:
                assert torch.equal(out[name], value), (key, name, rank)
            out.setdefault(name, value)
    for name, parts in slices.items():  # an MTP layer's expert is laid out like a decoder layer's
        out[name] = tp_unshard(
            parts, mappings[re.sub(r"^mtp\.layers\.\d+\.mtp_model_layer\.", "decoder.layers.0.", name)]
        )
    return out


def test_expert_parallel_step_equals_one_rank(moe_dir: str) -> None:
    layouts = {name: [EP2, *overrides] for name, overrides in TWO_RANK_LAYOUTS.items()}
    one = _steps(1, moe_dir, {"one": []})[0]["one"]
    per_rank = _steps(2, moe_dir, layouts)
    for name in layouts:
        results = [ranks[name] for ranks in per_rank]
        for result in results:
            assert abs(result["loss"] - one["loss"]) <= 1e-5 * abs(one["loss"]) + 1e-7, name
            assert result["metrics"]["grad_norm"] == pytest.approx(one["metrics"]["grad_norm"], rel=1e-5), (
                name
            )
        for key in ("grads", "params"):
            got = _gathered(results, key)
            worst = _worst(got, _per_expert(one[key]))
            print(f"EP 2 {name} {key}: worst relative error {worst:.2e}")
            assert worst < 1e-5, (name, key, worst)


def test_expert_parallel_with_mtp_layers_equals_one_rank(tmp_path) -> None:
    """Two MTP layers (MoE layers whose experts are split over EP like the decoder's) with the MTP loss: EP 2 at
    DP 2, and on megatron-core >= 0.19 ETP 2 (sequential experts, gated fc1 split in megatron-core's layout),
    equal EP 1 on one rank, every gradient and updated weight (MTP experts included, freshly initialised the same
    whatever the layout) gathered per global expert, 1e-5."""
    from rl_engine_workers import MTP_ON

    from verl_mcore_utils.hf_testing import save_tiny_hf_model

    coef = 0.1 if _supports_padding_mask() else 0.0
    path = str(
        save_tiny_hf_model(
            "qwen3_moe", tmp_path / "model", seed=3, router_aux_loss_coef=coef, num_nextn_predict_layers=2
        )
    )
    one = _steps(1, path, {"one": MTP_ON})[0]["one"]
    assert any(n.startswith("mtp.") and ".mlp.experts." in n for n in one["grads"])
    layouts = {"ep2": [EP2, *MTP_ON]}
    if _mcore_minor() >= (0, 19):
        sequential = f"+{AM}.override_transformer_config.moe_grouped_gemm=false"
        layouts["etp2"] = [f"{AM}.expert_tensor_parallel_size=2", sequential, *MTP_ON]
    per_rank = _steps(2, path, layouts)
    for name, (ep, etp) in {"ep2": (2, 1), "etp2": (1, 2)}.items():
        if name not in layouts:
            continue
        results = [ranks[name] for ranks in per_rank]
        for result in results:
            assert abs(result["loss"] - one["loss"]) <= 1e-5 * abs(one["loss"]) + 1e-7, name
        for key in ("grads", "params"):
            worst = _worst(_gathered(results, key, ep=ep, etp=etp), _per_expert(one[key]))
            assert worst < 1e-5, (name, key, worst)


def _mcore_minor() -> tuple[int, int]:
    from verl_mcore_utils.compat import mcore_version

    return (mcore_version().major, mcore_version().minor)


# ETP only where megatron-core runs it (>= 0.19); below, its refusal is test_expert_tensor_parallel_step_equals_one_rank's
_EXPORT_SIZES = {
    "ep2": [EP2],
    "etp2": [
        f"{AM}.expert_tensor_parallel_size=2",
        f"+{AM}.override_transformer_config.moe_grouped_gemm=false",
    ],
}


@pytest.mark.parametrize(
    "sizes",
    [v for k, v in _EXPORT_SIZES.items() if k == "ep2" or _mcore_minor() >= (0, 19)],
    ids=[k for k in _EXPORT_SIZES if k == "ep2" or _mcore_minor() >= (0, 19)],
)
def test_export_at_ep2_is_the_checkpoint_bitwise(moe_dir: str, sizes: list[str]) -> None:
    """EP 2 (experts broadcast from their EP rank) and ETP 2 (expert slices gathered): the checkpoint, bitwise."""
    from safetensors.torch import load_file

    exported = run_distributed(
        export_state, world_size=2, args=(moe_dir, ["trainer.n_gpus_per_node=2", *sizes])
    )[0]
    from pathlib import Path

    checkpoint = {}
    for file in sorted(Path(moe_dir).glob("*.safetensors")):
        checkpoint.update(load_file(str(file)))
    checkpoint.pop("lm_head.weight", None) if "lm_head.weight" not in exported else None
    assert sorted(exported) == sorted(checkpoint)
    assert all(torch.equal(exported[n], checkpoint[n].to(exported[n].dtype)) for n in checkpoint)


def _engine_section(**sizes: int) -> SimpleNamespace:
    fields = {
        "expert_model_parallel_size": 2,
        "tensor_model_parallel_size": 1,
        "pipeline_model_parallel_size": 1,
        "expert_tensor_parallel_size": None,
    }
    return SimpleNamespace(**{**fields, **sizes, "use_megatron_fsdp": False})


@pytest.mark.parametrize(
    ("sizes", "hf", "needles"),
    [
        ({"expert_model_parallel_size": 3}, {}, ["expert_model_parallel_size=3", "4 experts"]),
        (
            {"expert_model_parallel_size": 4},
            {},
            ["expert_model_parallel_size=4", "2 ranks of a pipeline stage"],
        ),
        ({}, {"model_type": "qwen3"}, ["expert_model_parallel_size=2", "dense model"]),
        (
            {"pipeline_model_parallel_size": 2},
            {},
            ["expert_model_parallel_size=2", "1 ranks of a pipeline stage", "world size / PP"],
        ),
        (
            {"expert_model_parallel_size": 1, "expert_tensor_parallel_size": 5},
            {},
            ["expert_tensor_parallel_size=5", "moe_intermediate_size=48"],
        ),
        (
            {"expert_tensor_parallel_size": 2},
            {},
            ["expert_model_parallel_size=2 x megatron.expert_tensor_parallel_size=2", "2 ranks"],
        ),
    ],
)
def test_expert_parallel_refusals_name_the_key(
    monkeypatch, sizes: dict, hf: dict, needles: list[str]
) -> None:
    """Checked by build_rl_engine before any process group or model: EP not dividing the experts, EP x ETP not
    dividing the pool, ETP not dividing the experts' width, a dense model, EP not dividing a pipeline stage's
    pool (EP with PP runs: tests/test_rl_engine_moe_pp_cpu.py; EP with TP + SP:
    tests/test_rl_engine_sequence_parallel_moe_cpu.py)."""
    from verl_engine.expert_parallel import check_expert_parallel

    monkeypatch.setenv("WORLD_SIZE", "2")
    config = {"model_type": "qwen3_moe", "num_experts": 4, "moe_intermediate_size": 48, **hf}
    with pytest.raises((ValueError, NotImplementedError)) as error:
        check_expert_parallel(_engine_section(**sizes), hf=config, model_name="tiny")
    assert all(n in str(error.value) for n in needles), str(error.value)


def test_expert_tensor_parallel_step_equals_one_rank(moe_dir: str) -> None:
    """ETP 2 at TP 1 (each expert's fc1 / fc2 split over 2 ranks of the pool) at DP 2 and dynamic CP, and
    EP 2 x ETP 2 at DP 4 (4 ranks): gradients and updated weights, slices joined, equal one rank. Refused by
    name on megatron-core < 0.19 (0.14 gave expert gradients off by 100% relative)."""
    etp2 = f"{AM}.expert_tensor_parallel_size=2"
    sequential = f"+{AM}.override_transformer_config.moe_grouped_gemm=false"  # grouped experts refuse ETP
    if _mcore_minor() < (0, 19):  # refused by name before any model is built
        from rl_engine_workers import build_error

        for message in run_distributed(
            build_error, world_size=2, args=(moe_dir, ["trainer.n_gpus_per_node=2", etp2])
        ):
            assert "expert_tensor_parallel_size=2" in message and "megatron-core >= 0.19" in message, message
        return
    layouts = {
        "etp2_dp2": [etp2, sequential],
        "etp2_dynamic_cp": [etp2, sequential, *TWO_RANK_LAYOUTS["dynamic_cp"]],
    }
    one = _steps(1, moe_dir, {"one": []})[0]["one"]
    cases = [(1, 2, _steps(2, moe_dir, layouts))]
    cases.append(
        (
            2,
            2,
            _steps(
                4, moe_dir, {"ep2_etp2_dp4": [EP2, etp2, sequential, "critic.ppo_micro_batch_size_per_gpu=1"]}
            ),
        )
    )
    for ep, etp, per_rank in cases:
        for name in per_rank[0]:
            results = [ranks[name] for ranks in per_rank]
            for key in ("grads", "params"):
                got = _gathered(results, key, ep=ep, etp=etp)
                worst = _worst(got, _per_expert(one[key]))
                print(f"{name} {key}: worst relative error {worst:.2e}")
                assert worst < 1e-5, (name, key, worst)
            for result in results:
                assert abs(result["loss"] - one["loss"]) <= 1e-5 * abs(one["loss"]) + 1e-7, name
                assert result["metrics"]["grad_norm"] == pytest.approx(one["metrics"]["grad_norm"], rel=1e-5)


def test_checkpoint_at_ep2_resumes_bitwise_and_refuses_another_expert_layout(moe_dir: str, tmp_path) -> None:
    """Each rank's file holds its own experts: two steps straight equal one step, save, load, one step
    (bitwise); loading the optimizer at EP 1 on the same ranks (other experts per rank) is refused naming EP."""
    from rl_engine_workers import checkpoint_run, ppo_overrides, verl_batch

    batches = [
        verl_batch(seed=s, prompt_lens=[3, 6, 1, 5] * 2, response_lens=[7, 2, 5, 4] * 2) for s in (1, 2)
    ]
    overrides = ppo_overrides(2, [EP2])
    straight = run_distributed(
        checkpoint_run, world_size=2, args=(moe_dir, overrides, batches, str(tmp_path / "a"), [1, 2])
    )
    root = str(tmp_path / "b")
    run_distributed(checkpoint_run, world_size=2, args=(moe_dir, overrides, batches, root, [1], 1))
    resumed = run_distributed(
        checkpoint_run, world_size=2, args=(moe_dir, overrides, batches, root, [2], None, True)
    )
    for rank in range(2):
        assert resumed[rank]["params"].keys() == straight[rank]["params"].keys()
        for name, value in straight[rank]["params"].items():
            assert torch.equal(resumed[rank]["params"][name], value), (rank, name)
    for message in run_distributed(
        checkpoint_error, world_size=2, args=(moe_dir, ppo_overrides(2, []), root)
    ):
        assert "EP / ETP / world [2, 1, 2]" in message and "load_optimizer=False" in message, message
