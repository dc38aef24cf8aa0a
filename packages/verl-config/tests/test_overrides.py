"""verl / Hydra override syntax: the value parser (property-based) and the override semantics."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from verl_config import (
    ConfigKeyError,
    ConfigTypeError,
    ConfigValueError,
    apply_override,
    default_tree,
    format_value,
    parse_override,
    parse_value,
)


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("1e-4", 1e-4),
        ("3", 3),
        ("-2", -2),
        ("0.5", 0.5),
        ("null", None),
        ("True", True),
        ("false", False),
        ("[a, b ,3]", ["a", "b", 3]),
        ("{a:1,b:[x,y],c:{d:null}}", {"a": 1, "b": ["x", "y"], "c": {"d": None}}),
        ("{'key with space': 'v, w'}", {"key with space": "v, w"}),
        ("[]", []),
        ("{}", {}),
        ("'a,b'", "a,b"),
        ('"quoted \\" inside"', 'quoted " inside'),
        ("${data.max_prompt_length}", "${data.max_prompt_length}"),
        ("[${a.b}, 2]", ["${a.b}", 2]),
        ("Qwen/Qwen2.5-7B-Instruct", "Qwen/Qwen2.5-7B-Instruct"),
        ("my run", "my run"),
        ("", ""),
        ("-inf", -math.inf),
    ],
)
def test_parse_value(text: str, value: object) -> None:
    assert parse_value(text) == value
    assert type(parse_value(text)) is type(value)


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("a,b", "Hydra sweep"),
        ("[1,2", "expected ',' or ']'"),
        ("{a 1}", "expected ':'"),
        ("'open", "unterminated"),
        ("${a.b", "unterminated"),
        ("[1,,2]", "empty element"),
    ],
)
def test_parse_value_errors_say_where_and_why(text: str, why: str) -> None:
    with pytest.raises(ConfigTypeError, match=why):
        parse_value(text, token=f"k={text}")


_keys = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,8}", fullmatch=True)
_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(10**12), 10**12)
    | st.floats(allow_nan=False, allow_infinity=True, width=64)
    | st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=12)
)
_values = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_keys, inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(_values)
def test_format_then_parse_round_trips(value: object) -> None:
    assert parse_value(format_value(value)) == value


@settings(max_examples=200, deadline=None)
@given(st.from_regex(r"[A-Za-z_][A-Za-z0-9_/\-]{0,15}", fullmatch=True))
def test_unquoted_words_are_strings_unless_keywords(word: str) -> None:
    value = parse_value(word)
    if word.lower() in ("null", "true", "false", "inf", "nan"):
        assert not isinstance(value, str)
    else:
        assert value == word


def test_parse_override_forms() -> None:
    assert parse_override("a.b=1").kind == "set"
    assert parse_override("+a.b=1").kind == "add"
    assert parse_override("++a.b=1").kind == "force_add"
    ov = parse_override("~a.b")
    assert (ov.kind, ov.has_value) == ("delete", False)
    ov = parse_override("~a.b=3")
    assert (ov.kind, ov.has_value, ov.value) == ("delete", True, 3)
    with pytest.raises(ConfigKeyError, match="has no '='"):
        parse_override("a.b")
    with pytest.raises(ConfigKeyError, match="not a valid key"):
        parse_override("a..b=1")


def _tree():
    return default_tree("megatron")


def test_set_existing_key_converts_type() -> None:
    cfg = _tree()
    apply_override(cfg, "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=4")
    assert cfg.actor_rollout_ref.actor.megatron.tensor_model_parallel_size == 4
    with pytest.raises(ConfigTypeError, match=r"tensor_model_parallel_size.*'four'"):
        apply_override(cfg, "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=four")


def test_open_dicts_accept_new_keys_with_or_without_plus() -> None:
    cfg = _tree()
    engine = "actor_rollout_ref.actor.megatron"
    apply_override(cfg, f"{engine}.override_ddp_config.data_parallel_sharding_strategy=optim_grads")
    apply_override(cfg, f"+{engine}.override_transformer_config.recompute_method=uniform")
    apply_override(cfg, f"++{engine}.override_transformer_config.recompute_num_layers=2")
    apply_override(cfg, "+actor_rollout_ref.model.override_config.model_config.rope_scaling.factor=4.0")
    node = cfg.actor_rollout_ref.actor.megatron
    assert node.override_ddp_config == {"data_parallel_sharding_strategy": "optim_grads"}
    assert node.override_transformer_config.recompute_method == "uniform"
    assert node.override_transformer_config.recompute_num_layers == 2
    assert cfg.actor_rollout_ref.model.override_config.model_config.rope_scaling.factor == 4.0


def test_plus_on_existing_key_and_on_typed_section_are_refused() -> None:
    cfg = _tree()
    # Hydra's rule where verl's yaml has the key: '+' refused on a key holding a value ...
    with pytest.raises(ConfigKeyError, match="already exists; use .*=VALUE.*Hydra refuses"):
        apply_override(cfg, "+actor_rollout_ref.actor.clip_ratio=0.3")
    # ... accepted on a key holding null, and with a list or dict value (merged)
    apply_override(
        cfg, "+actor_rollout_ref.actor.megatron.override_transformer_config.recompute_method=block"
    )
    apply_override(
        cfg, "+actor_rollout_ref.actor.megatron.override_transformer_config.recompute_modules=[mlp]"
    )
    node = cfg.actor_rollout_ref.actor.megatron.override_transformer_config
    assert node.recompute_method == "block" and list(node.recompute_modules) == ["mlp"]
    # a key only this schema declares (verl's yaml lacks it): '+' sets it while it holds its default
    apply_override(cfg, "+actor_rollout_ref.actor.megatron.grad_offload=true")
    with pytest.raises(ConfigKeyError, match="already exists"):
        apply_override(cfg, "+actor_rollout_ref.actor.megatron.grad_offload=false")
    with pytest.raises(
        ConfigKeyError, match="cannot add a key to the typed section 'actor_rollout_ref.actor.optim'"
    ):
        apply_override(cfg, "+actor_rollout_ref.actor.optim.new_knob=1")
    with pytest.raises(ConfigKeyError, match="did you mean 'actor_rollout_ref.actor.optim.lr'"):
        apply_override(cfg, "actor_rollout_ref.actor.optim.lrr=1")


def test_delete() -> None:
    cfg = _tree()
    tc = "actor_rollout_ref.actor.megatron.override_transformer_config"
    apply_override(cfg, f"~{tc}.recompute_modules")
    assert "recompute_modules" not in cfg.actor_rollout_ref.actor.megatron.override_transformer_config
    with pytest.raises(ConfigValueError, match="only if it equals 'fused'"):
        apply_override(cfg, f"~{tc}.attention_backend=fused")
    apply_override(cfg, f"~{tc}.attention_backend=flash")
    assert "attention_backend" not in cfg.actor_rollout_ref.actor.megatron.override_transformer_config
    with pytest.raises(ConfigKeyError, match="cannot delete 'actor_rollout_ref.actor.optim.lr'"):
        apply_override(cfg, "~actor_rollout_ref.actor.optim.lr")
    with pytest.raises(ConfigKeyError, match="unknown config key"):
        apply_override(cfg, f"~{tc}.not_there")


def test_lists_dicts_and_null_values() -> None:
    cfg = _tree()
    apply_override(cfg, "trainer.logger=[console,tensorboard]")
    apply_override(cfg, "actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size=null")
    apply_override(
        cfg, "actor_rollout_ref.rollout.val_kwargs={temperature:0.6,n:4}"
    )  # merged into a typed node
    assert list(cfg.trainer.logger) == ["console", "tensorboard"]
    assert cfg.actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size is None
    assert (
        cfg.actor_rollout_ref.rollout.val_kwargs.temperature,
        cfg.actor_rollout_ref.rollout.val_kwargs.n,
    ) == (0.6, 4)
    assert cfg.actor_rollout_ref.rollout.val_kwargs.top_p == 1.0  # untouched keys stay
    apply_override(
        cfg, "actor_rollout_ref.actor.megatron.override_ddp_config={bucket_size:1000}"
    )  # open dict: replaced
    apply_override(cfg, "actor_rollout_ref.actor.megatron.override_ddp_config={overlap_grad_reduce:true}")
    assert cfg.actor_rollout_ref.actor.megatron.override_ddp_config == {"overlap_grad_reduce": True}
