"""The rollout side: rebuild a published step bit for bit, verify it, and only then use it.

For each rank of the step, the loader plans the cheapest path from the state it holds (or from a
base) by the sizes in commit markers (`paths.cheapest_path`), fetches only those parts, and decodes
forward.  Every object is checked against its commit marker's SHA-256; every part against the run
manifest's digest (a part of another run is never ours); every payload against the trainer's
value checksum (incrementally for intermediate steps, in full for the step returned).  Any
mismatch raises and leaves the loader's state, and any module, as it was: held steps are never
written to, and a step is decoded only into buffers no held step uses.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from . import codec
from . import format as fmt
from .checksum import checksum, checksum_update
from .errors import (
    ChainError,
    ChecksumError,
    DeltaError,
    FormatError,
    ModelMismatchError,
    SnapshotNotFoundError,
)
from .follow import FollowedStep, follow
from .paths import cheapest_path
from .replica import agree, exchange
from .shards import assemble, named_tensors
from .store import Store, as_store

__all__ = ["DeltaLoader", "LoadReport", "copy_into"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadReport:
    """What the last `state_dict` / `apply_to` call did."""

    step: int
    kind: fmt.Kind  # of the part rank 0 rebuilt the step with (its bridge is a delta)
    parts_read: int  # part objects fetched; 0 when the step was already held
    bytes_read: int  # every object read from the store for it: markers, manifest, parts
    tensors: int  # full tensors rebuilt and verified
    seconds: float  # fetch, decode and verification
    probe: tuple[float, ...] | None = None  # the trainer's probe log-probs at this step, if published

    def __repr__(self) -> str:  # the probe's values would drown the rest
        probe = "None" if self.probe is None else f"<{len(self.probe)} log-probs>"
        return (
            f"LoadReport(step={self.step}, kind={self.kind.value}, parts_read={self.parts_read}, "
            f"bytes_read={self.bytes_read}, tensors={self.tensors}, seconds={self.seconds:.3f}, probe={probe})"
        )


@dataclass(frozen=True)
class _Payload:
    bits: Tensor  # the payload's reconstructed elements, 1-D
    checksum: int


@dataclass(frozen=True)
class _RankState:
    header: fmt.PartHeader  # of the part it was rebuilt with last
    probe: tuple[float, ...] | None
    payloads: list[_Payload]


class DeltaLoader:
    """Read-only view of a published chain.

    Args:
        store: fsspec URL (a local path works) or a `Store`.
        device: where reconstruction happens and where returned tensors live: the staging
            buffers.  On the model's device, a swap is a device-local copy.
        process_group: the workers of one replica.  Each fetches a disjoint share of the
            objects and broadcasts it to the others (see `lightning_delta.replica`); all of them
            must then call `state_dict`, `apply_to` and `follow` together, for the same steps.
        progress: show a progress bar while a step is fetched from a base (first load, re-sync).

    It holds two copies of each rebuilt shard: the verified step, and the buffers of the step it
    replaced, which the next one is decoded into.  Returned tensors are copies of neither.
    """

    def __init__(
        self,
        store: str | Store,
        *,
        storage_options: Mapping[str, Any] | None = None,
        device: str | torch.device = "cpu",
        process_group: dist.ProcessGroup | None = None,
        progress: bool = False,
    ) -> None:
        self.store = as_store(store, storage_options)
        self.device = _usable(torch.device(device))
        self.group = process_group
        self.progress = progress
        self._states: dict[tuple[int, int], _RankState] = {}  # (rank, world) -> last verified
        # (rank, world) -> the buffers of the state last replaced, which nothing references any more
        # (`_assemble` copies): the next step decodes into them, since on the CPU a fresh buffer's
        # page faults cost as much as the decode itself.
        self._spare: dict[tuple[int, int], list[Tensor]] = {}
        self._fetched = 0  # parts read by the current call
        self._complete: set[int] = set()  # steps seen complete
        self.last_report: LoadReport | None = None

    def steps(self, after: int | None = None) -> list[int]:
        """Steps whose every rank part is committed, ascending; with `after`, only later ones.

        Parts are never rewritten, so a step seen complete stays complete until it is deleted:
        a poll lists the step folders and looks into only those not yet seen complete.  With
        `after` it lists only the blocks from `after`'s on (see `Store.published_steps`).
        """
        listed = self.store.published_steps(after)
        manifest = self.store.manifest()
        if manifest is None:
            if listed:
                raise FormatError(
                    f"{self.store.url} holds steps but no {fmt.RUN_MANIFEST}: not a {fmt.PART_FORMAT} chain"
                )
            return []
        if after is None:  # a full listing: steps deleted by retention drop out
            self._complete &= set(listed)
        for step in listed:
            if step not in self._complete and self.store.is_complete(step, manifest.world_size):
                self._complete.add(step)
        return [s for s in listed if s in self._complete]

    def state_dict(self, step: int | None = None) -> tuple[int, dict[str, Tensor]]:
        """(step, full tensors by name) of a complete step, `None` for the latest one, verified."""
        if step is None:
            steps = self.steps()
            step = steps[-1] if steps else -1
            if self.group is not None:  # every worker of the replica takes group rank 0's newest
                step = agree(step, self.group)
            if step < 0:
                raise SnapshotNotFoundError(f"no complete step in {self.store.url}")
        started, read_before, self._fetched = time.perf_counter(), self.store.bytes_read, 0
        run = self.store.manifest()
        if run is None or not (step in self._complete or self.store.is_complete(step, run.world_size)):
            raise SnapshotNotFoundError(f"step {step} is not completely published in {self.store.url}")
        world = run.world_size
        try:
            states = self._rebuild(step, world, from_held=True)
        except DeltaError as err:
            if not any(w == world for _, w in self._states):
                raise
            # The cheap path from the step held crosses damage; a base may still rebuild it.
            log.warning("step %d does not rebuild from the step held (%s); trying from its base", step, err)
            states = self._rebuild(step, world, from_held=False)
        tensors = _assemble(run, states)
        for rank, state in enumerate(states):
            replaced = self._states.get((rank, world))
            if replaced is not None and replaced is not state:  # the step held already is kept as is
                self._spare[(rank, world)] = [p.bits for p in replaced.payloads]
            self._states[(rank, world)] = state
        self.last_report = LoadReport(
            step=step,
            kind=states[0].header.kind,
            parts_read=self._fetched,
            bytes_read=self.store.bytes_read - read_before,
            tensors=len(tensors),
            seconds=time.perf_counter() - started,
            probe=states[0].probe,
        )
        return step, tensors

    def apply_to(
        self,
        module: nn.Module,
        step: int | None = None,
        *,
        rename: Callable[[str], str | None] | None = None,
        after: Callable[[nn.Module], None] | None = None,
    ) -> int:
        """Copy a verified step into `module`'s parameters and buffers in place; returns the step.

        `rename` maps a published name to the module's (None drops the tensor); `after` runs
        once the copy is done (an engine's post-load step).  Nothing is copied unless every name
        and shape matches.
        """
        step, tensors = self.state_dict(step)
        copy_into(module, tensors, step, rename=rename)
        if after is not None:
            after(module)
        return step

    def follow(
        self,
        *,
        poll_seconds: float = 1.0,
        prefetch: int = 1,
        max_staleness: int | None = None,
        catch_up: bool = False,
        jump: bool = True,
        timeout: float | None = None,
    ) -> Iterator[FollowedStep]:
        """Watch the store and yield each newer complete step, verified, as a `FollowedStep`.

        The next step is fetched and rebuilt in the background while the caller works on the
        current one (`prefetch` steps at most).  A follower that fell behind skips to the newest
        step; one whose chain broke waits for the next step that rebuilds.  `max_staleness` logs
        a warning when a step is more than that many published steps behind as it is handed out;
        with `catch_up` such a step is dropped and the follower waits for the newest one instead.
        `jump=False` hands out every complete step in order instead (a replay, for evaluation).
        `timeout` ends the iteration after that many seconds without a new step.  While
        following, the loader's other methods must not be called from another thread.  With a
        `process_group`, every worker of the replica follows, group rank 0 picks the steps, and
        the iteration ends for all of them when it ends for group rank 0.
        """
        return follow(
            self,
            poll_seconds=poll_seconds,
            prefetch=prefetch,
            max_staleness=max_staleness,
            catch_up=catch_up,
            jump=jump,
            timeout=timeout,
        )

    # ------------------------------------------------------------------ reconstruction

    def _rebuild(self, step: int, world: int, from_held: bool) -> list[_RankState]:
        chains = self._fetch(step, world, from_held)
        return [self._decode(step, rank, world, chain) for rank, chain in enumerate(chains)]

    def _fetch(self, step: int, world: int, from_held: bool) -> list[list[fmt.Part]]:
        """Per rank, the parts that lead from what is held (or a base) to `step`, newest first."""
        if self.group is None:
            ours = range(world)
        else:  # worker i of n fetches the parts of trainer ranks i, i + n, i + 2n, ...
            ours = range(dist.get_rank(self.group), world, dist.get_world_size(self.group))
        bar = None
        if self.progress and not any(w == world for _, w in self._states):  # from a base
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ours), desc=f"step {step}", unit="part", leave=False)
        try:
            if self.group is None:
                return [[part for _, part in self._walk(step, rank, world, from_held, bar)] for rank in ours]
            try:
                walked = {rank: self._walk(step, rank, world, from_held, bar) for rank in ours}
                mine: list[bytes] | BaseException = [len(c).to_bytes(8, "little") for c in walked.values()]
                mine += [blob for chain in walked.values() for blob, _ in chain]
            except Exception as err:  # shared with the group, so no worker waits in a broadcast
                mine = err
            received = _unpack_shares(exchange(mine, self.group), world)
            return [
                [part for _, part in walked[rank]] if rank in walked else self._parse(step, rank, world, blobs)
                for rank, blobs in enumerate(received)
            ]
        finally:
            if bar is not None:
                bar.close()

    def _walk(self, step: int, rank: int, world: int, from_held: bool, bar: Any = None) -> list[tuple[bytes, fmt.Part]]:
        """Fetch the cheapest path from the state held (or a base) to `step`: markers first, to
        plan, then only the blobs on the path."""
        held = self._states.get((rank, world)) if from_held else None
        path = cheapest_path(step, held.header.step if held else None, lambda s: self.store.part_refs(s, rank, world))
        chain = []
        for ref in path:
            blob = self.store.read_blob(ref, rank, world)
            chain.append((blob, self._part(self.store.parse_part(blob, ref, rank, world), rank, world)))
            self._fetched += 1
        if bar is not None:
            bar.update(1)
        return chain

    def _parse(self, step: int, rank: int, world: int, blobs: list[bytes]) -> list[fmt.Part]:
        """Parts from blobs another replica worker fetched, each checked to be where the chain
        says it is (newest first, from `step` along `prev_step`)."""
        parts, at = [], step
        for blob in blobs:
            try:
                part = fmt.decode_blob(blob)
            except FormatError as err:
                raise FormatError(f"{self.store.url}/{fmt.blob_path(at, rank, world)}: {err}") from None
            header = part.header
            if (header.step, header.rank, header.world_size) != (at, rank, world):
                raise FormatError(f"a replica worker sent step {header.step} rank {header.rank} for {at} rank {rank}")
            parts.append(self._part(part, rank, world))
            if header.kind == fmt.Kind.BASE:
                break
            assert header.prev_step is not None
            at = header.prev_step
        return parts

    def _part(self, part: fmt.Part, rank: int, world: int) -> fmt.Part:
        """`part`, if it belongs to the run that owns the prefix and fits its layout."""
        run = self.store.manifest()
        assert run is not None  # no step is complete without one
        header = part.header
        where = f"{self.store.url}/{fmt.blob_path(header.step, rank, world)}"
        if header.manifest != run.sha256:
            raise ChainError(
                f"{where} is a part of another run (its manifest {header.manifest[:12]}..., the prefix's "
                f"{run.sha256[:12]}..., run {run.run_id}): a foreign part"
            )
        if len(part.entries) != len(run.payloads[rank]):
            expected = len(run.payloads[rank])
            raise FormatError(f"{where} has {len(part.entries)} payloads, the run's layout {expected}")
        for entry, (numel, _) in zip(part.entries, run.payloads[rank], strict=True):
            if entry.changed > numel:
                raise FormatError(f"{where} says {entry.changed} of a payload's {numel} elements changed")
        return part

    def _decode(self, step: int, rank: int, world: int, parts: list[fmt.Part]) -> _RankState:
        """Apply `parts` (newest first, linked by `prev_step` and all of this run) to the held
        state or from their base, verifying every payload."""
        held = self._states.get((rank, world))
        state = None
        if not parts or parts[-1].header.kind == fmt.Kind.DELTA:
            at = parts[-1].header.prev_step if parts else step
            if held is None or held.header.step != at:
                raise ChainError(f"step {step} rank {rank}: the chain does not reach a base or the step held")
            state = held
        # Buffers of held steps are never decoded into, whatever the pool holds: held steps are
        # handed out again without re-verification.
        taken = {p.bits.data_ptr() for s in self._states.values() for p in s.payloads}
        spare = [None if b.data_ptr() in taken else b for b in self._spare.pop((rank, world), [])]
        for i, part in enumerate(reversed(parts)):
            previous = state
            state = self._apply(state, part, full_check=i == len(parts) - 1, spare=spare)
            # An intermediate step of a longer chain is free once the next is built from it.
            spare = [p.bits for p in previous.payloads] if previous is not None and previous is not held else []
        assert state is not None
        return state

    def _apply(
        self, state: _RankState | None, part: fmt.Part, full_check: bool, spare: list[Tensor | None]
    ) -> _RankState:
        header = part.header
        run = self.store.manifest()
        assert run is not None
        where = f"{self.store.url}/{fmt.blob_path(header.step, header.rank, header.world_size)}"
        payloads = []
        for i, (entry, data, (numel, dtype)) in enumerate(
            zip(part.entries, part.payloads, run.payloads[header.rank], strict=True)
        ):
            old = state.payloads[i] if header.kind == fmt.Kind.DELTA and state else None
            out = spare[i] if i < len(spare) else None
            if out is not None and (out.numel(), out.dtype) != (numel, dtype):
                out = None
            try:
                decoded = codec.decode_change(old.bits if old else None, data, numel=numel, dtype=dtype, out=out)
            except FormatError as err:
                raise FormatError(f"{where}: payload {i}: {err}") from None
            new = decoded.new.to(self.device)
            change = decoded.change
            if change is not None and change.index.numel() != entry.changed:
                raise FormatError(
                    f"{where}: payload {i} changes {change.index.numel()} elements, header says {entry.changed}"
                )
            if change is not None and old is not None and not full_check:
                value = checksum_update(old.checksum, change.index, change.old, change.new)
            else:
                value = checksum(new.view(torch.int16))
            if value != entry.checksum:
                tensors = run.manifest.tensors
                names = [tensors[s.tensor].name for s in run.manifest.ranks[header.rank][i]]
                raise ChecksumError(
                    f"{where}: payload {i} ({', '.join(names[:4])}) does not reproduce the trainer's checksum"
                )
            payloads.append(_Payload(new, value))
        return _RankState(header, part.probe, payloads)


def _usable(device: torch.device) -> torch.device:
    """`device`, if this machine has it: a missing GPU is an error now, not at the first load."""
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device} requested, but torch sees no CUDA device here (use device='cpu')")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"device {device} requested, but torch sees {torch.cuda.device_count()} CUDA devices")
    return device


def copy_into(
    module: nn.Module,
    tensors: Mapping[str, Tensor],
    step: int,
    *,
    rename: Callable[[str], str | None] | None = None,
) -> float:
    """Copy verified full tensors into `module` in place; nothing is copied unless all fit.

    `rename` maps a published name to the module's (None drops it).  Returns the seconds the
    copy took: the pause a caller sees when the step was staged in the background.
    """
    if rename is not None:
        renamed = {}
        for name, tensor in tensors.items():
            target = rename(name)
            if target is not None:
                renamed[target] = tensor
        tensors = renamed
    targets = named_tensors(module)
    missing, unexpected = sorted(targets.keys() - tensors.keys()), sorted(tensors.keys() - targets.keys())
    wrong = [n for n in targets.keys() & tensors.keys() if targets[n].shape != tensors[n].shape]
    if missing or unexpected or wrong:
        raise ModelMismatchError(
            f"step {step} does not fit {type(module).__name__}: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}, wrong shape {wrong[:5]}"
        )
    started = time.perf_counter()
    with torch.no_grad():
        for name, target in targets.items():
            target.copy_(tensors[name])
    if any(t.is_cuda for t in targets.values()):
        torch.cuda.synchronize()
    return time.perf_counter() - started


def _unpack_shares(received: list[list[bytes]], world: int) -> list[list[bytes]]:
    """Per trainer rank, its chain, from what each replica worker broadcast: the chain lengths of
    its ranks (8-byte little-endian each), then their blobs back to back."""
    chains: list[list[bytes]] = [[] for _ in range(world)]
    for src, blobs in enumerate(received):
        ranks = range(src, world, len(received))
        lengths = [int.from_bytes(b, "little") for b in blobs[: len(ranks)]]
        rest = iter(blobs[len(ranks) :])
        for rank, length in zip(ranks, lengths, strict=True):
            chains[rank] = [next(rest) for _ in range(length)]
    return chains


def _assemble(run: fmt.Run, states: list[_RankState]) -> dict[str, Tensor]:
    """Full tensors from every rank's payloads, placed as the run manifest's layout says."""
    tensors = run.manifest.tensors
    pieces: dict[int, list[tuple[int, Tensor]]] = {}
    for state, layout in zip(states, run.manifest.ranks, strict=True):
        for payload, slices in zip(state.payloads, layout, strict=True):
            at = 0
            for s in slices:
                pieces.setdefault(s.tensor, []).append((s.start, payload.bits[at : at + s.numel]))
                at += s.numel
    return {
        tensors[i].name: assemble(tensors[i].name, tensors[i].shape, fmt.DTYPE_NAMES[tensors[i].dtype], pieces[i])
        for i in sorted(pieces, key=lambda i: tensors[i].name)
    }
