"""The `lightning-delta` commands on a chain written by a real run of scripts/train.py."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from conftest import ROOT, bitwise_equal, replace_blob, torchrun
from lightning_delta import DeltaLoader, Store
from lightning_delta import format as fmt
from lightning_delta.cli import main
from lightning_delta.retention import is_base_step

pytestmark = pytest.mark.slow


def train(cwd: Path, *overrides: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(ROOT / "scripts" / "train.py"), "steps=12", "model.dim=32", *overrides]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def chain(tmp_path_factory) -> str:
    tmp = tmp_path_factory.mktemp("cli")
    proc = train(tmp, "delta.base_every=5", f"store.url={tmp / 'store'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return str(tmp / "store")


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_hydra_overrides_reach_the_callback(chain):
    store = Store(chain)
    bases = [s for s in store.published_steps() if is_base_step(store, s, 1)]
    assert bases == [1, 6, 11]  # delta.base_every=5 from the command line


def test_generate_replays_every_step_with_the_trainers_probe(chain, tmp_path):
    cmd = [sys.executable, str(ROOT / "scripts" / "generate.py"), f"store.url={chain}", "model.dim=32"]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line.split() for line in proc.stdout.splitlines() if line.split() and line.split()[0].isdigit()]
    assert [int(r[0]) for r in rows] == list(range(1, 13))
    assert [int(r[2]) for r in rows] == list(range(11, -1, -1))  # behind the newest step
    assert all(float(r[6]) == 0.0 for r in rows)  # same log-probs as the trainer's bf16 weights
    assert len({r[7] for r in rows}) > 6  # the probe's mean log-prob shows the weights moving
    assert "Tip" not in proc.stdout + proc.stderr and "it/s" not in proc.stderr
    assert "applied 12 steps" in proc.stdout


def test_the_demo_prints_its_own_lines_only(tmp_path):
    proc = train(tmp_path, f"store.url={tmp_path / 'store'}", "steps=20")
    assert proc.returncode == 0, proc.stderr[-3000:]
    output = proc.stdout + proc.stderr
    for noise in ("Tip", "LeafSpec", "Epoch", "it/s", "GPU available"):
        assert noise not in output, noise
    assert "step   10/20" in proc.stdout and "step   20/20" in proc.stdout and "published 20 steps" in proc.stdout


def test_an_unknown_override_key_fails(tmp_path):
    proc = train(tmp_path, "delta.base_evry=5", f"store.url={tmp_path / 'store'}")
    assert proc.returncode != 0 and "base_evry" in proc.stderr
    assert not (tmp_path / "store").exists()


def test_inspect(chain, capsys):
    code, out, _ = run_cli(capsys, "inspect", chain, "--json")
    report = json.loads(out)
    assert (report["signer"], report["signer_checked"]) == (None, False) and report["run_id"]
    rows = report["steps"]
    assert code == 0 and [r["step"] for r in rows] == list(range(1, 13))
    assert [r["kind"] for r in rows][:6] == ["base", "delta", "delta", "delta", "delta", "base"]
    delta = rows[1]
    assert 0 < delta["changed_fraction"] < 0.5 and delta["ratio_to_full"] < rows[0]["ratio_to_full"]
    code, out, _ = run_cli(capsys, "inspect", chain)
    assert code == 0 and len(out.splitlines()) == 14 and " base " in out
    assert out.splitlines()[-1].endswith(": unsigned")


def test_verify_is_clean_then_names_a_planted_corruption(chain, tmp_path, capsys):
    assert run_cli(capsys, "verify", chain)[0] == 0
    broken = tmp_path / "broken"
    shutil.copytree(chain, broken)
    blob = broken / fmt.blob_path(8, 0, 1)
    data = bytearray(blob.read_bytes())
    data[-1] ^= 0x10
    blob.write_bytes(bytes(data))
    code, out, _ = run_cli(capsys, "verify", str(broken), "--json")
    report = json.loads(out)
    assert code == 1
    assert [p["step"] for p in report["problems"]] == [8, 9, 10]  # 11 is a base: the chain recovers
    assert report["problems"][0]["readers"] == ["follower", "joiner"]
    assert [(d["step"], d["part"], d["error"]) for d in report["damaged"]] == [(8, "delta", "ChecksumError")]
    assert run_cli(capsys, "verify", str(broken), "--step", "12")[0] == 0


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> str:
    """A chain of two trainer ranks: 8 steps, bases at 1 and 5, each with its bridge."""
    store = tmp_path_factory.mktemp("two") / "store"
    torchrun(ROOT / "tests" / "chain_job.py", str(store))
    return str(store)


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("bridge", [False, True])
@pytest.mark.parametrize("consistent", [False, True])
def test_verify_reads_every_object_and_names_the_readers_each_damaged_one_breaks(
    two_ranks, tmp_path, capsys, rank, bridge, consistent
):
    """A loader that holds the step before takes a base step by its bridge, and one that holds
    nothing by its base: each of the four objects of step 5 damaged alone, `verify` finds it, and
    says who cannot read past it.  `consistent`: the marker is re-signed, so that only the
    trainer's checksums of the rebuilt values can catch it."""
    assert run_cli(capsys, "verify", two_ranks)[0] == 0
    broken = tmp_path / "store"
    shutil.copytree(two_ranks, broken)
    store = Store(str(broken))
    path = broken / fmt.blob_path(5, rank, 2, bridge=bridge)
    data = bytearray(path.read_bytes())
    data[-(len(data) // 4)] ^= 0x01  # inside the last payload
    if consistent:
        replace_blob(store, 5, rank, 2, bytes(data), bridge=bridge)
    else:
        path.write_bytes(bytes(data))
    code, out, _ = run_cli(capsys, "verify", str(broken), "--json")
    report = json.loads(out)
    assert code == 1 and report["objects"] == 2 * (8 + 1)  # a part per rank and step, and a bridge beside base 5
    readers = ["follower"] if bridge else ["joiner"]
    assert {p["step"]: p["readers"] for p in report["problems"]} == {
        s: readers for s in ([5] if bridge else [5, 6, 7, 8])
    }
    if consistent:  # its bytes match its marker: the rebuild is what catches it
        assert report["damaged"] == [] and report["problems"][0]["error"] in ("ChecksumError", "FormatError")
    else:
        [damaged] = report["damaged"]
        assert (damaged["step"], damaged["rank"], damaged["part"]) == (5, rank, "bridge" if bridge else "base")
        expected = "a follower in sync at step 4" if bridge else "a joiner at step 5-8"
        assert damaged["error"] == "ChecksumError" and damaged["breaks"][0].startswith(expected)
    code, out, _ = run_cli(capsys, "verify", str(broken))
    assert code == 1 and "cannot rebuild it" in out and "broken steps" in out
    assert run_cli(capsys, "verify", str(broken), "--step", "4")[0] == 0
    assert run_cli(capsys, "verify", str(broken), "--step", "5")[0] == 1


def test_materialize_equals_the_loader_bit_for_bit(chain, tmp_path, capsys):
    out = tmp_path / "step7.safetensors"
    assert run_cli(capsys, "materialize", chain, "--step", "7", str(out))[0] == 0
    written = load_file(out)
    _, expected = DeltaLoader(chain).state_dict(7)
    assert written.keys() == expected.keys()
    assert all(bitwise_equal(written[k], expected[k]) for k in expected)


def test_cost_counts_what_loaders_move(chain, capsys):
    """One byte count: `cost` says, from markers alone, what a real loader's reports add up to."""
    code, out, _ = run_cli(capsys, "cost", chain, "--regions", "3", "--json")
    report = json.loads(out)
    readers = report["readers"]
    follower = DeltaLoader(chain)
    follower.steps()  # the manifest, read once per loader
    moved = 0
    for step in range(1, 13):
        follower.state_dict(step)
        moved += follower.last_report.bytes_read
    assert code == 0 and readers["in_sync_follower"]["per_region"] == moved
    late = DeltaLoader(chain)
    late.steps()
    late.state_dict(12)
    assert readers["late_joiner_at_12"]["per_region"] == late.last_report.bytes_read
    rows = json.loads(run_cli(capsys, "inspect", chain, "--json")[1])["steps"]
    assert readers["stored"]["per_region"] == sum(r["bytes"] for r in rows)
    full = readers["full_every_step"]
    assert full["per_region"] == 12 * rows[0]["dense_bytes"] and full["total"] == 3 * full["per_region"]
    assert report["formula"]["f"] == 3 and report["formula"]["W"] == 12
    # bridges: the follower reads no base after its first, so it moves far less than the chain stores
    share = readers["in_sync_follower"]["share_of_full"]
    assert share < readers["stored"]["share_of_full"] / 2 and share < report["formula"]["share_of_full"]
    joined = json.loads(run_cli(capsys, "cost", chain, "--regions", "1", "--window", "4", "--join", "10", "--json")[1])
    assert joined["window_steps"] == 4 and joined["formula"]["f"] == 1 and "late_joiner_at_10" in joined["readers"]
    code, out, _ = run_cli(capsys, "cost", chain, "--regions", "3")
    assert code == 0 and "in sync follower" in out and "late joiner at 12" in out and "seed's formula" in out


def test_gc_keeps_what_the_newest_bases_need(chain, tmp_path, capsys):
    import shutil

    copy = tmp_path / "gc"
    shutil.copytree(chain, copy)
    code, out, _ = run_cli(capsys, "gc", str(copy), "--keep-bases", "2", "--json")
    assert code == 0 and json.loads(out)["deleted_steps"] == [1, 2, 3, 4, 5]
    loader = DeltaLoader(str(copy))
    assert loader.steps() == list(range(6, 13))
    for step in loader.steps():
        assert all(
            bitwise_equal(a, b)
            for a, b in zip(
                loader.state_dict(step)[1].values(), DeltaLoader(chain).state_dict(step)[1].values(), strict=True
            )
        )
    assert json.loads(run_cli(capsys, "gc", str(copy), "--keep-bases", "5", "--json")[1])["deleted_steps"] == []


def test_gc_dry_run_deletes_nothing(chain, capsys):
    code, out, _ = run_cli(capsys, "gc", chain, "--keep-bases", "1", "--dry-run")
    assert code == 0 and out.strip() == "would delete 10 steps (1..10)"
    assert DeltaLoader(chain).steps() == list(range(1, 13))


def test_errors_are_one_line_and_non_zero(chain, capsys):
    code, out, err = run_cli(capsys, "materialize", chain, "--step", "99", "/tmp/never.safetensors")
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and "step 99" in err


@pytest.mark.parametrize("where", ["/no/such/path", "empty"])
@pytest.mark.parametrize(
    "command",
    [["inspect"], ["verify"], ["cost", "--regions", "1"], ["gc", "--keep-bases", "1"], ["materialize", "--step", "1"]],
)
def test_a_prefix_without_a_run_is_an_error_never_an_empty_chain(tmp_path, capsys, where, command):
    url = where if where.startswith("/") else str(tmp_path)
    extra = [str(tmp_path / "out.safetensors")] if command[0] == "materialize" else []
    code, out, err = run_cli(capsys, command[0], url, *command[1:], *extra)
    assert code == 2 and out == "" and err.count("\n") == 1 and f"no lightning_delta run at {url}" in err


def test_inspect_and_cost_mark_damaged_steps_and_go_on(chain, tmp_path, capsys):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(chain, broken)
    (broken / fmt.blob_path(8, 0, 1)).unlink()  # committed, but its object is gone
    code, out, _ = run_cli(capsys, "inspect", str(broken), "--json")
    rows = json.loads(out)["steps"]
    assert code == 0 and [r["step"] for r in rows] == list(range(1, 13))
    assert "committed but missing" in rows[7]["damaged"] and all("damaged" not in r for r in rows[:7])
    code, out, _ = run_cli(capsys, "inspect", str(broken))
    assert code == 0 and "DAMAGED" in out.splitlines()[8]
    assert run_cli(capsys, "cost", str(broken), "--regions", "1")[0] == 0


def test_materialize_writes_what_transformers_loads_and_never_overwrites_silently(chain, tmp_path, capsys):
    from safetensors import safe_open

    out = tmp_path / "step3.safetensors"
    assert run_cli(capsys, "materialize", chain, "--step", "3", str(out))[0] == 0
    assert out.stat().st_mode & 0o777 == 0o644
    with safe_open(out, "pt") as f:
        assert f.metadata()["format"] == "pt"
    code, _, err = run_cli(capsys, "materialize", chain, "--step", "4", str(out))
    assert code == 2 and "--force" in err
    assert run_cli(capsys, "materialize", chain, "--step", "4", str(out), "--force")[0] == 0


def _tied_llama():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        tie_word_embeddings=True,
    )


def _served_folder(tmp_path, capsys):
    """A tiny tied-embedding Llama published once and materialized with its config folder."""
    import torch
    from transformers import LlamaForCausalLM

    from lightning_delta import DeltaPublisher

    config = _tied_llama()
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    store = str(tmp_path / "store")
    with DeltaPublisher(store, model) as publisher:
        publisher.publish(1)
    config_dir = tmp_path / "config"
    config.save_pretrained(config_dir)
    out = tmp_path / "served"
    assert run_cli(capsys, "materialize", store, "--step", "1", str(out), "--config", str(config_dir))[0] == 0
    return model, store, out


def test_materialize_with_a_config_folder_loads_with_from_pretrained(tmp_path, capsys):
    """Tied embeddings: published once, tied again by from_pretrained, or expanded by --alias."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    model, store, out = _served_folder(tmp_path, capsys)
    config = _tied_llama()
    loaded, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True, dtype=torch.bfloat16)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    tokens = torch.randint(0, 97, (2, 8))
    with torch.no_grad():
        assert torch.equal(loaded(tokens).logits, model(tokens).logits)
    flat = tmp_path / "strict.safetensors"
    alias = ["--alias", "lm_head.weight=model.embed_tokens.weight"]
    assert run_cli(capsys, "materialize", store, "--step", "1", str(flat), *alias)[0] == 0
    strict = LlamaForCausalLM(config).to(torch.bfloat16)
    strict.load_state_dict(load_file(flat), strict=True)
    code, _, err = run_cli(capsys, "materialize", store, "--step", "1", str(tmp_path / "x"), "--alias", "nope")
    assert code == 2 and "NAME=SOURCE" in err


def test_storage_options_reach_a_non_default_endpoint(s3_url, capsys):
    import torch

    from lightning_delta import DeltaPublisher

    url, options = s3_url
    with DeltaPublisher(url, {"w": torch.ones(8)}, storage_options=options) as publisher:
        publisher.publish(1)
    endpoint = json.dumps({"client_kwargs": options["client_kwargs"]})
    code, out, _ = run_cli(capsys, "inspect", url, "--json", "--storage-options", endpoint)
    assert code == 0 and [r["step"] for r in json.loads(out)["steps"]] == [1]


def test_help_answers_without_importing_torch():
    code = "import sys; from lightning_delta.cli import parser; parser(); assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_console_script_is_installed():
    """Declared in pyproject.toml and installed beside the interpreter: `lightning-delta`, not
    `python -m lightning_delta.cli`, is what the README tells users to run."""
    import tomllib

    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert declared == {"lightning-delta": "lightning_delta.cli:main"}
    script = Path(sys.executable).parent / "lightning-delta"
    assert script.is_file(), f"{script} is missing: install the package (scripts/setup.sh)"
    proc = subprocess.run([str(script), "--help"], capture_output=True, text=True)
    assert proc.returncode == 0 and "materialize" in proc.stdout


OLDEST_TRANSFORMERS = Path(sys.prefix) / "oldest-transformers"  # scripts/setup.sh puts 4.56.2 there


@pytest.mark.slow
def test_materialized_folder_loads_under_the_oldest_transformers(tmp_path, capsys):
    """The extras allow transformers 4.56.2: its from_pretrained loads the folder with no missing or
    unexpected keys, every weight bit for bit, the head tied again to the embedding."""
    assert OLDEST_TRANSFORMERS.is_dir(), "run scripts/setup.sh: it installs the oldest transformers for this test"
    model, _, out = _served_folder(tmp_path, capsys)
    check = """
import sys, torch, transformers
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
assert transformers.__version__ == "4.56.2", transformers.__version__
loaded, info = AutoModelForCausalLM.from_pretrained(sys.argv[1], output_loading_info=True, torch_dtype=torch.bfloat16)
assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
state, stored = loaded.state_dict(), load_file(sys.argv[1] + "/model.safetensors")
assert set(state) == set(stored) | {"lm_head.weight"}, sorted(set(state) ^ set(stored))
for name, tensor in stored.items():
    assert torch.equal(state[name].view(torch.int16), tensor.view(torch.int16)), name
assert torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"])
"""
    env = {**os.environ, "PYTHONPATH": str(OLDEST_TRANSFORMERS)}
    proc = subprocess.run([sys.executable, "-c", check, str(out)], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import torch

    stored = load_file(out / "model.safetensors")
    assert torch.equal(stored["model.embed_tokens.weight"], model.state_dict()["model.embed_tokens.weight"])
