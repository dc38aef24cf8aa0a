"""Small reusable checks used by the schema's ``__post_init__`` methods and by launchers."""

from __future__ import annotations

from collections.abc import Iterable

from verl_config.errors import ConfigValueError

__all__ = [
    "check_choice",
    "check_dynamic_context_parallel",
    "check_parallel_layout",
    "check_positive",
    "check_positive_keys",
    "check_unit_interval",
]


def _unresolved(value: object) -> bool:
    """An OmegaConf interpolation not resolved yet (schema defaults such as ``${data.max_prompt_length}``).

    Default sections are instantiated once, before the tree is resolved; their interpolated
    fields are checked when the loader builds the resolved config.
    """
    return isinstance(value, str) and "${" in value


def check_positive(key: str, value: int | float, *, allow_zero: bool = False) -> None:
    """Raise ConfigValueError unless ``value`` is > 0 (or >= 0 with ``allow_zero``)."""
    if _unresolved(value):
        return
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigValueError(key, f"must be {bound}, got {value!r}")


def check_positive_keys(section: object, *keys: str, optional: bool = False) -> None:
    """:func:`check_positive` on each of ``keys`` of ``section``; with ``optional`` a null value is accepted."""
    for key in keys:
        value = getattr(section, key)
        if not (optional and value is None):
            check_positive(key, value)


def check_unit_interval(key: str, value: float, *, open_low: bool = False, open_high: bool = False) -> None:
    """Raise ConfigValueError unless ``value`` lies in [0, 1]; ``open_low`` / ``open_high`` exclude 0 / 1."""
    low_ok = value > 0.0 if open_low else value >= 0.0
    high_ok = value < 1.0 if open_high else value <= 1.0
    if not (low_ok and high_ok):
        interval = f"{'(' if open_low else '['}0, 1{')' if open_high else ']'}"
        raise ConfigValueError(key, f"must be in {interval}; got {value}")


def check_choice(key: str, value: object, choices: Iterable[object]) -> None:
    """Raise ConfigValueError unless ``value`` is one of ``choices``."""
    allowed = tuple(choices)
    if _unresolved(value):
        return
    if value not in allowed:
        raise ConfigValueError(key, f"must be one of {', '.join(map(repr, allowed))}; got {value!r}")


def check_parallel_layout(
    *,
    world_size: int,
    tensor_model_parallel_size: int,
    pipeline_model_parallel_size: int = 1,
    context_parallel_size: int = 1,
) -> int:
    """Check that the model-parallel sizes tile the world and return the data-parallel size.

    Raised before any process group is made, so an impossible layout fails with the numbers in
    the message instead of an assertion deep inside megatron-core (or a hang).
    """
    for key, value in (
        ("tensor_model_parallel_size", tensor_model_parallel_size),
        ("pipeline_model_parallel_size", pipeline_model_parallel_size),
        ("context_parallel_size", context_parallel_size),
    ):
        check_positive(key, value)
    model_parallel = tensor_model_parallel_size * pipeline_model_parallel_size * context_parallel_size
    if world_size % model_parallel != 0:
        raise ConfigValueError(
            "world_size",
            f"world size {world_size} is not divisible by tensor_model_parallel_size ({tensor_model_parallel_size})"
            f" x pipeline_model_parallel_size ({pipeline_model_parallel_size}) x context_parallel_size"
            f" ({context_parallel_size}) = {model_parallel}; choose sizes whose product divides {world_size}"
            f" or launch a multiple of {model_parallel} processes",
        )
    return world_size // model_parallel


def check_dynamic_context_parallel(
    *, dynamic_context_parallel: bool, max_seqlen_per_dp_cp_rank: int | None
) -> None:
    """Dynamic CP picks the CP size per micro-batch from ``max_seqlen_per_dp_cp_rank``: it must be set."""
    if not dynamic_context_parallel:
        return
    if max_seqlen_per_dp_cp_rank is None:
        raise ConfigValueError(
            "max_seqlen_per_dp_cp_rank",
            "is null but dynamic_context_parallel is true; set the most tokens one rank may hold"
            " (the CP size per micro-batch is chosen from it), e.g. max_seqlen_per_dp_cp_rank=4096",
        )
    check_positive("max_seqlen_per_dp_cp_rank", max_seqlen_per_dp_cp_rank)
