"""In-process A/B of the CPU brgemm forward at a stride-2 last dim (cpu_brgemm.FwdGeometry):
whole staged rows read at 2C (ps = 2, one GEMM per filter row) against the phase grid (ps = 1,
forced by replacing cpu_brgemm.column_stride), and torch's convolution, interleaved call by
call (medians of 9), 2 threads, NHWC, 3x3 stride 2 pad 1.

    PYTHONPATH=$PWD python benchmarks/diag/brgemm_stride2_ab.py
"""
import statistics
import time

import torch
import torch.nn.functional as F

from nnprim.args import ConvArgs
from nnprim.conv import cpu_brgemm
from nnprim.problems.conv import ConvProblem, to_layout


def once(f, *args) -> float:
    t = time.perf_counter()
    f(*args)
    return time.perf_counter() - t


def main() -> None:
    torch.set_num_threads(2)
    for dt in (torch.float32, torch.bfloat16):
        for shape, k in (((8, 128, 56, 56), 128), ((8, 64, 112, 112), 64), ((8, 256, 28, 28), 256)):
            p = ConvProblem.create("fwd", shape, (k, shape[1], 3, 3), dtype=dt, layout="nhwc", device="cpu",
                                   padding=1, stride=2)
            x = to_layout(torch.randn(p.x_shape).to(dt), "nhwc")
            w = to_layout(torch.randn(p.w_shape).to(dt), "nhwc")
            a = ConvArgs(x=x, w=w)
            new = cpu_brgemm.CpuBrgemmFwd().prepare(p)
            orig = cpu_brgemm.column_stride
            cpu_brgemm.column_stride = lambda p: 1
            try:
                old = cpu_brgemm.CpuBrgemmFwd().prepare(p)
            finally:
                cpu_brgemm.column_stride = orig
            ref = lambda x=x, w=w: F.conv2d(x, w, padding=1, stride=2)  # noqa: E731
            assert torch.allclose(new(a).float(), old(a).float(), rtol=1e-2, atol=1e-2)
            rn, ro, rt = [], [], []
            for _ in range(11):
                rn.append(once(new, a))
                ro.append(once(old, a))
                rt.append(once(ref))
            n, o, t = (statistics.median(v[2:]) * 1e3 for v in (rn, ro, rt))
            print(f"{dt} {shape}: ps=2 {n:.2f} ms, phases {o:.2f} ms, torch {t:.2f} ms; ps=2 / phases {o / n:.2f}x, "
                  f"torch / ps=2 {t / n:.2f}x, torch / phases {t / o:.2f}x")


if __name__ == "__main__":
    main()
