"""Where each checkpoint tensor lives in an engine's parameters, read off the engine's own loader.

An inference engine's parameters are not the checkpoint's tensors: it fuses q/k/v and gate/up,
slices them for tensor parallelism, pads vocabularies.  Its loader knows the mapping, so
`ViewMap.learn` reads it off: it hands the loader a meta tensor of each checkpoint tensor and
records, in a dispatch mode of the calling thread alone (never a patched `Tensor.copy_`), the copies
the loader makes from it, without making them.  A copy from a block of the checkpoint tensor (a
`narrow` of it, nothing computed) into a block of one parameter of the same dtype is a `Box`; a
tensor whose every copy is one is mapped.  Anything else is refused, tensor by tensor, with the
reason: a cast, a transpose, a loader that computes or fails, a layer that computes from a packed
copy of its weight.  Pure bookkeeping and index arithmetic: no engine is imported here.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["Box", "ViewMap"]

_CHUNK = 1 << 22  # elements of a block handled at a time where its positions are enumerated


@dataclass(frozen=True)
class Box:
    """A block of a checkpoint tensor (`start` and `shape` per dimension) that lives in parameter
    `param` at flat element `offset`, with the parameter's `strides` over the block's dimensions."""

    start: tuple[int, ...]
    shape: tuple[int, ...]
    param: str
    offset: int
    strides: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def region(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """What part of the checkpoint tensor it holds (the same for every worker that holds it)."""
        return self.start, self.shape

    def run_start(self, tensor_shape: Sequence[int]) -> int | None:
        """Where the box starts in the flat checkpoint tensor, if its elements lie there in one run
        in the parameter's order (whole rows, laid out as in the checkpoint: a whole tensor, a
        slice of rows); None otherwise."""
        whole_rows = self.start[1:] == (0,) * (len(self.start) - 1) and tuple(self.shape[1:]) == tuple(tensor_shape[1:])
        if not whole_rows or tuple(self.strides) != tuple(_row_major(self.shape)):
            return None
        return self.start[0] * _row_major(tensor_shape)[0] if self.start else 0

    def locate(self, index: Tensor, tensor_shape: Sequence[int]) -> tuple[slice | Tensor, Tensor]:
        """Of the ascending flat checkpoint positions `index`, which lie in the box (a slice of
        `index` where it is one run, else a mask), and where those are in the parameter's flat
        storage (in the order of `index`)."""
        first = self.run_start(tensor_shape)
        if first is not None:  # a shift
            bounds = torch.tensor([first, first + self.numel], dtype=index.dtype, device=index.device)
            lo, hi = torch.searchsorted(index, bounds).tolist()
            return slice(lo, hi), index[lo:hi] + (self.offset - first)
        strides = _row_major(tensor_shape)
        inside = torch.ones(index.numel(), dtype=torch.bool, device=index.device)
        target = torch.full_like(index, self.offset)
        for size, stride, start, extent, step in zip(
            tensor_shape, strides, self.start, self.shape, self.strides, strict=True
        ):
            at = (index // stride) % size - start
            inside &= (at >= 0) & (at < extent)
            target += at * step
        return inside, target[inside]

    def positions(self, tensor_shape: Sequence[int]) -> Iterator[tuple[Tensor, Tensor]]:
        """The box's elements in chunks of rows: (their flat checkpoint positions, their flat
        positions in the parameter), row-major over the block."""
        strides = _row_major(tensor_shape)
        base = sum(s * t for s, t in zip(self.start, strides, strict=True))
        if not self.shape:  # a scalar
            yield torch.tensor([base]), torch.tensor([self.offset])
            return
        rows = max(1, _CHUNK // max(math.prod(self.shape[1:]), 1))
        for first in range(0, self.shape[0], rows):
            dims = (min(rows, self.shape[0] - first), *self.shape[1:])
            source = torch.tensor(base + first * strides[0])
            target = torch.tensor(self.offset + first * self.strides[0])
            for dim, extent in enumerate(dims):
                steps, view = torch.arange(extent), [1] * len(dims)
                view[dim] = extent
                source = source + (steps * strides[dim]).view(view)
                target = target + (steps * self.strides[dim]).view(view)
            yield source.reshape(-1), target.reshape(-1)


@dataclass
class ViewMap:
    """Per checkpoint tensor, the boxes this worker's parameters hold of it; and the tensors refused."""

    boxes: dict[str, tuple[Box, ...]]
    refused: dict[str, str]  # checkpoint tensor name -> why it is not a plain view
    homes: dict[str, frozenset[str]] = field(default_factory=dict)
    """The parameters the loader copied each tensor into, mapped or refused: which modules it is in."""
    by_module: bool = False
    """Whether a module goes in place or through the reload as a whole (`_whole_modules`)."""

    @classmethod
    def learn(
        cls,
        specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
        load: Callable[[str, Tensor], None],
        params: Mapping[str, Tensor],
        refuse: Callable[[str], str | None] = lambda param: None,
        *,
        by_module: bool = False,
    ) -> ViewMap:
        """Run `load(name, tensor)` (the engine's loader) on a meta tensor of each checkpoint tensor
        in `specs` and keep the plain views it makes into `params`; `refuse(param)` may name a
        reason a parameter cannot be written in place (its layer computes from a packed copy).
        With `by_module` (an engine whose reload rebuilds each module it touches from what it
        receives, as vLLM's layerwise reload does), a module goes one way or the other as a whole."""
        by_storage: dict[int, list[tuple[str, Tensor]]] = {}  # parameters may share a storage
        for param_name, t in params.items():
            if t.numel():
                by_storage.setdefault(t.untyped_storage().data_ptr(), []).append((param_name, t))
        boxes: dict[str, tuple[Box, ...]] = {}
        refused: dict[str, str] = {}
        homes: dict[str, frozenset[str]] = {}
        for name, (shape, dtype) in specs.items():
            probe = torch.empty(shape, dtype=dtype, device="meta")
            recorder = _Copies(probe)
            try:
                with torch.no_grad(), recorder:
                    load(name, probe)
            except Exception as err:  # the loader cannot take it as it is: not a plain view
                refused[name] = f"the loader failed on it ({type(err).__name__}: {str(err)[:120]})"
                continue
            finally:
                homes[name] = frozenset(
                    home[0] for dst, _ in recorder.copies if not dst.is_meta and (home := _home(dst, by_storage))
                )
            try:
                found = tuple(_box(probe, dst, src, by_storage, refuse) for dst, src in recorder.copies)
                if not found:
                    raise _NotAView("the loader copied it nowhere")
                if sum(b.numel for b in found) > probe.numel() or _overlap(found):
                    raise _NotAView("the loader wrote parts of it twice")
            except _NotAView as why:
                refused[name] = str(why)
                continue
            boxes[name] = found
        view_map = cls(boxes, refused, homes, by_module)
        view_map._whole_modules()
        return view_map

    def refuse_derived(self, model: torch.nn.Module) -> None:
        """Refuse every tensor written into a parameter whose values feed copies made after loading.

        A module that holds a parameter no checkpoint tensor was copied into (one its processing
        computed after loading: MLA's `W_UK_T` and `W_UV`, derived from `kv_b_proj`) may compute it
        from any parameter below it; written in place, those would leave the copy stale.  So every
        loaded parameter of such a module, its submodules' included (by identity: a submodule may
        be registered under two names), goes through the reload, which processes the module again.
        """
        loaded = {b.param for found in self.boxes.values() for b in found}
        loaded |= {p for params in self.homes.values() for p in params}
        by_id = {id(t): name for name, t in model.named_parameters(remove_duplicate=False) if name in loaded}
        feeding: dict[str, str] = {}
        for prefix, module in model.named_modules():
            derived = [n for n, t in module.named_parameters(recurse=False) if t.numel() and id(t) not in by_id]
            if not derived:
                continue
            for t in module.parameters():
                if id(t) in by_id:
                    feeding.setdefault(by_id[id(t)], f"{prefix}.{derived[0]}" if prefix else derived[0])
        for name in [n for n, found in self.boxes.items() if any(b.param in feeding for b in found)]:
            param = next(b.param for b in self.boxes.pop(name) if b.param in feeding)
            self.refused[name] = f"{param} feeds {feeding[param]}, a copy made after loading"
        self._whole_modules()

    def describe(self) -> dict[str, list[list[list[int]]]]:
        """The regions this worker holds, by tensor (what workers compare to settle ownership)."""
        return {name: [[list(b.start), list(b.shape)] for b in found] for name, found in self.boxes.items()}

    def settle(
        self, described: Sequence[Mapping[str, list[list[list[int]]]]], rank: int, specs: Mapping[str, tuple]
    ) -> dict[str, tuple[bool, ...]]:
        """Given every worker's `describe()` (by rank), refuse the tensors some worker could not
        map, or whose regions do not tile the tensor (overlapping without being equal, or with a
        hole); and, per box of the others, whether this worker owns it: the lowest rank holding a
        region counts its elements once in every checksum."""
        owned: dict[str, tuple[bool, ...]] = {}
        for name in list(self.boxes):
            held = [set(map(_region, worker.get(name, []))) for worker in described]
            if not all(held):
                self.refused[name] = "not every tensor-parallel worker holds it as plain views"
                del self.boxes[name]
                continue
            regions = set().union(*held)
            shape = tuple(specs[name][0])
            if sum(math.prod(r[1]) for r in regions) != math.prod(shape) or _overlap_regions(list(regions)):
                self.refused[name] = "the workers' blocks of it do not tile it exactly"
                del self.boxes[name]
                continue
            owned[name] = tuple(min(w for w, h in enumerate(held) if b.region in h) == rank for b in self.boxes[name])
        for name in set().union(*(w.keys() for w in described)) - self.boxes.keys() - self.refused.keys():
            self.refused[name] = "another tensor-parallel worker could not map it"
        self._whole_modules()  # the same on every worker: they refuse the same tensors, of the same modules
        return {name: mine for name, mine in owned.items() if name in self.boxes}

    def _whole_modules(self) -> None:
        """Refuse every tensor of a module that holds a refused one.  An engine's layerwise reload
        rebuilds each module it touches from what it receives (vLLM's moves whole modules to the
        meta device): a tensor written in place beside a reloaded one would come back as
        uninitialised memory, so a module goes in place, or through the reload, as a whole."""
        while self.by_module:
            reloaded = {_module(p) for name in self.refused for p in self.homes.get(name, ())}
            joining = [
                name
                for name, found in self.boxes.items()
                if {_module(p) for p in self.homes.get(name, frozenset(b.param for b in found))} & reloaded
            ]
            if not joining:
                return
            for name in joining:
                modules = sorted({_module(b.param) for b in self.boxes.pop(name)} & reloaded)
                self.refused[name] = f"its module ({modules[0]}) is reloaded, as a whole, for another of its tensors"


