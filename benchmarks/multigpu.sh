#!/usr/bin/env bash
# One device call on two H200s (kind nvidia-h200-x2): `twell train` under torchrun with DDP and with
# FSDP, 2 micro-batches per step on each rank; reinit on under DDP and FSDP (the committed results
# in results/multigpu_small_h200x2/ ran FSDP without it), against one process (reinit on) with the
# same global batch, and an FSDP resume.
# Usage (repository root): bash benchmarks/multigpu.sh [OUTDIR]. Prints a table last.
set -u
OUTDIR="${1:-${OUT:-runs/multigpu}}"
mkdir -p "$OUTDIR"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
# NVLink multicast stays off on these shared hosts.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
RUNS=/tmp/twell_multigpu
rm -rf "$RUNS"
STEPS=${STEPS:-60}; HALF=$((STEPS / 2)); B=${BATCH:-8}; GA=${GA:-2}  # STEPS/BATCH/GA/PRESET/SEQ: small CPU dry runs
COMMON="--preset ${PRESET:-small} --seq-len ${SEQ:-512} --steps $STEPS --eval-every $HALF --save-every $HALF --log-every 10 --no-progress --no-plot"
log="$OUTDIR/multigpu.log"
nvidia-smi --query-gpu=index,name,memory.total --format=csv | tee "$log"
run() { echo "== $*" | tee -a "$log"; "$@" 2>&1 | grep -v "^\s*$" | tail -12 | tee -a "$log"; }
run python3 -m twell train $COMMON --batch-size $((2 * B)) --val-batches 8 --reinit --out $RUNS/one
run torchrun --standalone --nproc_per_node 2 -m twell train $COMMON --batch-size $((B / GA)) --grad-accum $GA --val-batches $((8 * GA)) --reinit --out $RUNS/ddp
run torchrun --standalone --nproc_per_node 2 -m twell train $COMMON --batch-size $((B / GA)) --grad-accum $GA --val-batches $((8 * GA)) --fsdp --reinit --out $RUNS/fsdp
cp -r $RUNS/fsdp $RUNS/fsdp_resumed && rm -rf $RUNS/fsdp_resumed/checkpoints/step_$(printf %06d $STEPS) $RUNS/fsdp_resumed/log.csv
run torchrun --standalone --nproc_per_node 2 -m twell train $COMMON --batch-size $((B / GA)) --grad-accum $GA --val-batches $((8 * GA)) --fsdp --reinit --out $RUNS/fsdp_resumed --resume $RUNS/fsdp_resumed/checkpoints/step_$(printf %06d $HALF)
for r in one ddp fsdp fsdp_resumed; do cp $RUNS/$r/log.csv "$OUTDIR/${r}_log.csv" 2>/dev/null; done
python3 - "$RUNS" <<'PY' | tee -a "$log"
import csv, sys
root = sys.argv[1]
print(f"{'run':14s} {'step':>5s} {'loss':>8s} {'val':>8s} {'active/token':>12s}")
for r in ("one", "ddp", "fsdp", "fsdp_resumed"):
    try:
        rows = list(csv.DictReader(open(f"{root}/{r}/log.csv")))
    except OSError as e:
        print(r, "missing", e); continue
    last = rows[-1]
    val = next((x.get("val_loss") for x in reversed(rows) if x.get("val_loss")), "")
    print(f"{r:14s} {last.get('step',''):>5s} {float(last.get('loss', 'nan')):8.4f} {val:>8s} {last.get('active_mean', last.get('active_per_token','')):>12s}")
PY
