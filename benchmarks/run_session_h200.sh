#!/usr/bin/env bash
# One device call running the named steps in turn, each under its own time limit, so that one
# call of at most 10 minutes checks and measures what a session changed.
# Usage (on the GPU machine, repository root):
#   bash benchmarks/run_session_h200.sh OUTDIR STEP...
# Steps: tests (every GPU test; TESTS=paths or node ids to narrow, split on spaces; TESTS_K=a -k expression), coldprobe (benchmarks/cold_weights_probe.py, COLDPROBE_M tokens), splitprobe
# (benchmarks/split_chain_probe.py), memprobe (benchmarks/decode_memory_probe.py),
# gemvprobe (benchmarks/decode_gemv_probe.py), gateprobe (benchmarks/decode_gate_probe.py), hostprobe (benchmarks/host_probe.py at HOST_M tokens, default 1 16 4096), smallm
# (benchmarks/prefill_small_m_probe.py), decode, decodefused (decode with DECODE_SPLIT off), splitsmallm
# (benchmarks/decode_split_small_m.py), downlayout (benchmarks/dense_down_layout_probe.py),
# eltprobe (benchmarks/dense_elementwise_probe.py), batch (BATCH_ARGS, e.g. --quick),
# batchd4096 (twell bench batch --shape 4096x11008, M $BATCHD_M, default 1 to 16384),
# decoded4096 (twell bench decode --shape 4096x11008),
# gridM (twell bench inference --M $GRID_M, default 4096 16384),
# grid (twell bench inference, no variants), model (twell bench model: 2b, calibrated k 29),
# training (twell bench training: the training grid and the 0.5b train steps; TRAINING_ARGS),
# hotab (benchmarks/hot_units_ab.py: the inference hot units off and on),
# onelaunch (benchmarks/one_launch_ab.py: the prefill up/down in one launch where rows are short, against two-pass; ONELAUNCH_CASES),
# prefillstage (benchmarks/prefill_stage_probe.py: one prefill call's kernels and gaps, profiled; STAGE_CASES),
# skewedab (benchmarks/train_skewed_ab.py: the training weight gradients' schedule and hot-unit
# limit; AB_CASES, AB_SETTINGS),
# stageprobe (benchmarks/split_stage_probe.py: the split kernels' times, profiled in a chain),
# spreadprobe (benchmarks/split_spread_probe.py: the inference split path's shapes by the rows' spread),
# exactprobe (benchmarks/exact_launch_probe.py: overflowed rows, per-row launch against dense rows),
# denserows (benchmarks/dense_rows_probe.py: the dense-rows limit DENSE_ROW_MIN),
# prefetchprobe (benchmarks/l2_prefetch_probe.py: gate weights read into L2 during attention),
# packprobe (benchmarks/pack_config_probe.py: pack and up/down launch shapes by batch size),
# layoutprobe (benchmarks/train_layout_probe.py: the training op with w_down in the kernels' layout),
# steplayout (benchmarks/train_step_layout_probe.py: the 0.5b lr 3e-4 loss curves by layout, run twice),
# eagerrange (benchmarks/eager_graph_range_probe.py: eager graphs' replays at 128 to 512 tokens),
# eagerprefill (the same with --prefill: replayed prefill kernels at 4096 and 6144 tokens),
# eagersmall (the same with --small: replays at 1 to 64 tokens, the output copied or handed out),
# breakeven (benchmarks/break_even_probe.py: the prefill break-even at d 2048 and 4096, k 48 to 128),
# breakeventimed (the same with twell.dispatch.TIMED_CHOICE on),
# splitd4096 (benchmarks/updown_split_probe.py at d 4096, f 11008: fused and split up/down shapes),
# splitfires (benchmarks/decode_split_fires_probe.py: the split decode kernels past 4096 fires, d 4096 and 2048),
# densebranch (benchmarks/dense_branch_small_m_probe.py: the module's dense branch against dense at 128 to 512 tokens),
# decodenokeep (decode with twell.dispatch.DECODE_SCRATCH off), model05 / model05nokeep (twell bench model
# --preset 0.5b --no-lean, default / DECODE_SCRATCH off), model05bare (the same, eager graphs off too),
# overhead (benchmarks/module_overhead_probe.py: the module against its own branches at 16384 and
# 65536 tokens; OVERHEAD_CASES for its CASES).
# Each writes STEP.log and its results under OUTDIR/STEP/; OUTDIR/results.tar.gz holds them all
# (the device tool returns few files). Prints each step's last lines.
set -u
OUTDIR="$1"
shift
mkdir -p "$OUTDIR"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
PY=python3
# a benchmark with twell.dispatch.DECODE_SCRATCH off (decode calls keep no buffers)
NOKEEP='import sys, twell.dispatch as d; d.DECODE_SCRATCH = False; from twell.bench.cli import bench_main; bench_main(sys.argv[1:])'
# ...and with twell's eager graphs off too
BARE='import sys, twell.dispatch as d, twell.eager_graphs as g; d.DECODE_SCRATCH = False; g.ENABLED = False; from twell.bench.cli import bench_main; bench_main(sys.argv[1:])'
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv
  $PY -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
} > "$OUTDIR/machine.log" 2>&1
t0=$(date +%s)
for step in "$@"; do
  dir="$OUTDIR/$step"
  mkdir -p "$dir"
  case "$step" in
    tests)    cmd=(timeout "${TESTS_S:-150}" $PY -m pytest -q -m gpu -p no:cacheprovider ${TESTS:-tests/} ${TESTS_K:+-k "$TESTS_K"}) ;;
    hostprobe) cmd=(timeout "${HOSTPROBE_S:-90}" $PY benchmarks/host_probe.py "$dir" ${HOST_M:-1 16 4096}) ;;
    memprobe) cmd=(timeout "${MEMPROBE_S:-120}" $PY benchmarks/decode_memory_probe.py "$dir") ;;
    gemvprobe) cmd=(timeout "${GEMVPROBE_S:-240}" $PY benchmarks/decode_gemv_probe.py "$dir" ${GEMVPROBE_ARGS:-}) ;;
    gateprobe) cmd=(timeout "${GATEPROBE_S:-240}" $PY benchmarks/decode_gate_probe.py "$dir" ${GATEPROBE_ARGS:-}) ;;
    coldprobe) cmd=(env OUT="$dir" timeout "${COLDPROBE_S:-240}" $PY benchmarks/cold_weights_probe.py ${COLDPROBE_M:-}) ;;
    splitprobe) cmd=(env OUT="$dir" timeout "${SPLITPROBE_S:-240}" $PY benchmarks/split_chain_probe.py) ;;
    stageprobe) cmd=(env OUT="$dir" timeout 120 $PY benchmarks/split_stage_probe.py) ;;
    spreadprobe) cmd=(timeout 200 $PY benchmarks/split_spread_probe.py "$dir") ;;
    exactprobe) cmd=(timeout 240 $PY benchmarks/exact_launch_probe.py "$dir") ;;
    denserows) cmd=(timeout 240 $PY benchmarks/dense_rows_probe.py "$dir") ;;
    prefetchprobe) cmd=(env OUT="$dir" timeout 240 $PY benchmarks/l2_prefetch_probe.py) ;;
    layoutprobe) cmd=(env OUT="$dir" timeout 200 $PY benchmarks/train_layout_probe.py) ;;
    steplayout) cmd=(env OUT="$dir" timeout 300 $PY benchmarks/train_step_layout_probe.py) ;;
    eagerrange) cmd=(env OUT="$dir" timeout 200 $PY benchmarks/eager_graph_range_probe.py) ;;
    eagerprefill) cmd=(env OUT="$dir" timeout 200 $PY benchmarks/eager_graph_range_probe.py --prefill) ;;
    eagersmall) cmd=(env OUT="$dir" timeout 150 $PY benchmarks/eager_graph_range_probe.py --small) ;;
    breakeven) cmd=(timeout "${BREAKEVEN_S:-300}" $PY benchmarks/break_even_probe.py "$dir") ;;
    breakeventimed) cmd=(env TIMED=1 timeout "${BREAKEVEN_S:-300}" $PY benchmarks/break_even_probe.py "$dir") ;;
    splitd4096) cmd=(env SHAPE=4096x11008 ${SPLIT_MS:+MS=$SPLIT_MS} ${SPLIT_KS:+KS=$SPLIT_KS} timeout "${SPLITD_S:-240}" $PY benchmarks/updown_split_probe.py "$dir") ;;
    overhead) cmd=(env ${OVERHEAD_CASES:+CASES=$OVERHEAD_CASES} timeout "${OVERHEAD_S:-240}" $PY benchmarks/module_overhead_probe.py "$dir") ;;
    packprobe) cmd=(env OUT="$dir" timeout "${PACKPROBE_S:-300}" $PY benchmarks/pack_config_probe.py) ;;
    smallm)   cmd=(timeout "${SMALLM_S:-120}" $PY benchmarks/prefill_small_m_probe.py "$dir") ;;
    gridM)    cmd=(timeout "${GRID_S:-300}" $PY -m twell.bench.cli inference --out "$dir" --rep 60 --M ${GRID_M:-4096 16384}) ;;
    decode)   cmd=(timeout "${DECODE_S:-150}" $PY -m twell.bench.cli decode --out "$dir") ;;
    decodefused) cmd=(timeout "${DECODE_S:-150}" $PY -m twell.bench.cli decode --fused --out "$dir") ;;
    downlayout) cmd=(env OUT="$dir" timeout 120 $PY benchmarks/dense_down_layout_probe.py) ;;
    eltprobe) cmd=(env OUT="$dir" timeout 120 $PY benchmarks/dense_elementwise_probe.py) ;;
    densebranch) cmd=(env OUT="$dir" timeout "${DENSEBRANCH_S:-200}" $PY benchmarks/dense_branch_small_m_probe.py) ;;
    splitfires) cmd=(env OUT="$dir" timeout "${SPLITFIRES_S:-200}" $PY benchmarks/decode_split_fires_probe.py) ;;
    splitsmallm) cmd=(env OUT="$dir" timeout "${SPLITSMALLM_S:-150}" $PY benchmarks/decode_split_small_m.py) ;;
    batch)    cmd=(timeout "${BATCH_S:-200}" $PY -m twell.bench.cli batch --out "$dir" ${BATCH_ARGS:-}) ;;
    batchd4096) cmd=(timeout "${BATCH_S:-240}" $PY -m twell.bench.cli batch --out "$dir" --shape 4096x11008 --M ${BATCHD_M:-1 4 16 64 256 1024 4096 16384}) ;;
    decodenokeep) cmd=(timeout "${DECODE_S:-150}" $PY -c "$NOKEEP" decode --out "$dir") ;;
    model05) cmd=(timeout "${MODEL_S:-300}" $PY -m twell.bench.cli model --preset 0.5b --no-lean --out "$dir") ;;
    model05bare) cmd=(timeout "${MODEL_S:-300}" $PY -c "$BARE" model --preset 0.5b --no-lean --out "$dir") ;;
    model05nokeep) cmd=(timeout "${MODEL_S:-300}" $PY -c "$NOKEEP" model --preset 0.5b --no-lean --out "$dir") ;;
    decoded4096) cmd=(timeout "${DECODE_S:-150}" $PY -m twell.bench.cli decode --out "$dir" --shape 4096x11008) ;;
    grid)     cmd=(timeout "${GRID_S:-300}" $PY -m twell.bench.cli inference --out "$dir" --rep 60) ;;
    model)    cmd=(timeout "${MODEL_S:-300}" $PY -m twell.bench.cli model --out "$dir") ;;
    training) cmd=(timeout "${TRAINING_S:-330}" $PY -m twell.bench.cli training --out "$dir" ${TRAINING_ARGS:-}) ;;
    prefillstage) cmd=(env ${STAGE_CASES:+CASES=$STAGE_CASES} timeout "${PREFILLSTAGE_S:-240}" $PY benchmarks/prefill_stage_probe.py "$dir") ;;
    onelaunch) cmd=(env ${ONELAUNCH_CASES:+CASES=$ONELAUNCH_CASES} timeout "${ONELAUNCH_S:-240}" $PY benchmarks/one_launch_ab.py "$dir") ;;
    hotab)    cmd=(timeout "${HOTAB_S:-300}" $PY benchmarks/hot_units_ab.py "$dir") ;;
    skewedab) cmd=(timeout "${SKEWEDAB_S:-240}" $PY benchmarks/train_skewed_ab.py "$dir") ;;
    *) echo "unknown step $step"; continue ;;
  esac
  "${cmd[@]}" > "$OUTDIR/$step.log" 2>&1
  echo "== $step: exit $? at $(( $(date +%s) - t0 )) s"
  tail -n "${TAIL:-25}" "$OUTDIR/$step.log"
done
tar czf "$OUTDIR/../results.tar.gz" -C "$OUTDIR" . && mv "$OUTDIR/../results.tar.gz" "$OUTDIR/"
