"""Per-rank functions of the verl backend tests (picklable: module level), CPU / gloo.

Each rank builds the same role twice from one tiny Hugging Face model: our engine directly (verl-config override
strings, our losses) and verl 0.9.1's own ``TrainingWorker`` constructed without Ray, which finds our engine through
verl's ``EngineRegistry`` (``VERL_ENGINE_DEVICE=verl_engine``) and calls it with verl's loss functions. Both see the
same batch (verl's no-padding layout for the worker, the padded one for the direct engine); every number is
returned so the test compares them.
"""

from __future__ import annotations

import os
from functools import partial
from typing import Any

import torch

# the PPO settings both sides use: PPO clip + entropy bonus + low-variance KL to the reference
ACTOR = {
    "entropy_coeff": 0.01,
    "use_kl_loss": True,
    "kl_loss_coef": 0.1,
    "kl_loss_type": "low_var_kl",
    "loss_agg_mode": "token-mean",
    "clip_ratio": 0.2,
}
# lr 1e-3: Adam turns a 1e-7 gradient difference of a near-zero gradient into ~lr * 1e-4; the 1e-6 bound holds
OPTIM = {"lr": 1e-3, "clip_grad": 1e9, "weight_decay": 0.0, "total_training_steps": 10}
MICRO = 2
# verl/trainer/config/engine/megatron.yaml's override_transformer_config (the dataclass default is {}; verl's trainer
# builds the engine config from the YAML)
YAML_TRANSFORMER = {
    "recompute_granularity": None,
    "recompute_modules": ["core_attn"],
    "recompute_method": None,
    "recompute_num_layers": None,
    "attention_backend": "flash",
}


def setup() -> None:
    """The test-only CPU patches, then our plugin (verl would import it from the entry point when installed)."""
    os.environ["VERL_ENGINE_DEVICE"] = "verl_engine"
    import verl_cpu_platform

    verl_cpu_platform.install()
    import verl_engine.integrations.verl  # noqa: F401  (registers the engines)


def no_padding(batch: dict[str, torch.Tensor], **scalars: Any) -> Any:
    """verl's trainer layout: ``left_right_2_no_padding`` of the padded batch plus its non-tensor keys."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    response_len = batch["response_mask"].shape[1]
    tensors = dict(batch)
    tensors["prompts"] = batch["input_ids"][:, :-response_len]
    tensors["responses"] = batch["input_ids"][:, -response_len:]
    td = TensorDict(tensors, batch_size=[batch["input_ids"].shape[0]])
    td = left_right_2_no_padding(td)
    tu.assign_non_tensor(td, **scalars)
    return td


def verl_configs(model_dir: str, *, role: str, offload: bool = False) -> tuple[Any, Any, Any, Any]:
    """verl's four per-role config objects, as its trainer builds them for ``model_engine=megatron``."""
    from verl.workers.config import HFModelConfig, McoreEngineConfig, McoreOptimizerConfig
    from verl.workers.config import McoreCheckpointConfig as Ckpt

    model = HFModelConfig(path=model_dir, load_tokenizer=False, use_remove_padding=True)
    engine = McoreEngineConfig(
        micro_batch_size_per_gpu=MICRO,
        infer_micro_batch_size_per_gpu=MICRO,
        max_token_len_per_gpu=4096,
        infer_max_token_len_per_gpu=4096,
        forward_only=role == "ref",
        override_transformer_config=dict(YAML_TRANSFORMER),
        param_offload=offload,
        optimizer_offload=offload,
    )
    optim = None if role == "ref" else McoreOptimizerConfig(**OPTIM)
    return model, engine, optim, Ckpt()


def verl_worker(model_dir: str, *, role: str, offload: bool = False) -> Any:
    """verl's TrainingWorker for ``role`` (actor / ref / critic) over our engine, initialised; ``offload``: the
    engine config's param_offload and optimizer_offload."""
    from verl.workers.config import TrainingWorkerConfig
    from verl.workers.engine_workers import TrainingWorker

    model, engine, optim, ckpt = verl_configs(model_dir, role=role, offload=offload)
    config = TrainingWorkerConfig(
        model_type="value_model" if role == "critic" else "language_model",
        model_config=model,
        engine_config=engine,
        optimizer_config=optim,
        checkpoint_config=ckpt,
    )
    worker = TrainingWorker(config)
    worker.reset()
    return worker


