"""The rollout side: rebuild a published step bit for bit, verify it, and only then use it.

For each rank of the step, the loader walks that rank's chain back to its base (or to the state
it already holds), then decodes forward.  Every object is checked against its commit marker's
SHA-256; every part against the run manifest's run id (a part of another run is never ours);
every slice against the trainer's value checksum (incrementally for intermediate steps, in full
for the step returned).  Any mismatch raises and leaves the loader's state, and any module, as
it was: held steps are never written to, and a step is decoded only into buffers no held step uses.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from . import codec
from . import format as fmt
from .checksum import checksum, checksum_update, parse_checksum
from .errors import (
    ChainError,
    ChecksumError,
    FormatError,
    ModelMismatchError,
    SnapshotNotFoundError,
)
from .follow import FollowedStep, follow
from .replica import agree, exchange
from .shards import assemble, named_tensors
from .store import Store, as_store

__all__ = ["DeltaLoader", "LoadReport", "copy_into"]


@dataclass(frozen=True)
class LoadReport:
    """What the last `state_dict` / `apply_to` call did."""

    step: int
    kind: fmt.Kind  # of the step itself (rank 0's part)
    parts_read: int  # objects fetched; 0 when the step was already held
    payload_bytes: int  # tensor payload bytes fetched
    tensors: int  # full tensors rebuilt and verified
    seconds: float  # fetch, decode and verification
    probe: tuple[float, ...] | None = None  # the trainer's probe log-probs at this step, if published

    def __repr__(self) -> str:  # the probe's values would drown the rest
        probe = "None" if self.probe is None else f"<{len(self.probe)} log-probs>"
        return (
            f"LoadReport(step={self.step}, kind={self.kind.value}, parts_read={self.parts_read}, "
            f"payload_bytes={self.payload_bytes}, tensors={self.tensors}, seconds={self.seconds:.3f}, probe={probe})"
        )


@dataclass(frozen=True)
class _Payload:
    bits: Tensor  # the payload's reconstructed elements, 1-D
    checksum: int


_Part = tuple[fmt.PartHeader, memoryview]  # a part's validated header and its payload area


@dataclass(frozen=True)
class _RankState:
    header: fmt.PartHeader
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
        self._fetched: list[fmt.PartHeader] = []
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
        manifest = self.store.manifest()
        if manifest is None or not (step in self._complete or self.store.is_complete(step, manifest.world_size)):
            raise SnapshotNotFoundError(f"step {step} is not completely published in {self.store.url}")
        world = manifest.world_size
        started, self._fetched = time.perf_counter(), []
        chains = self._fetch(step, world)
        states = [self._decode(step, rank, world, chain) for rank, chain in enumerate(chains)]
        tensors = _assemble(states)
        for rank, state in enumerate(states):
            replaced = self._states.get((rank, world))
            if replaced is not None and replaced is not state:  # the step held already is kept as is
                self._spare[(rank, world)] = [p.bits for p in replaced.payloads]
            self._states[(rank, world)] = state
        self.last_report = LoadReport(
            step=step,
            kind=states[0].header.kind,
            parts_read=len(self._fetched),
            payload_bytes=sum(h.payload_bytes for h in self._fetched),
            tensors=len(tensors),
            seconds=time.perf_counter() - started,
            probe=states[0].header.probe,
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

    def _fetch(self, step: int, world: int) -> list[list[_Part]]:
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
                return [[(h, p) for _, h, p in self._walk(step, rank, world, bar)] for rank in ours]
            try:
                walked = {rank: self._walk(step, rank, world, bar) for rank in ours}
                mine: list[bytes] | BaseException = [len(c).to_bytes(8, "little") for c in walked.values()]
                mine += [blob for chain in walked.values() for blob, _, _ in chain]
            except Exception as err:  # shared with the group, so no worker waits in a broadcast
                mine = err
            received = _unpack_shares(exchange(mine, self.group), world)
            return [
                [(h, p) for _, h, p in walked[rank]] if rank in walked else self._parse(step, rank, world, blobs)
                for rank, blobs in enumerate(received)
            ]
        finally:
            if bar is not None:
                bar.close()

    def _walk(
        self, step: int, rank: int, world: int, bar: Any = None
    ) -> list[tuple[bytes, fmt.PartHeader, memoryview]]:
        """Follow `prev_step` links back from `step` to a base or to the state already held."""
        chain: list[tuple[bytes, fmt.PartHeader, memoryview]] = []
        at, last = step, None
        held = self._states.get((rank, world))
        while True:
            if held and held.header.step == at:
                return chain
            try:
                blob = self.store.read_blob(at, rank, world)
            except SnapshotNotFoundError:
                if last is None:
                    raise
                raise ChainError(
                    f"step {last.step} rank {rank} is a delta against step {at}, "
                    "which is not in the store (deleted, or its upload never finished)"
                ) from None
            header, payload = self._part(blob, at, rank, world)
            chain.append((blob, header, payload))
            self._fetched.append(header)
            if header.kind == fmt.Kind.BASE:
                if bar is not None:
                    bar.update(1)
                return chain
            at, last = header.prev_step, header

    def _parse(self, step: int, rank: int, world: int, blobs: list[bytes]) -> list[_Part]:
        """Parts from blobs another replica worker fetched, each checked to be where the chain
        says it is (newest first, from `step` along `prev_step`)."""
        parts, at = [], step
        for blob in blobs:
            header, payload = self._part(blob, at, rank, world)
            parts.append((header, payload))
            if header.kind == fmt.Kind.BASE:
                break
            at = header.prev_step
        return parts

    def _part(self, blob: bytes, step: int, rank: int, world: int) -> _Part:
        """A part's header and payload area, if the part is where it claims and of this run."""
        header, payload = self.store.parse_part(blob, step, rank, world)
        manifest = self.store.manifest()
        assert manifest is not None  # no step is complete without one
        if header.run_id != manifest.run_id:
            raise ChainError(
                f"{self.store.url}/{fmt.blob_path(step, rank, world)} is a part of run {header.run_id}, "
                f"not of {manifest.run_id}, the run that owns the prefix: a foreign part"
            )
        return header, payload

    def _decode(self, step: int, rank: int, world: int, parts: list[_Part]) -> _RankState:
        """Apply `parts` (newest first, linked by `prev_step` and all of this run) to the held
        state or from their base, verifying every payload."""
        held = self._states.get((rank, world))
        state = None
        if not parts or parts[-1][0].kind == fmt.Kind.DELTA:
            at = parts[-1][0].prev_step if parts else step
            if held is None or held.header.step != at:
                raise ChainError(f"step {step} rank {rank}: the chain does not reach a base or the step held")
            state = held
        # Buffers of held steps are never decoded into, whatever the pool holds: held steps are
        # handed out again without re-verification.
        taken = {p.bits.data_ptr() for s in self._states.values() for p in s.payloads}
        spare = [None if b.data_ptr() in taken else b for b in self._spare.pop((rank, world), [])]
        for i, (header, payload) in enumerate(reversed(parts)):
            previous = state
            state = self._apply(state, header, payload, full_check=i == len(parts) - 1, spare=spare)
            # An intermediate step of a longer chain is free once the next is built from it.
            spare = [p.bits for p in previous.payloads] if previous is not None and previous is not held else []
        assert state is not None
        return state

    def _apply(
        self,
        state: _RankState | None,
        header: fmt.PartHeader,
        payload: memoryview,
        full_check: bool,
        spare: list[Tensor | None],
    ) -> _RankState:
        where = f"{self.store.url}/{fmt.blob_path(header.step, header.rank, header.world_size)}"
        if header.kind == fmt.Kind.DELTA:
            assert state is not None
            sizes = [p.numel for p in header.payloads]
            if header.tensors != state.header.tensors or sizes != [p.numel for p in state.header.payloads]:
                raise ChainError(f"{where}: its slices differ from those of its predecessor step {header.prev_step}")
        dtypes = {t.payload: fmt.DTYPE_NAMES[t.dtype] for t in header.tensors}  # every payload has slices
        payloads = []
        for i, entry in enumerate(header.payloads):
            data = payload[entry.offset : entry.offset + entry.length]
            old = state.payloads[i] if header.kind == fmt.Kind.DELTA and state else None
            out = spare[i] if i < len(spare) else None
            if out is not None and (out.numel(), out.dtype) != (entry.numel, dtypes[i]):
                out = None
            try:
                decoded = codec.decode_change(
                    old.bits if old else None, data, numel=entry.numel, dtype=dtypes[i], out=out
                )
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
            if value != parse_checksum(entry.checksum):
                names = sorted({t.name for t in header.tensors if t.payload == i})
                raise ChecksumError(
                    f"{where}: payload {i} ({', '.join(names[:4])}) does not reproduce the trainer's checksum"
                )
            payloads.append(_Payload(new, value))
        return _RankState(header, payloads)


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


def _assemble(states: list[_RankState]) -> dict[str, Tensor]:
    pieces: dict[str, list[tuple[int, Tensor]]] = {}
    meta: dict[str, tuple[str, tuple[int, ...]]] = {}
    for state in states:
        for entry in state.header.tensors:
            if meta.setdefault(entry.name, (entry.dtype, entry.shape)) != (entry.dtype, entry.shape):
                raise FormatError(f"{entry.name}: ranks disagree on its dtype or shape")
            bits = state.payloads[entry.payload].bits[entry.at : entry.at + entry.numel]
            pieces.setdefault(entry.name, []).append((entry.start, bits))
    return {
        name: assemble(name, meta[name][1], fmt.DTYPE_NAMES[meta[name][0]], pieces[name]) for name in sorted(pieces)
    }
