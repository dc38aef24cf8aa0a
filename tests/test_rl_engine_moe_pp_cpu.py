"""Mixture-of-experts (Qwen3-MoE) with pipeline stages through the RL engine on CPU, fp32, gloo: one PPO step at
PP 2, PP 2 x DP 2, PP 2 x virtual PP 2 and PP 2 x EP 2 equals the same step on one rank.

What made MoE + PP fail before: megatron-core refuses its all-gather token dispatcher (the one CPU models get:
the all-to-all one creates a CUDA stream when built) with ``variable_seq_lengths``, which the engine set for
every pipeline. Only megatron-core's schedules read that flag (the p2p shape exchange); the CPU backend runs its
own pipeline (:func:`verl_engine.pipeline.run_cpu_pipeline`, shapes always sent), so CPU MoE models leave it
off. Everything else already holds per stage: each stage's routers balance over TP x the DP x CP pool of that
stage (the micro-batch's tokens, as at PP 1), the aux-loss scale is set for the call on every stage (CPU) or by
megatron-core's schedule on every stage's forward (GPU), and the name table maps each stage's layers by their
global number. Tiny Qwen3-MoE (4 experts, top 2, load-balancing loss 0.1); gradients (routers included: the aux
loss reaches them) and updated weights under global names, joined over stages and EP ranks, 1e-5 relative.
"""

from __future__ import annotations

import pytest
import torch
from rl_engine_workers import verl_batch

from verl_mcore_utils.testing import run_distributed

A = "actor_rollout_ref.actor"
AM = f"{A}.megatron"
PP2 = f"{AM}.pipeline_model_parallel_size=2"
EP2 = f"{AM}.expert_model_parallel_size=2"
STEP = [
    "+actor_rollout_ref.actor.optim.override_optimizer_config.adam_eps=1e-3",
    f"{A}.use_kl_loss=true",
    f"{A}.kl_loss_type=low_var_kl",
    f"{A}.entropy_coeff=0.01",
]
MB1 = f"{A}.ppo_micro_batch_size_per_gpu=1"
PROMPTS, RESPONSES = [3, 6, 1, 5], [7, 2, 5, 4]


def _supports_padding_mask() -> bool:
    from verl_engine.moe import padding_mask_supported

    return padding_mask_supported()


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> str:
    """4 MoE layers (2 per stage, 1 per virtual chunk at VPP 2). megatron-core < 0.16 refuses the aux loss over
    several ranks (no padding mask): the DP / EP layouts run there without it, PP 2 alone has no padding."""
    from verl_mcore_utils.hf_testing import save_tiny_hf_model

    path = tmp_path_factory.mktemp("qwen3_moe_pp") / "model"
    coef = 0.1 if _supports_padding_mask() else 0.0
    return str(save_tiny_hf_model("qwen3_moe", path, seed=3, num_hidden_layers=4, router_aux_loss_coef=coef))


def steps(world: int, model_dir: str, layouts: dict[str, list[str]], *, pool: int) -> list[dict[str, dict]]:
    """Per rank, per layout: the step's results (``pool``: DP x CP ranks; the micro-batch is the pool's 4)."""
    from moe_pp_workers import moe_ppo_steps

    batch = verl_batch(seed=6, prompt_lens=PROMPTS, response_lens=RESPONSES)
    micro = [
        f"{A}.ppo_micro_batch_size_per_gpu={4 // pool}",
        "critic.ppo_micro_batch_size_per_gpu=1",
    ]  # the unused critic: DP = world
    args = [[f"trainer.n_gpus_per_node={world}", *micro, *STEP, *v] for v in layouts.values()]
    per_rank = run_distributed(moe_ppo_steps, world_size=world, args=(model_dir, args, batch))
    return [dict(zip(layouts, results, strict=True)) for results in per_rank]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-30))


def joined(results: list[dict], key: str) -> dict[str, torch.Tensor]:
    """Every rank's tensors by global name; a tensor two ranks hold (DP replicas) must agree bitwise."""
    out: dict[str, torch.Tensor] = {}
    for rank, result in enumerate(results):
        for name, value in result[key].items():
            if name in out:
                assert torch.equal(out[name], value), (key, name, rank)
            out.setdefault(name, value)
    return out


