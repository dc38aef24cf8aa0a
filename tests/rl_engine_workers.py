"""Per-rank functions of the RL engine tests (picklable: module level). CPU (gloo) or GPU (NCCL).

Every rank loads the unified ppo_trainer config (model_engine=megatron) from verl override strings, builds
the role's engine with ``rl_engine_from_config`` from a Hugging Face model directory, and runs the engine
API on a verl-style padded batch (the same on every rank). Several layouts run in one process group:
megatron-core's model-parallel state is rebuilt between them.
"""

from __future__ import annotations

from typing import Any

import torch

# a small Qwen2 shape in bf16 (untied embeddings) for one-GPU engine tests built with hf_config (random init)
SMALL_QWEN2 = {
    "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 256,
    "intermediate_size": 1024, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": 1024, "tie_word_embeddings": False,
    "max_position_embeddings": 1024, "rms_norm_eps": 1e-6, "rope_theta": 1e6, "hidden_act": "silu",
    "torch_dtype": "bfloat16",
}  # fmt: skip

BASE = [
    "model_engine=megatron",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2",
    "critic.ppo_micro_batch_size_per_gpu=2",
    "critic.model.path=${actor_rollout_ref.model.path}",  # GAE: the critic needs its model
    "actor_rollout_ref.actor.optim.lr=1e-2",
    "critic.optim.lr=1e-2",
    "actor_rollout_ref.actor.optim.clip_grad=1e9",
    "critic.optim.clip_grad=1e9",
    "actor_rollout_ref.actor.optim.weight_decay=0.0",
    "critic.optim.weight_decay=0.0",
    "actor_rollout_ref.actor.optim.total_training_steps=10",
    "critic.optim.total_training_steps=10",
    "data.train_batch_size=4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "actor_rollout_ref.model.use_remove_padding=true",
]


def verl_batch(
    *, seed: int, prompt_lens: list[int], response_lens: list[int], vocab: int = 128
) -> dict[str, Any]:
    """A verl padded batch: prompts left-padded to the longest, responses right-padded, PPO tensors."""
    g = torch.Generator().manual_seed(seed)
    b, p, r = len(prompt_lens), max(prompt_lens), max(response_lens)
    ids = torch.zeros((b, p + r), dtype=torch.int64)
    mask = torch.zeros((b, p + r), dtype=torch.int64)
    for i, (pl, rl) in enumerate(zip(prompt_lens, response_lens, strict=True)):
        ids[i, p - pl : p + rl] = torch.randint(1, vocab, (pl + rl,), generator=g)
        mask[i, p - pl : p + rl] = 1
    position_ids = (mask.cumsum(dim=1) - 1).clamp(min=0)
    response_mask = mask[:, p:].clone()
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "position_ids": position_ids,
        "response_mask": response_mask,
        "old_log_probs": -2.0 + 0.3 * torch.randn((b, r), generator=g),
        "ref_log_prob": -2.0 + 0.3 * torch.randn((b, r), generator=g),
        "advantages": torch.randn((b, r), generator=g),
        "values": 0.1 * torch.randn((b, r), generator=g),
        "returns": torch.randn((b, r), generator=g),
    }


def _engine(
    overrides: list[str], role: str, model_dir: str, device: str, hf_config: dict[str, Any] | None = None
) -> Any:
    from megatron.core import parallel_state

    from verl_config import load_config
    from verl_engine.build import rl_engine_from_config
    from verl_mcore_utils.parallel import init_parallel

    cfg = load_config(overrides=[*BASE, f"actor_rollout_ref.model.path={model_dir}", *overrides])
    section = {"actor": cfg.actor_rollout_ref.actor, "ref": cfg.actor_rollout_ref.ref, "critic": cfg.critic}[
        role
    ]
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    init_parallel(
        tensor_model_parallel_size=section.megatron.tensor_model_parallel_size,
        pipeline_model_parallel_size=section.megatron.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=section.megatron.virtual_pipeline_model_parallel_size,
        expert_model_parallel_size=section.megatron.expert_model_parallel_size,
        expert_tensor_parallel_size=section.megatron.expert_tensor_parallel_size,
        device=device,
    )
    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    return rl_engine_from_config(cfg, role=role, device=dev, hf_config=hf_config), cfg


def infer_layouts(
    rank: int,
    world_size: int,
    model_dir: str,
    layouts: list[list[str]],
    batch: dict[str, Any],
    device: str = "cpu",
    role: str = "actor",
) -> list[dict[str, torch.Tensor]]:
    """log_probs + entropy of ``batch`` under every layout (same process group)."""
    out = []
    for overrides in layouts:
        engine, _ = _engine(overrides, role, model_dir, device)
        data = {**batch, "calculate_entropy": True}
        with engine.eval_mode():
            result = engine.infer_batch(data)
        out.append({k: v.float().cpu() for k, v in result["model_output"].items()})
    return out


