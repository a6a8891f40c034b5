"""Counter-based attention dropout: one definition, reproduced bit for bit by every solver.

For element (b, h, i, j) of the (B, Hq, Sq, Sk) probability matrix (h = query head):

    counter   = (offset + ((b * Hq + h) * Sq + i) * Sk + j) mod 2**64      (int64 arithmetic)
    r         = Philox4x32-10(key = (seed lo32, seed hi32),
                              counter words = (counter lo32, counter hi32, 0, 0))[0]   (uint32)
              = Triton's `tl.randint(seed, counter)` for an int64 counter
    threshold = min(floor(dropout_p * 2**32), 2**32 - 1)                  (unsigned 32-bit)
    keep      = r >= threshold

Kept probabilities are multiplied by 1 / (1 - dropout_p). Dropout applies to the
normalised softmax probabilities P, never to lse. The mask is a pure function of
(seed, offset, b, h, i, j): identical across solvers, devices and between forward and
backward.

Two implementations:
- `philox_randint` / `dropout_keep_block` / `dropout_keep_mask`: torch, vectorised, uint32
  words held in int64 tensors (works on CPU and CUDA, no overflow: 32x32-bit products are
  split into 16-bit halves).
- `dropout_keep`: a `@triton.jit` helper that kernels import and call on a tile of rows
  and columns; the uint32 values are compared as int64 (no signedness traps).

The seed is an int or a *device seed*: a one-element int64 tensor on q's device whose value
the kernels read (`dropout_keep` loads it). A CUDA graph that refills it on replay (a
captured `torch.randint` or `seed.random_()`) drops new positions on every replay, where an
int seed is baked into the captured launch. `seed_value` reads either on the host.
"""
from __future__ import annotations

import math
from pathlib import Path

import torch
import triton
import triton.language as tl

from .errors import BadParameterError
from .native import NATIVE_HELPERS, NativeLibrary

_M32 = 0xFFFFFFFF
_KEY_A = 0x9E3779B9
_KEY_B = 0xBB67AE85
_ROUND_A = 0xD2511F53
_ROUND_B = 0xCD9E8D57
_ROUNDS = 10


def dropout_threshold(p: float) -> int:
    """The unsigned 32-bit threshold: keep iff r >= threshold."""
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p < 1.0:
        raise BadParameterError(f"dropout_p={p!r} must be a float in [0, 1)")
    return min(math.floor(p * 2.0**32), 2**32 - 1)


def dropout_scale(p: float) -> float:
    """Multiplier of kept probabilities: 1 / (1 - p)."""
    return 1.0 / (1.0 - p)


