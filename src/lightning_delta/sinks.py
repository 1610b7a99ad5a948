"""Where verified steps land: the loader's own copies, or a module's tensors written in place.

A sink holds the state a loader decodes the next step against, and takes the verified step.  It
is addressed in the run's coordinates (a tensor's number in the run manifest, flat element
positions, 16-bit patterns as int16), so the loader's fetch, decode and verify code never knows
what it writes into: a new target (an inference engine's live parameters) is one class.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Protocol

import torch
from torch import Tensor, nn

from . import format as fmt
from .errors import ModelMismatchError
from .shards import named_tensors

__all__ = ["HeldCopies", "ModuleSink", "Sink"]


class Sink(Protocol):
    """The held state of a loader, in the run's tensor coordinates."""

    device: torch.device

    def gather(self, tensor: int, positions: Tensor) -> Tensor:
        """The int16 bits of tensor number `tensor` at flat `positions` (int64, ascending)."""
        ...

    def read(self, tensor: int, start: int, numel: int) -> Tensor:
        """The int16 bits of `numel` elements from flat position `start` (a view or a copy: callers
        only read it, before the next write)."""
        ...

    def scatter(self, tensor: int, positions: Tensor, bits: Tensor) -> None:
        """Write int16 `bits` at flat `positions`."""
        ...

    def write(self, tensor: int, start: int, bits: Tensor) -> None:
        """Write int16 `bits` from flat position `start`."""
        ...


class HeldCopies:
    """The loader's own copy of every tensor: what `state_dict` hands out copies of, when no module
    holds the state."""

    def __init__(self, run: fmt.Run, device: torch.device) -> None:
        self.device, self._specs = device, run.manifest.tensors
        self._bits: dict[int, Tensor] = {}

    def _tensor(self, tensor: int) -> Tensor:
        if tensor not in self._bits:  # filled by the first (full) write of a step
            self._bits[tensor] = torch.empty(self._specs[tensor].numel, dtype=torch.int16, device=self.device)
        return self._bits[tensor]

    def gather(self, tensor: int, positions: Tensor) -> Tensor:
        return self._tensor(tensor).index_select(0, positions.to(self.device))

    def read(self, tensor: int, start: int, numel: int) -> Tensor:
        return self._tensor(tensor)[start : start + numel]

    def scatter(self, tensor: int, positions: Tensor, bits: Tensor) -> None:
        self._tensor(tensor).index_copy_(0, positions.to(self.device), bits.to(self.device))

    def write(self, tensor: int, start: int, bits: Tensor) -> None:
        self._tensor(tensor)[start : start + bits.numel()].copy_(bits)

    def tensors(self) -> dict[str, Tensor]:
        """Copies of every tensor, by name, in its dtype and shape."""
        return {
            spec.name: self._tensor(i).clone().view(fmt.DType(spec.dtype).torch).view(spec.shape)
            for i, spec in sorted(enumerate(self._specs), key=lambda item: item[1].name)
        }


_EXACT = {torch.float32, torch.float64}
"""Module dtypes besides the shipped one that hold every 16-bit float exactly."""


class ModuleSink:
    """A module's parameters and persistent buffers, written in place.

    Published names map to the module's through `rename` (None drops a tensor: the sink keeps that
    tensor's values itself, since the payload it shares with others is verified whole).  A module
    tensor must hold the shipped dtype, or float32 / float64, which hold it exactly; anything else
    would not be the trainer's weights bit for bit.
    """

    def __init__(self, module: nn.Module, run: fmt.Run, rename: Callable[[str], str | None] | None = None) -> None:
        self.module, self.rename = module, rename
        specs = run.manifest.tensors
        targets = named_tensors(module)
        wanted = {i: rename(s.name) if rename is not None else s.name for i, s in enumerate(specs)}
        names = {name for name in wanted.values() if name is not None}
        missing, unexpected = sorted(targets.keys() - names), sorted(names - targets.keys())
        wrong = sorted(
            name for i, name in wanted.items() if name in targets and tuple(targets[name].shape) != specs[i].shape
        )
        if missing or unexpected or wrong:
            raise ModelMismatchError(
                f"the run does not fit {type(module).__name__}: missing {missing[:5]}, "
                f"unexpected {unexpected[:5]}, wrong shape {wrong[:5]}"
            )
        self._flat: dict[int, Tensor] = {}
        self._shipped: dict[int, torch.dtype] = {}
        self._kept = HeldCopies(run, torch.device("cpu"))  # tensors `rename` drops
        devices = set()
        for i, name in wanted.items():
            shipped = fmt.DType(specs[i].dtype).torch
            if name is None:
                continue
            target = targets[name].detach()
            if target.dtype != shipped and target.dtype not in _EXACT:
                raise ModelMismatchError(
                    f"{name} is {target.dtype}: it cannot hold the trainer's {shipped} values bit for bit "
                    f"(use {shipped}, float32 or float64)"
                )
            if not target.is_contiguous():
                raise ModelMismatchError(f"{name} is not contiguous: it cannot be written in place")
            self._flat[i], self._shipped[i] = target.view(-1), shipped
            devices.add(target.device)
        self.device = devices.pop() if len(devices) == 1 else torch.device("cpu")

    def fits(self, module: nn.Module, rename: Callable[[str], str | None] | None) -> bool:
        """Whether this sink writes into `module` under `rename` (the same objects)."""
        return module is self.module and rename is self.rename

    def _bits(self, tensor: int, values: Tensor) -> Tensor:
        """Module values as the shipped type's bits (exact: they were written from them)."""
        shipped = self._shipped[tensor]
        return (values if values.dtype == shipped else values.to(shipped)).view(torch.int16)

    def _values(self, tensor: int, bits: Tensor) -> Tensor:
        target = self._flat[tensor]
        return bits.to(target.device).view(self._shipped[tensor]).to(target.dtype)

    def gather(self, tensor: int, positions: Tensor) -> Tensor:
        if tensor not in self._flat:
            return self._kept.gather(tensor, positions).to(positions.device)
        flat = self._flat[tensor]
        return self._bits(tensor, flat.index_select(0, positions.to(flat.device))).to(positions.device)

    def read(self, tensor: int, start: int, numel: int) -> Tensor:
        if tensor not in self._flat:
            return self._kept.read(tensor, start, numel)
        return self._bits(tensor, self._flat[tensor][start : start + numel])

    def scatter(self, tensor: int, positions: Tensor, bits: Tensor) -> None:
        if tensor not in self._flat:
            self._kept.scatter(tensor, positions, bits)
            return
        flat = self._flat[tensor]
        with torch.no_grad():
            flat.index_copy_(0, positions.to(flat.device), self._values(tensor, bits))

    def write(self, tensor: int, start: int, bits: Tensor) -> None:
        if tensor not in self._flat:
            self._kept.write(tensor, start, bits)
            return
        with torch.no_grad():
            self._flat[tensor][start : start + bits.numel()].copy_(self._values(tensor, bits))

    def tensors(self) -> Iterator[Tensor]:
        """The module tensors it writes (for a caller that synchronizes a device after writing)."""
        return iter(self._flat.values())
