"""The keys verl's own yaml declares (its generated trainer configs, both engines), shipped with the package.

Why: Hydra, verl's launcher, treats ``+key=value`` by whether ``key`` is in verl's yaml. Several keys are fields
of verl's config dataclasses or read with ``.get()`` but absent from its yaml (``rollout.moe_tensor_parallel_size``,
``model.lora.fully_sharded_loras``, ``algorithm.filter_groups.*`` ...): verl's scripts add them with '+'. This
schema declares them, so the loader needs to know which keys verl's yaml has to apply Hydra's rule exactly.
``scripts/refresh_verl_reference.py`` writes the file from the release's yaml; a test keeps it equal to the
stored reference.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

__all__ = ["VERL_YAML_KEYS_FILE", "flatten_yaml_keys", "verl_yaml_declares"]

VERL_YAML_KEYS_FILE = Path(__file__).parent / "config" / "verl_yaml_keys.json"


def flatten_yaml_keys(texts: Iterable[str]) -> list[str]:
    """Every dotted key (sections included) of the yaml documents ``texts``, sorted, without duplicates."""
    keys: set[str] = set()

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict):
            for name, child in node.items():
                key = f"{prefix}.{name}" if prefix else str(name)
                keys.add(key)
                walk(child, key)

    for text in texts:
        walk(yaml.safe_load(text), "")
    return sorted(keys)


@functools.cache
def _keys() -> frozenset[str]:
    return frozenset(json.loads(VERL_YAML_KEYS_FILE.read_text())["keys"])


def verl_yaml_declares(key: str) -> bool:
    """Whether verl's yaml (either engine's) has ``key``."""
    return key in _keys()
