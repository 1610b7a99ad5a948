"""Following a chain into a live engine's parameters, at the cost of the change.

The engine's parameters are the held state, read and written through a `ViewMap`; the tensors the
map refuses are kept as copies and handed to the engine's own `reload` whenever one of them
changes.  A step is prepared (fetched, decoded, verified), then written, by every worker of a
tensor-parallel group together:

- `fetch`: the group's one download, each blob fetched and hashed by one worker;
- `plan`: which payloads are walked in place or whole, through each worker's segment tables;
- `prepare`: each payload routed to what writes it, and verified where it can be before a write;
- `apply`: SPARSE payloads from the state held walked in (`sparse_walk` on the CPU, `device_walk`'s
  Triton kernels on a GPU, `torch_walk` where those cannot run or with apply=torch), one step after
  another for a follower that is late: decoded, checked and written in one pass, and every walk
  taken back exactly if any worker's check fails;
- `whole_write`: a base step's RAW payloads walked whole, each decompressed once in the group;
- `torch_path`: the rest decoded with torch a chunk at a time and verified by the partial sums
  over the changes each worker owns before anything is written;
- `group`: every decision taken in one exchange that carries any worker's failure to all;
- `prefetch`: the next step prepared in the background while the engine serves.

On a store that fills out of order (a replicated bucket), a listed step an object of which is not
there yet is not complete yet (`incomplete`): `NotCompleteYetError`, the step held kept, nothing read
from a base; the prefetcher and `update(None)` take the newest complete step meanwhile.

A failed update leaves nothing written, or (past the point where it can be taken back) no step
held, so the next one loads from a base.  Framework-free: an engine adapter (`vllm_backend`) gives
the loader call, the parameters, the reload and the group.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from . import apply as walks
from . import checks, plan
from . import format as fmt
from . import group as decisions
from .apply import ApplyBackend
from .errors import (
    ChecksumError,
    DeltaError,
    MissingObjectError,
    NotCompleteYetError,
    SnapshotNotFoundError,
    StoreError,
)
from .fetch import HeldDiffers, fetch_step
from .incomplete import MissingClock
from .loader import FullCheck
from .patch import LoadReport, RankState, views
from .prefetch import Prefetcher, PrefetchTimeoutError
from .prepare import route_and_verify
from .reader import ChainReader
from .scatter import ScatterSettings
from .store import Store
from .torch_path import TorchPath
from .viewmap import ViewMap
from .whole_write import WholeWriter

__all__ = ["EngineFollower", "EngineStep", "PrefetchTimeoutError"]

log = logging.getLogger(__name__)

_STOP, _NONE = -1, -2  # a prefetcher's decisions besides a step number


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
        apply: what walks the SPARSE payloads of a step in sync (`apply.ApplyBackend`; None: the
            CPU walk on the CPU, the device walk on a GPU, where they can run, else torch's walk).
            The device walk's kernels first prove themselves on the device: where they fail, this
            worker walks with torch for its life (`walks_with` says which writes), or raises
            `DeviceError` where the failure broke the device's CUDA context.
        scatter: how a base step's decoded elements travel between the group's workers (the size of
            the pieces that bound their buffers; `scatter.ScatterSettings`).
        missing_after: seconds an object a listed step needs may stay missing (the step is not
            complete yet: `NotCompleteYetError`) before the step counts as damage
            (`FollowSettings.missing_after`).

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
        scatter: ScatterSettings | None = None,
        missing_after: float = 120.0,
    ) -> None:
        self.store, self.map, self._params, self._reload = store, view_map, params, reload
        self.group, self.device, self.full_check = group, device or torch.device("cpu"), full_check
        self.decisions = decisions.Decisions(group)
        """What the group's workers decide together, each in one exchange."""
        self.rank, self.size = self.decisions.rank, self.decisions.size
        self._reader = ChainReader(store)
        mine: dict[str, list[list[list[int]]]] | Exception
        try:  # a worker that fails here still joins the group's first collective, with its error
            # (the kernels' proof runs on this worker's device alone: a DeviceError is this worker's)
            self._walker = walks.walker(apply, self.device)
            run = store.run()
            self.run = run
            payload_views = [views(run, rank) for rank in range(run.world_size)]
            specs = {t.name: (t.shape, fmt.DType(t.dtype).torch) for t in run.manifest.tensors}
            mine = view_map.describe()
        except Exception as err:
            mine = err
        described = self.decisions.gather_json(mine)
        owned = view_map.settle(described, self.rank, specs)  # refuses what the group cannot map
        asked = apply or ApplyBackend.default(self.device)
        self.plan = plan.Plan(
            store.url, run, payload_views, view_map, owned, self.rank, self._walker, asked, self.group, self.device
        )
        """Which payloads are walked, in place or whole, and the kept copies of refused tensors."""
        self._torch = TorchPath(self.plan, self.rank, self.group)
        self._whole = WholeWriter(self.plan, self.decisions, scatter)
        self._held: list[RankState] | None = None
        self._generation = 0
        self.prefetcher = Prefetcher[EngineStep](self.device, store.url)
        """The background preparation of the next step (`prefetch`)."""
        self.stop_seconds = stop_seconds
        self.missing = MissingClock(missing_after)
        """When each object a listed step needs was first found missing (restarted at each write of
        another step than the one held)."""

    # ------------------------------------------------------------------ facts

    def paths(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """((tensors, bytes) written in place, (tensors, bytes) through the engine's reload)."""
        sizes = {t.name: 2 * t.numel for t in self.run.manifest.tensors}
        mapped = [n for n in self.plan.names if n in self.map.boxes]
        refused = [n for n in self.plan.names if n not in self.map.boxes]
        return (len(mapped), sum(sizes[n] for n in mapped)), (len(refused), sum(sizes[n] for n in refused))

    @property
    def walks_with(self) -> ApplyBackend:
        """What writes this worker's SPARSE payloads in sync: `ApplyBackend.TORCH` too where the
        device walk's kernels failed their proof on this worker (`apply.walker`), or where the group
        walks no payload (`plan.segment_tables`)."""
        return walks.backend_of(self._walker) if self.plan.tables else ApplyBackend.TORCH

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
        newest = self.decisions.decide(outcome)[0]
        if newest < 0:
            raise SnapshotNotFoundError(f"no complete step in {self.store.url}")
        return newest

    def prepare(self, step: int) -> EngineStep:
        """Fetch, decode and verify `step` against what the engine holds, writing nothing (of the
        steps a late follower walks in turn, the first; `write` checks each as it walks it in)."""
        return self._prepare_step(step, verify=True)

    def _prepare_step(self, step: int, verify: bool, resync: bool = False) -> EngineStep:
        """`prepare`; without `verify`, the payloads `write` walks are left for it to check.  With
        `resync` (the engine's weights were written in part, or changed behind its back, since the
        step it held), a missing object is damage: `NotCompleteYetError` promises nothing written."""
        started, read_before = time.perf_counter(), self.store.bytes_read
        held, generation = self._held, self._generation
        try:
            states, chains, walked, whole, changed, fetched, share = self._prepare(step, held, verify)
        except DeltaError as err:
            if isinstance(err, MissingObjectError) and not resync and not self._lost(err):
                log.debug("step %d is not complete yet, the engine keeps step %s: %s", step, self.held_step, err)
                raise NotCompleteYetError(f"step {step} is not complete yet: {err}", err.key) from err
            if isinstance(err, StoreError) or (held is None and not isinstance(err, HeldDiffers)):
                raise
            log.warning("step %d does not rebuild from the step held (%s); trying from its base", step, err)
            held = None
            states, chains, walked, whole, changed, fetched, share = self._prepare(step, None, verify)
        report = LoadReport(
            step=step,
            kind=states[0].header.kind,
            parts_read=fetched,
            bytes_read=self.store.bytes_read - read_before,
            tensors=len(self.plan.names),
            changed=changed,
            seconds=time.perf_counter() - started,
            share_seconds=share,
            probe=states[0].probe,
        )
        return EngineStep(step, states, chains, held, report, generation, walked, whole)

    def _lost(self, err: MissingObjectError) -> bool:
        """Whether `err`'s object counts as lost (`MissingClock`): group rank 0's verdict, on every
        worker (each met the error, as the group agreed on it in `_prepare`)."""
        return bool(self.decisions.decide(int(self.missing.lost(err)))[0])

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
        chains, fetched, base_step, scattered = fetch_step(
            self._reader, self.plan, self.decisions, step, held, not verify
        )
        share = time.perf_counter() - started
        cadence = self.full_check
        if held is not None and (cadence == FullCheck.EVERY_STEP or (cadence == FullCheck.BASE_STEPS and base_step)):
            self._check(held)  # a failure re-syncs from a base, which writes every element
        states, walked, whole, changed = route_and_verify(
            self.plan, self._torch, self._walker, self.decisions, self._weights(), step, chains, held, scattered, verify
        )
        return states, chains, walked, whole, changed, fetched, share

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
        started, before = time.perf_counter(), self.held_step
        if check and prepared.held is not None:
            self._check_changes(prepared)
        params = self._weights()
        reload = self._walk(prepared, params)  # taken back on every worker if any fails
        failure: Exception | None = None
        written = bool(prepared.walked)  # what the walks wrote stays
        try:  # past the walk nothing is taken back: a failure anywhere means a re-sync everywhere
            reload |= self._whole.write(prepared.whole, prepared.chains, prepared.step, params)
            for rank, parts in enumerate(prepared.chains):
                held = prepared.held[rank] if prepared.held else None
                for i, view in enumerate(self.plan.views[rank]):
                    if (rank, i) in prepared.walked or (rank, i) in prepared.whole:
                        continue
                    for patch in self._torch.patches(rank, i, parts, held, params):
                        if patch.whole is None and (patch.index is None or not patch.index.numel()):
                            continue
                        for s, offset in zip(view.slices, view.offsets, strict=False):
                            written = True
                            reload |= self._torch.write_slice(s, offset, patch, params)
            if reload:
                if self._reload is None:
                    raise SnapshotNotFoundError("tensors the engine cannot take in place changed, and it has no reload")
                self._reload(self.plan.kept_tensors())
        except Exception as err:
            failure = err
        try:
            self.decisions.agree(failure)
        except Exception as err:
            self._held, self._generation = None, self._generation + 1
            log.warning(
                "%s: step %d was %s (%s); the engine holds no step of the chain until it is loaded from a base",
                self.store.url,
                prepared.step,
                # per worker: where another worker's write failed, this one may have written nothing
                "written only in part" if written or self._whole.wrote else "not written by this worker",
                err,
            )
            if isinstance(err, DeltaError):
                raise
            raise DeltaError(f"{type(err).__name__}: {err}") from err
        self._held, self._generation = prepared.states, self._generation + 1
        if prepared.step != before:  # a follower that rewrites the step it held is still stuck on it
            self.missing.restart()
        return time.perf_counter() - started

    def _check_changes(self, prepared: EngineStep) -> None:
        """Whether the changes take the values the engine holds now to the trainer's checksums
        (`checks.changes_differ`); if not, the next write is whole."""
        assert prepared.held is not None
        differs = checks.changes_differ(
            self._torch,
            self.plan,
            self.decisions,
            self._weights,
            prepared.chains,
            prepared.states,
            prepared.held,
            prepared.walked,
        )
        if differs is not None:
            self._held = None  # the engine's weights are not the step held: the next write is whole
            raise ChecksumError(
                f"rank {differs[0]} payload {differs[1]}: the engine's weights changed behind the follower's back "
                f"since step {prepared.step} was verified; nothing was written, and the next step is written whole"
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
        prepared = self._prepare_step(prepared.step, False, resync=True)  # no step held: the write checks it
        return prepared, False, self.write(prepared)

    def _weights(self) -> Mapping[str, Tensor]:
        """The engine's parameters now.  Where listing them raises (weights released, say), a
        mapping that raises that error at its first use: the worker then fails inside the group's
        next exchange, as every failure does, where raising here would leave its peers waiting in
        an exchange it never reaches (or pair theirs with its next one)."""
        try:
            return self._params()
        except Exception as err:
            return _Unlisted(err)

    def _walk(self, prepared: EngineStep, params: Mapping[str, Tensor]) -> bool:
        """Walk every walkable payload of a step in sync into the engine (`apply`): checked as they
        are written, and every walk taken back if any payload fails on any worker, so that the step
        leaves nothing written.  Returns whether a kept copy changed."""
        if not prepared.walked:
            return False
        assert prepared.held is not None
        held = prepared.held
        payloads = [
            p for r, i in sorted(prepared.walked) for p in self.plan.payloads(r, i, prepared.chains[r], held[r])
        ]
        try:
            return bool(walks.apply(self._walker, payloads, functools.partial(self.plan.target, params), self.group))
        except Exception as err:  # every worker raises here: the group heard of any failure in `apply`
            try:  # a worker whose undo failed holds part of the step: every worker drops the step held
                self.decisions.agree(err if isinstance(err, walks.UndoError) else None)
            except Exception:
                self._held, self._generation = None, self._generation + 1
                raise
            if isinstance(err, ChecksumError):
                self._held = None  # the engine's weights, or the step, are not what they should be
            if isinstance(err, DeltaError):
                raise
            # out of memory, say, on a worker without a group (a group's exchange names it a DeltaError):
            # taken back, yet raised as `write` raises every failure, and the next write loads a base
            self._held, self._generation = None, self._generation + 1
            raise DeltaError(f"{type(err).__name__}: {err}") from err

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
        checks.check_held(self._torch, self.plan, self.decisions, self._weights, held)

    # ------------------------------------------------------------------ prefetch

    def prefetch(self, poll_seconds: float) -> None:
        """Start fetching, decoding and verifying the next newer step in the background, so that
        `take` only writes it (every worker of the group must call this together)."""
        held = self.held_step

        def next_step(stop: threading.Event) -> EngineStep | None:
            while True:
                try:
                    found = self._newest_complete(held, True, stop)
                except NotCompleteYetError:  # every newer step: tried again at the next poll
                    found = _NONE
                if found == _STOP:
                    return None
                if isinstance(found, EngineStep):
                    return found
                stop.wait(poll_seconds)

        self.prefetcher.start(next_step, self.stop_seconds)

    @property
    def prefetching(self) -> bool:
        """Whether a prefetcher runs (it may read the engine's weights at any moment)."""
        return self.prefetcher.running

    def take(self, step: int | None) -> tuple[EngineStep, bool]:
        """The verified `step` (None: the newest), and whether it had been prefetched."""
        return self._take(step, verify=True)

    def _take(self, step: int | None, verify: bool) -> tuple[EngineStep, bool]:
        self._stop_prefetch()
        ready = self.prefetcher.take()
        if ready is not None and ready.generation != self._generation:
            ready = None
        if step is None:  # the newest complete step, which the prefetcher may have made ready
            try:
                found = self._newest_complete(self.held_step if ready is None else ready.step, verify)
            except NotCompleteYetError:
                if ready is None:
                    raise
                found = _NONE
            if isinstance(found, EngineStep):
                return found, False
            if ready is not None:
                return ready, True
            step = self.newest()  # none newer listed: the step held, prepared again, as before
        if ready is not None and ready.step == step:
            return ready, True
        return self._prepare_step(step, verify), False

    def _newest_complete(
        self, after: int | None, verify: bool, stop: threading.Event | None = None
    ) -> EngineStep | int:
        """The newest complete step listed after `after` (group rank 0's listing), prepared: a step
        not complete yet is passed over for the steps older than the one whose object is missing,
        whichever worker met it (the newer ones chain through it: trying each would read their
        blobs again, k^2/2 for k steps); `_NONE` if none is listed, `_STOP` once `stop` is set on
        any worker.  Where every newer step listed is not complete yet, the newest one's
        `NotCompleteYetError`."""
        below: int | None = None  # only steps older than this one are tried
        incomplete: NotCompleteYetError | None = None
        while True:
            choice: int | Exception
            try:  # a store error here must reach the decision, or the others wait in it
                steps = [s for s in self._reader.steps(after=after) if below is None or s < below]
                choice = _STOP if stop is not None and stop.is_set() else (steps[-1] if steps else _NONE)
            except Exception as err:
                choice = err
            decided = self.decisions.decide(choice)
            if _STOP in decided:
                return _STOP
            if decided[0] == _NONE:
                if incomplete is not None:
                    raise incomplete
                return _NONE
            try:
                return self._prepare_step(decided[0], verify)
            except NotCompleteYetError as err:  # raised on every worker: each says what it knows
                incomplete = incomplete or err
                hole = fmt.parse_step_key(err.key)  # None where the key is another worker's message
                below = min(self.decisions.decide(decided[0] if hole is None else min(hole, decided[0])))

    def _stop_prefetch(self) -> None:
        """Stop the prefetcher, keeping the step it made ready for `take` (`Prefetcher.stop`)."""
        self.prefetcher.stop(self.stop_seconds)

    def close(self) -> None:
        self._stop_prefetch()


class _Unlisted(Mapping[str, Tensor]):
    """The parameters of an engine that could not list them: every use raises why."""

    def __init__(self, error: Exception) -> None:
        self._error = error

    def __getitem__(self, name: str) -> Tensor:
        raise self._error

    def __iter__(self) -> Iterator[str]:
        raise self._error

    def __len__(self) -> int:
        raise self._error
