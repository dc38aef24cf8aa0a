"""verl batches as the RL engine reads them (RLBatch), and the engine's tokenizer: no process group needed."""

from __future__ import annotations

import pytest
import torch

from verl_engine.engine import MicroBatching, RLEngine
from verl_engine.rl_batch import RLBatch, read_scalar


def _batch(prompt_lens: list[int], response_lens: list[int]) -> dict[str, torch.Tensor]:
    p, r = max(prompt_lens), max(response_lens)
    mask = torch.zeros((len(prompt_lens), p + r), dtype=torch.int64)
    for i, (pl, rl) in enumerate(zip(prompt_lens, response_lens, strict=True)):
        mask[i, p - pl : p + rl] = 1
    ids = torch.arange(mask.numel()).view(mask.shape) % 97 + 1
    return {"input_ids": ids * mask, "attention_mask": mask, "response_mask": mask[:, p:].clone()}


def test_padded_batch_is_packed_with_each_sequence_extent() -> None:
    data = _batch([3, 1, 2], [2, 4, 1])
    batch = RLBatch.from_data(data)
    assert batch.packed.seq_lens == (5, 5, 3)
    assert (batch.prompt_lens, batch.response_lens, batch.left_pad) == ((3, 1, 2), (2, 4, 1), (0, 2, 1))
    assert torch.equal(batch.packed.input_ids, data["input_ids"][data["attention_mask"].bool()])
    # label-aligned per-token values 0..n-1 of every sequence: response token t reads slot prompt - 1 + t
    merged = torch.cat([torch.arange(n, dtype=torch.float32) for n in batch.packed.seq_lens])
    view = batch.response_view(merged, indices=[0, 1, 2])
    assert view.tolist() == [[2, 3, 0, 0], [0, 1, 2, 3], [1, 0, 0, 0]]
    back = batch.to_input_layout([torch.arange(n, dtype=torch.float32) for n in batch.packed.seq_lens])
    assert back[1].tolist() == [0, 0, 0, 1, 2, 3, 4] and back[0].tolist() == [0, 1, 2, 3, 4, 0, 0]


@pytest.mark.parametrize(
    ("change", "pattern"),
    [
        ("hole", "must be one contiguous run"),
        ("no_prompt", "have no prompt token"),
        ("no_mask", "has no 'attention_mask'"),
        ("empty_row", "sequences \\[1\\] have no valid token"),
        ("shape", "input_ids .* and attention_mask .* differ in shape"),
        ("wide_response", "response_mask must be \\[B, R\\]"),
    ],
)
def test_bad_batches_name_the_key(change: str, pattern: str) -> None:
    data = _batch([3, 2], [2, 2])
    if change == "hole":
        data["attention_mask"][0, 1] = 0
    elif change == "no_prompt":
        data["attention_mask"][1, :3] = 0
    elif change == "no_mask":
        del data["attention_mask"]
    elif change == "empty_row":
        data["attention_mask"][1] = 0
    elif change == "shape":
        data["input_ids"] = data["input_ids"][:, 1:]
    else:
        data["response_mask"] = torch.ones((2, 9), dtype=torch.int64)
    with pytest.raises(ValueError, match=pattern):
        RLBatch.from_data(data)


def test_jagged_input_must_match_the_mask() -> None:
    data = _batch([3, 2], [2, 2])
    mask = data["attention_mask"].bool()
    seqs = [data["input_ids"][i, mask[i]] for i in range(2)]
    data["input_ids"] = torch.nested.nested_tensor(seqs, layout=torch.jagged)
    batch = RLBatch.from_data(data)
    assert batch.jagged and batch.left_pad == (0, 0)
    data["input_ids"] = torch.nested.nested_tensor([seqs[0], seqs[1][:-1]], layout=torch.jagged)
    with pytest.raises(ValueError, match="jagged input_ids hold sequences of lengths"):
        RLBatch.from_data(data)


def test_scalars_and_micro_batching_rules() -> None:
    assert read_scalar({"t": torch.tensor(0.5)}, "t", 1.0) == 0.5
    assert read_scalar({}, "t", 1.0) == 1.0
    fixed = MicroBatching(use_dynamic_bsz=False, micro_batch_size_per_gpu=2)
    assert fixed.split((5, 5, 5, 5, 5), pool=2, groups_per_pool=2) == [(0, 1, 2, 3), (4,)]
    dynamic = MicroBatching(use_dynamic_bsz=True, max_token_len_per_gpu=4)
    assert dynamic.split((9, 2, 3, 3), pool=1, groups_per_pool=1) == [(0,), (2,), (3,), (1,)]  # 9 > 4: alone
    with pytest.raises(ValueError, match="use_dynamic_bsz needs max_token_len_per_gpu > 0"):
        MicroBatching(use_dynamic_bsz=True)
    with pytest.raises(ValueError, match="micro_batch_size_per_gpu must be > 0"):
        MicroBatching(use_dynamic_bsz=False)


def test_the_tokenizer_of_model_path_is_transformers_auto_tokenizer(tmp_path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "hello": 1, "world": 2}
    raw = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>").save_pretrained(tmp_path)
    engine = RLEngine(
        model=torch.nn.Linear(1, 1),
        optimizer=None,
        backend=None,
        tp_group=None,
        tp_size=1,
        device=torch.device("cpu"),
        cp_layout=None,  # type: ignore[arg-type]
        cp_groups=None,
        cp_workload=None,
        micro_batching=MicroBatching(use_dynamic_bsz=False, micro_batch_size_per_gpu=1),
        value_model=False,
        tokenizer_path=str(tmp_path),
    )
    assert engine.tokenizer("hello world")["input_ids"] == [1, 2]
    with pytest.raises(RuntimeError, match="has no optimizer"):
        engine.optimizer_step()


def test_micro_batches_are_split_to_a_multiple_of_the_pipeline_size() -> None:
    import pytest

    from verl_engine.engine import split_to_multiple

    assert split_to_multiple([(0, 1), (2, 3), (4,)], multiple=2) == [(0,), (1,), (2, 3), (4,)]
    assert split_to_multiple([(0, 1, 2, 3)], multiple=4) == [(0,), (1,), (2,), (3,)]
    assert split_to_multiple([(0,), (1,)], multiple=2) == [(0,), (1,)]
    with pytest.raises(ValueError, match="pipeline_model_parallel_size=4 micro-batches.*only 3 sequences"):
        split_to_multiple([(0, 1), (2,)], multiple=4)
