"""What ``verl-engine train`` prints on stderr: our warnings and errors, no third-party start-up notices."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

# Lines that third-party libraries print while they are imported or a model is built (any release).
_THIRD_PARTY = re.compile(
    r"megatron[/\\.]|GPTModel IS DEPRECATED|torch[/\\]|No CUDA runtime|transformers|apex|Apex"
)


def test_train_stderr_has_only_our_warnings(tmp_path: Path) -> None:
    """A fresh bytecode cache, as on a new machine: Python compiles megatron-core's sources again, which is
    when its SyntaxWarnings come. The override below is unused on CPU and warns from verl-mcore-utils:
    that warning must still show."""
    env = {**os.environ, "PYTHONPYCACHEPREFIX": str(tmp_path / "pycache")}
    env.pop("PYTHONWARNINGS", None)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "verl_engine",
            "train",
            "--steps=1",
            "--device=cpu",
            "--preset=tiny",
            f"--output-dir={tmp_path / 'run'}",
            "megatron.override_ddp_config.bucket_size=40000000",
            "optim.lr_warmup_steps=0",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "train: 100%" in result.stdout  # the progress bar ran
    lines = result.stderr.splitlines()
    ours = [
        i
        for i, line in enumerate(lines)
        if "UserWarning: override_ddp_config ['bucket_size'] is not used" in line
    ]
    assert len(ours) == 1, result.stderr
    assert "verl_mcore_utils" in lines[ours[0]]
    # the warning and the source line Python prints under it; nothing else
    others = [line for i, line in enumerate(lines) if i not in (ours[0], ours[0] + 1)]
    assert others == [], result.stderr
    assert not _THIRD_PARTY.search(result.stderr), result.stderr
