"""peft's ``LoraParallelLinear`` made to work on megatron-core linears (:class:`MegatronLoraParallelLinear`).

Built on first use so that importing :mod:`verl_mcore_utils.lora` needs no peft; the peft defects worked
around are listed in the package README.
"""

from __future__ import annotations

import copy
import functools
import importlib.metadata
import inspect
import re
from typing import Any

import torch
from megatron.core import tensor_parallel

DEFAULT_ADAPTER_NAME = "default"  # peft's adapter name; HF adapter files carry no name
VERIFIED_PEFT_VERSIONS: tuple[str, ...] = ("0.17.0", "0.18.1", "0.21.2")
_MIN_PEFT = (0, 17)


def import_peft() -> Any:
    try:
        import peft
    except ImportError as err:
        raise ImportError(
            "LoRA on megatron-core needs Hugging Face peft: pip install 'verl-mcore-utils[peft]'"
            f" (peft>={_MIN_PEFT[0]}.{_MIN_PEFT[1]}); import failed with: {err}"
        ) from err
    version = importlib.metadata.version("peft")
    parts = tuple(int(p) for p in re.findall(r"\d+", version)[:2])
    if parts < _MIN_PEFT:
        raise ImportError(
            f"peft {version} is too old for verl_mcore_utils.lora; need peft>={_MIN_PEFT[0]}.{_MIN_PEFT[1]}"
            f" (checked: {', '.join(VERIFIED_PEFT_VERSIONS)})"
        )
    return peft


def _first(output: Any) -> torch.Tensor:
    """megatron's parallel linears return ``(output, bias)``; ``nn.Linear`` returns the tensor."""
    return output[0] if isinstance(output, tuple) else output


def _peft_layer_kwargs(
    peft: Any, takes_config: bool, *, r: int, lora_alpha: float, lora_dropout: float, megatron_config: Any
) -> dict[str, Any]:
    """``LoraParallelLinear.__init__`` keywords for the installed peft (0.19+ takes a ``LoraConfig``)."""
    # A private copy: peft's update_layer overwrites params_dtype on the config it is given. The
    # adapters are initialised by apply_lora, so megatron's own init is skipped.
    config = copy.copy(megatron_config)
    config.perform_initialization = False
    common = {"backend": tensor_parallel, "r": r, "lora_alpha": lora_alpha, "megatron_config": config}
    if takes_config:  # peft >= 0.19
        peft_config = peft.LoraConfig(
            r=r, lora_alpha=lora_alpha, lora_dropout=lora_dropout, init_lora_weights=False
        )
        return {"config": peft_config, **common}
    return {"lora_dropout": lora_dropout, "init_lora_weights": False, **common}  # peft 0.17 - 0.18


def _add_adapter_outputs(
    layer: Any, x: torch.Tensor, result: torch.Tensor, *, gather: bool | None
) -> torch.Tensor:
    """``result`` plus ``scaling * B(A(x))`` of every active adapter, dropout before or after as configured."""
    for name in layer.active_adapters:
        if name not in layer.lora_A:
            continue
        lora_A, lora_B = layer.lora_A[name], layer.lora_B[name]
        dropout = layer.lora_dropout[name]
        h = x.to(lora_A.weight.dtype)
        if layer.dropout_position == "pre":
            h = dropout(h)
        h = _first(lora_A(h))
        if gather is not None and not layer.is_parallel_a:  # lora_B is column-parallel like the base
            h = _first(lora_B(h, runtime_gather_output=gather))
        else:
            h = _first(lora_B(h))
        if layer.dropout_position == "post":
            h = dropout(h)
        result = result + h * layer.scaling[name]
    return result


@functools.cache
def lora_layer_class() -> type:
    """Build :class:`MegatronLoraParallelLinear` on first use (so that importing this module needs no peft)."""
    peft = import_peft()
    from peft.tuners.lora.tp_layer import LoraParallelLinear

    takes_config = "config" in inspect.signature(LoraParallelLinear.__init__).parameters

    class MegatronLoraParallelLinear(LoraParallelLinear):  # type: ignore[misc, valid-type]
        """peft's ``LoraParallelLinear`` with the fixes listed in the package README.

        ``lora_A[adapter]`` / ``lora_B[adapter]`` are megatron Row/ColumnParallelLinear or ``nn.Linear``
        modules as peft builds them; ``scaling[adapter] = lora_alpha / r``; ``forward`` returns megatron's
        ``(output, bias)`` pair like the base layer.
        """

        def __init__(
            self,
            base_layer: torch.nn.Module,
            adapter_name: str,
            *,
            r: int,
            lora_alpha: float,
            lora_dropout: float,
            megatron_config: Any,
            dropout_position: str = "pre",
        ) -> None:
            if dropout_position not in ("pre", "post"):
                raise ValueError(f"dropout_position must be 'pre' or 'post'; got {dropout_position!r}")
            common = _peft_layer_kwargs(
                peft,
                takes_config,
                r=r,
                lora_alpha=lora_alpha,
                lora_dropout=lora_dropout,
                megatron_config=megatron_config,
            )
            super().__init__(base_layer, adapter_name, **common)
            self.dropout_position = dropout_position

        def update_layer(self, adapter_name: str, *args: Any, **kwargs: Any) -> None:
            # peft's parallel layer never fills lora_bias, which its shared LoraLayer code reads.
            self.lora_bias[adapter_name] = False
            super().update_layer(adapter_name, *args, **kwargs)

        def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
            if kwargs.pop("adapter_names", None) is not None:
                raise ValueError(
                    f"{type(self).__name__} does not support mixed-adapter batches (adapter_names)"
                )
            if self.disable_adapters:
                if self.merged:
                    self.unmerge()
                return self.base_layer(x, *args, **kwargs)
            result, bias = self.base_layer(x, *args, **kwargs)
            if self.merged:
                return result, bias
            result_dtype = result.dtype
            result = _add_adapter_outputs(self, x, result, gather=kwargs.get("runtime_gather_output"))
            return result.to(result_dtype), bias

        def sharded_state_dict(self, *args: Any, **kwargs: Any) -> Any:
            raise NotImplementedError(
                "megatron distributed checkpointing of LoRA-wrapped linears is not supported; save the adapters"
                " with verl_mcore_utils.lora.save_hf_adapter (the base weights are frozen: reload them from the"
                " Hugging Face checkpoint)"
            )

        def __repr__(self) -> str:
            return "megatron_" + super().__repr__()

    MegatronLoraParallelLinear.__module__ = "verl_mcore_utils.lora"  # found there through its __getattr__
    MegatronLoraParallelLinear.__qualname__ = "MegatronLoraParallelLinear"
    return MegatronLoraParallelLinear


def is_lora_layer(module: torch.nn.Module) -> bool:
    """True for a linear wrapped by :func:`apply_lora` (needs no peft import when there is none)."""
    if type(module).__name__ != "MegatronLoraParallelLinear":
        return False
    return isinstance(module, lora_layer_class())