def ppo_step_layouts(
    rank: int,
    world_size: int,
    model_dir: str,
    layouts: list[list[str]],
    batch: dict[str, Any],
    device: str = "cpu",
) -> list[dict[str, Any]]:
    """One actor train_batch with the PPO loss per layout; the updated weights (TP 1) and the metrics."""
    from functools import partial

    from verl_engine.losses import ppo_loss
    from verl_mcore_utils.module import unwrap_model

    out = []
    for overrides in layouts:
        engine, cfg = _engine(overrides, "actor", model_dir, device)
        loss_fn = partial(ppo_loss, config=cfg.actor_rollout_ref.actor)
        with engine.train_mode():
            engine.optimizer_zero_grad()
            result = engine.forward_backward_batch({**batch, "calculate_entropy": True}, loss_fn)
            named = unwrap_model(engine.model).named_parameters()
            grads = {n: p.grad.detach().float().cpu().clone() for n, p in named if p.grad is not None}
            result["metrics"]["grad_norm"] = engine.optimizer_step()
        params = {
            n: p.detach().float().cpu().clone() for n, p in unwrap_model(engine.model).named_parameters()
        }
        out.append({"metrics": result["metrics"], "loss": result["loss"], "params": params, "grads": grads})
    return out


def critic_values(
    rank: int,
    world_size: int,
    model_dir: str,
    overrides: list[str],
    batch: dict[str, Any],
    device: str = "cpu",
) -> dict[str, torch.Tensor]:
    """The critic's values of ``batch`` and its value head's weight (to recompute them from HF hidden states)."""
    from verl_mcore_utils.module import unwrap_model

    engine, _ = _engine(overrides, "critic", model_dir, device)
    with engine.eval_mode():
        result = engine.infer_batch(batch)
    head = unwrap_model(engine.model).output_layer.weight.detach().float().cpu().clone()
    return {"values": result["model_output"]["values"].float().cpu(), "head": head}


def engine_call(
    rank: int,
    world_size: int,
    model_dir: str,
    overrides: list[str],
    batch: dict[str, Any],
    role: str = "actor",
    loss: str = "ppo",
) -> dict[str, Any]:
    """One train_batch with the named loss; the result (or the error, raised on this rank)."""
    from functools import partial

    from verl_engine import losses

    engine, cfg = _engine(overrides, role, model_dir, "cpu")
    section = cfg.critic if role == "critic" else cfg.actor_rollout_ref.actor
    fn = {"ppo": losses.ppo_loss, "value": losses.value_loss, "sft": losses.sft_loss}[loss]
    with engine.train_mode():
        out = engine.train_batch(batch, partial(fn, config=section))
    return {"loss": out["loss"], "metrics": out["metrics"]}


def infer_tensordict(rank: int, world_size: int, model_dir: str, batch: dict[str, Any]) -> list[torch.Tensor]:
    """infer_batch on a tensordict.TensorDict as verl's new workers pass it: jagged input_ids, NonTensorData."""
    from tensordict import NonTensorData, TensorDict

    engine, _ = _engine([f"trainer.n_gpus_per_node={world_size}"], "ref", model_dir, "cpu")
    mask = batch["attention_mask"].bool()
    seqs = [batch["input_ids"][i, mask[i]] for i in range(mask.shape[0])]
    td = TensorDict(
        {
            "input_ids": torch.nested.nested_tensor(seqs, layout=torch.jagged),
            "attention_mask": batch["attention_mask"],
            "response_mask": batch["response_mask"],
        },
        batch_size=[mask.shape[0]],
    )
    td["temperature"] = NonTensorData(1.0)
    td["calculate_entropy"] = NonTensorData(True)
    with engine.eval_mode():
        out = engine.infer_batch(td)["model_output"]["log_probs"]
    assert out.is_nested
    return [t.clone() for t in out.unbind()]


def pipeline_layouts(
    rank: int,
    world_size: int,
    model_dir: str,
    layouts: list[list[str]],
    batch: dict[str, Any],
    device: str = "cpu",
) -> list[dict[str, Any]]:
    """Per layout: log-probs + entropy (infer_batch), then one PPO train_batch; loss, metrics, the updated
    weights under their Hugging Face names (gathered over TP and PP, so layouts compare name by name)."""
    from functools import partial

    from verl_engine.build import load_hf_config
    from verl_engine.losses import ppo_loss
    from verl_mcore_utils.weights import export_hf_weights

    out = []
    for overrides in layouts:
        engine, cfg = _engine(overrides, "actor", model_dir, device)
        with engine.eval_mode():
            infer = engine.infer_batch({**batch, "calculate_entropy": True})["model_output"]
        with engine.train_mode():
            step = engine.train_batch(
                {**batch, "calculate_entropy": True}, partial(ppo_loss, config=cfg.actor_rollout_ref.actor)
            )
        params = {
            n: t.detach().float().cpu().clone()
            for n, t in export_hf_weights(engine.chunks, hf_config=load_hf_config(model_dir))
        }
        critic, _ = _engine(overrides, "critic", model_dir, device)  # values (and a critic's PP section)
        with critic.eval_mode():
            values = critic.infer_batch(batch)["model_output"]["values"].float().cpu()
        out.append(
            {
                "log_probs": infer["log_probs"].float().cpu(),
                "entropy": infer["entropy"].float().cpu(),
                "step_log_probs": step["model_output"]["log_probs"].float().cpu(),
                "loss": step["loss"],
                "metrics": step["metrics"],
                "params": params,
                "values": values,
            }
        )
    return out


