"""Fused convolution epilogue for the GPU solvers: bias, then the post-op chain, on the
f32 accumulator tile, as a @triton.jit helper that every GPU conv kernel calls.

A tile is `acc[BM, BN]` over (m = flattened n,spatial output row, k = output channel).
`y_off[BM, BN]` are the element offsets of the tile in a y-shaped tensor stored in the
problem's layout; every full-size post-op tensor (Sum, Binary full) is brought to that
same layout and contiguity by `epilogue_args`, so one offset tile serves all of them.

Post-op chain: up to MAX_POST_OPS slots, each described by three constexprs
  KIND  0 none | 1 Sum (acc += alpha * t) | 2 Eltwise | 3 Binary
  SUB   eltwise kind index in ELTWISE_KINDS, or binary op index in BINARY_OPS
  BC    Binary broadcast: 0 scalar, 1 per output channel, 2 full
and a pointer plus two f32 scalars (alpha, beta; Sum's scale is alpha).
Not supported: more than MAX_POST_OPS post-ops, Binary broadcasts other than
scalar / per channel / full (solvers report it in not_supported_reasons)."""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..launch import interpreting  # noqa: F401  (re-exported for the conv kernels)
from ..post_ops import BINARY_OPS, ELTWISE_KINDS
from ..problems.conv import ConvProblem, to_layout

MAX_POST_OPS = 4

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT2 = 1.0 / math.sqrt(2.0)


def tl_dot_precision(dtype: torch.dtype) -> str:
    """f32 inputs must be exact (no TF32); half inputs use the tensor cores."""
    return "ieee" if dtype == torch.float32 else "tf32"


# ---- triton helpers ------------------------------------------------------------------
@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _tanh(x):
    # 1 - 2/(exp(2x)+1): exact limits for large |x| (exp overflow gives 1, underflow -1)
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _softplus(x):
    return tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))


@triton.jit
def eltwise(x, alpha, beta, KIND: tl.constexpr):
    """f(x; alpha, beta) for KIND = index into post_ops.ELTWISE_KINDS."""
    if KIND == 0:      # relu (alpha = negative slope)
        x = tl.where(x > 0, x, x * alpha)
    elif KIND == 1:    # gelu_tanh
        x = 0.5 * x * (1.0 + _tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)))
    elif KIND == 2:    # gelu_erf
        x = 0.5 * x * (1.0 + tl.erf(x * 0.7071067811865476))
    elif KIND == 3:    # silu
        x = x * _sigmoid(x)
    elif KIND == 4:    # sigmoid
        x = _sigmoid(x)
    elif KIND == 5:    # tanh
        x = _tanh(x)
    elif KIND == 6:    # elu
        x = tl.where(x > 0, x, alpha * (tl.exp(tl.minimum(x, 0.0)) - 1.0))
    elif KIND == 7:    # clip
        x = tl.minimum(tl.maximum(x, alpha), beta)
    elif KIND == 8:    # linear
        x = alpha * x + beta
    elif KIND == 9:    # square
        x = x * x
    elif KIND == 10:   # abs
        x = tl.abs(x)
    elif KIND == 11:   # sqrt
        x = tl.sqrt(x)
    elif KIND == 12:   # exp
        x = tl.exp(x)
    elif KIND == 13:   # log
        x = tl.log(x)
    elif KIND == 14:   # hardswish
        x = x * tl.minimum(tl.maximum(x + 3.0, 0.0), 6.0) / 6.0
    elif KIND == 15:   # mish
        x = x * _tanh(_softplus(x))
    return x


@triton.jit
def _binary(x, t, OP: tl.constexpr):
    if OP == 0:
        x = x + t
    elif OP == 1:
        x = x - t
    elif OP == 2:
        x = x * t
    elif OP == 3:
        x = x / t
    elif OP == 4:
        x = tl.maximum(x, t)
    elif OP == 5:
        x = tl.minimum(x, t)
    return x


@triton.jit
def _post_op(acc, ptr, alpha, beta, y_off, rn, mask_n, mask,
             KIND: tl.constexpr, SUB: tl.constexpr, BC: tl.constexpr):
    if KIND == 1:
        t = tl.load(ptr + y_off, mask=mask, other=0.0).to(tl.float32)
        acc = acc + alpha * t
    elif KIND == 2:
        acc = eltwise(acc, alpha, beta, SUB)
    elif KIND == 3:
        if BC == 0:
            t = tl.load(ptr).to(tl.float32)
            acc = _binary(acc, t, SUB)
        elif BC == 1:
            t = tl.load(ptr + rn, mask=mask_n, other=1.0).to(tl.float32)
            acc = _binary(acc, t[None, :], SUB)
        else:
            t = tl.load(ptr + y_off, mask=mask, other=1.0).to(tl.float32)
            acc = _binary(acc, t, SUB)
    return acc


