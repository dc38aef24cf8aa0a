"""Arithmetic data, tokenizer, LR schedule and CLI parsing of verl_engine."""

from __future__ import annotations

import pytest
import torch

from verl_config import ConfigKeyError
from verl_engine.apps.cli import main as engine_main
from verl_engine.apps.cli import parse_train_args
from verl_engine.apps.demo import ArithmeticDataset, CharTokenizer


def test_batches_are_deterministic_and_step_dependent() -> None:
    ds = ArithmeticDataset(seq_length=64, seed=3)
    a, b = ds.global_batch(step=5, batch_size=4), ds.global_batch(step=5, batch_size=4)
    assert torch.equal(a["input_ids"], b["input_ids"])
    assert not torch.equal(a["input_ids"], ds.global_batch(step=6, batch_size=4)["input_ids"])
    # verl's layout: <bos> as the prompt, the problems as the right-padded response
    assert a["input_ids"].shape == a["attention_mask"].shape == (4, 65)
    assert a["response_mask"].shape == (4, 64)
    assert (a["input_ids"][:, 0] == CharTokenizer().bos_id).all()


def test_loss_mask_covers_exactly_the_answers() -> None:
    tok = CharTokenizer()
    batch = ArithmeticDataset(seq_length=48, seed=0, tokenizer=tok).global_batch(step=0, batch_size=2)
    eq, nl = tok.stoi["="], tok.stoi["\n"]
    for row in range(2):
        ids = batch["input_ids"][row].tolist()
        for t, masked in enumerate(batch["response_mask"][row].tolist()):  # response token t = ids[t + 1]
            last_eq = max((i for i, x in enumerate(ids[: t + 1]) if x == eq), default=-1)
            last_nl = max((i for i, x in enumerate(ids[: t + 1]) if x == nl), default=-1)
            assert bool(masked) == (last_eq > last_nl and ids[t + 1] != tok.pad_id), f"row {row} position {t}"
        text = tok.decode(ids)
        for line in filter(None, text.split("\n")):
            lhs, rhs = line.split("=")
            assert eval(lhs) == int(rhs)  # the data is correct arithmetic
        assert batch["response_mask"][row].sum() > 0
        valid = batch["attention_mask"][row].bool()
        assert valid[: int(valid.sum())].all()  # one contiguous run of valid tokens


def test_lr_schedule_of_the_sft_section() -> None:
    """`verl-engine train` uses the engine's one schedule (megatron-core's rule, as verl's Megatron engine)."""
    from verl_config import SFTConfig, load_config
    from verl_engine.lr_schedule import lr_schedule_from_config

    optim = load_config(
        SFTConfig, overrides=["optim.lr=1.0", "optim.min_lr=0.1", "optim.lr_warmup_steps=10"]
    ).optim
    schedule = lr_schedule_from_config(optim, total_training_steps=100)
    assert schedule.lr_at(0) == pytest.approx(0.0)  # megatron-core's warm-up starts at lr_warmup_init
    assert schedule.lr_at(5) == pytest.approx(0.5)
    assert schedule.lr_at(10) == pytest.approx(1.0)
    assert schedule.lr_at(100) == pytest.approx(0.1)


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
            "optim.lr_warmup_steps=2",
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
