#!/usr/bin/env bash
# One device call: GPU tests of the sparse training kernels and the module's training path, then
# the training benchmark (twell bench training). Usage (on the GPU machine, repository root):
#   bash benchmarks/run_training_h200.sh [OUTDIR] [bench args, e.g. --quick]
# Writes under OUTDIR (default $OUT or benchmarks/results): training_gpu_tests.log,
# training_bench.log, training_mlp_h200.{json,csv,png}. Prints a short table last.
set -u
OUTDIR="${1:-${OUT:-benchmarks/results}}"
shift || true
mkdir -p "$OUTDIR"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
PY=python3
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$OUTDIR/training_gpu_tests.log"
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUTDIR/training_gpu_tests.log"
timeout "${TEST_TIMEOUT:-180}" $PY -m pytest -q -p no:cacheprovider tests/test_train_kernels.py tests/test_train_path.py tests/test_kernels_dense_rows.py 2>&1 | tail -25 | tee -a "$OUTDIR/training_gpu_tests.log"
timeout "${BENCH_TIMEOUT:-380}" $PY -m twell.bench.cli training --out "$OUTDIR" "$@" 2>&1 | tee "$OUTDIR/training_bench.log" | tail -60
