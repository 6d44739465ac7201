#!/usr/bin/env bash
# Checks and benchmarks on a GPU machine, one named step after another, each under its own time
# limit, so that one call of a few minutes tests and measures the tree.
#
# Usage (repository root, on the GPU machine):
#   bash benchmarks/run_gpu.sh OUTDIR STEP...
#
# Steps (each writes OUTDIR/STEP.log and its results under OUTDIR/STEP/):
#   tests        every GPU test (TESTS: test paths or node ids, split on spaces; TESTS_K: a -k expression)
#   grid         twell bench inference             -> inference_mlp_<gpu>.{json,png}
#   variants     twell bench inference --variants  -> inference_variants_<gpu>.json
#   batch        twell bench batch                 -> inference_batch_<gpu>.{json,png} (BATCH_ARGS)
#   batchd4096   twell bench batch --shape 4096x11008 -> inference_batch_<gpu>_d4096.{json,png}
#   decode       twell bench decode                -> decode_<gpu>.{json,png}
#   decoded4096  twell bench decode --shape 4096x11008 -> decode_<gpu>_d4096.{json,png}
#   model        twell bench model (2b shape)      -> model_<gpu>.{json,png}
#   training     twell bench training              -> training_mlp_<gpu>.{json,png} (TRAINING_ARGS)
#   compiled     twell bench compiled              -> compiled_<gpu>.{json,png} (COMPILED_ARGS)
#   fp8          twell bench fp8                   -> fp8_<gpu>.{json,png} (FP8_ARGS)
#   prefillstage benchmarks/prefill_stage.py: one prefill call's kernels and idle gaps, profiled
#   hotab        benchmarks/hot_units_ab.py: the prefill path with and without hot units
#   trainstage   benchmarks/train_call_stage.py: one training call's kernels, GPU idle and host time (CASES)
#   compiledstage benchmarks/compiled_call_stage.py: one compiled call at a few tokens, host and kernels (CASES)
# Results sit under OUTDIR/STEP/ and together in OUTDIR/results.tar.gz. Prints each step's last lines.
set -u
OUTDIR="$1"
shift
mkdir -p "$OUTDIR"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
PY=python3
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv
  $PY -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
} > "$OUTDIR/machine.log" 2>&1
BENCH=($PY -m twell.bench.cli)
t0=$(date +%s)
for step in "$@"; do
  dir="$OUTDIR/$step"
  mkdir -p "$dir"
  case "$step" in
    tests)       cmd=(timeout "${TESTS_S:-300}" $PY -m pytest -q -m gpu -p no:cacheprovider ${TESTS:-tests/} ${TESTS_K:+-k "$TESTS_K"}) ;;
    grid)        cmd=(timeout "${GRID_S:-300}" "${BENCH[@]}" inference --out "$dir" --rep 60) ;;
    variants)    cmd=(timeout "${GRID_S:-420}" "${BENCH[@]}" inference --out "$dir" --variants --rep 60) ;;
    batch)       cmd=(timeout "${BATCH_S:-240}" "${BENCH[@]}" batch --out "$dir" ${BATCH_ARGS:-}) ;;
    batchd4096)  cmd=(timeout "${BATCH_S:-240}" "${BENCH[@]}" batch --out "$dir" --shape 4096x11008) ;;
    decode)      cmd=(timeout "${DECODE_S:-150}" "${BENCH[@]}" decode --out "$dir") ;;
    decoded4096) cmd=(timeout "${DECODE_S:-150}" "${BENCH[@]}" decode --out "$dir" --shape 4096x11008) ;;
    model)       cmd=(timeout "${MODEL_S:-300}" "${BENCH[@]}" model --out "$dir") ;;
    training)    cmd=(timeout "${TRAINING_S:-330}" "${BENCH[@]}" training --out "$dir" ${TRAINING_ARGS:-}) ;;
    compiled)    cmd=(timeout "${COMPILED_S:-540}" "${BENCH[@]}" compiled --out "$dir" ${COMPILED_ARGS:-}) ;;
    fp8)         cmd=(timeout "${FP8_S:-300}" "${BENCH[@]}" fp8 --out "$dir" ${FP8_ARGS:-}) ;;
    prefillstage) cmd=(timeout "${PREFILLSTAGE_S:-240}" $PY benchmarks/prefill_stage.py "$dir") ;;
    hotab)       cmd=(timeout "${HOTAB_S:-300}" $PY benchmarks/hot_units_ab.py "$dir") ;;
    trainstage)  cmd=(timeout "${TRAINSTAGE_S:-240}" $PY benchmarks/train_call_stage.py "$dir") ;;
    compiledstage) cmd=(timeout "${COMPILEDSTAGE_S:-240}" $PY benchmarks/compiled_call_stage.py "$dir") ;;
    *) echo "unknown step $step"; continue ;;
  esac
  "${cmd[@]}" > "$OUTDIR/$step.log" 2>&1
  echo "== $step: exit $? at $(( $(date +%s) - t0 )) s"
  tail -n "${TAIL:-25}" "$OUTDIR/$step.log"
done
tar czf "$OUTDIR/../results.tar.gz" -C "$OUTDIR" . && mv "$OUTDIR/../results.tar.gz" "$OUTDIR/"
