#!/usr/bin/env bash
# README command 2: set up, then run the whole test suite (distributed tests launch torchrun
# with the gloo backend; GPU-only tests skip with a reason). Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash .ci/setup.sh
exec .venv/bin/python -m pytest -q -rs --durations=25 "$@"
