"""Arithmetic data, tokenizer, LR schedule and CLI parsing of verl_engine."""

from __future__ import annotations

import pytest
import torch

from verl_config import ConfigKeyError
from verl_engine.cli import main as engine_main
from verl_engine.cli import parse_train_args
from verl_engine.demo import ArithmeticDataset, CharTokenizer
from verl_engine.engine import lr_at_step


def test_batches_are_deterministic_and_step_dependent() -> None:
    ds = ArithmeticDataset(seq_length=64, seed=3)
    a, b = ds.global_batch(step=5, batch_size=4), ds.global_batch(step=5, batch_size=4)
    assert torch.equal(a.input_ids, b.input_ids)
    assert not torch.equal(a.input_ids, ds.global_batch(step=6, batch_size=4).input_ids)
    assert a.input_ids.shape == a.labels.shape == a.loss_mask.shape == a.position_ids.shape == (4, 64)
    assert torch.equal(a.input_ids[:, 1:], a.labels[:, :-1])  # labels are the next tokens


def test_loss_mask_covers_exactly_the_answers() -> None:
    tok = CharTokenizer()
    batch = ArithmeticDataset(seq_length=48, seed=0, tokenizer=tok).global_batch(step=0, batch_size=2)
    eq, nl = tok.stoi["="], tok.stoi["\n"]
    for row in range(2):
        ids = batch.input_ids[row].tolist()
        for t, masked in enumerate(batch.loss_mask[row].tolist()):
            last_eq = max((i for i, x in enumerate(ids[: t + 1]) if x == eq), default=-1)
            last_nl = max((i for i, x in enumerate(ids[: t + 1]) if x == nl), default=-1)
            assert bool(masked) == (last_eq > last_nl), (
                f"row {row} position {t}"
            )  # label is part of an answer
        text = tok.decode([*ids, batch.labels[row, -1].item()])
        for line in filter(None, text.split("\n")):
            lhs, rhs = line.split("=")
            assert eval(lhs) == int(rhs)  # the data is correct arithmetic
        assert batch.loss_mask[row].sum() > 0


def test_shard_and_micro_batches() -> None:
    batch = ArithmeticDataset(seq_length=32, seed=0).global_batch(step=0, batch_size=8)
    shards = [batch.shard(rank=r, num_shards=2) for r in range(2)]
    assert torch.equal(torch.cat([s.input_ids for s in shards]), batch.input_ids)
    assert [mb.batch_size for mb in shards[0].micro_batches(2)] == [2, 2]
    with pytest.raises(ValueError, match="not divisible by micro batch size 3"):
        shards[0].micro_batches(3)


def test_lr_schedule() -> None:
    kw = {"total_steps": 100, "lr": 1.0, "min_lr": 0.1, "warmup_steps": 10}
    assert lr_at_step(0, style="cosine", **kw) == pytest.approx(0.1)
    assert lr_at_step(9, style="cosine", **kw) == pytest.approx(1.0)
    assert lr_at_step(100, style="cosine", **kw) == pytest.approx(0.1)
    assert lr_at_step(55, style="linear", **kw) == pytest.approx(0.55)
    assert lr_at_step(80, style="constant", **kw) == 1.0


def test_cli_flags_map_to_config_keys() -> None:
    cfg, _ = parse_train_args(
        [
            "train",
            "--steps",
            "3",
            "--preset",
            "tiny",
            "--micro-batch-size",
            "2",
            "--device",
            "cpu",
            "optim.lr=0.01",
        ]
    )
    assert (cfg.trainer.total_training_steps, cfg.model.preset, cfg.data.micro_batch_size_per_gpu) == (
        3,
        "tiny",
        2,
    )
    assert (cfg.trainer.device, cfg.optim.lr) == ("cpu", 0.01)
    with pytest.raises(ConfigKeyError, match="did you mean 'optim.lr'"):
        parse_train_args(["train", "optim.lrr=1"])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["megatron.use_distributed_optimiser=false"], "did you mean 'megatron.use_distributed_optimizer'"),
        (["--steps", "ten"], "invalid int value"),
        (["data.train_batch_size=lots"], "data.train_batch_size"),
        (
            ["megatron.tensor_model_parallel_size=3"],
            "world size 1 is not divisible by tensor_model_parallel_size (3)",
        ),
        (["--preset", "huge"], "model.preset: must be one of"),
    ],
)
def test_bad_input_stops_with_clear_message(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    try:
        rc = engine_main(["train", "--device", "cpu", *args])
    except SystemExit as exc:  # argparse's own type errors
        rc = exc.code
    assert rc == 2
    assert message in capsys.readouterr().err