@triton.jit
def epilogue(acc, y_off, rn, mask_n, mask, bias_ptr,
             p0_ptr, p0_a, p0_b, p1_ptr, p1_a, p1_b,
             p2_ptr, p2_a, p2_b, p3_ptr, p3_a, p3_b,
             HAS_BIAS: tl.constexpr,
             P0_KIND: tl.constexpr, P0_SUB: tl.constexpr, P0_BC: tl.constexpr,
             P1_KIND: tl.constexpr, P1_SUB: tl.constexpr, P1_BC: tl.constexpr,
             P2_KIND: tl.constexpr, P2_SUB: tl.constexpr, P2_BC: tl.constexpr,
             P3_KIND: tl.constexpr, P3_SUB: tl.constexpr, P3_BC: tl.constexpr):
    """acc[BM,BN] (f32) -> post_ops(acc + bias[rn]); rn are global output channels."""
    if HAS_BIAS:
        b = tl.load(bias_ptr + rn, mask=mask_n, other=0.0).to(tl.float32)
        acc = acc + b[None, :]
    acc = _post_op(acc, p0_ptr, p0_a, p0_b, y_off, rn, mask_n, mask, P0_KIND, P0_SUB, P0_BC)
    acc = _post_op(acc, p1_ptr, p1_a, p1_b, y_off, rn, mask_n, mask, P1_KIND, P1_SUB, P1_BC)
    acc = _post_op(acc, p2_ptr, p2_a, p2_b, y_off, rn, mask_n, mask, P2_KIND, P2_SUB, P2_BC)
    acc = _post_op(acc, p3_ptr, p3_a, p3_b, y_off, rn, mask_n, mask, P3_KIND, P3_SUB, P3_BC)
    return acc


# ---- host side -----------------------------------------------------------------------
def post_op_reasons(p: ConvProblem) -> list[str]:
    """Why the fused epilogue cannot serve p's post-op chain (empty = it can)."""
    reasons = []
    if len(p.post_ops) > MAX_POST_OPS:
        reasons.append(f"at most {MAX_POST_OPS} fused post-ops, got {len(p.post_ops)}")
    for sig in p.post_ops:
        if sig[0] == "binary" and _binary_bc(p, tuple(sig[2])) is None:
            reasons.append(f"Binary tensor shape {tuple(sig[2])} is not scalar, per channel or full "
                           f"for y {p.y_shape}")
    return reasons


def _binary_bc(p: ConvProblem, shape: tuple[int, ...]) -> int | None:
    numel = math.prod(shape)
    if numel == 1:
        return 0
    nd = len(p.y_shape)
    if shape == tuple(p.y_shape):
        return 2
    if len(shape) == nd and shape[1] == p.K and numel == p.K:
        return 1
    return None


def y_strides(p: ConvProblem, shape_nc: tuple[int, int, int]) -> tuple[int, int, int]:
    """(s_n, s_p, s_c) of a contiguous (N, Ch, P) tensor stored in p.layout."""
    n, ch, pix = shape_nc
    if p.layout == "nhwc":
        return pix * ch, ch, 1
    return ch * pix, 1, pix


@dataclass(frozen=True)
class EpiloguePlan:
    """A problem's fused epilogue, fixed in `prepare`: the constexprs and the f32 scalars
    come from the problem's post-op signatures; only the tensors (bias, Sum and Binary
    operands) are read from the invoker's args on each call.

    Kernels take the epilogue's arguments as `bias_ptr, p0_ptr .. p3_ptr` (per call,
    with the other tensors at the head of the signature), `p0_a, p0_b .. p3_a, p3_b`
    (`scalars()`) and `HAS_BIAS, P0_KIND, P0_SUB, P0_BC .. P3_BC` (`constexprs()`)."""
    layout: str
    has_bias: bool
    ops: tuple[tuple[int, int, int, float, float], ...]   # MAX_POST_OPS x (KIND, SUB, BC, alpha, beta)

    @functools.cached_property
    def needs_tensors(self) -> bool:
        # read twice on every planned call (pointers, addresses): computed once
        return self.has_bias or any(o[0] in (1, 3) for o in self.ops)

    def scalars(self) -> tuple[float, ...]:
        return tuple(v for o in self.ops for v in (o[3], o[4]))

    def constexprs(self) -> tuple:
        return (self.has_bias,) + tuple(v for o in self.ops for v in o[:3])

    def addresses(self, ptrs: tuple, dummy_addr: int) -> tuple[int, ...] | None:
        """`pointers`' result `ptrs` as int addresses (`Launch.run_addresses`; the caller
        keeps `ptrs` alive until it has launched), None when one is not 16-byte aligned
        (then the caller launches with the tensors). `dummy_addr`: the dummy's address."""
        if not self.needs_tensors:
            return (dummy_addr,) * (MAX_POST_OPS + 1)
        out = tuple(t.data_ptr() for t in ptrs)
        return None if any(a & 15 for a in out) else out

    def pointers(self, bias: torch.Tensor | None, post_ops: tuple, dummy: torch.Tensor) -> tuple:
        """(bias_ptr, p0_ptr, .., p3_ptr) for one call; `dummy` fills the unused slots.
        Full-size tensors are brought to the problem's layout (a copy only when they
        are not in it)."""
        if not self.needs_tensors:
            return (dummy,) * (MAX_POST_OPS + 1)
        ptrs = [bias.contiguous() if self.has_bias else dummy]
        for i, (kind, _, bc, _, _) in enumerate(self.ops):
            if kind == 1 or (kind == 3 and bc == 2):
                ptrs.append(to_layout(post_ops[i].tensor, self.layout))
            elif kind == 3:
                ptrs.append(post_ops[i].tensor.reshape(-1).contiguous())
            else:
                ptrs.append(dummy)
        return tuple(ptrs)


