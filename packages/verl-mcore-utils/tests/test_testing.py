"""run_distributed: results by rank, a failing or dying rank is a clear error (never a hang), warm workers."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from verl_mcore_utils.testing import DistributedRunError, run_distributed

# the rank harness, not megatron-core: CI runs these once, on the newest release (the megatron-state test runs on each)
newest_mcore = pytest.mark.newest_mcore


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


def _pid(rank: int, world_size: int) -> int:
    return os.getpid()


def _env(rank: int, world_size: int, name: str) -> tuple[int, str | None]:
    return os.getpid(), os.environ.get(name)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@newest_mcore
def test_results_come_back_by_rank() -> None:
    assert run_distributed(_sum_of_ranks, world_size=3) == [(0, 3.0), (1, 3.0), (2, 3.0)]
    # back to back: every run gets its own rendezvous server (no port picked, released and re-bound)
    assert run_distributed(_sum_of_ranks, world_size=2) == [(0, 1.0), (1, 1.0)]


@newest_mcore
def test_a_failing_rank_is_reraised_with_its_traceback(capfd: pytest.CaptureFixture[str]) -> None:
    before = run_distributed(_pid, world_size=2)
    with pytest.raises(DistributedRunError, match=r"(?s)--- rank 1 ---.*ValueError: rank one refuses"):
        run_distributed(_rank1_raises, world_size=2, timeout_s=120)
    assert "rank one refuses" in capfd.readouterr().err  # also at the end of the test's output
    # the failed run's workers are killed, never reused: the next run gets new ones and works
    assert not any(_alive(p) for p in before)
    after = run_distributed(_sum_of_ranks, world_size=2)
    assert after == [(0, 1.0), (1, 1.0)]
    assert not set(run_distributed(_pid, world_size=2)) & set(before)


@newest_mcore
def test_a_dying_rank_is_an_error_not_a_hang() -> None:
    with pytest.raises(DistributedRunError, match=r"rank\(s\) \[1\] exited with codes \[3\]"):
        run_distributed(_rank1_dies, world_size=2, timeout_s=120)


def _rank1_crashes(rank: int, world_size: int, how: str) -> None:
    if rank != 1:
        return
    if how == "exit":  # what a C++ abort in a collective looks like from Python: a message, then death
        os.write(2, b"terminate called: gloo::IoException: Connection closed by peer\n")
        os._exit(3)
    import faulthandler

    faulthandler._sigsegv()  # a fatal signal: faulthandler writes the Python stack first


@pytest.mark.parametrize(
    ("how", "words"),
    [
        ("exit", "gloo::IoException: Connection closed by peer"),
        ("segfault", "Fatal Python error: Segmentation fault"),
    ],
)
@newest_mcore
def test_a_crashed_ranks_own_stderr_is_in_the_report(how: str, words: str) -> None:
    """A rank that dies without a Python exception explains itself: the lines its process wrote to stderr
    during the call are in the error (a shared worker's stderr goes to its own file, not to whichever test
    spawned it)."""
    with pytest.raises(DistributedRunError) as err:
        run_distributed(_rank1_crashes, world_size=2, args=(how,), timeout_s=120)
    message = str(err.value)
    assert "--- rank 1 stderr (last lines) ---" in message and words in message, message
    assert "rank(s) [1] exited" in message
    if how == "segfault":
        assert "_rank1_crashes" in message  # the Python frame that crashed


def _create_gloo_process_group(flag: Path) -> None:
    """Named like torch's gloo constructor: a failure here reads, in the traceback, as a failed rendezvous."""
    raise RuntimeError("Gloo connectFullMesh failed with ... Connection closed by peer")


def _rendezvous_fails_once(rank: int, world_size: int, flag: str) -> int:
    done = Path(flag) / f"rank{rank}"
    if not done.exists():
        done.touch()
        _create_gloo_process_group(done)
    return rank


@newest_mcore
def test_a_failed_rendezvous_is_retried_once_on_new_workers(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Every failing rank failed joining the process group (the function never ran): the call runs again on
    new workers, once, and says so; a second such failure is the call's error."""
    assert run_distributed(_rendezvous_fails_once, world_size=2, args=(str(tmp_path),)) == [0, 1]
    assert "retrying the call once on new workers" in capfd.readouterr().err
    with pytest.raises(DistributedRunError, match="connectFullMesh"):
        run_distributed(_rendezvous_always_fails, world_size=2)


def _rendezvous_always_fails(rank: int, world_size: int) -> None:
    _create_gloo_process_group(Path("."))


def _rank_tensor(rank: int, world_size: int) -> dict[str, torch.Tensor]:
    return {"values": torch.arange(1000, dtype=torch.float32) + rank}


@newest_mcore
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
    results = run_distributed(_rank_tensor, world_size=2, timeout_s=120, fresh=True)  # ranks that exit
    for rank, result in enumerate(results):
        assert torch.equal(result["values"], torch.arange(1000, dtype=torch.float32) + rank)
        assert not result["values"].is_shared()  # a private copy, not memory lent by a process


# Warm workers: gloo runs share the session's spawned processes; each call must find them as fresh ones.


@newest_mcore
def test_workers_are_reused_across_calls() -> None:
    first = run_distributed(_pid, world_size=2)
    assert run_distributed(_pid, world_size=2) == first
    assert run_distributed(_pid, world_size=1) == first[:1]  # a smaller run takes the first workers
    assert os.getpid() not in first and len(set(first)) == 2
    # what changes from test to test in the caller's environment is passed on, as a fresh spawn would see it
    ((pid, name),) = run_distributed(_env, world_size=1, args=("PYTEST_CURRENT_TEST",))
    assert pid == first[0] and "test_workers_are_reused_across_calls" in str(name)


@newest_mcore
def test_fresh_runs_get_new_processes_and_leave_the_pool_alone() -> None:
    pooled = run_distributed(_pid, world_size=2)
    fresh = run_distributed(_pid, world_size=2, fresh=True)
    assert not set(fresh) & set(pooled)
    assert run_distributed(_pid, world_size=2) == pooled
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in fresh) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in fresh)  # a fresh run's processes exit with it


