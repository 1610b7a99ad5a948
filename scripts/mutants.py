"""The critical mutants: each guarantee's line broken on purpose, one at a time, in a copy of src/;
the fast tests named for it must fail.  A mutant that survives is a guarantee no test pins.

    .venv/bin/python scripts/mutants.py              # every mutant; exit 1 if any survives
    .venv/bin/python scripts/mutants.py --list       # what each one breaks
    .venv/bin/python scripts/mutants.py value-checksum engine-undo
    .venv/bin/python scripts/mutants.py --multi-process  # a replica's, by two-process tests (not CI)

The real tree is never edited: each mutant is applied to a fresh copy of src/ and its tests run
with `PYTHONPATH=<copy>/src`.  Each names the exact source text it replaces (which must occur
exactly once, so an edit of the source that moves the guarantee breaks this script, not silently
the check), and as few tests as catch it: CI runs them all on every change (.ci/run).  The tests
are assumed to pass on the real tree (CI runs them first); the full mutation run with a tool is
in docs/RELIABILITY.md.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutant:
    name: str
    guarantee: str
    file: str  # under src/lightning_delta
    line: str  # the exact source text, found exactly once
    mutation: str  # what replaces it
    tests: tuple[str, ...]  # pytest node ids or files, each followed by its `-k` if any ("file::-k expr")


MUTANTS = (
    Mutant(
        "value-checksum",
        "a part whose values do not reproduce the trainer's checksum is refused (loader, follower, apply_to)",
        "patch.py",
        "            if value != entry.checksum:\n",
        "            if False:\n",
        (
            "tests/test_chain.py::-k only_its_checksum",
            "tests/test_follow.py::-k corrupt_step",
        ),
    ),
    Mutant(
        "engine-prepare-checksum",
        "the engine checks a step's changes (walked on the CPU or decoded by torch) before it writes",
        "prepare.py",
        "    for (rank, index, part_step, want), got in zip(expected, sums, strict=True):\n        if got != want:\n",
        "    for (rank, index, part_step, want), got in zip(expected, sums, strict=True):\n        if False:\n",
        ("tests/test_engine.py::-k only_its_checksum and prepare",),
    ),
    Mutant(
        "engine-walk-checksum",
        "a walk's checksum (CPU or device): a step walked in unchecked is checked as it is written",
        "apply.py",
        "            if got != payload.moved:\n",
        "            if False:\n",
        ("tests/test_engine.py::-k only_its_checksum and update and walk",),
    ),
    Mutant(
        "engine-composed-checksum",
        "a chain composed on a whole payload (a re-sync from a base) is checked by the trainer's checksum",
        "torch_path.py",
        "                    if partials is not None and moved != entry.checksum:\n",
        "                    if False:\n",
        ("tests/test_engine.py::-k only_its_checksum and update and torch",),
    ),
    Mutant(
        "engine-undo",
        "a walk that fails takes back everything it wrote: the engine holds the step it held",
        "apply.py",
        "            walk.undo()\n",
        "            pass\n",
        ("tests/test_engine.py::-k only_its_checksum and update and walk",),
    ),
    Mutant(
        "device-undo",
        "the device walk's undo subtracts what its write added: the engine holds the step it held",
        "device_walk.py",
        "            self._decode(check=False, sign=-1)\n",
        "            pass\n",
        ("tests/test_apply.py::-k kernels_trusted",),  # the proof taken as passed: the undo alone
    ),
    Mutant(
        "device-proof",
        "device kernels that write other values than torch's decoder fail their proof: the follower writes with torch",
        "device_walk.py",
        "    if not all(torch.equal(p.cpu(), e) for p, e in zip(params, after, strict=True)):\n",
        "    if False:\n",
        ("tests/test_apply.py::-k fail_their_proof",),
    ),
    Mutant(
        "engine-whole-checksum",
        "a base step walked whole is checked against the trainer's checksums: a wrong value leaves no step held",
        "whole_write.py",
        "            if got != want:\n",
        "            if False:\n",
        ("tests/test_engine.py::-k forged_value_in_a_base_step",),
    ),
    Mutant(
        "blob-sha256",
        "a blob that does not match its commit marker's SHA-256 is refused as such",
        "format.py",
        "    if hashlib.sha256(blob).hexdigest() != marker.sha256:\n",
        "    if False:\n",
        ("tests/test_follow.py::-k corrupt_step",),
    ),
    Mutant(
        "chain-link",
        "a chain's parts follow each other by their markers' links",
        "reader.py",
        "            if newer.header.prev_step != older.header.step:\n",
        "            if False:\n",
        ("tests/test_reliability.py::-k links_do_not_meet",),
    ),
    Mutant(
        "format-header-bound",
        "a part's header and payload count are bounded before anything is allocated",
        "format.py",
        "    if size > MAX_HEADER_BYTES or count > MAX_PAYLOADS:\n",
        "    if False:\n",
        ("tests/test_format.py::test_foreign_and_truncated_objects",),
    ),
    Mutant(
        "retention-order",
        "retention deletes steps newest first, markers first: a gc killed at any moment strands no reader",
        "retention.py",
        "    for step in reversed(steps):\n",
        "    for step in steps:\n",
        ("tests/test_reliability.py::-k killed_at_any_moment",),
    ),
    Mutant(
        "replica-decision",
        "a replica's workers all take group rank 0's decisions, though their listings differ",
        "follow.py",
        "                behind = source.decide(newer_count)[0]\n",
        "                behind = source.decide(newer_count)[-1]\n",
        ("tests/test_follow.py::-k rank_0s_decisions",),
    ),
    Mutant(
        "replica-newest",
        "a replica's workers all load group rank 0's newest step",
        "loader.py",
        "        newest = self.decide(newest)[0]  # every worker of a replica takes group rank 0's newest\n",
        "        newest = self.decide(newest)[-1]\n",
        ("tests/test_follow.py::-k rank_0s_newest",),
    ),
    Mutant(
        "replica-held-agreed",
        "workers that hold different steps decode the step from its base, not each against its own state",
        "loader.py",
        "            if len(set(exchange_bytes(mine, self.group, self._group_device))) > 1:\n",
        "            if exchange_bytes(mine, self.group, self._group_device) and False:\n",
        ("tests/test_follow.py::-k different_steps",),
    ),
    Mutant(
        "part-signature",
        "with trusted keys, a commit marker must be signed by the run's signer over its run, step, rank, kind and blob",
        "signing.py",
        "        if not PublicKey(run.manifest.signer).verify(marker.signature, message):\n",
        "        if False:\n",
        ("tests/test_signing.py::-k each_bound_field",),
    ),
    Mutant(
        "mirror-blob-check",
        "a mirror never copies a source blob that does not match its commit marker",
        "mirror.py",
        "                    fmt.verify_blob(blob, marker)\n",
        "                    pass\n",
        ("tests/test_mirror.py::-k damaged",),
    ),
)


COLLECTIVES = "tests/test_distributed.py::-k rank_that_fails_in_any_collective"
REPLICA = "tests/test_distributed.py::-k replica"

MULTI_PROCESS = (
    Mutant(
        "exchange-failure-seen",
        "a rank that failed before a collective makes every rank raise, none goes on with its result",
        "replica.py",
        "        if status != _OK and failure is None:\n",
        "        if False:\n",
        (COLLECTIVES,),
    ),
    Mutant(
        "exchange-first-failure",
        "with several failing ranks, every rank raises the first failing rank's error, a later failing one too",
        "replica.py",
        "        if status != _OK and failure is None:\n",
        "        if status != _OK:\n",
        ("tests/test_replica.py",),
    ),
    Mutant(
        "exchange-own-type",
        "the failing rank raises its own DeltaError, the type the others raise",
        "replica.py",
        "                raise mine\n",
        "                raise DeltaError(str(mine)) from mine\n",
        (COLLECTIVES,),
    ),
    Mutant(
        "exchange-foreign-wrapped",
        "an error that is not a DeltaError is a DeltaError on the failing rank too: one decision, one type",
        "replica.py",
        '                raise DeltaError(f"worker {me} of the group: {type(mine).__name__}: {mine}") from mine\n',
        "                raise mine\n",
        (COLLECTIVES,),
    ),
    Mutant(
        "exchange-error-type",
        "the others raise the failing rank's DeltaError subclass",
        "replica.py",
        "        raise errors.by_name(kind)(message) from cause\n",
        "        raise DeltaError(message) from cause\n",
        (COLLECTIVES,),
    ),
    Mutant(
        "exchange-rest-of-sizes",
        "more items than the head holds sizes for: the rest of the sizes follow in a second broadcast",
        "replica.py",
        "        if values[1] + 2 > _HEAD:  # more sizes than the head holds: the rest follow\n",
        "        if False:\n",
        (COLLECTIVES,),
    ),
    Mutant(
        "exchange-inline-bound",
        "items travel in the head only where they fit after the status, count and sizes",
        "replica.py",
        "    return 2 + len(sizes) + _aligned(sizes)[-1] // 8 <= _HEAD\n",
        "    return 1 + len(sizes) + _aligned(sizes)[-1] // 8 <= _HEAD\n",
        (COLLECTIVES,),
    ),
    Mutant(
        "exchange-alignment",
        "items start 8-byte aligned, so a receiver views int64 positions without a copy",
        "replica.py",
        "        starts.append(starts[-1] + (n + 7) // 8 * 8)\n",
        "        starts.append(starts[-1] + n)\n",
        (REPLICA, COLLECTIVES),
    ),
    Mutant(
        "replica-patch-verified",
        "each worker checks the patches the others send against its own held state before anyone writes",
        "loader.py",
        "                    patches.verify_against(run, rank, got, held[rank] if held else None, sink)\n",
        "                    pass\n",
        (REPLICA,),
    ),
    Mutant(
        "replica-refusal-shared",
        "a worker that refused another's patch makes every worker refuse the step: none writes",
        "loader.py",
        "        exchange_bytes(status, self.group, self._group_device)  # raises on every worker if any refused\n",
        '        exchange_bytes(b"", self.group, self._group_device)\n',
        (REPLICA,),
    ),
)
"""Mutants of a replica's collectives and decisions (replica.py, and the loader's exchange), which
run only in torchrun ranks, where a mutation tool's per-process tracing cannot see them; killed by
the two-process tests (a few minutes each), so not run by CI: `scripts/mutants.py --multi-process`."""


def pytest_args(spec: str) -> list[str]:
    path, _, select = spec.partition("::-k ")
    return [path, "-k", select] if select else [path]


def run(mutant: Mutant, scratch: Path, slots: queue.Queue[Path]) -> tuple[bool, float]:
    """Whether the mutant's tests failed on it (killed), and the seconds they took."""
    slot = slots.get()  # a copy's folder: each mutant runs in one of a few, never in another's at once
    try:
        return _run_in(mutant, slot, scratch / "numba")
    finally:
        slots.put(slot)


