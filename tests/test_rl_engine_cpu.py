"""The RL engine (verl's engine surface) on CPU, fp32, gloo: parity with Hugging Face transformers.

A tiny random Qwen2 model is saved with save_pretrained; the engine loads it through ``model.path`` and
computes log-probs and entropy of a verl-style padded batch (left-padded prompts, right-padded responses)
under every layout: TP 1 packed and padded, DP 2, TP 2, static CP 2, dynamic CP, dynamic batch sizes.
The reference is transformers' own forward in float64 on each sequence's valid tokens. Bound: 1e-5
relative to the largest reference value (fp32 engine vs fp64 reference).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from rl_engine_workers import infer_layouts, verl_batch

from verl_mcore_utils.testing import run_distributed

A = "actor_rollout_ref.actor"
AM = f"{A}.megatron"
SMALL_DATA = ["data.max_prompt_length=8", "data.max_response_length=8"]
FUSED = ["actor_rollout_ref.model.use_fused_kernels=true"]  # the LM head inside the chunked log-prob loss
PROMPTS, RESPONSES = [3, 6, 1, 5, 2], [7, 2, 5, 4, 6]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from verl_mcore_utils.hf_testing import save_tiny_hf_model

    return str(save_tiny_hf_model("qwen2", tmp_path_factory.mktemp("qwen2") / "model", seed=3))


def hf_reference(model_dir: str, batch: dict) -> dict[str, torch.Tensor]:
    """transformers' log p(token c+1) and entropy at every valid column c (last valid column 0), float64."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float64).eval()
    ids, mask = batch["input_ids"], batch["attention_mask"].bool()
    logp_out = torch.zeros(ids.shape, dtype=torch.float64)
    ent_out = torch.zeros(ids.shape, dtype=torch.float64)
    with torch.no_grad():
        for i in range(ids.shape[0]):
            cols = torch.nonzero(mask[i]).flatten()
            seq = ids[i, cols]
            logits = model(seq[None]).logits[0]
            logp = torch.log_softmax(logits, dim=-1)
            picked = logp[:-1].gather(1, seq[1:, None]).squeeze(1)
            ent = -(logp.exp() * logp).sum(-1)
            logp_out[i, cols[:-1]] = picked
            ent_out[i, cols[:-1]] = ent[:-1]
    return {"log_probs": logp_out, "entropy": ent_out}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def _check(results: list[dict], reference: dict, names: list[str]) -> None:
    for name, out in zip(names, results, strict=True):
        for key in ("log_probs", "entropy"):
            assert rel_err(out[key], reference[key]) < 1e-5, (name, key, rel_err(out[key], reference[key]))


def test_log_probs_and_entropy_match_transformers_on_one_rank(model_dir: str) -> None:
    batch = verl_batch(seed=0, prompt_lens=PROMPTS, response_lens=RESPONSES)
    reference = hf_reference(model_dir, batch)
    layouts = {
        "packed": [],
        "padded": [f"{AM}.use_remove_padding=false"],
        "packed_fused": FUSED,
        "padded_fused": [f"{AM}.use_remove_padding=false", *FUSED],
        "dynamic_bsz": [*SMALL_DATA, f"{A}.use_dynamic_bsz=true", f"{A}.ppo_max_token_len_per_gpu=16"],
        "micro_batch_1": [f"{A}.ppo_micro_batch_size_per_gpu=1", "data.train_batch_size=4"],
    }
    results = run_distributed(
        infer_layouts,
        world_size=1,
        args=(model_dir, [["trainer.n_gpus_per_node=1", *v] for v in layouts.values()], batch),
    )[0]
    _check(results, reference, list(layouts))


