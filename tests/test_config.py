"""Hydra configs: schemas, the shipped YAML, and building the callback from config."""

from __future__ import annotations

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from conftest import ROOT
from lightning_delta import Backlog, DeltaCallback, DeltaLoader, DeltaPublisher, Store
from lightning_delta.config import DeltaConfig, DType
from lightning_delta.format import DTYPE_NAMES
from tinylm import TinyLM


def test_the_config_enum_names_exactly_the_wire_dtypes():
    assert {d.value: d.torch for d in DType} == DTYPE_NAMES


def test_instantiate_builds_the_callback_from_the_shipped_yaml():
    import lightning_delta

    conf = OmegaConf.load(ROOT / "src" / "lightning_delta" / "conf" / "callbacks" / "delta.yaml")
    callback = instantiate(conf.delta, store="s3://bucket/run", base_every=10)
    assert isinstance(callback, DeltaCallback)
    settings = callback.settings
    assert (settings.store, settings.base_every, settings.dtype) == ("s3://bucket/run", 10, torch.bfloat16)
    assert settings.backlog == Backlog.BLOCK and settings.keep_bases is None
    packaged = lightning_delta.__file__.replace("__init__.py", "conf/callbacks/delta.yaml")
    assert OmegaConf.load(packaged) == conf  # the configs ship with the installed package


def test_config_validation_names_the_field():
    with pytest.raises(ValueError, match="base_every"):
        DeltaConfig(base_every=0)
    with pytest.raises(ValueError, match="keep_bases"):
        DeltaConfig(keep_bases=0)


def test_retention_keeps_the_newest_bases_while_publishing(tmp_path):
    url = str(tmp_path / "store")
    model = TinyLM()
    with DeltaPublisher(url, model, base_every=3, keep_bases=2) as pub:
        for step in range(1, 12):  # bases at 1, 4, 7, 10
            with torch.no_grad():
                next(model.parameters()).add_(1e-3)
            pub.publish(step)
    store = Store(url)
    assert store.published_steps() == list(range(7, 12))  # the two newest bases are 10 and 7
    loader = DeltaLoader(url)
    for step in loader.steps():
        loader.state_dict(step)  # everything kept still rebuilds and verifies


def test_groups_compose_and_typos_fail():
    from hydra import compose, initialize_config_module

    from lightning_delta.config import TrainConfig, register_configs

    register_configs()
    with initialize_config_module("lightning_delta.conf", version_base="1.3"):
        cfg = compose("train", overrides=["store=s3", "store.url=s3://bucket/run1", "delta.base_every=10"])
        train = OmegaConf.to_object(cfg)
        assert isinstance(train, TrainConfig)
        assert (train.store.url, train.delta.base_every, train.delta.dtype) == ("s3://bucket/run1", 10, DType.bfloat16)
        assert train.store.storage_options["config_kwargs"]["retries"] == {"max_attempts": 10, "mode": "standard"}
        endpoint = "+store.storage_options.client_kwargs.endpoint_url=http://127.0.0.1:9000"
        cfg = compose("train", overrides=["store=s3", endpoint])
        assert cfg.store.storage_options.client_kwargs.endpoint_url == "http://127.0.0.1:9000"
        with pytest.raises(Exception, match=r"store\.url"):  # no placeholder bucket to write into by mistake
            OmegaConf.to_object(compose("train", overrides=["store=s3"]))
        generate = compose("generate", overrides=["loader.device=cuda"])
        assert generate.loader.device == "cuda"
        with pytest.raises(Exception, match="base_evry"):
            compose("train", overrides=["delta.base_evry=10"])
        with pytest.raises(Exception, match="backlog"):
            OmegaConf.to_object(compose("train", overrides=["delta.backlog=sometimes"]))
