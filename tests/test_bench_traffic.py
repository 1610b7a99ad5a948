"""`scripts/bench_traffic.py` end to end on a small sequence: every load exact, the loader's byte
count equal to the file system's, a late joiner reading one base and the deltas after it."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from conftest import ROOT


@pytest.mark.slow
def test_bench_traffic_on_a_small_sequence(tmp_path):
    seq = tmp_path / "seq"
    make = [sys.executable, str(ROOT / "scripts/make_sequence.py"), str(seq), "--steps", "7", "--dim", "32"]
    subprocess.run([*make, "--layers", "1"], check=True, capture_output=True, timeout=300)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts/bench_traffic.py"), str(seq), "--base-every", "3"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "every load checked bit for bit" in out and "one base and the deltas after it" in out
    in_sync = int(re.search(r"in-sync follower\s+([\d,]+)", out)[1].replace(",", ""))
    base = int(re.search(r"a base is ([\d,]+)", out)[1].replace(",", ""))
    largest = int(re.search(r"largest step read ([\d,]+)", out)[1].replace(",", ""))
    assert largest < base / 2 and in_sync > 0  # bridges at 4 and 7: no base read after the first
