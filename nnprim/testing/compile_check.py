"""Compile the GPU solvers' Triton kernels for an H200 (sm_90) on a machine without a GPU.

The Triton interpreter runs the kernels' Python, not their code generation, so errors that
only the compiler sees (int64 promotion, tuples returned by jit helpers, TMA descriptor
types, register-hungry tiles) would first show on the GPU. Here every launch of a solver's
invoker becomes a compile-only warm-up for sm_90 through a stub driver; the invokers run
on CPU tensors (their GEMMs on torch's CPU kernels). Needs TRITON_INTERPRET unset and its
own process (it replaces Triton's active driver): `python -m nnprim.testing.compile_check`
(tests/test_compile_sm90.py runs it); exit status 1 on a kernel that does not compile."""
from __future__ import annotations

import os
import sys
import time
from dataclasses import replace

import torch

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
CONV = [  # (direction, x, w, options): the kernel paths of implicit GEMM, gemm and direct
    ("fwd", (2, 64, 10, 10), (64, 64, 3, 3), dict(padding=1, layout="nhwc", dtype=BF16)),       # TMA conv
    ("fwd", (2, 64, 10, 10), (64, 64, 1, 1), dict(layout="nhwc", dtype=BF16)),                  # TMA GEMM
    ("fwd", (2, 3, 10, 10), (16, 3, 3, 3), dict(padding=1, dtype=F16, has_bias=True)),         # flat K
    ("fwd", (2, 64, 10, 10), (64, 64, 3, 3), dict(padding=1, stride=2, dtype=F32)),            # channel blocks
    ("fwd", (2, 32, 9, 9), (32, 1, 3, 3), dict(padding=1, groups=32, layout="nhwc", dtype=BF16)),
    ("fwd", (2, 32, 9, 9), (32, 4, 3, 3), dict(padding=1, groups=8, layout="nhwc", dtype=BF16)),  # direct dot
    ("fwd", (2, 8, 40), (8, 1, 40), dict(padding=((39, 0),), groups=8, dtype=BF16)),
    ("bwd_data", (2, 64, 10, 10), (64, 64, 3, 3), dict(padding=1, layout="nhwc", dtype=BF16)),
    ("bwd_data", (2, 64, 10, 10), (64, 64, 1, 1), dict(layout="nhwc", dtype=BF16)),
    ("bwd_data", (2, 16, 10, 10), (32, 16, 3, 3), dict(padding=1, stride=2, dtype=F32)),
    ("bwd_data", (2, 32, 9, 9), (32, 1, 3, 3), dict(padding=1, groups=32, dtype=F16)),
    ("bwd_weights", (2, 64, 10, 10), (64, 64, 3, 3), dict(padding=1, layout="nhwc", dtype=BF16)),
    ("bwd_weights", (64, 16, 10, 10), (32, 16, 3, 3), dict(padding=1, stride=2, dtype=F32)),  # split-K
    ("bwd_weights", (2, 32, 9, 9), (32, 1, 3, 3), dict(padding=1, groups=32, dtype=F16)),
    ("bwd_weights", (8, 32, 9, 9), (32, 4, 3, 3), dict(padding=1, groups=8, layout="nhwc", dtype=BF16)),
    ("bwd_weights", (4, 32, 1, 1), (48, 32, 1, 1), dict(layout="nhwc", dtype=BF16)),       # 1x1 images
    ("bwd_data", (2, 32, 9, 9), (32, 1, 3, 3), dict(padding=1, stride=2, groups=32, layout="nhwc", dtype=BF16)),
    ("bwd_weights", (2, 32, 9, 9), (32, 1, 3, 3), dict(padding=1, groups=32, layout="nhwc", dtype=BF16)),
    ("fwd", (2, 3, 12, 11), (16, 3, 5, 5), dict(padding=2, has_bias=True, dtype=F16,   # stem (70), NCHW
                                                post_ops=(("eltwise", "relu", 0.0, 0.0),))),
    ("bwd_data", (2, 1, 9, 9), (40, 1, 3, 3), dict(padding=(0, 1), stride=(1, 2), dtype=F32)),  # stem (71)
    ("bwd_weights", (2, 4, 12, 11), (16, 4, 7, 7), dict(padding=3, stride=2, layout="nhwc", dtype=F16)),
]
ATTENTION = [  # (solver, problem fields)
    ("flash_fwd", dict(B=1, Hq=4, Hkv=2, Sq=70, Sk=90, D=64, Dv=64, dtype=BF16, causal="bottom_right",
                       return_lse=True)),
    ("flash_bwd", dict(direction="bwd", B=1, Hq=4, Hkv=2, Sq=70, Sk=90, D=64, Dv=64, dtype=F16, return_lse=True)),
    ("flash_bwd_atomic", dict(direction="bwd", B=1, Hq=4, Hkv=2, Sq=70, Sk=90, D=128, Dv=128, dtype=BF16,
                              causal="bottom_right", return_lse=True)),
    ("flash_bwd_ordered", dict(direction="bwd", B=1, Hq=2, Hkv=1, Sq=70, Sk=90, D=256, Dv=256, dtype=BF16,
                               causal="top_left", return_lse=True)),
    ("decode_split_k", dict(B=1, Hq=8, Hkv=1, Sq=1, Sk=5000, D=128, Dv=128, dtype=BF16, return_lse=True)),
    # kv_lens with splits: chunks shared by length (BALANCED) in the main kernels and the combine
    ("decode_split_k", dict(B=3, Hq=8, Hkv=2, Sq=2, Sk=5000, D=128, Dv=128, dtype=BF16, has_kv_lens=True,
                            causal="bottom_right")),
    ("decode_split_k_quant_grouped", dict(B=3, Hq=8, Hkv=2, Sq=1, Sk=5000, D=128, Dv=128, dtype=BF16, has_kv_lens=True,
                                          k_quant=("s8", 64, "g", "bfloat16", None),
                                          v_quant=("s8", 64, "g", "bfloat16", None))),
    ("decode_swap_ab_quant", dict(B=3, Hq=8, Hkv=2, Sq=1, Sk=4992, D=128, Dv=128, dtype=BF16, has_kv_lens=True,
                                  k_quant=("u4", 64, "g", "bfloat16", "g", 1),
                                  v_quant=("u4", 64, "g", "bfloat16", "g", 1), page_size=16)),
    ("decode_split_k_scaled", dict(B=3, Hq=8, Hkv=2, Sq=1, Sk=5000, D=128, Dv=128, dtype=BF16, has_kv_lens=True,
                                   k_quant=("fp8_e4m3", 128, "h", "float32", None),
                                   v_quant=("fp8_e4m3", 128, "h", "float32", None))),
    ("decode_split_k_quant", dict(B=1, Hq=4, Hkv=1, Sq=1, Sk=4000, D=128, Dv=128, dtype=BF16,
                                  k_quant=("s4", 32, "g", "float16", "g"))),
    ("decode_split_k_quant_grouped", dict(B=1, Hq=4, Hkv=1, Sq=1, Sk=4000, D=128, Dv=128, dtype=BF16,
                                          k_quant=("s8", 32, "g", "float16", None),
                                          v_quant=("u4", 32, "g", "float16", "g"))),
    ("decode_split_k_quant_grouped", dict(B=2, Hq=4, Hkv=2, Sq=1, Sk=4000, D=128, Dv=128, dtype=BF16,  # issue 14
                                          k_quant=("fp8_e4m3", 128, "h", "float32", None),
                                          v_quant=("s4", 64, "g", "bfloat16", "g", 1))),
    ("decode_swap_ab_quant", dict(B=2, Hq=8, Hkv=2, Sq=1, Sk=4000, D=128, Dv=128, dtype=BF16,  # issue 14, swap-AB
                                  k_quant=("s4", 32, "g", "bfloat16", None, 1),
                                  v_quant=("u4", 64, "g", "bfloat16", "g", 1), return_lse=True)),
    ("decode_swap_ab_quant", dict(B=1, Hq=4, Hkv=1, Sq=3, Sk=4000, D=128, Dv=128, dtype=F16, causal="bottom_right",
                                  k_quant=("s8", 128, "h", "float32", "h"),
                                  v_quant=("fp8_e4m3", 128, "t", "float32", None))),
    ("decode_split_k_scaled", dict(B=2, Hq=8, Hkv=2, Sq=1, Sk=4000, D=128, Dv=128, dtype=BF16,  # e4m3 -> f16
                                   k_quant=("fp8_e4m3", 128, "h", "float32", None),
                                   v_quant=("fp8_e4m3", 128, "h", "float32", None, "keys"), return_lse=True)),
    ("decode_split_k_scaled", dict(B=1, Hq=4, Hkv=1, Sq=3, Sk=4000, D=96, Dv=96, dtype=F16, causal="bottom_right",
                                   k_quant=("s8", 96, "t", "float32", None),
                                   v_quant=("u8", 96, "h", "bfloat16", None))),
    ("decode_split_k_quant", dict(B=1, Hq=4, Hkv=1, Sq=1, Sk=4000, D=128, Dv=128, dtype=BF16,
                                  k_quant=("fp8_e4m3", 128, "t", "float32", None),
                                  v_quant=("u4", 32, "g", "float16", "g", 1))),
]

