"""Worker functions of tests/test_rl_engine_router_replay_cpu.py (module level: run_distributed pickles them)."""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from rl_engine_workers import _engine

AM = "actor_rollout_ref.actor.megatron"
ONE = "trainer.n_gpus_per_node=1"


def perturb_routers(engine: Any, *, scale: float, seed: int = 11) -> None:
    """Add the same noise (every rank) to every router weight: the routers then choose other experts."""
    from verl_engine.router_replay import decoder_routers

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for router in decoder_routers(engine.chunks):
            noise = torch.randn(router.weight.shape, generator=g)
            router.weight.add_(scale * noise.to(router.weight))


def _grads(engine: Any) -> dict[str, torch.Tensor]:
    from verl_mcore_utils.module import unwrap_model

    named = unwrap_model(engine.model).named_parameters()
    return {n: p.grad.detach().float().cpu().clone() for n, p in named if p.grad is not None}


def _train(engine: Any, cfg: Any, data: dict[str, Any]) -> dict[str, Any]:
    from verl_engine.losses import ppo_loss

    loss_fn = partial(ppo_loss, config=cfg.actor_rollout_ref.actor)
    with engine.train_mode():
        engine.optimizer_zero_grad()
        out = engine.forward_backward_batch({**data, "calculate_entropy": True}, loss_fn)
        grads = _grads(engine)
        engine.optimizer_zero_grad()
    return {"loss": float(out["loss"]), "grads": grads, "log_probs": out["model_output"]["log_probs"].float()}


def _infer(engine: Any, data: dict[str, Any]) -> dict[str, torch.Tensor]:
    with engine.eval_mode():
        out = engine.infer_batch(data)["model_output"]
    return {k: v.cpu() for k, v in out.items()}


def _router_probe(engine: Any) -> tuple[list[Any], list[Any]]:
    """Forward hooks on the routers keeping (router input, probs, routing map) of every call."""
    from verl_engine.router_replay import decoder_routers

    seen: list[Any] = []
    hooks = []
    for i, router in enumerate(decoder_routers(engine.chunks)):

        def hook(module: Any, inputs: Any, output: Any, layer: int = i) -> None:
            seen.append((layer, module, inputs[0].detach(), output[0].detach(), output[1].detach()))

        hooks.append(router.register_forward_hook(hook))
    return seen, hooks


def replay_run(
    rank: int,
    world_size: int,
    model_dir: str,
    layouts: list[list[str]],
    batch: dict[str, Any],
    scale: float,
    probe: bool = False,
    device: str = "cpu",
) -> list[dict[str, Any]]:
    """Per layout (mode R2): record (old log-probs), perturb the routers by ``scale``, then the native
    forward, the replayed forward and the replayed / native training step."""
    from verl_engine.router_replay import keep_seen

    keep_seen(True)
    out = []
    for overrides in layouts:
        engine, cfg = _engine([*overrides, f"{AM}.router_replay.mode=R2"], "actor", model_dir, device)
        result: dict[str, Any] = {"recorded": _infer(engine, batch)}
        routes = result["recorded"]["routed_experts"]
        result["native_train"] = _train(engine, cfg, {**batch, "enable_routing_replay": False})
        if scale:
            perturb_routers(engine, scale=scale)
        result["native"] = _infer(engine, batch)  # R2 forward only without routes: records the new choice
        seen, hooks = _router_probe(engine) if probe else ([], [])
        result["replayed"] = _infer(engine, {**batch, "routed_experts": routes})
        for h in hooks:
            h.remove()
        result["seen"] = [[t.cpu() for t in per] for per in engine.router_replay.seen_routes()]
        if probe:
            result["probe"] = _probe_errors(seen)
        result["replay_train"] = _train(engine, cfg, {**batch, "routed_experts": routes})
        result["seen_train"] = [[t.cpu() for t in per] for per in engine.router_replay.seen_routes()]
        out.append(result)
    return out


