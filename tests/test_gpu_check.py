"""The GPU check's CPU smoke run: the script CI cannot run on a GPU still runs, and its follow and
engine checks and its 2-process replica (gloo) are bit-exact on the CPU (scripts/gpu_check.py)."""

from __future__ import annotations

import subprocess
import sys

from conftest import ROOT


def test_the_gpu_checks_smoke_run_passes_on_the_cpu():
    cmd = [sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--device", "cpu", "--scale", "0.005"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ") and "bit-exact" in line]
    assert len(rows) == 3 and all("True" in row and "False" not in row for row in rows), rows
