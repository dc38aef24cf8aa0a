"""Rank worker processes for :func:`verl_mcore_utils.testing.run_distributed`, kept warm between calls.

Spawning a rank costs 10-25 s of imports (torch, megatron-core, transformers) on a small CPU machine, more
than most test bodies; the test suites make hundreds of calls. So the calls of one test session share one
pool of spawned workers (:func:`shared_pool`): a call of world size N runs rank i on worker i, and the pool
grows to the largest world size asked for. Each worker puts its process back to a fresh state after every
call (:mod:`verl_mcore_utils._rank_worker`).

A pool that failed in any way is never used again (:func:`discard`): a worker that raised, died or timed
out may have left state that the clean-up does not know about, or may still be stuck in a collective.
The next call starts new workers. A pool is also replaced when the caller's environment changed since its
workers were spawned (a spawned process gets the environment once, at start; a test may set a variable
before calling). Workers are stopped at interpreter exit, and each one also exits when its parent does.

Each worker's stderr goes to its own file (:attr:`_Worker.log`), not to the caller's: a shared worker outlives
the test that spawned it, so what it prints (a C++ abort message, a fatal signal's Python stack) would land in that
earlier test's captured output. :func:`verl_mcore_utils.testing.run_distributed` puts the lines a call wrote
into its failure report instead.

``VERL_TEST_FRESH_WORKERS=1`` turns the sharing off: every call gets its own workers (for debugging a
test that might depend on a previous call).
"""

from __future__ import annotations

import atexit
import os
import pickle
import shutil
import tempfile
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

from verl_mcore_utils._rank_worker import Job, serve

__all__ = ["FRESH_ENV", "VOLATILE_ENV", "WorkerPool", "discard", "shared_pool", "sharing_disabled"]

FRESH_ENV = "VERL_TEST_FRESH_WORKERS"

# Variables that change during a test session without changing what a spawned process would do: they are
# sent with each call instead of replacing the pool.
VOLATILE_ENV = frozenset({"PYTEST_CURRENT_TEST"})


@dataclass
class _Worker:
    process: Any  # a started SpawnProcess
    conn: Connection  # the caller's end of the worker's duplex pipe
    log: Path  # the worker's stderr

    def log_size(self) -> int:
        try:
            return self.log.stat().st_size
        except OSError:
            return 0

    def log_since(self, offset: int, *, max_lines: int = 60) -> str:
        """The last ``max_lines`` lines the worker wrote to stderr after byte ``offset``."""
        try:
            with self.log.open("rb") as f:
                f.seek(offset)
                text = f.read().decode("utf-8", errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-max_lines:])


@dataclass
class WorkerPool:
    """Spawned workers (index = rank) and the environment they were spawned with."""

    environ: dict[str, str] = field(default_factory=lambda: _stable_environ())
    workers: list[_Worker] = field(default_factory=list)
    logs: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="verl-rank-logs-")))

    def grow(self, size: int) -> None:
        """Spawn workers until there are ``size``."""
        ctx = mp.get_context("spawn")
        while len(self.workers) < size:
            ours, theirs = ctx.Pipe(duplex=True)
            log = self.logs / f"worker{len(self.workers)}.stderr"
            log.touch()
            process = ctx.Process(target=serve, args=(theirs, str(log)), daemon=True)
            process.start()
            theirs.close()  # the worker holds its end: when it exits, reads here end instead of blocking
            self.workers.append(_Worker(process, ours, log))

    def healthy(self) -> bool:
        return all(w.process.exitcode is None for w in self.workers)

    def submit(self, rank: int, job: Job) -> None:
        self.workers[rank].conn.send_bytes(pickle.dumps(job, protocol=pickle.HIGHEST_PROTOCOL))

    def stop(self, *, grace_s: float = 5.0) -> None:
        """Ask every worker to exit; kill those still running after ``grace_s``."""
        for w in self.workers:
            try:
                w.conn.send_bytes(pickle.dumps(None))
            except OSError:
                pass  # already gone
        for w in self.workers:
            w.process.join(timeout=grace_s)
        self.kill()

    def kill(self) -> None:
        """Kill every worker still running and close the pipes."""
        for w in self.workers:
            if w.process.is_alive():
                w.process.kill()
            w.process.join()
            w.conn.close()
        self.workers.clear()
        shutil.rmtree(self.logs, ignore_errors=True)


_shared: WorkerPool | None = None


def sharing_disabled() -> bool:
    return os.environ.get(FRESH_ENV, "") not in ("", "0")


def shared_pool(size: int) -> WorkerPool:
    """The session's pool with at least ``size`` workers, replaced first if it cannot be trusted."""
    global _shared
    if _shared is not None and (not _shared.healthy() or _shared.environ != _stable_environ()):
        discard(_shared)
    if _shared is None:
        _shared = WorkerPool()
    _shared.grow(size)
    return _shared


def discard(pool: WorkerPool) -> None:
    """Kill ``pool``'s workers; if it is the shared pool, the next call starts a new one."""
    global _shared
    if pool is _shared:
        _shared = None
    pool.kill()


def _stable_environ() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in VOLATILE_ENV}


@atexit.register
def _stop_shared_pool() -> None:
    if _shared is not None:
        _shared.stop(grace_s=2.0)
