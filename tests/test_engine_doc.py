"""docs/engine.md's PPO step (actor + reference + critic) runs as written, on CPU, on one and two ranks."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from verl_mcore_utils.testing import run_distributed

pytestmark = pytest.mark.above_engine

DOC = Path(__file__).resolve().parents[1] / "docs" / "engine.md"


def doc_example() -> str:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    assert len(blocks) == 1, "docs/engine.md must hold exactly one python example"
    return blocks[0]


def run_example(rank: int, world_size: int, code: str, model_dir: str) -> dict[str, Any]:
    import torch

    torch.manual_seed(0)  # the example draws its batch with torch.randint: the same on every rank
    scope: dict[str, Any] = {"MODEL": model_dir, "WORLD": world_size}
    exec(compile(code, "docs/engine.md", "exec"), scope)
    return {"metrics": scope["metrics"], "actor_lr": scope["actor_lr"], "critic_lr": scope["critic_lr"]}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from verl_mcore_utils.hf_testing import save_tiny_hf_model

    return str(save_tiny_hf_model("qwen2", tmp_path_factory.mktemp("doc") / "model", seed=1))


@pytest.mark.parametrize("world", [1, 2])
def test_documented_ppo_step_runs(model_dir: str, world: int) -> None:
    results = run_distributed(run_example, world_size=world, args=(doc_example(), model_dir))
    for got in results:
        m = got["metrics"]
        for key in (
            "actor/pg_loss",
            "actor/pg_clipfrac",
            "actor/ppo_kl",
            "actor/kl_loss",
            "actor/grad_norm",
            "critic/vf_loss",
            "critic/grad_norm",
        ):
            assert key in m and m[key] == m[key], key  # present, not NaN
        assert m["actor/grad_norm"] > 0 and m["critic/grad_norm"] > 0
        assert got["actor_lr"] > 0 and got["critic_lr"] > 0
    assert results[0]["metrics"] == results[-1]["metrics"]  # every rank reports the same
