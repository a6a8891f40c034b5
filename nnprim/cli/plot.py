"""`nnprim bench --plot FILE`: each problem's speed against torch's (bars, log scale) and
its position under the roofline (achieved TFLOP/s against arithmetic intensity, with the
bf16 tensor-core and HBM ceilings of an H200). matplotlib is an optional extra
(`pip install nnprim[plot]`)."""
from __future__ import annotations

import math

from ..errors import NotSupportedError

PEAK_TFLOPS = 750.0   # bf16 dense, what a GEMM reaches on an H200
PEAK_TBS = 4.2        # HBM3e copy bandwidth measured on an H200


def plot_rows(rows: list[dict], path: str, title: str = "") -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise NotSupportedError("--plot needs matplotlib: pip install 'nnprim[plot]'") from None
    ok = [r for r in rows if r.get("ms")]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(16, max(4.0, 0.28 * len(ok) + 1.5)),
                                   gridspec_kw=dict(width_ratios=[1.1, 1]))
    labels = [f"{r['name']} {r['direction']}" for r in ok]
    ratios = [r.get("speedup", float("nan")) for r in ok]
    colors = ["tab:green" if v >= 1 else "tab:red" for v in ratios]
    ax1.barh(range(len(ok)), [v if v == v else 0 for v in ratios], color=colors)
    ax1.axvline(1.0, color="black", lw=0.8)
    ax1.set_xscale("log")
    ax1.set_yticks(range(len(ok)), labels, fontsize=7)
    ax1.invert_yaxis()
    ax1.set_xlabel("speed against torch (torch ms / nnprim ms)")
    good = [v for v in ratios if v == v and v > 0]
    if good:
        gm = math.exp(sum(map(math.log, good)) / len(good))
        ax1.set_title(f"{title} geomean x{gm:.2f}")
    xs = [r["tflops"] / r["tbps"] if r.get("tbps") else float("nan") for r in ok]  # FLOP per byte
    ax2.scatter(xs, [r["tflops"] for r in ok], s=14, label="nnprim")
    ax2.scatter(xs, [r.get("peer_tflops", float("nan")) for r in ok], s=14, marker="x", label="torch")
    finite = [x for x in xs if x == x and x > 0]
    lo, hi = (min(finite) / 2, max(finite) * 2) if finite else (0.1, 1e4)
    grid = [lo * (hi / lo) ** (i / 100) for i in range(101)]
    ax2.plot(grid, [min(PEAK_TFLOPS, PEAK_TBS * x) for x in grid], color="gray", lw=1, label="roofline")
    ax2.set_xscale("log")
    ax2.set_yscale("log")
    ax2.set_xlabel("arithmetic intensity (FLOP / byte of compulsory traffic)")
    ax2.set_ylabel("TFLOP/s")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
