"""Router replay (verl 0.9.1's ``megatron.router_replay.mode``: R2 / R3) through the RL engine: tiny Qwen3-MoE
(2 MoE layers, 4 experts, top 2), fp32, CPU, gloo.

What is compared: the experts each router uses (sorted per token, exact), the routers' probabilities against
the score function of the current logits at the recorded experts (megatron-core's softmax over the top-k
logits for Qwen3-MoE), log-probs, the loss and every gradient. After the routers are perturbed the log-probs of
a replayed forward are not the pre-perturbation ones (the probability weights come from the perturbed logits,
as they must for the router to get a gradient); the experts are the recorded ones, and that is checked exactly.
"""

from __future__ import annotations

import pytest
import torch
from rl_engine_workers import build_error, verl_batch

from verl_mcore_utils.testing import run_distributed

A = "actor_rollout_ref.actor"
AM = f"{A}.megatron"
PROMPTS, RESPONSES = [3, 6, 1, 5], [7, 2, 5, 4]
SCALE = 0.3  # router weight noise: 13 of the 33 tokens choose other experts afterwards
# TP 2 with an MoE model is refused by verl_mcore_utils.transformer_config (not supported yet); replay at PP 2,
# EP 2 and EP 2 x PP 2: tests/test_rl_engine_moe_pp_cpu.py
TWO_RANK_LAYOUTS = {
    "dp2": [],
    "cp2": [f"{AM}.context_parallel_size=2", f"{A}.ppo_micro_batch_size_per_gpu=4"],
    "dynamic_cp": [f"{AM}.dynamic_context_parallel=true", f"{AM}.max_seqlen_per_dp_cp_rank=8"],
}


def _tiny_moe(path, coef: float) -> str:
    from verl_mcore_utils.hf_testing import save_tiny_hf_model

    return str(save_tiny_hf_model("qwen3_moe", path, seed=3, router_aux_loss_coef=coef))


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> str:
    return _tiny_moe(tmp_path_factory.mktemp("qwen3_moe") / "model", 0.1)


@pytest.fixture(scope="module")
def batch() -> dict:
    return verl_batch(seed=6, prompt_lens=PROMPTS, response_lens=RESPONSES)


def _run(
    world: int, model_dir: str, layouts: dict[str, list[str]], batch: dict, scale: float, probe: bool = False
):
    from router_replay_workers import replay_run

    micro = f"{A}.ppo_micro_batch_size_per_gpu={4 // world}"
    args = [[f"trainer.n_gpus_per_node={world}", micro, *v] for v in layouts.values()]
    per_rank = run_distributed(replay_run, world_size=world, args=(model_dir, args, batch, scale, probe))
    return [dict(zip(layouts, results, strict=True)) for results in per_rank]


@pytest.fixture(scope="module")
def perturbed(moe_dir: str, batch: dict) -> dict:
    """One rank, two micro-batches: record, perturb the routers, native / replayed forward, replayed update."""
    return _run(1, moe_dir, {"one": [f"{A}.ppo_micro_batch_size_per_gpu=2"]}, batch, SCALE, probe=True)[0][
        "one"
    ]


def _packed(routes: torch.Tensor, batch: dict) -> torch.Tensor:
    """Padded [B, S, L, k] routes -> [T, L, k] (valid tokens), experts sorted per token."""
    return routes[batch["attention_mask"].bool()].long().sort(dim=-1).values


def _seen(per_router: list[list[torch.Tensor]]) -> torch.Tensor:
    """Experts each router used in the replayed calls of one rank -> [T, L, k], sorted per token."""
    return torch.stack([torch.cat(calls) for calls in per_router], dim=1).sort(dim=-1).values


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-30))


def test_replaying_the_routes_just_recorded_changes_nothing(moe_dir: str, batch: dict) -> None:
    got = _run(1, moe_dir, {"one": [f"{A}.ppo_micro_batch_size_per_gpu=2"]}, batch, 0.0)[0]["one"]
    recorded, replayed = got["recorded"], got["replayed"]
    assert recorded["routed_experts"].dtype == torch.int16
    assert recorded["routed_experts"].shape == (4, batch["input_ids"].shape[1], 2, 2)  # [B, S, layers, top-k]
    assert torch.equal(got["native"]["routed_experts"], recorded["routed_experts"])
    assert float((replayed["log_probs"] - recorded["log_probs"]).abs().max()) <= 1e-6
    native, replay = got["native_train"], got["replay_train"]
    assert abs(replay["loss"] - native["loss"]) <= 1e-6 * abs(native["loss"])
    assert native["grads"].keys() == replay["grads"].keys()
    for name in native["grads"]:
        assert _rel(replay["grads"][name], native["grads"][name]) <= 1e-6, name


