"""Run a function on N local processes with a real process group (gloo on CPU, NCCL on GPUs).

For tests of distributed code on a CPU-only machine: ``run_distributed(fn, world_size=2)`` starts
two spawned processes, initialises torch.distributed in each, calls ``fn(rank, world_size, *args)``
and returns the per-rank results. An exception on any rank is re-raised in the caller with that
rank's traceback; a rank that does not finish within ``timeout_s`` makes the whole run fail (the
other processes are killed) instead of hanging the test session.

Rendezvous without a port race: the caller's process opens the TCPStore server itself on a port the OS
assigns (port 0) and keeps it open for the whole run; the ranks join it as clients. (Picking a free
port, closing it and letting rank 0 bind it again seconds later, after its imports, lets any other
process on the machine take the port in between: an intermittent failure on a busy CI machine.)
A failure report is also written to stderr, so it ends the captured output of a failing test.

Results travel as plain pickled bytes. torch's multiprocessing queue would move a tensor's storage by
file descriptor, fetched from the producing process when the caller unpickles it; a rank that has
already exited by then (it returns as soon as it has put its result) makes that read fail with
"connection reset/refused", intermittently, depending on how fast the caller reads.
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue as queue_mod
import socket
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["DistributedRunError", "free_port", "run_distributed"]


class DistributedRunError(RuntimeError):
    """One or more ranks failed or timed out."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    fn: Callable[..., Any],
    args: Sequence[Any],
    queue: Any,
    timeout_s: float,
) -> None:
    import torch

    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
    )
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore("127.0.0.1", port, world_size=None, is_master=False, timeout=timeout)
        dist.init_process_group(
            backend=backend, store=store, rank=rank, world_size=world_size, timeout=timeout
        )
        result = fn(rank, world_size, *args)
        # Plain pickle: no file descriptors that outlive this process (see module doc).
        queue.put((rank, True, pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)))
    except BaseException:
        queue.put((rank, False, traceback.format_exc()))
    finally:
        # Tear down megatron's groups only if the rank used megatron-core: importing it just to check
        # would cost a torch-only rank 10-25 s.
        parallel_state = sys.modules.get("megatron.core.parallel_state")
        if parallel_state is not None and parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(
    fn: Callable[..., Any],
    *,
    world_size: int,
    args: Sequence[Any] = (),
    backend: str = "gloo",
    timeout_s: float = 300.0,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; return results by rank.

    ``fn`` and ``args`` must be picklable (a module-level function). Results are pickled back.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    # The rendezvous server lives here, on an OS-assigned port, until every rank is done (see module doc).
    server = dist.TCPStore(
        "127.0.0.1",
        0,
        world_size=None,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    port = server.port
    procs = [
        ctx.Process(
            target=_worker,
            args=(rank, world_size, port, backend, fn, tuple(args), queue, timeout_s),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    failures: dict[int, str] = {}  # rank -> its traceback
    killed: set[int] = set()  # ranks this function had to stop (not failures of their own)
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) + len(failures) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise DistributedRunError(
                    f"timed out after {timeout_s:.0f}s: ranks {sorted(set(range(world_size)) - set(results))} did not finish"
                )
            try:
                _record(queue.get(timeout=min(remaining, 1.0)), results, failures)
            except queue_mod.Empty:
                dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0) and i not in results]
                if dead:  # a rank may have reported just before exiting: read what is queued first
                    _drain(queue, results, failures)
                    dead = [i for i in dead if i not in results and i not in failures]
                if dead and not failures:
                    raise DistributedRunError(
                        f"rank(s) {dead} exited with codes {[procs[i].exitcode for i in dead]}"
                    ) from None
            if failures:
                break  # a rank failed: the others may now block in a collective, stop them
    except DistributedRunError as err:
        _report(str(err))
        raise
    finally:
        for i, p in enumerate(procs):
            p.join(timeout=5 if not failures else 0.5)
            if p.is_alive():
                p.kill()
                p.join()
                killed.add(i)
        del server
    if failures:
        lines = [f"--- rank {rank} ---\n{tb}" for rank, tb in sorted(failures.items())]
        died = [
            (i, p.exitcode)
            for i, p in enumerate(procs)
            if i not in results and i not in failures and i not in killed and p.exitcode not in (None, 0)
        ]
        if died:  # a rank that died without a report (e.g. killed, os._exit) explains the others' errors
            lines.append(
                f"rank(s) {[i for i, _ in died]} exited with codes {[c for _, c in died]} without reporting"
            )
        message = "distributed run failed:\n" + "\n".join(lines)
        _report(message)
        raise DistributedRunError(message)
    return [results[r] for r in range(world_size)]


def _record(item: tuple[int, bool, Any], results: dict[int, Any], failures: dict[int, str]) -> None:
    """File one rank's report: its result, or its traceback."""
    rank, ok, payload = item
    if ok:
        results[rank] = pickle.loads(payload)
    else:
        failures[rank] = payload


def _drain(queue: Any, results: dict[int, Any], failures: dict[int, str]) -> None:
    """Record every report already queued."""
    while True:
        try:
            _record(queue.get(timeout=0.2), results, failures)
        except queue_mod.Empty:
            return


def _report(message: str) -> None:
    """Write the failure last to stderr: CI logs often keep only the tail of a test's output."""
    print(f"\nrun_distributed: {message}", file=sys.stderr, flush=True)