ETP2 = [f"{AM}.expert_tensor_parallel_size=2", f"+{AM}.override_transformer_config.moe_grouped_gemm=false"]


def etp_joined(results: list[dict], key: str) -> dict[str, torch.Tensor]:
    """Every rank's tensors by global name at ETP 2 with PP outermost (ETP rank = rank % 2): expert slices joined
    in megatron-core's layout (gated fc1 per half), everything else as :func:`joined`."""
    import re

    from verl_mcore_utils.hf_testing import tiny_hf_config
    from verl_mcore_utils.weights.fused import tp_unshard
    from verl_mcore_utils.weights.names import param_mappings

    mappings = {m.megatron_name: m for m in param_mappings(hf_config=tiny_hf_config("qwen3_moe"))}
    experts = [{n: v for n, v in r[key].items() if ".local_experts." in n} for r in results]
    out = joined(
        [{key: {n: v for n, v in r[key].items() if ".local_experts." not in n}} for r in results], key
    )
    for rank in range(0, len(results), 2):
        for name in experts[rank]:
            mapping = mappings[re.sub(r"^decoder\.layers\.\d+\.", "decoder.layers.0.", name)]
            out[name] = tp_unshard([experts[rank][name], experts[rank + 1][name]], mapping)
    return out


def same_step(results: list[dict], one: dict, what: str) -> dict[str, float]:
    """Assert ``results`` (all ranks of one layout) equal the one-rank step; the worst errors."""
    errors = {}
    for key in ("grads", "params"):
        got, want = joined(results, key), one[key]
        assert got.keys() == want.keys(), (what, key, sorted(set(got) ^ set(want)))
        errors[key] = max(rel(got[n], want[n]) for n in want)
        assert errors[key] < 1e-5, (what, key, errors[key])
    for result in results:
        assert abs(result["loss"] - one["loss"]) <= 1e-5 * abs(one["loss"]) + 1e-7, (what, result["loss"])
        assert result["metrics"]["grad_norm"] == pytest.approx(one["metrics"]["grad_norm"], rel=1e-5), what
        errors["log_probs"] = max(errors.get("log_probs", 0.0), rel(result["log_probs"], one["log_probs"]))
        assert errors["log_probs"] < 1e-5, (what, errors["log_probs"])
    print(what, {k: f"{v:.1e}" for k, v in errors.items()})
    return errors


@pytest.fixture(scope="module")
def one_rank(moe_dir: str) -> dict:
    """One rank: one micro-batch of the 4 sequences, 4 of 1 and 2 of 2 (the aux loss is per micro-batch)."""
    one = steps(
        1, moe_dir, {"one": [], "mb1": [MB1], "mb2": [f"{A}.ppo_micro_batch_size_per_gpu=2"]}, pool=1
    )[0]
    routers = [n for n in one["one"]["grads"] if n.endswith("mlp.router.weight")]
    assert len(routers) == 4 and all(float(one["one"]["grads"][n].abs().max()) > 0 for n in routers)
    return one


def test_moe_at_pp2_and_vpp2_equals_one_rank(moe_dir: str, one_rank: dict) -> None:
    """PP 2 with one and with four micro-batches; PP 2 x VPP 2 (4 layers: one per chunk). The interleaved schedule
    needs a multiple of PP micro-batches, so the engine halves the one micro-batch of 4 into 2 of 2
    (``verl_engine.micro_batching.split_to_multiple``): the aux loss, a statistic of each micro-batch, is then
    the one of 2 micro-batches of 2 on one rank."""
    layouts = {
        "pp2": ([PP2], "one"),
        "pp2_mb1": ([PP2, MB1], "mb1"),
        "pp2_vpp2": ([PP2, f"{AM}.virtual_pipeline_model_parallel_size=2"], "mb2"),
    }
    per_rank = steps(2, moe_dir, {k: v[0] for k, v in layouts.items()}, pool=1)
    for name, (_, ref) in layouts.items():
        same_step([ranks[name] for ranks in per_rank], one_rank[ref], name)


