#!/usr/bin/env bash
# One device call's worth of GPU work for the hot path: the GPU tests, then the end-to-end record.
#   bash benchmarks/gpu_check.sh tests|e2e-eager|e2e-compiled|e2e-own   (each fits one 10-minute call)
# Writes logs and results under $OUT (the device's output folder) or ./gpu-out.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src:$PWD" PYTHONUNBUFFERED=1
out="${OUT:-gpu-out}"
mkdir -p "$out"
results=benchmarks/results/e2e_step.json
case "${1:-tests}" in
  tests)
    timeout 560 python -m pytest -q -m gpu tests/ -p no:cacheprovider 2>&1 | tee "$out/gpu_tests.log" | tail -40 ;;
  e2e-eager)
    timeout 560 python benchmarks/e2e_step.py --workloads hf --modes eager --profile "$out" --out "$results" \
      2>&1 | grep -v Warn | tee "$out/e2e_eager.log"
    cp "$results" "$out/" ;;
  e2e-compiled)
    timeout 560 python benchmarks/e2e_step.py --workloads hf --modes compiled --resume --out "$results" \
      2>&1 | grep -v Warn | tee "$out/e2e_compiled.log"
    cp "$results" "$out/" ;;
  e2e-own)
    timeout 560 python benchmarks/e2e_step.py --workloads own --modes eager,compiled --resume --out "$results" \
      2>&1 | grep -v Warn | tee "$out/e2e_own.log"
    cp "$results" "$out/" ;;
  *) echo "usage: $0 tests|e2e-eager|e2e-compiled|e2e-own" >&2; exit 2 ;;
esac
