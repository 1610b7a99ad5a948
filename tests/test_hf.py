"""DeltaTrainerCallback in a real `transformers.Trainer` run on CPU (a tiny Llama built from a config)."""

from __future__ import annotations

import types

import pytest
import torch

from conftest import assert_state, bf16_state, needs

needs("transformers", "accelerate", "peft")

import peft  # noqa: E402
import transformers  # noqa: E402

from hf_dist_job import Tokens  # noqa: E402
from lightning_delta import DeltaLoader, PublishError, PublisherSettings, UnsupportedStrategyError  # noqa: E402
from lightning_delta.hf import DeltaTrainerCallback  # noqa: E402
from tinylm import tiny_llama  # noqa: E402


class Truth(transformers.TrainerCallback):
    """Records the bf16 weights after each optimizer step: what a loader must rebuild."""

    def __init__(self) -> None:
        self.states: dict[int, dict[str, torch.Tensor]] = {}

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.states[state.global_step] = bf16_state(model)


def fit(
    tmp_path, callback, steps: int = 6, accumulation: int = 2, model=None, truth=None, **extra
) -> tuple[Truth, torch.nn.Module, transformers.Trainer]:
    """A tiny Llama (or `model`) trained by a real Trainer; `truth` (default `Truth`) records each step."""
    torch.manual_seed(0)
    model = tiny_llama() if model is None else model
    truth = Truth() if truth is None else truth
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=steps,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=accumulation,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(64), callbacks=[callback, truth])
    trainer.train()
    return truth, model, trainer


def test_every_optimizer_step_rebuilds_bit_exactly(tmp_path):
    url = str(tmp_path / "store")
    callback = DeltaTrainerCallback(url, PublisherSettings(base_every=4))
    truth, model, trainer = fit(tmp_path, callback)
    loader = DeltaLoader(url)
    assert loader.steps() == [1, 2, 3, 4, 5, 6]  # one per optimizer step, not per micro-batch
    for step in loader.steps():
        assert_state(loader.state_dict(step)[1], truth.states[step])
    replica = tiny_llama()
    loader.apply_to(replica)
    tokens = torch.randint(0, 97, (2, 12))
    with torch.no_grad():
        assert torch.equal(replica.to(torch.bfloat16)(tokens).logits, model.to(torch.bfloat16)(tokens).logits)
    logged = [h for h in trainer.state.log_history if "delta/changed_fraction" in h]
    assert logged and all(0 <= h["delta/changed_fraction"] <= 1 for h in logged)
    trainer.log({"eval_loss": 1.0})  # after training: no stale publishing figures
    assert not any(key.startswith("delta/") for key in trainer.state.log_history[-1])


def test_a_used_prefix_is_refused_before_training(tmp_path):
    url = str(tmp_path / "store")
    fit(tmp_path, DeltaTrainerCallback(url), steps=2, accumulation=1)
    with pytest.raises(PublishError, match="belongs to run"):
        fit(tmp_path, DeltaTrainerCallback(url), steps=2, accumulation=1)


def lora(model: torch.nn.Module, seed: int = 0, **config) -> torch.nn.Module:
    """`model` with LoRA adapters on q/v (and whatever `config` adds), B made non-zero so the
    merge is not the identity."""
    wrapped = peft.get_peft_model(
        model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], **config)
    )
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return wrapped