MTP_ON = ["actor_rollout_ref.model.mtp.enable=true", "actor_rollout_ref.model.mtp.enable_train=true"]


def _decoder_output(gpt: Any, seq: torch.Tensor) -> torch.Tensor:
    captured: list[torch.Tensor] = []
    hook = gpt.decoder.register_forward_hook(lambda _m, _i, out: captured.append(out))
    gpt(input_ids=seq[None], position_ids=None, attention_mask=None)
    hook.remove()
    return captured[0]


@torch.no_grad()
def mtp_reference(engine: Any, batch: dict[str, Any], *, num_layers: int) -> list[float]:
    """Per-depth MTP loss computed plainly: each sequence alone (no packing, no CP, BSHD attention), the
    MTP input of depth k at position c is token c + k, the target token c + 1 + k, counted when that
    target is a response token; mean cross-entropy over the batch's targets of each depth (float64)."""
    from verl_mcore_utils.module import unwrap_model
    from verl_mcore_utils.mtp import mtp_layer_forward

    gpt = unwrap_model(engine.model)
    ids, mask = batch["input_ids"], batch["attention_mask"].bool()
    first_response_col = ids.shape[1] - batch["response_mask"].shape[1]
    sums, counts = [0.0] * num_layers, [0] * num_layers
    for i in range(ids.shape[0]):
        cols = torch.nonzero(mask[i]).flatten()
        seq, is_response = ids[i, cols], cols >= first_response_col
        h, n = _decoder_output(gpt, seq), seq.shape[0]
        for k in range(1, num_layers + 1):
            m = n - k  # positions whose depth-k input token c + k exists
            if m <= 1:
                break
            emb = gpt.embedding(input_ids=seq[None, k:], position_ids=None)
            h = mtp_layer_forward(
                gpt.mtp.layers[k - 1], hidden_states=h[:m], decoder_input=emb, packed_seq_params=None
            )
            logits, _ = gpt.output_layer(h, weight=gpt.output_layer.weight)
            logp = torch.log_softmax(logits[:, 0].double(), dim=-1)
            for c in range(m - 1):  # the target c + 1 + k exists for c < n - 1 - k
                t = c + 1 + k
                if is_response[t]:
                    sums[k - 1] -= float(logp[c, seq[t]])
                    counts[k - 1] += 1
    return [s / max(c, 1) for s, c in zip(sums, counts, strict=True)]


def mtp_step_layouts(
    rank: int,
    world_size: int,
    model_dir: str,
    layouts: list[list[str]],
    batch: dict[str, Any],
    reference_layers: int = 0,
    device: str = "cpu",
) -> list[dict[str, Any]]:
    """Per layout: one forward_backward_batch with the PPO loss (MTP on when the layout says so); the loss,
    metrics and every parameter's gradient by (TP 1, PP 1) name (on the CPU, fp32); the plain per-depth
    reference if asked."""
    from functools import partial

    from verl_engine.losses import ppo_loss
    from verl_mcore_utils.module import unwrap_model

    out = []
    for overrides in layouts:
        engine, cfg = _engine(overrides, "actor", model_dir, device)
        reference = mtp_reference(engine, batch, num_layers=reference_layers) if reference_layers else None
        with engine.train_mode():
            engine.optimizer_zero_grad()
            result = engine.forward_backward_batch(
                {**batch, "calculate_entropy": True}, partial(ppo_loss, config=cfg.actor_rollout_ref.actor)
            )
            grads = {
                _global_name(gpt, n): grad.detach().float().cpu().clone()
                for gpt in map(unwrap_model, engine.chunks)
                for n, p in gpt.named_parameters()
                if (grad := engine.backend.gradient(p)) is not None
            }
        out.append(
            {"loss": result["loss"], "metrics": result["metrics"], "grads": grads, "reference": reference}
        )
    return out


def mtp_step_and_export(
    rank: int, world_size: int, model_dir: str, layouts: list[list[str]], batch: dict[str, Any]
) -> list[dict[str, Any]]:
    """Per layout: the MTP metrics of one forward_backward_batch (before any update), then every tensor the
    engine exports (``get_per_tensor_param``), on every rank."""
    from functools import partial

    from verl_engine.losses import ppo_loss

    out = []
    for overrides in layouts:
        engine, cfg = _engine(overrides, "actor", model_dir, "cpu")
        with engine.train_mode():
            engine.optimizer_zero_grad()
            result = engine.forward_backward_batch(
                {**batch, "calculate_entropy": True}, partial(ppo_loss, config=cfg.actor_rollout_ref.actor)
            )
        pairs, _ = engine.get_per_tensor_param()
        exported = {name: tensor.detach().float().clone() for name, tensor in pairs}
        out.append({"metrics": result["metrics"], "exported": exported})
    return out


