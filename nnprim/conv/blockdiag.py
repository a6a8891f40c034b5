"""Grouped convolution as dense tiles of whole groups: the block-diagonal filter the Gluon
forward / backward data kernels (gluon_conv.py, DIAG) multiply.

A tile of BN output channels holding whole groups (Kg output channels each) reads the
CB = BN / Kg * Cg input channels of the same groups; its filter block is [BN, taps, CB], the
filter entries where output and input channel share a group and zeros elsewhere. Packed
once per call into [K, taps * CB] (`pack`), the kernel runs it as a dense convolution with
CB input channels whose x boxes start at the tile's first input channel. Work: CB / Cg times
the grouped FLOPs (ResNeXt g32, Cg = Kg = 4, BN 64: 16x) in exchange for 64-wide wgmma
steps. Backward data packs the forward view's filter (`forward_view`: dy is x, dx is y):
rows are input channels, the taps flipped, the group roles swapped."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..problems.conv import ConvProblem

CB_CHOICES = (64, 128, 32, 16)    # input channels a tile: 64 first (128-byte rows, the least waste)
MIN_GROUP_WIDTH = 4               # Cg, Kg below this waste too much (depthwise has its own solvers)


@dataclass(frozen=True)
class DiagGeometry:
    """Output channels per tile BN (whole groups), their input channels CB, and the view's
    channels per group (Kg outputs, Cg inputs) of the convolution the kernel runs."""
    BN: int
    CB: int
    Kg: int
    Cg: int


def diag_geometry(fp: ConvProblem) -> DiagGeometry | None:
    """The tile of `fp` (a forward, possibly backward data's forward view) in whole groups:
    BN in 64/128/256 holding whole groups and CB = BN / Kg * Cg in CB_CHOICES (the first
    that fits); None when none fits or the groups are narrower than MIN_GROUP_WIDTH."""
    Kg, Cg = fp.K // fp.groups, fp.C // fp.groups
    if min(Kg, Cg) < MIN_GROUP_WIDTH:
        return None
    fits = [(bn, bn // Kg * Cg) for bn in (64, 128, 256) if bn % Kg == 0]
    for cb in CB_CHOICES:
        for bn, c in fits:
            if c == cb:
                return DiagGeometry(bn, cb, Kg, Cg)
    return None


@triton.jit
def _pack_kernel(w_ptr, out_ptr, E, T, CB, BN, Kg, Cg, wCg, BWD: tl.constexpr, BLOCK: tl.constexpr):
    """out[r, t, cb] (E = rows * T * CB entries, every one written): the filter entry of view
    output channel r and view input channel ci = (r // BN) * (BN // Kg) * Cg + cb at tap t
    when both are in r's group, else 0. w is the channels-last filter [K, T, wCg]; forward:
    w[r, t, ci - g*Cg]; backward data (BWD, r an input channel of the layer): w[ci, T-1-t, r - g*Kg]."""
    e = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = e < E
    cb = e % CB
    t = (e // CB) % T
    r = e // (CB * T)
    g = r // Kg
    ci = (r // BN) * (BN // Kg) * Cg + cb
    inside = (ci // Cg) == g
    if BWD:
        src = ci.to(tl.int64) * (T * wCg) + (T - 1 - t) * wCg + (r - g * Kg)
    else:
        src = r.to(tl.int64) * (T * wCg) + t * wCg + (ci - g * Cg)
    v = tl.load(w_ptr + src, mask=m & inside, other=0.0)
    tl.store(out_ptr + e, v, mask=m)


PACK_BLOCK = 1024


def pack_args(fp: ConvProblem, d: DiagGeometry, bwd: bool) -> tuple:
    """The scalar tail of `_pack_kernel` for the view `fp` (rows fp.K), entries first."""
    taps = 1
    for f in fp.filter:
        taps *= f
    w_cg = d.Kg if bwd else d.Cg    # the layer's filter holds C/groups channels per row
    return fp.K * taps * d.CB, taps, d.CB, d.BN, d.Kg, d.Cg, w_cg, bwd, PACK_BLOCK


def pack(w_phys: torch.Tensor, fp: ConvProblem, d: DiagGeometry, bwd: bool, out: torch.Tensor) -> torch.Tensor:
    """The block-diagonal filter [fp.K, taps * CB] of `fp` into `out` (contiguous) from the
    layer's channels-last filter `w_phys` (contiguous); one launch."""
    tail = pack_args(fp, d, bwd)
    _pack_kernel[(triton.cdiv(tail[0], PACK_BLOCK),)](w_phys, out, *tail)
    return out
