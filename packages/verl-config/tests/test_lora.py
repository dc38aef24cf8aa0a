"""LoRA: the canonical block, migration of the flat keys, one alpha default, module names per engine."""

from __future__ import annotations

import warnings

import pytest

from conftest import MICRO_BATCHES
from verl_config import (
    DEFAULT_LORA_ALPHA,
    ConfigValueError,
    LoraConfig,
    TrainerConfig,
    explicit_keys_of,
    load_config,
    translate_target_modules,
)

M = "actor_rollout_ref.model"


def _load(*overrides: str, engine: str = "megatron"):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load_config(overrides=[f"model_engine={engine}", *MICRO_BATCHES, *overrides])
    return cfg, [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]


def test_one_alpha_default_for_every_spelling_and_engine() -> None:
    assert DEFAULT_LORA_ALPHA == 32 and LoraConfig().alpha == 32
    for engine in ("fsdp", "megatron"):
        structured, _ = _load(f"{M}.lora.rank=8", engine=engine)
        flat, _ = _load(f"{M}.lora_rank=8", engine=engine)
        assert structured.actor_rollout_ref.model.lora.alpha == flat.actor_rollout_ref.model.lora.alpha == 32


def test_structured_only_is_silent() -> None:
    cfg, warned = _load(
        f"{M}.lora.rank=16", f"{M}.lora.alpha=16", f"{M}.lora.target_modules=[linear_qkv,linear_fc1]"
    )
    lora = cfg.actor_rollout_ref.model.lora
    assert (lora.rank, lora.alpha, lora.target_modules, lora.enabled) == (
        16,
        16,
        ["linear_qkv", "linear_fc1"],
        True,
    )
    assert warned == []


def test_flat_only_is_moved_into_the_block_with_warnings() -> None:
    cfg, warned = _load(f"{M}.lora_rank=8", f"{M}.target_modules=all-linear")
    model = cfg.actor_rollout_ref.model
    assert (model.lora.rank, model.lora.alpha) == (8, 32)
    assert model.lora.target_modules == ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
    assert (model.lora_rank, model.lora_alpha, model.target_modules) == (
        0,
        16,
        "all-linear",
    )  # verl's defaults
    assert any(f"{M}.lora_rank is deprecated; write {M}.lora.rank" in w for w in warned)
    assert any(f"{M}.target_modules is deprecated" in w for w in warned)
    assert any("alpha is now 32" in w and f"{M}.lora.alpha=16 to keep the old scaling" in w for w in warned)
    cfg, warned = _load(f"{M}.lora_rank=8", f"{M}.lora_alpha=16", engine="fsdp")
    assert cfg.actor_rollout_ref.model.lora.alpha == 16
    assert not any("alpha is now 32" in w for w in warned)
    critic, _ = _load("critic.model.lora_rank=4", engine="fsdp")  # verl's megatron critic has no flat keys
    assert critic.critic.model.lora.rank == 4


def test_both_spellings_equal_is_accepted() -> None:
    cfg, warned = _load(f"{M}.lora_rank=8", f"{M}.lora.rank=8", f"{M}.target_modules=all-linear")
    assert cfg.actor_rollout_ref.model.lora.rank == 8
    assert any("deprecated" in w for w in warned)
    # all-linear (flat, HF spelling) equals the block's default megatron list on the megatron engine
    cfg, _ = _load(
        f"{M}.target_modules=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]",
        f"{M}.lora.target_modules=[linear_qkv,linear_proj,linear_fc1,linear_fc2]",
        f"{M}.lora.rank=8",
    )
    assert cfg.actor_rollout_ref.model.lora.target_modules == [
        "linear_qkv",
        "linear_proj",
        "linear_fc1",
        "linear_fc2",
    ]


def test_flat_keys_given_at_verls_defaults_with_rank_0_are_left_alone() -> None:
    """A full dumped config writes every flat key at verl's default (rank 0: the flat LoRA is off, as in verl),
    which must not move into or conflict with the block; given keys are on the config (explicit_keys_of)."""
    cfg, warned = _load(
        f"{M}.lora_rank=0",
        f"{M}.lora_alpha=16",
        f"{M}.target_modules=all-linear",
        f"{M}.lora.rank=8",
        f"{M}.lora.alpha=64",
    )
    lora = cfg.actor_rollout_ref.model.lora
    assert (lora.rank, lora.alpha) == (8, 64)
    assert not any("deprecated" in w for w in warned)
    given = explicit_keys_of(cfg)
    assert given is not None and f"{M}.lora.rank" in given and f"{M}.lora_alpha" in given
    assert f"{M}.lora.dropout" not in given
    assert explicit_keys_of(LoraConfig()) is None
    moved, _ = _load(f"{M}.lora_rank=8", f"{M}.lora_alpha=16")  # with a flat rank, alpha 16 is a choice
    assert moved.actor_rollout_ref.model.lora.alpha == 16
    assert f"{M}.lora.alpha" in explicit_keys_of(moved)  # a moved flat key counts for its canonical key


