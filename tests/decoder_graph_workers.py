"""Per-rank functions of the decoder-graph tests (picklable: module level): the engine's DDP actor trained with
and without CUDA graphs of its decoder (verl_engine.decoder_graphs), one GPU."""

from __future__ import annotations

from typing import Any

import torch


def graph_or_eager_steps(
    rank: int, world_size: int, hf_config: dict[str, Any], graphs: bool, steps: int = 2
) -> dict[str, Any]:
    """``steps`` PPO steps of the actor (two micro-batches each, an offload and onload between steps), with the
    decoder graphed or eager: per step the loss, the gradient norm and every parameter's fp32 ``main_grad``;
    then the weights, the dispatcher's counts, the device memory the install added, the bytes of the weights on
    the fused weight-gradient path and the device memory the graph held after the last step."""
    from functools import partial

    from rl_engine_workers import _engine, verl_batch

    from verl_engine.decoder_graphs import decoder_graph_counts, release_decoder_graphs, use_decoder_graphs
    from verl_engine.losses import ppo_loss
    from verl_mcore_utils.module import unwrap_model

    batch = verl_batch(
        seed=0, prompt_lens=[5, 9, 3, 7], response_lens=[60, 30, 90, 45], vocab=hf_config["vocab_size"]
    )
    engine, cfg = _engine(["trainer.n_gpus_per_node=1"], "actor", "random-init", "cuda", hf_config=hf_config)
    chunk = engine.model[0] if isinstance(engine.model, list) else engine.model
    before = torch.cuda.memory_allocated()
    if graphs:
        use_decoder_graphs(engine, tokens=512, sequences=8)
    out: dict[str, Any] = {"graph_bytes": torch.cuda.memory_allocated() - before, "steps": []}
    loss_fn = partial(ppo_loss, config=cfg.actor_rollout_ref.actor)
    for step in range(steps):
        if step:
            engine.offload()
            engine.onload()
        engine.optimizer_zero_grad()
        with engine.train_mode():
            result = engine.forward_backward_batch({**batch, "calculate_entropy": True}, loss_fn)
            grads = {n: p.main_grad.detach().float().cpu().clone() for n, p in chunk.named_parameters()}
            # the weights whose gradient the fused path added into main_grad (marked by this backward)
            fused = [p for p in chunk.parameters() if getattr(p, "grad_added_to_main_grad", False)]
            out["fused_bytes"] = sum(p.numel() * p.element_size() for p in fused)
            grad_norm = engine.optimizer_step()
        out["steps"].append({"loss": float(result["loss"]), "grad_norm": float(grad_norm), "grads": grads})
    out["params"] = {n: p.detach().float().cpu().clone() for n, p in unwrap_model(chunk).named_parameters()}
    out["counts"] = decoder_graph_counts(engine)
    held = torch.cuda.memory_allocated()
    release_decoder_graphs(engine)  # what the graph keeps allocated between steps goes with it
    out["graph_held_bytes"] = held - torch.cuda.memory_allocated()
    engine.close()
    # a closed engine's model goes with its last reference (moved DDP hooks once kept it and its optimizer state)
    import gc
    import weakref

    model = weakref.ref(unwrap_model(chunk))
    del chunk
    gc.collect()
    out["collected"] = model() is None
    return out


def cpu_engine_refusal(rank: int, world_size: int, model_dir: str) -> str:
    """What use_decoder_graphs says for the CPU debug engine (no CUDA graphs there)."""
    from rl_engine_workers import _engine

    from verl_engine.decoder_graphs import decoder_graph_counts, use_decoder_graphs

    engine, _ = _engine(["trainer.n_gpus_per_node=1"], "actor", model_dir, "cpu")
    try:
        use_decoder_graphs(engine, tokens=256)
        message = "installed"
    except ValueError as err:
        message = str(err)
    assert decoder_graph_counts(engine) == {}
    engine.close()
    return message


def cp_graph_or_eager_steps(
    rank: int,
    world_size: int,
    overrides: list[str],
    graphs: bool,
    batches: list[tuple[tuple[int, ...], int, bool]],
    tokens: int,
) -> dict[str, Any]:
    """One optimizer step per packed batch of the SFT engine under static or dynamic CP (``overrides``), with the
    decoder graphed (every CP size) or eager, an offload and onload before every step but the first: per step
    the loss, step 0's reduced gradients, the weights after, the plans and the dispatcher's counts."""
    import sft_engine_ops as ops

    import packed_engine_workers as pew
    from verl_engine.decoder_graphs import decoder_graph_counts, use_decoder_graphs

    engine, cfg = pew._engine("cuda", overrides, tokens)
    if graphs:
        use_decoder_graphs(engine, tokens=tokens, sequences=16)
    data = [pew.packed_batch(lens, seed=seed, masked=masked) for lens, seed, masked in batches]
    out: dict[str, Any] = {"losses": [], "plans": []}
    for step, batch in enumerate(data):
        if step:
            engine.offload()
            engine.onload()
        out["plans"].append(pew._plan_summary(engine, batch))
        with engine.train_mode():
            loss, _ = ops.gradients(engine, batch)
            if step == 0:
                out["grads"] = ops.named_gradients(engine)
            ops.set_lr(engine, cfg.optim.lr)
            engine.optimizer_step()
        out["losses"].append(loss)
    out["params"] = {n: p.detach().float().cpu().clone() for n, p in engine.model.named_parameters()}
    out["counts"] = decoder_graph_counts(engine)
    engine.close()
    return out


def ddp_hook_run_by_hand(rank: int, world_size: int, hf_config: dict[str, Any]) -> dict[str, Any]:
    """megatron-core DDP's hook of a weight, moved onto it and run by hand (what a decoder graph would do for the
    weights whose gradient it adds into main_grad itself): main_grad as it was, the stand-in gradient cleared."""
    from rl_engine_workers import _engine

    from verl_engine.decoder_graphs import _ddp_and_model
    from verl_mcore_utils.ddp_graph_hooks import ddp_hooks_on_parameters, run_ddp_hook

    engine, _ = _engine(["trainer.n_gpus_per_node=1"], "actor", "random-init", "cuda", hf_config=hf_config)
    chunk = engine.model[0] if isinstance(engine.model, list) else engine.model
    ddp, model = _ddp_and_model(chunk)  # megatron-core DDP wraps the engine's chunks on GPUs only
    out: dict[str, Any] = {"moved": ddp_hooks_on_parameters(ddp)}
    weight = next(p for n, p in ddp.named_parameters() if p.dim() == 2 and ".decoder." in n)
    weight.main_grad.fill_(2.0)
    weight.grad_added_to_main_grad = True  # the fused path added the gradient already
    run_ddp_hook(weight)
    out["kept"] = bool((weight.main_grad == 2.0).all())
    out["grad_cleared"] = weight.grad is None
    weight.grad_added_to_main_grad = False  # a stand-in gradient adds nothing even where DDP would add it
    run_ddp_hook(weight)
    out["kept_unflagged"] = bool((weight.main_grad == 2.0).all())
    try:
        run_ddp_hook(torch.nn.Parameter(torch.zeros(2, device="cuda")))
        out["refused"] = ""
    except ValueError as err:
        out["refused"] = str(err)
    engine.close()
    # the moved hooks hold DDP weakly: the closed engine's model goes with its last reference (a hook closing
    # over DDP, held from the tensor's C++ side, kept every closed engine's model and optimizer state alive)
    import gc
    import weakref

    module = weakref.ref(model)
    del chunk, ddp, model, weight
    gc.collect()
    out["collected"] = module() is None
    return out
