#!/usr/bin/env bash
# The checks a machine with a CUDA GPU runs (torch with CUDA already installed there): build the
# extension in place, run the CUDA tests (tests/test_cuda.py), the peers benchmark on the GPU,
# and core suites with every Session and popxl.compile holding its replicas on the GPU
# (TORCH_POPXL_DEVICE=cuda). Logs go to $OUT (default /tmp/gpu_check). Each step has its own
# time limit so that one slow step still leaves the others' results.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
"$PY" -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$OUT/gpu.txt"
t0=$SECONDS
MAX_JOBS=${MAX_JOBS:-16} "$PY" setup.py -q build_ext --inplace >"$OUT/build.log" 2>&1 \
  || { tail -40 "$OUT/build.log"; exit 1; }
echo "== built in $((SECONDS - t0)) s"
PYTEST=("$PY" -m pytest -p no:cacheprovider -p no:benchmark -q -rfE --tb=short)
echo "== C++ errors: one of torch's own, then one of the extension's (an exception thrown through it)"
"$PY" -c "
import torch
try:
    torch.zeros(2).view(3)
except RuntimeError as e:
    print('torch: ok, RuntimeError')
" 2>&1 | tail -2
"$PY" -c "
import torch, torch_popxl
try:
    torch.ops.torch_popxl.remote_load_stacked(torch.zeros(2, 3, 4), torch.tensor([5, 0]), 1)
except ValueError as e:
    print('extension: ok, ValueError:', str(e)[:60])
" 2>&1 | tail -2
g++ --version | head -1
echo "== tests/test_cuda.py"
timeout "${CUDA_TESTS_S:-180}" "${PYTEST[@]}" tests/test_cuda.py 2>&1 | tee "$OUT/test_cuda.log" | tail -40
echo "== peers benchmark on the GPU"
timeout "${BENCH_S:-200}" "$PY" benchmarks/bench_peers.py --device cuda --rounds "${ROUNDS:-5}" 2>&1 \
  | grep -v '^\[transformers\]' | tee "$OUT/bench_peers.log" | tail -25
echo "== core suites with TORCH_POPXL_DEVICE=cuda"
XDIST=()
"$PY" -c "import xdist" 2>/dev/null && XDIST=(-n "${WORKERS:-8}")
TORCH_POPXL_DEVICE=cuda timeout "${SUITE_S:-150}" "${PYTEST[@]}" "${XDIST[@]}" \
  ${SUITES:-tests/test_remote.py tests/test_replication.py tests/test_session.py tests/test_explicit.py \
  tests/test_compile.py tests/test_compile_semantics.py tests/test_rts_grouped_divisor.py \
  tests/test_addons.py tests/test_random_replicas.py} \
  2>&1 | tee "$OUT/suite_on_cuda.log" | tail -40
echo "== done in $((SECONDS - t0)) s"
