"""run_distributed: results by rank, a failing or dying rank is a clear error (never a hang)."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from verl_mcore_utils.testing import DistributedRunError, run_distributed


def _sum_of_ranks(rank: int, world_size: int) -> tuple[int, float]:
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return rank, float(t.item())


def _rank1_raises(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("rank one refuses")
    dist.barrier()  # rank 0 would wait here for ever: the harness must stop it


def _rank1_dies(rank: int, world_size: int) -> None:
    if rank == 1:
        os._exit(3)
    dist.barrier()


def test_results_come_back_by_rank() -> None:
    assert run_distributed(_sum_of_ranks, world_size=3) == [(0, 3.0), (1, 3.0), (2, 3.0)]
    # back to back: every run gets its own rendezvous server (no port picked, released and re-bound)
    assert run_distributed(_sum_of_ranks, world_size=2) == [(0, 1.0), (1, 1.0)]


def test_a_failing_rank_is_reraised_with_its_traceback(capfd: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(DistributedRunError, match=r"(?s)--- rank 1 ---.*ValueError: rank one refuses"):
        run_distributed(_rank1_raises, world_size=2, timeout_s=120)
    assert "rank one refuses" in capfd.readouterr().err  # also at the end of the test's output


def test_a_dying_rank_is_an_error_not_a_hang() -> None:
    with pytest.raises(DistributedRunError, match=r"rank\(s\) \[1\] exited with codes \[3\]"):
        run_distributed(_rank1_dies, world_size=2, timeout_s=120)


def _rank_tensor(rank: int, world_size: int) -> dict[str, torch.Tensor]:
    return {"values": torch.arange(1000, dtype=torch.float32) + rank}


def test_tensor_results_outlive_the_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank exits right after reporting; its tensors must still be readable when the caller gets to them.

    The caller is made slow after the first report, so the second rank has exited before its report
    is read (torch's queue would have left a file descriptor to fetch from that dead process).
    """
    from verl_mcore_utils import testing

    record = testing._record
    calls = []

    def slow_record(*args: object) -> None:
        record(*args)  # type: ignore[arg-type]
        calls.append(1)
        if len(calls) == 1:
            time.sleep(4.0)

    monkeypatch.setattr(testing, "_record", slow_record)
    results = run_distributed(_rank_tensor, world_size=2, timeout_s=120)
    for rank, result in enumerate(results):
        assert torch.equal(result["values"], torch.arange(1000, dtype=torch.float32) + rank)
        assert not result["values"].is_shared()  # a private copy, not memory lent by a process
