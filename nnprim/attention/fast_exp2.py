"""exp2 of softmax scores partly on the FMA pipes (FlashAttention-4's trick, here for Hopper).

At head dim 64 a 64x128 score block's exp2s take an SM's MUFU unit (16 a clock) about as long
as the block's two GEMMs take its tensor cores, so the softmax, not the MMAs, sets the pace of
the attention forward. `exp2_mixed(x, POLY)` computes POLY of every 4 elements of x without
the MUFU: round x to the nearest integer j with the 1.5 * 2^23 magic add (the integer lands in
the low mantissa bits), f = x - j in [-0.5, 0.5], 2^f by a degree-3 polynomial (Horner, three
FMAs), and 2^j added to its exponent field by an integer add of j << 23 (the magic constant's
bits shift out). About 8 FMA-pipe instructions per element against 1/16 clock of MUFU.

Accuracy: relative error <= 7.5e-5 (`MAX_REL_ERR`; the coefficients are a minimax fit of 2^f
on [-0.5, 0.5]), far below the bf16 rounding of P (2^-9). Inputs are clamped at -125 (the
result then stays a normal f32, 2^-125 instead of 0 below it): meant for the softmax of
unmasked blocks, where x = s - rowmax is finite and <= 0 and a 2^-125 weight is 0 to every
sum it enters. Masked blocks (-inf scores) keep the MUFU exp2.
"""
from __future__ import annotations

import struct

import numpy as np

from ..gluon_support import gl, gluon

COEFFS = (0.9999281167984009, 0.6932609677314758, 0.24261054396629333, 0.05517132207751274)
MAX_REL_ERR = 7.5e-5
CLAMP = -125.0
MAGIC = 12582912.0   # 1.5 * 2^23: x + MAGIC rounds x to an integer held in the low mantissa bits


def _f32(v: float) -> str:
    """A PTX f32 immediate (0fXXXXXXXX)."""
    return f"0f{struct.unpack('<I', struct.pack('<f', v))[0]:08X}"


def exp2_asm(poly: int) -> str:
    """PTX for 4 f32 elements ($4..$7 -> $0..$3): the first 4 - poly by ex2.approx, the last
    poly by the polynomial."""
    c0, c1, c2, c3 = (_f32(c) for c in COEFFS)
    lines = ["{", ".reg .f32 t, f, p;", ".reg .b32 jb, pb;"]
    for i in range(4):
        if i < 4 - poly:
            lines.append(f"ex2.approx.ftz.f32 ${i}, ${i + 4};")
            continue
        lines += [f"max.f32 f, ${i + 4}, {_f32(CLAMP)};",
                  f"add.rn.f32 t, f, {_f32(MAGIC)};",
                  f"sub.rn.f32 p, t, {_f32(MAGIC)};",
                  "sub.rn.f32 f, f, p;",
                  f"fma.rn.f32 p, f, {c3}, {c2};",
                  f"fma.rn.f32 p, p, f, {c1};",
                  f"fma.rn.f32 p, p, f, {c0};",
                  "shl.b32 jb, t, 23;",
                  "mov.b32 pb, p;",
                  f"add.s32 ${i}, pb, jb;"]
    return "\n".join(lines + ["}"])


def exp2_poly_reference(x: np.ndarray) -> np.ndarray:
    """The polynomial path's float32 arithmetic step by step (what the PTX computes), for tests."""
    f32 = np.float32
    x = np.maximum(np.asarray(x, dtype=f32), f32(CLAMP))
    t = (x + f32(MAGIC)).astype(f32)
    f = (x - (t - f32(MAGIC)).astype(f32)).astype(f32)
    c0, c1, c2, c3 = (f32(c) for c in COEFFS)
    p = (f * c3 + c2).astype(f32)
    p = (p * f + c1).astype(f32)
    p = (p * f + c0).astype(f32)
    jb = (t.view(np.uint32) << np.uint32(23)).astype(np.uint32)
    return (p.view(np.uint32) + jb).astype(np.uint32).view(f32)


if gluon is not None:
    _ASM1 = gl.constexpr(exp2_asm(1))
    _ASM2 = gl.constexpr(exp2_asm(2))
    _ASM3 = gl.constexpr(exp2_asm(3))

    @gluon.jit
    def exp2_mixed(x, POLY: gl.constexpr):
        """2^x (f32) with POLY (0-3) of every 4 elements on the FMA pipes (see the module
        docstring; POLY 0 is gl.exp2). x: finite scores, or anything >= CLAMP that matters."""
        if POLY == 0:
            return gl.exp2(x)
        elif POLY == 1:
            return gl.inline_asm_elementwise(_ASM1, "=r,=r,=r,=r,r,r,r,r", [x], gl.float32, True, 4)
        elif POLY == 2:
            return gl.inline_asm_elementwise(_ASM2, "=r,=r,=r,=r,r,r,r,r", [x], gl.float32, True, 4)
        else:
            return gl.inline_asm_elementwise(_ASM3, "=r,=r,=r,=r,r,r,r,r", [x], gl.float32, True, 4)
else:
    exp2_mixed = None