def _global_name(gpt: Any, name: str) -> str:
    """``decoder.layers.<i>`` of a pipeline stage renamed with the layer's global number."""
    import re

    match = re.match(r"decoder\.layers\.(\d+)\.(.*)", name)
    if match is None:
        return name
    return f"decoder.layers.{gpt.decoder.layers[int(match.group(1))].layer_number - 1}.{match.group(2)}"


def mtp_two_steps(
    rank: int, world_size: int, model_dir: str, overrides: list[str], batch: dict[str, Any], old_gating: bool
) -> str:
    """Two train_batch calls; ``old_gating``: verl's gating before PR #5895, only CP rank 0 joins the MTP
    reduction. Then rank 0 waits in the reduction over the DP x CP pool while CP rank 1 has gone on to the
    next call's first collective: the job hangs (the test bounds it with the harness' timeout)."""
    from functools import partial

    from verl_engine.losses import ppo_loss
    from verl_engine.mtp import MtpTracker

    engine, cfg = _engine(overrides, "actor", model_dir, "cpu")
    cp_rank = engine.cp_groups.position % engine.cp_layout.static_cp_size

    class CpRankZeroOnly(MtpTracker):
        def reduce(self, *, group: Any) -> dict[str, float]:
            return super().reduce(group=group) if cp_rank == 0 else {}

    if old_gating:
        engine._mtp_tracker = lambda **_: CpRankZeroOnly(
            num_layers=engine.mtp.num_layers, device=engine.device
        )
    loss = partial(ppo_loss, config=cfg.actor_rollout_ref.actor)
    with engine.train_mode():
        for _ in range(2):
            engine.train_batch(batch, loss)
    return "finished"


def export_layouts(
    rank: int,
    world_size: int,
    model_dir: str,
    layouts: list[list[str]],
    batch: dict[str, Any],
    bucket_bytes: int,
) -> list[dict[str, Any]]:
    """Per layout: one PPO step (so the weights are no longer the checkpoint's), the engine's log-probs, then
    the weights for rollout in buckets (every rank iterates; rank 0 returns them)."""
    from functools import partial

    from verl_engine.losses import ppo_loss

    out = []
    for overrides in layouts:
        engine, cfg = _engine(overrides, "actor", model_dir, "cpu")
        with engine.train_mode():
            engine.train_batch(batch, partial(ppo_loss, config=cfg.actor_rollout_ref.actor))
        with engine.eval_mode():
            log_probs = engine.infer_batch(batch)["model_output"]["log_probs"].float()
        buckets = [
            [(n, t.clone()) for n, t in b] for b in engine.export_weight_buckets(bucket_bytes=bucket_bytes)
        ]
        out.append({"log_probs": log_probs, "buckets": buckets if rank == 0 else None})
    return out


def _die_before_meta(path: Any, payload: Any, *, original: Any) -> None:
    """A checkpoint writer that is killed (SIGKILL) when it reaches the step's meta.json."""
    import os
    import signal

    if path.name == "meta.json":
        os.kill(os.getpid(), signal.SIGKILL)
    original(path, payload)


def checkpoint_run(
    rank: int,
    world_size: int,
    model_dir: str,
    overrides: list[str],
    batches: list[dict[str, Any]],
    root: str,
    steps: list[int],
    save_at: int | list[int] | None = None,
    load: bool = False,
    load_optimizer: bool = True,
    kill_on_save: int | None = None,
    keep: int | None = None,
) -> dict[str, Any]:
    """Train ``steps`` (1-based step numbers; batch ``s - 1`` each) after optionally loading ``root``; save at
    ``save_at`` (one step or several; ``keep``: max_ckpt_to_keep). ``kill_on_save``: that step's save kills this process (SIGKILL) just before its metadata is
    written. Returns the losses, this rank's parameters (local names) and log-probs of batch 0 after training."""
    from functools import partial

    from verl_engine import checkpoint as ckpt
    from verl_engine.losses import ppo_loss

    engine, cfg = _engine(overrides, "actor", model_dir, "cpu")
    loaded = engine.load_checkpoint(root, load_optimizer=load_optimizer) if load else None
    loss = partial(ppo_loss, config=cfg.actor_rollout_ref.actor)
    losses = []
    for step in steps:
        with engine.train_mode():
            out = engine.train_batch(batches[step - 1], loss)
        engine.lr_scheduler_step()
        losses.append(out["loss"])
        if step == kill_on_save:
            ckpt._write_json = partial(_die_before_meta, original=ckpt._write_json)
        saves = save_at if isinstance(save_at, list) else [save_at]
        if step in (*saves, kill_on_save):
            engine.save_checkpoint(
                root, global_step=step, data_position={"epoch": 0, "index": step * 4}, max_ckpt_to_keep=keep
            )
    with engine.eval_mode():
        log_probs = engine.infer_batch(batches[0])["model_output"]["log_probs"].float()
    params = {n: p.detach().clone() for n, p in ckpt._params(engine).items()}
    return {"losses": losses, "params": params, "log_probs": log_probs, "loaded": loaded}


