"""Context-parallel attention on two GPUs against one, and against torch's own context
parallel, in the same run (issue 18).

    python3 benchmarks/context_parallel.py --out $OUT/cp.json [--sizes 32768,65536,131072]
                                           [--repeats 5] [--no-torch-cp] [--budget-s 210]
    python3 benchmarks/context_parallel.py --cpu-smoke   # the same code on CPU + gloo, tiny sizes

Spawns its own two processes (NCCL, one GPU each; NCCL_NVLS_ENABLE=0). Problem: bf16, B 1,
GQA 32/8, D 128, causal, S total as given. Per size, forward + backward (autograd, the
loss's gradient given), CUDA events, warm-up outside the timed region, median of
--repeats runs on each rank, the slower rank's median reported:
- one_gpu: nnprim.sdpa on the whole sequence on one GPU (each rank runs it on its own);
- cp: nnprim.distributed.context_parallel_sdpa, zigzag, two GPUs (also forward alone);
- cp_nocomm: the same ring schedule with nnprim.distributed.NullRing (no transfers: every
  step's attention and merge, on the local K/V), i.e. compute alone;
- comm: the ring's transfers alone (forward: W-1 K/V blocks; backward: W-1 K/V blocks and
  W dK/dV f32 partials), sequentially;
- torch_cp_<backend>: torch.distributed.tensor.experimental.context_parallel with
  F.scaled_dot_product_attention (cuDNN and flash backends; GQA through enable_gqa, else
  K/V repeated to 32 heads, recorded), wrapped in try/except (errors recorded);
- torch_1gpu_cudnn: F.scaled_dot_product_attention (cuDNN) on one GPU, for scale.
Derived: speedup = one_gpu / cp (target >= 1.85), vs_torch_cp = torch_cp / cp (target
>= 1.2), exposed comm = cp - cp_nocomm, hidden = 1 - exposed / comm, and the relative error
of the ring's o, dq, dk, dv against one GPU's. nnprim runs in find mode "fast" unless
NNPRIM_FIND_MODE says otherwise: one solver applies per direction on these shapes, and a
find would first run the float64 reference on every new shape (seconds at 128k).
Writes JSON to --out (default benchmarks/results/context_parallel_<date>.json) after each
measurement and prints a table. FLOPs: fwd 4*B*Hq*S*S*D / 2 (causal), bwd 2.5x.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
import traceback
from contextlib import ExitStack
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("NNPRIM_FIND_MODE", "fast")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn.functional as F  # noqa: E402

B, HQ, HKV, D = 1, 32, 8, 128
BF16 = torch.bfloat16
WORLD = 2
DEV = "cuda"  # "cpu" with --cpu-smoke (set in each worker)


def flops_fwd_bwd(S: int) -> float:
    fwd = 4.0 * B * HQ * S * S * D / 2
    return fwd * 3.5


# ---- timing (collective: both ranks call each) -----------------------------------------

def _once_ms(fn) -> float:
    if DEV == "cpu":
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    fn()
    e.record()
    e.synchronize()
    return s.elapsed_time(e)


def bench(fn, reps: int, warmup: int) -> float:
    """Median ms of fn on this rank's GPU (CUDA events), max over ranks (ranks start each
    run together)."""
    for _ in range(warmup):
        fn()
    if DEV == "cuda":
        torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        dist.barrier()
        ts.append(_once_ms(fn))
    t = torch.tensor([statistics.median(ts)], device=DEV)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def all_ok(ok: bool) -> bool:
    """True on every rank iff true on every rank (keeps the ranks on one path)."""
    t = torch.tensor([int(ok)], device=DEV)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


# ---- the measurements ------------------------------------------------------------------

class Size:
    """The data of one sequence length on this rank: the full sequence and this rank's shards."""

    def __init__(self, S: int, dev: torch.device) -> None:
        from nnprim.distributed import shard_sequence
        g = torch.Generator(dev).manual_seed(S)
        self.S = S
        self.q, self.do = (torch.randn(B, HQ, S, D, generator=g, device=dev, dtype=BF16) for _ in range(2))
        self.k, self.v = (torch.randn(B, HKV, S, D, generator=g, device=dev, dtype=BF16) for _ in range(2))
        self.shard = lambda t: shard_sequence(t, 2, load_balance="zigzag")
        self.ql, self.kl, self.vl = (self.shard(t).requires_grad_() for t in (self.q, self.k, self.v))
        self.dol = self.shard(self.do)


