"""RL engine checkpoints on CPU (fp32, gloo, the debug backend): exact resume, layout change, safety.

* Exact resume: 4 PPO steps uninterrupted vs 2 steps + save, then a fresh set of processes that loads and runs
  steps 3 and 4: identical losses and parameters, bitwise. At DP 2 and at TP 2 (2 ranks each).
* Another layout: saved at TP 2, loaded at TP 1 (one rank) and at static CP 2 (two ranks) with
  ``load_optimizer=False``: the same log-probs (1e-6); with the optimizer it is an error naming both layouts.
* A process killed (SIGKILL) during a save leaves the previous checkpoint and latest marker loadable.
* A file replaced by a pickle payload (with meta.json forged to match) is refused without being executed; a
  truncated file is named; ``max_ckpt_to_keep`` keeps the newest steps.
"""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest
import torch
from rl_engine_workers import checkpoint_run, ppo_overrides, verl_batch

from verl_mcore_utils.testing import DistributedRunError, run_distributed

AM = "actor_rollout_ref.actor.megatron"
PROMPTS, RESPONSES = [3, 6, 1, 5, 2, 4, 2, 3], [7, 2, 5, 4, 6, 3, 5, 2]
TP2 = [f"{AM}.tensor_model_parallel_size=2", f"{AM}.sequence_parallel=false"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from verl_mcore_utils.hf_testing import save_tiny_hf_model

    return str(save_tiny_hf_model("qwen2", tmp_path_factory.mktemp("qwen2_ckpt") / "model", seed=13))


@pytest.fixture(scope="module")
def batches() -> list[dict]:
    return [verl_batch(seed=20 + s, prompt_lens=PROMPTS, response_lens=RESPONSES) for s in range(4)]


_overrides = ppo_overrides


@pytest.mark.parametrize("layout", ["dp2", "tp2"])
def test_exact_resume_is_bitwise(model_dir: str, batches: list[dict], tmp_path: Path, layout: str) -> None:
    overrides = _overrides(2, TP2 if layout == "tp2" else [])
    full = run_distributed(
        checkpoint_run, world_size=2, args=(model_dir, overrides, batches, str(tmp_path / "a"), [1, 2, 3, 4])
    )
    root = str(tmp_path / "b")
    first = run_distributed(
        checkpoint_run, world_size=2, args=(model_dir, overrides, batches, root, [1, 2], 2)
    )
    assert json.loads((Path(root) / "latest_checkpointed_iteration.txt").read_text()) == {"global_step": 2}
    resumed = run_distributed(
        checkpoint_run, world_size=2, args=(model_dir, overrides, batches, root, [3, 4], None, True)
    )
    for rank in range(2):
        assert resumed[rank]["loaded"] == {"global_step": 2, "data_position": {"epoch": 0, "index": 8}}
        assert first[rank]["losses"] + resumed[rank]["losses"] == full[rank]["losses"]
        for name, value in full[rank]["params"].items():
            assert torch.equal(resumed[rank]["params"][name], value), name


def test_another_layout_loads_the_model_from_its_hugging_face_copy(
    model_dir: str, batches: list[dict], tmp_path: Path
) -> None:
    root = str(tmp_path / "tp2")
    saved = run_distributed(
        checkpoint_run, world_size=2, args=(model_dir, _overrides(2, TP2), batches, root, [1, 2], 2)
    )
    reference = saved[0]["log_probs"]
    (tp1,) = run_distributed(
        checkpoint_run,
        world_size=1,
        args=(model_dir, _overrides(1, []), batches, root, [], None, True, False),
    )
    cp2 = run_distributed(
        checkpoint_run,
        world_size=2,
        args=(
            model_dir,
            _overrides(2, [f"{AM}.context_parallel_size=2"]),
            batches,
            root,
            [],
            None,
            True,
            False,
        ),
    )
    for got in (tp1, *cp2):
        err = float((got["log_probs"] - reference).abs().max() / reference.abs().max())
        assert err < 1e-6, err
    with pytest.raises(DistributedRunError, match="saved at TP=2.*runs TP=1.*load_optimizer=False"):
        run_distributed(
            checkpoint_run, world_size=1, args=(model_dir, _overrides(1, []), batches, root, [], None, True)
        )


# the save's atomicity and the files' checks are our own code, the same on every release (newest only)
@pytest.mark.newest_mcore
def test_a_save_killed_midway_leaves_the_previous_checkpoint(
    model_dir: str, batches: list[dict], tmp_path: Path
) -> None:
    root = tmp_path / "killed"
    with pytest.raises(DistributedRunError, match="exited with codes"):
        run_distributed(  # fresh: the rank kills its own process, which then cannot serve later calls
            checkpoint_run,
            world_size=1,
            args=(model_dir, _overrides(1, []), batches, str(root), [1, 2], 1, False, True, 2),
            fresh=True,
        )
    assert (root / "global_step_2.tmp").is_dir() and not (root / "global_step_2").exists()
    assert json.loads((root / "latest_checkpointed_iteration.txt").read_text()) == {"global_step": 1}
    (got,) = run_distributed(
        checkpoint_run, world_size=1, args=(model_dir, _overrides(1, []), batches, str(root), [2, 3], 3, True)
    )
    assert got["loaded"]["global_step"] == 1
    assert not (root / "global_step_2.tmp").exists()  # the dead save's directory is cleared by the next save
    assert json.loads((root / "latest_checkpointed_iteration.txt").read_text()) == {"global_step": 3}


class _Payload:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):  # what an attacker's pickle does on load
        return (os.system, (f"touch {self.marker}",))


