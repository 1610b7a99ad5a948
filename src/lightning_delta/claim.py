"""Claiming a store prefix for a run: every rank's layout (which slices of which tensors each of
its payloads holds) gathered at rank 0, which writes the run manifest exclusively (a fresh run)
or finds it naming the same run, layout and signer (a resumed one), and the outcome agreed by
every rank, an error as the same `DeltaError` on all of them.  Two collectives, when a
publisher is made, never again.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import replace

import torch
import torch.distributed as dist

from . import format as fmt
from .errors import DeltaError, PublishError
from .format import DType
from .replica import exchange_bytes, group_device
from .signing import SigningKey
from .store import Store

__all__ = ["RankLayout", "claim"]

RankLayout = list[list[tuple[str, tuple[int, ...], int, int]]]  # payloads of (name, shape, start, numel)


def _manifest(run_id: str, layouts: list[RankLayout], dtype: str) -> fmt.RunManifest:
    """The run manifest of every rank's layout; ValueError if the ranks disagree on a tensor."""
    shapes: dict[str, tuple[int, ...]] = {}
    for layout in layouts:
        for name, shape, _, _ in (s for payload in layout for s in payload):
            if shapes.setdefault(name, shape) != shape:
                raise ValueError(f"ranks disagree on the shape of {name}: {shapes[name]} and {shape}")
    names = sorted(shapes)
    index = {name: i for i, name in enumerate(names)}
    return fmt.RunManifest(
        run_id=run_id,
        world_size=len(layouts),
        created=time.time(),
        tensors=tuple(fmt.TensorSpec(n, dtype, shapes[n]) for n in names),
        ranks=tuple(
            tuple(tuple(fmt.SliceSpec(index[n], start, numel) for n, _, start, numel in p) for p in layout)
            for layout in layouts
        ),
    )


def claim(
    store: Store,
    run_id: str | None,
    layout: RankLayout | BaseException,
    dtype: DType,
    rank: int,
    group: dist.ProcessGroup | None,
    key: SigningKey | None,
) -> tuple[str, str]:
    """(run id, manifest SHA-256) all ranks publish under, once rank 0 made the prefix this run's.

    Every rank's layout (or the error it met reading its tensors) reaches rank 0, which creates the
    run manifest exclusively (a fresh run), or finds it naming `run_id` with the same layout (a
    resumed one).  Its outcome reaches every rank, an error as the same `DeltaError` on all of
    them: no rank is left waiting in a collective.  Two collectives, at construction only.
    """
    collective = group is not None and dist.get_world_size(group) > 1
    device = group_device(group, _training_device()) if group is not None and collective else torch.device("cpu")
    mine = layout if isinstance(layout, BaseException) else json.dumps(layout).encode()
    if collective:
        assert group is not None
        gathered = exchange_bytes(mine, group, device)  # every rank raises if any rank's layout failed
    elif isinstance(mine, BaseException):
        raise mine
    else:
        gathered = [mine]
    outcome: bytes | BaseException = b""
    if rank == 0:
        try:
            layouts = [
                [[(name, tuple(shape), start, numel) for name, shape, start, numel in payload] for payload in layout]
                for layout in map(json.loads, gathered)
            ]
            outcome = " ".join(_make_run(store, run_id, layouts, dtype, key)).encode()
        except Exception as err:  # a store that cannot be written, a layout that does not fit
            outcome = err if isinstance(err, DeltaError) else PublishError(f"claiming {store.url} failed: {err}")
    if collective:
        assert group is not None
        outcome = exchange_bytes(outcome, group, device)[0]
    elif isinstance(outcome, BaseException):
        raise outcome
    assert isinstance(outcome, bytes)
    wanted, digest = outcome.decode().split(" ")
    return wanted, digest


def _make_run(
    store: Store, run_id: str | None, layouts: list[RankLayout], dtype: DType, key: SigningKey | None
) -> tuple[str, str]:
    """Rank 0's half of `claim`: the run's id and manifest digest, or a `PublishError` naming why
    this model cannot publish to this prefix."""
    wanted = run_id if run_id is not None else uuid.uuid4().hex
    try:
        manifest = _manifest(wanted, layouts, dtype.value)
        manifest.check()
    except ValueError as err:
        raise PublishError(f"this model cannot be published as one run: {err}") from None
    signer = None if key is None else key.public.text
    if key is not None:
        manifest = replace(manifest, signer=signer)
        manifest = replace(manifest, signature=key.sign(fmt.run_signed_bytes(manifest)))
    found = store.claim(manifest)
    if found.run_id != wanted:
        raise PublishError(
            f"{store.url} belongs to run {found.run_id}: give this run a prefix of its own, "
            f"or pass run_id={found.run_id!r} to continue that run"
        )
    if found.world_size != len(layouts):
        raise PublishError(f"run {wanted} in {store.url} has {found.world_size} ranks, this publisher {len(layouts)}")
    if found.manifest.signer != signer:
        said = f"signed by {found.manifest.signer}" if found.manifest.signer else "unsigned"
        raise PublishError(
            f"run {wanted} in {store.url} is {said}; this publisher's signing_key is "
            f"{signer or 'not set'}: a run keeps its signer (rotate keys with a new run)"
        )
    if (found.manifest.tensors, found.manifest.ranks) != (manifest.tensors, manifest.ranks):
        raise PublishError(
            f"run {wanted} in {store.url} was published with another layout (tensor names, shapes, "
            "dtype or sharding differ): a run has one layout; start a new run under a new prefix"
        )
    return wanted, found.sha256


def _training_device() -> torch.device:
    """The calling (training) thread's CUDA device, where an NCCL group's collectives run."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
