#!/bin/bash
# The GPU checks (tests/gpu) on one GPU host, in order of value, under one deadline in seconds (default 520):
#   OUT=dir bash tools/gpu_device/run_checks.sh [DEADLINE]
# Each part is its own pytest session with its own JSON report ($OUT/gpu-PART.json); the log is $OUT/log.txt.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false
T0=$(date +%s); END=${1:-520}
left() { local l=$(( $1 - ($(date +%s) - T0) )); [ $l -lt 1 ] && l=1; echo $l; }
part() {  # part NAME DEADLINE pytest-args...
  local name=$1 lim=$2; shift 2
  echo "== $name at $(( $(date +%s) - T0 )) s" | tee -a $OUT/times.txt
  JAXTRAIN_GPU_REPORT=$OUT/gpu-$name.json timeout -k 5 $(left $lim) python3 -m pytest -m gpu -s -q \
      -p no:cacheprovider "$@" 2>&1 | tee -a $OUT/log.txt | grep -v "^$"
  echo "== $name done at $(( $(date +%s) - T0 )) s" | tee -a $OUT/times.txt
}
{ nvidia-smi -L; python3 -c "
import sys, jax, flax, optax, torch, importlib.metadata as m
print(sys.version.split()[0], 'jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__,
      'orbax', m.version('orbax-checkpoint'), 'torch', torch.__version__, jax.devices())"; } 2>&1 | tee $OUT/times.txt
part kernels 100 tests/gpu/test_attention.py tests/gpu/test_matmul_peak.py
part steps 300 tests/gpu/test_steps.py -k "policy and (none or full) or xla_flags"
part baselines $((END - 20)) tests/gpu/test_steps.py -k baseline
part morepolicies $END tests/gpu/test_steps.py -k "policy and not none and not full"
