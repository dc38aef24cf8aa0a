"""verl_engine.use_decoder_graphs on the CPU debug engine: refused with the reason, nothing installed, and the
engine still closes. The graphs themselves (replays under DDP against the eager engine) are
tests/test_gpu_decoder_graph.py; the decoder-level refusals packages/verl-dyncp/tests/test_decoder_graph.py."""

from __future__ import annotations

import pytest

from verl_mcore_utils.testing import run_distributed


@pytest.mark.newest_mcore  # our refusal before any megatron-core call that differs by release
def test_decoder_graphs_are_refused_on_the_cpu_engine(tmp_path) -> None:
    from decoder_graph_workers import cpu_engine_refusal

    from verl_mcore_utils.hf_testing import save_tiny_hf_model

    model_dir = str(save_tiny_hf_model("qwen2", tmp_path / "model", seed=3))
    (message,) = run_distributed(cpu_engine_refusal, world_size=1, args=(model_dir,))
    assert "use_decoder_graphs: not supported here: the engine is on cpu (CUDA graphs need a GPU)" == message