def test_log_probs_and_entropy_match_transformers_on_two_ranks(model_dir: str) -> None:
    batch = verl_batch(seed=1, prompt_lens=PROMPTS, response_lens=RESPONSES)
    reference = hf_reference(model_dir, batch)
    layouts = {
        "dp2": [],
        "tp2": [f"{AM}.tensor_model_parallel_size=2", f"{AM}.sequence_parallel=false"],
        "tp2_fused": [f"{AM}.tensor_model_parallel_size=2", f"{AM}.sequence_parallel=false", *FUSED],
        "cp2": [f"{AM}.context_parallel_size=2"],
        "dynamic_cp": [f"{AM}.dynamic_context_parallel=true", f"{AM}.max_seqlen_per_dp_cp_rank=8"],
        "dynamic_cp_fused": [
            f"{AM}.dynamic_context_parallel=true",
            f"{AM}.max_seqlen_per_dp_cp_rank=8",
            *FUSED,
        ],
        "dynamic_bsz_dp2": [*SMALL_DATA, f"{A}.use_dynamic_bsz=true", f"{A}.ppo_max_token_len_per_gpu=16"],
    }
    per_rank = run_distributed(
        infer_layouts,
        world_size=2,
        args=(model_dir, [["trainer.n_gpus_per_node=2", *v] for v in layouts.values()], batch),
    )
    for rank_results in per_rank:  # every rank returns the same outputs
        _check(rank_results, reference, list(layouts))


def test_tensordict_with_jagged_input_ids(model_dir: str) -> None:
    from rl_engine_workers import infer_tensordict

    batch = verl_batch(seed=8, prompt_lens=PROMPTS, response_lens=RESPONSES)
    reference = hf_reference(model_dir, batch)
    for per_seq in run_distributed(infer_tensordict, world_size=2, args=(model_dir, batch)):
        mask = batch["attention_mask"].bool()
        for i, values in enumerate(per_seq):  # jagged in, jagged out: the valid tokens only, in input order
            assert rel_err(values, reference["log_probs"][i, mask[i]]) < 1e-5


def test_over_budget_sequences_and_fewer_sequences_than_ranks(model_dir: str) -> None:
    """A sequence longer than the token budget runs in a micro-batch of its own; one sequence on two ranks."""
    long_batch = verl_batch(seed=9, prompt_lens=[3, 9, 2], response_lens=[2, 8, 3])  # 17 tokens > budget 8
    single = verl_batch(seed=10, prompt_lens=[4], response_lens=[5])
    budget = [
        "data.max_prompt_length=4",
        "data.max_response_length=4",
        f"{A}.use_dynamic_bsz=true",
        f"{A}.ppo_max_token_len_per_gpu=8",
    ]
    for batch in (long_batch, single):
        reference = hf_reference(model_dir, batch)
        layouts = [
            ["trainer.n_gpus_per_node=2", *budget],
            ["trainer.n_gpus_per_node=2", f"{AM}.context_parallel_size=2"],
        ]
        for rank_results in run_distributed(infer_layouts, world_size=2, args=(model_dir, layouts, batch)):
            _check(rank_results, reference, ["budget", "cp2"])


def test_a_bad_batch_fails_on_every_rank_with_the_key(model_dir: str) -> None:
    batch = verl_batch(seed=2, prompt_lens=PROMPTS, response_lens=RESPONSES)
    del batch["attention_mask"]
    with pytest.raises(RuntimeError, match="the batch has no 'attention_mask'"):
        run_distributed(infer_layouts, world_size=2, args=(model_dir, [["trainer.n_gpus_per_node=2"]], batch))


def test_unsupported_architecture_is_named(tmp_path: Path) -> None:
    from verl_engine.build import load_hf_config

    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    with pytest.raises(ValueError, match="architecture 'gpt2' is not supported.*qwen2, qwen3, llama"):
        load_hf_config(tmp_path)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_hf_config(tmp_path / "missing")