NO_EPILOGUE = EpiloguePlan("nhwc", False, ((0, 0, 0, 0.0, 0.0),) * MAX_POST_OPS)


def plan_epilogue(p: ConvProblem) -> EpiloguePlan:
    """The epilogue of p (its bias flag and post-op signatures; forward problems)."""
    ops = []
    for sig in p.post_ops:
        if sig[0] == "sum":
            ops.append((1, 0, 0, float(sig[1]), 0.0))
        elif sig[0] == "eltwise":
            ops.append((2, ELTWISE_KINDS.index(sig[1]), 0, float(sig[2]), float(sig[3])))
        else:
            ops.append((3, BINARY_OPS.index(sig[1]), _binary_bc(p, tuple(sig[2])), 0.0, 0.0))
    ops += [(0, 0, 0, 0.0, 0.0)] * (MAX_POST_OPS - len(ops))
    return EpiloguePlan(p.layout, bool(p.has_bias), tuple(ops))


def post_op_bytes(p: ConvProblem) -> float:
    """Extra bytes the epilogue reads (full-size Sum/Binary tensors), for estimates."""
    e = torch.tensor([], dtype=p.dtype).element_size()
    ny = math.prod(p.y_shape)
    n = 0
    for sig in p.post_ops:
        if sig[0] == "sum" or (sig[0] == "binary" and math.prod(sig[2]) == ny):
            n += ny
    return float(n * e)


# ---- standalone epilogue kernel (used by the gemm family) ----------------------------
@triton.jit(do_not_specialize=["m0"])
def epilogue_copy_kernel(src_ptr, y_ptr, bias_ptr, p0_ptr, p1_ptr, p2_ptr, p3_ptr, m0,
                         M, NCH, P, s_sg, s_sm, s_sn, s_yn, s_yp, s_yc,
                         p0_a, p0_b, p1_a, p1_b, p2_a, p2_b, p3_a, p3_b,
                         HAS_BIAS: tl.constexpr,
                         P0_KIND: tl.constexpr, P0_SUB: tl.constexpr, P0_BC: tl.constexpr,
                         P1_KIND: tl.constexpr, P1_SUB: tl.constexpr, P1_BC: tl.constexpr,
                         P2_KIND: tl.constexpr, P2_SUB: tl.constexpr, P2_BC: tl.constexpr,
                         P3_KIND: tl.constexpr, P3_SUB: tl.constexpr, P3_BC: tl.constexpr,
                         BM: tl.constexpr, BN: tl.constexpr):
    """y[n, g*NCH + c, p] = epilogue(src[g, m - m0, c]) for rows m = n*P + p in
    [m0, m0 + M) (src f32 or any float, strided, below 2**31 elements); grid
    (cdiv(M, BM) * cdiv(NCH, BN) * groups,), group-major. `m0` is passed per call (not
    specialised); y's image base n * s_yn is int64."""
    num_n = tl.cdiv(NCH, BN)
    tiles = tl.cdiv(M, BM) * num_n
    pid = tl.program_id(0)
    g = pid // tiles
    pid = pid - g * tiles
    pid_m = pid // num_n
    pid_n = pid - pid_m * num_n
    rm = pid_m * BM + tl.arange(0, BM)
    rc = pid_n * BN + tl.arange(0, BN)
    mask_m = rm < M
    mask_c = rc < NCH
    mask = mask_m[:, None] & mask_c[None, :]
    acc = tl.load(src_ptr + g * s_sg + rm[:, None] * s_sm + rc[None, :] * s_sn, mask=mask, other=0.0)
    acc = acc.to(tl.float32)
    rn = g * NCH + rc
    gm = m0 + rm
    n = gm // P
    pix = gm - n * P
    y_off = (n.to(tl.int64) * s_yn + pix * s_yp)[:, None] + rn[None, :] * s_yc
    acc = epilogue(acc, y_off, rn, mask_c, mask, bias_ptr,
                   p0_ptr, p0_a, p0_b, p1_ptr, p1_a, p1_b, p2_ptr, p2_a, p2_b, p3_ptr, p3_a, p3_b,
                   HAS_BIAS, P0_KIND, P0_SUB, P0_BC, P1_KIND, P1_SUB, P1_BC,
                   P2_KIND, P2_SUB, P2_BC, P3_KIND, P3_SUB, P3_BC)
    tl.store(y_ptr + y_off, acc.to(y_ptr.dtype.element_ty), mask=mask)
