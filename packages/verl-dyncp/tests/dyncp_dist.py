"""A torch-only N-process gloo runner for the verl-dyncp tests.

verl_mcore_utils.testing.run_distributed imports megatron-core in every spawned process (its package
__init__ does), which costs ~10-25 s per process on this machine; the modules under test import only
torch, so this runner keeps the spawns to a torch import. Same contract: ``fn(rank, world_size, *args)``
must be module-level; results come back pickled by rank; a failure on any rank re-raises with its
traceback; a timeout kills the processes instead of hanging the session.
"""

from __future__ import annotations

import os
import queue as queue_mod
import socket
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch.multiprocessing as mp


def _port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(rank: int, world: int, port: int, fn: Callable[..., Any], args: Sequence[Any], q: Any) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        q.put((rank, True, fn(rank, world, *args)))
    except BaseException:
        q.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_gloo(
    fn: Callable[..., Any], *, world_size: int, args: Sequence[Any] = (), timeout_s: float = 180.0
) -> list[Any]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _port()
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, fn, tuple(args), q), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    failures: list[str] = []
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < world_size and not failures:
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out after {timeout_s:.0f}s; finished ranks {sorted(results)}")
            try:
                rank, ok, payload = q.get(timeout=1.0)
            except queue_mod.Empty:
                dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0) and i not in results]
                if dead:
                    raise RuntimeError(
                        f"rank(s) {dead} died with exit codes {[procs[i].exitcode for i in dead]}"
                    ) from None
                continue
            if ok:
                results[rank] = payload
            else:
                failures.append(f"--- rank {rank} ---\n{payload}")
    finally:
        for p in procs:
            p.join(timeout=5 if not failures else 0.5)
            if p.is_alive():
                p.kill()
                p.join()
    if failures:
        raise RuntimeError("distributed run failed:\n" + "\n".join(failures))
    return [results[r] for r in range(world_size)]
