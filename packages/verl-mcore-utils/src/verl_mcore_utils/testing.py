"""Run a function on N local processes with a real process group (gloo on CPU, NCCL on GPUs).

``run_distributed(fn, world_size=2)`` runs ``fn(rank, world_size, *args)`` on two processes and returns the
per-rank results; a rank's exception is re-raised here with its traceback, a timeout or a silent death fails
the run instead of hanging it. gloo runs reuse warm worker processes. Design (rendezvous, result transport):
the package README.
"""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

import torch.distributed as dist

from verl_mcore_utils._rank_worker import Job
from verl_mcore_utils._worker_pool import VOLATILE_ENV, WorkerPool, discard, shared_pool, sharing_disabled

__all__ = ["DistributedRunError", "free_port", "run_distributed"]


class DistributedRunError(RuntimeError):
    """One or more ranks failed or timed out."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_distributed(
    fn: Callable[..., Any],
    *,
    world_size: int,
    args: Sequence[Any] = (),
    backend: str = "gloo",
    timeout_s: float = 300.0,
    fresh: bool | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; return results by rank.

    ``fn`` and ``args`` must be picklable (a module-level function). Results are pickled back.

    ``fresh``: run on newly spawned processes that exit afterwards, for a function that needs a brand-new
    process (it checks import-time behaviour or the process's first-time state, or patches a module for
    good). By default gloo runs reuse the session's warm workers (see the package README) and NCCL runs
    are fresh (a GPU's memory, caching allocator and CUDA context should start clean for GPU tests).
    ``VERL_TEST_FRESH_WORKERS=1`` makes every run fresh.
    """
    if fresh is None:
        fresh = backend != "gloo"
    fresh = fresh or sharing_disabled()
    # Pickled here: an argument that cannot be pickled fails in the caller, before any process is touched.
    payload = pickle.dumps((fn, tuple(args)), protocol=pickle.HIGHEST_PROTOCOL)
    try:
        return _call(payload, world_size=world_size, backend=backend, timeout_s=timeout_s, fresh=fresh)
    except _RendezvousError as first:
        # Every failing rank failed while joining the call's process group (gloo's connectFullMesh): the
        # function never ran there, the workers are discarded. Under a loaded CPU this happens rarely between
        # warm workers; new workers and a new rendezvous server are a clean start. Once, and said so.
        _report(f"process-group rendezvous failed; retrying the call once on new workers:\n{first}")
    try:
        return _call(payload, world_size=world_size, backend=backend, timeout_s=timeout_s, fresh=fresh)
    except _RendezvousError as second:
        _report(str(second))
        raise DistributedRunError(str(second)) from None


class _RendezvousError(DistributedRunError):
    """Every rank that failed, failed inside ``init_process_group`` (before the function ran)."""


