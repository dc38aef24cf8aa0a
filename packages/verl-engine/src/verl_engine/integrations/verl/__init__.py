"""verl 0.9.1 drives verl-engine: our engine registered in verl's ``EngineRegistry``.

Imported by verl itself at ``import verl`` in every process, through the ``verl.plugins`` entry point this package
declares (or ``VERL_USE_EXTERNAL_MODULES=verl_engine.integrations.verl`` from a source checkout). It registers
:class:`VerlEngine` (``language_model``: actor, reference) and :class:`VerlValueEngine` (``value_model``: critic)
on backend ``megatron``, device :data:`DEVICE`. verl's own Megatron engine stays what it was (device ``cuda``);
``VERL_ENGINE_DEVICE=verl_engine`` selects ours. Why the device slot: an unknown device fails loudly if this plugin
did not load, where a vendor key would fall back to verl's engine silently. See docs/verl.md.
"""

from __future__ import annotations

from verl.workers.engine.base import EngineRegistry

from verl_engine.integrations.verl.engine import VerlEngine, VerlValueEngine, iter_registered

__all__ = ["BACKEND", "DEVICE", "VerlEngine", "VerlValueEngine", "register"]

BACKEND = "megatron"
DEVICE = "verl_engine"


def register() -> None:
    """Put both classes in verl's registry (once per process: verl asserts on a second registration)."""
    for model_type, cls in iter_registered():
        existing = EngineRegistry._engines.get(model_type, {}).get(BACKEND, {}).get(DEVICE)
        if existing is None:
            EngineRegistry.register(model_type=model_type, backend=BACKEND, device=DEVICE)(cls)
        elif existing is not cls:
            raise RuntimeError(
                f"verl's EngineRegistry already holds {existing.__qualname__} for ({model_type}, {BACKEND},"
                f" {DEVICE}); two verl-engine installations are imported"
            )


register()
