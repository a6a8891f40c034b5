"""Backward data of a strided convolution as stride-1 forward convolutions, one per output
phase (sub-pixel decomposition), for the CPU GEMM solvers (`cpu_gemm.py`): no col2im,
and every dx element comes out of ONE GEMM (the native bf16 GEMM's single rounding is
the result's, as the contract's f32 accumulation asks).

Per spatial dim (input I, stride s, dilation d, pad_before pb, filter R, output O):
  dx[i] = sum over (o, f) with o*s + f*d - pb = i of w[f] dy[o].
The positions i with (i + pb) mod s = rho form a phase: i = i0 + s*j, i0 = (rho - pb) mod s,
j < J = ceil((I - i0) / s). Only taps with f*d = rho (mod s) reach it: f = f0 + m*D,
D = s / gcd(s, d); their dy offsets step by d' = d / gcd(s, d). Flipping the taps,
  dx[i0 + s*j] = sum_m w[f_last - m*D] dy[j - pad + m*d'],   pad = (f_last*d - i0 - pb) / s
a stride-1 forward correlation of dy (dilation d', padding pad before and J - O - pad +
d'*(taps - 1) after; a negative pad crops dy instead). A phase no tap reaches
(possible when d shares a factor with s) is zero. Phases of all dims combine as a product."""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

from ..problems.conv import ConvProblem


@dataclass(frozen=True)
class DimPhase:
    """One phase of one spatial dim."""

    i0: int                  # first dx index of the phase (step: the stride)
    J: int                   # dx positions of the phase
    taps: tuple[int, ...]    # filter taps, in the sub-filter's (flipped) order
    crop: tuple[int, int]    # dy[crop0 : O - crop1] is the sub-convolution's input
    pad: tuple[int, int]     # its padding (>= 0)
    dil: int                 # its dilation


@dataclass(frozen=True)
class Phase:
    dims: tuple[DimPhase, ...]
    fwd: ConvProblem | None  # None: no tap reaches the phase (its dx is zero)


def _dim_phases(I: int, O: int, s: int, d: int, pb: int, R: int) -> list[DimPhase]:
    out = []
    g = math.gcd(s, d)
    for rho in range(s):
        i0 = (rho - pb) % s
        J = -(-(I - i0) // s) if I > i0 else 0
        if J == 0:
            continue
        taps = [f for f in range(R) if (f * d) % s == rho]
        if not taps:
            out.append(DimPhase(i0, J, (), (0, 0), (0, 0), 1))
            continue
        taps = taps[::-1]                          # flipped: f_last first
        dil = d // g
        before = (taps[0] * d - i0 - pb) // s      # exact: taps[0]*d = rho = i0 + pb (mod s)
        after = J - O - before + dil * (len(taps) - 1)
        crop = (max(0, -before), max(0, -after))
        out.append(DimPhase(i0, J, tuple(taps), crop, (max(0, before), max(0, after)), dil))
    return out


def phases(p: ConvProblem) -> list[Phase] | None:
    """The phases of backward data problem p (stride > 1 in some dim), or None when a
    phase's sub-convolution would read no dy (every phase then has to be handled by
    col2im; rare: padding far beyond the filter span)."""
    per_dim = [_dim_phases(I, O, s, d, pb, R) for I, O, s, d, pb, R in
               zip(p.in_size, p.out_size, p.stride, p.dilation, p.pad_before, p.filter)]
    res = []
    Kg = p.K // p.groups
    for combo in itertools.product(*per_dim):
        if any(not dp.taps for dp in combo):
            res.append(Phase(combo, None))
            continue
        size = [O - c0 - c1 for O, (c0, c1) in zip(p.out_size, (dp.crop for dp in combo))]
        if min(size) <= 0:
            return None
        fp = ConvProblem.create(
            "fwd", (p.N, p.K, *size), (p.C, Kg, *(len(dp.taps) for dp in combo)),
            dtype=p.dtype, out_dtype=p.out_dtype, layout=p.layout, device=p.device, stride=1,
            padding=tuple(dp.pad for dp in combo), dilation=tuple(dp.dil for dp in combo),
            groups=p.groups)
        if tuple(fp.out_size) != tuple(dp.J for dp in combo):
            return None
        res.append(Phase(combo, fp))
    return res


def phase_weight(p: ConvProblem, w: torch.Tensor, ph: Phase) -> torch.Tensor:
    """The sub-filter of phase ph: wt[g*Cg + c, k, m..] = w[g*Kg + k, c, taps[m]..]."""
    G, Kg = p.groups, p.K // p.groups
    sub = w
    for i, dp in enumerate(ph.dims):
        sub = sub.index_select(2 + i, torch.tensor(dp.taps, dtype=torch.long, device=w.device))
    sub = sub.unflatten(0, (G, Kg)).transpose(1, 2)           # (G, Cg, Kg, taps..)
    return sub.reshape(p.C, Kg, *sub.shape[3:])


def phase_dy(dy: torch.Tensor, ph: Phase) -> torch.Tensor:
    """The (cropped) dy the phase's sub-convolution reads (logical view)."""
    idx = (slice(None), slice(None), *(slice(dp.crop[0], dy.shape[2 + i] - dp.crop[1])
                                       for i, dp in enumerate(ph.dims)))
    return dy[idx]


def phase_dx(dx: torch.Tensor, ph: Phase, stride: tuple[int, ...]) -> torch.Tensor:
    """The phase's positions of dx (logical strided view)."""
    idx = (slice(None), slice(None), *(slice(dp.i0, dp.i0 + s * (dp.J - 1) + 1, s)
                                       for dp, s in zip(ph.dims, stride)))
    return dx[idx]


__all__ = ["Phase", "DimPhase", "phases", "phase_weight", "phase_dy", "phase_dx"]
