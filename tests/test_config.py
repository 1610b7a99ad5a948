"""Hydra configs: each component's settings dataclass is its one definition; the shipped YAML and
`instantiate` build exactly it."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from conftest import ROOT, assert_state, bf16_state
from lightning_delta import (
    Backlog,
    DeltaCallback,
    DeltaLoader,
    DeltaPublisher,
    DType,
    FollowSettings,
    LoaderSettings,
    PublisherSettings,
    Store,
)
from lightning_delta.codec import CodecOptions, Compressor, Context
from tinylm import TinyLM

CONF = ROOT / "src" / "lightning_delta" / "conf"


def fields(cls: type) -> dict[str, object]:
    """Every field of a settings dataclass, nested ones as dicts of theirs."""
    out: dict[str, object] = {}
    for f in dataclasses.fields(cls):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        out[f.name] = fields(type(default)) if dataclasses.is_dataclass(default) else None
    return out


def keys(node: object) -> dict[str, object]:
    """The keys of a YAML section, nested sections as dicts of theirs (Hydra's own keys aside)."""
    assert isinstance(node, dict)
    return {k: keys(v) if isinstance(v, dict) else None for k, v in node.items() if k not in ("defaults", "_target_")}


@pytest.mark.parametrize(
    ("yaml", "section", "cls"),
    [
        ("delta/default.yaml", None, PublisherSettings),
        ("callbacks/delta.yaml", "delta.settings", PublisherSettings),
        ("loader/default.yaml", None, LoaderSettings),
        ("follow/default.yaml", None, FollowSettings),
    ],
)
def test_every_shipped_yaml_spells_exactly_the_settings_fields(yaml, section, cls):
    node = OmegaConf.to_container(OmegaConf.load(CONF / yaml))
    for key in (section or "").split(".") if section else []:
        node = node[key]
    assert keys(node) == fields(cls), f"{yaml} and {cls.__name__} name different options"


def test_one_table_names_the_dtypes():
    assert {d.value: d.torch for d in DType} == {
        "bfloat16": torch.bfloat16,
        "float16": torch.float16,
        "int16": torch.int16,
    }
    assert [d for d in DType if d.shipped] == [DType.bfloat16, DType.float16]
    assert DType.of(torch.float16) is DType.float16 and DType.from_code(DType.bfloat16.code) is DType.bfloat16


def test_instantiate_builds_the_callback_from_the_shipped_yaml():
    import lightning_delta

    conf = OmegaConf.load(CONF / "callbacks" / "delta.yaml")
    callback = instantiate(conf.delta, store="s3://bucket/run", settings={"base_every": 10})
    assert isinstance(callback, DeltaCallback)
    settings = callback.settings
    assert (callback.store, settings.base_every, settings.dtype) == ("s3://bucket/run", 10, DType.bfloat16)
    assert settings.backlog == Backlog.BLOCK and settings.keep_bases is None
    assert settings.codec == CodecOptions(Compressor.ZSTD, 1, 4, Context.AUTO)
    packaged = lightning_delta.__file__.replace("__init__.py", "conf/callbacks/delta.yaml")
    assert OmegaConf.load(packaged) == conf  # the configs ship with the installed package


def test_settings_accept_names_and_values_and_name_the_wrong_field():
    settings = PublisherSettings(dtype="float16", backlog="coalesce", codec={"compressor": "LZ4", "context": 1})
    assert (settings.dtype, settings.backlog) == (DType.float16, Backlog.COALESCE)
    assert settings.codec == CodecOptions(Compressor.LZ4, context=Context.EXPONENT)
    assert PublisherSettings(dtype=torch.bfloat16).dtype is DType.bfloat16
    for wrong, field in [
        ({"base_every": 0}, "base_every"),
        ({"keep_bases": 0}, "keep_bases"),
        ({"dtype": "int16"}, "dtype"),
    ]:
        with pytest.raises(ValueError, match=field):
            PublisherSettings(**wrong)
    with pytest.raises(ValueError, match="poll_seconds"):
        FollowSettings(poll_seconds=0)
    with pytest.raises(ValueError, match="'sometimes' is not one of"):
        PublisherSettings(backlog="sometimes")


def test_retention_keeps_the_newest_bases_while_publishing(tmp_path):
    url = str(tmp_path / "store")
    model = TinyLM()
    truth = {}
    with DeltaPublisher(url, model, PublisherSettings(base_every=3, keep_bases=2)) as pub:
        for step in range(1, 12):  # bases at 1, 4, 7, 10
            with torch.no_grad():
                next(model.parameters()).add_(1e-3)
            truth[step] = bf16_state(model)
            pub.publish(step)
    store = Store(url)
    assert store.published_steps() == list(range(7, 12))  # the two newest bases are 10 and 7
    loader = DeltaLoader(url)
    assert loader.steps() == list(range(7, 12))
    for step in loader.steps():  # everything kept still rebuilds, exactly
        assert_state(loader.state_dict(step)[1], truth[step])


def test_groups_compose_and_typos_fail():
    from hydra import compose, initialize_config_module

    from lightning_delta.config import GenerateConfig, TrainConfig, register_configs

    register_configs()
    with initialize_config_module("lightning_delta.conf", version_base="1.3"):
        overrides = ["store=s3", "store.url=s3://bucket/run1", "delta.base_every=10", "delta.codec.context=EXPONENT"]
        train = OmegaConf.to_object(compose("train", overrides=overrides))
        assert isinstance(train, TrainConfig) and isinstance(train.delta, PublisherSettings)
        assert (train.store.url, train.delta.base_every, train.delta.dtype) == ("s3://bucket/run1", 10, DType.bfloat16)
        assert train.delta.codec.context == Context.EXPONENT
        assert train.store.storage_options["config_kwargs"]["retries"] == {"max_attempts": 10, "mode": "standard"}
        endpoint = "+store.storage_options.client_kwargs.endpoint_url=http://127.0.0.1:9000"
        cfg = compose("train", overrides=["store=s3", endpoint])
        assert cfg.store.storage_options.client_kwargs.endpoint_url == "http://127.0.0.1:9000"
        with pytest.raises(Exception, match=r"store\.url"):  # no placeholder bucket to write into by mistake
            OmegaConf.to_object(compose("train", overrides=["store=s3"]))
        generate = OmegaConf.to_object(compose("generate", overrides=["loader.device=cuda", "follow.timeout=5"]))
        assert isinstance(generate, GenerateConfig) and isinstance(generate.follow, FollowSettings)
        assert (generate.loader, generate.follow.timeout) == (LoaderSettings(device="cuda"), 5.0)
        with pytest.raises(Exception, match="base_evry"):
            compose("train", overrides=["delta.base_evry=10"])
        with pytest.raises(Exception, match="backlog"):
            OmegaConf.to_object(compose("train", overrides=["delta.backlog=sometimes"]))
