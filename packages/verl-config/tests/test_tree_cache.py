"""The on-disk cache of built default trees: a hit equals a build, bad files and unwritable places fall back."""

from __future__ import annotations

import pickle

import pytest
from omegaconf import OmegaConf

from verl_config import tree_cache
from verl_config.compose import _build_tree


def test_off_switch_and_default_location(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("VERL_CONFIG_CACHE_DIR", "off")
    assert tree_cache.cache_dir() is None
    monkeypatch.delenv("VERL_CONFIG_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert tree_cache.cache_dir() == tmp_path / "verl-config"


def test_a_cached_tree_is_the_built_tree(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("VERL_CONFIG_CACHE_DIR", str(tmp_path))
    calls = []

    def build() -> bytes:
        calls.append(1)
        return _build_tree("megatron")

    first = tree_cache.cached_bytes("t", build)
    second = tree_cache.cached_bytes("t", build)
    assert len(calls) == 1 and first == second
    assert OmegaConf.to_container(pickle.loads(second)) == OmegaConf.to_container(
        pickle.loads(_build_tree("megatron"))
    )
    assert len(list(tmp_path.glob("t-*.pkl"))) == 1


@pytest.mark.parametrize("content", [b"", b"garbage", b"\x80\x04not ours"])
def test_a_foreign_or_corrupt_file_is_rebuilt(monkeypatch, tmp_path, content: bytes) -> None:
    monkeypatch.setenv("VERL_CONFIG_CACHE_DIR", str(tmp_path))
    tree_cache.cached_bytes("t", lambda: b"payload")
    (path,) = tmp_path.glob("t-*.pkl")
    path.write_bytes(content)
    assert tree_cache.cached_bytes("t", lambda: b"rebuilt") == b"rebuilt"
    assert tree_cache.cached_bytes("t", lambda: b"not called") == b"rebuilt"


def test_an_unwritable_location_still_builds(monkeypatch, tmp_path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    monkeypatch.setenv("VERL_CONFIG_CACHE_DIR", str(blocker / "sub"))  # a folder under a file cannot exist
    assert tree_cache.cached_bytes("t", lambda: b"built") == b"built"
