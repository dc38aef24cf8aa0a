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
    "base_sync_done": "selects the adapter-only sync with LoRA; LoRA is refused by this backend",
}


class VerlWeightSync:
    """Mixin of :class:`~verl_engine.integrations.verl.engine.VerlEngine` (reads ``_built``)."""

    _built: Any

    def get_per_tensor_param(self, **kwargs: Any) -> tuple[Iterator[tuple[str, torch.Tensor]], dict | None]:
        """``((hf_name, tensor) generator, peft_config)``: every weight under its Hugging Face name (a collective
        over TP / PP: every rank iterates to the end)."""
        _check_kwargs(kwargs, "get_per_tensor_param")
        return self._built.get_per_tensor_param()

    def get_per_tensor_param_shard(
        self, **kwargs: Any
    ) -> tuple[Iterator[tuple[str, torch.Tensor, Any]], None]:
        """``((name, tensor, ShardSpec) generator, None)`` in the same order on every rank; each tensor whole."""
        from verl.workers.engine.spec import ShardSpec

        _check_kwargs(kwargs, "get_per_tensor_param_shard")
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


def _check_kwargs(kwargs: dict[str, Any], call: str) -> None:
    unknown = sorted(set(kwargs) - set(_EXPORT_KWARGS))
    if unknown:
        raise TypeError(f"{call}: unknown arguments {unknown}; verl 0.9.1 passes {', '.join(_EXPORT_KWARGS)}")