# Adam's first step divides each gradient by its own magnitude, which turns fp32 rounding noise of
# near-zero gradients into visible parameter differences; a larger epsilon (megatron's adam_eps, read by
# both backends) keeps the update a smooth function of the gradient so 1e-5 can be asserted on parameters.
STEP = ["+actor_rollout_ref.actor.optim.override_optimizer_config.adam_eps=1e-3"]
LOSSES = {
    "vanilla": [],
    "gspo_kl_entropy": [
        f"{A}.policy_loss.loss_mode=gspo",
        f"{A}.use_kl_loss=true",
        f"{A}.kl_loss_type=low_var_kl",
        f"{A}.entropy_coeff=0.01",
    ],
    "seq_mean_token_sum_dual_clip": [f"{A}.loss_agg_mode=seq-mean-token-sum", f"{A}.clip_ratio_c=1.5"],
}
MICRO = {
    "mb2": [],
    "mb1": [f"{A}.ppo_micro_batch_size_per_gpu=1"],
    "mb4": [f"{A}.ppo_micro_batch_size_per_gpu=4"],
    "dynamic_bsz": [*SMALL_DATA, f"{A}.use_dynamic_bsz=true", f"{A}.ppo_max_token_len_per_gpu=16"],
}


def _same_step(a: dict, b: dict, what: str) -> None:
    assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"]) + 1e-7, (what, a["loss"], b["loss"])
    for key in ("grads", "params"):
        worst = max(rel_err(a[key][n], b[key][n]) for n in b[key])
        assert worst < 1e-5, (what, key, worst)


def _run_steps(world: int, model_dir: str, batch: dict, layouts: dict[str, list[str]]) -> list[dict]:
    from rl_engine_workers import ppo_step_layouts

    args = [[f"trainer.n_gpus_per_node={world}", *STEP, *v] for v in layouts.values()]
    return run_distributed(ppo_step_layouts, world_size=world, args=(model_dir, args, batch))


def test_one_ppo_step_is_independent_of_micro_batching_dp_and_cp(model_dir: str) -> None:
    batch = verl_batch(seed=4, prompt_lens=PROMPTS, response_lens=RESPONSES)
    layouts = {f"{loss}/{mb}": [*lo, *mo] for loss, lo in LOSSES.items() for mb, mo in MICRO.items()}
    one = dict(zip(layouts, _run_steps(1, model_dir, batch, layouts)[0], strict=True))
    two_layouts = {
        f"{loss}/{name}": [*lo, *extra]
        for loss, lo in LOSSES.items()
        for name, extra in {"dp2": [], "cp2": [f"{AM}.context_parallel_size=2"]}.items()
    }
    per_rank = _run_steps(2, model_dir, batch, two_layouts)
    for loss in LOSSES:
        reference = one[f"{loss}/mb2"]
        assert reference["grads"] and reference["metrics"]["grad_norm"] > 0
        for mb in MICRO:
            _same_step(one[f"{loss}/{mb}"], reference, f"{loss}/{mb}")
        for rank_results in per_rank:
            got = dict(zip(two_layouts, rank_results, strict=True))
            for name in ("dp2", "cp2"):
                _same_step(got[f"{loss}/{name}"], reference, f"{loss}/{name}")
    # the loss-share metrics are global, not per micro-batch: identical whatever the micro-batching
    for mb in MICRO:
        assert (
            abs(
                one[f"vanilla/{mb}"]["metrics"]["actor/pg_loss"]
                - one["vanilla/mb2"]["metrics"]["actor/pg_loss"]
            )
            < 1e-6
        )


def test_the_fused_lm_head_gives_the_same_ppo_step(model_dir: str) -> None:
    """use_fused_kernels: the loss, every gradient (LM head and decoder) and the updated weights equal the
    unfused step's (fp32, 1e-5), with an entropy term so both outputs' gradients flow; one rank and DP 2."""
    batch = verl_batch(seed=6, prompt_lens=PROMPTS, response_lens=RESPONSES)
    entropy_kl = LOSSES["gspo_kl_entropy"]
    one = _run_steps(1, model_dir, batch, {"plain": entropy_kl, "fused": [*entropy_kl, *FUSED]})[0]
    assert one[0]["grads"]["output_layer.weight"].abs().max() > 0
    _same_step(one[1], one[0], "fused, one rank")
    for rank_results in _run_steps(2, model_dir, batch, {"fused_dp2": [*entropy_kl, *FUSED]}):
        _same_step(rank_results[0], one[0], "fused, dp2")


