"""Per-rank function of the verl backend's LoRA test (picklable: module level), CPU / gloo.

verl 0.9.1's ``TrainingWorker`` drives an actor with LoRA (``model.lora`` block: rank 4, alpha 8, the adapter not
merged for the rollout) over our engine; the same actor is built directly from verl-config override strings. One
PPO step is compared, then verl's two weight-sync calls (``base_sync_done`` True / False) and the reference
log-probs verl computes with the actor's adapter off (``no_lora_adapter``) against a plain reference worker.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from verl_backend_workers import (
    ACTOR,
    MICRO,
    OPTIM,
    YAML_TRANSFORMER,
    _log_probs,
    no_padding,
    params_of,
    setup,
    verl_actor_config,
    verl_step_result,
    verl_worker,
)

LORA = {"rank": 4, "alpha": 8}


def lora_actor(model_dir: str) -> Any:
    """verl's TrainingWorker for the actor with ``model.lora``, initialised."""
    from verl.workers.config import (
        HFModelConfig,
        McoreCheckpointConfig,
        McoreEngineConfig,
        McoreOptimizerConfig,
        TrainingWorkerConfig,
    )
    from verl.workers.engine_workers import TrainingWorker

    config = TrainingWorkerConfig(
        model_type="language_model",
        model_config=HFModelConfig(
            path=model_dir, load_tokenizer=False, use_remove_padding=True, lora=dict(LORA)
        ),
        engine_config=McoreEngineConfig(
            micro_batch_size_per_gpu=MICRO,
            infer_micro_batch_size_per_gpu=MICRO,
            max_token_len_per_gpu=4096,
            infer_max_token_len_per_gpu=4096,
            override_transformer_config=dict(YAML_TRANSFORMER),
        ),
        optimizer_config=McoreOptimizerConfig(**OPTIM),
        checkpoint_config=McoreCheckpointConfig(),
    )
    worker = TrainingWorker(config)
    worker.reset()
    return worker


def direct_lora_actor(model_dir: str) -> tuple[Any, Any]:
    import torch.distributed as dist
    from rl_engine_workers import _engine

    a = "actor_rollout_ref.actor"
    overrides = [
        f"trainer.n_gpus_per_node={dist.get_world_size()}",
        *(f"{a}.{k}={v}" for k, v in ACTOR.items()),
        *(f"{a}.optim.{k}={v}" for k, v in OPTIM.items()),
        *(f"actor_rollout_ref.model.lora.{k}={v}" for k, v in LORA.items()),
    ]
    return _engine(overrides, "actor", model_dir, "cpu")


def _export(engine: Any, *, base_sync_done: bool) -> tuple[dict[str, torch.Tensor], Any]:
    gen, peft = engine.get_per_tensor_param(layered_summon=False, base_sync_done=base_sync_done)
    return {name: t.detach().float().clone() for name, t in gen}, peft


def verl_drives_lora(
    rank: int, world_size: int, model_dir: str, batch: dict[str, torch.Tensor]
) -> dict[str, Any]:
    setup()
    from verl.workers.utils.losses import ppo_loss as verl_ppo_loss

    from verl_engine.losses import ppo_loss
    from verl_mcore_utils.lora import export_hf_adapter

    scalars = {"calculate_entropy": True, "global_batch_size": batch["input_ids"].shape[0]}
    direct, cfg = direct_lora_actor(model_dir)
    with direct.train_mode():
        res = direct.train_batch({**batch, **scalars}, partial(ppo_loss, config=cfg.actor_rollout_ref.actor))
    out: dict[str, Any] = {
        "direct": {"loss": res["loss"], "metrics": dict(res["metrics"]), "params": params_of(direct)}
    }
    adapter_direct = {
        k: v.float() for k, v in export_hf_adapter(direct.chunks, hf_config=direct.hf_config).items()
    }
    actor = lora_actor(model_dir)
    actor.set_loss_fn(partial(verl_ppo_loss, config=verl_actor_config()))
    out["verl"] = {
        **verl_step_result(actor, actor.train_batch(no_padding(batch, **scalars))),
        "trainable": sorted(n for n, p in actor.engine.engine.model.named_parameters() if p.requires_grad),
    }
    adapter, peft = _export(actor.engine, base_sync_done=True)
    base, base_peft = _export(actor.engine, base_sync_done=False)
    ref = verl_worker(model_dir, role="ref")
    ref_weights, _ = _export(ref.engine, base_sync_done=False)
    out["adapter"] = {
        "names": sorted(adapter),
        "direct_names": sorted(adapter_direct),
        "max_diff": max(float((adapter[k] - adapter_direct[k]).abs().max()) for k in adapter)
        if adapter.keys() == adapter_direct.keys()
        else float("inf"),
        "peft": {k: (type(v).__module__, v.value) if hasattr(v, "value") else v for k, v in peft.items()},
        "base_peft_same": base_peft == peft,
    }
    out["base"] = {
        "names_match": sorted(base) == sorted(ref_weights),
        "max_diff": max(float((base[k] - ref_weights[k]).abs().max()) for k in base)
        if base.keys() == ref_weights.keys()
        else float("inf"),
    }
    ref_lp = _log_probs(ref, batch, scalars)
    no_adapter = _log_probs(actor, batch, {**scalars, "no_lora_adapter": True})
    with_adapter = _log_probs(actor, batch, scalars)
    out["no_lora_adapter"] = {
        "max_diff": float((no_adapter - ref_lp).abs().max()) if rank == 0 else 0.0,
        "adapter_moves": float((with_adapter - ref_lp).abs().max()) if rank == 0 else 1.0,
    }
    return out