def offload_round_trip(
    rank: int,
    world_size: int,
    model_dir: str,
    overrides: list[str],
    batch: dict[str, Any],
    round_trip: bool = True,
    device: str = "cpu",
) -> dict[str, Any]:
    """One PPO step (so grads and optimizer state exist), snapshot everything, offload all, onload all, compare
    bitwise; then one more step with and without the round trip must agree too (the engine still works)."""
    from functools import partial

    from verl_engine.losses import ppo_loss

    engine, cfg = _engine(overrides, "actor", model_dir, device)
    loss = partial(ppo_loss, config=cfg.actor_rollout_ref.actor)
    with engine.train_mode():
        engine.optimizer_zero_grad()
        engine.forward_backward_batch(batch, loss)
        engine.optimizer_step()
        engine.forward_backward_batch(batch, loss)  # gradients present at offload time

        def snapshot() -> dict[str, torch.Tensor]:
            out = {}
            for i, chunk in enumerate(engine.chunks):
                for n, p in chunk.named_parameters():
                    out[f"param/{i}.{n}"] = p.detach().clone()
                    grad = (
                        getattr(p, "main_grad", None) if getattr(p, "main_grad", None) is not None else p.grad
                    )
                    if grad is not None:
                        out[f"grad/{i}.{n}"] = grad.detach().clone()
            opt = engine.optimizer
            inner = opt if isinstance(opt, torch.optim.Optimizer) else opt.optimizer
            for j, state in enumerate(inner.state.values()):
                for k, v in state.items():
                    if isinstance(v, torch.Tensor):
                        out[f"optim/{j}/{k}"] = v.detach().clone()
            return out

        before = snapshot()
        stats, stats_back, twice = {}, {}, ""
        if round_trip:
            from verl_mcore_utils.offload import OffloadStateError

            stats = engine.offload()
            try:
                engine.offload()
            except OffloadStateError as err:
                twice = str(err)
            stats_back = engine.onload()
        after = snapshot()
        mismatched = [k for k in before if not torch.equal(before[k], after[k])]
        engine.optimizer_step()
        result = engine.forward_backward_batch(batch, loss)
    return {
        "keys": sorted(before),
        "mismatched": mismatched,
        "moved": stats,
        "back": stats_back,
        "twice": twice,
        "loss_after": result["loss"],
        "params_after": {k: v for k, v in snapshot().items() if k.startswith("param/")},
    }


def transformers_log_probs(model: Any, batch: dict[str, Any]) -> torch.Tensor:
    """Per-token log-probs of ``batch`` (verl padded layout) from a transformers causal LM, one sequence at a
    time over its valid tokens (the reference the engine is compared with)."""
    ids, mask = batch["input_ids"], batch["attention_mask"].bool()
    dtype = next(model.parameters()).dtype
    out = torch.zeros(ids.shape, dtype=dtype)
    model.eval()
    with torch.no_grad():
        for i in range(ids.shape[0]):
            cols = torch.nonzero(mask[i]).flatten()
            seq = ids[i, cols]
            logp = torch.log_softmax(model(seq[None]).logits[0], dim=-1)
            out[i, cols[:-1]] = logp[:-1].gather(1, seq[1:, None]).squeeze(1)
    return out


def lora_surface(
    rank: int,
    world_size: int,
    model_dir: str,
    overrides: list[str],
    batch: dict[str, Any],
    out_dir: str,
    bucket_bytes: int,
) -> dict[str, Any]:
    """The reference engine's log-probs (base model); then the LoRA actor after one PPO step: its log-probs,
    with ``disable_adapter``, the merged and the adapter-only weight buckets (+ PEFT config), and ``save_hf``
    as an adapter directory and as a merged model."""
    from functools import partial

    from verl_engine.losses import ppo_loss

    ref, _ = _engine(overrides, "ref", model_dir, "cpu")
    with ref.eval_mode():
        ref_lp = ref.infer_batch(batch)["model_output"]["log_probs"].float()
    engine, cfg = _engine(overrides, "actor", model_dir, "cpu")
    trainable = sorted(n for n, p in engine.model.named_parameters() if p.requires_grad)
    with engine.train_mode():
        engine.train_batch(batch, partial(ppo_loss, config=cfg.actor_rollout_ref.actor))
    with engine.eval_mode():
        lp = engine.infer_batch(batch)["model_output"]["log_probs"].float()
        with engine.disable_adapter():
            off = engine.infer_batch(batch)["model_output"]["log_probs"].float()
        again = engine.infer_batch(batch)["model_output"]["log_probs"].float()
    still_trainable = sorted(n for n, p in engine.model.named_parameters() if p.requires_grad)
    merged = [
        [(n, t.clone()) for n, t in b]
        for b in engine.export_weight_buckets(bucket_bytes=bucket_bytes, lora_mode="merged")
    ]
    pairs, peft_config = engine.get_per_tensor_param(bucket_bytes=bucket_bytes, lora_mode="adapter")
    adapter = {n: t.clone() for n, t in pairs}
    engine.save_hf(f"{out_dir}/adapter")
    engine.save_hf(f"{out_dir}/merged", merged=True)
    keep = rank == 0
    return {
        "ref": ref_lp,
        "lora": lp,
        "off": off,
        "again": again,
        "trainable": trainable,
        "still_trainable": still_trainable,
        "merged": merged if keep else None,
        "adapter": adapter if keep else None,
        "peft_config": peft_config,
    }


