"""verl_dyncp installs and imports on top of verl-mcore-utils (its only sibling dependency)."""

import importlib.metadata

import verl_dyncp


def test_version_matches_distribution() -> None:
    assert verl_dyncp.__version__ == importlib.metadata.version("verl-dyncp")


def test_depends_on_mcore_utils() -> None:
    requires = importlib.metadata.requires("verl-dyncp") or []
    assert any(r.startswith("verl-mcore-utils>=") for r in requires), requires
