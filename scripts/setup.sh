#!/usr/bin/env bash
# Creates .venv and installs lightning_delta with its test and example extras (5 to 10 minutes on a
# fresh machine, nearly all of it pip fetching Lightning, transformers, TRL and moto).  torch is installed
# first and pinned: an unpinned torch pulled in by another package would download a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
pip=(.venv/bin/python -m pip install -q --disable-pip-version-check)
echo "setup [1/3]: creating .venv" >&2
python3 -m venv .venv
echo "setup [2/3]: torch 2.13.0 (pinned)" >&2
"${pip[@]}" torch==2.13.0
echo "setup [3/3]: lightning_delta with the test and example extras (the long part)" >&2
"${pip[@]}" -c <(echo torch==2.13.0) -e '.[test,examples]'
echo "setup: done" >&2
