#!/usr/bin/env bash
# The shared suites through the public API on the GPU, torch's ops timed in the same run:
#   bash benchmarks/run_suites.sh OUT_DIR [attention|conv|all]
# Each suite is compiled ahead (`nnprim warmup`, parallel processes) and found, then
# `nnprim bench` times every problem and direction (device events, median of 20) against
# torch (cuDNN / torch SDPA), writing OUT/<suite>.json (after every problem) and a plot.
# Correctness of the same solvers is the business of tests/gpu and the fuzz (--no-verify).
set -uo pipefail
OUT=${1:?usage: bash benchmarks/run_suites.sh OUT_DIR [attention|conv|all]}
WHICH=${2:-all}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
run() {  # run SUITE DIRECTIONS SECONDS [WARMUP_DIRECTIONS]
  timeout $(( $3 / 3 )) python3 -m nnprim warmup --suite "$1" ${4:+--direction "$4"} --workers 16 2>&1 | tail -1
  timeout "$3" python3 -m nnprim bench --suite "$1" --direction "$2" --no-verify --reps 20 \
    --json "$OUT/$1.json" --plot "$OUT/$1.png" 2>/dev/null
}
case $WHICH in attention|all) run attention_gpu fwd,bwd "${ATTN_S:-200}" ;; esac
case $WHICH in conv|all) run conv_gpu fwd,bwd_data,bwd_weights "${CONV_S:-240}" fwd,bwd_data,bwd_weights ;; esac
