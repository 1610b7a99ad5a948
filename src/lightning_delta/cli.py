"""`lightning-delta`: look at, check, export and prune a chain.

    lightning-delta inspect STORE                 # the chain as a table, damaged steps marked
    lightning-delta verify STORE [--step N]       # every object, by every reader's path; exit 0 only if clean
    lightning-delta materialize STORE --step N OUT.safetensors [--force] [--alias NAME=SOURCE ...]
    lightning-delta materialize STORE --step N OUT_DIR --config MODEL_DIR  # a from_pretrained folder
    lightning-delta cost STORE --regions 3 [--window W] [--join STEP]
    lightning-delta gc STORE --keep-bases K [--dry-run]
    lightning-delta mirror SRC DST [--follow] [--keep-bases K] [--dst-storage-options JSON] [--trust KEY.pub]
    lightning-delta keygen PATH                   # a signing key: PATH (private, 0600) and PATH.pub

Every command that reads a chain takes `--trust PATH.pub` (repeatable): the run must then be signed
by one of these keys, and anything unsigned or signed otherwise is a `SignatureError`.

Every command takes `--json` and `--storage-options JSON` (fsspec options, e.g. an S3 endpoint;
`AWS_ENDPOINT_URL` and fsspec's own config files work too).  Errors print one line and exit 2;
`verify` exits 1 when it finds damage, and a prefix that holds no run is an error, never an empty
chain.  torch is imported only by the commands that need it, so `--help` answers at once.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from .errors import DeltaError, SnapshotNotFoundError

if TYPE_CHECKING:
    from .format import Run
    from .store import Store

__all__ = ["main"]


def open_run(args: argparse.Namespace) -> tuple[Store, Run]:
    """The store named on the command line and its run manifest; a prefix that holds no run is an
    error, so a typo in a URL never reads as an empty, healthy chain."""
    from .format import RUN_MANIFEST
    from .signing import Trust
    from .store import Store

    store = Store(args.store, args.storage_options, trust=Trust.of(args.trust))
    manifest = store.manifest()
    if manifest is None:
        raise SnapshotNotFoundError(f"no lightning_delta run at {store.url} (no {RUN_MANIFEST} there)")
    return store, manifest


def step_summary(store: Store, world: int, step: int) -> dict[str, Any]:
    """One row of `inspect`: what the step's committed parts hold, from markers and headers alone.

    `bytes` counts every object stored for the step (parts, bridges, markers); `bridge_bytes` the
    bridges among them.  A step whose objects cannot be read is a row marked `damaged`, not the
    end of the table."""
    from .traffic import stored_bytes

    if not store.is_complete(step, world):
        committed = {w: len(r) for w, r in store.committed_ranks(step).items()}
        return {"step": step, "complete": False, "committed_ranks": committed}
    run = store.manifest()
    assert run is not None
    try:
        per_rank = [store.part_refs(step, rank, world) for rank in range(world)]
        if not all(per_rank):  # retention deleted the step since `is_complete` saw it
            raise SnapshotNotFoundError(f"step {step} was deleted while it was read")
        refs = [r for rank_refs in per_rank for r in rank_refs]
        heads = [store.read_head(rank_refs[0], rank, world) for rank, rank_refs in enumerate(per_rank)]
    except DeltaError as err:
        return {"step": step, "complete": True, "damaged": f"{type(err).__name__}: {err}"}
    kinds = {h.header.kind.value for h in heads}
    numel = sum(run.numel(rank) for rank in range(world))
    size = stored_bytes(refs)
    return {
        "step": step,
        "complete": True,
        "kind": kinds.pop() if len(kinds) == 1 else "mixed",
        "world_size": world,
        "bytes": size,
        "bridge_bytes": stored_bytes([r for r in refs if r.bridge]),
        "dense_bytes": 2 * numel,
        "changed_fraction": sum(h.changed for h in heads) / numel if numel else 0.0,
        "ratio_to_full": size / (2 * numel) if numel else 0.0,
        "created": max(h.header.created for h in heads),
    }


def _rows(store: Store, run: Run) -> list[dict[str, Any]]:
    return [step_summary(store, run.world_size, s) for s in store.published_steps()]


def _inspect(args: argparse.Namespace) -> int:
    store, run = open_run(args)
    rows = _rows(store, run)
    signer = run.manifest.signer
    if args.json:
        return _emit(
            {"run_id": run.run_id, "signer": signer, "signer_checked": bool(signer and store.trust), "steps": rows}
        )
    print(f"{'step':>8} {'kind':>6} {'bytes':>14} {'changed':>8} {'of full':>8} {'age':>8}")
    now = time.time()
    for r in rows:
        if not r["complete"]:
            print(f"{r['step']:8d} {'-':>6} incomplete (invisible to loaders): {r['committed_ranks']}")
        elif "damaged" in r:
            print(f"{r['step']:8d} {'-':>6} DAMAGED: {r['damaged']}")
        else:
            print(
                f"{r['step']:8d} {r['kind']:>6} {r['bytes']:14,d} {100 * r['changed_fraction']:7.2f}% "
                f"{100 * r['ratio_to_full']:7.2f}% {_age(now - r['created']):>8}"
            )
    checked = "checked against --trust" if store.trust else "not checked: pass --trust KEY.pub"
    print(f"run {run.run_id}: " + (f"signed by {signer} ({checked})" if signer else "unsigned"))
    return 0


def _verify(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from .audit import audit

    store, _ = open_run(args)
    found = audit(store, args.step)
    incomplete = [s for s in store.published_steps() if s not in found.steps] if args.step is None else []
    if args.json:
        _emit(
            {
                "checked": found.steps,
                "objects": found.objects,
                "damaged": [asdict(d) for d in found.damaged],
                "problems": [{**asdict(u), "readers": [r.value for r in u.readers]} for u in found.unreadable],
                "incomplete": incomplete,
            }
        )
    else:
        for d in found.damaged:
            print(f"step {d.step} rank {d.rank} {d.part}: {d.error}: {d.message}")
            print(f"    breaks {'; '.join(d.breaks)}")
        for u in found.unreadable:
            readers = " and ".join(f"a {r.value}" for r in u.readers)
            print(f"step {u.step}: {readers} cannot rebuild it: {u.error}: {u.message}")
        if incomplete:
            print(f"incomplete (invisible to loaders, not damage): {incomplete}")
        verdict = (
            "clean" if found.clean else f"{len(found.damaged)} damaged objects, {len(found.unreadable)} broken steps"
        )
        print(f"{verdict}: checked {found.objects} objects of {len(found.steps)} steps of {store.url}")
    return 0 if found.clean else 1


def _materialize(args: argparse.Namespace) -> int:
    import shutil

    from safetensors.torch import save_file

    from .loader import DeltaLoader

    if os.path.exists(args.out) and not args.force:
        raise FileExistsError(f"{args.out} exists; pass --force to overwrite it")
    aliases = dict(_alias(a) for a in args.alias)
    loader = DeltaLoader(open_run(args)[0])
    step, tensors = loader.state_dict(args.step)
    missing = sorted(set(aliases.values()) - tensors.keys())
    if missing:
        raise ValueError(f"--alias sources not in step {step}: {missing}")
    # Tied weights are published once (under the first name); strict loaders may want every name.
    tensors.update({name: tensors[source].clone() for name, source in aliases.items()})
    path = args.out
    if args.config:  # a folder from_pretrained loads: the config's files, then the weights
        if not os.path.isfile(os.path.join(args.config, "config.json")):
            raise FileNotFoundError(f"{args.config} holds no config.json: pass a model config directory")
        os.makedirs(args.out, exist_ok=True)
        for name in os.listdir(args.config):
            source = os.path.join(args.config, name)
            if os.path.isfile(source) and not name.endswith((".safetensors", ".bin", ".index.json", ".pt")):
                shutil.copyfile(source, os.path.join(args.out, name))
                os.chmod(os.path.join(args.out, name), 0o644)
        path = os.path.join(args.out, "model.safetensors")
    # "format": "pt" is what transformers' loaders check for; the rest says where it came from.
    save_file(tensors, path, metadata={"format": "pt", "step": str(step), "source": loader.store.url})
    os.chmod(path, 0o644)  # safetensors writes 0600, which other users' inference servers cannot read
    report = {"step": step, "tensors": len(tensors), "out": args.out}
    if args.json:
        return _emit(report)
    print(f"wrote step {step} ({len(tensors)} tensors, verified) to {args.out}")
    return 0


def _alias(text: str) -> tuple[str, str]:
    name, sep, source = text.partition("=")
    if not (name and sep and source):
        raise ValueError(f"--alias takes NAME=SOURCE (e.g. lm_head.weight=model.embed_tokens.weight), got {text!r}")
    return name, source


def _cost(args: argparse.Namespace) -> int:
    from .traffic import window_cost

    store, run = open_run(args)
    rows = [r for r in _rows(store, run) if r["complete"]]
    readable = [r["step"] for r in rows if "damaged" not in r]
    if not readable:
        raise SnapshotNotFoundError(f"no complete, readable step in {args.store}")
    window = readable[-args.window :] if args.window else readable
    earlier = [s for s in readable if s < window[0]]
    cost = window_cost(store, window, earlier[-1] if earlier else None, args.join)
    full = cost.full_every_step
    readers = {
        "full_every_step": full,
        "in_sync_follower": cost.in_sync,
        f"late_joiner_at_{cost.join}": cost.late_joiner,
        "stored": cost.stored,
    }
    report = {
        "window_steps": len(window),
        "regions": args.regions,
        "full_model_bytes": cost.dense_bytes,
        # One definition everywhere: bytes of objects moved (parts and commit markers), as a share
        # of shipping the full model every step.  The seed's formula beside it, as it defines it.
        "readers": {
            name: {"per_region": value, "total": value * args.regions, "share_of_full": cost.share(value)}
            for name, value in readers.items()
        },
        "formula": {"f": cost.bases, "W": len(window), "delta": cost.mean_delta, "share_of_full": cost.formula},
    }
    if args.json:
        return _emit(report)
    print(f"window: {len(window)} steps, {args.regions} regions, full model {cost.dense_bytes:,d} bytes (bf16)")
    print(f"{'':26}{'per region':>18}{'total':>18}{'of full':>10}")
    for name, value in readers.items():
        label = name.replace("_", " ")
        print(f"{label:26}{value:18,d}{value * args.regions:18,d}{100 * cost.share(value):9.2f}%")
    print(
        f"seed's formula [f + (W - f) * delta] / W with f={cost.bases}, W={len(window)}, measured "
        f"delta={cost.mean_delta:.4f} (bases counted as full): {100 * cost.formula:.2f}% of full"
    )
    return 0


def _gc(args: argparse.Namespace) -> int:
    from .retention import collect

    store, _ = open_run(args)
    doomed = collect(store, args.keep_bases, dry_run=args.dry_run)
    verb = "would delete" if args.dry_run else "deleted"
    if args.json:
        return _emit({"deleted_steps" if not args.dry_run else "would_delete_steps": doomed})
    print(f"{verb} {len(doomed)} steps" + (f" ({doomed[0]}..{doomed[-1]})" if doomed else ""))
    return 0


def _mirror(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from .mirror import Mirror, MirrorSettings
    from .signing import Trust

    settings = MirrorSettings(
        keep_bases=args.keep_bases,
        threads=args.threads,
        poll_seconds=args.poll_seconds,
        list_seconds=args.list_seconds,
        paced=not args.unpaced,
        missing_after=args.missing_after,
    )
    options = {"source_options": args.storage_options, "destination_options": args.dst_storage_options}
    with Mirror(args.store, args.destination, settings, **options, trust=Trust.of(args.trust)) as mirror:
        if not args.follow:
            metrics = mirror.sync()
            if not mirror.has_run:
                raise SnapshotNotFoundError(f"no lightning_delta run at {mirror.source.url} to mirror")
            if args.json:
                return _emit(asdict(metrics))
            print(metrics.line())
            return 0
        shown, shown_lag = None, 0.0
        try:
            # a line whenever the mirror moved, or a stalled one's lag grew (`_lag_grew`), until interrupted
            for metrics in mirror.follow():
                state = (metrics.source_step, metrics.mirror_step, metrics.bytes_copied, metrics.stopped_at)
                if state != shown or _lag_grew(shown_lag, metrics.lag_seconds):
                    shown, shown_lag = state, metrics.lag_seconds
                    print(json.dumps(asdict(metrics)) if args.json else metrics.line(), flush=True)
        except KeyboardInterrupt:
            pass
    return 0


def _lag_grew(shown: float, lag: float) -> bool:
    """Whether a mirror's lag grew enough since the line that showed `shown` to be shown again: a
    stalled mirror's lag grows at every pass while nothing else changes.  It doubled (and by a second
    at least), or grew by a minute: lines at a lag of 1, 2, 4, ... 32, 64, 124, 184 s, not at every
    poll; none while the mirror is caught up (a lag of 0)."""
    return lag >= shown + min(max(shown, 1.0), 60.0)


def _keygen(args: argparse.Namespace) -> int:
    from .signing import keygen

    key = keygen(args.path)
    if args.json:
        return _emit({"private": args.path, "public": args.path + ".pub", "key": key.public.text})
    print(f"wrote {args.path} (private, mode 0600; give it to the trainer only) and {args.path}.pub: {key.public.text}")
    return 0


def _emit(value: Any) -> int:
    json.dump(value, sys.stdout, indent=2)
    print()
    return 0


def _age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{max(seconds, 0):.0f}s"


def _options(text: str) -> dict[str, Any]:
    try:
        options = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"not JSON: {err}") from None
    if not isinstance(options, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return options


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lightning-delta", description="Look at, check, export and prune a delta chain.")
    sub = p.add_subparsers(dest="command", required=True)

    def command(name: str, help: str, run: Callable[[argparse.Namespace], int]) -> argparse.ArgumentParser:
        c = sub.add_parser(name, help=help)
        c.add_argument("store", help="fsspec URL or local path of the chain")
        c.add_argument("--json", action="store_true", help="machine-readable output")
        c.add_argument(
            "--storage-options",
            type=_options,
            default={},
            metavar="JSON",
            help='fsspec options, e.g. \'{"client_kwargs": {"endpoint_url": "http://127.0.0.1:9000"}}\'',
        )
        c.add_argument(
            "--trust",
            action="append",
            default=[],
            metavar="KEY.pub",
            help="refuse the chain unless signed by this public key (a path or 'ed25519:...'); repeatable",
        )
        c.set_defaults(run=run)
        return c

    command("inspect", "the chain as a table", _inspect)
    verify = command("verify", "check every stored object, as a joiner and a follower in sync read them", _verify)
    verify.add_argument("--step", type=int, help="check only this step's objects (and the chain it needs)")
    mat = command("materialize", "write a step as a safetensors file", _materialize)
    mat.add_argument("--step", type=int, required=True)
    mat.add_argument("out", help="output .safetensors path, or with --config an output folder")
    mat.add_argument("--force", action="store_true", help="overwrite OUT if it exists")
    mat.add_argument(
        "--config",
        metavar="MODEL_DIR",
        help="a model config directory (config.json, tokenizer files): OUT becomes a folder from_pretrained loads",
    )
    mat.add_argument(
        "--alias",
        action="append",
        default=[],
        metavar="NAME=SOURCE",
        help="also write NAME as a copy of SOURCE (tied weights, for strict loaders); repeatable",
    )
    cost = command("cost", "traffic of this chain vs shipping the full model every step", _cost)
    cost.add_argument("--regions", type=int, required=True, help="rollout regions that each download the chain")
    cost.add_argument("--window", type=int, help="the last W complete steps (default: all)")
    cost.add_argument("--join", type=int, help="the step a late joiner starts at (default: the window's last)")
    gc = command("gc", "delete steps older than the K newest complete bases", _gc)
    gc.add_argument("--keep-bases", type=int, required=True)
    gc.add_argument("--dry-run", action="store_true", help="list what would be deleted, delete nothing")
    mirror = command("mirror", "copy the chain to another store in commit order (a region's mirror)", _mirror)
    mirror.add_argument("destination", help="fsspec URL or local path of the mirror")
    mirror.add_argument("--follow", action="store_true", help="keep mirroring new steps until interrupted")
    mirror.add_argument(
        "--keep-bases", type=int, help="keep the K newest bases at the mirror (default: delete what the source deleted)"
    )
    mirror.add_argument(
        "--dst-storage-options", type=_options, default={}, metavar="JSON", help="fsspec options of the destination"
    )
    mirror.add_argument("--threads", type=int, default=8, help="objects copied at once")
    mirror.add_argument("--poll-seconds", type=float, default=1.0, help="seconds between passes with --follow")
    mirror.add_argument(
        "--list-seconds", type=float, default=30.0, help="seconds between listings of the source with --follow"
    )
    mirror.add_argument(
        "--unpaced", action="store_true", help="poll every --poll-seconds, not only once the next step is due"
    )
    mirror.add_argument(
        "--missing-after",
        type=float,
        default=120.0,
        help="seconds a blob whose marker the source holds may stay missing before it counts as damage",
    )
    keys = sub.add_parser("keygen", help="write a new Ed25519 signing key: PATH (private, 0600) and PATH.pub")
    keys.add_argument("path", help="where the private key goes (it must not exist)")
    keys.add_argument("--json", action="store_true", help="machine-readable output")
    keys.set_defaults(run=_keygen)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.run(args)
    except (DeltaError, OSError, ValueError) as err:
        print(f"lightning-delta {args.command}: {type(err).__name__}: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
