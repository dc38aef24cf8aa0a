"""The process side of :func:`verl_mcore_utils.testing.run_distributed`: one rank per call, many calls per process.

A worker is spawned once and then serves calls sent over its pipe until it is told to stop, its parent
goes away, or it is killed. Starting a process that imports torch, megatron-core and transformers costs
10-25 s on a small CPU machine, often more than the call itself; a reused worker pays it once.

What a call leaves behind in the process must not change the next call, so after each call the worker
puts back what a fresh process would have (:class:`_FreshState`): the environment, working directory and
``sys.path``; a new random seed for torch's default generator; torch's default dtype, thread count, grad mode, deterministic-algorithm
flags and float32 matmul precision; megatron-core's parallel state, microbatch calculator and RNG tracker;
the process group; and once-only warnings. What it cannot put back (a module attribute a call patched,
a C library's state) is why :func:`run_distributed` keeps ``fresh=True``.

Reports travel as plain pickled bytes over the pipe (see :mod:`verl_mcore_utils.testing` for why), and
a successful rank reports only after its process group and megatron-core state are torn down, so the
caller may close the rendezvous server as soon as every rank has reported.
"""

from __future__ import annotations

import datetime
import faulthandler
import gc
import os
import pickle
import sys
import threading
import time
import traceback
import warnings
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["Job", "serve"]


@dataclass(frozen=True)
class Job:
    """One rank's share of one call. ``payload``: ``pickle.dumps((fn, args))``, loaded after ``sys_path``."""

    call_id: int
    rank: int
    world_size: int
    port: int
    backend: str
    timeout_s: float
    payload: bytes
    sys_path: list[str]
    cwd: str
    environ: dict[str, str]  # the caller's variables that may differ from the worker's own (set for the call)


def serve(conn: Connection, log: str | None = None) -> None:
    """Run jobs from ``conn`` until a ``None`` job, the parent's exit, or a failed clean-up.

    Each report is ``(call_id, rank, ok, payload)``: ``payload`` is the pickled result, or the traceback.
    ``log``: the file this process's stderr (file descriptor 2, so C++ messages too) is appended to; a fatal
    signal writes every thread's Python stack there (faulthandler), so a crash explains itself.
    """
    if log is not None:
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 2)
        os.close(fd)
    faulthandler.enable(all_threads=True)
    _exit_with_parent()
    fresh = _FreshState.capture()
    while True:
        try:
            job = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return  # the caller is gone
        if job is None:
            return
        report = _run(job, conn)
        ok = report[2]
        try:
            if ok:  # tear down before reporting: the caller may then close the rendezvous server at once
                fresh.restore()
            conn.send_bytes(pickle.dumps(report, protocol=pickle.HIGHEST_PROTOCOL))
            if not ok:  # the caller discards this worker; tidy up only what a hung peer cannot block
                fresh.restore()
        except BaseException:
            # A process whose state could not be put back must not serve another call.
            if ok:
                conn.send_bytes(pickle.dumps((job.call_id, job.rank, False, traceback.format_exc())))
            os._exit(1)


def _run(job: Job, conn: Connection) -> tuple[int, int, bool, Any]:
    """Join the call's process group, run its function, wait for the other ranks, return the report.

    Between the function's end and the wait, a ``(call_id, rank, None, None)`` notice tells the caller this
    rank is done and only waiting, so a timeout names the ranks that really did not finish.
    """
    os.environ.update(job.environ)
    os.environ.update(
        {
            "RANK": str(job.rank),
            "LOCAL_RANK": str(job.rank),
            "WORLD_SIZE": str(job.world_size),
            "LOCAL_WORLD_SIZE": str(job.world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(job.port),
        }
    )
    try:
        sys.path[:] = job.sys_path  # as a spawned process gets them from its parent
        os.chdir(job.cwd)
        fn, args = pickle.loads(job.payload)  # may import the caller's test module: after sys.path is set
        if job.backend == "nccl":
            torch.cuda.set_device(job.rank)
        timeout = datetime.timedelta(seconds=job.timeout_s)
        store = dist.TCPStore("127.0.0.1", job.port, world_size=None, is_master=False, timeout=timeout)
        dist.init_process_group(
            backend=job.backend, store=store, rank=job.rank, world_size=job.world_size, timeout=timeout
        )
        result = fn(job.rank, job.world_size, *args)
        conn.send_bytes(pickle.dumps((job.call_id, job.rank, None, None), protocol=pickle.HIGHEST_PROTOCOL))
        _leave_together(store, job, timeout)
        # Plain pickle: no file descriptors that outlive this process (see verl_mcore_utils.testing).
        return (job.call_id, job.rank, True, pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL))
    except BaseException:
        return (job.call_id, job.rank, False, traceback.format_exc())