def rollout_round_trip(
    rank: int, world_size: int, model_dir: str, prompts: list[list[int]]
) -> dict[str, Any]:
    """The actor engine's weights into an HFRollout (weight sync), greedy and sampled generation, then the
    engine's log-probs of the greedy responses (verl's batch layout from ``rollout_batch``)."""
    import json
    from pathlib import Path

    from verl_engine.apps.grpo import rollout_batch
    from verl_engine.apps.rollout import HFRollout, SamplingParams

    engine, _ = _engine(["trainer.n_gpus_per_node=1"], "actor", model_dir, "cpu")
    hf_config = json.loads((Path(model_dir) / "config.json").read_text())
    rollout = HFRollout(hf_config=hf_config, eos_token_id=5, pad_token_id=0)
    weights, peft_config = engine.get_per_tensor_param(bucket_bytes=1 << 16)
    rollout.update_weights(weights)
    greedy = rollout.generate(prompts, SamplingParams(max_new_tokens=6, temperature=0.0))
    sampled = [rollout.generate(prompts, SamplingParams(max_new_tokens=6, n=3, seed=7)) for _ in range(2)]
    batch = rollout_batch(prompts, greedy, pad_token_id=0)
    with engine.eval_mode():
        log_probs = engine.infer_batch(batch)["model_output"]["log_probs"].float()
    state = {k: v.clone() for k, v in rollout.model.state_dict().items()}
    return {
        "greedy": greedy,
        "sampled": sampled,
        "batch": batch,
        "log_probs": log_probs,
        "peft_config": peft_config,
        "rollout_state": state if rank == 0 else None,
        "hf_config": hf_config,
    }


