"""Swapping verified steps into inference models: Hugging Face transformers, vLLM's loading path,
name mapping, post-load hooks, the probe check and the measured swap pause."""

from __future__ import annotations

import time

import pytest
import torch

from conftest import bf16_state, bitwise_equal, needs
from lightning_delta import DeltaLoader, DeltaPublisher, FollowSettings, ModelMismatchError, PublisherSettings
from lightning_delta.shards import named_tensors
from tinylm import tiny_llama

needs("transformers")


class Policy(torch.nn.Module):
    """What a trainer often holds: the language model under a prefix of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.policy = tiny_llama()


def probe_logprobs(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Log-probability of each next token of a fixed batch: the probe."""
    with torch.no_grad():
        logits = model(tokens[:, :-1]).logits.float()
    return logits.log_softmax(-1).gather(-1, tokens[:, 1:, None]).squeeze(-1)


PROBE = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(7))


def train_and_publish(url: str, steps: int = 6) -> dict[int, dict[str, torch.Tensor]]:
    """AdamW steps on a wrapped tiny Llama; publishes each step with its bf16 probe, returns the truth."""
    torch.manual_seed(0)
    trainer = Policy()
    opt = torch.optim.AdamW(trainer.parameters(), lr=1e-4)
    shadow = tiny_llama().to(torch.bfloat16)  # computes the probe from the bf16 weights that ship
    truth = {}
    with DeltaPublisher(url, trainer, PublisherSettings(base_every=4)) as publisher:
        for step in range(1, steps + 1):
            tokens = torch.randint(0, 97, (4, 12))
            trainer.policy(tokens, labels=tokens).loss.backward()
            opt.step()
            opt.zero_grad()
            truth[step] = bf16_state(trainer)
            shadow.load_state_dict({k.removeprefix("policy."): v for k, v in truth[step].items()})
            publisher.publish(step, probe=probe_logprobs(shadow, PROBE))
    return truth


def strip(name: str) -> str:
    return name.removeprefix("policy.")


def test_swap_into_transformers_model_gives_the_logits_of_the_trainers_state(store_url):
    truth = train_and_publish(store_url)
    torch.manual_seed(1)  # other initial weights: the swap must overwrite all of them
    rollout = tiny_llama().to(torch.bfloat16).eval()
    posted = []
    loader = DeltaLoader(store_url)
    step = loader.apply_to(rollout, rename=strip, after=lambda m: posted.append(m))
    assert step == 6 and posted == [rollout]

    direct = tiny_llama().to(torch.bfloat16).eval()
    direct.load_state_dict({strip(k): v for k, v in truth[6].items()})
    tokens = torch.randint(0, 97, (3, 10))
    with torch.no_grad():
        assert torch.equal(rollout(tokens).logits, direct(tokens).logits)
    for name, tensor in named_tensors(rollout).items():
        assert bitwise_equal(tensor, truth[6][f"policy.{name}"]), name


def test_a_mapping_that_does_not_fit_copies_nothing_and_skips_the_hook(store_url):
    train_and_publish(store_url, steps=2)
    rollout = tiny_llama().to(torch.bfloat16)
    before = {k: v.clone() for k, v in rollout.state_dict().items()}
    posted = []
    with pytest.raises(ModelMismatchError, match="missing"):  # no prefix stripped: nothing matches
        DeltaLoader(store_url).apply_to(rollout, after=posted.append)
    drop_norms = lambda name: None if "norm" in name else strip(name)  # noqa: E731
    with pytest.raises(ModelMismatchError, match="norm"):
        DeltaLoader(store_url).apply_to(rollout, rename=drop_norms, after=posted.append)
    assert posted == []
    assert all(torch.equal(before[k], v) for k, v in rollout.state_dict().items())


def test_followed_steps_report_the_swap_pause_and_pass_the_probe(store_url):
    """The pause `apply_to` returns is the write's: inside the call, and over before `after` runs."""
    truth = train_and_publish(store_url, steps=5)
    rollout = tiny_llama().to(torch.bfloat16).eval()
    follower = DeltaLoader(store_url).follow(FollowSettings(poll_seconds=0.01))
    followed = next(follower)
    after_at: list[float] = []

    def after(model: torch.nn.Module) -> None:  # a post-processing step with work of its own: a forward pass
        after_at.append(time.perf_counter())
        probe_logprobs(model, PROBE)

    called = time.perf_counter()
    pause = followed.apply_to(rollout, rename=strip, after=after)
    follower.close()
    assert followed.step == 5 and isinstance(pause, float)
    assert 0 < pause <= after_at[0] - called  # the write, timed: not the hook after it
    state = bf16_state(rollout)
    assert {f"policy.{name}" for name in state} == truth[5].keys()
    assert all(bitwise_equal(state[name], truth[5][f"policy.{name}"]) for name in state)
    assert followed.probe is not None and len(followed.probe) == PROBE[:, 1:].numel()
    assert followed.probe_error(probe_logprobs(rollout, PROBE)) == 0.0


def test_probe_catches_an_engine_that_post_processes_the_weights_wrongly(store_url):
    train_and_publish(store_url, steps=3)
    rollout = tiny_llama().to(torch.bfloat16).eval()
    follower = DeltaLoader(store_url).follow(FollowSettings(poll_seconds=0.01))
    followed = next(follower)

    def transpose_one_projection(model: torch.nn.Module) -> None:  # a wrong "fusing" step
        with torch.no_grad():
            q = model.model.layers[0].self_attn.q_proj.weight
            q.copy_(q.t().contiguous())

    followed.apply_to(rollout, rename=strip, after=transpose_one_projection)
    follower.close()
    assert followed.probe_error(probe_logprobs(rollout, PROBE)) > 1e-3
