"""PTX conversions of K/V codes to 16-bit floats for the decode kernels: packed 4-bit and
8-bit integer codes by magic numbers (exact: every code is a bf16 / f16), e4m3 by the
hardware's `cvt.rn.f16x2.e4m3x2` (sm_89+). Each handles 4 codes per 32-bit register."""
from __future__ import annotations

import triton
import triton.language as tl


def _asm4(dot: str, signed: bool) -> str:
    """PTX: 4 bytes of packed 4-bit codes ($4) -> their low nibbles ($0, $1) and high nibbles
    ($2, $3) as exact 16-bit floats, two per register: 0x4300 | n is bf16 128 + n (0x6400 | n
    is f16 1024 + n); s4 flips the sign bit first (n ^ 8) and subtracts 8 more."""
    magic = {"bf16": 0x4300, "f16": 0x6400}[dot] | (8 if signed else 0)
    bias = {"bf16": 0xC300, "f16": 0xE400}[dot] | (8 if signed else 0)  # -(128 | 8) / -(1024 | 8)
    one = {"bf16": 0x3F80, "f16": 0x3C00}[dot]
    lut = 0x6A if signed else 0xEA  # (a & b) ^ c  |  (a & b) | c
    fma = "fma.rn.bf16x2" if dot == "bf16" else "fma.rn.f16x2"
    return (
        "{ .reg .b32 t0, t1, s0, s1, z, one, bias;\n"
        "mov.b32 z, 0;\n"
        f"mov.b32 one, {one | one << 16};\n"
        f"mov.b32 bias, {bias | bias << 16};\n"
        "prmt.b32 t0, $4, z, 0x4140;\n"      # [b0, 0, b1, 0]
        "prmt.b32 t1, $4, z, 0x4342;\n"      # [b2, 0, b3, 0]
        "shr.u32 s0, t0, 4;\n"
        "shr.u32 s1, t1, 4;\n"
        f"lop3.b32 $0, t0, 0x000F000F, {magic | magic << 16}, {lut};\n"
        f"lop3.b32 $1, t1, 0x000F000F, {magic | magic << 16}, {lut};\n"
        f"lop3.b32 $2, s0, 0x000F000F, {magic | magic << 16}, {lut};\n"
        f"lop3.b32 $3, s1, 0x000F000F, {magic | magic << 16}, {lut};\n"
        f"{fma} $0, $0, one, bias;\n"
        f"{fma} $1, $1, one, bias;\n"
        f"{fma} $2, $2, one, bias;\n"
        f"{fma} $3, $3, one, bias;\n"
        "}")


def _asm8(dot: str, signed: bool) -> str:
    """PTX: 4 bytes of 8-bit codes ($2) -> 4 exact 16-bit floats ($0, $1). f16: one prmt puts
    two bytes under the exponent byte 0x64 (1024 + c); bf16 (7-bit mantissa) goes through
    f32 (0x4B0000 | c = 2**23 + c) and a packing convert. s8 flips the sign bit first."""
    flip = "xor.b32 w, $2, 0x80808080;\n" if signed else "mov.b32 w, $2;\n"
    if dot == "f16":
        bias = 0xE480 if signed else 0xE400  # -1152 | -1024
        return (
            "{ .reg .b32 w, m, t0, t1, one, bias;\n" + flip +
            "mov.b32 m, 0x64646464;\n"
            "mov.b32 one, 0x3C003C00;\n"
            f"mov.b32 bias, {bias | bias << 16};\n"
            "prmt.b32 t0, w, m, 0x4140;\n"
            "prmt.b32 t1, w, m, 0x4342;\n"
            "fma.rn.f16x2 $0, t0, one, bias;\n"
            "fma.rn.f16x2 $1, t1, one, bias;\n"
            "}")
    bias = "0f4B000080" if signed else "0f4B000000"  # 2**23 + 128 | 2**23
    return (
        "{ .reg .b32 w, m, f0, f1, f2, f3;\n" + flip +
        "mov.b32 m, 0x4B000000;\n"
        "prmt.b32 f0, w, m, 0x7650;\n"
        "prmt.b32 f1, w, m, 0x7651;\n"
        "prmt.b32 f2, w, m, 0x7652;\n"
        "prmt.b32 f3, w, m, 0x7653;\n"
        f"sub.f32 f0, f0, {bias};\n"
        f"sub.f32 f1, f1, {bias};\n"
        f"sub.f32 f2, f2, {bias};\n"
        f"sub.f32 f3, f3, {bias};\n"
        "cvt.rn.bf16x2.f32 $0, f1, f0;\n"
        "cvt.rn.bf16x2.f32 $1, f3, f2;\n"
        "}")


