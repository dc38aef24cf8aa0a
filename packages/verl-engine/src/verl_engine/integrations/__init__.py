"""Adapters that let a trainer drive :class:`~verl_engine.engine.RLEngine` through the trainer's own engine API.

Each adapter lives in its own subpackage and imports its trainer only there, so ``import verl_engine`` never needs
a trainer installed. ``verl``: verl 0.9.x's ``BaseEngine`` (extra ``verl-engine[verl]``), see docs/verl.md.
"""