def _probe_errors(seen: list[Any]) -> list[dict[str, Any]]:
    """Per router call: the experts it used and how far its probabilities are from the score function of the
    current logits at those experts (megatron-core's softmax after top-k, or before it)."""
    out = []
    for layer, router, hidden, probs, routing_map in seen:
        logits = router.gating(hidden).reshape(-1, router.config.num_moe_experts).float()
        k = router.topk
        experts = probs.float().masked_fill(~routing_map, float("-inf")).topk(k, dim=1).indices
        if (
            router.config.moe_router_score_function == "sigmoid"
        ):  # DeepSeek-V3 / GLM-4.5: bias steers the choice only
            expected = torch.sigmoid(logits).gather(1, experts)
            expected = expected / expected.sum(dim=-1, keepdim=True) if k > 1 else expected
        elif router.config.moe_router_pre_softmax:
            expected = torch.softmax(logits, dim=-1).gather(1, experts)
        else:
            expected = torch.softmax(logits.gather(1, experts), dim=-1)
        if router.config.moe_router_topk_scaling_factor:
            expected = expected * router.config.moe_router_topk_scaling_factor
        got = probs.float().gather(1, experts)
        out.append(
            {
                "layer": layer,
                "experts": experts.sort(dim=1).values.cpu(),
                "per_token": int(routing_map.sum(dim=1).min()),
                "prob_error": float((got - expected).abs().max()),
            }
        )
    return out


def r3_run(rank: int, world_size: int, model_dir: str, batch: dict[str, Any], scale: float) -> dict[str, Any]:
    """Routes recorded by an R2 engine, replayed by an R3 engine (perturbed routers), jagged and padded."""
    from verl_engine.router_replay import keep_seen

    keep_seen(True)
    recorder, _ = _engine([ONE, f"{AM}.router_replay.mode=R2"], "actor", model_dir, "cpu")
    routes = _infer(recorder, batch)["routed_experts"]
    engine, cfg = _engine([ONE, f"{AM}.router_replay.mode=R3"], "actor", model_dir, "cpu")
    perturb_routers(engine, scale=scale)
    out: dict[str, Any] = {"routes": routes}
    try:
        _infer(engine, batch)
    except ValueError as error:
        out["missing_error"] = str(error)
    out["replayed"] = _infer(engine, {**batch, "routed_experts": routes})
    out["seen"] = [[t.cpu() for t in per] for per in engine.router_replay.seen_routes()]
    # the rollout's jagged layout without a route for the last token of each sequence (verl's R3 alignment)
    mask = batch["attention_mask"].bool()
    parts = [routes[i][mask[i]][:-1] for i in range(mask.shape[0])]
    ids = torch.nested.nested_tensor(
        [batch["input_ids"][i][mask[i]] for i in range(mask.shape[0])], layout=torch.jagged
    )
    jagged = {
        **batch,
        "input_ids": ids,
        "routed_experts": torch.nested.nested_tensor(parts, layout=torch.jagged),
    }
    # R2 with verl's engine layout (jagged input_ids): the recorded routes come back jagged, the same rows
    out["recorded_jagged"] = _infer(recorder, {**batch, "input_ids": ids})["routed_experts"]
    out["jagged"] = _infer(engine, jagged)
    out["seen_jagged"] = [[t.cpu() for t in per] for per in engine.router_replay.seen_routes()]
    out["train"] = _train(engine, cfg, {**batch, "routed_experts": routes})
    return out


def update_without_routes(rank: int, world_size: int, model_dir: str, batch: dict[str, Any]) -> str:
    """The R2 update called without routed_experts: the message of its error."""
    engine, cfg = _engine([ONE, f"{AM}.router_replay.mode=R2"], "actor", model_dir, "cpu")
    try:
        _train(engine, cfg, batch)
    except ValueError as error:
        return str(error)
    raise AssertionError("an R2 update without routed_experts ran")


def unreplayed_router_error(rank: int, world_size: int, model_dir: str, batch: dict[str, Any]) -> str:
    """A replaying forward in which layer 2's router routes on its own (its wrapper removed, as if it were a
    router the engine never found): the message of the error the forward raises."""
    from verl_engine.router_replay import decoder_routers

    engine, _ = _engine([ONE, f"{AM}.router_replay.mode=R2"], "actor", model_dir, "cpu")
    routes = _infer(engine, batch)["routed_experts"]
    del decoder_routers(engine.chunks)[1].__dict__["routing"]
    try:
        _infer(engine, {**batch, "routed_experts": routes})
    except RuntimeError as error:
        return str(error)
    raise AssertionError("a forward with a router that did not replay ran")