def grpo_run(
    rank: int,
    world_size: int,
    out_dir: str,
    overrides: list[str],
    kwargs: dict[str, Any],
    check_sync: bool = False,
    threads: int | None = None,
) -> dict[str, Any]:
    """``run_grpo`` on the embedded arithmetic task; returns its result and the metrics file's records.

    ``threads``: torch's intra-op threads (Ray's workers run with one: the same count gives the same
    floating-point reduction order).

    ``check_sync``: afterwards (the last step ends with an evaluation, i.e. a weight sync), every tensor of
    the rollout model is compared with the actor engine's export: ``sync_mismatches`` lists those not equal.
    """
    import json
    from pathlib import Path

    import torch

    from verl_engine.apps.demo import CharTokenizer
    from verl_engine.apps.grpo_run import GRPORun, InProcessWorkers, run_grpo, tiny_arithmetic_hf_config
    from verl_engine.apps.rollout import HFRollout

    if threads is not None:
        torch.set_num_threads(threads)
    run = GRPORun(out_dir=out_dir, overrides=overrides, **kwargs)
    workers = InProcessWorkers(device="cpu")
    tok = CharTokenizer()
    rollout = None
    if check_sync:
        hf = tiny_arithmetic_hf_config(
            vocab_size=tok.vocab_size, hidden_size=run.hidden_size, layers=run.layers
        )
        rollout = HFRollout(hf_config=hf, eos_token_id=tok.eos_id, pad_token_id=tok.pad_id)
    result = run_grpo(run, workers=workers, rollout=rollout)
    lines = (Path(out_dir) / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    # "records": the training steps; "eval_records": records without training metrics (step 0's evaluation)
    out = {
        **result,
        "records": [r for r in records if "reward_mean" in r],
        "eval_records": [r for r in records if "reward_mean" not in r],
    }
    if check_sync:
        exported = dict(workers.export_weights("actor"))
        params = dict(rollout.model.named_parameters())
        out["sync_names"] = sorted(params) == sorted(exported)
        out["sync_mismatches"] = [n for n, p in params.items() if not torch.equal(p, exported[n])]
    return out


def ppo_overrides(world: int, extra: list[str]) -> list[str]:
    """The PPO batch keys the lifecycle tests share: ``world`` ranks, 8 sequences per step, then ``extra``."""
    return [
        f"trainer.n_gpus_per_node={world}",
        "data.train_batch_size=8",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        f"critic.ppo_micro_batch_size_per_gpu={max(1, 8 // world // 2)}",
        *extra,
    ]


def close_and_rebuild(rank: int, world_size: int, model_dir: str, batch: dict[str, Any]) -> dict[str, Any]:
    """Build an actor, infer, close it; then a second one in the same process group gives the same output.

    Reports whether the first engine's model and optimizer were freed (weak references dead after
    close), what using a closed engine raises, and whether its CP groups refuse use.
    """
    import gc
    import weakref

    out: dict[str, Any] = {}
    overrides = [f"trainer.n_gpus_per_node={world_size}"]
    engine, _ = _engine(overrides, "actor", model_dir, "cpu")
    with engine.eval_mode():
        first = engine.infer_batch({**batch})["model_output"]["log_probs"]
    gc.collect()
    refs = [
        weakref.ref(engine.model),
        weakref.ref(engine.optimizer),
        weakref.ref(next(engine.model.parameters())),
    ]
    cp_groups = engine.cp_groups
    engine.close()
    engine.close()  # idempotent
    out["freed"] = [r() is None for r in refs]
    out["closed"] = engine.closed
    for use in (lambda: engine.infer_batch(batch), lambda: engine.optimizer_step()):
        try:
            use()
            out.setdefault("errors", []).append(None)
        except RuntimeError as err:
            out.setdefault("errors", []).append(str(err))
    try:
        cp_groups.group(1)
        out["cp_groups_error"] = None
    except RuntimeError as err:
        out["cp_groups_error"] = str(err)
    second, _ = _engine(overrides, "actor", model_dir, "cpu")
    with second, second.eval_mode():
        again = second.infer_batch({**batch})["model_output"]["log_probs"]
    out["same_output"] = bool(torch.equal(first, again))
    out["second_closed"] = second.closed
    return out


def gpu_engines_in_turn(rank: int, world_size: int, hf_config: dict[str, Any], rounds: int) -> dict[str, Any]:
    """``rounds`` actor engines built, trained one PPO step and closed in turn on one GPU; device memory
    (allocated, and reserved by torch's cache) at the start, with each engine, and after each close."""
    from functools import partial

    from verl_engine.losses import ppo_loss

    torch.cuda.init()
    out: dict[str, Any] = {
        "start": torch.cuda.memory_allocated(),
        "with": [],
        "after": [],
        "reserved_after": [],
    }
    batch = verl_batch(
        seed=0, prompt_lens=[5, 9, 3, 7], response_lens=[60, 30, 90, 45], vocab=hf_config["vocab_size"]
    )
    overrides = ["trainer.n_gpus_per_node=1", "actor_rollout_ref.model.use_fused_kernels=true"]
    for _ in range(rounds):
        engine, cfg = _engine(overrides, "actor", "random-init", "cuda", hf_config=hf_config)
        with engine.train_mode():
            engine.train_batch(
                {**batch, "calculate_entropy": True}, partial(ppo_loss, config=cfg.actor_rollout_ref.actor)
            )
        out["with"].append(torch.cuda.memory_allocated())
        engine.close()
        out["after"].append(torch.cuda.memory_allocated())
        out["reserved_after"].append(torch.cuda.memory_reserved())
    out["live_cuda_tensors"] = _live_cuda_tensors()
    return out


def _live_cuda_tensors() -> list[str]:
    """Every CUDA tensor the garbage collector still reaches (shape, dtype, bytes): what a leak holds."""
    import gc

    gc.collect()
    found = []
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor) and obj.is_cuda:
                found.append(f"{tuple(obj.shape)} {obj.dtype} {obj.untyped_storage().nbytes()} B")
        except Exception:  # objects that fail isinstance or attribute access are not tensors we own
            continue
    return sorted(found)