def test_moe_at_pp2_dp2_and_ep2_pp2_equals_one_rank(moe_dir: str, one_rank: dict) -> None:
    layouts = {"pp2_dp2": [PP2], "pp2_ep2": [PP2, EP2]}
    per_rank = steps(4, moe_dir, layouts, pool=2)
    for name in layouts:
        same_step([ranks[name] for ranks in per_rank], one_rank["one"], name)


# ---------------------------------------------------------------------------------------------- router replay
SCALE = 0.3  # router weight noise: routes change (checked below)


def _packed(routes: torch.Tensor, batch: dict) -> torch.Tensor:
    """Padded [B, S, L, k] routes -> [T, L, k] (valid tokens), experts sorted per token."""
    return routes[batch["attention_mask"].bool()].long().sort(dim=-1).values


def _replay(world: int, model_dir: str, layouts: dict[str, list[str]]) -> list[dict[str, dict]]:
    from moe_pp_workers import replay_across_stages

    batch = verl_batch(seed=6, prompt_lens=PROMPTS, response_lens=RESPONSES)
    args = [
        [f"trainer.n_gpus_per_node={world}", "critic.ppo_micro_batch_size_per_gpu=1", *v]
        for v in layouts.values()
    ]
    per_rank = run_distributed(replay_across_stages, world_size=world, args=(model_dir, args, batch, SCALE))
    return [dict(zip(layouts, results, strict=True)) for results in per_rank]


def test_router_replay_at_pp2_ep2_and_ep2_pp2_equals_one_rank(moe_dir: str) -> None:
    """R2 at PP 2 (each stage records and replays its layers' columns; recorded routes hold every layer on every
    stage), at EP 2 (routes are per token, routed before any dispatch) and at EP 2 x PP 2, against one rank:
    replaying the routes just recorded changes nothing; after the routers are perturbed the replayed forward
    uses exactly the recorded experts (PP 2: every token), and log-probs, loss and gradients equal one rank's."""
    batch = verl_batch(seed=6, prompt_lens=PROMPTS, response_lens=RESPONSES)
    micro4, micro2 = f"{A}.ppo_micro_batch_size_per_gpu=4", f"{A}.ppo_micro_batch_size_per_gpu=2"
    one = _replay(1, moe_dir, {"one": [micro4]})[0]["one"]
    recorded = _packed(one["recorded"]["routed_experts"], batch)
    assert recorded.shape[1] == 4
    changed = int((_packed(one["native"]["routed_experts"], batch) != recorded).any(dim=-1).any(dim=-1).sum())
    assert changed > 0, "the perturbation changed no route: the test would prove nothing"
    cases = [
        (2, _replay(2, moe_dir, {"pp2": [PP2, micro4], "ep2": [EP2, micro2]})),
        (4, _replay(4, moe_dir, {"pp2_ep2": [PP2, EP2, micro2]})),
    ]
    for _, per_rank in cases:
        for name in per_rank[0]:
            for rank, result in enumerate(ranks[name] for ranks in per_rank):
                what = (name, rank)
                for call in ("recorded", "native"):  # every stage returns the routes of every layer
                    assert torch.equal(result[call]["routed_experts"], one[call]["routed_experts"]), (
                        *what,
                        call,
                    )
                for call in ("recorded", "native", "replayed"):
                    assert rel(result[call]["log_probs"], one[call]["log_probs"]) < 1e-5, (*what, call)
                native, same = result["native_train"], result["same_train"]
                assert abs(same["loss"] - native["loss"]) <= 1e-6 * abs(native["loss"]), what
                assert all(rel(same["grads"][n], native["grads"][n]) <= 1e-6 for n in native["grads"]), what
                got, want = result["replay_train"], one["replay_train"]
                assert abs(got["loss"] - want["loss"]) <= 1e-5 * abs(want["loss"]), what
                if name == "pp2":  # one DP rank: this stage's routers saw every token
                    for column, calls in zip(result["columns"], result["seen"], strict=True):
                        seen = torch.cat(calls).sort(dim=-1).values
                        assert torch.equal(seen, recorded[:, column]), (*what, column)
            for key in ("native_train", "replay_train"):
                grads = joined([ranks[name][key] for ranks in per_rank], "grads")
                assert grads.keys() == one[key]["grads"].keys(), (name, key)
                worst = max(rel(grads[n], one[key]["grads"][n]) for n in grads)
                print(name, key, f"{worst:.1e}")
                assert worst < 1e-5, (name, key, worst)


