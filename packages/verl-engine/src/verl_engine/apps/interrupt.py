"""A run stopped by SIGINT (Ctrl-C) or SIGTERM (preemption) ends at a step boundary, with a checkpoint.

Why a flag and not an exception: a signal arrives on each rank at a different moment, often inside a collective;
raising there would leave the other ranks waiting forever, and a checkpoint written mid-step would not be one
that resumes exactly. The handler only records the signal; at the end of every step the ranks agree on it (one
all-reduce of a number) and all stop after the same step, write its checkpoint together and exit with 128 +
the signal's number (130 for SIGINT, 143 for SIGTERM). A second signal stops at once.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["RunInterrupted", "StopSignals"]


class RunInterrupted(Exception):
    """The run stopped at a step boundary on ``signum``: ``step`` steps done, ``checkpoint`` holds them (None:
    nothing could be saved, e.g. during the warm start)."""

    def __init__(self, signum: int, *, step: int, checkpoint: Path | None, note: str = "") -> None:
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        name = signal.Signals(signum).name
        where = f"checkpoint: {checkpoint}" if checkpoint is not None else "nothing saved"
        super().__init__(f"interrupted by {name} after step {step}; {where}{note}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class StopSignals:
    """Within the ``with`` block SIGINT and SIGTERM set :attr:`received` instead of stopping the process
    (main thread only: elsewhere handlers cannot be installed and the process keeps Python's defaults)."""

    def __init__(self, *, announce: bool = True) -> None:
        self.received = 0
        self.announce = announce
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received:  # the second one: stop now, as Python would have
            raise KeyboardInterrupt
        self.received = signum
        if self.announce and os.environ.get("RANK", "0") == "0":
            print(
                f"{signal.Signals(signum).name}: stopping after the current step (writing its checkpoint);"
                " send it again to stop at once",
                file=sys.stderr,
                flush=True,
            )

    def agreed(self, device: torch.device) -> int:
        """The signal any rank received (0: none), the same on every rank: call it on every rank together."""
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return self.received
        flag = torch.tensor([self.received], dtype=torch.int64, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())
