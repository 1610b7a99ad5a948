#!/usr/bin/env bash
# Creates .venv and installs lightning_delta with its test extras.  torch is installed first and
# pinned: an unpinned torch pulled in by another package would download a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[test,examples]'