def verl_actor_config() -> Any:
    from verl.workers.config import McoreActorConfig

    return McoreActorConfig(
        strategy="megatron", rollout_n=1, ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=MICRO, **ACTOR
    )


def verl_critic_config() -> Any:
    from verl.workers.config import McoreCriticConfig

    return McoreCriticConfig(strategy="megatron", ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=MICRO)


def direct_engine(model_dir: str, *, role: str) -> tuple[Any, Any]:
    """Our engine built directly from verl-config override strings with the same settings."""
    import torch.distributed as dist
    from rl_engine_workers import _engine

    a = "actor_rollout_ref.actor"
    overrides = [
        f"trainer.n_gpus_per_node={dist.get_world_size()}",
        *(f"{a}.{k}={v}" for k, v in ACTOR.items()),
        *(f"{section}.optim.{k}={v}" for section in (a, "critic") for k, v in OPTIM.items()),
    ]
    return _engine(overrides, role, model_dir, "cpu")


def params_of(engine: Any) -> dict[str, torch.Tensor]:
    from verl_mcore_utils.module import unwrap_model

    return {n: p.detach().float().clone() for n, p in unwrap_model(engine.model).named_parameters()}


def flat_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    """verl's per-micro-batch metric lists (gathered over the size-1 DP group) reduced as verl's trainer does."""
    from verl.utils.metric import AggregationType, Metric

    out: dict[str, float] = {}
    for key, value in metrics.items():
        items = value
        while isinstance(items, list) and items and isinstance(items[0], list):
            items = [x for xs in items for x in xs]
        if not isinstance(items, list):
            out[key] = float(items)
        elif items and isinstance(items[0], Metric):
            merged = Metric(aggregation=items[0].aggregation)
            for m in items:
                merged.extend(m)
            out[key] = float(merged.aggregate())
        else:
            out[key] = float(sum(items) / len(items))
    del AggregationType
    return out


def verl_step_result(worker: Any, result: Any) -> dict[str, Any]:
    """The "verl" side of a step: the loss, the flat metrics (all but the loss) and the parameters of ``worker``
    (a TrainingWorker) after its ``train_batch`` returned ``result``."""
    from verl.utils import tensordict_utils as tu

    metrics = tu.get(result, "metrics") if result is not None else {}
    return {
        "loss": metrics.get("loss"),
        "metrics": flat_metrics({k: v for k, v in metrics.items() if k != "loss"}),
        "params": params_of(worker.engine.engine),
    }


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def jagged_vs_padded(jagged: torch.Tensor, padded: torch.Tensor, mask: torch.Tensor) -> float:
    """Largest difference between a jagged whole-sequence output and the padded layout's valid columns."""
    dense = padded[mask.bool()]
    return float((jagged.values().double() - dense.double()).abs().max())


def verl_drives_engine(
    rank: int, world_size: int, model_dir: str, batch: dict[str, torch.Tensor], ckpt_dir: str
) -> dict[str, Any]:
    """Every TrainingWorker call against our engine driven directly: reference log-probs, one PPO step (entropy +
    KL), offload through ``to``, delta export, checkpoints, and one critic step."""
    setup()
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.losses import ppo_loss as verl_ppo_loss

    from verl_engine.losses import ppo_loss

    out: dict[str, Any] = {}
    scalars = {"calculate_entropy": True, "global_batch_size": batch["input_ids"].shape[0]}
    # reference: infer only
    ref_direct, _ = direct_engine(model_dir, role="ref")
    with ref_direct.eval_mode():
        direct = ref_direct.infer_batch({**batch, "calculate_entropy": True})["model_output"]
    ref = verl_worker(model_dir, role="ref")
    result = ref.infer_batch(no_padding(batch, compute_loss=False, **scalars))
    out["ref"] = {
        key: jagged_vs_padded(tu.get(result, key), direct[key], batch["attention_mask"]) if rank == 0 else 0.0
        for key in ("log_probs", "entropy")
    }
    # actor: one train step
    actor_direct, cfg = direct_engine(model_dir, role="actor")
    with actor_direct.train_mode():
        res = actor_direct.train_batch(
            {**batch, **scalars}, partial(ppo_loss, config=cfg.actor_rollout_ref.actor)
        )
    out["direct"] = {"loss": res["loss"], "metrics": dict(res["metrics"]), "params": params_of(actor_direct)}
    actor = verl_worker(model_dir, role="actor")
    actor.set_loss_fn(partial(verl_ppo_loss, config=verl_actor_config()))
    out["verl"] = verl_step_result(actor, actor.train_batch(no_padding(batch, **scalars)))
    out["auto_offload"] = auto_offload_step(model_dir, batch, scalars)
    out["offload"] = offload_roundtrip(actor, batch, scalars)
    out["delta"] = delta_export(actor, batch, scalars)
    out["checkpoint"] = checkpoint_roundtrip(actor, batch, scalars, ckpt_dir)
    out["critic"] = critic_step(model_dir, batch)
    return out