def _run_in(mutant: Mutant, copy: Path, numba_cache: Path) -> tuple[bool, float]:
    # Numba's cache of the walks is keyed by their source files' folder: in a copy at a new path
    # each mutant's tests compiled them again (~43 s of one mutant's 56 at load 10). A copy made
    # where the last one was, with the source files' times kept (copytree), finds the cache its
    # predecessor left in `numba_cache`; a mutated walk's file has a new time, so it compiles.
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(ROOT / "src", copy / "src", ignore=shutil.ignore_patterns("__pycache__"))
    source = copy / "src" / "lightning_delta" / mutant.file
    text = source.read_text()
    if text.count(mutant.line) != 1:
        raise SystemExit(f"{mutant.name}: its line occurs {text.count(mutant.line)} times in {mutant.file}: update it")
    source.write_text(text.replace(mutant.line, mutant.mutation))
    env = {**os.environ, "PYTHONPATH": str(copy / "src"), "NUMBA_CACHE_DIR": str(numba_cache)}
    started, killed = time.monotonic(), False
    for spec in mutant.tests:  # stop at the first that fails
        cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider"]
        done = subprocess.run(cmd + pytest_args(spec), cwd=ROOT, env=env, capture_output=True, text=True)
        if done.returncode == 1:  # tests failed; anything else (no tests, a collection error) is not a kill
            killed = True
            break
        if done.returncode != 0:
            raise SystemExit(f"{mutant.name}: pytest {spec} exited {done.returncode}:\n{done.stdout[-3000:]}")
    shutil.rmtree(copy)
    return killed, time.monotonic() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", help="mutants to run (default: all)")
    parser.add_argument("--list", action="store_true", help="print each mutant and exit")
    parser.add_argument(
        "--multi-process", action="store_true", help="the replica's mutants instead, killed by two-process tests"
    )
    args = parser.parse_args()
    mutants = MULTI_PROCESS if args.multi_process else MUTANTS
    unknown = set(args.names) - {m.name for m in mutants}
    if unknown:
        parser.error(f"unknown mutants: {', '.join(sorted(unknown))}")
    chosen = [m for m in mutants if not args.names or m.name in args.names]
    if args.list:
        for m in chosen:
            print(f"{m.name}: {m.guarantee}\n  {m.file}: {m.line.strip()!r} -> {m.mutation.strip()!r}\n  {m.tests}")
        return
    survivors = []
    # Two at a time: each is one pytest process at a time, and beside other work (CI's two CPU hogs)
    # two of them get a whole core where one gets two thirds of one.
    with tempfile.TemporaryDirectory(prefix="mutants-") as scratch, concurrent.futures.ThreadPoolExecutor(2) as pool:
        slots: queue.Queue[Path] = queue.Queue()
        for i in range(2):
            slots.put(Path(scratch) / f"copy-{i}")
        for m, (killed, seconds) in zip(chosen, pool.map(lambda m: run(m, Path(scratch), slots), chosen), strict=True):
            print(f"{'killed  ' if killed else 'SURVIVED'} {m.name} ({seconds:.0f} s): {m.guarantee}", flush=True)
            if not killed:
                survivors.append(m.name)
    if survivors:
        raise SystemExit(f"{len(survivors)} critical mutants survived: {', '.join(survivors)}")
    print(f"all {len(chosen)} critical mutants killed")


if __name__ == "__main__":
    main()