def _rank0_hangs(rank: int, world_size: int) -> None:
    if rank == 0:
        time.sleep(600)


@newest_mcore
def test_a_timeout_kills_the_pool_instead_of_hanging() -> None:
    before = run_distributed(_pid, world_size=2)
    start = time.monotonic()
    # 20 s: long enough for rank 1 to finish on a loaded 2-core machine (at 3 s it sometimes did not)
    with pytest.raises(
        DistributedRunError,
        match=r"timed out after 20s: ranks \[0\] did not finish \(ranks \[1\] finished and were waiting for them\)",
    ):
        run_distributed(_rank0_hangs, world_size=2, timeout_s=20)
    assert time.monotonic() - start < 60
    assert not any(_alive(p) for p in before)
    assert run_distributed(_sum_of_ranks, world_size=2) == [(0, 1.0), (1, 1.0)]


def _teardown_time_and_end(rank: int, world_size: int, tmp: str) -> float:
    """Rank 0 returns at once, rank 1 after 1.5 s; each rank's teardown writes when it began (fresh workers)."""
    real = dist.destroy_process_group

    def recorded(*args: object, **kwargs: object) -> None:
        Path(tmp, f"teardown{rank}").write_text(repr(time.time()))
        real(*args, **kwargs)

    dist.destroy_process_group = recorded  # the worker's own teardown looks it up here
    if rank == 1:
        time.sleep(1.5)
    return time.time()


@newest_mcore
def test_no_rank_tears_down_before_every_rank_has_finished(tmp_path: Path) -> None:
    """A rank whose function is done must keep its process group until every peer's function is done: gloo
    returns from init_process_group on one rank while a slower peer still completes the handshake, and an
    early teardown made that peer fail with "Connection closed by peer" (CI's rare gloo failure)."""
    ends = run_distributed(_teardown_time_and_end, world_size=2, args=(str(tmp_path),), fresh=True)
    assert float((tmp_path / "teardown0").read_text()) >= ends[1]


def _dirty_the_process(rank: int, world_size: int, tmp: str) -> None:
    os.environ["VERL_TEST_LEAK"] = "1"
    os.environ.pop("MASTER_ADDR")
    os.chdir(tmp)
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(1)
    torch.manual_seed(123)
    torch.use_deterministic_algorithms(True)
    torch.set_grad_enabled(False)


def _process_state(rank: int, world_size: int) -> dict[str, object]:
    return {
        "pid": os.getpid(),
        "leak": os.environ.get("VERL_TEST_LEAK"),
        "master": os.environ.get("MASTER_ADDR"),
        "cwd": os.getcwd(),
        "dtype": torch.get_default_dtype(),
        "threads": torch.get_num_threads(),
        "draw": torch.rand(3),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "grad": torch.is_grad_enabled(),
    }


@newest_mcore
def test_a_call_leaves_nothing_behind_for_the_next(tmp_path: Path) -> None:
    before = run_distributed(_process_state, world_size=2)
    run_distributed(_dirty_the_process, world_size=2, args=(str(tmp_path),))
    after = run_distributed(_process_state, world_size=2)
    for got, want in zip(after, before, strict=True):
        assert got.pop("pid") == want.pop("pid")  # the same process, put back as it was
        # the default generator is seeded anew, as a new process's is (at random), not left at 123
        assert not torch.equal(got.pop("draw"), torch.rand(3, generator=torch.Generator().manual_seed(123)))
        want.pop("draw")
        assert got == want
        assert got["leak"] is None and got["master"] == "127.0.0.1" and got["cwd"] == os.getcwd()


def _dirty_megatron(rank: int, world_size: int) -> None:
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.num_microbatches_calculator import init_num_microbatches_calculator

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world_size)
    tensor_parallel.get_cuda_rng_tracker()._is_initialized = True  # what seeding it sets (that needs CUDA)
    init_num_microbatches_calculator(rank, None, 4, 1, world_size)


def _megatron_state(rank: int, world_size: int) -> tuple[bool, bool, bool]:
    from megatron.core import num_microbatches_calculator, parallel_state, tensor_parallel

    return (
        parallel_state.model_parallel_is_initialized(),
        tensor_parallel.get_cuda_rng_tracker().is_initialized(),
        num_microbatches_calculator._GLOBAL_NUM_MICROBATCHES_CALCULATOR is not None,
    )


def test_megatron_state_does_not_leak_into_the_next_call() -> None:
    run_distributed(_dirty_megatron, world_size=2)
    assert run_distributed(_megatron_state, world_size=2) == [(False, False, False)] * 2


@newest_mcore
def test_a_changed_caller_environment_gets_new_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    before = run_distributed(_pid, world_size=1)
    monkeypatch.setenv("VERL_TEST_CALLER_VAR", "x")
    ((pid, value),) = run_distributed(_env, world_size=1, args=("VERL_TEST_CALLER_VAR",))
    assert value == "x" and pid != before[0]  # spawned with the caller's environment, as a fresh run is


@newest_mcore
def test_sharing_can_be_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VERL_TEST_FRESH_WORKERS", "1")
    first = run_distributed(_pid, world_size=1)
    assert run_distributed(_pid, world_size=1) != first
