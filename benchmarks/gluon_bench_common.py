"""What benchmarks/gluon_fwd.py and gluon_bwd.py share: the hang-safe smoke run in a
subprocess, the relative error, the attention FLOP count, the interleaved timing of one
problem's implementations against cuDNN, the train problems of the suite, the output path
and the geomean summary."""
from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from nnprim.search.timing import interleaved_samples

ROOT = Path(__file__).resolve().parents[1]


def smoke(code: str, argv: list[str], timeout: int = 90) -> str | None:
    """None when `code` prints SMOKE-OK in a subprocess within `timeout` s, else why (a
    deadlocked kernel would otherwise hang the whole benchmark)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    try:
        r = subprocess.run([sys.executable, "-c", code, *argv], env=env, capture_output=True, text=True,
                           timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"hung for {timeout} s"
    return None if "SMOKE-OK" in r.stdout else (r.stdout + r.stderr)[-2000:]


def rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double(), ref.double()
    return float((x - ref).norm() / ref.norm().clamp_min(1e-30))


def attn_flops(p: dict, factor: float = 1.0) -> float:
    """The forward's 4*B*Hq*Sq*Sk*D (half when causal and square) times `factor` (2.5: backward)."""
    frac = 0.5 if (p["causal"] and p["Sq"] == p["Sk"]) else 1.0
    return factor * 4.0 * p["B"] * p["Hq"] * p["Sq"] * p["Sk"] * p["D"] * frac


def time_row(row: dict, live: dict[str, Callable[[], object]], flops: float, rounds: int, warmup: int) -> dict:
    """Times `live` interleaved on the GPU into row["ms"], row["tflops"] and row["vs_cudnn"]
    (when "cudnn" is among them); drops an empty row["errors"]."""
    names = list(live)
    samples = interleaved_samples([live[n] for n in names], "cuda", rounds=rounds, warmup=warmup)
    for n, ts in zip(names, samples):
        ms = statistics.median(ts)
        row["ms"][n] = round(ms, 4)
        row["tflops"][n] = round(flops / ms / 1e9, 1)
    if "cudnn" in row["ms"]:
        for n in names:
            row["vs_cudnn"][n] = round(row["ms"]["cudnn"] / row["ms"][n], 3)
    if not row["errors"]:
        del row["errors"]
    return row


def train_problems(suite: str, dims: str, subset: str) -> list[dict]:
    """The suite's train problems with D in `dims` ("64,128"), only `subset`'s names if given."""
    want_d = {int(d) for d in dims.split(",") if d}
    probs = [p for p in json.load(open(suite))["problems"] if p["mode"] == "train" and p["D"] in want_d]
    if subset:
        names = set(subset.split(","))
        probs = [p for p in probs if p["name"] in names]
    return probs


def out_path(out: str, stem: str) -> Path:
    """`out` when it names a .json file, else <out>/<stem>_<date>.json; its folder made."""
    path = Path(out)
    if path.suffix != ".json":
        path = path / f"{stem}_{time.strftime('%Y-%m-%d')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def new_result() -> dict:
    return dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                triton=__import__("triton").__version__, date=time.strftime("%Y-%m-%d %H:%M"), problems=[])


def geomean(xs: list[float]) -> float | None:
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def summarise(result: dict, names: list[str]) -> None:
    """geomean_<n>_vs_cudnn and min_<n>_vs_cudnn over the problems, into `result`."""
    for n in names:
        r = [row["vs_cudnn"][n] for row in result["problems"] if n in row.get("vs_cudnn", {})]
        result[f"geomean_{n}_vs_cudnn"] = geomean(r)
        result[f"min_{n}_vs_cudnn"] = min(r) if r else None

def graph_fn(fn):
    """fn captured in a CUDA graph (after a warm-up call); None when capture fails."""
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        return g.replay
    except Exception:  # noqa: BLE001 - no graph time for this one
        return None


def graph_us(fn, n: int = 20, repeats: int = 7) -> float | None:
    """Device time (us) of one call of fn: captured in a CUDA graph, the median over
    `repeats` event-timed runs of `n` replays; None when capture fails."""
    replay = graph_fn(fn)
    if replay is None:
        return None
    replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(repeats):
        a.record()
        for _ in range(n):
            replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / n * 1e3)
    return statistics.median(ts)


def host_us(fn, n: int = 30) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    dt = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return dt