def _mul_hi_lo(const: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi32, lo32) of the 64-bit product const * x for const, x < 2**32 (int64 tensors)."""
    x_lo = x & 0xFFFF
    x_hi = x >> 16
    p_lo = x_lo * const                      # < 2**48
    p_hi = x_hi * const                      # < 2**48
    hi = (p_hi + (p_lo >> 16)) >> 16          # floor(const * x / 2**32)
    lo = ((p_hi & 0xFFFF) << 16) + p_lo       # == const * x  (mod 2**32) after masking
    return hi & _M32, lo & _M32


def seed_value(seed) -> int:
    """The seed as an int (a device seed's value: a host sync on a GPU tensor, for the CPU
    solvers and the float64 reference)."""
    return int(seed.reshape(()).item()) if isinstance(seed, torch.Tensor) else seed


def check_device_seed(seed: torch.Tensor, device: torch.device) -> None:
    """A device seed: one int64 element on `device` (its value is not read: no sync)."""
    if seed.dtype != torch.int64 or seed.numel() != 1:
        raise BadParameterError(f"seed must be an int or a one-element int64 tensor, got a {seed.dtype} tensor "
                                f"of shape {tuple(seed.shape)}")
    if seed.device != device:
        raise BadParameterError(f"seed is on {seed.device} but q is on {device}")


def philox_randint(seed: int, counter: torch.Tensor) -> torch.Tensor:
    """Triton's `tl.randint(seed, counter)` for an int64 counter tensor: the first uint32
    word of Philox4x32-10, returned as int64 values in [0, 2**32)."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**64:
        raise BadParameterError(f"seed={seed!r} must be an int in [0, 2**64)")
    counter = counter.to(torch.int64)
    c0 = counter & _M32
    c1 = (counter >> 32) & _M32
    c2 = torch.zeros_like(c0)
    c3 = torch.zeros_like(c0)
    k0, k1 = seed & _M32, (seed >> 32) & _M32
    for _ in range(_ROUNDS):
        hi_b, lo_b = _mul_hi_lo(_ROUND_B, c2)
        hi_a, lo_a = _mul_hi_lo(_ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0 = (k0 + _KEY_A) & _M32
        k1 = (k1 + _KEY_B) & _M32
    return c0


def dropout_counter(offset: int, b, h, rows, cols, Hq: int, Sq: int, Sk: int) -> torch.Tensor:
    """counter = offset + ((b*Hq + h)*Sq + i)*Sk + j in int64 (wrapping mod 2**64); the
    index arguments are ints or int tensors that broadcast against each other."""
    def t(x):
        return x.to(torch.int64) if isinstance(x, torch.Tensor) else torch.tensor(x, dtype=torch.int64)
    b, h, rows, cols = t(b), t(h), t(rows), t(cols)
    dev = next((x.device for x in (b, h, rows, cols) if x.dim() > 0), b.device)
    b, h, rows, cols = (x.to(dev) for x in (b, h, rows, cols))
    return ((b * Hq + h) * Sq + rows) * Sk + cols + wrap64(offset)


def wrap64(v: int) -> int:
    """v mod 2**64 as a signed int64 value."""
    v &= (1 << 64) - 1
    return v - (1 << 64) if v >= 1 << 63 else v


_NATIVE = NativeLibrary("nnprim_cpu_dropout", NATIVE_HELPERS + Path(__file__).with_name("dropout_src.cpp").read_text(),
                        "native CPU dropout mask")


def _column_range(cols) -> tuple[int, int] | None:
    """(first, count) when `cols` is a run of consecutive key indices along the last dim only
    (how the CPU solvers and the reference index a block)."""
    if not isinstance(cols, torch.Tensor) or cols.dim() == 0 or cols.numel() != cols.shape[-1]:
        return None
    flat = cols.reshape(-1)
    c0, n = int(flat[0]), flat.numel()
    if not torch.equal(flat, torch.arange(c0, c0 + n, dtype=flat.dtype, device=flat.device)):
        return None
    return c0, n


def dropout_keep_block(seed: int, offset: int, b, h, rows, cols, Hq: int, Sq: int, Sk: int,
                       threshold: int) -> torch.Tensor:
    """Torch twin of the Triton `dropout_keep`: bool keep flags for broadcastable indices. On
    the CPU a block of consecutive key columns takes the native loop (dropout_src.cpp)."""
    seed = seed_value(seed)
    span = _column_range(cols)
    if span is not None and cols.device.type == "cpu":
        native = _NATIVE.ops()
        if native is not None:
            bases = dropout_counter(offset, b, h, rows, 0, Hq, Sq, Sk)
            if bases.dim() == cols.dim() and bases.shape[-1] == 1:
                flags = native.keep_rows(wrap64(seed), bases.reshape(-1), span[0], span[1], threshold)
                return flags.view(*bases.shape[:-1], span[1])
    r = philox_randint(seed, dropout_counter(offset, b, h, rows, cols, Hq, Sq, Sk))
    return r >= threshold


def dropout_keep_mask(seed: int, offset: int, B: int, Hq: int, Sq: int, Sk: int, p: float,
                      device=None, *, batches: slice | None = None,
                      heads: slice | None = None, rows: slice | None = None) -> torch.Tensor:
    """Bool keep mask of shape (B, Hq, Sq, Sk) (or the sub-block batches x heads x rows,
    still indexed globally). p == 0 keeps everything."""
    bs = range(B)[batches or slice(None)]
    hs = range(Hq)[heads or slice(None)]
    rs = range(Sq)[rows or slice(None)]
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if p == 0:
        return torch.ones(len(bs), len(hs), len(rs), Sk, dtype=torch.bool, device=dev)
    thr = dropout_threshold(p)
    b = torch.arange(bs.start, bs.stop, bs.step, device=dev).view(-1, 1, 1, 1)
    h = torch.arange(hs.start, hs.stop, hs.step, device=dev).view(1, -1, 1, 1)
    i = torch.arange(rs.start, rs.stop, rs.step, device=dev).view(1, 1, -1, 1)
    j = torch.arange(Sk, device=dev).view(1, 1, 1, -1)
    return dropout_keep_block(seed, offset, b, h, i, j, Hq, Sq, Sk, thr)


@triton.jit
def dropout_keep(seed, offset, b, h, rows, cols, Hq, Sq, Sk, threshold):
    """Keep flags (bool block) for query indices `rows` and key indices `cols`, which must
    broadcast against each other (e.g. offs_m[:, None], offs_n[None, :], or the transpose
    in a backward kernel that walks keys as rows). `b`, `h` (query head) are scalars;
    `threshold` = dropout_threshold(p) passed as an int. The counter is built in int64, so
    `tl.randint` uses both counter words exactly as the torch implementation does. `seed`:
    an int, or a pointer to a device seed (loaded here; the kernel compiles once per kind)."""
    if seed.dtype.is_ptr():
        seed = tl.load(seed)
    base = (tl.cast(b, tl.int64) * Hq + tl.cast(h, tl.int64)) * Sq
    counter = (base + tl.cast(rows, tl.int64)) * Sk + tl.cast(cols, tl.int64) + tl.cast(offset, tl.int64)
    r = tl.randint(seed, counter)
    return tl.cast(r, tl.int64) >= tl.cast(threshold, tl.int64)
