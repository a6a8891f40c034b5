#!/usr/bin/env bash
# What solver 129's ordered dQ adds cost, piece by piece (diagnostic, not deterministic
# variants): benchmarks/gluon_bwd.py's `ordered` config against `default` with the kernel's
# inline PTX patched in a scratch copy of the tree: base; the reduce-adds waited for only
# until read (readonly); the proxy fences removed (nofence); a relaxed increment (relaxed);
# no turn waits (nowait); all of them (all_off). Run on the GPU from the repository root:
#   bash benchmarks/diag/ordered_cost.sh OUT
set -uo pipefail
OUT=${1:?usage: bash benchmarks/diag/ordered_cost.sh OUT}
SRC=$(cd "$(dirname "$0")/../.." && pwd)
W=$(mktemp -d)
cp -r "$SRC/nnprim" "$SRC/benchmarks" "$W/"
cd "$W"
export PYTHONPATH=$W TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
S=${SUBSET:-train_d128_s4096,train_d128_s4096_causal,train_d64_s4096}
F=nnprim/attention/gluon_bwd.py
cp $F orig.py
run() {
  echo "== $1"
  timeout 100 python3 benchmarks/gluon_bwd.py --rounds 4 --subset "$S" --configs default,ordered --solvers flash_111 \
    --out "$OUT/ordered_cost_$1.json" 2>&1 | grep -A4 "^problem" | tail -3
}
patch() {   # the named pieces off, on a fresh copy
  cp orig.py $F
  for p in "$@"; do
    case $p in
      readonly) sed -i 's/cp.async.bulk.wait_group 0;/cp.async.bulk.wait_group.read 0;/' $F ;;
      nofence) sed -i 's/"fence.proxy.async.global;\\n"/""/' $F ;;
      relaxed) sed -i 's/@p red.release.gpu/@p red.relaxed.gpu/' $F ;;
      nowait) sed -i 's/\[sem, zero + turn\]/[sem, zero]/' $F ;;
    esac
  done
  echo "patched: $* ($(diff orig.py $F | grep -c '^>') lines)"
}
run base
for p in readonly nofence relaxed nowait; do patch $p; run $p; done
patch readonly nofence relaxed nowait; run all_off
rm -rf "$W"