E4 = torch.float8_e4m3fn
FP8_ATTENTION = [  # solver 125 with the Hopper tiles, pointer and TMA loads (CPU tensors never take TMA)
    dict(B=1, Hq=4, Hkv=2, Sq=300, Sk=333, D=128, Dv=128, causal="bottom_right", descale="hth"),
    dict(B=1, Hq=2, Hkv=2, Sq=200, Sk=150, D=64, Dv=64, mask="bool", mask_shape=(1, 1, 200, 150), descale="tnt"),
    dict(B=1, Hq=2, Hkv=1, Sq=130, Sk=260, D=256, Dv=256, causal="top_left", descale="hhh", return_lse=True),
]


def _fp8_attempts(attempt) -> None:
    from nnprim.attention import configs, flash_fwd_fp8
    from nnprim.problems.attention import AttentionProblem
    from nnprim.search.solver import REGISTRY
    saved = flash_fwd_fp8.use_tma_for, configs.device_arch
    try:
        configs.device_arch = lambda device: "sm90"
        for tma in (False, True):
            flash_fwd_fp8.use_tma_for = lambda p, a, tma=tma: tma
            for fields in FP8_ATTENTION:
                attempt(REGISTRY.get("flash_fwd_fp8"), AttentionProblem(**(
                    dict(direction="fwd", device="cpu", dtype=E4, out_dtype=BF16) | fields)))
    finally:
        flash_fwd_fp8.use_tma_for, configs.device_arch = saved