def auto_offload_step(
    model_dir: str, batch: dict[str, torch.Tensor], scalars: dict[str, Any]
) -> dict[str, Any]:
    """param_offload + optimizer_offload: offloaded after initialize, brought in by train_mode (verl's
    BaseEngineCtx) for the step and offloaded again on exit; the step is the same as without offload."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.losses import ppo_loss as verl_ppo_loss

    actor = verl_worker(model_dir, role="actor", offload=True)
    after_init = dict(actor.engine._offloaded)
    actor.set_loss_fn(partial(verl_ppo_loss, config=verl_actor_config()))
    result = actor.train_batch(no_padding(batch, **scalars))
    after_step = dict(actor.engine._offloaded)
    actor.to("device")  # bring the weights in to read them
    metrics = tu.get(result, "metrics") if result is not None else {}
    return {
        "after_init": after_init,
        "after_step": after_step,
        "loss": metrics.get("loss"),
        "params": params_of(actor.engine.engine),
    }


def _log_probs(worker: Any, batch: dict[str, torch.Tensor], scalars: dict[str, Any]) -> torch.Tensor:
    from verl.utils import tensordict_utils as tu

    result = worker.infer_batch(no_padding(batch, compute_loss=False, **scalars))
    return tu.get(result, "log_probs").values().clone() if result is not None else torch.zeros(0)


def offload_roundtrip(worker: Any, batch: dict[str, torch.Tensor], scalars: dict[str, Any]) -> dict[str, Any]:
    """verl's ``TrainingWorker.to``: offload everything, bring it back; the outputs must not change."""
    before = _log_probs(worker, batch, scalars)
    worker.to("cpu", model=True, optimizer=True, grad=True)
    offloaded = dict(worker.engine._offloaded)
    worker.to("device", model=True, optimizer=True, grad=True)
    onloaded = dict(worker.engine._offloaded)
    after = _log_probs(worker, batch, scalars)
    return {
        "offloaded": offloaded,
        "onloaded": onloaded,
        "max_diff": float((before - after).abs().max()) if before.numel() else 0.0,
    }


def _full_export(engine: Any) -> dict[str, torch.Tensor]:
    gen, peft = engine.get_per_tensor_param(layered_summon=False, base_sync_done=False)
    assert peft is None
    return {name: t.detach().clone() for name, t in gen}