def nnprim_rows(z: Size, rank: int, reps: int, warmup: int) -> dict:
    import nnprim
    from nnprim.distributed import NullRing, P2PRing, context_parallel_sdpa, make_plan, ring_attention
    from nnprim.distributed.comm import TAG_DKV, TAG_KV
    row: dict = {}
    qs, ks, vs = (t.clone().requires_grad_() for t in (z.q, z.k, z.v))

    def one_gpu():
        qs.grad = ks.grad = vs.grad = None
        nnprim.sdpa(qs, ks, vs, causal=True).backward(z.do)

    def one_gpu_fwd():
        with torch.no_grad():
            nnprim.sdpa(z.q, z.k, z.v, causal=True)

    def cp():
        z.ql.grad = z.kl.grad = z.vl.grad = None
        context_parallel_sdpa(z.ql, z.kl, z.vl, causal=True).backward(z.dol)

    def cp_fwd():
        with torch.no_grad():
            context_parallel_sdpa(z.ql, z.kl, z.vl, causal=True)

    plan = make_plan(z.ql, z.kl, z.vl, causal=True)
    null = NullRing(rank, WORLD)

    def cp_nocomm():
        z.ql.grad = z.kl.grad = z.vl.grad = None
        ring_attention(z.ql, z.kl, z.vl, plan, null)[0].backward(z.dol)

    ring = P2PRing(None, z.q.device)
    kv = torch.empty(2 * z.kl.numel(), dtype=BF16, device=z.q.device)
    kv2, dkv, dkv2 = torch.empty_like(kv), torch.empty(kv.shape, device=kv.device), torch.empty(kv.shape, device=kv.device)

    def comm():
        for _ in range(2 * (WORLD - 1)):       # forward and backward K/V rings
            ring.start(kv, kv2, TAG_KV).wait()
        for _ in range(WORLD):                 # dK/dV partials, f32
            ring.start(dkv, dkv2, TAG_DKV).wait()

    row["one_gpu_ms"] = bench(one_gpu, reps, warmup)
    row["one_gpu_fwd_ms"] = bench(one_gpu_fwd, reps, 1)
    row["cp_ms"] = bench(cp, reps, warmup)
    row["cp_fwd_ms"] = bench(cp_fwd, reps, 1)
    row["cp_nocomm_ms"] = bench(cp_nocomm, reps, 1)
    row["comm_ms"] = bench(comm, reps, 1)
    # exactness at this size: the ring against one GPU (both from the last timed runs)
    with torch.no_grad():
        o1 = nnprim.sdpa(z.q, z.k, z.v, causal=True)
        o = context_parallel_sdpa(z.ql, z.kl, z.vl, causal=True)
    one_gpu()
    cp()
    row["rel_err_vs_one_gpu"] = {n: round(rel(a, z.shard(b)), 5) for n, a, b in
                                 (("o", o, o1), ("dq", z.ql.grad, qs.grad), ("dk", z.kl.grad, ks.grad),
                                  ("dv", z.vl.grad, vs.grad))}
    return row


