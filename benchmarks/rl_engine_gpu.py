"""The RL engine on one GPU, bf16: log-prob parity with transformers, one PPO actor step, one critic step.

    python3 benchmarks/rl_engine_gpu.py --out benchmarks/results/rl_engine_h100.json

A random Qwen2.5-0.5B-shaped model (hidden 896, 24 layers, 14 / 2 heads, vocab 151936) is saved with
save_pretrained and loaded by the engine through ``model.path`` (verl-config ``ppo_trainer``,
model_engine=megatron), like a user's checkpoint. Measured:

* log-prob parity on a verl-style padded batch: engine (bf16 weights, megatron-core model, packed THD)
  vs transformers in float32 on the same weights. The bound is relative to transformers' own bf16 error
  on the same tokens (bf16 forward vs float32 forward): the engine must stay within 2x that plus 1e-3
  (mean absolute log-prob error), since both run the same arithmetic in bf16 and differ only in kernel
  order; verl's own checks use 1e-3 / 1e-2.
* one PPO actor ``train_batch`` (ppo_loss, dynamic batch size) and one critic ``train_batch`` (value_loss):
  loss, grad norm, finite outputs; tokens/s of infer_batch and train_batch (warm, synchronised timings).

Writes JSON (device, versions, config, numbers) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from functools import partial
from pathlib import Path

import torch
from _common import QWEN25_05B, rl_batch, save_model, synced
from _record import write_record


def hf_log_probs(model_dir: Path, batch: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=dtype).cuda().eval()
    out = torch.zeros(batch["input_ids"].shape, dtype=torch.float32)
    with torch.no_grad():
        for i in range(batch["input_ids"].shape[0]):
            cols = torch.nonzero(batch["attention_mask"][i]).flatten()
            seq = batch["input_ids"][i, cols].cuda()
            logp = torch.log_softmax(model(seq[None]).logits[0].float(), dim=-1)
            out[i, cols[:-1]] = logp[:-1].gather(1, seq[1:, None]).squeeze(1).cpu()
    del model
    torch.cuda.empty_cache()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--sequences", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--response", type=int, default=1024)
    parser.add_argument("--max-token-len", type=int, default=16384)
    args = parser.parse_args()

    from verl_config import load_config
    from verl_engine.build import rl_engine_from_config
    from verl_engine.losses import ppo_loss, value_loss
    from verl_mcore_utils.parallel import init_parallel

    work = Path(tempfile.mkdtemp())
    model_dir = save_model(work / "qwen25_05b_shaped", layers=args.layers)
    batch = rl_batch(
        n=args.sequences, prompt=args.prompt, response=args.response, vocab=QWEN25_05B["vocab_size"], seed=0
    )
    tokens = int(batch["attention_mask"].sum())
    ref32 = hf_log_probs(model_dir, batch, torch.float32)
    ref16 = hf_log_probs(model_dir, batch, torch.bfloat16)
    valid = torch.zeros_like(batch["attention_mask"], dtype=torch.bool)
    for i in range(valid.shape[0]):
        cols = torch.nonzero(batch["attention_mask"][i]).flatten()
        valid[i, cols[:-1]] = True

    overrides = [
        "model_engine=megatron",
        f"actor_rollout_ref.model.path={model_dir}",
        "trainer.n_gpus_per_node=1",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "data.max_prompt_length=512",
        "data.max_response_length=1024",
        "data.train_batch_size=32",
        "actor_rollout_ref.actor.ppo_mini_batch_size=32",
        "actor_rollout_ref.actor.use_dynamic_bsz=true",
        f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={args.max_token_len}",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.actor.optim.total_training_steps=10",
        "critic.optim.total_training_steps=10",
        f"critic.ppo_max_token_len_per_gpu={args.max_token_len}",
        f"critic.model.path={model_dir}",
    ]
    cfg = load_config(overrides=overrides)
    init_parallel(device="cuda")
    device = torch.device("cuda", torch.cuda.current_device())
    actor = rl_engine_from_config(cfg, role="actor", device=device)

    with actor.eval_mode():
        actor.infer_batch(batch)  # warm-up
        out, infer_s = synced(lambda: actor.infer_batch(batch))
    logp = out["model_output"]["log_probs"].float().cpu()
    engine_err = float((logp - ref32)[valid].abs().mean())
    hf_bf16_err = float((ref16 - ref32)[valid].abs().mean())
    bound = 2 * hf_bf16_err + 1e-3
    max_engine_err = float((logp - ref32)[valid].abs().max())

    loss_fn = partial(ppo_loss, config=cfg.actor_rollout_ref.actor)
    with actor.train_mode():
        actor.train_batch(batch, loss_fn)  # warm-up step (allocations, kernels)
        step, train_s = synced(lambda: actor.train_batch(batch, loss_fn))
    lr = actor.lr_scheduler_step()
    peak_actor = torch.cuda.max_memory_allocated() / 2**30
    actor = None  # free its memory before the critic is built
    torch.cuda.empty_cache()

    critic = rl_engine_from_config(cfg, role="critic", device=device)
    vloss = partial(value_loss, config=cfg.critic)
    with critic.train_mode():
        cstep, critic_s = synced(lambda: critic.train_batch(batch, vloss))

    record = write_record(
        args.out,
        benchmark="rl_engine_gpu",
        config={
            "model": "Qwen2.5-0.5B-shaped, random weights",
            "layers": args.layers,
            "sequences": args.sequences,
            "tokens": tokens,
            "max_token_len_per_gpu": args.max_token_len,
            "dtype": "bfloat16",
        },
        extra_versions=("transformers",),
        numbers={
            "parity": {
                "mean_abs_logp_err_engine_vs_hf_fp32": engine_err,
                "max_abs_logp_err_engine_vs_hf_fp32": max_engine_err,
                "mean_abs_logp_err_hf_bf16_vs_hf_fp32": hf_bf16_err,
                "bound": bound,
                "within_bound": engine_err <= bound,
            },
            "actor_step": {"loss": step["loss"], "metrics": step["metrics"], "lr_after_step": lr},
            "critic_step": {"loss": cstep["loss"], "metrics": cstep["metrics"]},
            "tokens_per_s": {
                "infer_batch": tokens / infer_s,
                "actor_train_batch": tokens / train_s,
                "critic_train_batch": tokens / critic_s,
            },
            "peak_memory_gib_actor": peak_actor,
        },
    )
    print(json.dumps(record, indent=2, default=float))
    if not record["parity"]["within_bound"]:
        raise SystemExit(f"engine log-probs outside the bound: {engine_err} > {bound}")


if __name__ == "__main__":
    main()
