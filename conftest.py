"""Shared pytest setup for every package's tests and the cross-package tests.

Markers (registered in pyproject.toml):
* ``gpu``: needs CUDA. Skipped cleanly where no GPU is visible.
* ``num_gpus(n)``: needs at least n GPUs; implies ``gpu`` so ``pytest -m gpu`` selects it.
* ``slow``: takes more than a few seconds.

``VERL_TEST_GPUS=n`` keeps only the GPU tests that need exactly n GPUs (the others are deselected): the GPU suite
(``scripts/gpu_suite.py``) runs each chunk of tests on as many GPUs as its tests need, several chunks at once.
``VERL_TEST_GPU_INVENTORY=path`` writes, at collection, the GPU counts each test file's GPU tests need (JSON).
"""

from __future__ import annotations

import json
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


def _gpus_needed(item: pytest.Item) -> int:
    marker = item.get_closest_marker("num_gpus")
    if marker is None:
        return 1
    return int(marker.args[0]) if marker.args else int(marker.kwargs["n"])


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    inventory = os.environ.get("VERL_TEST_GPU_INVENTORY")
    if inventory:  # scripts/gpu_suite.py check: which GPU counts each test file's tests need
        needs: dict[str, set[int]] = {}
        for item in items:
            if item.get_closest_marker("gpu") is not None:
                needs.setdefault(item.nodeid.split("::")[0], set()).add(_gpus_needed(item))
        with open(inventory, "w") as f:
            json.dump({path: sorted(counts) for path, counts in needs.items()}, f)
    exact = os.environ.get("VERL_TEST_GPUS")
    if not exact:
        return
    if not exact.isdigit() or int(exact) < 1:
        raise pytest.UsageError(f"VERL_TEST_GPUS must be a GPU count >= 1, got {exact!r}")
    keep, drop = [], []
    for item in items:
        wanted = item.get_closest_marker("gpu") is not None and _gpus_needed(item) == int(exact)
        (keep if wanted else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("gpu") is None:
        return
    needed = _gpus_needed(item)
    available = _gpu_count()
    if available < needed:
        pytest.skip(f"needs {needed} CUDA device(s), {available} visible")
