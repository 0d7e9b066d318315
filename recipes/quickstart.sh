#!/usr/bin/env bash
# README command 1: set up, then convert SmolLM2-135M-Instruct into a BDLM, fine-tune it on the
# shipped tasks, save, reload with AutoModel.from_pretrained and generate. Extra args go to
# recipes/quickstart.py (e.g. --minutes 2).
set -euo pipefail
cd "$(dirname "$0")/.."
bash .ci/setup.sh
exec .venv/bin/python recipes/quickstart.py "$@"