def _leave_together(store: dist.TCPStore, job: Job, timeout: datetime.timedelta) -> None:
    """Return once every rank of the call has finished its function: only then may this rank tear down.

    Why: gloo's ``init_process_group`` returns on a rank as soon as its own side of the connection mesh is
    up, while a slower peer may still be completing the handshake on its side. A rank whose function needs
    no collective would then destroy its group (closing its sockets) at once, and the peer's
    ``connectFullMesh`` fails with "Connection closed by peer" (measured under CPU load: 4 of 150 trivial
    4-rank calls; the cause of CI's rare gloo failure). The barrier is on the call's rendezvous store, not
    on the process group, which the function may have destroyed itself. A rank that failed never arrives:
    its peers wait here until the caller, having read the failure, discards them.
    """
    store.set(f"verl_test/{job.call_id}/done/{job.rank}", b"1")  # type: ignore[arg-type]  # bytes are accepted
    store.wait([f"verl_test/{job.call_id}/done/{r}" for r in range(job.world_size)], timeout)


def _exit_with_parent() -> None:
    """Exit when the parent does, even in the middle of a call: a worker must never outlive its test run.

    (Between calls the closed pipe ends the worker too; this also covers a call that is still running.)
    """
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


@dataclass
class _FreshState:
    """What a call may change in the process, as the fresh worker had it (see module doc)."""

    environ: dict[str, str]
    cwd: str
    sys_path: list[str]
    default_dtype: torch.dtype
    num_threads: int
    grad_enabled: bool
    deterministic: bool
    deterministic_warn_only: bool
    matmul_precision: str

    @classmethod
    def capture(cls) -> _FreshState:
        return cls(
            environ=dict(os.environ),
            cwd=os.getcwd(),
            sys_path=list(sys.path),
            default_dtype=torch.get_default_dtype(),
            num_threads=torch.get_num_threads(),
            grad_enabled=torch.is_grad_enabled(),
            deterministic=torch.are_deterministic_algorithms_enabled(),
            deterministic_warn_only=torch.is_deterministic_algorithms_warn_only_enabled(),
            matmul_precision=torch.get_float32_matmul_precision(),
        )

    def restore(self) -> None:
        """Tear down the call's distributed state, then put every captured setting back."""
        _reset_megatron()
        if dist.is_initialized():
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(self.environ)
        os.chdir(self.cwd)
        sys.path[:] = self.sys_path
        torch.set_default_dtype(self.default_dtype)
        torch.set_num_threads(self.num_threads)
        torch.seed()  # a new process starts from a random seed too: no call sees another's draws
        torch.set_grad_enabled(self.grad_enabled)
        # Only when changed: the first call of use_deterministic_algorithms loads torch's compiler (3 s).
        wanted = (self.deterministic, self.deterministic_warn_only)
        if (
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
        ) != wanted:
            torch.use_deterministic_algorithms(self.deterministic, warn_only=self.deterministic_warn_only)
        torch.set_float32_matmul_precision(self.matmul_precision)
        _reset_once_only_warnings()
        gc.collect()  # the call's models and optimizer states: free them now, not during the next call


def _reset_megatron() -> None:
    """megatron-core's process globals as a fresh import has them, for the modules this process loaded.

    Looked up in ``sys.modules``: importing megatron-core just to reset it would cost a torch-only
    worker 10-25 s.
    """
    parallel_state = sys.modules.get("megatron.core.parallel_state")
    if parallel_state is not None:
        parallel_state.destroy_model_parallel()  # also drops the global memory buffer
    microbatches = sys.modules.get("megatron.core.num_microbatches_calculator")
    if microbatches is not None:
        microbatches.destroy_num_microbatches_calculator()
    rng: Any = sys.modules.get("megatron.core.tensor_parallel.random")  # Any: its attributes are set below
    if rng is not None:  # "is the RNG tracker seeded?" must be answered as in a fresh process
        rng._CUDA_RNG_STATE_TRACKER = None
        rng._CUDA_RNG_STATE_TRACKER_INITIALIZED = False


def _reset_once_only_warnings() -> None:
    """Warn again what a fresh process would: Python's per-location registries and verl-config's once-set."""
    mutated = getattr(warnings, "_filters_mutated", None)  # bumps the filters' version: registries reset
    if mutated is not None:
        mutated()
    notes = sys.modules.get("verl_config.notes")
    if notes is not None:
        notes._WARNED.clear()
