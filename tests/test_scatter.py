"""A base step in a tensor-parallel group, decoded once by the worker that read each part and
scattered by owner (`lightning_delta.scatter`), with real gloo ranks (tests/scatter_job.py)."""

from __future__ import annotations

import json

import pytest

from conftest import ROOT, torchrun


@pytest.mark.parametrize("workers", [2, 3])
def test_a_base_step_is_decoded_once_per_part_and_every_failure_is_refused_by_every_worker(tmp_path, workers):
    out = tmp_path / "out"
    out.mkdir()
    torchrun(ROOT / "tests" / "scatter_job.py", str(tmp_path / "store"), str(out), nproc=workers)
    reports = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(workers)]
    for worker, report in enumerate(reports):
        # bit-exact after each base step that loads, the last one after the failures
        assert report["exact"] == [[1, True], [5, True]]
        # the damaged part (read by worker 1) refused by every worker; the failure after the
        # transfer (the last worker writing what it received) and before it (worker 0 gathering)
        # too, each as the same error everywhere, and no worker holding a step after any of them
        assert report["errors"] == [[3, "ChecksumError", None], [5, "DeltaError", None], [5, "DeltaError", None]]
        assert "SHA-256" in report["messages"][0]  # refused before any byte of it was decoded
        # each trainer rank's payloads decompressed by the worker that read its part alone (the
        # third of three workers reads none)
        assert report["decoded"] == ([worker] if worker < 2 else [])
