"""What the installed megatron-core offers, in one place.

Every other module of the workspace asks this module instead of branching on megatron-core
versions itself. Supported: megatron-core 0.14 to 0.19.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import os
from collections.abc import Mapping
from typing import Any

from packaging.version import Version

__all__ = [
    "MAX_MCORE_EXCLUSIVE",
    "MIN_MCORE",
    "ddp_config_fields",
    "fsdp_synchronize_param_gather",
    "hf_rope_parameters",
    "import_megatron_core",
    "make_megatron_optimizer",
    "make_packed_seq_params",
    "mcore_version",
    "megatron_fsdp_grad_precision",
    "packed_seq_params_fields",
    "prepare_megatron_import",
]

MIN_MCORE = Version("0.14.0")
MAX_MCORE_EXCLUSIVE = Version("0.20.0")


@functools.cache
def mcore_version() -> Version:
    """The installed megatron-core version (raises a clear error when absent or unsupported)."""
    try:
        version = Version(importlib.metadata.version("megatron-core"))
    except importlib.metadata.PackageNotFoundError:
        raise ImportError("megatron-core is not installed; pip install 'megatron-core>=0.14,<0.20'") from None
    if not (MIN_MCORE <= Version(version.base_version) < MAX_MCORE_EXCLUSIVE):
        raise ImportError(
            f"megatron-core {version} is not supported; this package supports {MIN_MCORE} <= version < {MAX_MCORE_EXCLUSIVE}"
        )
    return version


def prepare_megatron_import() -> None:
    """Make ``import megatron.core`` safe and its failures clear, without importing it.

    Runs in the ``__init__`` of verl-mcore-utils (and of the packages built on it), which Python executes
    before any of their modules, so those modules import megatron-core at the top like any other library:

    * the installed release must be one we support (:func:`mcore_version` raises an ImportError naming the
      supported range, instead of an import error from inside megatron-core or a wrong result later);
    * megatron-core 0.15 compiles a CUDA extension at import time (inference/unified_memory.py); on a CUDA
      build of torch with no visible GPU that raises IndexError unless TORCH_CUDA_ARCH_LIST is set, in which
      case the failure is caught inside megatron-core. We set it only when it is unset and no GPU is
      visible, so GPU hosts are untouched;
    * megatron-core's notices about the fallbacks we chose (no Transformer Engine, Apex or absl) are muted
      (:mod:`verl_mcore_utils.notices`; ``VERL_MEGATRON_NOTICES=1`` keeps them).
    """
    from verl_mcore_utils.notices import mute_fallback_notices

    mute_fallback_notices()  # before torch: on a CPU machine torch logs "No CUDA runtime" when megatron loads
    import torch

    mcore_version()
    if "TORCH_CUDA_ARCH_LIST" not in os.environ and not torch.cuda.is_available():
        os.environ["TORCH_CUDA_ARCH_LIST"] = "8.0"


def import_megatron_core() -> Any:
    """``megatron.core``, imported after :func:`prepare_megatron_import` (for a function that imports it late)."""
    prepare_megatron_import()
    import megatron.core

    return megatron.core


@functools.cache
def ddp_config_fields() -> tuple[str, ...]:
    """Field names of DistributedDataParallelConfig in the installed megatron-core."""
    import_megatron_core()
    from megatron.core.distributed import DistributedDataParallelConfig

    return tuple(f.name for f in dataclasses.fields(DistributedDataParallelConfig))


def hf_rope_parameters(hf_config: Mapping[str, Any] | Any) -> dict[str, Any]:
    """RoPE settings of a Hugging Face config: one dict with at least ``rope_theta`` and ``rope_type``.

    transformers >= 5 keeps them in ``config.rope_parameters`` (``rope_theta`` inside it, no top-level
    attribute); transformers 4 configs and older config.json files have a top-level ``rope_theta`` and
    an optional ``rope_scaling`` dict whose kind is under ``rope_type`` or ``type``. Accepts a
    PretrainedConfig or a config.json mapping. A missing theta is 10000.0 (the transformers default).
    """

    def get(key: str) -> Any:
        return hf_config.get(key) if isinstance(hf_config, Mapping) else getattr(hf_config, key, None)

    params = dict(get("rope_parameters") or get("rope_scaling") or {})
    theta = params.get("rope_theta", get("rope_theta"))
    params["rope_theta"] = float(theta) if theta is not None else 10000.0
    params["rope_type"] = params.get("rope_type", params.pop("type", None)) or "default"
    return params


# ----------------------------------------------------------------------------------------------
# Feature detection: each function looks at what the installed megatron-core has (signatures,
# attributes), not at version numbers, so a backported feature is found and a removed one fails
# with a clear message instead of an AttributeError deep inside a training step.


@functools.cache
def packed_seq_params_fields() -> tuple[str, ...]:
    """Field names of PackedSeqParams (``local_cp_size`` / ``cp_group`` exist from 0.16)."""
    import_megatron_core()
    from megatron.core.packed_seq_params import PackedSeqParams

    return tuple(f.name for f in dataclasses.fields(PackedSeqParams))


def make_packed_seq_params(**fields: Any) -> Any:
    """A PackedSeqParams with ``fields``; a field this megatron-core lacks is an error naming it."""
    import_megatron_core()
    from megatron.core.packed_seq_params import PackedSeqParams

    unknown = sorted(set(fields) - set(packed_seq_params_fields()))
    if unknown:
        raise TypeError(
            f"PackedSeqParams of megatron-core {mcore_version()} has no field(s) {unknown}"
            f" (available: {', '.join(packed_seq_params_fields())})"
        )
    return PackedSeqParams(**fields)


def make_megatron_optimizer(
    config: Any, model_chunks: list[Any], *, use_gloo_process_groups: bool = True, fused_adam: bool = True
) -> Any:
    """get_megatron_optimizer with the arguments every release accepts.

    0.14-0.15 take ``no_weight_decay_cond`` / ``scale_lr_cond`` / ``lr_mult``; 0.16+ replaced them with
    ``config_overrides``. The defaults (no weight decay on biases and 1-D parameters) are the same, so
    the common call passes only the config, the chunks and the gloo switch.

    ``fused_adam``: where megatron-core fell back to torch's Adam (no Transformer Engine, no Apex) over CUDA
    tensors, use torch's fused kernel (:func:`verl_mcore_utils.fused_adam.use_fused_torch_adam`).

    Where megatron-core fell back to its pure-torch multi-tensor l2 norm / scale (no Transformer Engine, no Apex),
    sync-free replacements are installed first
    (:func:`verl_mcore_utils.multi_tensor.use_sync_free_multi_tensor_fallbacks`).
    """
    import inspect

    import_megatron_core()
    from megatron.core.optimizer import get_megatron_optimizer

    from verl_mcore_utils.multi_tensor import use_sync_free_multi_tensor_fallbacks

    use_sync_free_multi_tensor_fallbacks()  # gradient norm and clipping without a host sync per parameter tensor
    kwargs: dict[str, Any] = {}
    if "use_gloo_process_groups" in inspect.signature(get_megatron_optimizer).parameters:
        kwargs["use_gloo_process_groups"] = use_gloo_process_groups
    optimizer = get_megatron_optimizer(config, model_chunks, **kwargs)
    if fused_adam:
        from verl_mcore_utils.fused_adam import use_fused_torch_adam

        use_fused_torch_adam(optimizer)
    return optimizer


def fsdp_synchronize_param_gather(chunk: Any) -> None:
    """Wait for Megatron-FSDP's parameter all-gather of ``chunk``.

    The method is on the FSDP adapter from 0.18 and only on the wrapped ``.module`` before.
    """
    for target in (chunk, getattr(chunk, "module", None)):
        fn = getattr(target, "synchronize_param_gather", None)
        if callable(fn):
            fn()
            return
    raise AttributeError(
        f"{type(chunk).__name__} has no synchronize_param_gather (on itself or .module): not a Megatron-FSDP model?"
    )


def megatron_fsdp_grad_precision(*, fp32: bool) -> dict[str, Any]:
    """DDP-config fields that give Megatron-FSDP fp32 (or model-dtype) main gradients on this release.

    <= 0.16 only know ``grad_reduce_in_fp32``; 0.17 added ``megatron_fsdp_main_grads_dtype`` /
    ``megatron_fsdp_grad_comm_dtype`` (both honoured in 0.17-0.18); 0.19 ignores ``grad_reduce_in_fp32``
    for Megatron-FSDP, so the dtype fields are the only switch there. Setting both where both exist is
    consistent on every release.
    """
    import torch

    fields: dict[str, Any] = {"grad_reduce_in_fp32": fp32}
    available = set(ddp_config_fields())
    dtype = torch.float32 if fp32 else None  # None: the model's compute dtype
    for name in ("megatron_fsdp_main_grads_dtype", "megatron_fsdp_grad_comm_dtype"):
        if name in available:
            fields[name] = dtype
    return fields


def with_mlp_class(mlp_spec: Any, *, base: type, cls: type[Any]) -> Any:
    """A layer spec's ``mlp`` entry building ``cls`` (a subclass of ``base``) where it built ``base``.

    Up to 0.18 the entry is ``ModuleSpec(module=MLP, submodules=...)``; 0.19 writes it as
    ``partial(MLP.as_mlp_submodule, submodules=...)``. Any other entry (MoE, Transformer Engine's fused MLP)
    is returned unchanged.
    """
    from megatron.core.transformer.spec_utils import ModuleSpec

    if isinstance(mlp_spec, ModuleSpec):
        if mlp_spec.module is base:
            return dataclasses.replace(mlp_spec, module=cls)
        return mlp_spec
    func = getattr(mlp_spec, "func", None)
    if (
        isinstance(mlp_spec, functools.partial)
        and getattr(func, "__self__", None) is base
        and getattr(func, "__name__", "") == "as_mlp_submodule"
    ):
        return functools.partial(cls.as_mlp_submodule, *mlp_spec.args, **mlp_spec.keywords)
    return mlp_spec
