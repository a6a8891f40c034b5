#!/usr/bin/env bash
# GPU fuzz of issue 11 on one H200, in one command (about 6 minutes):
#   bash benchmarks/fuzz_gpu.sh OUT_DIR
# 1. plain fuzz: the small cases of tests/gpu/test_fuzz.py over $SHARDS parallel processes
#    (Triton compiles on all CPU cores) and the huge cases in one more process, until a
#    deadline (cases not started by then are reported as skipped);
#    (and tests/gpu/test_workspace.py: workspace_size against max_memory_allocated);
# 2. the sanitizer subset (about 20 small problems) under
#    compute-sanitizer --tool memcheck --error-exitcode 1, in 4 parallel processes, with
#    PyTorch's caching allocator off so that an access past a tensor leaves its allocation.
# Writes OUT/fuzz.log and OUT/sanitizer.log (pytest output of every process, then totals and
# failures), the per-case JSON lines OUT/*.jsonl, and exits non-zero on any failure.
# Environment: NNPRIM_FUZZ_SHARDS (12), NNPRIM_FUZZ_PLAIN_S (200: small cases; the huge ones get
# 40 s more), NNPRIM_FUZZ_SANITIZER_S (100), NNPRIM_FUZZ_COUNT (random problems, 300).
set -uo pipefail
OUT=${1:?usage: bash benchmarks/fuzz_gpu.sh OUT_DIR}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."

export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export TRITON_INTERPRET=0
TRITON_CACHE_DIR=$(mktemp -d /tmp/nnprim-fuzz-triton.XXXXXX)
NNPRIM_CACHE_DIR=$(mktemp -d /tmp/nnprim-fuzz-db.XXXXXX)
export TRITON_CACHE_DIR NNPRIM_CACHE_DIR   # fresh: every kernel compiles here; the sanitizer run reuses them
SHARDS=${NNPRIM_FUZZ_SHARDS:-12}
PLAIN_S=${NNPRIM_FUZZ_PLAIN_S:-200}
SAN_S=${NNPRIM_FUZZ_SANITIZER_S:-100}
GRACE=30   # a case started before the deadline may finish; then the process is killed

if python3 -c "import pytest" 2>/dev/null; then RUNNER=pytest; else RUNNER=cli; fi
fuzz() {  # fuzz SUBSET SHARD LOG [wrapper...]: one process of the fuzz
  local subset=$1 shard=$2 log=$3
  shift 3
  if [ "$RUNNER" = pytest ]; then
    NNPRIM_FUZZ_SUBSET=$subset NNPRIM_FUZZ_SHARD=$shard NNPRIM_FUZZ_LOG=$log \
      "$@" python3 -m pytest -q -rfEs --tb=short -p no:cacheprovider tests/gpu/test_fuzz.py
  else
    "$@" python3 -m nnprim.testing.fuzz run --device cuda --subset "$subset" ${shard:+--shard "$shard"} --log "$log"
  fi
}

{
  echo "nnprim GPU fuzz, $(date -u +%FT%TZ), runner $RUNNER, commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} > "$OUT/fuzz.log" 2>&1

# ---- 1. plain fuzz ---------------------------------------------------------------------------
export NNPRIM_FUZZ_DEADLINE=$(( $(date +%s) + PLAIN_S ))
rm -f "$OUT"/fuzz_*.jsonl "$OUT"/sanitizer_*.jsonl
pids=()
for i in $(seq 0 $((SHARDS - 1))); do
  fuzz small "$i/$SHARDS" "$OUT/fuzz_small_$i.jsonl" timeout $((PLAIN_S + GRACE)) > "$OUT/fuzz_small_$i.out" 2>&1 &
  pids+=($!)
done
NNPRIM_FUZZ_DEADLINE=$((NNPRIM_FUZZ_DEADLINE + 40)) fuzz huge "" "$OUT/fuzz_huge.jsonl" \
  timeout $((PLAIN_S + 40 + GRACE)) > "$OUT/fuzz_huge.out" 2>&1 &
pids+=($!)
if [ "$RUNNER" = pytest ]; then   # workspace_size against max_memory_allocated, next to the fuzz
  timeout $((PLAIN_S + GRACE)) python3 -m pytest -q -s -rfE --tb=short -p no:cacheprovider \
    tests/gpu/test_workspace.py > "$OUT/workspace.out" 2>&1 &
  pids+=($!)
fi
plain_rc=0
for p in "${pids[@]}"; do wait "$p"; rc=$?; [ $rc = 0 ] || [ $rc = 5 ] || plain_rc=1; done   # 5: empty shard
{
  for f in "$OUT"/fuzz_small_*.out "$OUT/fuzz_huge.out" "$OUT/workspace.out"; do
    [ -f "$f" ] && { echo "==== $(basename "$f")"; cat "$f"; }
  done
  echo "==== totals (plain)"
  python3 -m nnprim.testing.fuzz summary "$OUT"/fuzz_*.jsonl
} >> "$OUT/fuzz.log" 2>&1

# ---- 2. sanitizer subset ---------------------------------------------------------------------
SAN=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
san_rc=0
{
  echo "compute-sanitizer: ${SAN:-not found}"
  [ -n "$SAN" ] && "$SAN" --version | tail -1
} > "$OUT/sanitizer.log" 2>&1
if [ -n "$SAN" ]; then
  export NNPRIM_FUZZ_DEADLINE=$(( $(date +%s) + SAN_S ))
  pids=()
  for i in 0 1 2 3; do
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 fuzz sanitizer "$i/4" "$OUT/sanitizer_$i.jsonl" \
      timeout $((SAN_S + GRACE)) "$SAN" --tool memcheck --error-exitcode 1 --target-processes all \
      --report-api-errors no --print-limit 100 > "$OUT/sanitizer_$i.out" 2>&1 &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p"; rc=$?; [ $rc = 0 ] || [ $rc = 5 ] || san_rc=1; done
  {
    for i in 0 1 2 3; do echo "==== sanitizer_$i.out"; cat "$OUT/sanitizer_$i.out"; done
    echo "==== totals (sanitizer)"
    python3 -m nnprim.testing.fuzz summary "$OUT"/sanitizer_*.jsonl
    echo "==== memcheck error summaries (one per process)"
    grep -h "ERROR SUMMARY" "$OUT"/sanitizer_*.out || echo "(none printed: a process did not finish)"
  } >> "$OUT/sanitizer.log" 2>&1
else
  san_rc=1
fi

tail -n 40 "$OUT/fuzz.log"
tail -n 25 "$OUT/sanitizer.log"
echo "plain fuzz: $([ $plain_rc = 0 ] && echo clean || echo FAILURES), sanitizer: $([ $san_rc = 0 ] && echo clean || echo FAILURES)"
rm -rf "$TRITON_CACHE_DIR" "$NNPRIM_CACHE_DIR"
[ $plain_rc = 0 ] && [ $san_rc = 0 ]
