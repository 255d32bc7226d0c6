#!/usr/bin/env bash
# One call on a lent H200: build csrc in place, check every kernel and the engine against
# their references, then benchmark. Run from the repository root with the wheels from
# ../shared/gpu/fetch-wheels.sh in .whl and a tokenizer directory in .gpu-assets/tokenizer.
#   bash tests/gpu/run_h200.sh [checks|bench|quant|all]
set -uo pipefail
phase=${1:-all}
OUT=${OUT:-/tmp/asyncgen-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total,memory.used,clocks.sm --format=csv | tee "$OUT/gpu.txt"
status=0
run() {  # run NAME CMD...: log to $OUT/NAME.log, remember failures
  local name=$1; shift
  echo "=== $name: $*"
  local t0=$SECONDS
  "$@" 2>&1 | tee "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: exit $rc after $((SECONDS - t0)) s"
  [ "$rc" -eq 0 ] || status=1
}
if [ "$phase" = checks ] || [ "$phase" = all ]; then
  run build python3 setup.py build_ext --inplace
  run triton_ops python3 tests/gpu/check_triton_ops.py
  run csrc_ops python3 tests/gpu/check_csrc_ops.py
  run dense_algos python3 tests/gpu/check_dense_algos.py
  run engine python3 tests/gpu/check_engine_cuda.py --tokenizer .gpu-assets/tokenizer
  run pooling_beams python3 tests/gpu/check_pooling_beams_cuda.py --tokenizer .gpu-assets/tokenizer
fi
if [ "$phase" = bench ] || [ "$phase" = all ]; then
  [ -f asyncgen/_C*.so ] || ls asyncgen/_C*.so >/dev/null 2>&1 || run build python3 setup.py build_ext --inplace
  run bench_7b python3 benchmarks/h200_llama7b.py --tokenizer .gpu-assets/tokenizer --out "$OUT/bench_7b.json"
fi
if [ "$phase" = quant ] || [ "$phase" = all ]; then
  run quant_ops python3 tests/gpu/check_quant_ops.py
  run quant_bench python3 benchmarks/quant_decode.py --tokenizer .gpu-assets/tokenizer
fi
exit $status
