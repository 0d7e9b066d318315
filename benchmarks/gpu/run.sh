#!/usr/bin/env bash
# The GPU runbook in one command (docs/gpu.md): checks and timings of hf_bdlm on this machine's GPU(s), offline.
#   bash benchmarks/gpu/run.sh [--dry-run] [--out DIR] [--budget-minutes M] [--sections ...]
# Writes DIR/runbook.json and DIR/summary.txt (default DIR: gpu_results). Exit codes: 0 all checks passed,
# 1 an exactness check failed, 2 no GPU visible (without --dry-run).
set -euo pipefail
cd "$(dirname "$0")/../.."
# Nothing is downloaded: the models are random, built from configs; keep the hub offline so nothing tries.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -x .venv/bin/python ]; then PY=.venv/bin/python
else PY=python3
fi
exec "$PY" -m benchmarks.gpu.runbook "$@"
