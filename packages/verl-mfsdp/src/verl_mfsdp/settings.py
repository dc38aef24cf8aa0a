"""Megatron-FSDP DDP settings: one flag, the same meaning on every construction path and release.

The settings are computed by :func:`megatron_fsdp_ddp_config` and handed to verl-mcore-utils'
``build_ddp_config`` (the only place a DDP config is made), so every path that wraps through
``make_megatron_module`` gets them (why: the README's design notes). Rules:

* use_distributed_optimizer is forced true: Megatron-FSDP owns the sharded optimizer state, so a
  user's ``false`` (wrap config or override) is a contradiction and an error, not a silent change;
* filled only when absent from ``override_ddp_config``: use_megatron_fsdp, data_parallel_sharding_strategy
  ``optim_grads_params`` (ZeRO-3), overlap_grad_reduce, check_for_nan_in_grad, and fp32 main gradients
  in the fields the installed megatron-core reads (0.19 ignores grad_reduce_in_fp32 for FSDP);
* ``override_ddp_config`` wins for everything else; ``grad_reduce_in_fp32: false`` there switches the
  per-release gradient dtype fields together;
* pipeline parallelism and an unknown sharding strategy are errors;
* ``suggested_communication_unit_size``, when absent, is twice the mean parameter count of the model's FSDP unit
  modules (:func:`fsdp_communication_unit_size`, applied by the wrapper, which has the model).

Why the last rule: megatron-core's default bounds how many unsharded gradient elements may wait in the
reduce-scatter queue, and how many gathered parameter elements are prefetched (half of it). Its code computes
"twice an FSDP unit" and then raises it to at least 1e9 elements (0.16 to 0.19: ``max`` where its comment says
"cap"; 0.14 and 0.15: 1e9 outright). On a model of a few billion parameters that lets almost the whole model's gradients
sit unsharded in the queue (1e9 fp32 elements, 4 GB) plus 5e8 prefetched parameters. Twice a unit is the intent
the code states: the unit being reduced and the next one. Measured: at a small shape the peak is lower with it
(``tests/test_gpu_mfsdp.py``); at the 1.5B shape on 2 x H200 with bf16 gradient reduction it lowers the peak by
only 0.06 GiB, so it is not what makes Megatron-FSDP's step allocate about 2.6 GiB more than DDP's there
(docs/benchmarks.md, which names the A/B's records).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from verl_mcore_utils.compat import megatron_fsdp_grad_precision
from verl_mcore_utils.ddp import WrapConfig, build_ddp_config

if TYPE_CHECKING:
    import torch

__all__ = [
    "SHARDING_STRATEGIES",
    "fsdp_communication_unit_size",
    "megatron_fsdp_ddp_config",
    "megatron_fsdp_defaults",
    "with_communication_unit_size",
]

SHARDING_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
_DTYPE_NAMES = {
    "float32": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
}


def _dtype(key: str, name: str) -> Any:
    """Config files cannot hold a torch.dtype: accept its name (``bf16``, ``float32`` ...)."""
    import torch

    if name.lower() not in _DTYPE_NAMES:
        raise ValueError(f"{key} {name!r} is not a dtype name; use one of {', '.join(_DTYPE_NAMES)} or null")
    return getattr(torch, _DTYPE_NAMES[name.lower()])


def megatron_fsdp_defaults(*, override_ddp_config: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The Megatron-FSDP path defaults for the installed megatron-core (lowest precedence)."""
    overrides = dict(override_ddp_config or {})
    fp32_grads = bool(overrides.get("grad_reduce_in_fp32", True))
    return {
        "use_megatron_fsdp": True,
        "data_parallel_sharding_strategy": "optim_grads_params",
        "overlap_grad_reduce": True,
        "check_for_nan_in_grad": True,
        **megatron_fsdp_grad_precision(fp32=fp32_grads),
    }


