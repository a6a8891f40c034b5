"""Random-problem fuzzing of every solver through the public API (issue 11).

A `Case` is one valid problem: a `ConvSpec` (1D/2D/3D, a direction, groups/depthwise,
stride, dilation, asymmetric padding, NCHW/NHWC, f32/f16/bf16, bias, post-ops) or an
`AttnSpec` (forward or backward, GQA/MQA, masks, both causal alignments, Sk = 1,
Sq >> Sk, kv_lens, dropout, quantized K/V for decode). `random_cases(seed, count, scale)`
draws them from a seeded generator ("gpu" sizes or tiny "cpu" ones); `special_cases(scale)`
adds the huge and degenerate ones (2**31-element outputs, the long causal depthwise
conv1d of issue 11, 1x1 images, filters as long as the input, batch 1 with 65536
channels, a 2**31-element K/V cache seen through a permuted view, B*Hq beyond grid axis
1, long decode caches with many splits). `suite(scale, subset)` is what the tests run:
subset "all", "small" (no huge case), "huge", or "sanitizer" (about twenty small and
medium problems for compute-sanitizer, which runs kernels 10-100x slower).

`run_case(case, device)` makes the tensors, forces every applicable solver in turn through
the public API (`solver=name`; the float64 reference solvers only on small problems),
then makes the default call, and checks each result: no exception (NotSupportedError
from a forced solver is recorded "refused", not a failure; the default call must
succeed), no NaN or inf where float64 has none, relative norm error within
`tolerance`. The float64 reference is computed whole, or, for `Case.sample` (huge)
problems, on a few images and channels (conv) or batch entries and KV heads (attention)
sliced out and recomputed from first principles, the last image / channel / head always
among them (the largest offsets).

Run through pytest (tests/gpu/test_fuzz.py, tests/test_fuzz_cpu.py) or as
`python -m nnprim.testing.fuzz run --device cuda [--subset S] [--shard i/n] [--log F]`;
`python -m nnprim.testing.fuzz summary LOG...` totals JSON-lines logs (one line per
case) and lists the failures."""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, replace

import torch

import nnprim
from nnprim.args import AttnArgs
from nnprim.attention.reference import reference_backward, reference_forward
from nnprim.conv import reference as conv_ref
from nnprim.errors import NotSupportedError
from nnprim.paged import to_pages
from nnprim.post_ops import Binary, Eltwise, PostOp, Sum
from nnprim.problems.attention import AttentionProblem
from nnprim.problems.conv import ConvProblem, empty_in_layout, layout_of
from nnprim.quant import KVQuant
from nnprim.search.random_args import _kv_quant
from nnprim.search.solver import REGISTRY

DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
# relative norm error allowed (the contract's); f32 grows with the reduction length
TOL = {"f32": 1e-5, "f16": 1e-2, "bf16": 1e-2}
BWD_TOL = {"f32": 1e-5, "f16": 1e-2, "bf16": 2e-2}
# eltwise kinds that stay finite on any input (sqrt/log/exp may give NaN or inf)
SAFE_ELTWISE = {"relu": (0.1, 0.0), "gelu_tanh": (0, 0), "gelu_erf": (0, 0), "silu": (0, 0), "sigmoid": (0, 0),
                "tanh": (0, 0), "elu": (1.0, 0.0), "clip": (-1.0, 1.0), "linear": (0.5, 0.25), "square": (0, 0),
                "abs": (0, 0), "hardswish": (0, 0), "mish": (0, 0)}
BINARY_OPS = ("add", "sub", "mul", "div", "max", "min")
FAILED = ("wrong", "nan", "error", "oom", "fault")


# ---- problem specs ------------------------------------------------------------------------
@dataclass(frozen=True)
class ConvSpec:
    direction: str
    x_shape: tuple[int, ...]
    w_shape: tuple[int, ...]
    stride: tuple[int, ...]
    padding: tuple[tuple[int, int], ...]
    dilation: tuple[int, ...]
    groups: int
    layout: str                       # "nchw" | "nhwc"
    dtype: str                        # key of DTYPES
    out_dtype: str | None = None
    bias: bool = False
    post_ops: tuple = ()              # ("sum", scale) | ("eltwise", kind) | ("binary", op, "scalar"|"channel"|"full")

    def problem(self, device: str) -> ConvProblem:
        """The spec as a ConvProblem (shapes and options; `api_conv_problem` gives the one the
        public API builds from the tensors, whose layout is what torch reports)."""
        base = ConvProblem.create(self.direction, self.x_shape, self.w_shape, dtype=DTYPES[self.dtype],
                                  layout=self.layout, device=device, stride=self.stride, padding=self.padding,
                                  dilation=self.dilation, groups=self.groups,
                                  out_dtype=DTYPES[self.out_dtype] if self.out_dtype else None,
                                  has_bias=self.bias)
        sigs = tuple(_post_op(op, base.y_shape, None).signature() for op in self.post_ops)
        return replace(base, post_ops=sigs)

    def reduction(self) -> int:
        """Terms of the sum behind one output element (scales the f32 tolerance)."""
        taps = math.prod(self.w_shape[2:])
        if self.direction == "fwd":
            return self.w_shape[1] * taps
        if self.direction == "bwd_data":
            return self.w_shape[0] // self.groups * taps
        p = self.problem("cpu")
        return p.N * math.prod(p.out_size)