def gpu_wgrad_fusion_grads(
    rank: int,
    world_size: int,
    hf_config: dict[str, Any],
    fused_head: bool,
    runs: list[str],
    overrides: tuple[str, ...] = (),
) -> list[dict[str, Any]]:
    """One PPO forward/backward (two micro-batches of two sequences) on one GPU per entry of ``runs``
    ("default": megatron-core's wgrad accumulation fusion left to the engine's default, "off": switched
    off, "torch_kernels": the default with the vocabulary and SwiGLU kernels replaced by their torch paths),
    engines built and closed in turn; every parameter's fp32 ``main_grad`` of each run, and whether the fused
    GEMM was really in use. ``overrides``: more config keys for every run."""
    import contextlib
    from functools import partial

    from megatron.core.tensor_parallel import layers

    from verl_engine.losses import ppo_loss
    from verl_engine.vocab_kernels import torch_ops_only
    from verl_mcore_utils.module import get_model_config
    from verl_mcore_utils.swiglu import torch_form_only

    batch = verl_batch(
        seed=0, prompt_lens=[5, 9, 3, 7], response_lens=[60, 30, 90, 45], vocab=hf_config["vocab_size"]
    )
    base = [
        "trainer.n_gpus_per_node=1",
        f"actor_rollout_ref.model.use_fused_kernels={str(fused_head).lower()}",
        *overrides,
    ]
    knob = "actor_rollout_ref.actor.megatron.override_transformer_config.gradient_accumulation_fusion"
    unknown = sorted(set(runs) - {"default", "off", "torch_kernels"})
    if unknown:  # a misspelt run would otherwise silently be a second "default"
        raise ValueError(f"runs {unknown}: use default, off or torch_kernels")
    out: list[dict[str, Any]] = []
    for run in runs:
        extra = [f"{knob}=false"] if run == "off" else []
        engine, cfg = _engine([*base, *extra], "actor", "random-init", "cuda", hf_config=hf_config)
        chunk = engine.model[0] if isinstance(engine.model, list) else engine.model
        config = get_model_config(chunk)
        engine.optimizer_zero_grad()
        paths = contextlib.ExitStack()
        if run == "torch_kernels":
            paths.enter_context(torch_ops_only())
            paths.enter_context(torch_form_only())
        with engine.train_mode(), paths:
            result = engine.forward_backward_batch(
                {**batch, "calculate_entropy": True},
                partial(ppo_loss, config=cfg.actor_rollout_ref.actor),
                forward_only=False,
            )
            # inside train_mode: leaving it may release the gradient buffers (the engine's lifecycle)
            grads = {n: p.main_grad.detach().float().cpu().clone() for n, p in chunk.named_parameters()}
        out.append(
            {
                "flag": bool(config.gradient_accumulation_fusion),
                "available": bool(layers._grad_accum_fusion_available),
                "loss": float(result["loss"]),
                "grads": grads,
            }
        )
        engine.close()
    return out


def build_error(rank: int, world_size: int, model_dir: str, overrides: list[str]) -> str:
    """The message of the error building the actor raises (AssertionError when it builds)."""
    try:
        _engine(overrides, "actor", model_dir, "cpu")
    except (NotImplementedError, ValueError) as error:
        return str(error)
    raise AssertionError(f"the actor was built with {overrides}")


def moe_graph_references(rank: int, world_size: int, model_dir: str, batch: dict[str, Any]) -> dict[str, Any]:
    """A MoE actor after one forward/backward: how many graph-attached tensors its modules' helper objects
    keep, what ``drop_autograd_graphs`` drops, and whether megatron-core's MoE metrics tracker survives close."""
    from functools import partial

    from verl_engine.lifetime import drop_autograd_graphs
    from verl_engine.losses import ppo_loss
    from verl_mcore_utils.module import unwrap_model

    def kept(model: Any) -> list[str]:
        found = []
        for name, module in unwrap_model(model).named_modules():
            owners = [(name, module)] + [
                (f"{name}.{k}", v)
                for k, v in vars(module).items()
                if hasattr(v, "__dict__") and not isinstance(v, (torch.nn.Module, torch.Tensor))
            ]
            for owner_name, owner in owners:
                for key, value in vars(owner).items():
                    if isinstance(value, torch.Tensor) and value.grad_fn is not None:
                        found.append(f"{owner_name}.{key}")
        return found

    overrides = [
        f"trainer.n_gpus_per_node={world_size}",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    ]
    engine, cfg = _engine(overrides, "actor", model_dir, "cpu")
    with engine.train_mode():
        engine.forward_backward_batch({**batch}, partial(ppo_loss, config=cfg.actor_rollout_ref.actor))
    before = kept(engine.model)
    params = {n: p.detach().clone() for n, p in unwrap_model(engine.model).named_parameters()}
    dropped = drop_autograd_graphs(engine.model)
    after = kept(engine.model)
    same = all(torch.equal(p, params[n]) for n, p in unwrap_model(engine.model).named_parameters())
    engine.close()
    try:
        from megatron.core.transformer.moe import moe_logging

        tracker_left = moe_logging._MOE_METRICS_TRACKER is not None
    except ImportError:
        from megatron.core.transformer.moe import moe_utils

        tracker_left = bool(moe_utils._MOE_LAYER_WISE_LOGGING_TRACKER)
    return {
        "before": before,
        "dropped": dropped,
        "after": after,
        "params_kept": same,
        "tracker_left": tracker_left,
    }


def moe_engines_of_two_depths(
    rank: int, world_size: int, model_dirs: list[str], batch: dict[str, Any]
) -> list[float]:
    """MoE actors of different depths stepped one after the other in one process, none closed: each one's loss
    (megatron-core's MoE metrics tracker, sized by the first model, once made the deeper one fail)."""
    from functools import partial

    from verl_engine.losses import ppo_loss

    overrides = [
        f"trainer.n_gpus_per_node={world_size}",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    ]
    engines, losses = [], []
    for model_dir in model_dirs:
        engine, cfg = _engine(overrides, "actor", model_dir, "cpu")
        engines.append(engine)
        with engine.train_mode():
            out = engine.forward_backward_batch(
                {**batch}, partial(ppo_loss, config=cfg.actor_rollout_ref.actor)
            )
        losses.append(float(out["loss"]))
    return losses
