"""install_decoder_graph's refusals on a real megatron-core TransformerBlock (CPU): each setting one graph of a
micro-batch cannot hold is named before anything is captured. The dispatcher's replays and counts under the
engine are tested on GPUs: tests/test_gpu_decoder_graph.py."""

from __future__ import annotations

import pytest

from verl_mcore_utils.testing import run_distributed

CASES = {  # a TransformerConfig setting changed on the built decoder -> what the error must name
    "recompute_granularity": ("full", "recompute_granularity='full' is not supported"),
    "hidden_dropout": (0.1, "hidden_dropout=0.1 is not supported"),
    "num_moe_experts": (8, "num_moe_experts=8 is not supported"),
    "tensor_model_parallel_size": (2, "tensor_model_parallel_size=2 is not supported"),
}


def _refusals(rank: int, world_size: int) -> dict[str, str]:
    import torch

    from verl_dyncp.decoder_graph import install_decoder_graph
    from verl_dyncp.graph_layout import GraphSlots
    from verl_dyncp.model import build_thd_gpt_model
    from verl_mcore_utils.parallel import init_parallel
    from verl_mcore_utils.presets import qwen2_preset
    from verl_mcore_utils.transformer_config import hf_to_transformer_config

    init_parallel(device="cpu")
    hf = qwen2_preset("tiny", vocab_size=128)
    tf = hf_to_transformer_config(hf, dtype="float32")
    decoder = build_thd_gpt_model(hf_config=hf, tf_config=tf, device=torch.device("cpu")).decoder

    def error() -> str:
        try:
            install_decoder_graph(decoder, slots=GraphSlots(tokens=64, sequences=4), hidden_size=64,
                                  dtype=torch.float32)  # fmt: skip
        except ValueError as err:
            return str(err)
        return "installed"

    out: dict[str, str] = {"plain": error()}
    for name, (value, _) in CASES.items():
        old = getattr(decoder.config, name)
        setattr(decoder.config, name, value)
        out[name] = error()
        setattr(decoder.config, name, old)
    handle = decoder.layers[0].mlp.register_forward_pre_hook(lambda module, args: None)
    out["hook"] = error()
    handle.remove()
    out["forward_is_own"] = str("forward" not in decoder.__dict__)
    return out


@pytest.mark.newest_mcore  # our checks of the block's config, before anything of megatron-core runs
def test_what_one_graph_cannot_hold_is_refused_by_name() -> None:
    (out,) = run_distributed(_refusals, world_size=1, timeout_s=240)
    assert "the decoder is not on a CUDA device" in out["plain"], out["plain"]
    for name, (_, expected) in CASES.items():
        assert expected in out[name], (name, out[name])
    assert "submodule 'layers.0.mlp' has forward hooks" in out["hook"], out["hook"]
    assert "overlap_param_gather" in out["hook"]
    assert out["forward_is_own"] == "True"  # nothing installed by a refused call