def test_expert_tensor_parallelism_with_pipeline_stages_equals_one_rank(
    monkeypatch, moe_dir: str, one_rank: dict
) -> None:
    """PP 2 x ETP 2 on 4 ranks (sequential experts: each stage's experts split over the stage's 2 ranks, gated fc1
    in megatron-core's ``[gate shard; up shard]`` layout): gradients and updated weights, ETP slices joined, equal
    one rank, 1e-5. megatron-core < 0.19 refuses ETP other than TP by name, before any model is built."""
    from test_rl_engine_moe_ep_cpu import _engine_section, _mcore_minor, _per_expert

    if _mcore_minor() < (0, 19):
        from verl_engine.expert_parallel import check_expert_parallel

        monkeypatch.setenv("WORLD_SIZE", "4")
        section = _engine_section(
            expert_model_parallel_size=1, expert_tensor_parallel_size=2, pipeline_model_parallel_size=2
        )
        config = {"model_type": "qwen3_moe", "num_experts": 4, "moe_intermediate_size": 48}
        with pytest.raises(
            NotImplementedError, match="expert_tensor_parallel_size=2 .* megatron-core >= 0.19"
        ):
            check_expert_parallel(section, hf=config, model_name="tiny")
        return
    per_rank = steps(4, moe_dir, {"pp2_etp2": [PP2, *ETP2]}, pool=2)
    results = [ranks["pp2_etp2"] for ranks in per_rank]
    for key in ("grads", "params"):
        got, want = etp_joined(results, key), _per_expert(one_rank["one"][key])
        assert got.keys() == want.keys(), sorted(set(got) ^ set(want))
        worst = max(rel(got[n], want[n]) for n in want)
        print(f"pp2_etp2 {key}: worst rel. error {worst:.1e}")
        assert worst < 1e-5, (key, worst)
    for result in results:
        assert abs(result["loss"] - one_rank["one"]["loss"]) <= 1e-5 * abs(one_rank["one"]["loss"]) + 1e-7


def test_router_replay_with_recompute_across_stages_is_refused_by_name(moe_dir: str) -> None:
    """A micro-batch's replay targets stay set for its backward's recompute only when that backward follows its
    own forward; pipeline schedules run later forwards in between, so replay + recompute at PP > 1 is refused."""
    from rl_engine_workers import build_error

    overrides = [
        "trainer.n_gpus_per_node=2",
        "critic.ppo_micro_batch_size_per_gpu=1",
        PP2,
        f"{AM}.router_replay.mode=R2",
        f"+{AM}.override_transformer_config.recompute_granularity=selective",
    ]
    for message in run_distributed(build_error, world_size=2, args=(moe_dir, overrides)):
        assert "recompute_granularity=selective" in message and "pipeline_model_parallel_size=2" in message, (
            message
        )


def test_transformer_config_at_pp2_on_a_host_without_cuda() -> None:
    """megatron-core refuses its all-gather dispatcher with variable_seq_lengths; a CPU MoE model gets that
    dispatcher and leaves the flag (read only by megatron-core's schedules) off; a dense model keeps it."""
    from verl_mcore_utils.hf_testing import tiny_hf_config
    from verl_mcore_utils.transformer_config import hf_to_transformer_config

    if torch.cuda.is_available():
        pytest.skip("CUDA hosts give MoE models the all-to-all dispatcher")
    moe = hf_to_transformer_config(tiny_hf_config("qwen3_moe").to_dict(), pipeline_model_parallel_size=2)
    dense = hf_to_transformer_config(tiny_hf_config("qwen3").to_dict(), pipeline_model_parallel_size=2)
    assert (moe.moe_token_dispatcher_type, moe.variable_seq_lengths) == ("allgather", False)
    assert dense.variable_seq_lengths is True
