"""A run directory checked before any work: never overwritten by accident, never found unusable half-way.

Why: a run that silently replaced an earlier one's metrics and mixed its checkpoints with the new run's loses
work; a path under a file, or an unwritable one, used to fail only after minutes of warm start. Every rank runs
the check on the same files before any process group exists, so every rank reaches the same decision.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from verl_config import ConfigError

__all__ = ["RUN_ARTIFACTS", "prepare_run_dir"]

# what the apps write into a run directory (GRPO: all; SFT: metrics.jsonl and summary.json)
RUN_ARTIFACTS = ("metrics.jsonl", "summary.json", "grpo.png", "checkpoints", "sft")


def prepare_run_dir(
    path: str | os.PathLike[str], *, flag: str, resume: bool, overwrite: bool, can_resume: bool
) -> Path:
    """Check ``path`` (given by the command-line ``flag``) and return it; with ``overwrite`` remove the earlier run.

    Refused: a file where the directory or one of its parents must be; a directory that cannot be written; a
    directory holding a run (:data:`RUN_ARTIFACTS`) unless ``resume`` continues it or ``overwrite`` replaces it.
    Only rank 0 (``RANK``) removes files, and only the run's own artifacts, never other files.
    """
    out = Path(path).expanduser()
    if resume and overwrite:
        raise ConfigError("--resume continues the run in the directory and --overwrite replaces it: give one")
    for place in (out, *out.parents):
        if not place.exists():
            continue
        if not place.is_dir():
            raise ConfigError(f"{flag} {out}: {place} is a file, not a directory; choose another {flag}")
        if not os.access(place, os.W_OK | os.X_OK):
            raise ConfigError(f"{flag} {out}: {place} is not writable; choose another {flag}")
        break
    found = [name for name in RUN_ARTIFACTS if (out / name).exists()]
    if found and not (resume or overwrite):
        keep = "continue it with --resume, " if can_resume else ""
        raise ConfigError(
            f"{flag} {out} already holds a run ({', '.join(found)}): {keep}replace it with --overwrite, or choose"
            f" another {flag}"
        )
    if overwrite and found and os.environ.get("RANK", "0") == "0":
        for name in found:
            target = out / name
            shutil.rmtree(target) if target.is_dir() else target.unlink()
    return out
