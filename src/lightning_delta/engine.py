"""Following a chain into a live engine's parameters, at the cost of the change.

The engine's parameters are the held state, read and written through a `ViewMap`; the tensors the
map refuses are kept as copies here and handed to the engine's own `reload` whenever one of them
changes.  A tensor-parallel worker holds only slices, so a step is decoded into what it does
(`torch_path`: changed positions and 16-bit steps, a chunk at a time), verified by the checksums'
partial sums over the changes each worker owns, summed over the group before anything is
written, and then every worker writes `old + step` at the positions it holds.  SPARSE payloads
from the state held are instead walked (`apply`: `sparse_walk` on the CPU, `device_walk`'s Triton
kernels on a GPU), one step after another for a follower that is late: decoded, checked and
written in one pass over the engine's memory, not two, their partial sums summed over the group
once every payload is walked, and every walk taken back exactly, in reverse (steps add mod
2**16), if any worker's check fails, so a failed update still leaves nothing written.  The
workers share one download: each fetches the parts of a share of the trainer ranks, checks them
against their markers, and sends the others the blobs, or the error it met, which every worker
then raises: each blob is hashed once in the group, by the worker that read it, and a base step's
RAW payloads are decompressed once too, by that worker, which sends each of the others only the
elements it holds (`scatter`).

Framework-free: an engine adapter (`vllm_backend`) gives the loader call, the parameters, the
reload and the group.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from . import apply as walks
from . import codec, plan, scatter, sparse_walk, whole_walk
from . import format as fmt
from . import group as decisions
from .apply import ApplyBackend
from .errors import ChainError, ChecksumError, DeltaError, ModelMismatchError, SnapshotNotFoundError, StoreError
from .loader import FullCheck
from .patch import LoadReport, RankState, views
from .reader import ChainReader
from .replica import exchange, exchange_bytes
from .store import Store
from .torch_path import Agreed, PayloadPatch, TorchPath, flat_bits
from .viewmap import ViewMap

__all__ = ["EngineFollower", "EngineStep", "PrefetchTimeoutError"]

log = logging.getLogger(__name__)

_MASK64 = (1 << 64) - 1
_STOP, _NONE = -1, -2  # a prefetcher's decisions besides a step number


class PrefetchTimeoutError(DeltaError, TimeoutError):
    """The background prefetcher did not stop in time: the follower waits for it before it uses
    the group again."""


class _HeldDiffers(ChainError):
    """The workers of a group hold different steps (every one of them raises it): each fetches
    the step again from its base."""


@dataclass
class EngineStep:
    """A verified step, not yet written: its parts, still compressed (a few bytes a change), which
    `write` decodes again one payload at a time, so that no decoded step is held beside the engine.
    (`update` leaves the payloads `write` walks unverified: the walk checks them as it writes.)"""

    step: int
    states: list[RankState]  # per trainer rank, once written
    chains: list[tuple[fmt.Part, ...]]  # per trainer rank, oldest first, from `held`
    held: list[RankState] | None  # what the chains apply to (None: every chain starts at a base)
    report: LoadReport
    generation: int
    walked: frozenset[tuple[int, int]]  # (trainer rank, payload) that `write` walks in place
    whole: frozenset[tuple[int, int]] = frozenset()
    """(trainer rank, payload) of a base step that `write` walks whole (`whole_walk`): decoded,
    written and checked in one pass, by the workers that hold any of it."""


class EngineFollower:
    """One worker's follower of a chain into an engine.

    Args:
        store: the chain.
        view_map: where this worker's parameters hold each checkpoint tensor (`ViewMap.learn`).
        params: the engine's parameters by name (called at each write: an engine may re-register them).
        reload: hands the engine every tensor the map refused, as full checkpoint tensors, after
            one of them changed (the engine's own reload, which may prepack or quantize them).
        group: the engine's tensor-parallel workers (a gloo group), or None for one worker.
        device: where steps are decoded.
        full_check: when the engine's weights are rehashed in full before a step is written (each
            worker the elements it owns, summed over the group); `verify` does it on demand.
        stop_seconds: how long stopping the prefetcher waits for it (it may be fetching a step, or
            waiting in a collective for a worker that is gone) before `PrefetchTimeoutError`.
        apply: what writes the SPARSE payloads of a step in sync (`apply.ApplyBackend`; None: the
            CPU walk on the CPU, the device walk on a GPU, where they can run, else torch).  The
            device walk's kernels first prove themselves on the device: where they fail, on this
            worker or another of the group, the follower writes with torch for its life
            (`walks_with` says which writes), or raises `DeviceError` where the failure broke the
            device's CUDA context.

    Whatever any worker raises (a store error, an out-of-memory, a bug), every worker of the group
    reaches the same decision: the failing worker's error, as a `DeltaError` naming it, on all.
    """

    def __init__(
        self,
        store: Store,
        view_map: ViewMap,
        params: Callable[[], Mapping[str, Tensor]],
        reload: Callable[[Mapping[str, Tensor]], None] | None,
        *,
        group: dist.ProcessGroup | None = None,
        device: torch.device | None = None,
        full_check: FullCheck = FullCheck.BASE_STEPS,
        stop_seconds: float = 600.0,
        apply: ApplyBackend | None = None,
    ) -> None:
        self.store, self.map, self._params, self._reload = store, view_map, params, reload
        self.group, self.device, self.full_check = group, device or torch.device("cpu"), full_check
        self.rank = dist.get_rank(group) if group is not None else 0
        self.size = dist.get_world_size(group) if group is not None else 1
        self._reader = ChainReader(store)
        self._walker: walks.Walker | None = None
        mine: dict[str, list[list[list[int]]]] | Exception
        try:  # a worker that fails here still joins the group's first collective, with its error
            # (the kernels' proof runs on this worker's device alone: a DeviceError is this worker's)
            self._walker = walks.walker(apply, self.device)
            run = store.run()
            self.run = run
            self._names = [t.name for t in run.manifest.tensors]
            self._views = [views(run, rank) for rank in range(run.world_size)]
            self._shapes = [t.shape for t in run.manifest.tensors]
            specs = {t.name: (t.shape, fmt.DType(t.dtype).torch) for t in run.manifest.tensors}
            mine = view_map.describe()
        except Exception as err:
            mine = err
        described = self._gather_json(mine)
        self._owned = view_map.settle(described, self.rank, specs)  # refuses what the group cannot map
        self._kept: dict[int, Tensor] = {}  # refused tensors: full int16 copies, filled by the first write
        self._torch = TorchPath(
            store.url, run, self._views, view_map, self._owned, self._kept, self.rank, self.group, self.device
        )
        self._segments = plan.segment_tables(
            self._views, self._names, self._shapes, view_map, self._owned, self.rank, self._walker, self.group
        )
        if self._segments and self.device.type == "cpu":
            sparse_walk.compile()  # seconds, once per machine (numba caches it): not in the first update
            whole_walk.compile()
        self._peers = {}  # every worker's tables, for the base steps it decodes for the others
        if self.group is not None and self.device.type == "cpu":
            self._peers = scatter.peer_tables(self._segments, self.group)
        self._held: list[RankState] | None = None
        self._generation = 0
        self._prefetch: tuple[threading.Thread, threading.Event, list[Any]] | None = None
        self._ready: EngineStep | None = None  # what a stopped prefetcher prepared
        self.stop_seconds = stop_seconds

    # ------------------------------------------------------------------ facts

    def paths(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """((tensors, bytes) written in place, (tensors, bytes) through the engine's reload)."""
        sizes = {t.name: 2 * t.numel for t in self.run.manifest.tensors}
        mapped = [n for n in self._names if n in self.map.boxes]
        refused = [n for n in self._names if n not in self.map.boxes]
        return (len(mapped), sum(sizes[n] for n in mapped)), (len(refused), sum(sizes[n] for n in refused))

    @property
    def walks_with(self) -> ApplyBackend:
        """What writes this worker's SPARSE payloads in sync: `ApplyBackend.TORCH` too where the
        device walk's kernels failed their proof (`apply.walker`) on this worker or on another of
        the group (which then walks nothing: `plan.segment_tables`)."""
        return walks.backend_of(self._walker) if self._segments else ApplyBackend.TORCH

    @property
    def held_step(self) -> int | None:
        return self._held[0].header.step if self._held else None

    # ------------------------------------------------------------------ prepare

    def newest(self) -> int:
        """The newest complete step (group rank 0's, on every worker)."""
        outcome: int | BaseException
        try:
            steps = self._reader.steps()
            outcome = steps[-1] if steps else -1
        except Exception as err:
            outcome = err
        newest = self._decide(outcome)[0]
        if newest < 0:
            raise SnapshotNotFoundError(f"no complete step in {self.store.url}")
        return newest

    def prepare(self, step: int) -> EngineStep:
        """Fetch, decode and verify `step` against what the engine holds, writing nothing (of the
        steps a late follower walks in turn, the first; `write` checks each as it walks it in)."""
        return self._prepare_step(step, verify=True)

    def _prepare_step(self, step: int, verify: bool) -> EngineStep:
        """`prepare`; without `verify`, the payloads `write` walks are left for it to check."""
        started, read_before = time.perf_counter(), self.store.bytes_read
        held, generation = self._held, self._generation
        try:
            states, chains, walked, whole, changed, fetched, share = self._prepare(step, held, verify)
        except DeltaError as err:
            if isinstance(err, StoreError) or (held is None and not isinstance(err, _HeldDiffers)):
                raise
            log.warning("step %d does not rebuild from the step held (%s); trying from its base", step, err)
            held = None
            states, chains, walked, whole, changed, fetched, share = self._prepare(step, None, verify)
        report = LoadReport(
            step=step,
            kind=states[0].header.kind,
            parts_read=fetched,
            bytes_read=self.store.bytes_read - read_before,
            tensors=len(self._names),
            changed=changed,
            seconds=time.perf_counter() - started,
            share_seconds=share,
            probe=states[0].probe,
        )
        return EngineStep(step, states, chains, held, report, generation, walked, whole)

    def _prepare(
        self, step: int, held: list[RankState] | None, verify: bool
    ) -> tuple[
        list[RankState],
        list[tuple[fmt.Part, ...]],
        frozenset[tuple[int, int]],
        frozenset[tuple[int, int]],
        int,
        int,
        float,
    ]:
        """Every rank's verified chain and state at `step`, the payloads `write` walks in place and
        whole, the elements to write, the parts this worker fetched, and the seconds of its fetch.
        The payloads `write` walks are checked here only with `verify`, and of several steps only
        the first (each is checked again as it is written)."""
        started = time.perf_counter()
        chains, fetched, base_step, scattered = self._fetch(step, held, thin=not verify)
        share = time.perf_counter() - started
        cadence = self.full_check
        if held is not None and (cadence == FullCheck.EVERY_STEP or (cadence == FullCheck.BASE_STEPS and base_step)):
            self._check(held)  # a failure re-syncs from a base, which writes every element
        states: list[RankState] = []
        partials: list[int] = []
        expected: list[tuple[int, int, int, int]] = []
        outcome: Exception | None = None
        changed, params, local, walked, whole = 0, self._params(), False, set(), set()
        checked: list[walks.Payload] = []  # the walked payloads to check, all at once
        try:
            for rank, parts in enumerate(chains):
                first = parts[0].header if parts else None
                if (
                    first is not None
                    and first.kind == fmt.Kind.DELTA
                    and (held is None or first.prev_step != held[rank].header.step)
                ):
                    raise ChainError(f"rank {rank}: the chain does not reach a base or the step held")
                if parts and parts[-1].header.step != step:
                    raise ChainError(f"rank {rank}: the chain ends at step {parts[-1].header.step}, not {step}")
                state = held[rank] if held else None
                for i in range(len(self.run.payloads[rank])):  # one payload's patch at a time
                    if state is not None and self._walkable(rank, i, parts):
                        walked.add((rank, i))
                        changed += sum(part.entries[i].changed for part in parts)
                        if verify:  # the first step of the chain; each later one as it is walked
                            local = True
                            checked.append(self._payload(rank, i, parts[0], state.checksums[i]))
                        continue
                    if state is None and ((rank, i) in scattered or self._whole_walkable(rank, i, parts)):
                        whole.add((rank, i))
                        if not verify:
                            changed += self._views[rank][i].numel
                            continue
                    local = True
                    for patch in self._torch.patches(rank, i, parts, state, params, partials, expected):
                        changed += patch.changed
                if parts:
                    state = RankState(parts[-1].header, parts[-1].probe, tuple(e.checksum for e in parts[-1].entries))
                assert state is not None  # no parts: the step is the one held
                states.append(state)
            if checked:
                assert self._walker is not None
                partials += walks.check(self._walker, checked, functools.partial(self._target, params))
                expected += [(*p.key, chains[p.key[0]][0].header.step, p.moved) for p in checked]
        except Exception as err:  # whatever it is (an out-of-memory, a bad index), the group hears of it
            outcome = err
        if outcome is not None and (self.group is None or not local):
            raise outcome  # from the bytes every worker holds (or no group): the same everywhere
        # decoded against its own state, a worker may fail alone: its error rides with the partial sums
        sums = self._sum(partials, outcome) if local else []
        for (rank, index, part_step, want), got in zip(expected, sums, strict=True):
            if got != want:
                names = [self._names[s.tensor] for s in self._views[rank][index].slices]
                raise ChecksumError(
                    f"{self.store.url} rank {rank} step {part_step}: payload {index} ({', '.join(names[:4])}) "
                    "does not reproduce the trainer's checksum from the values the engine holds"
                )
        return states, chains, frozenset(walked), frozenset(whole), changed, fetched, share

    def _fetch(
        self, step: int, held: list[RankState] | None, thin: bool = False
    ) -> tuple[list[tuple[fmt.Part, ...]], int, bool, frozenset[tuple[int, int]]]:
        """Every rank's parts (oldest first), the parts this worker fetched, whether the step is a
        base step, and (with `thin`) the payloads the group walks whole that travel decoded, from
        the worker that read them (`scatter`), not in the blobs; each worker fetches a share and
        sends the others its blobs (without those payloads), and the steps it holds: `ChainError`
        on every worker if they differ (each then fetches from a base)."""
        world = self.run.world_size
        ours = range(self.rank, world, self.size)
        fetched: dict[int, tuple[list[fmt.PartRef], Sequence[bytes | memoryview]]] = {}
        scattered: dict[int, list[int]] = {}
        mine: list[Tensor] | BaseException
        try:
            if not self._reader.is_complete(step):
                raise SnapshotNotFoundError(f"step {step} is not completely published in {self.store.url}")
            for rank in ours:
                fetched[rank] = self._reader.fetch_blobs(step, rank, held[rank].header.step if held else None)
                self._reader.check(*fetched[rank], rank)  # here only: a failure reaches the others in the exchange
            mine = []
            if self.group is not None:  # what the others need: the steps held here, and the blobs
                mine.append(codec.byte_view(json.dumps([s.header.step for s in held] if held else None).encode()))
                for rank, (refs, blobs) in fetched.items():
                    if thin and held is None and len(refs) == 1:
                        blobs, scattered[rank] = self._thinned(rank, refs, blobs)
                    mine.append(codec.byte_view(json.dumps([[asdict(r) for r in refs], scattered.get(rank)]).encode()))
                    mine += [codec.byte_view(b) for b in blobs]
        except Exception as err:
            mine = err
        if self.group is not None:
            received = exchange(mine, self.group, torch.device("cpu"))
            if len({bytes(pieces[0].numpy()) for pieces in received}) > 1:
                raise _HeldDiffers("the workers of the group hold different steps")
            for src, pieces in enumerate(received):
                if src == self.rank:
                    continue
                rest = iter(pieces[1:])
                for rank in range(src, world, self.size):
                    described, whole = json.loads(bytes(next(rest).numpy()))
                    refs = [_ref(r) for r in described]
                    fetched[rank] = (refs, [next(rest).numpy().data for _ in refs])  # not copied
                    if whole is not None:
                        scattered[rank] = whole
        elif isinstance(mine, BaseException):
            raise mine
        chains = [self._reader.parse(*fetched[rank], rank, checked=True) for rank in range(world)]
        base_step = any(refs and (refs[-1].bridge or refs[-1].kind == fmt.Kind.BASE) for refs, _ in fetched.values())
        whole = frozenset((rank, i) for rank, indices in scattered.items() for i in indices)
        return chains, sum(len(fetched[r][0]) for r in ours), base_step, whole

    def _thinned(
        self, rank: int, refs: list[fmt.PartRef], blobs: Sequence[bytes | memoryview]
    ) -> tuple[list[bytes | memoryview], list[int]]:
        """A base part (checked) as the others receive it: without the payloads the group walks
        whole, which this worker decodes and sends each of them as elements (`scatter`); and
        which those payloads are."""
        (part,) = self._reader.parse(refs, blobs, rank, checked=True)
        whole = [i for i in range(len(part.payloads)) if self._whole_walkable(rank, i, (part,))]
        if not whole:
            return list(blobs), whole
        entries = [dataclasses.replace(e, length=0) if i in whole else e for i, e in enumerate(part.entries)]
        payloads = [b"" if i in whole else bytes(p) for i, p in enumerate(part.payloads)]
        return [fmt.encode_blob(part.header, entries, payloads, part.probe)], whole

    # ------------------------------------------------------------------ write

    def write(self, prepared: EngineStep, check: bool = False) -> float:
        """Write a verified step into the engine (the positions this worker holds, and the kept
        copies, then the engine's reload if one of those changed); returns the seconds it took.

        With `check` (a step verified ahead, while the engine served), its changes are checked once
        more against the values they will be written over, with the group, before the first write:
        if a weight was changed behind the follower's back meanwhile, `ChecksumError`, and nothing
        is written.
        """
        self._stop_prefetch()  # its collectives and these must not interleave
        if prepared.generation != self._generation:
            raise SnapshotNotFoundError(f"step {prepared.step} was decoded against a state no longer held")
        started = time.perf_counter()
        if check and prepared.held is not None:
            self._check_changes(prepared)
        params = self._params()
        reload = self._walk(prepared, params)  # taken back on every worker if any fails
        failure: Exception | None = None
        try:  # past the walk nothing is taken back: a failure anywhere means a re-sync everywhere
            reload |= self._write_whole(prepared, params)
            for rank, parts in enumerate(prepared.chains):
                held = prepared.held[rank] if prepared.held else None
                for i, view in enumerate(self._views[rank]):
                    if (rank, i) in prepared.walked or (rank, i) in prepared.whole:
                        continue
                    for patch in self._torch.patches(rank, i, parts, held, params):
                        if patch.whole is None and (patch.index is None or not patch.index.numel()):
                            continue
                        for s, offset in zip(view.slices, view.offsets, strict=False):
                            reload |= self._torch.write_slice(s, offset, patch, params)
            if reload:
                if self._reload is None:
                    raise SnapshotNotFoundError("tensors the engine cannot take in place changed, and it has no reload")
                self._reload(self._kept_tensors())
        except Exception as err:
            failure = err
        try:
            if isinstance(failure, Agreed):  # the group decided in a decode's exchange: no other exchange
                raise failure.error
            if self.group is not None:
                exchange_bytes(failure or b"", self.group, torch.device("cpu"))
            elif failure is not None:
                raise failure
        except Exception as err:
            self._held, self._generation = None, self._generation + 1
            log.warning(
                "%s: step %d was written only in part (%s); the engine holds no step of the chain until it is "
                "loaded from a base",
                self.store.url,
                prepared.step,
                err,
            )
            if isinstance(err, DeltaError):
                raise
            raise DeltaError(f"{type(err).__name__}: {err}") from err
        self._held, self._generation = prepared.states, self._generation + 1
        return time.perf_counter() - started

    def _check_changes(self, prepared: EngineStep) -> None:
        """Whether the changes take the values the engine holds now to the trainer's checksums:
        partial sums over the owned changes, summed over the group."""
        assert prepared.held is not None
        partials, expected, failure = [], [], None
        try:
            params = self._params()
            chains = zip(prepared.chains, prepared.states, prepared.held, strict=True)
            for rank, (parts, state, held) in enumerate(chains):
                for i, view in enumerate(self._views[rank]):
                    if (rank, i) in prepared.walked:
                        continue  # checked as it is written
                    moved, whole = 0, False
                    for patch in self._torch.patches(rank, i, parts, held, params):
                        if patch.index is None or patch.step is None:
                            whole = True
                            continue
                        moved += self._torch.partial(view, PayloadPatch(), patch.index, patch.step, params)
                    if not whole:
                        partials.append(moved & _MASK64)
                        expected.append((rank, i, (state.checksums[i] - held.checksums[i]) & _MASK64))
        except Exception as err:
            failure = err
        for (rank, i, want), got in zip(expected, self._sum(partials, failure), strict=True):
            if got != want:
                self._held = None  # the engine's weights are not the step held: the next write is whole
                raise ChecksumError(
                    f"rank {rank} payload {i}: the engine's weights changed behind the follower's back since step "
                    f"{prepared.step} was verified; nothing was written, and the next step is written whole"
                )

    def update(self, step: int | None) -> tuple[EngineStep, bool, float]:
        """Take `step` (None: the newest; prefetched if it was) and write it: (the step, whether
        it was prefetched, the seconds of the write).  A step whose changes no longer fit the
        engine's weights, or whose write failed past the point where it can be taken back (the
        engine's reload raised, say), is loaded again from a base, which writes every element;
        if that fails too, the follower holds no step, and the next update loads from a base."""
        prepared, prefetched = self._take(step, verify=False)
        try:
            return prepared, prefetched, self.write(prepared, check=prefetched)
        except ChecksumError as err:
            log.warning("%s; loading step %d from its base", err, prepared.step)
        except DeltaError as err:  # every worker raised it, and each holds no step if it was written in part
            if self._held is not None or prepared.held is None:
                raise  # nothing written, or a failed write from a base, which would fail the same way again
            log.warning("%s; re-syncing step %d from its base", err, prepared.step)
        prepared = self._prepare_step(prepared.step, verify=False)  # no step held: the write checks it
        return prepared, False, self.write(prepared)

    def _walk(self, prepared: EngineStep, params: Mapping[str, Tensor]) -> bool:
        """Walk every walkable payload of a step in sync into the engine (`apply`): checked as they
        are written, and every walk taken back if any payload fails on any worker, so that the step
        leaves nothing written.  Returns whether a kept copy changed."""
        if not prepared.walked:
            return False
        assert prepared.held is not None and self._walker is not None
        held = prepared.held
        payloads = [p for r, i in sorted(prepared.walked) for p in self._payloads(r, i, prepared.chains[r], held[r])]
        try:
            return bool(walks.apply(self._walker, payloads, functools.partial(self._target, params), self.group))
        except ChecksumError:
            self._held = None  # the engine's weights, or the step, are not what they should be
            raise

    def _write_whole(self, prepared: EngineStep, params: Mapping[str, Tensor]) -> bool:
        """Walk every whole payload of a base step into the engine (`whole_walk`), side by side on
        threads, and check them: partial sums over the owned elements, summed over the group.  In a
        group, the worker that read a part decodes its payloads alone and sends each peer the
        elements it holds (`scatter`).  A failure on any worker raises on all of them, with the
        engine holding no step.  Returns whether a kept copy changed."""
        if not prepared.whole:
            return False
        jobs, expected, partials, kept = [], [], list[int](), False
        sending: list[tuple[int, int, np.ndarray]] = []  # (peer, tag, elements)
        receiving: list[tuple[int, int, np.ndarray]] = []  # (worker that decodes it, tag, buffer)
        arrays: dict[str | int, np.ndarray] = {}
        failure: Exception | None = None
        try:
            for at, (rank, i) in enumerate(sorted(prepared.whole)):  # `at` tags its transfers too
                table = self._segments_of(rank, i)
                assert table is not None
                expected.append((rank, i, prepared.chains[rank][0].entries[i].checksum))
                holds = whole_walk.count(table[0])
                for name in table[1] if holds else ():
                    if isinstance(name, int):
                        kept = True
                        self._kept.setdefault(
                            name, torch.zeros(self.run.manifest.tensors[name].numel, dtype=torch.int16)
                        )
                source = scatter.reader(rank, self.size)
                if source == self.rank and (holds or self.group is not None):
                    jobs.append((at, rank, i))
                elif source != self.rank and holds:
                    receiving.append((source, at, np.empty(holds, dtype=np.int16)))
            partials = [0] * len(expected)
            with ThreadPoolExecutor(max_workers=max(1, min(len(jobs), _threads()))) as pool:
                futures = [
                    (at, pool.submit(self._walk_whole, rank, i, prepared.chains[rank][0], params, arrays))
                    for at, rank, i in jobs
                ]
                for at, future in futures:
                    partials[at], gathered = future.result()
                    sending += [(peer, at, values) for peer, values in gathered]
        except Exception as err:
            failure = err
        if self.group is not None:
            # past it, every worker sends and receives
            transfers = scatter.agree(failure, sending, receiving, self.group)
            try:
                transfers.run()
                sending.clear()
                keys = sorted(prepared.whole)
                with ThreadPoolExecutor(max_workers=max(1, min(len(receiving), _threads()))) as pool:
                    writes = [
                        (at, pool.submit(self._scattered, *keys[at], values, params, arrays))
                        for _, at, values in receiving
                    ]
                    for at, written in writes:
                        partials[at] = written.result()
            except Exception as err:
                failure = err
        for (rank, i, want), got in zip(expected, self._sum(partials, failure), strict=True):
            if got != want:
                names = [self._names[s.tensor] for s in self._views[rank][i].slices]
                raise ChecksumError(
                    f"{self.store.url} rank {rank} step {prepared.step}: payload {i} ({', '.join(names[:4])}) does "
                    "not reproduce the trainer's checksum; the engine holds no step of the chain until it is loaded "
                    "from a base"
                )
        return kept

    def _walk_whole(
        self, rank: int, i: int, part: fmt.Part, params: Mapping[str, Tensor], arrays: dict[str | int, np.ndarray]
    ) -> tuple[int, list[tuple[int, np.ndarray]]]:
        """Payload `i` of `rank`'s whole walk: this worker's share of its checksum, and the
        elements each peer holds of it (in a group, where this worker read the part)."""
        view, table = self._views[rank][i], self._segments_of(rank, i)
        assert table is not None
        packed = codec.parse(part.payloads[i], view.numel)
        if packed.dtype != view.dtype:
            where = f"{self.store.url} rank {rank} step {part.header.step}: payload {i}"
            raise fmt.FormatError(f"{where} is {packed.dtype}, expected {view.dtype}")
        walk = whole_walk.WholeWalk(packed, table[0], self._whole_targets(table[1], params, arrays))
        share = walk.apply()
        peers = self._peers.get((rank, i), []) if self.group is not None else []
        return share, [(q, walk.gather(t)) for q, t in enumerate(peers) if q != self.rank and whole_walk.count(t)]

    def _scattered(
        self, rank: int, i: int, values: np.ndarray, params: Mapping[str, Tensor], arrays: dict[str | int, np.ndarray]
    ) -> int:
        """Payload `i` of `rank`'s elements this worker holds, as the worker that read it sent them:
        written, and this worker's share of its checksum."""
        table = self._segments_of(rank, i)
        assert table is not None
        return whole_walk.Scattered(values, table[0], self._whole_targets(table[1], params, arrays)).apply()

    def _whole_targets(
        self, names: list[str | int], params: Mapping[str, Tensor], arrays: dict[str | int, np.ndarray]
    ) -> list[np.ndarray]:
        """The arrays a table names: a parameter, or the kept copy of a refused tensor."""
        for name in names:
            if name not in arrays:  # threads may both fill it: the same array either way
                arrays[name] = _host(params[name], name) if isinstance(name, str) else self._kept[name].numpy()
        return [arrays[name] for name in names]

    def _whole_walkable(self, rank: int, i: int, parts: tuple[fmt.Part, ...]) -> bool:
        """Whether payload `i` of `rank` is walked whole (`whole_walk`): on the CPU, one RAW payload
        of a step loaded from its base, into tensors the map holds as runs or 2-D blocks."""
        return (
            len(parts) == 1
            and self.device.type == "cpu"
            and codec.mode_of(parts[0].payloads[i]) == codec.Mode.RAW
            and self._segments_of(rank, i) is not None
        )

    def _walkable(self, rank: int, i: int, parts: tuple[fmt.Part, ...]) -> bool:
        """Whether payload `i` of `rank` is walked in place (`apply`): SPARSE payloads from the state
        held (the chain checks that it starts there), one step after another (a follower one step
        late walks two, each at the cost of its change, rather than composing them through torch),
        into tensors the map holds as runs or 2-D blocks."""
        return (
            bool(parts)
            and all(
                p.header.kind == fmt.Kind.DELTA and codec.mode_of(p.payloads[i]) == codec.Mode.SPARSE for p in parts
            )
            and self._segments_of(rank, i) is not None
        )

    def _payloads(self, rank: int, i: int, parts: Sequence[fmt.Part], held: RankState) -> list[walks.Payload]:
        """Payload `i` of each of `rank`'s parts, in chain order, each one step from the one before
        (walked in that order, taken back in the reverse)."""
        before = [held.checksums[i]] + [part.entries[i].checksum for part in parts[:-1]]
        return [self._payload(rank, i, part, b) for part, b in zip(parts, before, strict=True)]

    def _payload(self, rank: int, i: int, part: fmt.Part, before: int) -> walks.Payload:
        """Payload `i` of `rank`'s part, one step from a state whose checksum of it is `before`, as
        a walk takes it."""
        view, table = self._views[rank][i], self._segments_of(rank, i)
        assert table is not None
        entry = part.entries[i]
        return walks.Payload(
            key=(rank, i),
            data=part.payloads[i],
            numel=view.numel,
            dtype=view.dtype,
            changed=entry.changed,
            segments=table[0],
            names=tuple(table[1]),
            moved=(entry.checksum - before) & _MASK64,
            where=f"{self.store.url} rank {rank} step {part.header.step}: payload {i}",
        )

    def _target(self, params: Mapping[str, Tensor], name: str | int) -> Tensor:
        """What a walk writes: a parameter (by name) or the kept copy of a refused tensor (by
        index), as flat int16."""
        if isinstance(name, str):
            return _held(params[name], name)
        if name not in self._kept:
            raise SnapshotNotFoundError(f"{self._names[name]} is not held yet")
        return self._kept[name]

    def _segments_of(self, rank: int, i: int) -> tuple[sparse_walk.Segments, list[str | int]] | None:
        """Payload `i` of `rank` as a walk's segment table and the arrays it names (a parameter by
        name, the kept copy of a refused tensor by its index), or None where it is not walked."""
        return self._segments.get((rank, i))

    def _kept_tensors(self) -> dict[str, Tensor]:
        specs = self.run.manifest.tensors
        return {
            specs[i].name: bits.view(fmt.DType(specs[i].dtype).torch).view(specs[i].shape)
            for i, bits in self._kept.items()
        }

    # ------------------------------------------------------------------ full check

    def forget(self) -> None:
        """Hold no step (the engine computes what its weights do not say, though they check out: a
        failed probe, say): the next update loads one from its base, writing every element."""
        self._stop_prefetch()  # a step it prefetched applies to the state held
        self._held, self._generation = None, self._generation + 1

    def verify(self) -> None:
        """Rehash everything the engine holds of the chain against the trainer's checksums: each
        worker the elements it owns, summed over the group; `ChecksumError` if any payload differs
        (then the next step is written whole, from a base)."""
        self._stop_prefetch()  # its collectives and these must not interleave
        if self._held is None:
            raise SnapshotNotFoundError("the engine holds no step of the chain yet")
        try:
            self._check(self._held)
        except ChecksumError:
            self._held = None
            raise

    def _check(self, held: list[RankState]) -> None:
        partials, expected, failure = [], [], None
        try:
            params = self._params()
            for rank, state in enumerate(held):
                for i, view in enumerate(self._views[rank]):
                    partials.append(self._torch.owned_sum(view, params))
                    expected.append((rank, i, state.header.step, state.checksums[i]))
        except Exception as err:
            failure = err
        for (rank, i, step, want), got in zip(expected, self._sum(partials, failure), strict=True):
            if got != want:
                raise ChecksumError(
                    f"rank {rank} payload {i}: the engine's weights no longer match the trainer's checksum of step "
                    f"{step}: they were changed behind the follower's back; the next step is written whole"
                )

    # ------------------------------------------------------------------ prefetch

    def prefetch(self, poll_seconds: float) -> None:
        """Start fetching, decoding and verifying the next newer step in the background, so that
        `take` only writes it (every worker of the group must call this together)."""
        self._stop_prefetch()
        stop, result = threading.Event(), list[EngineStep | Exception]()

        def run() -> None:
            held = self.held_step
            try:
                while True:
                    choice: int | Exception
                    try:  # a store error here must reach the decision, or the others wait in it
                        steps = self._reader.steps(after=held)
                        choice = _STOP if stop.is_set() else (steps[-1] if steps else _NONE)
                    except Exception as err:
                        choice = err
                    decided = self._decide(choice)
                    if _STOP in decided:
                        return
                    if decided[0] != _NONE:
                        result.append(self.prepare(decided[0]))
                        return
                    stop.wait(poll_seconds)
            except Exception as err:  # kept for `take`, which prepares again and raises it there
                result.append(err)

        written = None  # the writes queued so far on the caller's stream: the prefetcher reads after them
        if self.device.type == "cuda":
            written = torch.cuda.Event()
            written.record(torch.cuda.current_stream(self.device))

        def on_device() -> None:  # a new thread's current CUDA device is 0, whatever the engine's
            if written is not None:  # on a side stream: its waits are not for the engine's work
                side = torch.cuda.Stream(self.device)
                side.wait_event(written)
                with torch.cuda.device(self.device), torch.cuda.stream(side):
                    run()
            else:
                run()

        thread = threading.Thread(target=on_device, name="delta-engine-prefetch", daemon=True)
        thread.start()
        self._prefetch = (thread, stop, result)

    @property
    def prefetching(self) -> bool:
        """Whether a prefetcher runs (it may read the engine's weights at any moment)."""
        return self._prefetch is not None and self._prefetch[0].is_alive()

    def take(self, step: int | None) -> tuple[EngineStep, bool]:
        """The verified `step` (None: the newest), and whether it had been prefetched."""
        return self._take(step, verify=True)

    def _take(self, step: int | None, verify: bool) -> tuple[EngineStep, bool]:
        self._stop_prefetch()
        ready, self._ready = self._ready, None
        wanted = self.newest() if step is None else step
        if ready is not None and ready.generation == self._generation and ready.step == wanted:
            return ready, True
        return self._prepare_step(wanted, verify), False

    def _stop_prefetch(self) -> None:
        """Stop the prefetcher, keeping the step it made ready for `take`: every use of the group
        outside the prefetcher comes after this, never while it may still be in a collective (the
        next call waits for it again)."""
        if self._prefetch is None:
            return
        thread, stop, result = self._prefetch
        stop.set()
        thread.join(self.stop_seconds)
        if thread.is_alive():
            raise PrefetchTimeoutError(
                f"{self.store.url}: the prefetcher did not stop within {self.stop_seconds:g} s (a store that does "
                "not answer, or a worker of the group that is gone); nothing was written, and the next call waits "
                "for it again"
            )
        self._prefetch = None
        if result and isinstance(result[0], EngineStep):
            self._ready = result[0]

    def close(self) -> None:
        self._stop_prefetch()

    # ------------------------------------------------------------------ group

    def _decide(self, value: int | Exception) -> list[int]:
        return decisions.decide(self.group, value)

    def _sum(self, partials: list[int], failure: Exception | None = None) -> list[int]:
        """The group's sums of each partial checksum, mod 2**64; or, on every worker, the error
        `failure` of any worker that could not compute its partials."""
        if isinstance(failure, Agreed):  # the group decided in a decode's exchange: no other exchange
            raise failure.error
        return decisions.sum_partials(self.group, partials, failure)

    def _gather_json(self, value: object) -> list[Any]:
        return decisions.gather_json(self.group, value)


def _threads() -> int:
    """Payloads walked whole at once: the cores this process may run on (the walk and zstd release the GIL)."""
    return len(os.sched_getaffinity(0))


def _host(tensor: Tensor, name: str) -> np.ndarray:
    """A CPU parameter's elements as int16 numpy (its own memory, for a walk)."""
    return _held(tensor, name).numpy()


def _held(tensor: Tensor, name: str) -> Tensor:
    """A parameter's elements as flat int16; one left on the meta device (an engine reload that
    did not finish) holds nothing to write into."""
    if tensor.is_meta:
        raise ModelMismatchError(
            f"{name} is on the meta device (the engine's reload did not finish): restart the engine"
        )
    return flat_bits(tensor)


def _ref(fields: dict[str, Any]) -> fmt.PartRef:
    return fmt.PartRef(
        int(fields["step"]),
        fmt.Kind(fields["kind"]),
        None if fields["prev_step"] is None else int(fields["prev_step"]),
        int(fields["size"]),
        bool(fields["bridge"]),
        str(fields["sha256"]),
    )
