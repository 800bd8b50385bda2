#!/usr/bin/env bash
# Install torch into the given Python's environment without forcing a CUDA download on a CPU-only machine.
#   - torch already importable: keep it (users with GPUs install the torch they need first).
#   - an NVIDIA GPU is visible: the default PyPI build (CUDA).
#   - otherwise: the CPU build (a local CPU wheel when the machine has one, else PyTorch's CPU index).
set -euo pipefail
PY="${1:-python3}"
if "$PY" -c "import torch" 2>/dev/null; then
    echo "torch $("$PY" -c 'import torch; print(torch.__version__)') already installed"
    exit 0
fi
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    "$PY" -m pip install torch
elif "$PY" -m pip install "torch==2.13.0+cpu"; then
    :
else
    "$PY" -m pip install torch --index-url https://download.pytorch.org/whl/cpu
fi
