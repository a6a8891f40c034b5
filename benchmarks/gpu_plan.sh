#!/usr/bin/env bash
# The GPU verification and measurement plan in steps that each fit one device call
# (<= 10 minutes on one H200), logs and JSON under OUT:
#   bash benchmarks/gpu_plan.sh STEP OUT
# Steps, in the order a session with little device time should take them:
#   tests      tests/gpu on 8 xdist workers (bigmem tests take one of 3 slots); the whole call
#              (2026-12-03: a cold machine reached the 560 s limit with 15 tests left); on a cold
#              machine take its halves in two calls: tests_attn (the attention training kernels'
#              modules) and tests_rest (conv, decode, paged, API, integration, workspace);
#              tests_decode: the four decode / paged modules alone (all bigmem: BIGMEM_SLOTS, default 4,
#              at once; 3 left 42 of 211 unstarted in 400 s on 15 workers, 2026-12-04)
#   fuzz       the memory-safety fuzz (benchmarks/fuzz_gpu.sh), incl. compute-sanitizer
#   attention  benchmarks/attention.py --api on every train problem (fwd, bwd, deterministic bwd)
#   tune5      tile candidates of the five-GEMM backward solvers 123/124
#   decode     benchmarks/decode_formats.py (K/V formats, 122 vs 128, both V orders) and benchmarks/paged.py
#   decode_sweep  tile / warp / split sweep of the quantized decode solvers 122 and 128 through their
#              plans (benchmarks/diag/decode_swap_sweep.py), cuDNN interleaved; CONFIGS overrides the list
#   paged_probe  the flash forward over 16- and 64-key pages per tile config, TMA and pointer loads on the
#              contiguous cache, and solver 120's split counts on the Sq 4 decode
#              (benchmarks/diag/paged_prefill_probe.py)
#   decode_q4  solver 133's GPU module, then 133 against 122 through the plans and the public call,
#              cuDNN interleaved (decode_swap_sweep.py), and the public call's host time against the
#              plan's (benchmarks/diag/api_vs_plan.py)
#   paged_q4   solver 133 on shuffled 16 / 64 / 256-key page pools against the contiguous cache, its L2
#              variants (PREFETCH entries N[+ringR][+rC][+nofast][+nolazy]: L2 prefetch distance, cp.async
#              ring slots, register cap, unclamped rows / lazy rescale off) and 122
#              (benchmarks/diag/paged_q4_probe.py), then paged.py's 4-bit
#              rows through the public API with 122 and 133 forced
#   fp8        benchmarks/attention_fp8.py (d64/128/256, S 4k-16k)
#   conv       the conv suite through the public API (run_suites.sh conv), benchmarks/depthwise.py (tile
#              and walk variants, cuDNN) and benchmarks/nchw_probe.py (layout copies, NCHW solvers)
#   sysdb      nnprim db build-system for the H200 (suites + 90 model layers, about 5 minutes)
#   sysdb_decode  the same for the quantized decode suite (decode_quant_gpu: 25 problems)
#   bench_decode  that suite through `nnprim bench` (public calls, torch on the bf16 cache as the peer)
#   regret     benchmarks/regret.py (60 held-out problems) and benchmarks/first_call.py; the seed-1
#              problems' kernels are compiled by the sysdb step; another seed compiles from scratch
#              and did not finish in 240 s (2026-12-01): give it a call of its own
#   gluon_bench  benchmarks/gluon_fwd.py, benchmarks/gluon_bwd.py and benchmarks/gluon_conv_probe.py
#              (solver level, peers interleaved)
#   attn_bwd   tests/gpu/test_gluon_bwd_gpu.py and benchmarks/gluon_bwd.py (127 and its ordered variant
#              129 through their plans, 111 and 124 forced, the peers)
#   d256       solver 130 (gluon_flash_bwd_d256): its GPU tests and the solver-level d256 benchmark
#              (benchmarks/diag/d256_device.sh)
#   ragged     decode over ragged kv_lens: 133 / 128 with chunks shared by length against the even
#              split and the public call (benchmarks/diag/ragged_decode.py), then the public call's
#              choice and time against 133 / 128 forced (benchmarks/diag/api_choice_ragged.py)
#   capture    each problem's first call inside CUDA-graph capture in a fresh process (conv, sdpa, decode
#              with kv_lens; benchmarks/diag/capture_first_call.py), the integration module's capture tests,
#              and the decode public call's host time (benchmarks/diag/decode_host_profile.py)
#   fuzz_huge  the fuzz's huge cases alone, no other process on the GPU (2026-12-04: the 2^31-element
#              attention ran out of memory in its default call while 12 fuzz shards shared the GPU)
#   dropout    per-call dropout counters and device seeds (thirty-third session): tests/gpu/test_dropout_plans_gpu.py,
#              the integration module's dropout / capture tests, benchmarks/diag/dropout_host.py (host us
#              with and without dropout) and the GPU fuzz's dropout cases
#   autograd_host  sdpa forward + backward through autograd: host us of each part, autograd's device
#              thread against the calling thread, cProfile (benchmarks/diag/attn_autograd_host.py; 2026-12-04:
#              592 us of host against 37 + 146 us called directly, torch's 287)
#   autograd_parts  what autograd itself costs around sdpa's backward: direct, through the Function,
#              autograd.grad on the device thread and the calling thread, torch's SDPA and a trivial
#              Function of the same arity (benchmarks/diag/autograd_parts.py; 2026-12-04: the host of the
#              H200 machine moved 2x between calls, our fwd+bwd 2.0-2.8x torch's)
#   refind     nnprim db build-system --refind-solver $SOLVERS (default 127) [--refind-key $KEYS] into the shipped db
#   conv_probes  benchmarks/stem_probe.py, benchmarks/gluon_conv_bwd_probe.py (solver level) and
#              benchmarks/pointwise_probe.py (the 1x1 layers through the API)
#   diag       the default-vs-forced clock check and the graphed conv's choices
#   host       where a public call's time goes (benchmarks/diag/api_host_breakdown.py: host us of the
#              public call, its invoker and torch's, CUDA-graph device time) and host_overhead.py
#   fused      fused conv + bias + residual + ReLU through the public API against torch eager and
#              torch.compile of the same expression (benchmarks/fused_conv.py, issue 13's targets), then
#              benchmarks/diag/fused_choice.py (FUSED_ONLY problems: default, plain and forced solvers)
#   wgrad      solver 29's schedules on the suite's 3x3 layers (benchmarks/diag/wgrad_tile_probe.py
#              --stream: split slices against stream-K, cuDNN in the same process)
set -uo pipefail
STEP=${1:?usage: bash benchmarks/gpu_plan.sh STEP OUT}
OUT=${2:?usage: bash benchmarks/gpu_plan.sh STEP OUT}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
D=$(date +%F)
case $STEP in
  tests|tests_attn|tests_rest|tests_decode)
    # -v streams each result and SIGINT makes pytest print its summary, so a run that
    # meets the time limit still names its failures (2026-12-01: 9 min for the suite).
    ATTN="tests/gpu/test_gluon_bwd_gpu.py tests/gpu/test_gluon_bwd_d256_gpu.py tests/gpu/test_gluon_fwd_gpu.py
          tests/gpu/test_attention_bwd_gpu.py tests/gpu/test_attention_fp8_gpu.py"
    case $STEP in
      tests) SEL=(tests/gpu) ;;
      tests_attn) SEL=($ATTN) ;;
      tests_rest) SEL=(tests/gpu); for f in $ATTN; do SEL+=(--ignore="$f"); done ;;
      tests_decode) SEL=(tests/gpu/test_gluon_decode_q4_gpu.py tests/gpu/test_paged_gpu.py
                         tests/gpu/test_decode_quant_gpu.py tests/gpu/test_decode_swap_gpu.py)
                    export NNPRIM_GPU_BIGMEM_SLOTS=${BIGMEM_SLOTS:-4} ;;
    esac
    timeout -s INT 560 python3 -m pytest -p no:cacheprovider "${SEL[@]}" -n 8 --dist load -v -rf --tb=short \
      --durations=25 -p no:benchmark --ignore=tests/gpu/test_fuzz.py > "$OUT/gpu_${STEP}_$D.log" 2>&1
    grep -E "FAILED|passed|failed" "$OUT/gpu_${STEP}_$D.log" | tail -40 ;;
  gluon_bench)
    timeout 240 python3 benchmarks/gluon_fwd.py --rounds 6 --dims 64,128,256 --variants pp_pers,pp_single,pp3_pers,1c_pers \
      --out "$OUT/gluon_fwd_$D.json" 2>&1 | tail -22
    timeout 180 python3 benchmarks/gluon_bwd.py --rounds 4 --out "$OUT/gluon_bwd_$D.json" 2>&1 | tail -18
    timeout 150 python3 benchmarks/gluon_conv_probe.py --out "$OUT/gluon_conv_probe_$D.json" 2>&1 | tail -40 ;;
  attn_bwd)
    # solver 127's dQ by f32 atomics against TMA reduce-adds (ninth session): its GPU module, then
    # the configs at the solver level with 111 and the peers interleaved
    timeout 250 python3 -m pytest -p no:cacheprovider tests/gpu/test_gluon_bwd_gpu.py -n 6 -q -rf --tb=short \
      > "$OUT/gpu_tests_gluon_bwd_$D.log" 2>&1
    tail -5 "$OUT/gpu_tests_gluon_bwd_$D.log"
    timeout ${BENCH_S:-200} python3 benchmarks/gluon_bwd.py --rounds 3 --configs ${CONFIGS:-default,ordered} \
      --solvers ${SOLVERS:-flash_111,ordered_124} --out "$OUT/gluon_bwd_$D.json" 2>&1 | tail -18 ;;
  d256)
    OUT="$OUT" bash benchmarks/diag/d256_device.sh ;;
  ragged)
    NNPRIM_CACHE_DIR=$(mktemp -d) timeout 150 python3 benchmarks/diag/ragged_decode.py --out "$OUT/ragged_decode_$D.json" \
      --rounds 15 2>&1 | grep -v Warn | cut -c1-170 | tail -26
    NNPRIM_CACHE_DIR=$(mktemp -d) timeout 90 python3 benchmarks/diag/api_choice_ragged.py 2>&1 | grep -v Warn | tail -6 ;;
  capture)
    timeout 200 python3 benchmarks/diag/capture_first_call.py --out "$OUT/capture_first_call_$D.json" 2>&1 | cut -c1-600
    timeout 150 python3 -m pytest -p no:cacheprovider -q tests/gpu/test_integration_gpu.py -k "capture or graph" -n 4 \
      2>&1 | tail -3
    NNPRIM_CACHE_DIR=$(mktemp -d) timeout 150 python3 benchmarks/diag/decode_host_profile.py \
      --out "$OUT/decode_host_profile_$D.json" 2>&1 | grep "^{" ;;
  dropout)
    timeout 200 python3 -m pytest -p no:cacheprovider -q tests/gpu/test_dropout_plans_gpu.py tests/gpu/test_integration_gpu.py \
      -k "dropout or capture or graph or each_call" -n 4 -rf --tb=short 2>&1 | tail -6
    NNPRIM_CACHE_DIR=$(mktemp -d) timeout 120 python3 benchmarks/diag/dropout_host.py --out "$OUT/dropout_host_$D.json" \
      2>&1 | grep "^{"
    NNPRIM_CACHE_DIR=$(mktemp -d) timeout 200 python3 -c "import sys; from nnprim.testing import fuzz
