"""`replica.exchange` across three gloo processes: which error each rank raises when several fail.
(Two-rank runs of every collective, with one failing rank, are in tests/test_distributed.py.)"""

from __future__ import annotations

import json

import pytest

from conftest import ROOT, torchrun

pytestmark = pytest.mark.slow


def test_every_rank_raises_the_first_failing_ranks_error(tmp_path):
    torchrun(ROOT / "tests" / "exchange_job.py", str(tmp_path), nproc=3, timeout=120)
    reports = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(3)]
    unreachable = ["StoreError", "the endpoint is unreachable"]
    truncated = ["FormatError", "part is truncated"]
    assert [r["first"] for r in reports] == [
        ["StoreError", "worker 1 of the group: the endpoint is unreachable"],
        unreachable,  # the first failing rank raises its own error
        ["StoreError", "worker 1 of the group: the endpoint is unreachable"],  # a later one too: one branch
    ]
    assert [r["zero"] for r in reports] == [
        truncated,
        ["FormatError", "worker 0 of the group: part is truncated"],
        ["FormatError", "worker 0 of the group: part is truncated"],
    ]
    assert [r["then"] for r in reports] == [["ok", ""]] * 3