def merged_truth(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    import copy

    return bf16_state(copy.deepcopy(model).merge_and_unload())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merged_tensors_are_exactly_merge_and_unload(dtype):
    from lightning_delta.merged import merged_tensors

    torch.manual_seed(0)
    model = lora(tiny_llama().to(dtype), lora_dropout=0.0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    merged = {n: t.to(torch.bfloat16) for n, t in merged_tensors(model).items()}
    assert_state(merged, merged_truth(model))
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())  # the model is untouched
    assert "model.layers.0.self_attn.q_proj.weight" in merged and not any("lora" in n for n in merged)


def test_a_peft_lora_policy_is_published_merged(tmp_path):
    """Every optimizer step equals `merge_and_unload()` of the policy at that step, bit for bit."""

    class MergedTruth(transformers.TrainerCallback):
        def __init__(self) -> None:
            self.states: dict[int, dict[str, torch.Tensor]] = {}

        def on_step_end(self, args, state, control, model=None, **kwargs):
            self.states[state.global_step] = merged_truth(model)

    url = str(tmp_path / "store")
    torch.manual_seed(0)
    truth = MergedTruth()
    fit(
        tmp_path,
        DeltaTrainerCallback(url, PublisherSettings(base_every=3)),
        steps=4,
        accumulation=1,
        model=lora(tiny_llama()),
        truth=truth,
    )
    loader = DeltaLoader(url)
    assert loader.steps() == [1, 2, 3, 4]
    for step in loader.steps():
        assert_state(loader.state_dict(step)[1], truth.states[step])
    replica = tiny_llama()  # a plain base model, as a rollout engine holds it
    assert loader.apply_to(replica) == 4
    assert_state(bf16_state(replica), truth.states[4])  # the merged policy, under the base model's names


def test_a_peft_model_it_cannot_merge_is_refused_with_the_way_out():
    from lightning_delta.merged import merged_tensors

    model = lora(tiny_llama(), use_dora=True)
    with pytest.raises(UnsupportedStrategyError, match="merge_and_unload"):
        merged_tensors(model)


@pytest.mark.slow
def test_each_process_of_a_distributed_trainer_publishes_its_share(tmp_path):
    from safetensors.torch import load_file

    from conftest import ROOT, torchrun
    from lightning_delta import Store

    store, truth = str(tmp_path / "store"), tmp_path / "truth"
    truth.mkdir()
    torchrun(ROOT / "tests" / "hf_dist_job.py", store, str(truth))
    ranks = [(truth / f"rank-{r}.txt").read_text().split() for r in range(2)]
    assert ranks[0] == ranks[1] and ranks[0][0] == "2"  # both processes, one run
    run = Store(store).manifest()
    assert run.world_size == 2 and min(run.numel(0), run.numel(1)) > 0  # each uploads its own share
    loader = DeltaLoader(store)
    assert loader.steps() == [1, 2, 3, 4, 5]
    for step in loader.steps():
        assert_state(loader.state_dict(step)[1], load_file(truth / f"step-{step}.safetensors"))


class FlatParameter(torch.nn.Parameter):
    """FSDP1's flat parameter, as its class name shows it (FSDP1 needs the real collectives to build one)."""


@pytest.mark.parametrize(
    ("unreadable", "way_out"),
    [
        ("fsdp1", "use FSDP2"),
        ("zero3", "ZeRO stage 1 or 2"),
        ("qlora", "train LoRA over a bf16 base model"),
    ],
)
def test_weights_that_are_not_the_weights_are_refused_with_the_way_out(tmp_path, unreadable, way_out):
    """The conditions are built directly: FSDP1, DeepSpeed and bitsandbytes do not run on this CPU."""
    model = tiny_llama()
    layer = model.model.layers[0].self_attn.q_proj
    if unreadable == "fsdp1":
        layer.weight = FlatParameter(layer.weight.detach().reshape(-1))
    elif unreadable == "zero3":
        layer.weight = torch.nn.Parameter(torch.empty(0))
        layer.weight.ds_id, layer.weight.ds_shape = 7, (64, 64)  # what ZeRO-3 leaves in the module
    else:
        model = lora(model)
        base = model.get_base_model().model.layers[0].self_attn.q_proj.get_base_layer()
        base.weight.quant_state = object()  # bitsandbytes' Params4bit carries its quantization state
    callback = DeltaTrainerCallback(str(tmp_path / "store"))
    with pytest.raises(UnsupportedStrategyError, match=way_out):
        callback.on_train_begin(None, types.SimpleNamespace(global_step=0), None, model=model)


@pytest.mark.slow
def test_the_probe_under_fsdp2_publishes_each_ranks_shard(tmp_path):
    from safetensors.torch import load_file

    from conftest import ROOT, torchrun

    store, truth = str(tmp_path / "store"), tmp_path / "truth"
    torchrun(ROOT / "tests" / "hf_fsdp2_job.py", store, str(truth))
    loader = DeltaLoader(store)
    assert loader.steps() == [1, 2, 3, 4]
    for step in loader.steps():
        assert_state(loader.state_dict(step)[1], load_file(truth / f"step-{step}.safetensors"))
        assert loader.last_report.probe == tuple(torch.load(truth / f"probe-{step}.pt").flatten().tolist())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_peft_publish_holds_one_merged_weight_at_a_time(tmp_path, monkeypatch, dtype):
    """Merging every adapted weight up front (or to plan, or to find devices) would hold a copy of
    each beside the model, or merge it twice."""
    import copy
    import weakref

    from peft import LoraConfig, get_peft_model

    from lightning_delta import DeltaPublisher
    from lightning_delta import merged as merged_module

    merges, alive_before = [], []
    real = merged_module._merged

    def tracked(layer, which):
        alive_before.append(sum(ref() is not None for ref in merges))  # earlier merged weights still held
        out = real(layer, which)
        merges.append(weakref.ref(out))
        return out

    monkeypatch.setattr(merged_module, "_merged", tracked)
    torch.manual_seed(0)
    layers = 4  # each over the publisher's small-slice bound, so each is a payload of its own
    base = torch.nn.Sequential(*(torch.nn.Linear(768, 512, bias=False) for _ in range(layers))).to(dtype)
    config = LoraConfig(r=4, target_modules=[str(i) for i in range(layers)], init_lora_weights=False)
    model = get_peft_model(base, config)
    truth = {}
    with DeltaPublisher(str(tmp_path), model, PublisherSettings(base_every=2)) as publisher:
        for step in (1, 2, 3):
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if "lora_" in name:
                        p.add_(0.1 * torch.randn_like(p))
            truth[step] = bf16_state(copy.deepcopy(model).merge_and_unload())
            publisher.publish(step)
    assert len(merges) == 3 * layers and max(alive_before) <= 1  # once a publish on the CPU (twice on CUDA), let go
    for step in (1, 2, 3):
        assert_state(DeltaLoader(str(tmp_path)).state_dict(step)[1], truth[step])
