"""An on-disk cache of the built default trees, like ``__pycache__`` for the schema.

Building an engine's typed default tree with ``OmegaConf.structured`` takes ~80 ms (OmegaConf
copies every node of ~600 keys); unpickling the finished tree takes ~8 ms. The first
``load_config`` of a process would otherwise pay the build every time a launcher starts. The
cache key is a hash of this package's source files, the omegaconf and Python versions and the
engine, so a changed schema can never be served a stale tree. Anything wrong with the cache
(unwritable directory, corrupt or foreign file) falls back to building; it is never an error.

Location: ``$VERL_CONFIG_CACHE_DIR``, else ``$XDG_CACHE_HOME/verl-config``, else
``~/.cache/verl-config``; ``VERL_CONFIG_CACHE_DIR=off`` disables it.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import omegaconf

__all__ = ["cache_dir", "cached_bytes"]

_MAGIC = b"verl-config-tree-v1\n"


def cache_dir() -> Path | None:
    """The cache folder, or None when caching is off."""
    explicit = os.environ.get("VERL_CONFIG_CACHE_DIR")
    if explicit is not None:
        return None if explicit.strip().lower() in ("", "off", "0", "none") else Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "verl-config"


@functools.cache
def _source_digest() -> str:
    """Hash of every module of this package (the schema is code), omegaconf's and Python's versions."""
    digest = hashlib.sha256()
    digest.update(f"{omegaconf.__version__}|{sys.version}".encode())
    for path in sorted(Path(__file__).parent.glob("*.py")):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:32]


def cached_bytes(name: str, build: Callable[[], bytes]) -> bytes:
    """``build()``'s bytes, read from the cache when a file for this source state exists, else written there."""
    folder = cache_dir()
    if folder is None:
        return build()
    path = folder / f"{name}-{_source_digest()}.pkl"
    try:
        data = path.read_bytes()
        if data.startswith(_MAGIC):
            return data[len(_MAGIC) :]
    except OSError:
        pass
    payload = build()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{name}-")
        with os.fdopen(fd, "wb") as handle:
            handle.write(_MAGIC + payload)
        os.replace(tmp, path)  # atomic: concurrent ranks never read a half-written file
    except OSError:
        pass
    return payload