def _call(payload: bytes, *, world_size: int, backend: str, timeout_s: float, fresh: bool) -> list[Any]:
    """One attempt of :func:`run_distributed`."""
    global _calls
    _calls += 1
    # The rendezvous server lives here, on an OS-assigned port, until every rank is done (package README).
    server = dist.TCPStore(
        "127.0.0.1",
        0,
        world_size=None,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    pool = WorkerPool() if fresh else shared_pool(world_size)
    replies = _Replies(call_id=_calls, pending=set(range(world_size)))
    log_starts: list[int] = []
    try:
        pool.grow(world_size)
        log_starts = [w.log_size() for w in pool.workers[:world_size]]
        for rank in range(world_size):
            pool.submit(rank, _job(_calls, rank, world_size, server.port, backend, timeout_s, payload))
        _collect(pool.workers[:world_size], replies, timeout_s=timeout_s)
    except BaseException as err:  # a timeout, a silent death, or an interrupt: these workers are done for
        if isinstance(err, DistributedRunError):
            err = DistributedRunError(str(err) + _stderr_tails(pool, log_starts))
            discard(pool)
            _report(str(err))
            raise err from None
        discard(pool)
        raise
    finally:
        del server
    failures, died = replies.failures, replies.died
    if failures:
        lines = [f"--- rank {rank} ---\n{tb}" for rank, tb in sorted(failures.items())]
        if died:  # a rank that died without a report (e.g. killed, os._exit) explains the others' errors
            lines.append(
                f"rank(s) {sorted(died)} exited with codes {[died[r] for r in sorted(died)]} without reporting"
            )
        message = "distributed run failed:\n" + "\n".join(lines) + _stderr_tails(pool, log_starts)
        discard(pool)
        if not died and all(_RENDEZVOUS_FAILURE in tb for tb in failures.values()):
            raise _RendezvousError(message)
        _report(message)
        raise DistributedRunError(message)
    if fresh:
        pool.stop()
    return [replies.results[r] for r in range(world_size)]


def _job(
    call_id: int, rank: int, world_size: int, port: int, backend: str, timeout_s: float, payload: bytes
) -> Job:
    """One rank's share of the call, with what a process spawned now would take from this one."""
    return Job(
        call_id=call_id,
        rank=rank,
        world_size=world_size,
        port=port,
        backend=backend,
        timeout_s=timeout_s,
        payload=payload,
        sys_path=list(sys.path),
        cwd=os.getcwd(),
        environ={k: os.environ[k] for k in VOLATILE_ENV if k in os.environ},
    )


# the frame of a rank's traceback that says it failed joining the process group, before the function ran
_RENDEZVOUS_FAILURE = "in _create_gloo_process_group"
_FAILURE_GRACE_S = 5.0  # after one rank's error, how long the others may still report theirs
_calls = 0  # numbers the calls: a report always names the call it belongs to


@dataclass
class _Replies:
    """What the ranks of one call have reported so far."""

    call_id: int
    pending: set[int]  # ranks not heard from yet
    finished: set[int] = field(
        default_factory=set
    )  # pending ranks whose function returned: waiting for peers
    results: dict[int, Any] = field(default_factory=dict)
    failures: dict[int, str] = field(default_factory=dict)  # rank -> its traceback
    died: dict[int, int] = field(
        default_factory=dict
    )  # rank -> exit code, for ranks that exited without reporting


def _collect(workers: list[Any], replies: _Replies, *, timeout_s: float) -> None:
    """Read the ranks' reports until all are in or one rank failed; raise on a timeout or a silent death.

    After a failure the other ranks may be blocked in a collective for ever: the caller discards them.
    """
    pending, failures = replies.pending, replies.failures
    deadline = time.monotonic() + timeout_s
    while pending and not failures:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            stuck, waiting = sorted(pending - replies.finished), sorted(pending & replies.finished)
            raise DistributedRunError(
                f"timed out after {timeout_s:.0f}s: ranks {stuck} did not finish"
                + (f" (ranks {waiting} finished and were waiting for them)" if waiting else "")
            )
        _poll(workers, replies, timeout=min(remaining, 1.0))
        if replies.died and not failures:
            dead = sorted(replies.died)
            raise DistributedRunError(f"rank(s) {dead} exited with codes {[replies.died[r] for r in dead]}")
    if failures:
        # The first error is often a consequence ("connection closed by peer"): the rank that failed first, or
        # died, holds the cause. Give the others a few seconds to report or exit; a rank blocked in a
        # collective will not, and is killed with the pool.
        # Ranks whose function returned wait for the failed one at the end of the call: they will not report.
        grace = time.monotonic() + _FAILURE_GRACE_S
        while pending - replies.finished and time.monotonic() < grace:
            _poll(workers, replies, timeout=max(0.0, min(grace - time.monotonic(), 0.5)))


def _poll(workers: list[Any], replies: _Replies, *, timeout: float) -> None:
    """Wait up to ``timeout`` for a pending rank to report or exit; read what came, note the deaths."""
    pending = replies.pending
    by_conn = {workers[r].conn: r for r in pending}
    by_sentinel = {workers[r].process.sentinel: r for r in pending}
    for ready in wait([*by_conn, *by_sentinel], timeout=timeout):
        rank = by_conn.get(ready) if isinstance(ready, Connection) else by_sentinel.get(ready)
        # a process that exited may have sent its report first: that still counts
        if rank is not None and rank in pending and (ready in by_conn or workers[rank].conn.poll()):
            _read(workers[rank].conn, rank, replies)
    for rank in sorted(pending):
        _note_death(workers[rank], rank, replies)


def _note_death(worker: Any, rank: int, replies: _Replies) -> None:
    """If ``rank``'s process has exited, read the report it may have sent first, else record its death."""
    code = worker.process.exitcode
    if code is None:
        return
    if worker.conn.poll():  # a report, or the end of the pipe
        _read(worker.conn, rank, replies)
    if rank in replies.pending:
        replies.died[rank] = code


def _read(conn: Connection, rank: int, replies: _Replies) -> None:
    """Take one rank's report off its pipe (a pipe that closed mid-report is a rank that died)."""
    try:
        item = pickle.loads(conn.recv_bytes())
    except (EOFError, OSError):
        return  # its exit code is read by the caller's loop
    got_call, got_rank, ok, payload = item
    if got_call != replies.call_id or got_rank != rank:
        raise DistributedRunError(
            f"rank {rank} answered call {got_call} as rank {got_rank}, not call {replies.call_id}"
        )
    if ok is None:  # the function returned; the rank now waits for the others before its report
        replies.finished.add(rank)
        return
    replies.pending.discard(rank)
    _record((rank, ok, payload), replies.results, replies.failures)


def _record(item: tuple[int, bool, Any], results: dict[int, Any], failures: dict[int, str]) -> None:
    """File one rank's report: its result, or its traceback."""
    rank, ok, payload = item
    if ok:
        results[rank] = pickle.loads(payload)
    else:
        failures[rank] = payload


def _stderr_tails(pool: WorkerPool, starts: list[int]) -> str:
    """What each rank wrote to stderr during the call (its worker's log from the call's start): a crashed
    rank's own last words, e.g. a C++ exception's message or the Python stack faulthandler prints."""
    parts = []
    for rank, start in enumerate(starts):
        if rank < len(pool.workers):
            text = pool.workers[rank].log_since(start)
            if text.strip():
                parts.append(f"--- rank {rank} stderr (last lines) ---\n{text}")
    return ("\n" + "\n".join(parts)) if parts else ""


def _report(message: str) -> None:
    """Write the failure last to stderr: CI logs often keep only the tail of a test's output."""
    print(f"\nrun_distributed: {message}", file=sys.stderr, flush=True)
