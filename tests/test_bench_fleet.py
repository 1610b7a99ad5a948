"""`scripts/bench_fleet.py`: its link proxy relays and counts every byte, and its smallest fleet
(three regions of two replicas, the three modes, links shaped by the proxy alone) runs end to end
with every swap exact and the bytes each mode must move seen crossing the links."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from conftest import ROOT, DictObjects
from lightning_delta import format as fmt

sys.path.insert(0, str(ROOT / "scripts"))
from bench_fleet import MODES, REGIONS, DelayProxy, Timeline, TokenBucket, digest, model_for, written

FIGURES = (
    "cross_region_bytes_per_step",
    "codec_bytes_per_step",
    "generating_fraction",
    "commit_to_swapped_p95_s",
    "staleness_max",
)


def test_the_link_proxy_relays_every_byte_both_ways_and_counts_them():
    payload = bytes(range(256)) * 4000
    server = socket.create_server(("127.0.0.1", 0))
    got_request = []

    def serve() -> None:
        conn, _ = server.accept()
        with conn:
            got_request.append(conn.recv(5))
            conn.sendall(payload)

    threading.Thread(target=serve, daemon=True).start()
    proxy = DelayProxy("127.0.0.1", server.getsockname(), rtt=0.02, bucket=TokenBucket(100e6))
    port = proxy.open_port()
    try:
        with socket.create_connection(("127.0.0.1", port)) as client:
            client.sendall(b"hello")
            client.shutdown(socket.SHUT_WR)
            received = b""
            while chunk := client.recv(1 << 16):
                received += chunk
    finally:
        proxy.close()
        server.close()
    assert got_request == [b"hello"] and received == payload
    assert proxy.counts[port] == len(payload) + 5


def test_a_module_replica_holds_each_tensor_of_a_sequence_under_its_name():
    """TinyLM's names or a Hugging Face Llama's (the sequence vLLM replicas load): the replica's
    module has a parameter of each tensor's name, shape and dtype, and nothing else."""
    g = torch.Generator().manual_seed(0)
    truth = {
        name: torch.randn(shape, generator=g).to(torch.bfloat16)
        for name, shape in {
            "model.embed_tokens.weight": (8, 4),
            "model.layers.0.self_attn.q_proj.weight": (4, 4),
            "model.layers.0.input_layernorm.weight": (4,),
            "model.layers.1.mlp.up_proj.weight": (6, 4),
            "lm_head.weight": (8, 4),
            "logit_scale": (3,),
        }.items()
    }
    module = model_for(truth)
    assert {k: (v.shape, v.dtype) for k, v in module.state_dict().items()} == {
        k: (v.shape, v.dtype) for k, v in truth.items()
    }
    assert digest(module.state_dict()) != digest(truth)  # zeros until a step is applied
    module.load_state_dict(truth)
    assert digest(module.state_dict()) == digest(truth)


def test_a_replicas_waits_merge_while_another_replica_of_its_region_records_between_them():
    """The region's replicas share one list of intervals: a replica waiting for minutes (engines
    starting elsewhere) is one interval, not one per poll."""
    events: list[dict] = []
    lock = threading.Lock()
    a, b = Timeline("a", events, lock), Timeline("b", events, lock)
    for i in range(100):
        a.add("waiting", i, i + 1)
        b.add("waiting", i, i + 1)
    a.add("generating", 100, 101, step=1)
    a.add("waiting", 101, 102)
    a.add("waiting", 102, 103)
    got = [(e["replica"], e["kind"], e["t0"], e["t1"]) for e in events]
    assert got == [
        ("a", "waiting", 0, 100),
        ("b", "waiting", 0, 100),
        ("a", "generating", 100, 101),
        ("a", "waiting", 101, 103),
    ]


