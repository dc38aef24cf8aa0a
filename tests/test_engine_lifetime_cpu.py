"""Engine.close() / RLEngine.close() on CPU (gloo): the engine's model and optimizer are freed (weak
references die at close, not at some later garbage collection), a closed engine refuses every use with
one clear error, its CP groups are destroyed, and a second engine built afterwards in the same process
group works and gives the first one's outputs. The device-memory check (two engines in turn, memory back
to the start) is tests/test_gpu_engine_lifetime.py.
"""

from __future__ import annotations

import pytest
from rl_engine_workers import close_and_rebuild, verl_batch

from verl_mcore_utils.testing import run_distributed


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from verl_mcore_utils.hf_testing import save_tiny_hf_model

    return str(save_tiny_hf_model("qwen2", tmp_path_factory.mktemp("qwen2") / "model", seed=3))


@pytest.mark.parametrize("world", [1, 2])
def test_close_frees_the_engine_and_a_new_one_works(model_dir: str, world: int) -> None:
    batch = verl_batch(seed=0, prompt_lens=[3, 5, 2], response_lens=[4, 2, 6])
    for out in run_distributed(close_and_rebuild, world_size=world, args=(model_dir, batch)):
        assert out["freed"] == [True, True, True]
        assert out["closed"] and out["second_closed"]
        assert len(out["errors"]) == 2
        for message in out["errors"]:
            assert (
                message is not None and "RLEngine was closed" in message and "build a new engine" in message
            )
        assert out["cp_groups_error"] is not None and "destroyed" in out["cp_groups_error"]
        assert out["same_output"]


def test_close_drops_what_moe_dispatchers_keep_of_the_last_step(tmp_path) -> None:
    """megatron-core's token dispatchers keep the last routing probabilities (graph-attached); on GPUs that
    graph reached DDP's hooks and kept a closed MoE engine whole (tests/test_gpu_engine_lifetime.py[moe])."""
    from rl_engine_workers import moe_graph_references

    from verl_mcore_utils.hf_testing import save_tiny_hf_model

    model_dir = str(save_tiny_hf_model("qwen3_moe", tmp_path / "model", seed=3, router_aux_loss_coef=0.1))
    batch = verl_batch(seed=6, prompt_lens=[3, 6, 1, 5], response_lens=[7, 2, 5, 4])
    (out,) = run_distributed(moe_graph_references, world_size=1, args=(model_dir, batch))
    assert out["before"] and all("token_dispatcher" in name for name in out["before"]), out
    assert out["dropped"] == len(out["before"]) and out["after"] == [], out
    assert out["params_kept"]
    assert not out["tracker_left"]


def test_moe_engines_of_different_depths_train_in_one_process(tmp_path) -> None:
    """megatron-core sizes its process-wide MoE metrics tracker by the first model that records and never
    resizes it: a deeper MoE model built next in the same process failed inside its router (IndexError). The
    engine drops the tracker before every MoE call (verl_engine.moe.drop_moe_metrics_tracker)."""
    import math

    from rl_engine_workers import moe_engines_of_two_depths

    from verl_mcore_utils.hf_testing import save_tiny_hf_model

    dirs = [
        str(
            save_tiny_hf_model(
                "qwen3_moe", tmp_path / f"l{n}", seed=3, router_aux_loss_coef=0.1, num_hidden_layers=n
            )
        )
        for n in (2, 4)
    ]
    batch = verl_batch(seed=6, prompt_lens=[3, 6, 1, 5], response_lens=[7, 2, 5, 4])
    (losses,) = run_distributed(moe_engines_of_two_depths, world_size=1, args=(dirs, batch))
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses), losses
