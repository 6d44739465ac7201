#!/usr/bin/env bash
# One device call: GPU tests of the inference kernels, the design variants, the full grid.
# Usage (on the GPU machine, repository root): bash benchmarks/run_inference_h200.sh [OUTDIR]
# Writes under OUTDIR (default $OUT or benchmarks/results): gpu_tests.log, bench.log,
# inference_variants_h200.json, inference_mlp_h200.{json,csv,png}. Prints a short table last.
# The committed results (benchmarks/results/inference_*) are this script's output, run 5 of
# benchmarks/NOTES_inference.md: about 135 s on one H200.
set -u
OUTDIR="${1:-${OUT:-benchmarks/results}}"
mkdir -p "$OUTDIR"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
PY=python3
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$OUTDIR/gpu_tests.log"
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUTDIR/gpu_tests.log"
timeout "${TEST_TIMEOUT:-150}" $PY -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels_pack.py tests/test_kernels_updown.py tests/test_kernels_elementwise.py 2>&1 | tail -30 | tee -a "$OUTDIR/gpu_tests.log"
timeout "${BENCH_TIMEOUT:-420}" $PY -m twell.bench.cli inference --out "$OUTDIR" ${BENCH_ARGS:---variants --rep 60} 2>&1 | tee "$OUTDIR/bench.log" | tail -70
