"""Test-only: run verl 0.9.1's TrainingWorker on a CPU host (gloo), for the verl backend tests.

verl 0.9.1 assumes an accelerator in a few places. Each patch below is named, says which verl code needs it, and is
installed only by the test workers (never by verl-engine itself); docs/verl.md lists them.

1. ``cpu`` platform (``PlatformRegistry.register("cpu")`` + ``VERL_PLATFORM=cpu``): verl's platform probe falls
   back to ``nvidia`` on a host without GPUs (``verl/plugin/platform/platform_manager.py``), so
   ``get_device_name()`` would be ``"cuda"``: ``TrainingWorker._postprocess_output`` builds
   ``torch.tensor(loss, device="cuda")`` and reads ``max_memory_allocated`` of the device module, and the FLOPs
   counter asks the device module for the device's name. The CPU platform answers ``"cpu"``, a device module with
   zero memory statistics and an unknown device name (FLOPs counter: promised FLOPs = inf, MFU 0), and ``gloo``.
2. Process group: ``initialize_global_process_group_ray`` would create ``cpu:gloo,cuda:nccl``; it does nothing
   when a group exists, so the test's gloo group (verl_mcore_utils.testing.run_distributed) is used.
3. Worker environment: ``Worker.__init__`` reads ``RANK`` / ``WORLD_SIZE`` / ``MASTER_ADDR`` / ``MASTER_PORT``
   that Ray would set; :func:`install` sets them from the existing process group.
"""

from __future__ import annotations

import os
import types
from contextlib import nullcontext
from typing import Any

import torch


def _cpu_device_module() -> types.ModuleType:
    """torch.cpu with what verl calls on a device module and torch.cpu lacks."""
    module = types.ModuleType("verl_test_cpu_device")
    for name in dir(torch.cpu):
        if not name.startswith("__"):
            setattr(module, name, getattr(torch.cpu, name))
    module.max_memory_allocated = lambda *a, **k: 0
    module.max_memory_reserved = lambda *a, **k: 0
    module.memory_allocated = lambda *a, **k: 0
    module.memory_reserved = lambda *a, **k: 0
    module.reset_peak_memory_stats = lambda *a, **k: None
    module.empty_cache = lambda: None
    module.get_device_name = lambda *a, **k: "CPU"  # unknown to verl's FLOPs table
    module.manual_seed = torch.manual_seed
    module.manual_seed_all = torch.manual_seed
    module.is_available = lambda: True
    return module


def install() -> None:
    """Register the ``cpu`` platform, select it, and set the worker environment (call in every rank)."""
    import torch.distributed as dist
    from verl.plugin.platform import platform_manager
    from verl.plugin.platform.platform_base import PlatformBase

    cpu_module = _cpu_device_module()

    class PlatformCPU(PlatformBase):
        device_name = "cpu"
        vendor_name = "cpu"
        device_module = cpu_module

        def is_available(self) -> bool:
            return True

        def current_device(self) -> int:
            return 0

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index: int) -> None:
            pass

        def synchronize(self, device_index: int | None = None) -> None:
            pass

        def manual_seed(self, seed: int) -> None:
            torch.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings: str) -> None:
            pass

        def empty_cache(self) -> None:
            pass

        def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
            return None, None

        def communication_backend_name(self) -> str:
            return "gloo"

        def visible_devices_envvar(self) -> str:
            return "CUDA_VISIBLE_DEVICES"

        def nvtx_range(self, msg: str) -> Any:
            return nullcontext()

        def profiler_start(self) -> None:
            pass

        def profiler_stop(self) -> None:
            pass

        def ray_resource_name(self) -> str:
            return "CPU"

        def ray_noset_envvars(self) -> list[str]:
            return []

        def is_ipc_supported(self) -> bool:
            return False

        def cudart(self) -> Any:
            return None

    platform_manager.PlatformRegistry.register("cpu")(PlatformCPU)
    os.environ["VERL_PLATFORM"] = "cpu"
    platform_manager._current_platform = None  # a platform cached before this patch is re-detected
    os.environ.update(
        RANK=str(dist.get_rank()),
        WORLD_SIZE=str(dist.get_world_size()),
        LOCAL_RANK="0",
        LOCAL_WORLD_SIZE="1",
        MASTER_ADDR=os.environ.get("MASTER_ADDR", "127.0.0.1"),
        MASTER_PORT=os.environ.get("MASTER_PORT", "29500"),
    )