class _NotAView(Exception):
    pass


class _Copies(TorchDispatchMode):
    """Records, and skips, the copies made from views of `probe` while it is active (this thread
    only); every other operation runs as usual."""

    def __init__(self, probe: Tensor) -> None:
        super().__init__()
        self.storage = probe.untyped_storage()._cdata
        self.copies: list[tuple[Tensor, Tensor]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.copy_.default:
            dst, src = args[0], args[1]
            if src.is_meta and src.untyped_storage()._cdata == self.storage:
                self.copies.append((dst, src))
                return dst
        return func(*args, **kwargs)


def _box(
    probe: Tensor,
    dst: Tensor,
    src: Tensor,
    by_storage: Mapping[int, list[tuple[str, Tensor]]],
    refuse: Callable[[str], str | None],
) -> Box:
    """The box of one recorded copy, or `_NotAView` with the reason."""
    if src.dtype != probe.dtype or dst.dtype != src.dtype:
        raise _NotAView(f"the loader casts it ({src.dtype} into {dst.dtype})")
    if src.dim() != probe.dim() or src.stride() != probe.stride() or tuple(dst.shape) != tuple(src.shape):
        raise _NotAView("the loader reshapes or transposes it")
    home = None if dst.is_meta else _home(dst, by_storage)
    if home is None:
        raise _NotAView("the loader copies it into something that is not a parameter")
    param, tensor = home
    if not tensor.is_contiguous():
        raise _NotAView(f"{param} is not contiguous")
    why = refuse(param)
    if why is not None:
        raise _NotAView(why)
    start, rest = [], int(src.storage_offset())
    for stride in probe.stride():
        start.append(rest // stride if stride else 0)
        rest = rest % stride if stride else rest
    offset = int(dst.storage_offset()) - int(tensor.storage_offset())
    last = offset + sum((n - 1) * s for n, s in zip(dst.shape, dst.stride(), strict=True)) if dst.numel() else offset
    if offset < 0 or last >= tensor.numel() or min(dst.stride(), default=0) < 0:
        raise _NotAView(f"the loader copies it past the ends of {param}")
    return Box(tuple(start), tuple(int(n) for n in src.shape), param, offset, tuple(int(s) for s in dst.stride()))


def _home(dst: Tensor, by_storage: Mapping[int, list[tuple[str, Tensor]]]) -> tuple[str, Tensor] | None:
    """The one parameter whose elements `dst` starts in (several may share a storage); None if
    none does, or more than one."""
    start = int(dst.storage_offset())
    found = [
        (name, t)
        for name, t in by_storage.get(dst.untyped_storage().data_ptr(), [])
        if t.storage_offset() <= start < t.storage_offset() + t.numel()
    ]
    return found[0] if len(found) == 1 else None


def _module(param: str) -> str:
    return param.rsplit(".", 1)[0] if "." in param else ""


def _row_major(shape: Sequence[int]) -> list[int]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return strides[::-1]


def _region(described: list[list[int]]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return tuple(described[0]), tuple(described[1])


def _overlap(boxes: Sequence[Box]) -> bool:
    return _overlap_regions([b.region for b in boxes])


def _overlap_regions(regions: Sequence[tuple[tuple[int, ...], tuple[int, ...]]]) -> bool:
    """Whether any two of the blocks share an element."""
    for i, (a_start, a_shape) in enumerate(regions):
        for b_start, b_shape in regions[i + 1 :]:
            if all(s < t + m and t < s + n for s, n, t, m in zip(a_start, a_shape, b_start, b_shape, strict=True)):
                return True
    return False