def test_every_step_a_mirror_writes_is_timed_by_its_parts_markers():
    """The mirror's lag is timed per step from its markers' writes at the mirror: a pass that
    copies a backlog writes each step's markers, and each is timed (only the newest step of a pass
    was, so the older ones, the latest, went uncounted); a blob, a base's bridge (written before
    its part) and a marker already there time nothing."""
    objects = DictObjects("dict://mirror")
    events: list[dict] = []
    written(objects, events, threading.Lock())
    objects.create(fmt.commit_path(3, 0, 1), b"{}")  # there before: not written by this pass
    keys = [fmt.RUN_MANIFEST, fmt.blob_path(3, 0, 1), fmt.commit_path(3, 0, 1), fmt.blob_path(4, 0, 1)]
    keys += [fmt.commit_path(4, 0, 1)]
    keys += [fmt.commit_path(5, 1, 2, bridge=True), fmt.commit_path(5, 1, 2), fmt.commit_path(5, 0, 2)]
    events.clear()
    for key in keys:
        objects.create(key, b"{}")
    assert [(e["replica"], e["kind"], e["step"]) for e in events] == [("mirror", "mirrored", s) for s in (4, 5, 5)]
    assert all(isinstance(e["t"], float) for e in events)


def write_sequence(folder: Path, steps: int) -> None:
    """A small model's bf16 steps (one layer, dim 32: ~45 K elements), each changing 1% of every
    tensor's elements by one to three ULPs, a sparse delta as an RL step's is:
    written here in milliseconds instead of trained in a process of its own (10-25 s on 2 cores)."""
    g = torch.Generator().manual_seed(0)
    shapes = {"embed.weight": (512, 32), "head.weight": (512, 32), "norm.weight": (32,)}
    shapes |= {f"layers.0.{name}.weight": (32, 32) for name in ("q", "k", "v", "o")}
    shapes |= {"layers.0.up.weight": (128, 32), "layers.0.down.weight": (32, 128), "layers.0.norm.weight": (32,)}
    state = {name: (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16) for name, shape in shapes.items()}
    folder.mkdir()
    for step in range(steps):
        save_file(state, folder / f"step-{step:06d}.safetensors")
        for name, tensor in state.items():
            bits = tensor.view(torch.int16).clone().reshape(-1)
            index = torch.randperm(bits.numel(), generator=g)[: max(1, bits.numel() // 100)]
            size = torch.randint(1, 4, (index.numel(),), generator=g) * torch.where(
                torch.rand(index.numel(), generator=g) < 0.5, 1, -1
            )
            bits[index] += size.to(torch.int16)
            state[name] = bits.view(torch.bfloat16).reshape(tensor.shape)


@pytest.mark.slow
def test_bench_fleet_smallest_case(tmp_path):
    seq = tmp_path / "seq"
    write_sequence(seq, 3)  # steps 1-3: the warm-up, then a window of two
    out, png = tmp_path / "fleet.json", tmp_path / "fleet.png"
    args = ["--no-kernel", "--replicas", "2", "--period", "1", "--generate", "0.2", "--mbit", "20"]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts/bench_fleet.py"), str(seq), *args, "--json", str(out), "--png", str(png)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "proxy only" in proc.stdout  # --no-kernel says how the links were made
    figures = json.loads(out.read_text())
    assert set(figures) == set(MODES)
    regions = {name for name, _ in REGIONS} | {"fleet"}
    for mode, numbers in figures.items():
        assert numbers["mismatches"] == 0 and numbers["replicas"] == 2, mode
        for name in FIGURES:
            assert set(numbers[name]) == regions, (mode, name)
        for region in regions - {"fleet"}:
            assert 0 < numbers["generating_fraction"][region] <= 1, mode
            crossed, codec = numbers["cross_region_bytes_per_step"][region], numbers["codec_bytes_per_step"][region]
            readers = 1 if mode == "delta_mirror" else 2  # one mirror, or every replica, reads home
            assert crossed >= readers * codec, (mode, region, crossed, codec)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
