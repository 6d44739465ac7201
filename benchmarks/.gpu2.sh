set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src"
mkdir -p $OUT/model $OUT/batch
timeout 90 python3 benchmarks/heavy_rows_tune_probe.py $OUT 2>&1 | grep -v Warning | tail -8
timeout 300 python3 -m twell.bench.cli model --out $OUT/model 2>&1 | tee $OUT/model/model_bench.log | tail -16
timeout 120 python3 -m twell.bench.cli batch --out $OUT/batch 2>&1 | tee $OUT/batch/batch.log | grep -E "k=280 even|eager .* ms|done" | tail -12
