#!/usr/bin/env bash
# Create (or reuse) ./.venv and install torch_popxl with its C++ extension, the examples' and
# the tests' extras.
#
# What it downloads: torch 2.14.1 + torchvision 0.29.1 from PyPI, the default (CUDA) build of
# torch, about 5.6 GB with its NVIDIA libraries. That pair is pinned on purpose: torchvision
# does not import with the CPU-only torch build some machines carry. If you already have a
# torch >= 2.8, skip this script and use pip (see README, Install).
#
# The extension is compiled (a C++17 compiler is needed) against the torch installed here:
# --no-build-isolation, since an isolated build would download another torch. MAX_JOBS bounds
# the parallel compile jobs (default 2).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
PIP=(.venv/bin/python -m pip install -q --disable-pip-version-check)
# Build requirements first: --no-build-isolation does not install them.
"${PIP[@]}" torch==2.14.1 torchvision==0.29.1 setuptools wheel ninja
# torch's build looks for the ninja executable on PATH; pip put it in .venv/bin. Without it
# the build silently falls back to compiling one file at a time.
PATH="$PWD/.venv/bin:$PATH" MAX_JOBS=${MAX_JOBS:-2} "${PIP[@]}" --no-build-isolation -e ".[examples,test]"
