"""A base step in a tensor-parallel group, decoded once by the worker that read each part and
scattered by owner (`lightning_delta.scatter`), with real gloo ranks (tests/scatter_job.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from conftest import ROOT, torchrun
from lightning_delta import scatter
from lightning_delta.scatter import ScatterSettings


@pytest.mark.parametrize("workers", [2, 3])
def test_a_base_step_is_decoded_once_per_part_and_every_failure_is_refused_by_every_worker(tmp_path, workers):
    out = tmp_path / "out"
    out.mkdir()
    torchrun(ROOT / "tests" / "scatter_job.py", str(tmp_path / "store"), str(out), nproc=workers)
    reports = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(workers)]
    for worker, report in enumerate(reports):
        # bit-exact after each base step that loads, the last one after the failures
        assert report["exact"] == [[1, True], [7, True], [7, True], [7, True], [7, True]]
        # every worker refuses, with the same error and no step held after it: the part whose bytes
        # do not match its marker (read by worker 1, refused before any byte of it is decoded); the
        # part re-signed over a flipped value (decoded and sent, refused by the group's checksum);
        # the last worker failing as it writes the second piece it received and worker 0 failing as
        # it gathers its second piece (each mid-transfer: no worker waits forever for a piece, and
        # the group refuses the step); a transfer changed in an element its receiver does not
        # own (the replicated norm: caught by the transfer's CRC-32, which the group's checksum does
        # not count); worker 0 not sending what a peer expects (refused by all before any element moves, where
        # the peer waited for it forever)
        assert report["errors"] == [
            [3, "ChecksumError", None],
            [5, "ChecksumError", None],
            [7, "DeltaError", None],
            [7, "DeltaError", None],
            [7, "ChecksumError", None],
            [7, "ModelMismatchError", None],
        ]
        assert "SHA-256" in report["messages"][0]
        assert "does not reproduce the trainer's checksum" in report["messages"][1]
        assert "did not arrive as it sent them" in report["messages"][4]
        assert "worker 0 is expected to send" in report["messages"][5]
        # a piece whose failure mark was set in transit: refused by its CRC-32, which covers the mark
        # (not dropped as a failed sender's: that would be refused by the group's checksum instead, or
        # not at all for elements no checksum counts), then the base loaded again
        assert any("did not arrive as it sent them" in m for m in report["marked_log"]), report["marked_log"]
        # each trainer rank's payloads decompressed by the worker that read its part alone (the
        # third of three workers reads none)
        assert report["decoded"] == ([worker] if worker < 2 else [])
        # every piece that travelled fits the setting (a transfer is several: 4.6 KB a tensor)
        assert 0 < report["largest"] <= 1024
    # the failures were mid-transfer: at the second piece, a first one gone
    assert reports[-1]["written before failing"] == 2 and reports[0]["gathered before failing"] == 2
    # pipelined within a transfer: worker 0 sends a piece of one before it gathers that transfer's
    # last, and worker 1 writes a piece of one before it posts that transfer's last receive (before,
    # every element was gathered before any was sent, and every receive posted before any written)
    assert before(reports[0]["events"], "send", "gather") and before(reports[1]["events"], "write", "receive")
    assert sum(report.get("corrupted", 0) for report in reports) > 0  # an element its receiver does not own travelled
    # a payload's pieces are gathered and sent while the next payload decodes, on one decoding
    # thread: each piece waited for the next decode to begin (before, the next payload was
    # submitted only once the pieces of this one were sent: every piece waited in vain)
    for report in reports[:2]:
        assert report["jobs"] >= 2 and report["decodes"] == [report["jobs"]]
        assert report["overlapped"] and all(report["overlapped"]), report["overlapped"]


def before(events: list[list[Any]], first: str, last: str) -> bool:
    """Whether, in some transfer, a `first` event comes before that transfer's last `last` event."""
    for transfer in {t for what, t in events if what == last and t is not None}:
        last_at = max(i for i, event in enumerate(events) if event == [last, transfer])
        if [first, transfer] in events[:last_at]:
            return True
    return False


def test_a_piece_too_small_for_an_element_or_no_piece_in_flight_is_refused():
    with pytest.raises(ValueError, match="piece_bytes must hold an element and the trailer"):
        ScatterSettings(piece_bytes=9)
    with pytest.raises(ValueError, match="depth must be >= 1"):
        ScatterSettings(depth=0)
    assert ScatterSettings(piece_bytes=10).elements == 1


def test_a_transfer_sent_out_of_the_agreed_order_raises_before_any_piece_moves():
    """Its pieces and those skipped would be posted marked failed by `close` while no worker
    failed, and the receiver would drop them silently: a step with elements left unwritten."""
    pieces = [scatter._Piece(0, 0, 0, 1, 0, 5), scatter._Piece(1, 1, 0, 1, 0, 5)]
    sending = scatter.Scatter(pieces, [], 2, None)  # type: ignore[arg-type]  # no piece moves
    filled: list[int] = []
    with pytest.raises(ValueError, match="transfer 1 to worker 1 is not the next one agreed"):
        sending.send(1, 1, lambda start, out: filled.append(start))
    assert filled == []