def test_replay_forces_the_recorded_experts_after_the_routers_change(perturbed: dict, batch: dict) -> None:
    recorded = _packed(perturbed["recorded"]["routed_experts"], batch)
    native = _packed(perturbed["native"]["routed_experts"], batch)
    changed = int((native != recorded).any(dim=-1).any(dim=-1).sum())
    assert changed > 0, "the perturbation changed no route: the test would prove nothing"
    # the replayed forward: every router used exactly the recorded experts, top-2 per token ...
    assert torch.equal(_seen(perturbed["seen"]), recorded)
    probe = perturbed["probe"]
    for layer in range(recorded.shape[1]):
        calls = [p for p in probe if p["layer"] == layer]
        assert torch.equal(torch.cat([p["experts"] for p in calls]), recorded[:, layer])
        # ... weighted by the perturbed router's own probabilities at those experts (the gradient's path)
        assert all(p["per_token"] == 2 and p["prob_error"] <= 1e-6 for p in calls), calls
    # the routes decide the log-probs: replayed and native forwards of the same weights differ
    assert float((perturbed["replayed"]["log_probs"] - perturbed["native"]["log_probs"]).abs().max()) > 1e-3


def test_r2_records_in_the_old_log_prob_pass_and_the_update_replays_them(
    perturbed: dict, batch: dict, moe_dir: str
) -> None:
    recorded = _packed(perturbed["recorded"]["routed_experts"], batch)
    padding = ~batch["attention_mask"].bool()
    assert int(perturbed["recorded"]["routed_experts"][padding].abs().sum()) == 0  # the input's padded layout
    # the update (two micro-batches, forward + backward) used the recorded experts, not the perturbed router's
    assert torch.equal(_seen(perturbed["seen_train"]), recorded)
    routers = [n for n in perturbed["replay_train"]["grads"] if n.endswith("mlp.router.weight")]
    assert routers and all(float(perturbed["replay_train"]["grads"][n].abs().max()) > 0 for n in routers)
    from router_replay_workers import update_without_routes

    (message,) = run_distributed(update_without_routes, world_size=1, args=(moe_dir, batch))
    assert "routed_experts" in message and "compute_log_prob" in message, message


def test_r3_replays_the_routes_given_in_the_batch(moe_dir: str, batch: dict) -> None:
    from router_replay_workers import r3_run

    (got,) = run_distributed(r3_run, world_size=1, args=(moe_dir, batch, SCALE))
    assert "enable_rollout_routing_replay" in got["missing_error"], got["missing_error"]
    recorded = _packed(got["routes"], batch)
    lens = batch["attention_mask"].sum(dim=1)
    last = torch.cumsum(lens, 0) - 1  # the last token of each sequence keeps its own routing (verl's R3 mask)
    keep = torch.ones(recorded.shape[0], dtype=torch.bool)
    keep[last] = False
    for key in ("seen", "seen_jagged"):  # padded routes, and the rollout's jagged ones without a last row
        seen = _seen(got[key])
        assert torch.equal(seen[keep], recorded[keep]), key
    recorded_jagged = got["recorded_jagged"]
    assert recorded_jagged.is_nested and recorded_jagged.dtype == torch.int16
    assert torch.equal(recorded_jagged.values(), got["routes"][batch["attention_mask"].bool()])
    jagged = got["jagged"]["log_probs"].values()
    padded = got["replayed"]["log_probs"][batch["attention_mask"].bool()]
    assert float((jagged - padded).abs().max()) <= 1e-6