GLUON_CONV = [  # (x, w, options) of solver 27 (Gluon, sm_90 only): 3x3 C=K=64..512, 1x1, 5x5/7x7, epilogues
    ((2, 64, 10, 10), (64, 64, 3, 3), dict(padding=1)),
    ((2, 128, 20, 20), (128, 128, 3, 3), dict(padding=1)),
    ((2, 256, 14, 14), (256, 256, 3, 3), dict(padding=1)),
    ((2, 512, 7, 7), (512, 512, 3, 3), dict(padding=1)),
    ((2, 64, 10, 10), (256, 64, 1, 1), dict()),
    ((2, 256, 10, 10), (64, 256, 1, 1), dict(has_bias=True, dtype=F16)),
    ((2, 512, 7, 7), (128, 512, 1, 1), dict()),
    ((1, 32, 9, 11), (48, 32, 5, 5), dict(padding=((2, 1), (0, 3)), has_bias=True)),
    ((1, 16, 9, 11), (32, 16, 7, 7), dict(padding=3)),
    ((2, 64, 12, 12), (128, 64, 3, 3), dict(padding=2, dilation=2, has_bias=True,
                                            post_ops=(("sum", 0.5), ("eltwise", "gelu_erf", 0.0, 0.0),
                                                      ("binary", "mul", (1, 128, 1, 1)),
                                                      ("eltwise", "silu", 0.0, 0.0)))),
    # a residual block's epilogue (bias, Sum in y's dtype read through c_smem, ReLU): 128 x 128,
    # 64-wide and 256-row (two consumer warpgroups) tiles, a tail of rows, and a Sum in f32
    ((2, 128, 28, 28), (128, 128, 3, 3), dict(padding=1, has_bias=True,
                                              post_ops=(("sum", 1.0), ("eltwise", "relu", 0.0, 0.0)))),
    ((2, 64, 9, 11), (64, 64, 3, 3), dict(padding=1, has_bias=True, dtype=F16,
                                          post_ops=(("sum", 1.0), ("eltwise", "relu", 0.0, 0.0)))),
    ((8, 640, 32, 32), (640, 640, 3, 3), dict(padding=1, has_bias=True,
                                              post_ops=(("sum", 1.0), ("eltwise", "relu", 0.0, 0.0)))),
    ((4, 2048, 7, 7), (512, 2048, 1, 1), dict(has_bias=True, post_ops=(("sum", 1.0),))),
    ((2, 64, 5, 10, 11), (128, 64, 3, 3, 3), dict(padding=1, has_bias=True,                  # 3-D (c3d's kind)
                                                   post_ops=(("sum", 1.0), ("eltwise", "relu", 0.0, 0.0)))),
    # stride 2 (x read per stride phase): 3x3, the 1x1 downsample, dilation 2
    ((2, 64, 11, 10), (128, 64, 3, 3), dict(padding=1, stride=2)),
    ((2, 256, 14, 14), (512, 256, 1, 1), dict(stride=2)),
    ((2, 64, 13, 12), (64, 64, 3, 3), dict(padding=2, dilation=2, stride=(2, 1))),
    # solver 28: stride-1 backward data on the same kernel (filter read transposed, taps flipped)
    ((2, 64, 10, 10), (64, 64, 3, 3), dict(padding=1, direction="bwd_data")),
    ((2, 256, 14, 14), (128, 256, 3, 3), dict(padding=1, direction="bwd_data")),
    ((2, 64, 10, 10), (256, 64, 1, 1), dict(direction="bwd_data", dtype=F16)),
    # solver 28 at stride 2: one phased launch (phase table, a store view per phase)
    ((2, 128, 11, 10), (128, 128, 3, 3), dict(padding=1, stride=2, direction="bwd_data")),   # 4/2/2/1 taps
    ((2, 256, 14, 14), (512, 256, 1, 1), dict(stride=2, direction="bwd_data")),             # 3 zero phases
    ((2, 64, 13, 12), (64, 64, 3, 3), dict(padding=2, dilation=2, stride=(2, 1), direction="bwd_data")),
    ((1, 32, 9, 11), (48, 32, 5, 5), dict(padding=((2, 1), (0, 3)), stride=(1, 2), direction="bwd_data",
                                          dtype=F16)),
    # 3-D: output planes as images, each depth tap reads its x plane (c3d's kind, depth stride 2)
    ((2, 64, 5, 10, 10), (128, 64, 3, 3, 3), dict(padding=1, has_bias=True)),
    ((2, 64, 6, 10, 10), (64, 64, 3, 3, 3), dict(padding=1, stride=(2, 2, 2))),
    ((2, 64, 5, 10, 10), (64, 64, 3, 3, 3), dict(padding=1, direction="bwd_data")),
    # 45 K steps: 256-row tiles with two consumer warpgroups (LONG_STEPS), forward and backward data
    ((1, 320, 33, 35), (320, 320, 3, 3), dict(padding=1)),
    ((1, 320, 33, 35), (320, 320, 3, 3), dict(padding=1, direction="bwd_data")),
    # grouped (blockdiag.py): tiles of whole groups over the packed block-diagonal filter
    ((2, 128, 10, 10), (128, 4, 3, 3), dict(padding=1, groups=32, has_bias=True)),
    ((2, 128, 10, 10), (128, 4, 3, 3), dict(padding=1, groups=32, direction="bwd_data")),
]


