"""GRPO's pieces on CPU: group-normalised advantages, verl's rollout batch layout, weight sync into the embedded
transformers rollout engine.

* ``grpo_outcome_advantage`` equals verl's per-group loop (``torch.mean`` / ``torch.std`` per prompt, a lone
  response with mean 0 and std 1) re-computed here, for contiguous and interleaved groups, with and without the
  std (Dr. GRPO); groups of several responses have zero mean and unit std.
* ``rollout_batch``: prompts left-padded, responses right-padded, masks and positions as verl builds them.
* ``HFRollout`` after ``update_weights(engine.get_per_tensor_param())``: greedy responses equal the argmax of the
  rollout model's own forward, sampling with a seed is reproducible and prompt-major, and the engine's log-probs
  of the generated responses equal the rollout model's (1e-5): the exported weights are the engine's. A weight sync
  that misses a tensor is an error.
"""

from __future__ import annotations

import pytest
import torch
from rl_engine_workers import rollout_round_trip, transformers_log_probs

from verl_engine.apps.grpo import grpo_outcome_advantage, rollout_batch
from verl_engine.apps.rollout import HFRollout, RolloutEngine, SamplingParams
from verl_mcore_utils.testing import run_distributed


def _verl_reference(scores: torch.Tensor, ids: list, *, norm: bool, eps: float = 1e-6) -> torch.Tensor:
    by_group: dict = {}
    for i, g in enumerate(ids):
        by_group.setdefault(g, []).append(scores[i])
    stats = {}
    for g, values in by_group.items():
        if len(values) == 1:
            stats[g] = (torch.tensor(0.0, dtype=scores.dtype), torch.tensor(1.0, dtype=scores.dtype))
        else:
            stacked = torch.stack(values)
            stats[g] = (stacked.mean(), stacked.std())
    out = scores.clone()
    for i, g in enumerate(ids):
        mean, std = stats[g]
        out[i] = (scores[i] - mean) / (std + eps) if norm else scores[i] - mean
    return out


@pytest.mark.parametrize("norm", [True, False])
def test_grpo_advantage_equals_verls_group_loop(norm: bool) -> None:
    g = torch.Generator().manual_seed(3)
    scores = torch.randint(0, 2, (14,), generator=g).double() + 0.1 * torch.randn(
        14, generator=g, dtype=torch.float64
    )
    ids = [0, 0, 0, 0, 1, 1, 1, 1, 2, 3, 3, 3, 1, 0]  # interleaved groups and a lone response (group 2)
    got = grpo_outcome_advantage(scores, group_ids=ids, norm_adv_by_std_in_grpo=norm)
    torch.testing.assert_close(got, _verl_reference(scores, ids, norm=norm), rtol=1e-12, atol=1e-12)
    for group in (0, 1, 3):
        members = got[[i for i, x in enumerate(ids) if x == group]]
        assert abs(float(members.mean())) < 1e-12
        if norm:
            assert abs(float(members.std()) - 1.0) < 1e-5
    assert float(got[8]) == pytest.approx(float(scores[8]) / (1 + 1e-6) if norm else float(scores[8]))
    same = grpo_outcome_advantage(torch.ones(4), group_ids=[0] * 4)
    assert torch.equal(same, torch.zeros(4))  # every sample equal: no signal, no NaN


def test_rollout_batch_layout() -> None:
    batch = rollout_batch([[7, 8, 9], [4]], [[1, 2], []], pad_token_id=0)
    assert batch["input_ids"].tolist() == [[7, 8, 9, 1, 2], [0, 0, 4, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [0, 0, 1, 0, 0]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 4], [0, 0, 0, 0, 0]]
    assert batch["response_mask"].tolist() == [[1, 1], [0, 0]]
    assert batch["responses"].tolist() == [[1, 2], [0, 0]] and batch["prompts"].tolist() == [
        [7, 8, 9],
        [0, 0, 4],
    ]
    with pytest.raises(ValueError, match="one response per prompt"):
        rollout_batch([[1]], [], pad_token_id=0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(max_new_tokens=4, top_p=0.0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from verl_mcore_utils.hf_testing import save_tiny_hf_model

    return str(save_tiny_hf_model("qwen2", tmp_path_factory.mktemp("qwen2_rollout") / "model", seed=5))


def test_weight_sync_into_the_transformers_rollout(model_dir: str) -> None:
    prompts = [[3, 9, 17, 4], [11, 2], [30, 31, 32, 33, 34, 35]]
    (out,) = run_distributed(rollout_round_trip, world_size=1, args=(model_dir, prompts))
    rollout = HFRollout(hf_config=out["hf_config"], eos_token_id=5, pad_token_id=0)
    assert isinstance(rollout, RolloutEngine)
    with pytest.raises(RuntimeError, match="before update_weights"):
        rollout.generate(prompts, SamplingParams(max_new_tokens=2))
    rollout.model.load_state_dict(out["rollout_state"])
    assert out["peft_config"] is None

    # greedy = argmax of the rollout model's forward, token by token
    for prompt, response in zip(prompts, out["greedy"], strict=True):
        seq = list(prompt)
        for token in response:
            with torch.no_grad():
                logits = rollout.model(torch.tensor([seq])).logits[0, -1]
            assert token == int(logits.argmax())
            seq.append(token)
        assert len(response) == 6 or response[-1] == 5
    a, b = out["sampled"]
    assert a == b and len(a) == 3 * len(prompts)  # seeded: reproducible; n per prompt, prompt-major
    assert all(len(r) >= 1 for r in a)

    # the engine's log-probs of the responses = the rollout model's (the exported weights are the engine's)
    want = transformers_log_probs(rollout.model.double(), out["batch"])  # per input position, as the engine's
    got = out["log_probs"].double()
    assert got.shape == want.shape
    err = float((got - want).abs().max() / want.abs().max())
    assert err < 1e-5, err

    rollout.model.float()
    partial = [(n, t) for n, t in rollout.model.state_dict().items() if n != "model.norm.weight"]
    with pytest.raises(ValueError, match="did not receive 1 of"):
        rollout.update_weights(partial)