@dataclass(frozen=True)
class AttnSpec:
    direction: str                    # "fwd" | "bwd"
    B: int
    Hq: int
    Hkv: int
    Sq: int
    Sk: int
    D: int
    Dv: int
    dtype: str
    causal: str | None = None
    mask: str = "none"                # "none" | "bool" | "additive"
    mask_shape: tuple[int, ...] = ()  # 4 dims, 1 = broadcast
    scale: str = "default"            # "default" | "float" | "tensor"
    invert_scale: bool = False
    dropout_p: float = 0.0
    kv_lens: bool = False
    inf_as_zero: bool = False
    return_lse: bool = False
    k_quant: tuple | None = None      # KVQuant.signature(): (dtype, group, "t"|"g", scale dtype, None|"t"|"g")
    v_quant: tuple | None = None
    kv_layout: str = "bhsd"           # "bshd": K/V stored (B, Sk, H, D), passed as a permuted view
    page_size: int = 0                # > 0: K/V as shuffled page pools (nnprim.paged) with a block table

    def reduction(self) -> int:
        return self.Sk if self.direction == "fwd" else self.Sk + self.Sq * (self.Hq // self.Hkv)


@dataclass(frozen=True)
class Case:
    name: str
    spec: ConvSpec | AttnSpec
    tags: frozenset = frozenset()     # "random" | "huge" | "degenerate", plus "sanitizer"
    sample: bool = False              # compare a sampled subset in float64 (huge problems)
    seed: int = 0

    @property
    def kind(self) -> str:
        return "conv" if isinstance(self.spec, ConvSpec) else "attention"

    def nbytes(self) -> int:
        """Bytes of the case's own tensors (inputs and outputs; workspaces and references
        not included): keeps the huge cases sized for the GPU."""
        s = self.spec
        e = DTYPES[s.dtype].itemsize
        if isinstance(s, ConvSpec):
            p = s.problem("cpu")
            return e * (2 * math.prod(p.x_shape) + 2 * math.prod(p.y_shape) + 2 * math.prod(p.w_shape))
        q = s.B * s.Hq * s.Sq * (s.D + 2 * s.Dv)
        kv = s.B * s.Hkv * s.Sk * (s.D + s.Dv)
        return e * ((2 * q + 2 * kv) if s.direction == "bwd" else (q + kv))


def _post_op(op: tuple, y_shape: tuple[int, ...], make: Callable | None) -> PostOp:
    """The PostOp of a spec entry; `make(shape, kind)` gives its tensor ("sum", "binary",
    "div": kept away from zero), or a meta tensor when None (signatures only)."""
    def tensor(shape, kind):
        return torch.empty(shape, device="meta") if make is None else make(shape, kind)

    nd = len(y_shape)
    if op[0] == "sum":
        return Sum(tensor(y_shape, "sum"), op[1])
    if op[0] == "eltwise":
        a, b = SAFE_ELTWISE[op[1]]
        return Eltwise(op[1], a, b)
    shape = {"scalar": (1,) * nd, "channel": (1, y_shape[1]) + (1,) * (nd - 2), "full": tuple(y_shape)}[op[2]]
    return Binary(op[1], tensor(shape, "div" if op[1] == "div" else "binary"))


# ---- random problems ------------------------------------------------------------------------
def _conv_dims(rng: random.Random, nd: int, cpu: bool):
    """Per spatial dim: (input size, filter, stride, dilation, (pad before, pad after)),
    valid (output size >= 1)."""
    max_in = {1: 24 if cpu else 160, 2: 7 if cpu else 24, 3: 4 if cpu else 8}[nd]
    out = []
    for _ in range(nd):
        f = rng.choice((1, 2, 3, 3, 5) if nd < 3 else (1, 2, 3))
        st = rng.choice((1, 1, 1, 2, 3))
        dl = rng.choice((1, 1, 2))
        reach = dl * (f - 1)
        pads = (0, 0) if rng.random() < 0.3 else (rng.randint(0, reach), rng.randint(0, reach))
        lo = max(1, reach + 1 - pads[0] - pads[1])
        out.append((rng.randint(lo, max(lo, max_in)), f, st, dl, pads))
    return out


def random_conv(rng: random.Random, cpu: bool) -> ConvSpec:
    nd = rng.choice((1, 2, 2, 3))
    direction = rng.choice(("fwd", "fwd", "bwd_data", "bwd_weights"))
    dtype = rng.choice(("f32", "f16", "bf16"))
    mode = rng.choice(("dense", "dense", "grouped", "depthwise"))
    if mode == "depthwise":
        groups, cg, kg = rng.choice((2, 3, 8) if cpu else (4, 16, 32, 96)), 1, rng.choice((1, 1, 2))
    elif mode == "grouped":
        groups = rng.choice((2, 3, 4))
        cg, kg = (rng.choice((1, 2, 3, 5) if cpu else (2, 4, 8, 16, 24)) for _ in range(2))
    else:
        groups = 1
        cg = rng.choice((1, 2, 3, 5, 8) if cpu else (1, 3, 8, 16, 32, 64, 96))
        kg = rng.choice((1, 2, 4, 7) if cpu else (1, 8, 16, 40, 64, 128))
    N = rng.choice((1, 2) if cpu else (1, 2, 3, 4))
    dims = _conv_dims(rng, nd, cpu)
    out_dtype = None
    if direction == "fwd" and dtype != "f32" and rng.random() < 0.3:
        out_dtype = "f32"
    elif direction == "fwd" and dtype == "f32" and rng.random() < 0.1:
        out_dtype = rng.choice(("f16", "bf16"))
    elif direction != "fwd" and dtype != "f32" and rng.random() < 0.2:
        out_dtype = "f32"
    bias, ops = False, ()
    if direction == "fwd":
        bias = rng.random() < 0.5
        n_ops = rng.choice((0, 0, 0, 1, 2, 3, 4)) if rng.random() > 0.05 else 5   # 5: beyond the GPU epilogue
        ops = tuple(_random_post_op(rng) for _ in range(n_ops))
    return ConvSpec(direction, (N, cg * groups, *(d[0] for d in dims)), (kg * groups, cg, *(d[1] for d in dims)),
                    tuple(d[2] for d in dims), tuple(d[4] for d in dims), tuple(d[3] for d in dims), groups,
                    rng.choice(("nchw", "nhwc")), dtype, out_dtype, bias, ops)


def _random_post_op(rng: random.Random) -> tuple:
    kind = rng.choice(("sum", "eltwise", "eltwise", "binary"))
    if kind == "sum":
        return ("sum", rng.choice((1.0, 0.5, -1.0)))
    if kind == "eltwise":
        return ("eltwise", rng.choice(sorted(SAFE_ELTWISE)))
    return ("binary", rng.choice(BINARY_OPS), rng.choice(("scalar", "channel", "full")))


def random_attention(rng: random.Random, cpu: bool) -> AttnSpec:
    direction = rng.choice(("fwd", "fwd", "bwd"))
    dtype = rng.choice(("f32", "f16", "bf16"))
    B = rng.choice((1, 2) if cpu else (1, 2, 3))
    Hkv = rng.choice((1, 2) if cpu else (1, 2, 3))
    Hq = Hkv * rng.choice((1, 2, 3) if cpu else (1, 2, 4))
    D = rng.choice((8, 16, 24) if cpu else (16, 32, 40, 64, 72, 128, 128, 256))
    Dv = D if rng.random() < 0.8 else rng.choice((8, 16, 20) if cpu else (16, 64, 96, 128))
    regime = rng.choice(("decode", "square", "tall", "sk1"))
    if regime == "decode":
        Sq, Sk = rng.randint(1, 4 if cpu else 16), rng.randint(1, 64 if cpu else 3000)
    elif regime == "square":
        Sq, Sk = rng.randint(1, 40 if cpu else 300), rng.randint(1, 40 if cpu else 300)
    elif regime == "tall":     # Sq >> Sk
        Sq, Sk = rng.randint(24, 48) if cpu else rng.randint(200, 1200), rng.randint(1, 8)
    else:
        Sq, Sk = rng.randint(1, 40 if cpu else 300), 1
    mask = rng.choice(("none", "none", "none", "bool", "additive"))
    full = (B, Hq, Sq, Sk)
    mask_shape = tuple(n if rng.random() < 0.5 else 1 for n in full) if mask != "none" else ()
    scale = rng.choice(("default", "float", "tensor"))
    k_quant = v_quant = None
    if direction == "fwd" and Sq <= 16 and rng.random() < 0.35:
        which = rng.choice(("k", "v", "kv"))
        k_quant = _random_quant(rng, D) if "k" in which else None
        v_quant = _random_quant(rng, Dv) if "v" in which else None
    dropout_p = rng.choice((0.1, 0.25)) if rng.random() < 0.12 else 0.0
    # paged caches serve inference: forward only, kv_lens required (DESIGN.md, paged K/V)
    paged = direction == "fwd" and not dropout_p and rng.random() < 0.25
    page_size = rng.choice((1, 3, 8, 16, 16, 64, 256) if not cpu else (1, 3, 4, 8, 16)) if paged else 0
    return AttnSpec(direction, B, Hq, Hkv, Sq, Sk, D, Dv, dtype,
                    causal=rng.choice((None, None, "top_left", "bottom_right")), mask=mask, mask_shape=mask_shape,
                    scale=scale, invert_scale=scale != "default" and rng.random() < 0.3, dropout_p=dropout_p,
                    kv_lens=paged or rng.random() < 0.25, inf_as_zero=rng.random() < 0.3,
                    return_lse=direction == "fwd" and rng.random() < 0.5, k_quant=k_quant, v_quant=v_quant,
                    page_size=page_size)


def _random_quant(rng: random.Random, d: int) -> tuple:
    """A KVQuant signature valid for head dim d."""
    qd = rng.choice(("s8", "u8", "s4", "u4") if d % 2 == 0 else ("s8", "u8"))
    step = 2 if qd in ("s4", "u4") else 1
    groups = [g for g in (d, 32, 64, 16, 8) if d % g == 0 and g % step == 0]
    return (qd, rng.choice(groups), rng.choice(("t", "g")), rng.choice(("float16", "bfloat16", "float32")),
            rng.choice((None, None, "t", "g")))


def random_cases(seed: int, count: int, scale: str = "gpu") -> list[Case]:
    """`count` random valid problems (about 55% convolutions) from a seeded generator."""
    rng = random.Random(seed)
    cpu = scale == "cpu"
    out = []
    for i in range(count):
        if rng.random() < 0.55:
            spec = random_conv(rng, cpu)
        else:
            spec = random_attention(rng, cpu)
        out.append(Case(f"r{i:03d}-{describe(spec)}", spec, frozenset({"random"}), seed=seed * 100003 + i))
    return out


def describe(spec: ConvSpec | AttnSpec) -> str:
    """A short readable id of a spec (for test ids and logs)."""
    if isinstance(spec, ConvSpec):
        g = f"g{spec.groups}" if spec.groups > 1 else ""
        return (f"conv{len(spec.x_shape) - 2}d-{spec.direction}-x{'x'.join(map(str, spec.x_shape))}"
                f"-w{'x'.join(map(str, spec.w_shape))}{g}-{spec.layout}-{spec.dtype}")
    q = "-q" if spec.k_quant or spec.v_quant else ""
    pg = f"-p{spec.page_size}" if spec.page_size else ""
    return (f"attn-{spec.direction}-b{spec.B}h{spec.Hq}kv{spec.Hkv}-sq{spec.Sq}sk{spec.Sk}-d{spec.D}"
            f"{'' if spec.Dv == spec.D else f'v{spec.Dv}'}-{spec.dtype}{q}{pg}")


# ---- huge and degenerate problems ----------------------------------------------------------
def _conv(direction, x, w, *, pad=0, stride=1, dilation=1, groups=1, layout="nchw", dtype="f32", **kw) -> ConvSpec:
    nd = len(x) - 2
    pads = tuple(pad) if isinstance(pad, tuple) else ((pad, pad),) * nd
    return ConvSpec(direction, tuple(x), tuple(w), (stride,) * nd, pads, (dilation,) * nd, groups, layout, dtype, **kw)


def special_cases(scale: str = "gpu") -> list[Case]:
    """The huge and degenerate problems; "cpu" gives tiny versions of the degenerate ones
    (and small sampled ones, which exercise the sampled reference)."""
    cases: list[Case] = []

    def add(name, spec, *tags, sample=False):
        cases.append(Case(name, spec, frozenset(tags), sample=sample, seed=len(cases) + 7))

    dirs = ("fwd", "bwd_data", "bwd_weights")
    if scale == "cpu":
        for d in dirs:
            add(f"cpu-long-causal-dw-{d}", _conv(d, (2, 4, 33), (4, 1, 33), pad=((32, 0),), groups=4, dtype="bf16"),
                "degenerate", sample=True)
            add(f"cpu-dw64-b1-{d}", _conv(d, (1, 64, 5), (64, 1, 3), pad=1, groups=64, layout="nhwc", dtype="f16"),
                "degenerate")
        add("cpu-1x1img-3x3", _conv("fwd", (2, 4, 1, 1), (3, 4, 3, 3), pad=1, dtype="f32"), "degenerate")
        add("cpu-1x1img-1x1", _conv("bwd_weights", (2, 4, 1, 1), (3, 4, 1, 1), layout="nhwc", dtype="bf16"),
            "degenerate")
        add("cpu-filter-eq-input-1d", _conv("bwd_data", (2, 3, 9), (2, 3, 9), dtype="f32"), "degenerate")
        add("cpu-filter-eq-input-2d", _conv("fwd", (1, 2, 4, 4), (3, 2, 4, 4), layout="nhwc", dtype="bf16"),
            "degenerate")
        add("cpu-attn-sampled-fwd", AttnSpec("fwd", 2, 4, 2, 9, 13, 16, 16, "f32", causal="bottom_right",
                                             mask="bool", mask_shape=(2, 1, 9, 13), return_lse=True),
            "degenerate", sample=True)
        add("cpu-attn-sampled-bwd", AttnSpec("bwd", 2, 4, 2, 21, 5, 8, 8, "bf16", causal="top_left", kv_lens=True,
                                             inf_as_zero=True), "degenerate", sample=True)
        add("cpu-attn-bshd-sk1", AttnSpec("fwd", 1, 2, 1, 3, 1, 16, 16, "f16", kv_layout="bshd"), "degenerate")
        add("cpu-decode-quant", AttnSpec("fwd", 2, 4, 2, 2, 70, 32, 16, "bf16", causal="bottom_right", kv_lens=True,
                                         k_quant=("s4", 16, "g", "float16", "g"), v_quant=("u8", 16, "t", "float32", "t"),
                                         return_lse=True), "degenerate")
        add("cpu-attn-dropout-bwd", AttnSpec("bwd", 1, 2, 1, 17, 23, 16, 16, "f32", mask="additive",
                                             mask_shape=(1, 2, 17, 23), dropout_p=0.25), "degenerate")
        return cases

    # the problem of issue 11: long causal depthwise conv1d (filter as long as the input)
    for d in dirs:
        add(f"long-causal-dw-conv1d-{d}", _conv(d, (8, 768, 8192), (768, 1, 8192), pad=((8191, 0),), groups=768,
                                                dtype="bf16"), "huge", sample=True)
    # attention: 2**31-element q/o with Sq >> Sk; a 2**31-element K/V cache per tensor through a
    # permuted (B, Sk, H, D) view; long caches (many splits); B*Hq beyond grid axis 1
    add("attn-sq131072-sk64-2^31-fwd", AttnSpec("fwd", 2, 64, 8, 131072, 64, 128, 128, "bf16", causal="top_left",
                                                return_lse=True), "huge", sample=True)
    add("attn-sq131072-sk64-2^31-bwd", AttnSpec("bwd", 2, 64, 8, 131072, 64, 128, 128, "bf16",
                                                causal="bottom_right", inf_as_zero=True), "huge", sample=True)
    add("attn-kv-2^31-bshd-decode", AttnSpec("fwd", 1, 32, 16, 1, 2 ** 20, 128, 128, "bf16", kv_layout="bshd"),
        "huge", sample=True)
    # 2**31-element outputs / inputs (int64 image bases; im2col blocks inside one image)
    for d in dirs:
        add(f"conv2d-2^31-nhwc-bf16-{d}", _conv(d, (32, 64, 1024, 1024), (64, 64, 3, 3), pad=1, layout="nhwc",
                                                dtype="bf16"), "huge", sample=True)
    add("conv2d-2^31-nchw-f16-fwd", _conv("fwd", (8, 16, 4096, 4096), (16, 16, 3, 3), pad=1, dtype="f16", bias=True,
                                           post_ops=(("eltwise", "relu"),)), "huge", sample=True)
    # batch 1 with 65536 channels (groups beyond a grid axis), 1x1 images, filters as long as the input
    for d in dirs:
        add(f"dw65536-b1-nhwc-bf16-{d}", _conv(d, (1, 65536, 8, 8), (65536, 1, 3, 3), pad=1, groups=65536,
                                               layout="nhwc", dtype="bf16"), "degenerate")
        add(f"dw65536-b1-nchw-f32-{d}", _conv(d, (1, 65536, 9), (65536, 1, 3), pad=1, groups=65536), "degenerate")
        add(f"1x1img-1x1-nhwc-bf16-{d}", _conv(d, (4, 32, 1, 1), (48, 32, 1, 1), layout="nhwc", dtype="bf16"),
            "degenerate")
        add(f"1x1img-3x3-nchw-f32-{d}", _conv(d, (4, 32, 1, 1), (48, 32, 3, 3), pad=1), "degenerate")
        add(f"filter-eq-input-1d-f32-{d}", _conv(d, (2, 8, 257), (8, 8, 257)), "degenerate")
    add("dense-c65536-b1-f16-fwd", _conv("fwd", (1, 65536, 2, 2), (16, 65536, 1, 1), layout="nhwc", dtype="f16"),
        "degenerate")
    add("dense-c65536-b1-f16-bwd_weights", _conv("bwd_weights", (1, 65536, 2, 2), (16, 65536, 1, 1), layout="nhwc",
                                                  dtype="f16"), "degenerate")
    add("filter-eq-input-2d-bf16-fwd", _conv("fwd", (2, 4, 7, 7), (6, 4, 7, 7), layout="nhwc", dtype="bf16"),
        "degenerate")
    add("filter-eq-input-3d-f16-bwd_data", _conv("bwd_data", (1, 2, 5, 5, 5), (3, 2, 5, 5, 5), dtype="f16"),
        "degenerate")
    add("attn-decode-sk512k-b1", AttnSpec("fwd", 1, 8, 1, 1, 2 ** 19, 128, 128, "bf16"), "degenerate")
    add("attn-decode-sk256k-d256", AttnSpec("fwd", 1, 4, 1, 2, 2 ** 18, 256, 256, "f16", causal="bottom_right",
                                            return_lse=True), "degenerate")
    for d in ("fwd", "bwd"):
        add(f"attn-bhq-131072-{d}", AttnSpec(d, 1024, 128, 64, 4, 8, 16, 16, "f16"), "degenerate")
        add(f"attn-sk1-sq2048-{d}", AttnSpec(d, 2, 8, 2, 2048, 1, 64, 64, "bf16", causal="bottom_right",
                                             inf_as_zero=True), "degenerate")
    return cases


def suite(scale: str = "gpu", subset: str = "all", *, seed: int = 11, count: int | None = None) -> list[Case]:
    """The fuzz's cases: the special ones, then `count` random ones (default 300 on the
    GPU, 16 on the CPU), filtered by `subset` ("all", "small", "huge", "sanitizer")."""
    if count is None:
        count = 300 if scale == "gpu" else 16
    special = special_cases(scale)
    rand = random_cases(seed, count, scale)
    if subset == "all":
        return special + rand
    if subset == "small":
        return [c for c in special + rand if "huge" not in c.tags]
    if subset == "huge":
        return [c for c in special if "huge" in c.tags]
    if subset == "sanitizer":
        return sanitizer_cases(special, rand)
    raise ValueError(f"subset={subset!r} is not all, small, huge or sanitizer")


# degenerate cases under compute-sanitizer: few programs each (memcheck is 10-100x slower)
SANITIZER_SPECIAL = ("dw65536-b1-nchw-f32-fwd", "1x1img-3x3-nchw-f32-bwd_data", "1x1img-1x1-nhwc-bf16-bwd_weights",
                     "filter-eq-input-1d-f32-bwd_weights", "filter-eq-input-2d-bf16-fwd", "attn-sk1-sq2048-bwd",
                     "cpu-long-causal-dw-bwd_data", "cpu-attn-sampled-bwd", "cpu-1x1img-3x3")


def sanitizer_cases(special: list[Case], rand: list[Case], limit: int = 20) -> list[Case]:
    """About `limit` small and medium cases for compute-sanitizer: a few degenerate ones
    (SANITIZER_SPECIAL), then random ones under 16 MiB, round robin over (kind, direction,
    quantized K/V)."""
    chosen = [c for c in special if c.name in SANITIZER_SPECIAL]
    buckets: dict[tuple, list[Case]] = {}
    for c in rand:
        if c.nbytes() < 16 * 2 ** 20:
            s = c.spec
            quant = isinstance(s, AttnSpec) and bool(s.k_quant or s.v_quant)
            paged = isinstance(s, AttnSpec) and s.page_size > 0
            buckets.setdefault((c.kind, s.direction, quant, paged), []).append(c)
    keys = sorted(buckets, key=str)
    while len(chosen) < limit and any(buckets[k] for k in keys):
        for k in keys:
            if buckets[k] and len(chosen) < limit:
                chosen.append(buckets[k].pop(0))
    return [Case(c.name, c.spec, c.tags | {"sanitizer"}, c.sample, c.seed) for c in chosen]


def shard(cases: list[Case], spec: str | None) -> list[Case]:
    """Cases of shard "i/n" (every n-th from i); all of them for None."""
    if not spec:
        return cases
    i, n = (int(v) for v in spec.split("/"))
    return cases[i::n]


# ---- tensors ---------------------------------------------------------------------------------
@dataclass
class ConvTensors:
    x: torch.Tensor
    w: torch.Tensor
    dy: torch.Tensor | None
    bias: torch.Tensor | None
    post_ops: tuple


def conv_tensors(s: ConvSpec, p: ConvProblem, device: str, seed: int) -> ConvTensors:
    """Random tensors in the problem's layout: x, dy ~ N(0, 1), w ~ N(0, 1 / fan-in) so that
    outputs stay O(1) (post-ops such as square stay finite in f16)."""
    g = torch.Generator(device=device).manual_seed(seed)
    dt = DTYPES[s.dtype]

    def randn(shape, std=1.0):
        return empty_in_layout(shape, s.layout, dtype=dt, device=device).normal_(0.0, std, generator=g)

    def operand(shape, kind):
        if kind != "div":
            return randn(shape)
        t = empty_in_layout(shape, s.layout, dtype=torch.float32, device=device).uniform_(0.5, 1.5, generator=g)
        t *= torch.where(torch.rand(shape, generator=g, device=device) < 0.5, -1.0, 1.0)   # either sign
        return t.to(dt)

    x = randn(p.x_shape)
    w = randn(p.w_shape, 1.0 / math.sqrt(p.w_shape[1] * math.prod(p.filter)))
    dy = randn(p.y_shape) if s.direction != "fwd" else None
    bias = torch.randn(p.K, generator=g, device=device).to(dt) if s.bias else None
    ops = tuple(_post_op(op, p.y_shape, operand) for op in s.post_ops)
    return ConvTensors(x, w, dy, bias, ops)


@dataclass
class AttnTensors:
    q: torch.Tensor
    k: object
    v: object
    mask: torch.Tensor | None
    scale: float | torch.Tensor | None
    kv_lens: torch.Tensor | None
    seed: int
    offset: int
    do: torch.Tensor | None = None
    o: torch.Tensor | None = None
    lse: torch.Tensor | None = None
    block_table: torch.Tensor | None = None   # paged: k, v are page pools; k_ref, v_ref the contiguous caches
    k_ref: object = None
    v_ref: object = None
    mask_ref: torch.Tensor | None = None

    def options(self, s: AttnSpec) -> dict:
        opts = dict(attn_mask=self.mask, causal=s.causal, scale=self.scale, invert_scale=s.invert_scale,
                    dropout_p=s.dropout_p, seed=self.seed, offset=self.offset, kv_lens=self.kv_lens,
                    softmax_inf_as_zero=s.inf_as_zero)
        return opts if self.block_table is None else dict(opts, block_table=self.block_table)

    def contiguous(self) -> AttnTensors:
        """The same call on the contiguous cache (what a paged call must equal: its reference)."""
        if self.block_table is None:
            return self
        return replace(self, k=self.k_ref, v=self.v_ref, mask=self.mask_ref, block_table=None, k_ref=None,
                       v_ref=None, mask_ref=None)


def attention_tensors(s: AttnSpec, device: str, seed: int) -> AttnTensors:
    g = torch.Generator(device=device).manual_seed(seed)
    dt = DTYPES[s.dtype]

    def randn(*shape):
        return torch.empty(shape, dtype=dt, device=device).normal_(generator=g)

    def kv(d: int, quant):
        if quant is not None:
            return _kv_quant(quant, (s.B, s.Hkv, s.Sk, d), device, torch.Generator().manual_seed(seed + d))
        if s.kv_layout == "bshd":
            return randn(s.B, s.Sk, s.Hkv, d).transpose(1, 2)
        return randn(s.B, s.Hkv, s.Sk, d)

    q = randn(s.B, s.Hq, s.Sq, s.D)
    k, v = kv(s.D, s.k_quant), kv(s.Dv, s.v_quant)
    mask = None
    if s.mask == "bool":
        mask = torch.rand(s.mask_shape, generator=g, device=device) < 0.8
    elif s.mask == "additive":
        mask = randn(*s.mask_shape)
    scale = {"default": None, "float": 0.3, "tensor": torch.tensor(0.3, device=device)}[s.scale]
    kv_lens = None
    if s.kv_lens:
        kv_lens = torch.randint(0, s.Sk + 1, (s.B,), generator=g, device=device, dtype=torch.int32)
    t = AttnTensors(q, k, v, mask, scale, kv_lens, seed=1234 + seed, offset=7 * seed)
    return _in_pages(t, s.page_size, seed) if s.page_size else t


def _in_pages(t: AttnTensors, page: int, seed: int) -> AttnTensors:
    """t with K/V moved into shuffled page pools with spare pages. Every pool row no
    sequence may read (past its kv_lens: page tails, unused pages) is NaN in float pools and
    in the per-token scales of quantized ones, so a read past kv_lens shows in the output.
    The block table has a spare last column of -1 (past every sequence's pages)."""
    B, Sk = t.q.shape[0], t.k.shape[2]
    M = -(-Sk // page)
    rng = torch.Generator().manual_seed(seed)
    n = B * M + int(torch.randint(1, 9, (1,), generator=rng))
    bt = torch.randperm(n, generator=rng)[:B * M].reshape(B, M).to(torch.int32).to(t.q.device)
    rows = torch.arange(M * page, device=t.q.device)[None, :] < t.kv_lens.to(t.q.device)[:, None]
    readable = torch.zeros((n, page), dtype=torch.bool, device=t.q.device)
    readable[bt.reshape(-1).long()] = rows.reshape(B * M, page)
    hidden = ~readable[:, None, :, None]

    def pool(cache):
        pages = to_pages(_pad_keys(cache, M * page), bt, n)
        for part in ((pages,) if isinstance(pages, torch.Tensor) else (pages.scales,)):
            if part is not None and part.dim() == 4 and part.is_floating_point():
                part.masked_fill_(hidden, float("nan"))
        return pages
    spare = torch.full((B, 1), -1, dtype=torch.int32, device=t.q.device)
    mask = t.mask   # a paged call's Sk is the table's (max_pages * page_size): keys past kv_lens padded
    if mask is not None and mask.shape[-1] != 1:
        mask = torch.cat([mask, mask.new_zeros((*mask.shape[:-1], (M + 1) * page - Sk))], -1)
    return replace(t, k=pool(t.k), v=pool(t.v), mask=mask, block_table=torch.cat([bt, spare], 1), k_ref=t.k,
                   v_ref=t.v, mask_ref=t.mask)


def _pad_keys(cache, S: int):
    """A K/V cache (tensor or KVQuant, (B, H, Sk, X) parts) with random keys appended up to S."""
    if isinstance(cache, KVQuant):
        return KVQuant.trusted(*(None if x is None else _pad_keys(x, S) for x in (cache.data, cache.scales,
                                                                                 cache.zero_points)),
                               cache.dtype, cache.group_size, cache.layout)
    if cache.dim() != 4 or cache.shape[2] == S:
        return cache        # per-tensor / per-head parts have no key axis
    extra = list(cache.shape)
    extra[2] = S - cache.shape[2]
    fill = (torch.randn(extra, device=cache.device).to(cache.dtype) if cache.is_floating_point()
            else torch.zeros(extra, dtype=cache.dtype, device=cache.device))
    return torch.cat([cache, fill], 2)


# ---- references and comparisons -----------------------------------------------------------
@dataclass
class Check:
    """One comparison: `pick(result)` (a slice of an output) against `ref` (float64)."""
    label: str
    pick: Callable
    ref: torch.Tensor
    tol: float
    floor: float = 0.0  # the error's denominator is at least this (see _grad_floor)


def rel_error(out: torch.Tensor, ref: torch.Tensor, floor: float = 0.0) -> tuple[float, str]:
    """(relative norm error over the finite reference entries, problem) where non-finite
    entries (NaN / inf) of `out` must sit exactly where the reference has them. The
    denominator is at least `floor`: a gradient that is exactly zero in float64 (one key:
    dS = P (dP - delta) = 0) is measured against the size of its terms instead."""
    out = out.double()
    bad_ref = ~torch.isfinite(ref)
    bad_out = ~torch.isfinite(out)
    if not torch.equal(bad_out, bad_ref):
        extra = int((bad_out & ~bad_ref).sum())
        missing = int((bad_ref & ~bad_out).sum())
        return math.inf, f"{extra} non-finite values where float64 is finite, {missing} finite where it is not"
    ok = ~bad_ref
    if not ok.any():
        return 0.0, ""
    o, r = out[ok], ref[ok]
    return float((o - r).norm() / r.norm().clamp_min(max(floor, 1e-30))), ""


def tolerance(dtype: str, reduction: int, backward: bool = False) -> float:
    base = (BWD_TOL if backward else TOL)[dtype]
    return base * max(1.0, math.sqrt(reduction / 1024)) if dtype == "f32" else base


def _conv_call(s: ConvSpec, t: ConvTensors, solver) -> torch.Tensor:
    kw = dict(stride=s.stride, padding=s.padding, dilation=s.dilation, groups=s.groups, solver=solver,
              out_dtype=DTYPES[s.out_dtype] if s.out_dtype else None)
    if s.direction == "fwd":
        return nnprim.conv_forward(t.x, t.w, t.bias, post_ops=t.post_ops, **kw)
    if s.direction == "bwd_data":
        return nnprim.conv_backward_data(t.dy, t.w, s.x_shape, **kw)
    return nnprim.conv_backward_weights(t.dy, t.x, s.w_shape, **kw)


def _slice_post_op(op: PostOp, ns: list[int], k: int) -> PostOp:
    """`op` restricted to images `ns` and output channel k (its tensor sliced where not broadcast)."""
    if isinstance(op, Eltwise):
        return op
    t = op.tensor
    if t.shape[0] != 1:
        t = t[ns]
    if t.shape[1] != 1:
        t = t[:, k:k + 1]
    return Sum(t, op.scale) if isinstance(op, Sum) else Binary(op.op, t)


def _pick(n: int, extra: int, rng: random.Random) -> list[int]:
    """The last index of range(n) (the largest offsets) and up to `extra` other random ones."""
    return sorted({n - 1, *rng.sample(range(n - 1), min(extra, n - 1))})


def api_conv_problem(s: ConvSpec, t: ConvTensors) -> ConvProblem:
    """The problem the public API builds from these tensors (its layout is what torch
    reports for x or dy: a channels-last tensor with C = 1 or 1x1 images counts as NCHW)."""
    kw = dict(stride=s.stride, padding=s.padding, dilation=s.dilation, groups=s.groups,
              out_dtype=DTYPES[s.out_dtype] if s.out_dtype else None)
    if s.direction == "fwd":
        return ConvProblem.from_tensors(t.x, t.w, "fwd", bias=t.bias, post_ops=t.post_ops, **kw)
    src = t.dy if s.direction == "bwd_data" else t.x
    return ConvProblem.create(s.direction, s.x_shape, s.w_shape, dtype=src.dtype, layout=layout_of(src),
                              device=src.device.type, **kw)


def conv_checks(s: ConvSpec, p: ConvProblem, t: ConvTensors, sample: bool, rng: random.Random) -> list[Check]:
    """Float64 references: the whole output, or sampled images x channels (sample)."""
    # an f32 problem with a 16-bit out_dtype is as exact as its output's rounding
    tol = max(tolerance(s.dtype, s.reduction()), tolerance(s.out_dtype, s.reduction()) if s.out_dtype else 0.0)
    if not sample:
        ref = {"fwd": lambda: conv_ref.conv_fwd_f64(p, t.x, t.w, t.bias, t.post_ops),
               "bwd_data": lambda: conv_ref.conv_bwd_data_f64(p, t.dy, t.w),
               "bwd_weights": lambda: conv_ref.conv_bwd_weights_f64(p, t.dy, t.x)}[s.direction]()
        return [Check("all", lambda out: out, ref, tol)]
    Kg, Cg = p.K // p.groups, p.C // p.groups
    geo = dict(dtype=p.dtype, stride=p.stride, padding=p.padding, dilation=p.dilation)
    ns = _pick(p.N, 1, rng)
    checks = []
    if s.direction == "fwd":
        for k in _pick(p.K, 2, rng):
            g = k // Kg
            xs, ws = t.x[ns][:, g * Cg:(g + 1) * Cg], t.w[k:k + 1]
            ps = ConvProblem.create("fwd", xs.shape, ws.shape, **geo)
            ops = tuple(_slice_post_op(op, ns, k) for op in t.post_ops)
            ref = conv_ref.conv_fwd_f64(ps, xs, ws, None if t.bias is None else t.bias[k:k + 1], ops)
            checks.append(Check(f"y[n={ns}, k={k}]", lambda out, k=k: out[ns][:, k:k + 1], ref, tol))
    elif s.direction == "bwd_data":
        for c in _pick(p.C, 2, rng):
            g, cl = divmod(c, Cg)
            dys, ws = t.dy[ns][:, g * Kg:(g + 1) * Kg], t.w[g * Kg:(g + 1) * Kg, cl:cl + 1]
            ps = ConvProblem.create("bwd_data", (len(ns), 1, *p.in_size), ws.shape, **geo)
            ref = conv_ref.conv_bwd_data_f64(ps, dys, ws)
            checks.append(Check(f"dx[n={ns}, c={c}]", lambda out, c=c: out[ns][:, c:c + 1], ref, tol))
    else:
        for k in _pick(p.K, 1, rng):
            for cl in _pick(Cg, 1, rng):
                c = k // Kg * Cg + cl
                dys, xs = t.dy[:, k:k + 1], t.x[:, c:c + 1]
                ps = ConvProblem.create("bwd_weights", xs.shape, (1, 1, *p.filter), **geo)
                ref = conv_ref.conv_bwd_weights_f64(ps, dys, xs)
                checks.append(Check(f"dw[k={k}, c={cl}]", lambda out, k=k, cl=cl: out[k:k + 1, cl:cl + 1], ref, tol))
    return checks


def _attn_problem(s: AttnSpec, t: AttnTensors, q, k, v, mask, kv_lens, direction: str,
                  block_table: torch.Tensor | None = None) -> AttentionProblem:
    return AttentionProblem.from_tensors(
        q, k, v, attn_mask=mask, causal=s.causal, scale=t.scale, invert_scale=s.invert_scale, dropout_p=s.dropout_p,
        kv_lens=kv_lens, softmax_inf_as_zero=s.inf_as_zero, return_lse=s.return_lse or direction == "bwd",
        direction=direction, seed=t.seed, offset=t.offset, block_table=block_table)


def _attn_args(t: AttnTensors, q, k, v, mask, kv_lens, do=None, o=None, lse=None) -> AttnArgs:
    return AttnArgs(q=q, k=k, v=v, attn_mask=mask, scale=t.scale, seed=t.seed, offset=t.offset, kv_lens=kv_lens,
                    do=do, o=o, lse=lse)


def attention_checks(s: AttnSpec, p: AttentionProblem, t: AttnTensors, sample: bool,
                     rng: random.Random) -> list[Check]:
    """Float64 references (whole, or for sampled batch entries x KV heads); for the
    backward, fills t.do, t.o, t.lse first (o and lse from float64, or from the default
    forward call for sampled problems)."""
    tol = tolerance(s.dtype, s.reduction(), s.direction == "bwd") * _score_growth(s, p, t)
    # lse in f32 from scores of the inputs as given; quantized K is dequantized into q's dtype
    # first (as every quantized-cache kernel does), which bounds lse at that dtype's accuracy
    lse_tol = tolerance(s.dtype if s.k_quant else "f32", s.Sk)
    if s.direction == "bwd":
        g = torch.Generator(device=t.q.device).manual_seed(t.seed)
        t.do = torch.empty((s.B, s.Hq, s.Sq, s.Dv), dtype=t.q.dtype, device=t.q.device).normal_(generator=g)
        if sample:
            t.o, t.lse = nnprim.sdpa(t.q, t.k, t.v, return_lse=True, **t.options(s))
        else:
            fp = p.with_direction("fwd")
            o64, lse64 = reference_forward(fp, _attn_args(t, t.q, t.k, t.v, t.mask, t.kv_lens))
            t.o, t.lse = o64.to(t.q.dtype), lse64.float()
    if not sample:
        args = _attn_args(t, t.q, t.k, t.v, t.mask, t.kv_lens, t.do, t.o, t.lse)
        return _attn_refs(s, p, args, lambda r: r, tol, lse_tol, "")
    if s.dropout_p or s.k_quant or s.v_quant:
        raise ValueError("sampled attention references need no dropout (its mask depends on b, h) and float K/V")
    G = s.Hq // s.Hkv
    checks = []
    for b in _pick(s.B, 1, rng):
        for hk in _pick(s.Hkv, 1, rng):
            hs = slice(hk * G, (hk + 1) * G)
            q, k, v = t.q[b:b + 1, hs], t.k[b:b + 1, hk:hk + 1], t.v[b:b + 1, hk:hk + 1]
            mask = t.mask
            if mask is not None:
                m4 = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
                mask = m4[b:b + 1] if m4.shape[0] != 1 else m4
                mask = mask[:, hs] if m4.shape[1] != 1 else mask
            lens = None if t.kv_lens is None else t.kv_lens[b:b + 1]
            ps = _attn_problem(s, t, q, k, v, mask, lens, s.direction)
            sub = (lambda x, b=b, hs=hs: x[b:b + 1, hs])
            kv_sub = (lambda x, b=b, hk=hk: x[b:b + 1, hk:hk + 1])
            args = _attn_args(t, q, k, v, mask, lens, *(None if x is None else sub(x) for x in (t.do, t.o, t.lse)))
            checks += _attn_refs(s, ps, args, (sub, kv_sub), tol, lse_tol, f"[b={b}, hkv={hk}]")
    return checks


def _score_growth(s: AttnSpec, p: AttentionProblem, t: AttnTensors) -> float:
    """How much larger than O(1) the scaled scores are (rms / 4, at least 1). A score's
    rounding error grows with its size and enters P = exp(s - lse) as a relative error:
    scores of rms 50 (a scale of 3.3 at D 256) cost f32 softmax and its gradients ~3e-5,
    torch's own f32 math as much (2026-12-04 GPU fuzz, r173). Quantized K: 1."""
    if not isinstance(t.k, torch.Tensor):
        return 1.0
    sc = _attn_args(t, t.q, t.k, t.v, t.mask, t.kv_lens).effective_scale(p.invert_scale)
    sc = abs(float(sc.double().reshape(()))) if isinstance(sc, torch.Tensor) else abs(sc)
    q, k = t.q[:, 0, :64].double(), t.k[:, 0, :64].double()
    return max(1.0, sc * _rms(q @ k.transpose(-1, -2)) / 4)


def _attn_refs(s: AttnSpec, p: AttentionProblem, args: AttnArgs, subs, tol: float, lse_tol: float,
               where: str) -> list[Check]:
    """Checks of one (sub)problem; `subs` maps a full output to the sub-block: one function
    for every output, or (query-head side, KV-head side)."""
    q_sub, kv_sub = subs if isinstance(subs, tuple) else (subs, subs)
    if s.direction == "fwd":
        o64, lse64 = reference_forward(p, args)
        checks = [Check("o" + where, lambda r: q_sub(r[0] if isinstance(r, tuple) else r), o64, tol)]
        if s.return_lse:
            checks.append(Check("lse" + where, lambda r: q_sub(r[1]), lse64, lse_tol))
        return checks
    dq, dk, dv = reference_backward(p, args)
    fq, fk = _grad_floor(p, args, dq, args.k), _grad_floor(p, args, dk, args.q)
    return [Check("dq" + where, lambda r: q_sub(r[0]), dq, tol, fq),
            Check("dk" + where, lambda r: kv_sub(r[1]), dk, tol, fk),
            Check("dv" + where, lambda r: kv_sub(r[2]), dv, tol)]


def _rms(t: torch.Tensor) -> float:
    return float(t.double().square().mean().sqrt())


def _grad_floor(p: AttentionProblem, args: AttnArgs, grad: torch.Tensor, other: torch.Tensor) -> float:
    """The norm dq (other = k) or dk (other = q) has when its terms do not cancel:
    |scale| * rms(dO) * rms(V) * sqrt(Dv) (one entry of dP) * rms(other) * sqrt(numel)."""
    sc = args.effective_scale(p.invert_scale)
    sc = abs(float(sc.double().reshape(()))) if isinstance(sc, torch.Tensor) else abs(sc)
    return sc * _rms(args.do) * _rms(args.v) * math.sqrt(p.Dv) * _rms(other) * math.sqrt(grad.numel())


def _attn_call(s: AttnSpec, t: AttnTensors, solver):
    if s.direction == "fwd":
        return nnprim.sdpa(t.q, t.k, t.v, return_lse=s.return_lse, solver=solver, **t.options(s))
    return nnprim.sdpa_backward(t.do, t.q, t.k, t.v, t.o, t.lse, solver=solver, **t.options(s))


# ---- running a case ---------------------------------------------------------------------------
@dataclass
class Outcome:
    solver: str                       # solver name, or "default"
    status: str                       # ok | refused | skipped | wrong | nan | error | oom | fault
    err: float | None = None
    tol: float | None = None
    seconds: float = 0.0
    detail: str = ""


@dataclass
class CaseResult:
    case: Case
    outcomes: list[Outcome] = field(default_factory=list)
    not_applicable: dict[str, list[str]] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def failures(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.status in FAILED]

    @property
    def fatal(self) -> bool:
        """A CUDA fault: the context is lost, nothing more can run in this process."""
        return any(o.status == "fault" for o in self.outcomes)

    def record(self) -> dict:
        c = self.case
        return {"case": c.name, "kind": c.kind, "tags": sorted(c.tags), "sample": c.sample,
                "spec": asdict(c.spec), "seconds": round(self.seconds, 3),
                "outcomes": [asdict(o) for o in self.outcomes],
                "not_applicable": {k: v[:3] for k, v in self.not_applicable.items()}}

    def report(self) -> str:
        lines = [f"{self.case.name} ({self.seconds:.1f} s):"]
        for o in self.outcomes:
            err = "" if o.err is None else f" err {o.err:.3g} (tol {o.tol:.3g})"
            lines.append(f"  {o.solver:<30} {o.status:<8}{err} {o.seconds:.2f} s {o.detail}")
        return "\n".join(lines)


# sticky CUDA errors: the context is lost (a launch refused for its configuration is not one)
_FAULT_WORDS = ("illegal memory access", "illegal address", "unspecified launch failure", "misaligned address",
                "device-side assert", "illegal instruction", "hardware stack error")


class _LogCapture(logging.Handler):
    """Warnings nnprim logs (find's skipped or disagreeing candidates) during the default call."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage()[:300])


def _run_one(label: str, call: Callable, checks: list[Check], device: str, forced: bool) -> Outcome:
    t0 = time.perf_counter()
    cap = _LogCapture()
    log = logging.getLogger("nnprim")
    log.addHandler(cap)
    try:
        with warnings.catch_warnings(record=True) as wlist:
            warnings.simplefilter("always")
            out = call()
            if device == "cuda":
                torch.cuda.synchronize()
    except NotSupportedError as e:
        return Outcome(label, "refused" if forced else "error", seconds=time.perf_counter() - t0,
                       detail=str(e).splitlines()[0][:300])
    except torch.cuda.OutOfMemoryError as e:
        return Outcome(label, "oom", seconds=time.perf_counter() - t0, detail=str(e).splitlines()[0][:300])
    except Exception as e:  # noqa: BLE001 - every other exception is a finding
        status = "fault" if any(w in str(e) for w in _FAULT_WORDS) else "error"
        tb = traceback.format_exc().strip().splitlines()
        return Outcome(label, status, seconds=time.perf_counter() - t0,
                       detail=f"{type(e).__name__}: {str(e)[:300]} | {' / '.join(tb[-4:-1])[:400]}")
    finally:
        log.removeHandler(cap)
    notes = [str(w.message)[:200] for w in wlist if "nnprim" in (w.filename or "")] + cap.lines
    worst, worst_tol, problems = 0.0, None, []
    for chk in checks:
        err, why = rel_error(chk.pick(out), chk.ref, chk.floor)
        if why or not err <= chk.tol:
            problems.append(f"{chk.label}: {why or f'err {err:.3g} > {chk.tol:.3g}'}")
        if err >= worst:
            worst, worst_tol = err, chk.tol
    del out
    status = "ok"
    if problems:
        status = "nan" if any("non-finite" in p for p in problems) else "wrong"
    detail = "; ".join(problems + notes)[:800]
    return Outcome(label, status, err=worst, tol=worst_tol, seconds=time.perf_counter() - t0, detail=detail)


def run_case(case: Case, device: str) -> CaseResult:
    """Force every applicable solver of `case` through the public API, then make the
    default call; compare each result with float64 (see the module docstring)."""
    t0 = time.perf_counter()
    res = CaseResult(case)
    _run_solvers(case, device, res)
    if device == "cuda" and (case.sample or "huge" in case.tags):
        torch.cuda.empty_cache()       # the case's tensors are gone: give their memory back
    res.seconds = time.perf_counter() - t0
    return res


def _run_solvers(case: Case, device: str, res: CaseResult) -> None:
    rng = random.Random(case.seed)
    s = case.spec
    try:
        if isinstance(s, ConvSpec):
            t = conv_tensors(s, s.problem(device), device, case.seed)
            p = api_conv_problem(s, t)
            checks = conv_checks(s, p, t, case.sample, rng)
            call = lambda solver: _conv_call(s, t, solver)  # noqa: E731
        else:
            t = attention_tensors(s, device, case.seed)
            p = _attn_problem(s, t, t.q, t.k, t.v, t.mask, t.kv_lens, s.direction, t.block_table)
            tc = t.contiguous()   # a paged call's reference: the contiguous cache's
            pc = p if tc is t else _attn_problem(s, tc, tc.q, tc.k, tc.v, tc.mask, tc.kv_lens, s.direction)
            checks = attention_checks(s, pc, tc, case.sample, rng)
            call = lambda solver: _attn_call(s, t, solver)  # noqa: E731
    except Exception as e:  # noqa: BLE001 - a broken case (or a fault in the reference) is a finding too
        status = "fault" if any(w in str(e) for w in _FAULT_WORDS) else "error"
        res.outcomes.append(Outcome("setup", status, detail=f"{type(e).__name__}: {str(e)[:400]}"))
        return
    heavy = case.sample or "huge" in case.tags
    for solver in REGISTRY.for_problem(p):
        reasons = solver.not_supported_reasons(p)
        if reasons:
            res.not_applicable[solver.name] = reasons
            continue
        if solver.family == "reference" and heavy:
            res.outcomes.append(Outcome(solver.name, "skipped", detail="float64 reference on a huge problem"))
            continue
        res.outcomes.append(_run_one(solver.name, lambda n=solver.name: call(n), checks, device, True))
        if res.fatal:
            return
    res.outcomes.append(_run_one("default", lambda: call(None), checks, device, False))


# ---- command line --------------------------------------------------------------------------
def _deadline() -> float | None:
    v = os.environ.get("NNPRIM_FUZZ_DEADLINE")
    return float(v) if v else None


def write_record(result: CaseResult, path: str | None) -> None:
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(result.record()) + "\n")


def run(cases: Iterable[Case], device: str, log_path: str | None) -> int:
    """Run cases in order (stopping at NNPRIM_FUZZ_DEADLINE or a CUDA fault); 1 on any failure."""
    failed = 0
    for case in cases:
        dl = _deadline()
        if dl is not None and time.time() > dl:
            print(f"SKIP {case.name}: past NNPRIM_FUZZ_DEADLINE", flush=True)
            continue
        r = run_case(case, device)
        write_record(r, log_path)
        print(("FAIL " if r.failures else "ok   ") + r.report(), flush=True)
        failed += bool(r.failures)
        if r.fatal:
            print("CUDA fault: stopping (the context is lost)", flush=True)
            return 1
    return 1 if failed else 0


def summary(paths: list[str]) -> str:
    """Totals of JSON-lines logs: cases, runs per status, per solver, the failures."""
    recs = []
    for path in paths:
        if os.path.exists(path):
            with open(path) as f:
                recs += [json.loads(line) for line in f if line.strip()]
    by_status: dict[str, int] = {}
    by_solver: dict[str, dict[str, int]] = {}
    fails = []
    for r in recs:
        for o in r["outcomes"]:
            by_status[o["status"]] = by_status.get(o["status"], 0) + 1
            by_solver.setdefault(o["solver"], {}).setdefault(o["status"], 0)
            by_solver[o["solver"]][o["status"]] += 1
            if o["status"] in FAILED:
                fails.append(f"  {r['case']} :: {o['solver']}: {o['status']} {o['detail'][:300]}")
    lines = [f"cases: {len(recs)} ({sum(1 for r in recs if 'huge' in r['tags'])} huge), "
             f"runs: {sum(by_status.values())}, case time {sum(r['seconds'] for r in recs):.0f} s",
             "by status: " + ", ".join(f"{k} {v}" for k, v in sorted(by_status.items()))]
    lines += [f"  {name:<30} " + ", ".join(f"{k} {v}" for k, v in sorted(st.items()))
              for name, st in sorted(by_solver.items())]
    lines.append(f"failures: {len(fails)}")
    return "\n".join(lines + fails)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m nnprim.testing.fuzz")
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run fuzz cases")
    r.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    r.add_argument("--subset", default=os.environ.get("NNPRIM_FUZZ_SUBSET", "all"))
    r.add_argument("--shard", default=os.environ.get("NNPRIM_FUZZ_SHARD"))
    r.add_argument("--count", type=int, default=None)
    r.add_argument("--log", default=os.environ.get("NNPRIM_FUZZ_LOG"))
    r.add_argument("--list", action="store_true", help="print the cases and their sizes, run nothing")
    r.add_argument("--only", default="", help="comma-separated case-name prefixes (re-run findings)")
    sm = sub.add_parser("summary", help="summarise JSON-lines logs")
    sm.add_argument("logs", nargs="+")
    a = ap.parse_args(argv)
    if a.cmd == "summary":
        print(summary(a.logs))
        return 0
    scale = "gpu" if a.device == "cuda" else "cpu"
    cases = shard(suite(scale, a.subset, count=a.count), a.shard)
    if a.only:
        prefixes = tuple(p for p in a.only.split(",") if p)
        cases = [c for c in cases if c.name.startswith(prefixes)]
    if a.list:
        for c in cases:
            print(f"{c.name:<70} {c.nbytes() / 2 ** 30:8.2f} GiB {sorted(c.tags)}")
        return 0
    return run(cases, a.device, a.log)


if __name__ == "__main__":
    sys.exit(main())