def _cubin_usage(ck) -> str:
    """'REG:n STACK:n LOCAL:n CALLS:n' of a compiled kernel (cuobjdump of its cubin), or '?'.
    CALLS: `ptx_calls`. A kernel with a call lost the uniform datapath in its main loop (solver
    133's int64 `//`: ~8 % slower on the H200, 2026-12-04)."""
    import subprocess
    import tempfile
    cuobjdump = os.path.join(os.path.dirname(__import__("triton").__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(cuobjdump):
        return "?"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(ck.asm["cubin"])
        f.flush()
        out = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True).stdout
    usage = " ".join(w for w in out.split() if w.startswith(("REG:", "STACK:", "LOCAL:")))
    return f"{usage} CALLS:{ptx_calls(ck)}"


def ptx_calls(ck) -> int:
    """Calls, and 64-bit integer divisions / remainders (a subroutine each in the SASS), in a
    compiled kernel's PTX."""
    import re
    return len(re.findall(r"\b(?:call|div\.[su]64|rem\.[su]64)\b", ck.asm.get("ptx", "")))


def _report_variants(label: str, kernel, report: list[str]) -> None:
    """One '<label> <kernel> warps=.. dynamic_smem=.. REG:.. STACK:.. <CONSTEXPRS>' line per
    compiled variant of a Gluon kernel (its upper-case constexprs name the variant)."""
    names = kernel.arg_names
    for cache in kernel.device_caches.values():
        for ck in cache[0].values():
            c = " ".join(f"{names[k[0]]}={v}" for k, v in ck.src.constants.items()
                         if isinstance(k, tuple) and len(k) == 1 and names[k[0]].isupper())
            report.append(f"{label} {ck.name} warps={ck.metadata.num_warps} "
                          f"dynamic_smem={ck.metadata.shared} {_cubin_usage(ck)} {c}".rstrip())


def _conv_plan_attempts(label: str, module, kernel: str, plan: str, cases, direction: str, describe,
                        failures: list[str], report: list[str]) -> None:
    """Compile a Gluon conv kernel through its plan for each (x, w, options) case (the
    solvers are not applicable without a Hopper GPU) and report, per new compiled variant,
    `describe(problem, plan)` with warps, shared memory, registers and spills."""
    from nnprim.gluon_support import GLUON_ERROR
    from nnprim.problems.conv import ConvProblem
    from nnprim.search.random_args import random_args
    if GLUON_ERROR is not None:
        failures.append(f"{label}: Gluon import failed: {GLUON_ERROR}")
        return
    kernel, make_plan = getattr(module, kernel), getattr(module, plan)
    for x, w, kw in cases:
        kw = dict(kw)
        p = ConvProblem.create(kw.pop("direction", direction), x, w, device="cpu", layout="nhwc",
                               dtype=kw.pop("dtype", BF16), **kw)
        before = {id(ck) for cache in kernel.device_caches.values() for ck in cache[0].values()}
        try:
            plan = make_plan(p)
            plan(random_args(p, seed=0))
        except Exception as e:  # noqa: BLE001 - report every variant that does not compile
            failures.append(f"{label} on {p.key()}: {type(e).__name__}: {str(e)[:800]}")
            continue
        new = [ck for cache in kernel.device_caches.values() for ck in cache[0].values() if id(ck) not in before]
        for ck in new:
            report.append(f"{label} {describe(p, plan)} warps={ck.metadata.num_warps} "
                          f"dynamic_smem={ck.metadata.shared} {_cubin_usage(ck)}")


def _gluon_conv_attempts(failures: list[str], report: list[str]) -> None:
    """Solvers 27/28 (one kernel): tile, registers, spills and shared memory per problem
    (stride-2 backward data: the phased launch)."""
    from nnprim.conv import gluon_conv

    def describe(p, plan) -> str:
        t = plan.tile
        return (f"{p.direction} x={p.x_shape} w={p.w_shape} BH={t.BH} BW={t.BW} BN={t.BN} BK={t.BK} "
                f"KSUB={t.KSUB} STAGES={t.STAGES}")
    _conv_plan_attempts("gluon conv", gluon_conv, "_gluon_conv_kernel", "GluonConvPlan", GLUON_CONV, "fwd",
                        describe, failures, report)


STEM = ((2, 3, 20, 22), (64, 3, 7, 7), dict(padding=3, stride=2))   # solvers 70-72: rn50_conv1, small


def _stem_attempts(failures: list[str], report: list[str]) -> None:
    """Solvers 70-72: every tile variant the H200 probe times, registers and spills."""
    from nnprim.conv import stem
    from nnprim.problems.conv import ConvProblem
    from nnprim.search.random_args import random_args
    x, w, kw = STEM
    kernels = {"fwd": stem._stem_fwd_kernel, "bwd_data": stem._stem_bwd_data_kernel,
               "bwd_weights": stem._stem_bwd_w_kernel}
    for d, kernel in kernels.items():
        p = ConvProblem.create(d, x, w, device="cpu", layout="nhwc", dtype=BF16, **kw)
        for tile in stem.VARIANTS[d]:
            before = {id(ck) for cache in kernel.device_caches.values() for ck in cache[0].values()}
            try:
                stem.plan(p, tile)(random_args(p, seed=0))
            except Exception as e:  # noqa: BLE001 - report every variant that does not compile
                failures.append(f"stem {d} {tile}: {type(e).__name__}: {str(e)[:800]}")
                continue
            for ck in [ck for cache in kernel.device_caches.values() for ck in cache[0].values()
                       if id(ck) not in before]:
                report.append(f"stem {d} {tile} dynamic_smem={ck.metadata.shared} {_cubin_usage(ck)}")


GLUON_WGRAD = [  # (x, w, options) of solver 29 (Gluon backward weights, sm_90 only)
    ((2, 64, 10, 10), (64, 64, 3, 3), dict(padding=1)),                 # BM 64, BN 64: split
    ((2, 256, 14, 14), (128, 256, 3, 3), dict(padding=1, dtype=F16)),   # BM 128, BN 128, 2 warpgroups
    ((1, 128, 7, 7), (256, 128, 1, 1), dict()),                         # 1x1, small image
    ((1, 64, 5, 6), (64, 64, 3, 3), dict(padding=1)),                   # one slice: dw written directly
    ((16, 128, 28, 28), (128, 128, 3, 3), dict(padding=1)),             # split slices + ordered reduce
    ((8, 128, 12, 12), (128, 4, 3, 3), dict(padding=1, groups=32)),     # grouped: block-diagonal tiles
    ((8, 144, 10, 10), (144, 1, 3, 3), dict(padding=1, groups=144)),    # depthwise
    # stride 2: x read per stride phase
    ((4, 128, 28, 28), (128, 128, 3, 3), dict(padding=1, stride=2)),    # rn50_r3_3x3s2's kind
    ((2, 256, 14, 14), (512, 256, 1, 1), dict(stride=2)),               # 1x1 downsample
    ((2, 64, 13, 12), (64, 64, 3, 3), dict(padding=2, dilation=2, stride=(1, 2))),
    ((8, 144, 11, 10), (144, 1, 3, 3), dict(padding=1, groups=144, stride=2)),   # depthwise stride 2
    ((2, 64, 5, 10, 10), (128, 64, 3, 3, 3), dict(padding=1)),          # 3-D (c3d's kind)
    ((2, 32, 6, 9, 9), (32, 32, 3, 3, 3), dict(padding=1, stride=2)),   # 3-D stride 2
    ((2, 320, 20, 21), (320, 320, 3, 3), dict(padding=1)),          # 320 channels: 64 x 64, 128-pixel steps
]


def _gluon_wgrad_attempts(failures: list[str], report: list[str]) -> None:
    """Solver 29: tile, split, registers and spills per problem."""
    from nnprim.conv import gluon_conv_wgrad

    def describe(p, plan) -> str:
        t = plan.tile
        return f"x={p.x_shape} w={p.w_shape} BH={t.BH} BW={t.BW} BM={t.BM} BN={t.BN} STAGES={t.STAGES} split={plan.split}"
    _conv_plan_attempts("gluon_implicit_gemm_bwd_weights", gluon_conv_wgrad, "_gluon_wgrad_kernel", "GluonWgradPlan",
                        GLUON_WGRAD, "bwd_weights", describe, failures, report)

    class _Taps2Plan(gluon_conv_wgrad.GluonWgradPlan):   # two taps a tile (ungrouped)
        def __init__(self, p):
            super().__init__(p, tile=gluon_conv_wgrad.taps2_tile(p))
    t2 = type("t2", (), {"_gluon_wgrad_kernel": gluon_conv_wgrad._gluon_wgrad_kernel, "Plan": _Taps2Plan})
    _conv_plan_attempts("gluon_implicit_gemm_bwd_weights (two taps a tile)", t2, "_gluon_wgrad_kernel", "Plan",
                        [c for c in GLUON_WGRAD if c[2].get("groups", 1) == 1 and c[1][-1] > 1], "bwd_weights",
                        describe, failures, report)

    class _StreamPlan(gluon_conv_wgrad.GluonWgradPlan):   # the stream-K schedule wherever it applies
        def __init__(self, p):
            super().__init__(p, stream=True)
    sk = type("sk", (), {"_gluon_wgrad_sk_kernel": gluon_conv_wgrad._gluon_wgrad_sk_kernel, "Plan": _StreamPlan})
    _conv_plan_attempts("gluon_implicit_gemm_bwd_weights (stream-K)", sk, "_gluon_wgrad_sk_kernel", "Plan",
                        [c for c in GLUON_WGRAD if c[2].get("groups", 1) == 1], "bwd_weights", describe, failures,
                        report)


GLUON_ATTENTION = [  # (consumers, persistent, fields) of solver 126 (Gluon, sm_90 only): d64/d128/d256,
    # causal, GQA, tails; one-tile-per-CTA and persistent launches (SEPARATE_O at d64/d128); one 8-warp
    # consumer or 2 ping-pong warpgroups, or 3 at d64 (192-row tiles, 160 registers a thread)
    (3, True, dict(B=1, Hq=4, Hkv=1, Sq=300, Sk=333, D=64, Dv=64, dtype=BF16, causal="bottom_right",
                   return_lse=True)),
    (3, False, dict(B=1, Hq=4, Hkv=2, Sq=300, Sk=333, D=64, Dv=64, dtype=F16, return_lse=True)),
    (2, False, dict(B=1, Hq=4, Hkv=1, Sq=300, Sk=333, D=64, Dv=64, dtype=BF16, return_lse=True)),
    (2, True, dict(B=1, Hq=4, Hkv=1, Sq=300, Sk=333, D=64, Dv=64, dtype=BF16, causal="bottom_right",
                      return_lse=True)),
    (1, False, dict(B=1, Hq=4, Hkv=2, Sq=300, Sk=333, D=64, Dv=64, dtype=F16, causal="top_left")),
    (1, True, dict(B=1, Hq=4, Hkv=2, Sq=300, Sk=333, D=64, Dv=64, dtype=F16)),
    (2, False, dict(B=1, Hq=8, Hkv=1, Sq=300, Sk=333, D=128, Dv=128, dtype=BF16, return_lse=True)),
    (2, True, dict(B=1, Hq=8, Hkv=1, Sq=300, Sk=333, D=128, Dv=128, dtype=BF16, return_lse=True)),
    (2, False, dict(B=1, Hq=4, Hkv=1, Sq=333, Sk=300, D=128, Dv=128, dtype=BF16, causal="bottom_right",
                       return_lse=True, inf_as_zero=True)),
    (2, True, dict(B=1, Hq=4, Hkv=1, Sq=333, Sk=300, D=128, Dv=128, dtype=BF16, causal="bottom_right",
                      return_lse=True, inf_as_zero=True)),
    (1, False, dict(B=1, Hq=8, Hkv=1, Sq=300, Sk=333, D=128, Dv=128, dtype=BF16, causal="top_left",
                        return_lse=True)),
    (1, True, dict(B=1, Hq=8, Hkv=1, Sq=300, Sk=333, D=128, Dv=128, dtype=F16, causal="top_left",
                       return_lse=True)),
    (1, False, dict(B=1, Hq=2, Hkv=1, Sq=200, Sk=150, D=256, Dv=256, dtype=BF16, causal="top_left")),
    (1, True, dict(B=1, Hq=2, Hkv=1, Sq=200, Sk=150, D=256, Dv=256, dtype=BF16, causal="top_left")),
    (1, True, dict(B=1, Hq=2, Hkv=1, Sq=200, Sk=150, D=256, Dv=256, dtype=BF16, return_lse=True)),
    (2, False, dict(B=1, Hq=2, Hkv=1, Sq=200, Sk=150, D=256, Dv=256, dtype=BF16, return_lse=True)),
    (2, True, dict(B=1, Hq=2, Hkv=1, Sq=200, Sk=150, D=256, Dv=256, dtype=BF16, return_lse=True)),
]


def _gluon_attempts(failures: list[str], report: list[str]) -> None:
    """Compile solver 126's kernel through its launcher (its solver is not applicable without
    a Hopper GPU, so `attempt` would skip it) and report registers, spills and shared memory
    of each compiled variant (cuobjdump of the cubin when Triton ships it)."""
    from nnprim.attention import gluon_fwd
    from nnprim.gluon_support import GLUON_ERROR
    from nnprim.problems.attention import AttentionProblem
    from nnprim.search.random_args import random_args
    if GLUON_ERROR is not None:
        failures.append(f"gluon_flash_fwd: Gluon import failed: {GLUON_ERROR}")
        return
    for consumers, persistent, fields in GLUON_ATTENTION:
        p = AttentionProblem(**(dict(direction="fwd", device="cpu") | fields))
        cfg = gluon_fwd.tile_config(p.D, consumers > 1, persistent, consumers=consumers if consumers > 1 else None)
        try:
            gluon_fwd.gluon_forward(p, random_args(p, seed=0), cfg=cfg)
        except Exception as e:  # noqa: BLE001 - report every variant that does not compile
            failures.append(f"gluon_flash_fwd on {p.key()}: {type(e).__name__}: {str(e)[:800]}")
    _report_variants("gluon_flash_fwd", gluon_fwd._gluon_fwd_kernel, report)


GLUON_BWD = [  # (split dQ, or a gluon_bwd.CONFIGS name; fields) of solver 127
    # (Gluon, sm_90 only): d64/d128, causal both ways and not, GQA, tails; d128 with dQ split by columns
    # between the warpgroups (the default) and per warpgroup; the descriptors hoisted (REMAT off)
    (False, dict(B=1, Hq=4, Hkv=1, Sq=300, Sk=333, D=64, Dv=64, dtype=BF16)),
    (False, dict(B=1, Hq=4, Hkv=2, Sq=333, Sk=300, D=64, Dv=64, dtype=F16, causal="bottom_right")),
    (True, dict(B=1, Hq=4, Hkv=1, Sq=300, Sk=333, D=128, Dv=128, dtype=BF16)),
    (True, dict(B=1, Hq=4, Hkv=1, Sq=300, Sk=333, D=128, Dv=128, dtype=BF16, causal="top_left")),
    (True, dict(B=1, Hq=2, Hkv=2, Sq=333, Sk=300, D=128, Dv=128, dtype=F16, causal="bottom_right")),
    (False, dict(B=1, Hq=4, Hkv=1, Sq=300, Sk=333, D=128, Dv=128, dtype=BF16)),
    (False, dict(B=1, Hq=4, Hkv=1, Sq=300, Sk=333, D=128, Dv=128, dtype=BF16, causal="top_left")),
    ("s3", dict(B=1, Hq=4, Hkv=1, Sq=300, Sk=333, D=128, Dv=128, dtype=BF16, causal="top_left")),  # 3 stages
    ("hoisted", dict(B=1, Hq=4, Hkv=1, Sq=300, Sk=333, D=128, Dv=128, dtype=BF16, causal="top_left")),  # REMAT off
    # dQ by f32 atomics instead of TMA reduce-adds: split columns (d128), per warpgroup (d64, d128)
    ("atomic", dict(B=1, Hq=4, Hkv=1, Sq=300, Sk=333, D=128, Dv=128, dtype=BF16, causal="top_left")),
    ("atomic", dict(B=1, Hq=4, Hkv=2, Sq=333, Sk=300, D=64, Dv=64, dtype=F16, causal="bottom_right")),
    ("wg_dq_atomic", dict(B=1, Hq=4, Hkv=1, Sq=300, Sk=333, D=128, Dv=128, dtype=BF16)),
    # solver 129: the reduce-adds in key-block order (semaphores)
    ("ordered", dict(B=1, Hq=4, Hkv=1, Sq=300, Sk=333, D=128, Dv=128, dtype=BF16, causal="bottom_right")),
    ("ordered", dict(B=1, Hq=4, Hkv=2, Sq=333, Sk=300, D=64, Dv=64, dtype=F16, causal="top_left")),
    # without causal masking: the rotated walk, with the ordered adds passed on at the next step
    # or at once, and 127's rotated walk
    ("ordered", dict(B=1, Hq=4, Hkv=1, Sq=300, Sk=333, D=128, Dv=128, dtype=BF16)),
    ("ordered", dict(B=1, Hq=4, Hkv=2, Sq=333, Sk=300, D=64, Dv=64, dtype=F16)),
    ("ordered_eager", dict(B=1, Hq=4, Hkv=1, Sq=300, Sk=333, D=128, Dv=128, dtype=BF16)),
    ("ordered_fixed", dict(B=1, Hq=4, Hkv=1, Sq=300, Sk=333, D=128, Dv=128, dtype=BF16)),
    ("rotate", dict(B=1, Hq=4, Hkv=2, Sq=333, Sk=300, D=64, Dv=64, dtype=F16)),
    # solver 129's default puts the ordered adds in a writer warp; the consumers' own ordered adds
    # (the sixteenth session's 129) and 127 with the writer
    ("ordered_inline", dict(B=1, Hq=4, Hkv=1, Sq=300, Sk=333, D=128, Dv=128, dtype=BF16)),
    ("writer", dict(B=1, Hq=4, Hkv=2, Sq=333, Sk=300, D=64, Dv=64, dtype=F16, causal="bottom_right")),
]


def _gluon_bwd_attempts(failures: list[str], report: list[str]) -> None:
    """Compile solver 127's main kernel (and 123's preprocess / cast) through its plan and
    report registers, spills and shared memory of each compiled variant."""
    from nnprim.attention import gluon_bwd
    from nnprim.gluon_support import GLUON_ERROR
    from nnprim.problems.attention import AttentionProblem
    from nnprim.search.random_args import random_args
    if GLUON_ERROR is not None:
        failures.append(f"gluon_flash_bwd: Gluon import failed: {GLUON_ERROR}")
        return
    for split, fields in GLUON_BWD:
        p = AttentionProblem(**(dict(direction="bwd", device="cpu", return_lse=True) | fields))
        try:
            if isinstance(split, str):
                cfg = gluon_bwd.CONFIGS[split](p.D)
            else:
                cfg = gluon_bwd.tile_config(p.D, split)
            gluon_bwd.GluonBwdPlan(p, cfg)(random_args(p, seed=0))
        except Exception as e:  # noqa: BLE001 - report every variant that does not compile
            failures.append(f"gluon_flash_bwd on {p.key()}: {type(e).__name__}: {str(e)[:1500]}")
    _report_variants("gluon_flash_bwd", gluon_bwd._gluon_bwd_kernel, report)


GLUON_BWD_D256 = [  # (a gluon_bwd_d256.CONFIGS name; fields) of solver 130 (Gluon, sm_90 only): both
    # causal alignments, GQA, tails, f16 (each compile ~30 s on CI's CPU: the other variants run in
    # tests/gpu and benchmarks/diag/gluon_bwd_regs.py --dims 256)
    ("default", dict(B=1, Hq=4, Hkv=1, Sq=300, Sk=333, D=256, Dv=256, dtype=BF16, causal="top_left")),
    ("default", dict(B=1, Hq=4, Hkv=2, Sq=333, Sk=300, D=256, Dv=256, dtype=F16, causal="bottom_right")),
    # deterministic: the ordered adds by the writer warp, with the rotated walk (no causal mask, Sq = Sk)
    ("ordered", dict(B=1, Hq=4, Hkv=1, Sq=640, Sk=640, D=256, Dv=256, dtype=BF16)),
]


def _gluon_bwd_d256_attempts(failures: list[str], report: list[str]) -> None:
    """Compile solver 130's main kernel through its plan; registers, spills and shared memory
    of each compiled variant ('gluon_flash_bwd_d256 ...' lines)."""
    from nnprim.attention import gluon_bwd_d256
    from nnprim.gluon_support import GLUON_ERROR
    from nnprim.problems.attention import AttentionProblem
    from nnprim.search.random_args import random_args
    if GLUON_ERROR is not None:
        failures.append(f"gluon_flash_bwd_d256: Gluon import failed: {GLUON_ERROR}")
        return
    for name, fields in GLUON_BWD_D256:
        p = AttentionProblem(**(dict(direction="bwd", device="cpu", return_lse=True) | fields))
        try:
            gluon_bwd_d256.GluonBwdD256Plan(p, gluon_bwd_d256.CONFIGS[name]())(random_args(p, seed=0))
        except Exception as e:  # noqa: BLE001 - report every variant that does not compile
            failures.append(f"gluon_flash_bwd_d256 on {p.key()}: {type(e).__name__}: {str(e)[:1500]}")
    _report_variants("gluon_flash_bwd_d256", gluon_bwd_d256._gluon_bwd_d256_kernel, report)


GLUON_DECODE_Q4 = [  # solver 133 (Gluon, sm_90 only): (K/V signature, D, q dtype, Sq, causal, page size);
    # paged caches and page size -1 (contiguous) with kv_lens: chunks shared by length (BALANCED)
    (("s4", 64, "g", "bfloat16", "g", 1), 128, BF16, 1, None, 0),
    (("s4", 64, "g", "bfloat16", None, 1), 128, BF16, 1, None, -1),
    (("u4", 64, "g", "bfloat16", "g", 1), 128, BF16, 1, None, -1),
    (("u4", 32, "g", "float16", None, 0), 128, F16, 2, "bottom_right", 0),
    (("s4", 64, "h", "float32", None, 1), 64, BF16, 1, None, 0),
    (("u4", 64, "g", "bfloat16", "g", 1), 128, BF16, 1, None, 64),     # a page per key block
    (("s4", 32, "g", "bfloat16", None, 1), 128, BF16, 1, None, 16),    # two pages per key block
    (("s4", 128, "g", "bfloat16", "g", 1), 128, BF16, 1, None, 48),   # a page per row
]


def _gluon_decode_q4_attempts(failures: list[str], report: list[str]) -> None:
    """Compile solver 133's kernel through its plan; registers and spills of each variant."""
    from nnprim.attention import gluon_decode_quant as q4
    from nnprim.gluon_support import GLUON_ERROR
    from nnprim.problems.attention import AttentionProblem
    from nnprim.search.random_args import random_args
    if GLUON_ERROR is not None:
        failures.append(f"gluon_decode_q4: Gluon import failed: {GLUON_ERROR}")
        return
    for sig, d, dt, sq, causal, page in GLUON_DECODE_Q4:
        p = AttentionProblem(direction="fwd", device="cpu", B=2, Hq=8, Hkv=2, Sq=sq, Sk=3072 if page > 0 else 3000,
                             D=d, Dv=d, dtype=dt, causal=causal, k_quant=sig, v_quant=sig, page_size=max(page, 0),
                             has_kv_lens=page != 0)
        # paged: also the int64 offsets of pools past 2^31 elements (too big to allocate here)
        # with kv_lens also the even split (Q4Config.balanced off; on by default)
        for fits, bal in [(f, b) for f in ((True, False) if page == 64 else (True,)) for b in {False, page != 0}]:
            real, real_cfg = q4.pools_fit_int32, q4.default_config
            try:
                q4.pools_fit_int32 = lambda *a, fits=fits: fits
                q4.default_config = lambda pr, bal=bal, real_cfg=real_cfg: replace(real_cfg(pr), balanced=bal)
                q4.GluonDecodeQ4().prepare(p)(random_args(p, seed=0))
            except Exception as e:  # noqa: BLE001 - report every variant that does not compile
                failures.append(f"gluon_decode_q4 on {p.key()}: {type(e).__name__}: {str(e)[:1500]}")
            finally:
                q4.pools_fit_int32, q4.default_config = real, real_cfg
    _report_variants("gluon_decode_q4", q4._gluon_decode_q4_kernel, report)


def install_compile_only(arch: int = 90, calls: dict[str, int] | None = None) -> list[str]:
    """Make every Triton launch in this process a compile-only warm-up for `arch`; returns
    the list the names of compiled kernels are appended to (and records in `calls`, when
    given, each kernel's largest `ptx_calls`)."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    class StubDriver:
        def get_current_device(self) -> int:
            return 0

        def get_current_stream(self, device=None) -> int:
            return 0

        def get_current_target(self):
            return GPUTarget("cuda", arch, 32)

    driver.set_active(StubDriver())
    run, names = JITFunction.run, []

    def compile_only(self, *args, grid, warmup, **kwargs):
        ck = run(self, *args, grid=grid, warmup=True, **kwargs)
        names.append(self.fn.__name__)
        if calls is not None and ck is not None:
            calls[self.fn.__name__] = max(calls.get(self.fn.__name__, 0), ptx_calls(ck))
        return None            # no compiled kernel: planned launches never take their fast path
    JITFunction.run = compile_only
    return names


def main() -> int:
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        print("unset TRITON_INTERPRET: the kernels must be compiled, not interpreted")
        return 2
    calls: dict[str, int] = {}
    names = install_compile_only(calls=calls)
    from nnprim.problems.attention import AttentionProblem
    from nnprim.problems.conv import ConvProblem
    from nnprim.search.random_args import random_args
    from nnprim.search.solver import REGISTRY

    t0, failures = time.time(), []

    def attempt(solver, p) -> None:
        if solver.not_supported_reasons(replace(p, device="cuda")):
            return
        try:
            solver.prepare(p)(random_args(p, seed=0))     # CPU tensors; GPU-only paths stay planned
        except Exception as e:  # noqa: BLE001 - report every kernel that does not compile
            failures.append(f"{solver.name} on {p.key()}: {type(e).__name__}: {str(e)[:500]}")

    for d, x, w, kw in CONV:
        p = ConvProblem.create(d, x, w, device="cpu", **kw)
        for s in REGISTRY.for_problem(p):
            if s.uses_triton and s.family in ("implicit_gemm", "gemm", "direct"):
                attempt(s, p)
    for name, fields in ATTENTION:
        attempt(REGISTRY.get(name), AttentionProblem(**(dict(direction="fwd", device="cpu") | fields)))
    _fp8_attempts(attempt)
    gluon_report: list[str] = []
    _gluon_attempts(failures, gluon_report)
    _gluon_bwd_attempts(failures, gluon_report)
    _gluon_bwd_d256_attempts(failures, gluon_report)
    _gluon_decode_q4_attempts(failures, gluon_report)
    _gluon_conv_attempts(failures, gluon_report)
    _gluon_wgrad_attempts(failures, gluon_report)
    _stem_attempts(failures, gluon_report)
    print(f"compiled {len(set(names))} kernels ({len(names)} launches) for sm_90 in {time.time() - t0:.0f} s: "
          + ", ".join(sorted(set(names))))
    for line in gluon_report:
        print(line)
    print("subroutine calls (ptx_calls) in: " + (", ".join(f"{k}={v}" for k, v in sorted(calls.items()) if v)
                                                 or "none"))
    for f in failures:
        print("FAILED", f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
