#!/usr/bin/env bash
# Creates .venv and installs lightning_delta with its test and example extras (5 to 10 minutes on a
# fresh machine, nearly all of it pip fetching Lightning, transformers, TRL and moto).  torch is installed
# first and pinned: an unpinned torch pulled in by another package would download a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
pip=(.venv/bin/python -m pip install -q --disable-pip-version-check)
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
echo "setup: done" >&2
