"""Compare the delta codec with the usual ways of shipping a weight update, in one run.

    python scripts/make_sequence.py runs/seq && python scripts/bench_codec.py --sequence runs/seq
    python scripts/bench_codec.py --synthetic 67108864 --densities 0.005 0.01 0.02 0.05

For every (previous, next) pair of steps and every tensor, each method encodes the change and
decodes it again; every lossless method's output is checked bit for bit.  Sizes are compared with
the order-0 entropy bound of the change: per tensor, n * H2(m / n) for the changed mask plus
m * H(value change), with H the empirical entropy of `new - old mod 2**16`, summed over tensors.
It also prints the same bound with mask and value conditioned on the old value's exponent (which a
decoder knows): a lower limit for the exponent-context (CLASSED) rows, which pays no table cost.
Context NONE is what a CPU publisher writes by default, EXPONENT what a GPU one does
(`Context.AUTO`); this benchmark runs both on the CPU.
Speeds are MB/s of dense bf16 input on one thread, next to a memcpy of the same bytes.

Peers, where the benchmark-only extra is installed (`pip install -e '.[bench]'`): the seed's codec,
Fireworks' `fireworks-delta-compression` (`arc_v3`, and `arc_v2`, dense XOR + zstd), and ZipNN for
bases.  arc_v3 races its candidates on threads of its own and keeps the first that finishes within
`ARC3_CANDIDATE_WAIT_MULTIPLIER` times the fastest; this run lets every candidate finish, its best
case.  Its wire format unpickles payloads (`pickle.loads` on stored bytes); ours never executes
stored bytes.
"""

from __future__ import annotations

import argparse
import math
import os

os.environ.setdefault("ARC3_CANDIDATE_WAIT_MULTIPLIER", "1e9")  # read at import: every candidate finishes
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import lz4.frame
import numpy as np
import torch
import zstandard
from safetensors.torch import load_file

sys.path.insert(0, os.path.dirname(__file__))
from lightning_delta import codec
from lightning_delta.codec import CodecOptions, Compressor, Context
from make_sequence import synthetic_pair

Pair = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class Method:
    name: str
    encode: Callable[[torch.Tensor, torch.Tensor], bytes]
    decode: Callable[[torch.Tensor, bytes], torch.Tensor]


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.int16).numpy()


