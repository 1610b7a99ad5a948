"""The plan of an engine follower's writes: which payloads the group walks in place or whole, and
this worker's segment table of each (`sparse_walk.SEGMENT_FIELDS`), made once when the follower
starts (`Plan`), with the kept copies of the tensors the engine's map refuses.

A table maps a payload's positions to where this worker holds them: a run of a parameter, or a
block of rows and columns of a 2-D one (a tensor-parallel slice), and the kept copy of a refused
tensor.  Every worker of a group walks the same payloads, or its partial sums would not line up:
a payload is walked only where every worker has a table for it and its walker takes it.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Mapping, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from . import codec, sparse_walk, whole_walk
from . import format as fmt
from .apply import ApplyBackend, Payload, Walker
from .errors import ModelMismatchError, SnapshotNotFoundError, first_names
from .group import gather_json
from .patch import PayloadView, RankState
from .torch_path import flat_bits
from .viewmap import ViewMap

__all__ = ["Plan", "Table", "held_bits", "segment_table", "segment_tables"]

log = logging.getLogger(__name__)

_MASK64 = (1 << 64) - 1

Table = tuple[sparse_walk.Segments, list[str | int]]
"""A payload's segment table and the arrays its rows name: a parameter by name, or the kept copy
of a refused tensor by its index in the manifest."""


class Plan:
    """One worker's plan of a chain over the engine: where each payload's positions lie (`views`),
    which payloads the group walks (`tables`, agreed by every worker when it is made; `backend`:
    the `ApplyBackend` asked for, resolved), and the kept copies of the tensors the map refuses
    (`kept`: full int16 copies, filled by the first write, which the engine's reload takes)."""

    def __init__(
        self,
        url: str,
        run: fmt.Run,
        views: Sequence[Sequence[PayloadView]],
        view_map: ViewMap,
        owned: Mapping[str, Sequence[bool]],
        rank: int,
        walker: Walker,
        backend: ApplyBackend,
        group: dist.ProcessGroup | None,
        device: torch.device,
    ) -> None:
        self.url, self.run, self.views, self.map, self.owned, self.device = url, run, views, view_map, owned, device
        self.names = [t.name for t in run.manifest.tensors]
        self.shapes = [t.shape for t in run.manifest.tensors]
        self.kept: dict[int, Tensor] = {}
        self.tables = segment_tables(self.views, self.names, self.shapes, view_map, owned, rank, walker, group)
        self.walks_whole = device.type == "cpu" and sparse_walk.AVAILABLE and backend != ApplyBackend.TORCH
        """Whether base steps' RAW payloads are walked whole (numba, on the CPU): by the backend
        asked for (`backend`), not the walker it gave, so the same on every worker of a group,
        whose protocol depends on it, even where one worker's device walk failed its proof."""
        if self.tables and self.walks_whole:
            sparse_walk.compile()  # seconds, once per machine (numba caches it): not in the first update
            whole_walk.compile()

    def table(self, rank: int, i: int) -> Table | None:
        """Payload `i` of `rank` as a walk's segment table and the arrays it names (a parameter by
        name, the kept copy of a refused tensor by its index), or None where it is not walked."""
        return self.tables.get((rank, i))

    def walkable(self, rank: int, i: int, parts: tuple[fmt.Part, ...]) -> bool:
        """Whether payload `i` of `rank` is walked in place (`apply`): SPARSE payloads from the state
        held (the chain checks that it starts there), one step after another (a follower one step
        late walks two, each at the cost of its change, rather than composing them through torch),
        into tensors the map holds as runs or 2-D blocks."""
        return (
            bool(parts)
            and all(
                p.header.kind == fmt.Kind.DELTA and codec.mode_of(p.payloads[i]) == codec.Mode.SPARSE for p in parts
            )
            and self.table(rank, i) is not None
        )

    def whole_walkable(self, rank: int, i: int, parts: tuple[fmt.Part, ...]) -> bool:
        """Whether payload `i` of `rank` is walked whole (`whole_walk`): on the CPU with numba, one RAW payload
        of a step loaded from its base, into tensors the map holds as runs or 2-D blocks."""
        return (
            len(parts) == 1
            and self.walks_whole
            and codec.mode_of(parts[0].payloads[i]) == codec.Mode.RAW
            and self.table(rank, i) is not None
        )

    def payloads(self, rank: int, i: int, parts: Sequence[fmt.Part], held: RankState) -> list[Payload]:
        """Payload `i` of each of `rank`'s parts, in chain order, each one step from the one before
        (walked in that order, taken back in the reverse)."""
        before = [held.checksums[i]] + [part.entries[i].checksum for part in parts[:-1]]
        return [self.payload(rank, i, part, b) for part, b in zip(parts, before, strict=True)]

    def payload(self, rank: int, i: int, part: fmt.Part, before: int) -> Payload:
        """Payload `i` of `rank`'s part, one step from a state whose checksum of it is `before`, as
        a walk takes it."""
        view, table = self.views[rank][i], self.table(rank, i)
        assert table is not None
        entry = part.entries[i]
        return Payload(
            key=(rank, i),
            data=part.payloads[i],
            numel=view.numel,
            dtype=view.dtype,
            changed=entry.changed,
            segments=table[0],
            names=tuple(table[1]),
            moved=(entry.checksum - before) & _MASK64,
            where=f"{self.url} rank {rank} step {part.header.step}: payload {i}",
        )

    def target(self, params: Mapping[str, Tensor], name: str | int) -> Tensor:
        """What a walk writes: a parameter (by name) or the kept copy of a refused tensor (by
        index), as flat int16."""
        if isinstance(name, str):
            return held_bits(params[name], name)
        if name not in self.kept:
            raise SnapshotNotFoundError(f"{self.names[name]} is not held yet")
        return self.kept[name]

    def keep(self, tensor: int) -> None:
        """Make the kept copy of refused tensor `tensor` (zeros) if there is none yet."""
        self.kept.setdefault(tensor, torch.zeros(self.run.manifest.tensors[tensor].numel, dtype=torch.int16))

    def kept_tensors(self) -> dict[str, Tensor]:
        """The kept copies as the checkpoint's tensors (what the engine's reload takes)."""
        specs = self.run.manifest.tensors
        return {
            specs[i].name: bits.view(fmt.DType(specs[i].dtype).torch).view(specs[i].shape)
            for i, bits in self.kept.items()
        }

    def where(self, rank: int, i: int, step: int) -> str:
        """Payload `i` of `rank` at `step` for a message: where it is and its first tensors."""
        names = [self.names[s.tensor] for s in self.views[rank][i].slices]
        return f"{self.url} rank {rank} step {step}: payload {i} ({first_names(names)})"


def held_bits(tensor: Tensor, name: str) -> Tensor:
    """A parameter's elements as flat int16; one left on the meta device (an engine reload that
    did not finish) holds nothing to write into."""
    if tensor.is_meta:
        raise ModelMismatchError(
            f"{name} is on the meta device (the engine's reload did not finish): restart the engine"
        )
    return flat_bits(tensor)


def segment_tables(
    views: Sequence[Sequence[PayloadView]],
    names: Sequence[str],
    shapes: Sequence[Sequence[int]],
    view_map: ViewMap,
    owned: Mapping[str, Sequence[bool]],
    rank: int,
    walker: Walker,
    group: dist.ProcessGroup | None,
) -> dict[tuple[int, int], Table]:
    """The payloads (trainer rank, payload) every worker of the group walks, with this worker's
    tables (every worker calls this together)."""
    tables = {}
    mine: list[tuple[int, int]] | Exception
    try:
        for trainer, payloads in enumerate(views):
            for i, view in enumerate(payloads):
                table = segment_table(view, names, shapes, view_map, owned, rank)
                if table is not None and walker.takes(table[1]):
                    tables[trainer, i] = table
        mine = sorted(tables)
    except Exception as err:
        mine = err
    walkable = set(tables)
    theirs = gather_json(group, mine)
    for listed in theirs:
        walkable &= {(trainer, i) for trainer, i in listed}
    if tables and not walkable:
        log.warning(
            "lightning_delta: workers %s of the group walk no payload (their walker takes none of them: the device "
            "walk takes no kept copy on a GPU): every worker decodes with torch before it writes (exact, slower)",
            [worker for worker, listed in enumerate(theirs) if not listed],
        )
    return {key: tables[key] for key in sorted(walkable)}


def segment_table(
    view: PayloadView,
    names: Sequence[str],
    shapes: Sequence[Sequence[int]],
    view_map: ViewMap,
    owned: Mapping[str, Sequence[bool]],
    rank: int,
) -> Table | None:
    """`view`'s table on this worker (group rank `rank`), or None where a tensor is held in a
    way a walk cannot address (neither runs nor 2-D blocks, or blocks side by side)."""
    rows: list[list[int]] = []
    arrays: dict[str | int, int] = {}
    for s, offset in zip(view.slices, view.offsets, strict=False):
        name, shape = names[s.tensor], shapes[s.tensor]
        if name not in view_map.boxes:  # the kept copy: counted once, by group rank 0
            kept = arrays.setdefault(s.tensor, len(arrays))
            rows.append([offset, offset + s.numel, kept, s.start, 0, 0, 0, 0, 0, 0, 0, int(rank == 0)])
            continue
        for box, mine in zip(view_map.boxes[name], owned[name], strict=True):
            param, first = arrays.setdefault(box.param, len(arrays)), box.run_start(shape)
            if first is not None:  # a run of the tensor
                lo, hi = max(first, s.start), min(first + box.numel, s.start + s.numel)
                geometry = [box.offset + lo - first, 0, 0, 0, 0, 0, 0, 0]
            elif len(shape) == 2 and box.strides[1] == 1:  # a block of rows and columns
                columns, row = shape[1], box.start[0]
                lo, hi = max(row * columns, s.start), min((row + box.shape[0]) * columns, s.start + s.numel)
                geometry = [box.offset, lo, columns, row, box.shape[0], box.start[1], box.shape[1], box.strides[0]]
            else:
                return None
            if hi > lo:
                rows.append([offset + lo - s.start, offset + hi - s.start, param, *geometry, int(mine)])
    rows.sort()
    if any(a[1] > b[0] for a, b in itertools.pairwise(rows)):
        return None  # several blocks of one tensor side by side: more than one segment a position
    rows_array = np.array(rows, dtype=np.int64).reshape(-1, len(sparse_walk.SEGMENT_FIELDS))
    return sparse_walk.Segments(rows_array, view.numel), list(arrays)
