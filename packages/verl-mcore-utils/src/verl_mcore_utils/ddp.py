"""The one place a DistributedDataParallelConfig is made, so no construction path can drop a user setting.

Rule, the same for every model-construction path: when wrapping, start from the path's defaults,
put the wrap config's ``use_distributed_optimizer`` (and ``use_megatron_fsdp``) on top, then the
user's ``override_ddp_config`` on top of that, so an explicit override always wins and no path can
forget the user's choice. When not wrapping there is no DDP config at all.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from megatron.core.distributed import DistributedDataParallelConfig

from verl_mcore_utils.compat import ddp_config_fields

__all__ = ["WrapConfig", "build_ddp_config", "describe_ddp_config"]


@dataclass(frozen=True)
class WrapConfig:
    """How a model is wrapped after construction (verl's McoreModuleWrapperConfig)."""

    is_value_model: bool = False
    share_embeddings_and_output_weights: bool = False
    wrap_with_ddp: bool = True
    use_distributed_optimizer: bool = True
    use_megatron_fsdp: bool = False


def build_ddp_config(
    *,
    wrap_config: WrapConfig,
    override_ddp_config: Mapping[str, Any] | None = None,
    path_defaults: Mapping[str, Any] | None = None,
) -> DistributedDataParallelConfig | None:
    """Return the DDP config for ``wrap_config``: path defaults < wrap config < override_ddp_config.

    Raises ValueError naming every unknown field (with the valid ones for the installed
    megatron-core). Returns None when ``wrap_config.wrap_with_ddp`` is False.
    """
    overrides = dict(override_ddp_config or {})
    valid = set(ddp_config_fields())
    for source, given in (("path defaults", path_defaults or {}), ("override_ddp_config", overrides)):
        unknown = sorted(set(given) - valid)
        if unknown:
            raise ValueError(
                f"{source}: unknown DistributedDataParallelConfig field(s) {unknown} for the installed megatron-core;"
                f" valid fields: {', '.join(sorted(valid))}"
            )
    if not wrap_config.wrap_with_ddp:
        if overrides:
            warnings.warn(
                f"override_ddp_config {sorted(overrides)} is not used: this model is not wrapped with DDP (wrap_with_ddp=False)",
                stacklevel=2,
            )
        return None
    fields: dict[str, Any] = dict(path_defaults or {})
    fields["use_distributed_optimizer"] = wrap_config.use_distributed_optimizer
    if wrap_config.use_megatron_fsdp:
        fields["use_megatron_fsdp"] = True
    fields.update(overrides)
    return DistributedDataParallelConfig(**fields)


_DESCRIBED = (
    "use_distributed_optimizer",
    "use_megatron_fsdp",
    "overlap_grad_reduce",
    "overlap_param_gather",
    "grad_reduce_in_fp32",
)
_DESCRIBED_FSDP = ("data_parallel_sharding_strategy", "suggested_communication_unit_size")


def describe_ddp_config(ddp_config: Any) -> dict[str, Any]:
    """The DDP settings a benchmark record or a log line should show: what decides a run's communication.

    Megatron-FSDP adds its sharding strategy and its communication unit (the reduce-scatter queue's capacity;
    half of it is the parameter prefetch), which decide its memory. Fields the installed release lacks are left out.
    """
    keys = _DESCRIBED + (_DESCRIBED_FSDP if getattr(ddp_config, "use_megatron_fsdp", False) else ())
    return {key: getattr(ddp_config, key) for key in keys if hasattr(ddp_config, key)}