@pytest.mark.parametrize(
    ("flat", "block", "names"),
    [
        (f"{M}.lora_rank=8", f"{M}.lora.rank=16", (f"{M}.lora_rank", f"{M}.lora.rank")),
        (f"{M}.lora_alpha=64", f"{M}.lora.alpha=32", (f"{M}.lora_alpha", f"{M}.lora.alpha")),
        (
            f"{M}.target_modules=[q_proj,k_proj,v_proj]",
            f"{M}.lora.target_modules=[linear_fc1]",
            (f"{M}.target_modules",),
        ),
    ],
)
def test_both_spellings_different_is_an_error_naming_both(
    flat: str, block: str, names: tuple[str, ...]
) -> None:
    with pytest.raises(ConfigValueError) as exc:
        _load(flat, block, f"{M}.lora.rank=16" if "rank" not in flat else "trainer.nnodes=1")
    msg = str(exc.value)
    assert "two spellings of one setting" in msg
    for name in names:
        assert name in msg
    assert f"{M}.lora." in msg


def test_target_module_translation_per_engine() -> None:
    hf = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    mcore = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
    assert translate_target_modules(hf, engine="megatron") == mcore
    assert translate_target_modules(["all-linear"], engine="megatron") == mcore
    assert translate_target_modules(mcore, engine="fsdp") == hf
    assert translate_target_modules(["all-linear"], engine="fsdp") == ["all-linear"]
    assert translate_target_modules(["o_proj", "linear_fc2"], engine="megatron") == [
        "linear_proj",
        "linear_fc2",
    ]
    assert translate_target_modules(["mlp.experts.w1"], engine="fsdp") == [
        "mlp.experts.w1"
    ]  # custom HF names pass
    with pytest.raises(
        ConfigValueError, match=r"\['q_proj'\] without \['k_proj', 'v_proj'\]: megatron-core fuses"
    ):
        translate_target_modules(["q_proj"], engine="megatron")
    with pytest.raises(ConfigValueError, match="'lm_head' is not a linear layer that LoRA supports"):
        translate_target_modules(["lm_head"], engine="megatron")
    cfg, _ = _load(f"{M}.lora.rank=8", engine="fsdp")  # block default (megatron names) -> HF names on fsdp
    assert cfg.actor_rollout_ref.model.lora.target_modules == hf
    with pytest.raises(
        ConfigValueError, match=f"{M}.lora.target_modules: \\['gate_proj'\\] without \\['up_proj'\\]"
    ):
        _load(f"{M}.lora.rank=8", f"{M}.lora.target_modules=[gate_proj]")


def test_lora_block_validation() -> None:
    with pytest.raises(ConfigValueError, match=f"{M}.lora.adapter_path: is set .* but rank is 0"):
        _load(f"{M}.lora.adapter_path=/ckpt/adapter")
    with pytest.raises(ConfigValueError, match=f"{M}.lora.dropout: must be in \\[0, 1\\)"):
        _load(f"{M}.lora.dropout=1.5")
    with pytest.raises(ConfigValueError, match=f"{M}.lora.type: must be one of"):
        _load(f"{M}.lora.type=ia3")


def _legacy_spelling(legacy: str, canonical: str, *, warning: str) -> TrainerConfig:
    """Load ``legacy`` alone (moved with a warning), then check that it conflicts with ``canonical``."""
    cfg, warned = _load(legacy, engine="fsdp")
    assert any(warning in w for w in warned)
    with pytest.raises(ConfigValueError, match="two spellings of one setting"):
        _load(legacy, canonical, engine="fsdp")
    return cfg


def test_legacy_grad_clip_is_optim_clip_grad() -> None:
    cfg = _legacy_spelling(
        "actor_rollout_ref.actor.grad_clip=0.5",
        "actor_rollout_ref.actor.optim.clip_grad=2.0",
        warning="grad_clip is deprecated",
    )
    assert cfg.actor_rollout_ref.actor.optim.clip_grad == 0.5


def test_legacy_warmup_style_is_lr_scheduler_type() -> None:
    cfg = _legacy_spelling(
        "actor_rollout_ref.actor.optim.warmup_style=cosine",
        "actor_rollout_ref.actor.optim.lr_scheduler_type=constant",
        warning="optim.warmup_style is deprecated",
    )
    optim = cfg.actor_rollout_ref.actor.optim
    assert (optim.lr_scheduler_type, optim.warmup_style) == ("cosine", None)