sys.exit(fuzz.run([c for c in fuzz.suite('gpu') if getattr(c.spec, 'dropout_p', 0)], 'cuda', '$OUT/fuzz_dropout_$D.jsonl'))" \
      > "$OUT/fuzz_dropout_$D.log" 2>&1; echo "fuzz rc $?"; python3 -m nnprim.testing.fuzz summary "$OUT/fuzz_dropout_$D.jsonl" | tail -12 ;;
  autograd_host)
    NNPRIM_CACHE_DIR=$(mktemp -d) timeout 150 python3 benchmarks/diag/attn_autograd_host.py \
      --out "$OUT/attn_autograd_host_$D.json" --trace "$OUT/attn_autograd_trace_$D.json" 2>&1 | grep -v Warn | cut -c1-200 | head -90 ;;
  autograd_parts)
    NNPRIM_CACHE_DIR=$(mktemp -d) timeout 150 python3 benchmarks/diag/autograd_parts.py --profile \
      --out "$OUT/autograd_parts_$D.json" 2>&1 | grep -v Warn | tail -2 ;;
  fuzz_huge)
    NNPRIM_CACHE_DIR=$(mktemp -d) NNPRIM_FUZZ_SUBSET=huge timeout 500 python3 -m pytest -q -p no:cacheprovider \
      tests/gpu/test_fuzz.py -rfE --tb=line > "$OUT/fuzz_huge_$D.log" 2>&1
    tail -8 "$OUT/fuzz_huge_$D.log" | cut -c1-400 ;;
  refind)
    # find again the system db's problems whose records hold solvers whose kernels changed
    # (SOLVERS, default 127), into the shipped db; copied to OUT
    # SOLVERS unset: 127; set but empty (with KEYS): by key only (2026-12-04: `:-` made an empty
    # SOLVERS refind 127's 36 problems too)
    SOLVERS=${SOLVERS-gluon_flash_bwd}
    timeout -s INT 330 python3 -m nnprim db build-system --device cuda ${SOLVERS:+--refind-solver "$SOLVERS"} \
      ${KEYS:+--refind-key "$KEYS"} --workers 12 2>&1 | tr '\r' '\n' | tail -4
    cp nnprim/data/system_finddb.sqlite nnprim/data/system_finddb.tsv "$OUT"/ ;;
  conv_probes)
    # the seventh session's conv solvers at the solver level: stem variants (70-72) and the
    # stride-2 Gluon backward (28/29) against Triton 21/22 and cuDNN (2026-12-01: 104 s in all)
    timeout 170 python3 benchmarks/stem_probe.py --out "$OUT/stem_probe_$D.json" 2>&1 | tail -8
    timeout 170 python3 benchmarks/gluon_conv_bwd_probe.py --out "$OUT/gluon_conv_bwd_probe_$D.json" 2>&1 | tail -10
    # the rn50 1x1 layers: cuBLAS solvers 33-35 vs implicit GEMM vs cuDNN vs a bare torch.mm (2026-12-01: 70 s)
    (cd benchmarks && timeout 170 python3 pointwise_probe.py --out "$OUT/pointwise_probe_$D.json" 2>&1 | tail -21) ;;
  diag)
    timeout 60 python3 benchmarks/diag/default_vs_forced.py --out "$OUT/default_vs_forced_$D.json" 2>&1 | tail -4
    timeout 120 python3 benchmarks/diag/graph_bwd_weights.py graph 2>&1 | grep -E "CHOSEN|WARNING" | head -20 ;;
  host)
    timeout 240 python3 benchmarks/diag/api_host_breakdown.py --out "$OUT/api_host_$D.json" 2>&1 | grep "^{" | cut -c1-400
    timeout 120 python3 benchmarks/host_overhead.py --out "$OUT/host_overhead_$D.json" 2>&1 | tail -8 ;;
  wgrad)
    timeout 240 python3 benchmarks/diag/wgrad_tile_probe.py --stream --out "$OUT/wgrad_stream_$D.json" 2>&1 | cut -c1-600 ;;
  fuzz)
    bash benchmarks/fuzz_gpu.sh "$OUT" ;;
  attention)
    timeout ${ATTN_S:-560} python3 benchmarks/attention.py --api --out "$OUT/attention_api_$D.json" \
      --bwd-solvers "${BWD_SOLVERS:-flash_bwd,flash_bwd_atomic,flash_bwd_ordered}" 2>&1 | tail -15 ;;
  tune5)
    timeout 560 python3 benchmarks/attention.py --api --tune-5gemm --out "$OUT/attention_api_tune_$D.json" \
      --subset train_d64_s4096,train_d128_s4096_causal,train_d256_s4096,train_d256_s4096_causal 2>&1 | tail -15 ;;
  decode)
    # 122, 128 and 133 forced next to the default path, V stored both ways (2026-12-01: 128 1.49x
    # cuDNN on s4 g32 with keys-contiguous V; 122 2-3x slower on that storage than on rows)
    timeout 330 python3 benchmarks/decode_formats.py --quick --solvers 122,128,133 --v-order both \
      --problems decode_b64_k8k,decode_b8_k32k --out "$OUT/decode_formats_$D.json" 2>&1 | tail -40
    timeout 220 python3 benchmarks/paged.py --out "$OUT/paged_$D.json" 2>&1 | tail -20 ;;
  decode_sweep)
    timeout 500 python3 benchmarks/diag/decode_swap_sweep.py --out "$OUT/decode_sweep_$D.json" \
      --formats s4:64,s8:64,u4:64,fp8:head,s4:head \
      --configs "${CONFIGS:-128x4x3,64x4x3:2,122/32x1x3,122/32x1x3:2,122/64x2x3,122/64x2x3:2}" 2>&1 | grep -v Warn | tail -14 ;;
  decode_q4)
    timeout 200 python3 -m pytest -p no:cacheprovider tests/gpu/test_gluon_decode_q4_gpu.py -n 4 -q -rf --tb=short \
      > "$OUT/gpu_tests_gluon_decode_q4_$D.log" 2>&1
    tail -3 "$OUT/gpu_tests_gluon_decode_q4_$D.log"
    timeout 300 python3 benchmarks/diag/decode_swap_sweep.py --out "$OUT/decode_q4_regs_$D.json" --rounds 60 \
      --formats ${FORMATS:-s4:64,u4:64,s4:head} \
      --configs "${CONFIGS:-122/32x1x3,133/32x1x1}" 2>&1 | grep -v Warn | tail -8
    timeout 90 python3 benchmarks/diag/api_vs_plan.py --formats s4:64,u4:64 --out "$OUT/api_vs_plan_$D.json" 2>&1 \
      | grep -E "^(api|plan|run_planned|s4|u4)" ;;
  paged_q4)
    timeout 200 python3 benchmarks/diag/paged_q4_probe.py --prefetch "${PREFETCH:-2,0+ring2+r168,0+ring3+r168}" \
      --pages 0,16,64 --out "$OUT/paged_q4_probe_$D.json" \
      2>&1 | grep -v Warn | tail -6
    timeout 330 python3 benchmarks/paged.py --formats bf16,s4,u4 --decode-only --forced 122,133 \
      --out "$OUT/paged_q4_$D.json" 2>&1 | grep -v "UserWarn\|warnings.warn" | tail -22 ;;
  paged_probe)
    timeout 400 python3 benchmarks/diag/paged_prefill_probe.py --out "$OUT/paged_prefill_probe_$D.json" 2>&1 | tail -4 ;;
  fp8)
    timeout 560 python3 benchmarks/attention_fp8.py --out "$OUT/attention_fp8_$D.json" 2>&1 | tail -20 ;;
  conv)
    CONV_S=300 bash benchmarks/run_suites.sh "$OUT" conv
    timeout 200 python3 benchmarks/depthwise.py --out "$OUT" 2>&1 | tail -3
    timeout 100 python3 benchmarks/nchw_probe.py --out "$OUT/nchw_probe_$D.json" 2>&1 | tail -4 ;;
  fused)
    # then where a fused call's time goes (default vs plain vs every forced solver; 2026-12-02: about
    # 60 s for four problems): c3d_3x3x3 fused ran 0.43 ms against its 0.27 ms plain forward
    timeout 330 python3 benchmarks/fused_conv.py --rounds 20 --out "$OUT/fused_conv_$D.json" 2>&1 | grep -v "^W1" | tail -25
    timeout 200 python3 benchmarks/diag/fused_choice.py --only ${FUSED_ONLY:-c3d_3x3x3,rn50_r5_1x1,rn50_r3_3x3} \
      --out "$OUT/fused_choice_$D.json" 2>&1 | grep -E "chosen|default|eager|forced" ;;
  sysdb)
    timeout -s INT 585 python3 -m nnprim db build-system --device cuda --count 90 --workers 14 --time-budget 470 2>&1 \
      | tr '\r' '\n' | tail -5
    cp nnprim/data/system_finddb.sqlite nnprim/data/system_finddb.tsv "$OUT"/ ;;
  bench_decode)
    # the quantized decode suite through `nnprim bench` (public calls, torch's SDPA on the bf16
    # cache as the peer in alternating rounds): issue 14's ratios per format and page size
    timeout 420 python3 -m nnprim bench --suite decode_quant_gpu --reps 40 --json "$OUT/bench_decode_quant_$D.json" \
      2>&1 | grep -v Warn | tail -30 ;;
  sysdb_decode)
    # the quantized decode suite (nnprim/data/suites/decode_quant_gpu.json: 4-bit / 8-bit / fp8,
    # contiguous and paged) into the shipped db
    timeout -s INT 420 python3 -m nnprim db build-system --device cuda --suite decode_quant_gpu --models none \
      --workers 14 --time-budget 330 2>&1 | tr '\r' '\n' | grep -v Warn | tail -30
    cp nnprim/data/system_finddb.sqlite nnprim/data/system_finddb.tsv "$OUT"/ ;;
  regret)
    timeout -s INT 420 python3 benchmarks/regret.py --device cuda --count 60 --seed ${SEED:-1} --workers 14 --time-budget 300 \
      --out "$OUT/regret_$D.json" 2>&1 | tail -20
    NNPRIM_CACHE_DIR=$(mktemp -d) timeout 120 python3 benchmarks/first_call.py --out "$OUT/first_call_$D.json" 2>&1 | tail -10 ;;
  *) echo "unknown step $STEP"; exit 2 ;;
esac
