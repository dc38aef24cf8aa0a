"""Weight sync with verl 0.9.1's rollout side: the full export and the sharded / delta exports of its delta
checkpoint engine (``verl/checkpoint_engine/delta_checkpoint_engine.py``).

Our exported tensors are whole Hugging Face tensors, gathered over TP / PP one at a time (the same on every rank),
so each is described to verl as unsharded (``ShardSpec`` with no mesh): verl's delta helpers then diff it against
the host snapshot taken by ``prime_delta_snapshots`` and send only the changed elements. Memory: the snapshot (one
host copy of the HF weights, as verl's own engines keep) plus one gathered tensor at a time.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["VerlWeightSync"]

# keyword arguments verl 0.9.1's callers pass to the export methods, and why each needs no action here
_EXPORT_KWARGS = {
    "layered_summon": "an FSDP memory hint (summon one layer at a time); our export gathers one tensor at a time",
    "base_sync_done": "with LoRA (lora.merge=false): True = the adapter only, False = the base weights",
}


class VerlWeightSync:
    """Mixin of :class:`~verl_engine.integrations.verl.engine.VerlEngine` (reads ``_built``)."""

    _built: Any

    def get_per_tensor_param(
        self, *, base_sync_done: bool = False, **kwargs: Any
    ) -> tuple[Iterator[tuple[str, torch.Tensor]], dict | None]:
        """``((hf_name, tensor) generator, peft_config)`` as verl's Megatron engine (a collective over TP / PP:
        every rank iterates to the end).

        Without LoRA, or with ``lora.merge=true``: every weight under its Hugging Face name (the adapter merged
        in), peft_config None. With ``lora.merge=false`` the rollout serves base + adapter: ``base_sync_done=True``
        yields the adapter tensors only (PEFT names), ``False`` the frozen base weights (HF names, no adapter
        merged: what the rollout loads once before the adapters); both return the PEFT config (``peft_type`` /
        ``task_type`` peft enum members, as ``verl.utils.megatron_peft_utils.build_peft_config_for_vllm``).
        """
        _check_kwargs(kwargs, "get_per_tensor_param")
        engine = self._built
        if engine.lora is None or engine.lora.merge:
            return engine.get_per_tensor_param()
        config = _peft_enums(engine.peft_config())
        if base_sync_done:
            pairs, _ = engine.get_per_tensor_param(lora_mode="adapter")
            return pairs, config
        return _base_weights(engine), config

    def get_per_tensor_param_shard(
        self, **kwargs: Any
    ) -> tuple[Iterator[tuple[str, torch.Tensor, Any]], None]:
        """``((name, tensor, ShardSpec) generator, None)`` in the same order on every rank; each tensor whole."""
        from verl.workers.engine.spec import ShardSpec

        _check_kwargs(kwargs, "get_per_tensor_param_shard")
        lora = self._built.lora
        if lora is not None and not lora.merge:
            raise NotImplementedError(
                "the sharded / delta weight export with an unmerged LoRA adapter (model.lora.merge=false) is not"
                " implemented by verl-engine's verl backend; set model.lora.merge=true or use the naive sync"
            )
        pairs, _ = self._built.get_per_tensor_param()

        def shards() -> Iterator[tuple[str, torch.Tensor, Any]]:
            for name, tensor in pairs:
                yield name, tensor, ShardSpec(full_shape=tuple(tensor.shape))

        return shards(), None

    def get_per_tensor_param_delta_shard(self, **kwargs: Any) -> tuple[Iterator[tuple[Any, ...]], None]:
        """verl's delta entries ``(slots, dtype, counts, hf_idx, hf_val, gather_group)``: for each tensor only the
        elements that changed since the last snapshot (``prime_delta_snapshots`` or the previous delta export),
        which this call refreshes. An unchanged tensor yields an entry with a zero count (verl's lockstep)."""
        from verl.workers.engine.utils import _hf_entry_identity, hf_delta_export

        _check_kwargs(kwargs, "get_per_tensor_param_delta_shard")
        snaps = getattr(self, "_delta_shard_snap", None)
        if not snaps:
            raise RuntimeError(
                "get_per_tensor_param_delta_shard before prime_delta_snapshots: the delta needs a base (verl's"
                " delta checkpoint engine primes it after the first full sync)"
            )
        gen, _ = self.get_per_tensor_param_shard()
        return hf_delta_export(gen, snaps, _hf_entry_identity), None


def _base_weights(engine: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """The base model's weights (LoRA layers swapped for their base linears while the generator runs)."""
    from verl_mcore_utils.lora import without_adapters
    from verl_mcore_utils.weights import export_hf_weights

    with without_adapters(engine.chunks):
        for name, tensor in export_hf_weights(engine.chunks, hf_config=engine.hf_config):
            yield name, tensor.detach().clone()


def _peft_enums(config: dict[str, Any]) -> dict[str, Any]:
    """Our PEFT config with ``peft_type`` / ``task_type`` as peft's enum members (verl's rollouts expect them)."""
    from peft import PeftType, TaskType

    out = dict(config)
    out["peft_type"] = PeftType(out.get("peft_type", "LORA"))
    out["task_type"] = TaskType(out.get("task_type", "CAUSAL_LM"))
    return out


def _check_kwargs(kwargs: dict[str, Any], call: str) -> None:
    unknown = sorted(set(kwargs) - set(_EXPORT_KWARGS))
    if unknown:
        raise TypeError(f"{call}: unknown arguments {unknown}; verl 0.9.1 passes {', '.join(_EXPORT_KWARGS)}")