def test_a_pickle_payload_is_refused_and_never_run(
    model_dir: str, batches: list[dict], tmp_path: Path
) -> None:
    root = tmp_path / "evil"
    run_distributed(
        checkpoint_run, world_size=1, args=(model_dir, _overrides(1, []), batches, str(root), [1], 1)
    )
    step = root / "global_step_1"
    marker = tmp_path / "pwned"
    evil = step / "rank_00000.safetensors"
    evil.write_bytes(pickle.dumps(_Payload(str(marker))))
    meta = json.loads((step / "meta.json").read_text())  # the attacker fixes the digests too
    import hashlib

    meta["files"]["rank_00000.safetensors"] = {
        "bytes": evil.stat().st_size,
        "sha256": hashlib.sha256(evil.read_bytes()).hexdigest(),
    }
    (step / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(DistributedRunError, match="rank_00000.safetensors is not a safetensors file"):
        run_distributed(
            checkpoint_run,
            world_size=1,
            args=(model_dir, _overrides(1, []), batches, str(root), [], None, True),
        )
    assert not marker.exists()


@pytest.mark.newest_mcore  # as above: our files, our checks
def test_truncated_files_and_keep_last(model_dir: str, batches: list[dict], tmp_path: Path) -> None:
    from verl_engine.checkpoint import CheckpointError, _resolve

    root = tmp_path / "keep"
    args = (model_dir, _overrides(1, []), batches, str(root), [1, 2, 3], [1, 2, 3], False, True, None, 2)
    run_distributed(checkpoint_run, world_size=1, args=args)
    assert sorted(p.name for p in root.glob("global_step_*")) == ["global_step_2", "global_step_3"]
    assert _resolve(root) == root / "global_step_3"
    file = root / "global_step_3" / "rank_00000.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])
    with pytest.raises(
        DistributedRunError, match="rank_00000.safetensors does not match meta.json.*truncated"
    ):
        run_distributed(
            checkpoint_run,
            world_size=1,
            args=(model_dir, _overrides(1, []), batches, str(root), [], None, True),
        )
    with pytest.raises(CheckpointError, match="neither a checkpoint step directory"):
        _resolve(tmp_path)
