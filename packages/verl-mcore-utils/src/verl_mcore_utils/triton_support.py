"""What every Triton kernel of these packages checks before it runs, in one place.

The kernels (verl-mcore-utils' SwiGLU, verl-dyncp's RoPE, verl-engine's vocabulary kernels) run where Triton is
installed and the tensors are on CUDA, or on any device under Triton's CPU interpreter (``TRITON_INTERPRET=1``,
how CPU tests run them; it must be set before Triton is imported). Each family has a :class:`KernelSwitch` so
that benchmarks and tests can run the torch path they replace on the same machine.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator

import torch

__all__ = ["KernelSwitch", "have_triton", "triton_runs_on"]


@functools.cache
def have_triton() -> bool:
    """Whether Triton can be imported (checked once)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def triton_runs_on(t: torch.Tensor) -> bool:
    """Whether a Triton kernel can take ``t``: on CUDA, or under Triton's interpreter; Triton installed."""
    return (t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1") and have_triton()


class KernelSwitch:
    """On / off for one family of kernels: :meth:`off` runs the torch path instead within a block."""

    def __init__(self) -> None:
        self.enabled = True

    @contextlib.contextmanager
    def off(self) -> Iterator[None]:
        before, self.enabled = self.enabled, False
        try:
            yield
        finally:
            self.enabled = before