def test_fused_kernels_with_an_unknown_backend_is_refused(model_dir: str) -> None:
    from rl_engine_workers import infer_layouts

    bad = [
        "trainer.n_gpus_per_node=1",
        *FUSED,
        "actor_rollout_ref.model.fused_kernel_options.impl_backend=triton",
    ]
    with pytest.raises(Exception, match="impl_backend='triton'.*impl_backend=torch"):
        run_distributed(
            infer_layouts,
            world_size=1,
            args=(model_dir, [bad], verl_batch(seed=0, prompt_lens=[2], response_lens=[2])),
        )


def test_critic_values_are_the_backbone_through_a_value_head(model_dir: str) -> None:
    import transformers
    from rl_engine_workers import critic_values

    batch = verl_batch(seed=5, prompt_lens=PROMPTS, response_lens=RESPONSES)
    out = run_distributed(
        critic_values,
        world_size=1,
        args=(model_dir, ["trainer.n_gpus_per_node=1", f"critic.model.path={model_dir}"], batch),
    )[0]
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float64).eval()
    expected = torch.zeros(batch["input_ids"].shape, dtype=torch.float64)
    with torch.no_grad():
        for i in range(expected.shape[0]):
            cols = torch.nonzero(batch["attention_mask"][i]).flatten()
            hidden = model.model(batch["input_ids"][i, cols][None]).last_hidden_state[0]
            expected[i, cols] = hidden @ out["head"].double()[0]
    assert out["values"].shape == batch["input_ids"].shape
    assert rel_err(out["values"], expected) < 1e-5


# our batch checks raise before the model runs: the megatron-core release does not enter (newest only)
@pytest.mark.newest_mcore
@pytest.mark.parametrize(
    ("change", "loss", "pattern"),
    [
        ("drop_advantages", "ppo", "ppo_loss needs data\\['advantages'\\]"),
        ("short_returns", "value", "returns"),
        ("empty", "ppo", "empty batch"),
    ],
)
def test_bad_batches_fail_on_every_rank(model_dir: str, change: str, loss: str, pattern: str) -> None:
    from rl_engine_workers import engine_call

    batch = verl_batch(seed=6, prompt_lens=PROMPTS, response_lens=RESPONSES)
    if change == "drop_advantages":
        del batch["advantages"]
    elif change == "short_returns":
        batch["returns"] = batch["returns"][:, :-1]
    else:
        batch = {k: v[:0] for k, v in batch.items()}
    role = "critic" if loss == "value" else "actor"
    args = (model_dir, ["trainer.n_gpus_per_node=2", f"critic.model.path={model_dir}"], batch, role, loss)
    with pytest.raises(Exception) as err:
        run_distributed(engine_call, world_size=2, args=args, timeout_s=240)
    text = str(err.value)
    # the error itself, not a timeout: every rank checks the same batch before any collective
    assert re.search(pattern, text) and "timed out" not in text, text


def test_an_all_zero_response_mask_gives_zero_loss_and_no_nan(model_dir: str) -> None:
    from rl_engine_workers import engine_call

    batch = verl_batch(seed=7, prompt_lens=PROMPTS, response_lens=RESPONSES)
    batch["response_mask"] = torch.zeros_like(batch["response_mask"])
    out = run_distributed(engine_call, world_size=1, args=(model_dir, ["trainer.n_gpus_per_node=1"], batch))[
        0
    ]
    assert out["loss"] == 0.0
    assert all(v == v for v in out["metrics"].values())  # no NaN
