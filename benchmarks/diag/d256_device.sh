#!/usr/bin/env bash
# Solver 130 `gluon_flash_bwd_d256` (nnprim/attention/gluon_bwd_d256.py) on the H200 in one device
# call (~5 minutes), from the repo root with OUT set:
#   OUT=/some/dir bash benchmarks/diag/d256_device.sh        (or: bash benchmarks/gpu_plan.sh d256 $OUT)
# (1) tests/gpu/test_gluon_bwd_d256_gpu.py (each dQ variant smoke-run in a subprocess first: a
#     barrier bug shows as a hang there; stops at the first failure: STOP="" runs them all)
#     -> $OUT/log (and $OUT/gpu_tests_d256.log, the pytest output);
# (2) benchmarks/gluon_bwd.py on the suite's six d256 train problems: 130 through the API and its
#     configs default / atomic / red16 / aligned through its plan, solver 111, cuDNN and FLASH_ATTENTION
#     interleaved, each checked against float32 autograd first -> $OUT/gluon_bwd_d256.json.
# Knobs: STOP (default -x), WORKERS (xdist, 4), TEST_S / BENCH_S (timeouts), ROUNDS, CONFIGS256, REGS=1.
set -uo pipefail
OUT=${OUT:?set OUT}
mkdir -p "$OUT"
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} TRITON_INTERPRET=0 PYTHONUNBUFFERED=1 NNPRIM_GLUON=1
STOP=${STOP--x}
XDIST=""
python3 -c "import xdist" 2>/dev/null && XDIST="-n ${WORKERS:-4} --dist load"
{
  echo "== $(date -Is) $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null)"
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cudnn', torch.backends.cudnn.version())"
  if [ -n "${REGS:-}" ]; then   # registers / spills / smem as compiled here (offline figures: the same)
    timeout 90 python3 benchmarks/diag/gluon_bwd_regs.py --dims 256 --configs default,atomic,red16,aligned \
      --causal none,top_left,bottom_right 2>&1 | tail -9
  fi
  echo "== (1) tests/gpu/test_gluon_bwd_d256_gpu.py $STOP $XDIST"
  timeout -s INT ${TEST_S:-200} python3 -m pytest -p no:cacheprovider tests/gpu/test_gluon_bwd_d256_gpu.py $STOP $XDIST \
    -v -rfs --tb=short --durations=10 > "$OUT/gpu_tests_d256.log" 2>&1
  echo "pytest rc=$?"
  grep -E "PASSED|FAILED|SKIPPED|ERROR|passed|failed" "$OUT/gpu_tests_d256.log" | tail -70
  grep -B2 -A25 "^E " "$OUT/gpu_tests_d256.log" | head -120
  echo "== (2) benchmarks/gluon_bwd.py --dims 256"
  timeout ${BENCH_S:-170} python3 benchmarks/gluon_bwd.py --dims 256 --rounds ${ROUNDS:-3} \
    --solvers gluon_130,flash_111 --configs256 ${CONFIGS256:-default,atomic,red16,aligned} \
    --out "$OUT/gluon_bwd_d256.json" 2>&1 | tail -25
  echo "bench rc=$?"
  echo "== $(date -Is) done"
} 2>&1 | tee "$OUT/log"