def delta_export(worker: Any, batch: dict[str, torch.Tensor], scalars: dict[str, Any]) -> dict[str, Any]:
    """Delta sync after one step: only the changed elements are sent, and they rebuild the new weights exactly."""
    engine = worker.engine
    before = _full_export(engine)
    full_bytes = sum(t.numel() * t.element_size() for t in before.values())
    engine.prime_delta_snapshots()
    worker.train_batch(no_padding(batch, **scalars))
    after = _full_export(engine)
    gen, _ = engine.get_per_tensor_param_delta_shard()
    sent_bytes, changed, rebuilt_diff, unchanged_tensors, zero_count_tensors = 0, 0, 0.0, 0, 0
    for slots, _dtype, counts, idx, val, _group in gen:
        (name, _shape), count = slots[0], int(counts.sum())
        sent_bytes += idx.numel() * idx.element_size() + val.numel() * val.element_size()
        changed += count
        rebuilt = before[name].clone().view(-1) if count else after[name].clone().view(-1)
        rebuilt[idx.long()] = val
        rebuilt_diff = max(rebuilt_diff, float((rebuilt.view_as(after[name]) - after[name]).abs().max()))
        truly_changed = int((before[name] != after[name]).sum())
        # whole tensors are unsharded for verl: global rank 0 sends, the other ranks keep lockstep with empty entries
        assert count == (truly_changed if torch.distributed.get_rank() == 0 else 0), (
            name,
            truly_changed,
            count,
        )
        unchanged_tensors += truly_changed == 0
        zero_count_tensors += count == 0
    idle, _ = (
        engine.get_per_tensor_param_delta_shard()
    )  # nothing moved since the last export: nothing to send
    idle_bytes = sum(e[3].numel() * e[3].element_size() + e[4].numel() * e[4].element_size() for e in idle)
    return {
        "idle_bytes": idle_bytes,
        "full_bytes": full_bytes,
        "sent_bytes": sent_bytes,
        "changed_elements": changed,
        "total_elements": sum(t.numel() for t in before.values()),
        "rebuilt_max_diff": rebuilt_diff,
        "unchanged_tensors": unchanged_tensors,
        "zero_count_tensors": zero_count_tensors,
    }


def checkpoint_roundtrip(
    worker: Any, batch: dict[str, torch.Tensor], scalars: dict[str, Any], ckpt_dir: str
) -> dict[str, Any]:
    """Save through verl's worker, train on, load: the saved weights come back; max_ckpt_to_keep removes the
    oldest saved path; a set hdfs_path is refused."""
    first, second = (
        os.path.join(ckpt_dir, "global_step_1", "actor"),
        os.path.join(ckpt_dir, "global_step_2", "actor"),
    )
    worker.save_checkpoint(first, None, 1, 1)
    saved = params_of(worker.engine.engine)
    worker.train_batch(no_padding(batch, **scalars))
    moved = max_diff(saved, params_of(worker.engine.engine))
    worker.save_checkpoint(second, None, 2, 1)  # keeps only the newest: `first` is removed
    second_saved = params_of(worker.engine.engine)
    first_removed = not os.path.exists(first)
    worker.train_batch(no_padding(batch, **scalars))
    moved_state = params_of(worker.engine.engine)
    worker.load_checkpoint(second, None, False)
    second_state = params_of(worker.engine.engine)
    try:
        worker.save_checkpoint(os.path.join(ckpt_dir, "x"), "hdfs://namenode/ckpt", 3, None)
        hdfs_error = ""
    except ValueError as error:
        hdfs_error = str(error)
    return {
        "moved_after_save": moved,
        "first_removed": first_removed,
        "second_kept": os.path.exists(second),
        "load_max_diff": max_diff(second_saved, second_state),
        "moved_before_load": max_diff(second_saved, moved_state),
        "hdfs_error": hdfs_error,
    }


def critic_step(model_dir: str, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
    """One critic step with verl's value_loss through the worker and with ours directly."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.losses import value_loss as verl_value_loss

    from verl_engine.losses import value_loss

    scalars = {"global_batch_size": batch["input_ids"].shape[0]}
    direct, cfg = direct_engine(model_dir, role="critic")
    with direct.eval_mode():
        values_direct = direct.infer_batch(dict(batch))["model_output"]["values"]
    with direct.train_mode():
        res = direct.train_batch({**batch, **scalars}, partial(value_loss, config=cfg.critic))
    critic = verl_worker(model_dir, role="critic")
    values = critic.infer_batch(no_padding(batch, compute_loss=False, **scalars))
    critic.set_loss_fn(partial(verl_value_loss, config=verl_critic_config()))
    verl = verl_step_result(critic, critic.train_batch(no_padding(batch, **scalars)))
    return {
        "values_diff": jagged_vs_padded(tu.get(values, "values"), values_direct, batch["attention_mask"])
        if values is not None
        else 0.0,
        "direct": {"loss": res["loss"], "metrics": dict(res["metrics"]), "params": params_of(direct)},
        "verl": verl,
    }