_A4_BF16_S = tl.constexpr(_asm4("bf16", True))
_A4_BF16_U = tl.constexpr(_asm4("bf16", False))
_A4_F16_S = tl.constexpr(_asm4("f16", True))
_A4_F16_U = tl.constexpr(_asm4("f16", False))
_A8_BF16_S = tl.constexpr(_asm8("bf16", True))
_A8_BF16_U = tl.constexpr(_asm8("bf16", False))
_A8_F16_S = tl.constexpr(_asm8("f16", True))
_A8_F16_U = tl.constexpr(_asm8("f16", False))


@triton.jit
def cvt4(c, SIGNED: tl.constexpr, ASM: tl.constexpr, DOT_DTYPE: tl.constexpr, PURE: tl.constexpr = True):
    """Low and high nibbles of uint8 codes as DOT_DTYPE values (two's complement if SIGNED).
    ASM (CUDA, 16-bit DOT_DTYPE): the magic-number PTX above; else shifts and a convert."""
    if ASM:
        if DOT_DTYPE == tl.bfloat16:
            return tl.inline_asm_elementwise(_A4_BF16_S if SIGNED else _A4_BF16_U, "=r,=r,=r,=r,r", [c],
                                             (tl.bfloat16, tl.bfloat16), PURE, 4)
        else:
            return tl.inline_asm_elementwise(_A4_F16_S if SIGNED else _A4_F16_U, "=r,=r,=r,=r,r", [c],
                                             (tl.float16, tl.float16), PURE, 4)
    else:
        if SIGNED:
            ci = c.to(tl.int8, bitcast=True)
            return ((ci << 4) >> 4).to(DOT_DTYPE), (ci >> 4).to(DOT_DTYPE)
        else:
            return (c & 15).to(DOT_DTYPE), (c >> 4).to(DOT_DTYPE)


@triton.jit
def cvt8(c, SIGNED: tl.constexpr, ASM: tl.constexpr, DOT_DTYPE: tl.constexpr, PURE: tl.constexpr = True):
    """8-bit codes (int8 if SIGNED else uint8) as exact DOT_DTYPE values."""
    if ASM:
        if DOT_DTYPE == tl.bfloat16:
            return tl.inline_asm_elementwise(_A8_BF16_S if SIGNED else _A8_BF16_U, "=r,=r,r", [c], tl.bfloat16, PURE, 4)
        else:
            return tl.inline_asm_elementwise(_A8_F16_S if SIGNED else _A8_F16_U, "=r,=r,r", [c], tl.float16, PURE, 4)
    else:
        return c.to(DOT_DTYPE)


# e4m3 -> f16, two codes per cvt. PURE = False pins a conversion where its codes were
# loaded: Triton moves a pure one behind the shared-memory load of the mma operand, where
# V's codes (k = keys, D bytes apart) are read byte by byte (LDS.U8 + PRMT per code); pinned,
# they load 16 bytes at a time, convert, and reach the mma as 16-bit floats through
# ldmatrix. Offline sm_90 SASS of the key loop: 131 on e4m3 643 instructions per 128 keys
# (1042 pure), 122 on s4 g64 951 per 32 keys (1197 pure). Time on the H200 (2026-12-02):
# 131 pinned at 122's speed on e4m3; 122 pinned 1.1-1.3x slower on s4 (decode_quant.py).
_E4M3_F16 = tl.constexpr("{ .reg .b16 lo, hi;\nmov.b32 {lo, hi}, $2;\n"
                         "cvt.rn.f16x2.e4m3x2 $0, lo;\ncvt.rn.f16x2.e4m3x2 $1, hi;\n}")


@triton.jit
def codes_f16(c, FP8: tl.constexpr, SIGNED: tl.constexpr):
    """8-bit codes (e4m3 if FP8, else int8 / uint8 as SIGNED says) as exact f16 values,
    pinned where they are loaded (see _E4M3_F16)."""
    if FP8:
        return tl.inline_asm_elementwise(_E4M3_F16, "=r,=r,r", [c.to(tl.uint8, bitcast=True)], tl.float16,
                                         False, 4)
    else:
        return cvt8(c, SIGNED, True, tl.float16, False)
