"""Helpers of tests/test_rl_engine_sequence_parallel_cpu.py: TP shards joined into one rank's tensors."""

from __future__ import annotations

import torch


def tp_joined(
    per_rank: list[dict], key: str, *, model_type: str, tp: int = 2, rtol: float = 0.0
) -> dict[str, torch.Tensor]:
    """The ``key`` tensors of TP ranks 0..tp-1 (the first ``tp`` ranks: TP is innermost) as one rank's: split
    tensors joined with the name table's TP layout, replicated ones checked equal between the TP ranks (bitwise:
    the shared gradients are all-reduced, the weights stepped identically; ``rtol`` > 0: within it)."""
    from verl_mcore_utils.hf_testing import tiny_hf_config
    from verl_mcore_utils.weights.fused import tp_unshard
    from verl_mcore_utils.weights.names import param_mappings

    # with the MTP layer's entries (GLM-4.5): a config declaring one MTP layer (other tiny configs are unchanged)
    config = tiny_hf_config(model_type, num_nextn_predict_layers=1)
    mappings = {m.megatron_name: m for m in param_mappings(hf_config=config, mtp=True)}
    ranks = [per_rank[r][key] for r in range(tp)]
    out = {}
    for name, value in ranks[0].items():
        mapping = mappings.get(
            name.replace(".transformer_layer.", ".mtp_model_layer.")
        )  # grouped experts' stacked weights have no entry: replicated (ETP 1)
        if mapping is not None and mapping.tp_dim is not None:
            out[name] = tp_unshard([r[name] for r in ranks], mapping)
        else:
            for other in ranks[1:]:
                if rtol:
                    assert torch.allclose(other[name], value, rtol=rtol, atol=0.0), (key, name)
                else:
                    assert torch.equal(other[name], value), (key, name)
            out[name] = value
    return out
