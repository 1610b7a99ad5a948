"""The rollout side: rebuild a published step bit for bit, verify it, and only then write it.

A loader holds one state, in a sink: its own copy of every tensor (what `state_dict` hands out
copies of), or, once `apply_to` has bound a module, the module itself, so that no copy of the
model is kept beside it.  A step is fetched along the cheapest path from the step held
(`reader.ChainReader`), decoded into a patch of the held state that reads only the old values at
the changed positions (`patch.decode_rank`), verified with the trainer's value checksums (the
incremental check of every payload, and at `full_check`'s cadence a rehash of the whole held
state), agreed across a replica, and only then written.  Any failure before the write leaves the
held state, and any module, as it was.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from . import format as fmt
from . import patch as patches
from .errors import (
    ChecksumError,
    DeltaError,
    FormatError,
    MissingObjectError,
    SnapshotNotFoundError,
    StaleChainError,
    StoreError,
)
from .follow import FollowedStep, FollowSettings, follow
from .patch import LoadReport, RankPatch, RankState, StepPatch
from .reader import ChainReader
from .records import enum_member
from .replica import exchange, exchange_bytes, group_device
from .signing import Trust
from .sinks import HeldCopies, ModuleSink, Sink
from .store import Store, as_store

__all__ = ["DeltaLoader", "FullCheck", "LoadReport", "LoaderSettings"]

log = logging.getLogger(__name__)


class FullCheck(str, Enum):
    """When the loader rehashes its whole held state against the trainer's checksums.

    Every step is verified incrementally (its changes, from the old values it reads); that cannot
    see a value changed behind the loader's back where the step changes nothing.  The full check
    reads every held value (docs/RELIABILITY.md says exactly what each check proves).
    """

    BASE_STEPS = "base_steps"  # before writing a step the trainer published a base at
    EVERY_STEP = "every_step"
    ON_DEMAND = "on_demand"  # only when `DeltaLoader.verify` is called


@dataclass
class LoaderSettings:
    """A loader's options (Hydra's `loader` group is this dataclass)."""

    device: str = "cpu"
    """Where steps are decoded and verified, and where the loader's copies live; a module bound by
    `apply_to` keeps its own device ("cuda" is the current CUDA device, fixed at construction)."""
    full_check: FullCheck = FullCheck.BASE_STEPS
    """The cadence of the full rehash of the held state."""
    progress: bool = False
    """A progress bar while a step is fetched from a base (first load, re-sync)."""
    trusted_keys: tuple[str, ...] = ()
    """Public keys (paths of `.pub` files, or their text `ed25519:...`) a run must be signed by: the
    manifest, every marker and the heartbeat are checked as they are read, and anything else is
    refused with `SignatureError` before a byte of its payloads is decoded.  Empty: unchecked."""
    max_heartbeat_age: float | None = None
    """Warn when the run's newest heartbeat is older than this many seconds (or missing): the store,
    or a mirror on the way, may be withholding new steps.  None: the heartbeat is not read."""
    refuse_stale: bool = False
    """With `max_heartbeat_age`: raise `StaleChainError` instead of warning."""

    def __post_init__(self) -> None:
        self.full_check = enum_member(FullCheck, self.full_check)
        self.trusted_keys = tuple(str(k) for k in self.trusted_keys)  # a config's list
        if self.max_heartbeat_age is not None and self.max_heartbeat_age <= 0:
            raise ValueError(f"max_heartbeat_age must be > 0 or None, got {self.max_heartbeat_age}")


class DeltaLoader:
    """Read-only view of a published chain.

    Args:
        store: fsspec URL (a local path works) or a `Store`.
        settings: device, full-check cadence, progress bars.
        storage_options: passed to fsspec with a URL.
        process_group: the workers of one replica.  Each fetches and decodes a disjoint share of
            the step and sends the others its patches (see `lightning_delta.replica`); all of them
            must then call `state_dict`, `apply_to` and `follow` together, for the same steps.
    """

    def __init__(
        self,
        store: str | Store,
        settings: LoaderSettings | None = None,
        *,
        storage_options: Mapping[str, Any] | None = None,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        self.settings = settings or LoaderSettings()
        self.store = as_store(store, storage_options, trust=Trust.of(self.settings.trusted_keys))
        self.device = _resolve(torch.device(self.settings.device))
        self.group = process_group
        self._group_device = group_device(process_group, self.device) if process_group is not None else None
        self._reader = ChainReader(self.store)
        self._sink: Sink | None = None
        self._held: list[RankState] | None = None  # per trainer rank; its values are in the sink
        self._generation = 0  # advances with every write, so a step decoded before it is never written
        self._lock = threading.Lock()  # guards the held state; decoding only reads it
        self.last_report: LoadReport | None = None
        self._stale = False  # warned about the heartbeat, until it is fine again
        self._behind_since: float | None = None  # since when the heartbeat names a step not seen here

    # ------------------------------------------------------------------ public

    def steps(self, after: int | None = None) -> list[int]:
        """Steps whose every rank part is committed, ascending; with `after`, only later ones.

        With `max_heartbeat_age`, the heartbeat is checked too (every poll of a follower)."""
        found = self._reader.steps(after)
        if self.settings.max_heartbeat_age is not None:
            self.check_heartbeat(self.settings.max_heartbeat_age, found[-1] if found else after)
        return found

    def check_heartbeat(self, max_age: float, newest: int | None = None) -> float | None:
        """The age in seconds of the run's newest heartbeat (checked against the trusted keys), None
        if there is none.  Warns, or with `refuse_stale` raises `StaleChainError`, if it is older
        than `max_age` or missing (a frozen store), or if the step it names has stayed newer than
        `newest`, the newest complete step seen here, for longer than `max_age` (steps withheld
        while the heartbeat is relayed)."""
        beat = self.store.heartbeat() if self.store.manifest() is not None else None
        age = None if beat is None else time.time() - beat.time
        problem = "no heartbeat" if age is None else f"the newest heartbeat is {age:.1f} s old"
        if beat is not None and age is not None and age <= max_age:
            problem = ""
            if beat.step is not None and beat.step > (-1 if newest is None else newest):
                if self._behind_since is None:
                    self._behind_since = time.monotonic()
                waited = time.monotonic() - self._behind_since
                if waited > max_age:
                    problem = (
                        f"the heartbeat names step {beat.step}, but for {waited:.1f} s the newest complete "
                        f"step seen here is {newest}"
                    )
            else:
                self._behind_since = None
        if not problem:
            self._stale = False
            return age
        what = (
            f"{self.store.url}: {problem} (max_heartbeat_age {max_age} s): the store, or a mirror on the way, "
            "may be withholding the trainer's newer steps, or the trainer stopped"
        )
        if self.settings.refuse_stale:
            raise StaleChainError(what)
        if not self._stale:
            log.warning("%s", what)
            self._stale = True
        return age

    @property
    def held_step(self) -> int | None:
        """The step the held state is at (the bound module's, or the loader's copies'), if any."""
        held = self._held
        return held[0].header.step if held else None

    @property
    def holds_module(self) -> bool:
        """Whether a module bound by `apply_to` is the held state."""
        return isinstance(self._sink, ModuleSink)

    def state_dict(self, step: int | None = None) -> tuple[int, dict[str, Tensor]]:
        """(step, full tensors by name) of a complete step, `None` for the latest one, verified.

        The tensors are copies.  Without a bound module the loader's own copies move to the step;
        with one, the module stays where it is and the copies are the module's plus the patch.
        """
        prepared = self.prepare(self._resolve_step(step))
        if self.holds_module:
            return prepared.step, self.tensors_of(prepared)
        self.write(prepared)
        return prepared.step, self.tensors_of(prepared)

    def apply_to(
        self,
        module: nn.Module,
        step: int | None = None,
        *,
        rename: Callable[[str], str | None] | None = None,
        after: Callable[[nn.Module], None] | None = None,
    ) -> int:
        """Write a verified step into `module`'s parameters and buffers in place; returns the step.

        The module becomes the held state: later steps are decoded against it, only their changes
        are written, and the loader keeps no copy of the model.  `rename` maps a published name to
        the module's (None drops the tensor); `after` runs once the write is done (an engine's
        post-load step).  Nothing is written unless every name, shape and checksum fits.
        """
        prepared = self.prepare(self._resolve_step(step))
        self.write(prepared, module, rename=rename)
        if after is not None:
            after(module)
        return prepared.step

    def verify(self) -> None:
        """Rehash the whole held state against the trainer's checksums now (the full check);
        `ChecksumError` if it differs, and the next step is then rebuilt from a base."""
        with self._lock:
            held, sink = self._held, self._sink
        if held is None or sink is None:
            raise SnapshotNotFoundError("the loader holds no step to verify")
        self._full_check(self.store.run(), held, sink)  # takes the lock itself to drop a bad state

    def follow(self, settings: FollowSettings | None = None) -> Iterator[FollowedStep]:
        """Watch the store and yield each newer complete step, verified, as a `FollowedStep`.

        The next step is fetched, decoded and verified in the background while the caller works on
        the current one; `FollowedStep.apply_to(module)` then only writes it.  `FollowSettings`
        says how to poll, jump, replay and catch up.  While following, the loader's other methods
        must not be called.  With a `process_group`, every worker of the replica follows and takes
        the same steps; the iteration ends for all of them when it ends for any.
        """
        return follow(self, settings or FollowSettings())

    def decide(self, value: int | BaseException) -> list[int]:
        """Every worker's `value`, by group rank (this one's alone without a group), or the error a
        worker met instead: how a replica's workers take the same decision."""
        if self.group is None:
            if isinstance(value, BaseException):
                raise value
            return [value]
        assert self._group_device is not None
        mine = value if isinstance(value, BaseException) else str(value).encode()
        return [int(v) for v in exchange_bytes(mine, self.group, self._group_device)]

    # ------------------------------------------------------------------ prepare: fetch, decode, verify

    def _resolve_step(self, step: int | None) -> int:
        if step is not None:
            return step
        newest: int | BaseException
        try:
            steps = self.steps()  # with `max_heartbeat_age`, the newest is checked for freshness
            newest = steps[-1] if steps else -1
        except DeltaError as err:
            newest = err
        newest = self.decide(newest)[0]  # every worker of a replica takes group rank 0's newest
        if newest < 0:
            raise SnapshotNotFoundError(f"no complete step in {self.store.url}")
        return newest

    def prepare(self, step: int, *, resync_missing: bool = True) -> StepPatch:
        """Fetch, decode and verify `step` against the held state, writing nothing (a follower's
        background thread calls this while its caller generates; `write` applies the result).

        Where the path from the step held crosses damage, the step is rebuilt from its base; with
        `resync_missing=False` a missing object is raised at once instead (`MissingObjectError`:
        a follower waits for it rather than read a base at every poll)."""
        with self._lock:
            held, sink, generation = self._held, self._sink, self._generation
        started, read_before = time.perf_counter(), self.store.bytes_read
        if self.group is not None:  # the workers decode shares of one step against one state
            assert self._group_device is not None
            mine = json.dumps([s.header.step for s in held] if held else None).encode()
            if len(set(exchange_bytes(mine, self.group, self._group_device))) > 1:
                held = None
        # Decoded where the held state lives: a bound module's device, else the loader's.
        device = sink.device if isinstance(sink, ModuleSink) else self.device
        try:
            ranks, fetched, share = self._decode(step, held, sink, device)
        except DeltaError as err:
            if held is None or isinstance(err, StoreError):
                raise
            if isinstance(err, MissingObjectError) and not resync_missing:
                raise
            # The cheap path from the step held crosses damage; a base may still rebuild it.
            log.warning("step %d does not rebuild from the step held (%s); trying from its base", step, err)
            ranks, fetched, share = self._decode(step, None, sink, device)
        run = self.store.run()
        report = LoadReport(
            step=step,
            kind=ranks[0].state.header.kind,
            parts_read=fetched,
            bytes_read=self.store.bytes_read - read_before,
            tensors=len(run.manifest.tensors),
            changed=sum(p.changed for rank in ranks for p in rank.payloads),
            seconds=time.perf_counter() - started,
            share_seconds=share,
            probe=ranks[0].state.probe,
        )
        self.last_report = report
        return StepPatch(step, ranks, report, generation)

    def _decode(
        self, step: int, held: list[RankState] | None, sink: Sink | None, device: torch.device
    ) -> tuple[list[RankPatch], int, float]:
        """Every rank's patch from `held` (None: from a base) to `step`, the parts this worker
        fetched and the seconds its own share took; with a group, each worker decodes its share
        and the others' arrive as patches."""
        outcome: list[RankPatch] | BaseException
        fetched, started = 0, time.perf_counter()
        try:
            if not self._reader.is_complete(step):
                raise SnapshotNotFoundError(f"step {step} is not completely published in {self.store.url}")
            run = self.store.run()
            ours = self._share(run.world_size)
            bar = self._bar(step, len(ours)) if held is None else None
            outcome = []
            try:
                for rank in ours:
                    got = self._reader.fetch(step, rank, held[rank].header.step if held else None, bar)
                    fetched += len(got.parts)
                    where = f"{self.store.url} rank {rank}"
                    state = held[rank] if held else None
                    outcome.append(patches.decode_rank(run, rank, got.parts, state, sink, device, where, got.base_step))
            finally:
                if bar is not None:
                    bar.close()
            cadence = self.settings.full_check
            due = cadence == FullCheck.EVERY_STEP or (
                cadence == FullCheck.BASE_STEPS and any(p.base_step for p in outcome)
            )
            if held is not None and sink is not None and due:
                self._full_check(run, held, sink)
        except DeltaError as err:
            outcome = err
        share = time.perf_counter() - started
        if self.group is None:
            if isinstance(outcome, BaseException):
                raise outcome
            return outcome, fetched, share
        return self._share_patches(step, outcome, held, sink, device), fetched, share

    def _share(self, world: int) -> range:
        """The trainer ranks this worker fetches and decodes: i, i + n, i + 2n, ... of n workers."""
        if self.group is None:
            return range(world)
        return range(dist.get_rank(self.group), world, dist.get_world_size(self.group))

    def _share_patches(
        self,
        step: int,
        outcome: list[RankPatch] | BaseException,
        held: list[RankState] | None,
        sink: Sink | None,
        device: torch.device,
    ) -> list[RankPatch]:
        """Send this worker's patches, receive the others', check those against this worker's own
        held state, and agree that every worker verified everything before anyone writes."""
        assert self.group is not None and self._group_device is not None
        mine = outcome if isinstance(outcome, BaseException) else [t for p in outcome for t in patches.pack(p)]
        received = exchange(mine, self.group, self._group_device)
        assert not isinstance(outcome, BaseException)  # `exchange` raised it on every worker
        run = self.store.run()
        size, me = dist.get_world_size(self.group), dist.get_rank(self.group)
        ranks = dict(zip(self._share(run.world_size), outcome, strict=True))
        status: bytes | BaseException = b""
        try:
            for src, pieces in enumerate(received):
                if src == me:
                    continue
                shares = range(src, run.world_size, size)
                for rank, got in zip(shares, patches.unpack(pieces, len(shares), device), strict=True):
                    header = got.state.header
                    if (header.step, header.rank) != (step, rank):
                        raise FormatError(f"worker {src} sent step {header.step} rank {header.rank} for {step} {rank}")
                    patches.verify_against(run, rank, got, held[rank] if held else None, sink)
                    ranks[rank] = got
        except DeltaError as err:
            status = err
        exchange_bytes(status, self.group, self._group_device)  # raises on every worker if any refused
        return [ranks[r] for r in range(run.world_size)]

    def _full_check(self, run: fmt.Run, held: list[RankState], sink: Sink) -> None:
        for rank, state in enumerate(held):
            if patches.held_checksums(run, rank, sink) != state.checksums:
                with self._lock:
                    if self._held is held:
                        self._held = None  # the held values are not the trainer's: re-sync from a base
                raise ChecksumError(
                    f"the held state of step {state.header.step} no longer matches the trainer's checksums "
                    f"(rank {rank}): it was changed behind the loader's back; the next step is rebuilt from a base"
                )

    def _bar(self, step: int, total: int) -> Any:
        if not self.settings.progress:
            return None
        from tqdm.auto import tqdm

        return tqdm(total=total, desc=f"step {step}", unit="part", leave=False)

    # ------------------------------------------------------------------ write

    def write(
        self,
        prepared: StepPatch,
        module: nn.Module | None = None,
        *,
        rename: Callable[[str], str | None] | None = None,
    ) -> float:
        """Write a prepared step into the held state, or into `module`, which becomes the held
        state; returns the seconds of the write (the pause a follower's caller sees).

        Once a step is written, the same step may still be written into a module that does not hold
        it yet (the state is copied over): that is how a follower's first step binds a module.
        """
        with self._lock:
            run = self.store.run()
            current = self._generation == prepared.generation
            already = self._generation == prepared.generation + 1 and self.held_step == prepared.step
            if not (current or (already and module is not None)):
                raise SnapshotNotFoundError(
                    f"step {prepared.step} was decoded against a state the loader no longer holds; load it again"
                )
            bound = module is not None and isinstance(self._sink, ModuleSink) and self._sink.fits(module, rename)
            if already and bound:
                return 0.0  # this module holds the step already
            sink = self._sink if module is None or bound else ModuleSink(module, run, rename)  # names, shapes
            started = time.perf_counter()
            if sink is None:
                sink = HeldCopies(run, self.device)
            if sink is self._sink or all(p.whole for p in prepared.ranks):
                for rank, rank_patch in enumerate(prepared.ranks):
                    patches.apply(run, rank, rank_patch, sink)
            else:  # a module that holds nothing of the chain yet: the whole state
                state = self._copy_held() if already else self._materialize(prepared)
                for i, spec in enumerate(run.manifest.tensors):
                    sink.write(i, 0, state.read(i, 0, spec.numel))
            if isinstance(sink, ModuleSink):
                for device in {t.device for t in sink.tensors() if t.is_cuda}:
                    torch.cuda.synchronize(device)
            self._sink, self._held = sink, [p.state for p in prepared.ranks]
            if current:
                self._generation += 1
            return time.perf_counter() - started

    def tensors_of(self, prepared: StepPatch) -> dict[str, Tensor]:
        """Copies of every tensor at the prepared step, written or not (while nothing newer was)."""
        with self._lock:
            if prepared.tensors is None:
                if prepared.generation == self._generation:
                    prepared.tensors = self._materialize(prepared).tensors()
                elif prepared.generation + 1 == self._generation and self.held_step == prepared.step:
                    prepared.tensors = self._copy_held().tensors()
                else:
                    raise SnapshotNotFoundError(
                        f"step {prepared.step} is no longer held: take its tensors before the next step"
                    )
            return prepared.tensors

    def _copy_held(self) -> HeldCopies:
        """The held state as the loader's copies: its own (to read, not to keep), or a copy of the
        bound module's."""
        if isinstance(self._sink, HeldCopies):
            return self._sink
        run = self.store.run()
        copies = HeldCopies(run, self.device)
        assert self._sink is not None
        for i, spec in enumerate(run.manifest.tensors):
            copies.write(i, 0, self._sink.read(i, 0, spec.numel).to(self.device))
        return copies

    def _materialize(self, prepared: StepPatch) -> HeldCopies:
        """A copy of the held state with the prepared patch applied."""
        run = self.store.run()
        copies = HeldCopies(run, self.device)
        if not all(p.whole for p in prepared.ranks):
            assert self._sink is not None
            for i, spec in enumerate(run.manifest.tensors):
                copies.write(i, 0, self._sink.read(i, 0, spec.numel).to(self.device))
        for rank, rank_patch in enumerate(prepared.ranks):
            patches.apply(run, rank, rank_patch, copies)
        return copies


def _resolve(device: torch.device) -> torch.device:
    """`device` with its index, if this machine has it: a missing GPU is an error now, and a
    follower's background thread works on this device, not on its thread's default one."""
    if device.type != "cuda":
        return device
    if not torch.cuda.is_available():
        raise ValueError(f"device {device} requested, but torch sees no CUDA device here (use device='cpu')")
    index = torch.cuda.current_device() if device.index is None else device.index
    if index >= torch.cuda.device_count():
        raise ValueError(f"device {device} requested, but torch sees {torch.cuda.device_count()} CUDA devices")
    return torch.device("cuda", index)
