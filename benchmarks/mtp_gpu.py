"""Multi-token prediction on one GPU, bf16: a Qwen2-shaped model with one MTP layer trains, MTP loss falls.

    python3 benchmarks/mtp_gpu.py --out benchmarks/results/mtp_h100.json

A random Qwen2.5-0.5B-shaped model (hidden 896, 14 / 2 heads, vocab 151936; ``--layers`` decoder layers)
whose config.json declares ``num_nextn_predict_layers: 1`` is saved with save_pretrained and loaded by the
engine through ``model.path`` with ``actor_rollout_ref.model.mtp.enable=true`` / ``enable_train=true``
(megatron-core's MTP block, bf16, megatron optimizer). The data are learnable sequences (each token is
the previous one plus a per-sequence stride, modulo a small vocabulary range), so both the next-token
loss and the MTP loss (token ``c + 2`` from position ``c``) can fall. ``--steps`` actor ``train_batch``
calls with the SFT loss on the same batch; per step: SFT loss, ``mtp_losses/mtp_1_loss``, grad norm,
time. Also recorded: the LM head gets no MTP gradient (one extra forward-backward with the SFT loss
zeroed: the output layer's gradient must be exactly zero while the MTP layer's is not).

Writes JSON (device, versions, config, numbers) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from _common import save_model
from _record import write_record


def make_batch(*, n: int, prompt: int, response: int, seed: int) -> dict[str, torch.Tensor]:
    """Arithmetic sequences over tokens [1000, 1512): token i+1 = token i + stride (per sequence)."""
    g = torch.Generator().manual_seed(seed)
    length = prompt + response
    start = torch.randint(0, 512, (n, 1), generator=g)
    stride = torch.randint(1, 8, (n, 1), generator=g)
    ids = 1000 + (start + stride * torch.arange(length)[None]) % 512
    mask = torch.ones_like(ids)
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "position_ids": (mask.cumsum(1) - 1).clamp(min=0),
        "response_mask": mask[:, prompt:].clone(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--response", type=int, default=384)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--lr", type=float, default=3e-4)
    args = parser.parse_args()

    from verl_config import load_config
    from verl_engine.build import rl_engine_from_config
    from verl_engine.losses import sft_loss
    from verl_mcore_utils.module import unwrap_model
    from verl_mcore_utils.parallel import init_parallel

    work = Path(tempfile.mkdtemp())
    model_dir = save_model(
        work / "qwen2_mtp", layers=args.layers, extra={"num_nextn_predict_layers": 1}, small_init=False
    )
    batch = make_batch(n=args.sequences, prompt=args.prompt, response=args.response, seed=0)
    tokens = int(batch["attention_mask"].sum())
    overrides = [
        "model_engine=megatron",
        f"actor_rollout_ref.model.path={model_dir}",
        "actor_rollout_ref.model.mtp.enable=true",
        "actor_rollout_ref.model.mtp.enable_train=true",
        "trainer.n_gpus_per_node=1",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        f"data.max_prompt_length={args.prompt}",
        f"data.max_response_length={args.response}",
        f"data.train_batch_size={args.sequences}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={args.sequences}",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
        "critic.ppo_micro_batch_size_per_gpu=4",
        "critic.model.path=${actor_rollout_ref.model.path}",  # GAE (the default) uses the critic: give its model
        f"actor_rollout_ref.actor.optim.lr={args.lr}",
        "actor_rollout_ref.actor.optim.weight_decay=0.0",
        f"actor_rollout_ref.actor.optim.total_training_steps={args.steps}",
        "critic.optim.total_training_steps=10",
    ]
    cfg = load_config(overrides=overrides)
    init_parallel(device="cuda")
    device = torch.device("cuda", torch.cuda.current_device())
    actor = rl_engine_from_config(cfg, role="actor", device=device)
    gpt = unwrap_model(actor.model)

    def zero_sft(**kw):
        loss, metrics = sft_loss(**kw)
        return loss * 0.0, metrics

    with actor.train_mode():  # the LM head's gradient with only the MTP loss: exactly zero
        actor.optimizer_zero_grad()
        probe = actor.forward_backward_batch(batch, zero_sft)
        head_grad = float(getattr(gpt.output_layer.weight, "main_grad", gpt.output_layer.weight).abs().max())
        mtp_grad = max(float(getattr(p, "main_grad", p).abs().max()) for p in gpt.mtp.parameters())
        actor.optimizer_zero_grad()

    steps = []
    with actor.train_mode():
        for step in range(args.steps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = actor.train_batch(batch, sft_loss)
            torch.cuda.synchronize()
            seconds = time.perf_counter() - t0
            actor.lr_scheduler_step()
            steps.append(
                {
                    "step": step,
                    "sft_loss": out["loss"],
                    "mtp_1_loss": out["metrics"]["mtp_losses/mtp_1_loss"],
                    "grad_norm": out["metrics"]["grad_norm"],
                    "seconds": seconds,
                }
            )
            print(json.dumps(steps[-1]), flush=True)
    first, last = steps[0]["mtp_1_loss"], steps[-1]["mtp_1_loss"]
    record = write_record(
        args.out,
        benchmark="mtp_gpu",
        config={
            "model": "Qwen2.5-0.5B-shaped, random weights, num_nextn_predict_layers=1",
            "layers": args.layers,
            "sequences": args.sequences,
            "tokens": tokens,
            "dtype": "bfloat16",
            "lr": args.lr,
            "loss": "sft_loss + 0.1 * mtp_1_loss",
        },
        extra_versions=("transformers",),
        numbers={
            "lm_head_grad_from_mtp_only": head_grad,
            "mtp_layer_grad_from_mtp_only": mtp_grad,
            "mtp_only_probe_metric": probe["metrics"]["mtp_losses/mtp_1_loss"],
            "steps": steps,
            "mtp_loss_first": first,
            "mtp_loss_last": last,
            "mtp_loss_fell": last < first,
            "tokens_per_s_train_batch": tokens
            / (sum(s["seconds"] for s in steps[1:]) / max(1, len(steps) - 1)),
            "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
        },
    )
    print(json.dumps({k: v for k, v in record.items() if k != "steps"}, indent=2, default=float))
    if not record["mtp_loss_fell"] or head_grad != 0.0 or mtp_grad == 0.0:
        raise SystemExit("MTP check failed: see the record")


if __name__ == "__main__":
    main()
