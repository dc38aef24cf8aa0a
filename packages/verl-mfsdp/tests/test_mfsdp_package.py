"""verl_mfsdp installs and imports on top of verl-mcore-utils (its only sibling dependency)."""

import importlib.metadata

import verl_mfsdp


def test_version_matches_distribution() -> None:
    assert verl_mfsdp.__version__ == importlib.metadata.version("verl-mfsdp")


def test_depends_on_mcore_utils() -> None:
    requires = importlib.metadata.requires("verl-mfsdp") or []
    assert any(r.startswith("verl-mcore-utils>=") for r in requires), requires
