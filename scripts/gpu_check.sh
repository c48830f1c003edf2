#!/usr/bin/env bash
# The checks a machine with a CUDA GPU runs (torch with CUDA already installed there), in one
# call: build the extension, probe how its C++ argument checks raise there, run the CUDA tests
# (tests/test_cuda.py), the peers benchmark on the GPU and, time allowing, core suites with
# every Session and popxl.compile holding its replicas on the GPU (TORCH_POPXL_DEVICE=cuda).
# Logs go to $OUT (default /tmp/gpu_check). Each step has its own time limit so that one slow
# step still leaves the others' results; the whole script fits in about 9 minutes.
#
# The probe: on the lent H200 (2026-11-27) the environment's CXX was /opt/gcc/bin/g++, a newer
# GCC than the system's libstdc++ the process loads; an extension built with it crashed (SIGSEGV
# inside std::ostream's number formatting) whenever one of its checks formatted an error
# message. Builds side by side (VARIANTS: "default" = the environment's CXX, "system" = the g++
# on PATH, "unwind" = -O2 with unwind tables and frame pointers), each is asked to raise, and the
# first that raises is the one tested; where none does, cuda-gdb (the machine has no gdb) prints
# the crashing stack.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
PY=${PYTHON:-python3}
ROOT=$PWD
t0=$SECONDS
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  "$PY" -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)"
  echo "CXX=${CXX:-} ($(${CXX:-c++} --version | head -1)); g++ on PATH: $(g++ --version | head -1)"
  nproc
} 2>&1 | tee "$OUT/gpu.txt"

VARIANTS=${VARIANTS:-default system}
echo "== builds side by side: $VARIANTS"
declare -A FLAGS=([default]="-O3" [system]="-O3" [unwind]="-O2 -g -fasynchronous-unwind-tables -fno-omit-frame-pointer")
declare -A CC=([default]="${CXX:-c++}" [system]="$(command -v g++)" [unwind]="${CXX:-c++}")
for v in $VARIANTS; do
  d=/tmp/tpx_$v
  rm -rf "$d" && mkdir -p "$d" && cp -r setup.py pyproject.toml README.md csrc torch_popxl "$d"/
  (cd "$d" && CXX="${CC[$v]}" MAX_JOBS=8 TORCH_POPXL_CXXFLAGS="${FLAGS[$v]}" \
    timeout 240 "$PY" setup.py -q build_ext --inplace >"/tmp/build_$v.log" 2>&1; echo "build $v rc=$?") &
done
wait
echo "== built in $((SECONDS - t0)) s"
tail -3 /tmp/build_*.log

PROBE='
import torch, torch_popxl
try:
    torch.ops.torch_popxl.remote_load_stacked(torch.zeros(2, 3, 4), torch.tensor([5, 0]), 1)
    print("no error raised")
except (ValueError, RuntimeError) as e:
    print("RAISED", type(e).__name__, str(e)[:60])
'
echo "== probe: torch's own error, then the extension's, per build (rc -11 = SIGSEGV)"
timeout 60 "$PY" -c "
import torch
try:
    torch.zeros(2).view(3)
except RuntimeError as e:
    print('torch: RuntimeError raised')
" 2>&1 | tail -1
for v in $VARIANTS; do
  for st in 1 0; do
    (cd /tmp/tpx_$v && PYTHONPATH=/tmp/tpx_$v TORCH_SHOW_CPP_STACKTRACES=$st timeout 60 "$PY" -c "$PROBE" \
      >"/tmp/probe_${v}_$st.log" 2>&1; echo "probe $v stacktraces=$st rc=$? $(grep -h 'RAISED\|no error' "/tmp/probe_${v}_$st.log")") &
  done
done
wait
PICK=""
for v in $VARIANTS; do
  if grep -q RAISED "/tmp/probe_${v}_1.log" && grep -q RAISED "/tmp/probe_${v}_0.log"; then PICK=$v; break; fi
done
if [ -z "$PICK" ] && command -v cuda-gdb >/dev/null; then
  echo "== the default build's crash, under cuda-gdb"
  (cd /tmp/tpx_default && PYTHONPATH=/tmp/tpx_default timeout 90 cuda-gdb -q -batch -ex run -ex bt \
    --args "$PY" -c "$PROBE" 2>&1 | grep -v '^\[New Thread\|^\[Thread\|^warning' | tail -45) | tee "$OUT/crash_bt.log"
fi
PICK=${PICK:-default}
echo "== testing the '$PICK' build ($((SECONDS - t0)) s)"
cp /tmp/tpx_$PICK/torch_popxl/_C*.so "$ROOT/torch_popxl/"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

PYTEST=("$PY" -m pytest -p no:cacheprovider -p no:benchmark -q -rfE --tb=short)
echo "== tests/test_cuda.py"
timeout "${CUDA_TESTS_S:-150}" "${PYTEST[@]}" tests/test_cuda.py 2>&1 | tee "$OUT/test_cuda.log" | tail -30
echo "== peers benchmark on the GPU ($((SECONDS - t0)) s)"
[ -n "${MODELS-x}" ] && timeout "${BENCH_S:-170}" "$PY" benchmarks/bench_peers.py --device cuda --models "${MODELS:-mlp,gpt,hf-gpt2}" \
  --rounds "${ROUNDS:-3}" 2>&1 | grep -v '^\[transformers\]' | tee "$OUT/bench_peers.log" | tail -25
left=$(( ${BUDGET_S:-530} - (SECONDS - t0) ))
if [ "$left" -gt 40 ]; then
  echo "== core suites with TORCH_POPXL_DEVICE=cuda (${left} s left)"
  XDIST=()
  # (WORKERS=0: one process; session 15's run printed nothing once xdist's workers started)
  [ "${WORKERS:-8}" != 0 ] && "$PY" -c "import xdist" 2>/dev/null && XDIST=(-n "${WORKERS:-8}")
  TORCH_POPXL_DEVICE=cuda timeout "$((left - 10))" "${PYTEST[@]}" "${XDIST[@]}" \
    ${SUITES:-tests/test_remote.py tests/test_replication.py tests/test_session.py tests/test_explicit.py \
    tests/test_compile.py tests/test_compile_semantics.py tests/test_rts_grouped_divisor.py \
    tests/test_addons.py tests/test_random_replicas.py} \
    2>&1 | tee "$OUT/suite_on_cuda.log" | tail -25
fi
echo "== done in $((SECONDS - t0)) s"
