"""The backend's `vllm.general_plugins` entry point in the vLLM venv, with no engine: it registers
once, never raises (vLLM calls it unguarded at every startup), and says in one line what it did
not do where vLLM's API moved.  Prints a JSON report:

    .venv-vllm/bin/python tests/vllm_register_job.py
"""

from __future__ import annotations

import json
import logging
import os

import vllm._custom_ops as ops
from vllm.distributed.weight_transfer import WeightTransferEngineFactory

from lightning_delta import vllm_backend


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname} {record.getMessage()}")


def main() -> None:
    said = Lines()
    logging.getLogger("vllm.lightning_delta").addHandler(said)
    logging.getLogger("vllm.lightning_delta").setLevel(logging.INFO)  # as vLLM's engine sets "vllm"
    report: dict[str, object] = {}
    os.environ[vllm_backend.PLAIN_WEIGHTS] = "1"
    ops._supports_onednn = True
    vllm_backend.register()
    vllm_backend.register()  # a second time in one process: already registered, nothing said
    engine = WeightTransferEngineFactory._registry[vllm_backend.NAME]()
    report["registered"] = engine is vllm_backend.LightningDeltaEngine
    report["onednn"] = ops._supports_onednn
    report["plain"], said.lines = said.lines, []

    register = WeightTransferEngineFactory.register_engine
    del WeightTransferEngineFactory._registry[vllm_backend.NAME]
    WeightTransferEngineFactory.register_engine = None  # a vLLM whose factory moved
    vllm_backend.register()
    WeightTransferEngineFactory.register_engine = register
    report["moved"], said.lines = said.lines, []
    report["unregistered"] = vllm_backend.NAME not in WeightTransferEngineFactory._registry

    del ops._supports_onednn  # a vLLM without the flag
    vllm_backend.register()
    report["no_flag"] = said.lines
    print(json.dumps(report))


if __name__ == "__main__":
    main()
