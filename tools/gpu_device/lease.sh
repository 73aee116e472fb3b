#!/bin/bash
# Everything one short GPU lease should bring back, in one call, each step under its own limit so that the
# archive is always written:  OUT=dir bash tools/gpu_device/lease.sh [CHECKS_DEADLINE_S]
#   1. the GPU checks (run_checks.sh: python -m pytest -m gpu, four parts under one deadline, default 330 s);
#   2. where the step's time goes at the fastest same-math setting (breakdown.py: save_dots, bfloat16 head);
#   3. python -m jaxtrain.bench on the real data pipeline (needs grain: wheels in .whl/ are installed first).
# Writes $OUT/summary.txt (the figures) and $OUT/all.tgz (every JSON and log).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false
R=$OUT/r; mkdir -p $R; T0=$(date +%s)
say() { echo "== $* at $(( $(date +%s) - T0 )) s" | tee -a $R/times.txt; }
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PWD:/tmp/site
fi
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv > $R/smi.txt 2>&1
say checks; OUT=$R bash tools/gpu_device/run_checks.sh "${1:-330}" > $R/checks.out 2>&1
grep -E "^(\.|s|F|E)?[a-z_]+[: ].*(ms|TFLOP|error|accepted)|passed|failed" $R/log.txt | tail -40
say breakdown; OUT=$R BD=40 timeout -k 5 100 python3 tools/gpu_device/breakdown.py dots-bf16 model.remat=save_dots \
  model.head_logits_dtype=bfloat16 > $R/breakdown.out 2>&1; tail -5 $R/breakdown.out
say bench; timeout -k 5 120 python3 -m jaxtrain.bench --config llama3-1b --mesh fsdp=1 --set train.seq_len=2048 \
  --set train.batch_size=1 --steps 20 --warmup 3 --measure-peak --out $R/bench-1b.json --workdir /tmp/bench \
  > $R/bench.out 2>&1; tail -12 $R/bench.out
say done; { cat $R/smi.txt $R/times.txt; grep -v "^$" $R/log.txt | tail -60; tail -12 $R/bench.out; } > $OUT/summary.txt
tar -czf $OUT/all.tgz -C $OUT r && rm -rf $R