def _tensor(array: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(array.copy()).view(like.dtype)


_ZSTD = zstandard.ZstdCompressor(level=3)  # the baselines' zstd; ours uses its own default level
_UNZSTD = zstandard.ZstdDecompressor()


def _index_value_encode(old: torch.Tensor, new: torch.Tensor) -> bytes:
    index = (old.view(torch.int16) != new.view(torch.int16)).nonzero().squeeze(1)
    return index.to(torch.int32).numpy().tobytes() + _bits(new)[index.numpy()].tobytes()


def _index_value_decode(old: torch.Tensor, payload: bytes) -> torch.Tensor:
    m = len(payload) // 6
    index = np.frombuffer(payload, np.int32, m)
    out = _bits(old).copy()
    out[index] = np.frombuffer(payload, np.int16, m, offset=4 * m)
    return _tensor(out, old)


def _gaps_encode(old: torch.Tensor, new: torch.Tensor) -> bytes:
    """u16 gaps (0xFFFF = skip 65535 more) + new values, zstd-3: the common 'sparse + zstd' design."""
    index = (old.view(torch.int16) != new.view(torch.int16)).nonzero().squeeze(1).numpy()
    gaps = np.diff(index, prepend=-1) - 1
    escapes, rest = np.divmod(gaps, 0xFFFF)
    stream = np.repeat(np.full(len(gaps), 0xFFFF, np.uint16), escapes)
    entries = np.concatenate([np.repeat(np.arange(len(gaps)), escapes), np.arange(len(gaps))])
    values = np.concatenate([stream, rest.astype(np.uint16)])[np.argsort(entries, kind="stable")]
    body = np.uint64(len(index)).tobytes() + values.tobytes() + _bits(new)[index].tobytes()
    return _ZSTD.compress(body)


def _gaps_decode(old: torch.Tensor, payload: bytes) -> torch.Tensor:
    body = _UNZSTD.decompress(payload)
    m = int(np.frombuffer(body, np.uint64, 1)[0])
    gaps = np.frombuffer(body, np.uint16, (len(body) - 8 - 2 * m) // 2, offset=8)
    step = np.where(gaps == 0xFFFF, 0xFFFF, gaps.astype(np.int64) + 1)
    index = (np.cumsum(step) - 1)[gaps != 0xFFFF]
    out = _bits(old).copy()
    out[index] = np.frombuffer(body, np.int16, m, offset=len(body) - 2 * m)
    return _tensor(out, old)


def _xor_encode(old: torch.Tensor, new: torch.Tensor) -> bytes:
    return lz4.frame.compress((_bits(old) ^ _bits(new)).tobytes())


def _xor_decode(old: torch.Tensor, payload: bytes) -> torch.Tensor:
    return _tensor(_bits(old) ^ np.frombuffer(lz4.frame.decompress(payload), np.int16), old)


def peers() -> list[Method]:
    """The seed's codec and ZipNN, if the benchmark extra is installed."""
    found = []
    try:
        import fireworks_delta_compression as fdc
    except ImportError:
        print("fireworks-delta-compression is not installed: no arc_v3/arc_v2 rows (pip install -e '.[bench]')")
    else:
        checksums: dict[int, object] = {}

        def fireworks(fmt: str) -> Method:
            def encode(old: torch.Tensor, new: torch.Tensor) -> bytes:
                payload, checksum = fdc.delta_compress(src=old, dst=new, compression_format=fmt)
                data = payload.numpy().tobytes()
                checksums[hash(data)] = checksum
                return data

            def decode(old: torch.Tensor, payload: bytes) -> torch.Tensor:
                diff = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
                checksum = checksums[hash(payload)]
                return fdc.delta_decompress(src=old, compressed_diff=diff, checksum=checksum, compression_format=fmt)

            return Method(f"fireworks {fmt} (seed's codec)", encode, decode)

        found += [fireworks("arc_v3"), fireworks("arc_v2")]
    return found


def base_methods() -> list[Method]:
    """Ways to store a whole tensor (a base): ours, ZipNN if installed, byte-plane-free zstd."""
    found = [
        Method("lightning_delta base", lambda o, n: codec.encode(None, n), lambda o, p: codec.decode(o, p)),
        Method(
            "full bf16 + zstd-3",
            lambda o, n: _ZSTD.compress(_bits(n).tobytes()),
            lambda o, p: _tensor(np.frombuffer(_UNZSTD.decompress(p), np.int16), o),
        ),
    ]
    try:
        import zipnn
    except ImportError:
        print("zipnn is not installed: no ZipNN row (pip install -e '.[bench]')")
    else:
        z = zipnn.ZipNN(input_format="torch", bytearray_dtype="bfloat16", threads=1)
        # ZipNN compresses its input in place: it gets a copy.
        found.append(Method("ZipNN", lambda o, n: z.compress(n.clone()), lambda o, p: z.decompress(p).reshape(-1)))
    return found


def methods() -> list[Method]:
    ours = [
        Method(
            f"lightning_delta ({c.name.lower()}{', exponent context' if x == Context.EXPONENT else ''})",
            lambda o, n, c=c, x=x: codec.encode(o, n, CodecOptions(c, context=x)),
            lambda o, p: codec.decode(o, p),
        )
        for c, x in (
            (Compressor.ZSTD, Context.NONE),
            (Compressor.ZSTD, Context.EXPONENT),
            (Compressor.LZ4, Context.NONE),
            (Compressor.NONE, Context.NONE),
        )
    ]
    buffers: dict[int, torch.Tensor] = {}  # what a follower does: decode into last step's spare buffer

    def into_reused(old: torch.Tensor, payload: bytes) -> torch.Tensor:
        out = buffers.setdefault(id(old), torch.empty_like(old))
        return codec.decode(old, payload, out=out)

    ours.append(Method("lightning_delta (zstd), decode into a reused buffer", ours[0].encode, into_reused))
    return [
        *ours,
        Method("full bf16", lambda o, n: _bits(n).tobytes(), lambda o, p: _tensor(np.frombuffer(p, np.int16), o)),
        Method(
            "full bf16 + zstd-3",
            lambda o, n: _ZSTD.compress(_bits(n).tobytes()),
            lambda o, p: _tensor(np.frombuffer(_UNZSTD.decompress(p), np.int16), o),
        ),
        Method("int32 index + bf16 value", _index_value_encode, _index_value_decode),
        Method("u16 gaps + value + zstd-3", _gaps_encode, _gaps_decode),
        Method("dense XOR + lz4", _xor_encode, _xor_decode),
        *peers(),
    ]


def entropy_bound_bits(old: torch.Tensor, new: torch.Tensor) -> float:
    """Order-0 bound of one tensor's change: mask entropy plus value-change entropy."""
    step = (new.view(torch.int16).int() - old.view(torch.int16).int()) & 0xFFFF
    changed = step[step != 0]
    n, m = old.numel(), changed.numel()
    if m in (0, n):
        mask = 0.0
    else:
        p = m / n
        mask = -n * (p * math.log2(p) + (1 - p) * math.log2(1 - p))
    if m == 0:
        return mask
    counts = torch.bincount(changed, minlength=1).double()
    probs = counts[counts > 0] / m
    return mask + float(-(probs * probs.log2()).sum()) * m


def _conditional_bits(key: torch.Tensor, symbol: torch.Tensor) -> float:
    """Empirical H(symbol | key) times the count: sum over pairs of -c * log2(c / c_key)."""
    pairs, counts = torch.unique(key.long() * 65536 + symbol.long(), return_counts=True)
    per_key = torch.bincount(key.long(), minlength=1)[pairs // 65536]
    return float(-(counts * (counts.double() / per_key).log2()).sum())


def exponent_bound_bits(old: torch.Tensor, new: torch.Tensor) -> float:
    """The bound when both mask and value change are conditioned on the old value's exponent,
    which a decoder knows: what exponent-conditioned coding could reach at best."""
    a = old.view(torch.int16).int() & 0xFFFF
    step = (new.view(torch.int16).int() - a) & 0xFFFF
    shift, width = (7, 0xFF) if old.dtype == torch.bfloat16 else (10, 0x1F)
    exponent = (a >> shift) & width
    changed = step != 0
    return _conditional_bits(exponent, changed.int()) + _conditional_bits(exponent[changed], step[changed])


def _ef_bits(n: torch.Tensor, m: torch.Tensor) -> float:
    """Textbook Elias-Fano bits of m positions among n (low-bit width floor(log2(n / m))), per
    entry of the (n, m) tensors: an analytic estimate before zstd (the codec keeps one low bit
    fewer, because zstd codes the high bits)."""
    n, m = n[m > 0].double(), m[m > 0].double()
    low = torch.floor(torch.log2(n / m))
    return float((m * low + m + torch.floor((n - 1) / 2**low) + 1).sum())


def position_bits(old: torch.Tensor, new: torch.Tensor) -> tuple[float, float]:
    """(one Elias-Fano sequence over the tensor, one per exponent class of the old value): what
    coding positions per class would save, before any value coding."""
    a = old.view(torch.int16).int() & 0xFFFF
    shift, width = (7, 0xFF) if old.dtype == torch.bfloat16 else (10, 0x1F)
    exponent = (a >> shift) & width
    changed = old.view(torch.int16) != new.view(torch.int16)
    n_c = torch.bincount(exponent, minlength=width + 1)
    m_c = torch.bincount(exponent[changed], minlength=width + 1)
    whole = _ef_bits(torch.tensor([old.numel()]), torch.tensor([int(changed.sum())]))
    return whole, _ef_bits(n_c, m_c)


def sequence_steps(folder: Path) -> Iterator[list[Pair]]:
    """Per step of the sequence, the (old, new) pair of each tensor."""
    files = sorted(folder.glob("step-*.safetensors"))
    if len(files) < 2:
        raise SystemExit(f"{folder} holds fewer than two steps: run scripts/make_sequence.py first")
    previous = load_file(files[0])
    for f in files[1:]:
        current = load_file(f)
        yield [(previous[name].reshape(-1), current[name].reshape(-1)) for name in sorted(current)]
        previous = current


def as_published(step: list[Pair], small: int = 1 << 18) -> list[Pair]:
    """The payloads `DeltaPublisher` makes of one step: large tensors alone, the rest concatenated."""
    large = [pair for pair in step if pair[1].numel() > small]
    rest = [pair for pair in step if pair[1].numel() <= small]
    grouped = [(torch.cat([o for o, _ in rest]), torch.cat([n for _, n in rest]))] if rest else []
    return large + grouped


def best_of(repeats: int, fn: Callable[[], object]) -> tuple[float, object]:
    best, out = math.inf, None
    for _ in range(repeats):
        started = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - started)
    return best, out


def run_bases(label: str, tensors: list[torch.Tensor], repeats: int) -> None:
    """One table of base sizes and speeds, every method decoded and checked."""
    dense = sum(2 * t.numel() for t in tensors)
    print(f"\n### {label}\n{len(tensors)} tensors, {dense / 1e6:.1f} MB dense bf16\n")
    print("| method | bytes | % of dense | encode MB/s | decode MB/s |\n|---|---:|---:|---:|---:|")
    for method in base_methods():
        enc_s, payloads = best_of(repeats, lambda m=method: [m.encode(t, t) for t in tensors])
        dec_s, decoded = best_of(
            repeats, lambda m=method, p=payloads: [m.decode(t, x) for t, x in zip(tensors, p, strict=True)]
        )
        for t, got in zip(tensors, decoded, strict=True):
            if not torch.equal(got.reshape(-1).view(torch.int16), t.view(torch.int16)):
                raise SystemExit(f"{method.name} is not lossless")
        size = sum(len(p) for p in payloads)
        print(
            f"| {method.name} | {size:,} | {100 * size / dense:.2f} | {dense / enc_s / 1e6:,.0f} | "
            f"{dense / dec_s / 1e6:,.0f} |"
        )


def run(label: str, pairs: list[Pair], repeats: int, bound_pairs: list[Pair] | None = None) -> None:
    """One table; the bound is taken over `bound_pairs` (the original tensors) when given."""
    dense = sum(2 * new.numel() for _, new in pairs)
    bound = sum(entropy_bound_bits(old, new) for old, new in bound_pairs or pairs) / 8
    conditioned = sum(exponent_bound_bits(old, new) for old, new in bound_pairs or pairs) / 8
    changed = sum(int((o.view(torch.int16) != n.view(torch.int16)).sum()) for o, n in pairs)
    positions = [position_bits(old, new) for old, new in bound_pairs or pairs]
    one_ef, class_ef = (sum(p[i] for p in positions) / 8 for i in range(2))
    targets = [torch.empty_like(new) for _, new in pairs]
    copy_s, _ = best_of(repeats, lambda: [t.copy_(new) for t, (_, new) in zip(targets, pairs, strict=True)])
    memcpy = dense / copy_s / 1e6
    print(f"\n### {label}")
    share = 100 * changed / (dense / 2)
    print(f"{len(pairs)} tensors, {dense / 1e6:.1f} MB dense bf16, {share:.2f}% of elements changed;")
    print(f"entropy bound {bound / 1e3:.1f} kB ({8 * bound / max(changed, 1):.2f} bits per changed element);")
    print(f"given the old value's exponent, {conditioned / 1e3:.1f} kB ({conditioned / bound:.2f} x the bound);")
    print(
        f"positions as one Elias-Fano sequence per tensor {one_ef / 1e3:.1f} kB, as one per exponent class "
        f"of the old value {class_ef / 1e3:.1f} kB ({class_ef / one_ef:.2f}x, before zstd)\n"
    )
    print("| method | bytes | % of dense | x bound | encode MB/s | decode MB/s | memcpy MB/s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for method in methods():
        enc_s, payloads = best_of(repeats, lambda m=method: [m.encode(o, n) for o, n in pairs])
        dec_s, decoded = best_of(
            repeats, lambda m=method, p=payloads: [m.decode(o, x) for (o, _), x in zip(pairs, p, strict=True)]
        )
        for (_, new), got in zip(pairs, decoded, strict=True):
            if not torch.equal(got.view(torch.int16), new.view(torch.int16)):
                raise SystemExit(f"{method.name} is not lossless")
        size = sum(len(p) for p in payloads)
        print(
            f"| {method.name} | {size:,} | {100 * size / dense:.2f} | {size / bound:.2f} | "
            f"{dense / enc_s / 1e6:,.0f} | {dense / dec_s / 1e6:,.0f} | {memcpy:,.0f} |"
        )
    diff_s, _ = best_of(repeats, lambda: [codec.diff(o, n) for o, n in pairs])
    print(
        f"\n`codec.diff` alone (the positions and old and new values of the changes, the first stage "
        f"of every sparse method): {dense / diff_s / 1e6:,.0f} MB/s, {100 * copy_s / diff_s:.1f}% of memcpy"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sequence", type=Path, help="folder written by make_sequence.py")
    p.add_argument("--synthetic", type=int, metavar="NUMEL", help="synthetic tensors of NUMEL elements")
    p.add_argument("--densities", type=float, nargs="+", default=[0.005, 0.01, 0.02, 0.05])
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(1)
    level = codec.CodecOptions().level
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread, lightning_delta at zstd level {level}")
    if args.sequence:
        steps = list(sequence_steps(args.sequence))
        tensors = [pair for step in steps for pair in step]
        run(f"realistic sequence {args.sequence}, tensor by tensor", tensors, args.repeats)
        published = [pair for step in steps for pair in as_published(step)]
        label = f"realistic sequence {args.sequence}, as published (tensors <= 256K elements grouped)"
        run(label, published, args.repeats, bound_pairs=tensors)
        first = load_file(sorted(args.sequence.glob("step-*.safetensors"))[0])
        bases = [pair[1] for pair in as_published([(t.reshape(-1), t.reshape(-1)) for _, t in sorted(first.items())])]
        run_bases(f"realistic sequence {args.sequence}, its first step as bases, as published", bases, args.repeats)
    if args.synthetic:
        for density in args.densities:
            run(
                f"synthetic, {args.synthetic:,} elements, density {density:.1%}",
                [synthetic_pair(args.synthetic, density)],
                args.repeats,
            )
    if not (args.sequence or args.synthetic):
        p.error("give --sequence, --synthetic or both")


if __name__ == "__main__":
    main()
