"""Shared pytest setup for every package's tests and the cross-package tests.

Markers (registered in pyproject.toml):
* ``gpu``: needs CUDA. Skipped cleanly where no GPU is visible.
* ``num_gpus(n)``: needs at least n GPUs; implies ``gpu`` so ``pytest -m gpu`` selects it.
* ``slow``: takes more than a few seconds.

``VERL_TEST_MIN_GPUS=n`` runs only the GPU tests that need at least n GPUs (a GPU suite runs the one-GPU tests in
parallel lanes, one GPU each, then the multi-GPU tests with every GPU visible).
"""

from __future__ import annotations

import os

import pytest


def _gpu_count() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pytest_itemcollected(item: pytest.Item) -> None:
    if item.get_closest_marker("num_gpus") is not None and item.get_closest_marker("gpu") is None:
        item.add_marker(pytest.mark.gpu)


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("gpu") is None:
        return
    needed = 1
    marker = item.get_closest_marker("num_gpus")
    if marker is not None:
        needed = int(marker.args[0]) if marker.args else int(marker.kwargs["n"])
    at_least = int(os.environ.get("VERL_TEST_MIN_GPUS", "1"))
    if needed < at_least:
        pytest.skip(
            f"needs {needed} CUDA device(s); this run takes tests of >= {at_least} (VERL_TEST_MIN_GPUS)"
        )
    available = _gpu_count()
    if available < needed:
        pytest.skip(f"needs {needed} CUDA device(s), {available} visible")
