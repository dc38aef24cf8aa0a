"""Run a function on N local processes with a real process group (gloo on CPU, NCCL on GPUs).

For tests of distributed code on a CPU-only machine: ``run_distributed(fn, world_size=2)`` runs
``fn(rank, world_size, *args)`` on two spawned processes, each in a freshly initialised
torch.distributed process group, and returns the per-rank results. An exception on any rank is
re-raised in the caller with that rank's traceback; a rank that does not finish within ``timeout_s``
makes the whole run fail (the processes are killed) instead of hanging the test session; a rank that
dies without reporting is named with its exit code.

Warm workers: a spawned rank spends 10-25 s importing torch, megatron-core and transformers on a small
CPU machine, usually more than the test body. gloo runs therefore reuse the session's spawned workers
(:mod:`verl_mcore_utils._worker_pool`), which put their process back to a fresh state after every call
(:mod:`verl_mcore_utils._rank_worker`); workers that failed, died or timed out are killed and never
reused. ``fresh=True`` (or ``VERL_TEST_FRESH_WORKERS=1`` for every call) spawns processes for one call
only, as before.

Rendezvous without a port race: the caller's process opens the TCPStore server itself on a port the OS
assigns (port 0) and keeps it open for the whole run; the ranks join it as clients. (Picking a free
port, closing it and letting rank 0 bind it again seconds later, after its imports, lets any other
process on the machine take the port in between: an intermittent failure on a busy CI machine.)
A failure report is also written to stderr, so it ends the captured output of a failing test.

Results travel as plain pickled bytes. torch's multiprocessing queue would move a tensor's storage by
file descriptor, fetched from the producing process when the caller unpickles it; a rank that has
already exited by then (it returns as soon as it has put its result) makes that read fail with
"connection reset/refused", intermittently, depending on how fast the caller reads. The function and
its arguments go the other way as plain pickled bytes too, over each worker's pipe.
"""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import sys
import time
from collections.abc import Callable, Sequence
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
    good). By default gloo runs reuse the session's warm workers (see module doc) and NCCL runs are fresh
    (a GPU's memory, caching allocator and CUDA context should start clean for GPU tests).
    ``VERL_TEST_FRESH_WORKERS=1`` makes every run fresh.
    """
    if fresh is None:
        fresh = backend != "gloo"
    fresh = fresh or sharing_disabled()
    # Pickled here: an argument that cannot be pickled fails in the caller, before any process is touched.
    payload = pickle.dumps((fn, tuple(args)), protocol=pickle.HIGHEST_PROTOCOL)
    global _calls
    _calls += 1
    # The rendezvous server lives here, on an OS-assigned port, until every rank is done (see module doc).
    server = dist.TCPStore(
        "127.0.0.1",
        0,
        world_size=None,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    pool = WorkerPool() if fresh else shared_pool(world_size)
    results: dict[int, Any] = {}
    failures: dict[int, str] = {}  # rank -> its traceback
    died: dict[int, int] = {}  # rank -> exit code, for ranks that exited without reporting
    try:
        pool.grow(world_size)
        for rank in range(world_size):
            pool.submit(rank, _job(_calls, rank, world_size, server.port, backend, timeout_s, payload))
        _collect(pool.workers[:world_size], _calls, timeout_s, results, failures, died)
    except BaseException as err:  # a timeout, a silent death, or an interrupt: these workers are done for
        discard(pool)
        if isinstance(err, DistributedRunError):
            _report(str(err))
        raise
    finally:
        del server
    if failures:
        discard(pool)
        lines = [f"--- rank {rank} ---\n{tb}" for rank, tb in sorted(failures.items())]
        if died:  # a rank that died without a report (e.g. killed, os._exit) explains the others' errors
            lines.append(
                f"rank(s) {sorted(died)} exited with codes {[died[r] for r in sorted(died)]} without reporting"
            )
        message = "distributed run failed:\n" + "\n".join(lines)
        _report(message)
        raise DistributedRunError(message)
    if fresh:
        pool.stop()
    return [results[r] for r in range(world_size)]


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


_calls = 0  # numbers the calls: a report always names the call it belongs to


def _collect(
    workers: list[Any],
    call_id: int,
    timeout_s: float,
    results: dict[int, Any],
    failures: dict[int, str],
    died: dict[int, int],
) -> None:
    """Read the ranks' reports until all are in or one rank failed; raise on a timeout or a silent death.

    After a failure the other ranks may be blocked in a collective for ever: the caller discards them.
    """
    by_conn = {w.conn: rank for rank, w in enumerate(workers)}
    by_sentinel = {w.process.sentinel: rank for rank, w in enumerate(workers)}
    pending = set(range(len(workers)))
    deadline = time.monotonic() + timeout_s
    while pending and not failures:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise DistributedRunError(
                f"timed out after {timeout_s:.0f}s: ranks {sorted(pending)} did not finish"
            )
        handles = [workers[r].conn for r in pending] + [workers[r].process.sentinel for r in pending]
        for ready in wait(handles, timeout=min(remaining, 1.0)):
            rank = by_conn.get(ready) if isinstance(ready, Connection) else None
            if rank is not None and rank in pending:
                _read(workers[rank].conn, rank, call_id, results, failures, pending)
            elif ready in by_sentinel:  # the process exited: a report it sent first still counts
                rank = by_sentinel[ready]
                if rank in pending and workers[rank].conn.poll():
                    _read(workers[rank].conn, rank, call_id, results, failures, pending)
        for rank in sorted(pending):
            _note_death(workers[rank], rank, call_id, results, failures, pending, died)
        if died and not failures:
            dead = sorted(died)
            raise DistributedRunError(f"rank(s) {dead} exited with codes {[died[r] for r in dead]}")
    if failures:  # a rank that died explains the others' errors: give a dying process a moment to exit
        time.sleep(0.5)
        for rank in sorted(pending):
            _note_death(workers[rank], rank, call_id, results, failures, pending, died)


def _note_death(
    worker: Any,
    rank: int,
    call_id: int,
    results: dict[int, Any],
    failures: dict[int, str],
    pending: set[int],
    died: dict[int, int],
) -> None:
    """If ``rank``'s process has exited, read the report it may have sent first, else record its death."""
    code = worker.process.exitcode
    if code is None:
        return
    if worker.conn.poll():  # a report, or the end of the pipe
        _read(worker.conn, rank, call_id, results, failures, pending)
    if rank in pending:
        died[rank] = code


def _read(
    conn: Connection,
    rank: int,
    call_id: int,
    results: dict[int, Any],
    failures: dict[int, str],
    pending: set[int],
) -> None:
    """Take one rank's report off its pipe (a pipe that closed mid-report is a rank that died)."""
    try:
        item = pickle.loads(conn.recv_bytes())
    except (EOFError, OSError):
        return  # its exit code is read by the caller's loop
    got_call, got_rank, ok, payload = item
    if got_call != call_id or got_rank != rank:
        raise DistributedRunError(
            f"rank {rank} answered call {got_call} as rank {got_rank}, not call {call_id}"
        )
    pending.discard(rank)
    _record((rank, ok, payload), results, failures)


def _record(item: tuple[int, bool, Any], results: dict[int, Any], failures: dict[int, str]) -> None:
    """File one rank's report: its result, or its traceback."""
    rank, ok, payload = item
    if ok:
        results[rank] = pickle.loads(payload)
    else:
        failures[rank] = payload


def _report(message: str) -> None:
    """Write the failure last to stderr: CI logs often keep only the tail of a test's output."""
    print(f"\nrun_distributed: {message}", file=sys.stderr, flush=True)
