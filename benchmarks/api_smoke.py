"""End-to-end check of the public API on the GPU: the default find mode (hybrid) runs a
find on the first call of each problem, records it in the find-db, and later calls reuse
it. Checks results against the float64 references and reports which solver won, the find
time and the per-call time. Writes $OUT/api_smoke.json.

    PYTHONUNBUFFERED=1 python benchmarks/api_smoke.py
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
os.environ.setdefault("NNPRIM_CACHE_DIR", tempfile.mkdtemp(prefix="nnprim-smoke-"))

import nnprim  # noqa: E402
from nnprim.args import AttnArgs, ConvArgs  # noqa: E402
from nnprim.attention.reference import reference_backward, reference_forward  # noqa: E402
from nnprim.conv.reference import reference  # noqa: E402
from nnprim.search import context  # noqa: E402
from nnprim.search.numerics import rel_error  # noqa: E402
from nnprim.search.timing import median_ms  # noqa: E402

OUT = os.environ.get("OUT", ".")
DRY = "--dry" in sys.argv  # CPU dry run of the script itself at tiny sizes
dev = "cpu" if DRY else "cuda"


def sz(n: int, small: int) -> int:
    return small if DRY else n


def sync():
    if dev == "cuda":
        torch.cuda.synchronize()
rows = []


def record(name, problem, first_ms, fn, err):
    s = context.for_problem(problem).resolve(problem)
    ms = median_ms(fn, dev, repeats=20, warmup=3)
    row = dict(name=name, key=problem.key(), solver=s.name, family=s.family, first_call_ms=round(first_ms, 1),
               ms=round(ms, 4), tflops=round(problem.flops() / ms / 1e9, 1), rel_err=err)
    rows.append(row)
    print(row, flush=True)
    with open(os.path.join(OUT, "api_smoke.json"), "w") as f:  # incremental: a timeout still returns data
        json.dump(dict(rows=rows), f, indent=1)


def timed(fn):
    sync()
    t0 = time.perf_counter()
    out = fn()
    sync()
    return out, (time.perf_counter() - t0) * 1e3


def conv(name, N, C, H, W, K, R, stride, pad, groups=1, post=True):
    g = torch.Generator(device=dev).manual_seed(0)
    cl = torch.channels_last
    x = torch.randn(N, C, H, W, device=dev, generator=g).bfloat16().to(memory_format=cl)
    w = torch.randn(K, C // groups, R, R, device=dev, generator=g).bfloat16().to(memory_format=cl)
    b = torch.randn(K, device=dev, generator=g).bfloat16()
    ops = []
    p = nnprim.ConvProblem.from_tensors(x, w, stride=stride, padding=pad, groups=groups, bias=b)
    if post:
        res = torch.randn(p.y_shape, device=dev, generator=g).bfloat16().to(memory_format=cl)
        ops = [nnprim.Sum(res), nnprim.Eltwise("relu")]
    call = lambda: nnprim.conv_forward(x, w, b, stride=stride, padding=pad, groups=groups, post_ops=ops)
    y, first = timed(call)
    p = nnprim.ConvProblem.from_tensors(x, w, stride=stride, padding=pad, groups=groups, bias=b, post_ops=ops)
    err = rel_error(y, reference(p, ConvArgs(x=x, w=w, bias=b, post_ops=tuple(ops))).to(y.dtype))
    record(name + "/fwd", p, first, call, err)
    kw = dict(stride=stride, padding=pad, groups=groups)
    for d in ("bwd_data", "bwd_weights"):
        dy = torch.randn(p.y_shape, device=dev, generator=g).bfloat16().to(memory_format=cl)
        if d == "bwd_data":
            call = lambda dy=dy: nnprim.conv_backward_data(dy, w, x.shape, **kw)
            args = ConvArgs(dy=dy, w=w)
        else:
            call = lambda dy=dy: nnprim.conv_backward_weights(dy, x, w.shape, **kw)
            args = ConvArgs(dy=dy, x=x)
        out, first = timed(call)
        pd = nnprim.ConvProblem.create(d, x.shape, w.shape, dtype=x.dtype, layout="nhwc", device=dev, **kw)
        record(f"{name}/{d}", pd, first, call, rel_error(out, reference(pd, args).to(out.dtype)))


def attn(name, B, Hq, Hkv, Sq, Sk, D, causal, quant=None):
    g = torch.Generator(device=dev).manual_seed(1)
    q = torch.randn(B, Hq, Sq, D, device=dev, generator=g).bfloat16()
    k = torch.randn(B, Hkv, Sk, D, device=dev, generator=g).bfloat16()
    v = torch.randn(B, Hkv, Sk, D, device=dev, generator=g).bfloat16()
    if quant:
        k, v = nnprim.quantize_kv(k, quant, 64), nnprim.quantize_kv(v, quant, 64)
    call = lambda: nnprim.sdpa(q, k, v, causal=causal)
    o, first = timed(call)
    p = nnprim.AttentionProblem.from_tensors(q, k, v, causal=causal)
    ref, _ = reference_forward(p, AttnArgs(q=q, k=k, v=v))
    record(name + "/fwd", p, first, call, rel_error(o, ref.to(o.dtype)))
    if quant or Sq == 1:
        return
    o, lse = nnprim.sdpa(q, k, v, causal=causal, return_lse=True)
    do = torch.randn_like(o)
    call = lambda: nnprim.sdpa_backward(do, q, k, v, o, lse, causal=causal)
    grads, first = timed(call)
    pb = nnprim.AttentionProblem.from_tensors(q, k, v, causal=causal, direction="bwd", return_lse=True)
    refs = reference_backward(pb, AttnArgs(q=q, k=k, v=v, do=do, o=o, lse=lse))
    record(name + "/bwd", pb, first, call, rel_error(grads, tuple(r.to(o.dtype) for r in refs)))


conv("rn50_r3_3x3", sz(128, 2), 128, 28, 28, 128, 3, 1, 1)
attn("d128_s4096_causal", sz(4, 1), 16, 16, sz(4096, 64), sz(4096, 64), 128, "top_left")
attn("decode_b64_k8k", sz(64, 2), 32, 8, 1, sz(8192, 256), 128, None)
attn("decode_b64_k8k_s4", sz(64, 2), 32, 8, 1, sz(8192, 256), 128, None, quant="s4")
# the second process reuses the db: time a fresh choice of one problem
context.reset()
t0 = time.perf_counter()
shape = (sz(4, 1), 16, sz(4096, 64), 128)
nnprim.sdpa(*(torch.randn(shape, device=dev).bfloat16() for _ in range(3)), causal="top_left")
sync()
db_hit_ms = (time.perf_counter() - t0) * 1e3
print("first call after clearing in-memory caches (find-db hit):", round(db_hit_ms, 1), "ms")
with open(os.path.join(OUT, "api_smoke.json"), "w") as f:
    name = torch.cuda.get_device_name() if dev == "cuda" else "cpu"
    json.dump(dict(rows=rows, db_hit_first_call_ms=db_hit_ms, device=name), f, indent=1)
bad = [r for r in rows if not r["rel_err"] <= 2e-2]
print(f"\n{'problem':28} {'solver':28} {'first ms':>10} {'ms':>10} {'TFLOP/s':>8} {'rel_err':>9}")
for r in rows:
    print(f"{r['name']:28} {r['solver']:28} {r['first_call_ms']:10.1f} {r['ms']:10.4f} {r['tflops']:8.1f} {r['rel_err']:9.2e}")
print("FAILED:", [r["name"] for r in bad] if bad else "none")