def test_replay_under_dp_static_cp_and_dynamic_cp_equals_one_rank(
    moe_dir: str, batch: dict, tmp_path
) -> None:
    from verl_engine.moe import padding_mask_supported

    # megatron-core < 0.16 refuses the aux loss with padding (verl_engine.moe): replay itself needs no padding mask
    model_dir = moe_dir if padding_mask_supported() else _tiny_moe(tmp_path / "no_aux", 0.0)
    one = _run(1, model_dir, {"one": []}, batch, SCALE)[0]["one"]
    for rank, got in enumerate(_run(2, model_dir, TWO_RANK_LAYOUTS, batch, SCALE)):
        for name, result in got.items():
            for call in ("recorded", "native"):
                assert torch.equal(result[call]["routed_experts"], one[call]["routed_experts"]), (
                    name,
                    rank,
                    call,
                )
            for call in ("recorded", "native", "replayed"):
                assert _rel(result[call]["log_probs"], one[call]["log_probs"]) < 1e-5, (name, rank, call)
            got_train, want = result["replay_train"], one["replay_train"]
            assert abs(got_train["loss"] - want["loss"]) <= 1e-5 * abs(want["loss"]), (name, rank)
            for n in want["grads"]:
                assert _rel(got_train["grads"][n], want["grads"][n]) < 1e-5, (name, rank, n)


def test_a_replaying_forward_in_which_a_router_did_not_replay_is_refused(moe_dir: str, batch: dict) -> None:
    from router_replay_workers import unreplayed_router_error

    (message,) = run_distributed(unreplayed_router_error, world_size=1, args=(moe_dir, batch))
    assert "did not replay" in message and "layers [2]" in message, message


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ([f"{AM}.router_replay.mode=R2", f"{AM}.router_replay.record_file=routes.pt"], "record_file"),
        ([f"{AM}.router_replay.mode=R2", f"{AM}.use_remove_padding=false"], "use_remove_padding=false"),
    ],
    ids=["record_file", "padded_rows"],
)
def test_unsupported_replay_settings_are_refused_by_name(
    moe_dir: str, overrides: list[str], expected: str
) -> None:
    world = 2 if "trainer.n_gpus_per_node=2" in overrides else 1
    overrides = overrides if world == 2 else ["trainer.n_gpus_per_node=1", *overrides]
    for message in run_distributed(build_error, world_size=world, args=(moe_dir, overrides)):
        assert expected in message and "router_replay" in message, message


def test_replay_of_a_dense_model_is_refused(tmp_path) -> None:
    from verl_mcore_utils.hf_testing import save_tiny_hf_model

    dense = str(save_tiny_hf_model("qwen3", tmp_path / "dense", seed=3))
    overrides = ["trainer.n_gpus_per_node=1", f"{AM}.router_replay.mode=R3"]
    (message,) = run_distributed(build_error, world_size=1, args=(dense, overrides))
    assert "router_replay.mode=R3" in message and "dense" in message, message


def test_replay_with_the_expert_bias_and_group_limited_router(tmp_path, batch: dict) -> None:
    """GLM-4.5 (DeepSeek-V3's sigmoid router, expert bias, group-limited top-k; a dense first layer): replaying the
    routes just recorded changes nothing (log-probs, loss, gradients 1e-6); after the routers change, every router
    uses exactly the recorded experts, weighted by the current sigmoid scores at them, renormalised (the bias and
    the group limit steer only the choice, which is given)."""
    from verl_mcore_utils.hf_testing import save_tiny_hf_model

    glm = str(save_tiny_hf_model("glm4_moe", tmp_path / "glm", seed=3, router_aux_loss_coef=0.1))
    layout = {"one": [f"{A}.ppo_micro_batch_size_per_gpu=2"]}
    same = _run(1, glm, layout, batch, 0.0)[0]["one"]
    assert float((same["replayed"]["log_probs"] - same["recorded"]["log_probs"]).abs().max()) <= 1e-6
    native, replay = same["native_train"], same["replay_train"]
    assert abs(replay["loss"] - native["loss"]) <= 1e-6 * abs(native["loss"])
    assert all(_rel(replay["grads"][n], native["grads"][n]) <= 1e-6 for n in native["grads"])
    got = _run(1, glm, layout, batch, SCALE, probe=True)[0]["one"]
    recorded = _packed(got["recorded"]["routed_experts"], batch)
    moe_layers = recorded[:, -len(got["seen"]) :]  # the routes' layer dim may include the dense first layer
    changed = int((_packed(got["native"]["routed_experts"], batch) != recorded).any(dim=-1).any(dim=-1).sum())
    assert changed > 0, "the perturbation changed no route: the test would prove nothing"
    assert torch.equal(_seen(got["seen"]), moe_layers)
    assert torch.equal(_seen(got["seen_train"]), moe_layers)
    assert all(p["per_token"] == 2 and p["prob_error"] <= 1e-6 for p in got["probe"]), got["probe"]
