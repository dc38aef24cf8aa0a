"""Names a package loads on first use (PEP 562), shared by the workspace's package ``__init__`` files."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_attributes(
    *, module: str, lazy: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of package ``module`` whose ``lazy`` maps name -> defining module.

    A package lists its megatron-dependent names here instead of importing them, so that importing the
    package (a spawned test rank, a torch-only user) does not import megatron-core. A name, once loaded, is
    stored in the package, so later lookups skip ``__getattr__``.
    """

    def __getattr__(name: str) -> Any:
        if name not in lazy:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(lazy[name]), name)
        setattr(sys.modules[module], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted([*vars(sys.modules[module]), *lazy])

    return __getattr__, __dir__