def _torch_cp_ms(z: Size, mesh, kind, gqa: bool, reps: int, warmup: int) -> float:
    """One configuration of torch's context parallel. Set-up and a first step run under
    try; the ranks then agree (one all_ok) before either times or raises, so a failure
    on one rank never leaves the other waiting in a collective."""
    from torch.distributed.tensor.experimental import context_parallel
    from torch.nn.attention import sdpa_kernel
    err: Exception | None = None
    with ExitStack() as stack:
        try:
            k, v = (z.k, z.v) if gqa else (z.k.repeat_interleave(HQ // HKV, 1), z.v.repeat_interleave(HQ // HKV, 1))
            bufs = [z.q.clone(), k.clone(), v.clone(), z.do.clone()]
            stack.enter_context(sdpa_kernel([kind]))
            stack.enter_context(context_parallel(mesh, buffers=bufs, buffer_seq_dims=[2, 2, 2, 2],
                                                 no_restore_buffers=set(bufs)))
            tq, tk, tv, tdo = bufs
            for t in (tq, tk, tv):
                t.requires_grad_()

            def step():
                tq.grad = tk.grad = tv.grad = None
                F.scaled_dot_product_attention(tq, tk, tv, is_causal=True, enable_gqa=gqa).backward(tdo)

            step()
        except Exception as e:
            err = e
        if not all_ok(err is None):
            raise err or RuntimeError("failed on the other rank")
        return bench(step, reps, warmup - 1)


def torch_cp_row(z: Size, mesh, backend: str, reps: int, warmup: int) -> dict:
    """torch's context parallel (monkey-patched F.scaled_dot_product_attention) on the same
    problem: GQA through enable_gqa, else K/V repeated to Hq heads."""
    from torch.nn.attention import SDPBackend
    kind = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[backend]
    out: dict = {}
    for gqa in (True, False):
        try:
            out["ms"] = _torch_cp_ms(z, mesh, kind, gqa, reps, warmup)
            out["kv_heads"] = HKV if gqa else HQ
            return out
        except Exception as e:
            out["error_gqa" if gqa else "error_repeated_kv"] = f"{type(e).__name__}: {str(e)[:300]}"
            if DEV == "cuda":
                torch.cuda.empty_cache()
    return out


def torch_1gpu_row(z: Size, reps: int, warmup: int) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    qs, ks, vs = (t.clone().requires_grad_() for t in (z.q, z.k, z.v))

    def step():
        qs.grad = ks.grad = vs.grad = None
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True).backward(z.do)
    try:
        step()
        ok = all_ok(True)
    except Exception as e:
        ok = all_ok(False)
        return {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    return {"ms": bench(step, reps, warmup - 1)} if ok else {"error": "failed on the other rank"}


# ---- the run -----------------------------------------------------------------------------

def derive(r: dict) -> None:
    S = r["S"]
    r["one_gpu_tflops"] = round(flops_fwd_bwd(S) / r["one_gpu_ms"] / 1e9, 1)
    r["cp_tflops_per_gpu"] = round(flops_fwd_bwd(S) / r["cp_ms"] / 1e9 / WORLD, 1)
    r["speedup"] = round(r["one_gpu_ms"] / r["cp_ms"], 3)
    r["speedup_fwd"] = round(r["one_gpu_fwd_ms"] / r["cp_fwd_ms"], 3)
    r["compute_split_speedup"] = round(r["one_gpu_ms"] / r["cp_nocomm_ms"], 3)
    exposed = r["cp_ms"] - r["cp_nocomm_ms"]
    r["exposed_comm_ms"] = round(exposed, 3)
    r["comm_hidden_fraction"] = round(min(1.0, max(0.0, 1 - exposed / r["comm_ms"])), 3) if r["comm_ms"] > 0 else None
    for key, val in list(r.items()):
        if key.startswith("torch_cp_") and isinstance(val, dict) and "ms" in val:
            r[f"vs_{key}"] = round(val["ms"] / r["cp_ms"], 3)


def worker(rank: int, port: int, a: argparse.Namespace) -> None:
    global DEV
    if a.cpu_smoke:
        DEV, dev = "cpu", torch.device("cpu")
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    else:
        torch.cuda.set_device(rank)
        dev = torch.device("cuda", rank)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                                timeout=timedelta(seconds=180), device_id=dev)
    import triton

    import nnprim
    t0 = time.time()
    res = dict(date=a.date, machine="cpu smoke" if a.cpu_smoke else torch.cuda.get_device_name(), gpus=WORLD,
               torch=torch.__version__, triton=triton.__version__,
               nccl=None if a.cpu_smoke else str(torch.cuda.nccl.version()),
               find_mode=nnprim.get_find_mode(), problem=dict(B=B, Hq=HQ, Hkv=HKV, D=D, dtype="bf16", causal=True,
                                                              load_balance="zigzag"),
               repeats=a.repeats, rows=[])

    def save() -> None:
        if rank == 0:
            Path(a.out).parent.mkdir(parents=True, exist_ok=True)
            json.dump(res, open(a.out, "w"), indent=1)

    def log(msg: str) -> None:
        if rank == 0:
            print(f"[{time.time() - t0:5.0f}s] {msg}", flush=True)

    def over_budget() -> bool:  # rank 0 decides for both
        t = torch.tensor([int(time.time() - t0 > a.budget_s)], device=DEV)
        dist.broadcast(t, 0)
        return bool(t.item())

    sizes = [int(s) for s in a.sizes.split(",")]
    data = {}
    for i, S in enumerate(sizes):  # nnprim first, every size; the peers after
        if over_budget():
            log(f"budget spent: S={S} skipped")
            break
        z = data[S] = Size(S, dev)
        row = {"S": S, **nnprim_rows(z, rank, a.repeats, 2 if i == 0 else 1)}
        derive(row)
        res["rows"].append(row)
        save()
        log(json.dumps(row))
        del data[S]
        torch.cuda.empty_cache()
    if not a.no_torch_cp:
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh(DEV, (WORLD,))
        for row in res["rows"]:
            z = Size(row["S"], dev)
            for backend in ("cudnn", "flash"):
                if over_budget():
                    row[f"torch_cp_{backend}"] = {"error": "skipped: benchmark budget spent"}
                    continue
                row[f"torch_cp_{backend}"] = torch_cp_row(z, mesh, backend, a.repeats, 2)
                torch.cuda.empty_cache()
            if not over_budget():
                row["torch_1gpu_cudnn"] = torch_1gpu_row(z, a.repeats, 2)
            derive(row)
            save()
            log(json.dumps({k: v for k, v in row.items() if "torch" in k}))
            del z
            torch.cuda.empty_cache()
    res["wall_s"] = round(time.time() - t0, 1)
    save()
    if rank == 0:
        print_table(res)
    dist.destroy_process_group()


def print_table(res: dict) -> None:
    hdr = (f"{'S':>7s} {'1 GPU ms':>9s} {'2 GPU ms':>9s} {'speedup':>7s} {'fwd x':>6s} {'nocomm':>8s} {'comm':>7s} "
           f"{'hidden':>6s} {'TF/GPU':>7s} {'torch cuDNN':>11s} {'torch flash':>11s} {'vs torch':>8s} max err")
    print(hdr)
    for r in res["rows"]:
        tc = [r.get(f"torch_cp_{b}", {}).get("ms") for b in ("cudnn", "flash")]
        best = min((t for t in tc if t), default=None)
        print(f"{r['S']:7d} {r['one_gpu_ms']:9.1f} {r['cp_ms']:9.1f} {r['speedup']:7.3f} {r['speedup_fwd']:6.3f} "
              f"{r['cp_nocomm_ms']:8.1f} {r['comm_ms']:7.2f} {r['comm_hidden_fraction'] or 0:6.2f} "
              f"{r['cp_tflops_per_gpu']:7.1f} {tc[0] or float('nan'):11.1f} {tc[1] or float('nan'):11.1f} "
              f"{(best / r['cp_ms']) if best else float('nan'):8.3f} {max(r['rel_err_vs_one_gpu'].values()):.2e}")
    print("targets: speedup >= 1.85, vs torch (best torch CP / ours) >= 1.2; errors: bf16 relative norm vs one GPU")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    date = time.strftime("%Y-%m-%d")
    ap.add_argument("--out", default=str(ROOT / f"benchmarks/results/context_parallel_{date}.json"))
    ap.add_argument("--sizes", default="32768,65536,131072")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-torch-cp", action="store_true")
    ap.add_argument("--budget-s", type=float, default=210.0, help="stop starting new measurements after this")
    ap.add_argument("--date", default=date)
    ap.add_argument("--cpu-smoke", action="store_true", help="CPU + gloo at tiny sizes: checks the script, times nothing useful")
    a = ap.parse_args()
    if a.cpu_smoke:
        a.sizes, a.repeats = "64,128", 2
        a.out = a.out if "--out" in sys.argv else os.path.join(os.environ.get("TMPDIR", "/tmp"), "cp_smoke.json")
    elif torch.cuda.device_count() < WORLD:
        sys.exit(f"needs {WORLD} CUDA devices, found {torch.cuda.device_count()}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        mp.spawn(worker, args=(port, a), nprocs=WORLD, join=True)
    except Exception:
        traceback.print_exc()
        sys.exit(1)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
