"""The code structure the project holds itself to (scripts/structure_report.py --check): imports only down the
package layering (verl_config <- verl_mcore_utils <- verl_dyncp, verl_mfsdp <- verl_engine <- verl_engine.apps), no
import circles, no source file over 500 lines, no function over 80."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_structure_report_check_passes() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "structure_report.py"), "--root", str(ROOT), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
