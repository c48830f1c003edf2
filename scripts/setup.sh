#!/usr/bin/env bash
# Create (or reuse) ./.venv and install torch_popxl with its C++ extension.
# torch is pinned to the build this machine kind provides; the extension is compiled
# against it with --no-build-isolation (an isolated build would download another torch).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check \
  torch==2.14.1 torchvision==0.29.1 numpy pytest hypothesis ninja tqdm matplotlib ruff mypy setuptools wheel
MAX_JOBS=${MAX_JOBS:-2} .venv/bin/python -m pip install -q --disable-pip-version-check \
  --no-build-isolation --no-deps -e .