def megatron_fsdp_ddp_config(
    *,
    wrap_config: WrapConfig,
    override_ddp_config: Mapping[str, Any] | None = None,
    pipeline_model_parallel_size: int = 1,
) -> Any:
    """The DistributedDataParallelConfig of a Megatron-FSDP model (None when not wrapping).

    Raises ValueError naming the setting for every contradiction listed in the module docstring.
    """
    overrides = dict(override_ddp_config or {})
    if not wrap_config.use_megatron_fsdp:
        raise ValueError(
            "megatron_fsdp_ddp_config needs WrapConfig(use_megatron_fsdp=True); for plain DDP use"
            " verl_mcore_utils.build_ddp_config"
        )
    if overrides.get("use_megatron_fsdp") is False:
        raise ValueError(
            "override_ddp_config.use_megatron_fsdp is false but use_megatron_fsdp is true; remove the override"
            " or set use_megatron_fsdp=false"
        )
    for key, value in (
        ("use_distributed_optimizer", wrap_config.use_distributed_optimizer),
        ("override_ddp_config.use_distributed_optimizer", overrides.get("use_distributed_optimizer", True)),
    ):
        if value is False:
            raise ValueError(
                f"{key} is false but use_megatron_fsdp is true; Megatron-FSDP shards the optimizer state and"
                " requires the distributed optimizer: remove the setting or set use_megatron_fsdp=false"
            )
    if pipeline_model_parallel_size > 1:
        raise ValueError(
            f"pipeline_model_parallel_size is {pipeline_model_parallel_size} but use_megatron_fsdp is true;"
            " Megatron-FSDP does not support pipeline parallelism: set pipeline_model_parallel_size=1"
        )
    strategy = overrides.get("data_parallel_sharding_strategy", "optim_grads_params")
    if strategy not in SHARDING_STRATEGIES:
        raise ValueError(
            f"override_ddp_config.data_parallel_sharding_strategy {strategy!r} is not one of"
            f" {', '.join(SHARDING_STRATEGIES)}"
        )
    for key, value in list(overrides.items()):
        if key.endswith("_dtype") and isinstance(value, str):
            overrides[key] = _dtype(f"override_ddp_config.{key}", value)
    defaults = megatron_fsdp_defaults(override_ddp_config=overrides)
    return build_ddp_config(
        wrap_config=replace(wrap_config, use_distributed_optimizer=True),
        override_ddp_config=overrides,
        path_defaults=defaults,
    )


def _fsdp_unit_classes() -> tuple[type[torch.nn.Module], ...]:
    """The module classes megatron-core's FSDP adapter makes FSDP units under ``optim_grads_params``.

    Every release from 0.14 has TransformerLayer (MoETransformerLayer, 0.19, subclasses it); MambaLayer
    joins where the release has it.
    """
    from megatron.core.transformer.transformer_layer import TransformerLayer

    classes: list[type[torch.nn.Module]] = [TransformerLayer]
    try:
        from megatron.core.ssm.mamba_layer import MambaLayer
    except ImportError:  # a release or an install without the SSM layers
        pass
    else:
        classes.append(MambaLayer)
    return tuple(classes)


def fsdp_communication_unit_size(chunks: Sequence[Any]) -> int | None:
    """Twice the mean parameter count (elements) of the FSDP unit modules in ``chunks`` (None without units).

    Megatron-FSDP uses this number as the reduce-scatter queue's capacity and half of it as the all-gather
    prefetch size, so it keeps about one unit reducing and one prefetched (the module docstring says why
    megatron-core's own default is far larger). Counted on this rank's (tensor-parallel) parameters, before
    wrapping, as megatron-core counts them. The other strategies (no FSDP units: gradient buckets instead) get
    the same size: megatron-core floors their queue at the same 1e9 elements.
    """
    units = _fsdp_unit_classes()
    sizes = [
        sum(p.numel() for p in module.parameters())
        for chunk in chunks
        for module in chunk.modules()
        if isinstance(module, units)
    ]
    if not sizes:
        return None
    return 2 * -(-sum(sizes) // len(sizes))


def with_communication_unit_size(
    ddp_config: Any, *, chunks: Sequence[Any], override_ddp_config: Mapping[str, Any] | None = None
) -> Any:
    """``ddp_config`` with :func:`fsdp_communication_unit_size` filled in, unless the user set the field.

    A value in ``override_ddp_config`` (including an explicit null: megatron-core's default) is kept as given.
    """
    if "suggested_communication_unit_size" in dict(override_ddp_config or {}):
        return ddp_config
    if not hasattr(ddp_config, "suggested_communication_unit_size"):
        return ddp_config
    size = fsdp_communication_unit_size(chunks)
    if size is None:
        return ddp_config
    return replace(ddp_config, suggested_communication_unit_size=size)
