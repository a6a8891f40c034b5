"""CPU per-tap convolution backward weights (family `gemm`, id 13 `CpuTapBwdWeights`):
one GEMM per filter tap over ALL output positions, no im2col, for bf16 inputs and output
on CPUs with native bf16 (avx512_bf16 / amx_bf16); any stride, dilation, padding, groups.

Math (groups G, Kg = K/G, Cg = C/G; per spatial dim: padded size P = in + pad_before +
pad_after, stride s, phase grid U = ceil(P / s), flattened with strides us):
  x phase rho (one per combination of rho_i < s_i), channel-major or position-major:
          X_rho[c, n, u] = x_pad[n, c, u*s + rho]      (zero outside x; zero slack after)
  dy_wide (K, N*prod(U))  dy on the phase grid, zero where o_i >= out_i
  tap f:  rho_f = f*d mod s, off_f = sum_i (f_i*d_i div s_i) * us_i
          dw[g*Kg + k, c, f] = sum_q dy_wide[g*Kg + k, q] * X_rho_f[g*Cg + c, q + off_f]
since x_pad[o*s + f*d] = X_{f*d mod s}[o + f*d div s]. A valid position (o_i < out_i) reads
inside its own image row (o + f*d div s <= (P - 1) div s < U); junk positions read
finite values (staged x or zeros) times dy = 0. Stride 1 is one phase, U = P.

Each dw element is ONE GEMM's output: the bf16 GEMM (oneDNN, f32 accumulation inside
over all N*prod(U) positions) rounds once, to the result's dtype -- the contract's f32
accumulation, unlike a per-block bf16 GEMM whose partials are rounded before they are
summed. Both operands are plain views (row stride = a phase's row length), so torch.mm
reads them in place. Against the im2col GEMM (solver 12): no column buffer (F x the
input), the native bf16 GEMM instead of the f32 one; the extra work is the junk
positions ((prod(U) - prod(out)) / prod(out): 7 % on a padded 56x56 3x3).
Grouped problems (G > 1) copy the taps' columns of a chunk of groups (whole phase rows:
long contiguous runs) and run ONE batched GEMM per chunk, dw^T[g] = col[g] . dy[g]^T, a
reduction of N*prod(U) into a (Cg*F) x Kg output: the per-group per-tap GEMMs (Kg x Cg
outputs, G x F calls) ran at a third of its speed (grouped_g8: 4.4 -> ~1.7 ms).
On AMX CPUs (measured there only; avx512_bf16 alone keeps the paths above):
- narrow ungrouped stride-1 problems (`replicas`) replicate the x rows once per tap of the
  last filter dim (REP[c, j, q] = X[c, q + j*d], one shifted copy each), so the taps of one
  filter row are ONE GEMM over a plain view: channel-major the rows (c, j) are REP's rows at
  a uniform stride, position-major the columns (j, c) are REP's. A C-wide GEMM output
  becomes filter[-1]*C wide: 64 x 32 outputs run at 110-150 GFLOP/s, 64 x 96 at 230-400;
  64 x 64 at 300-340, 64 x 192 at 390-520;
- wide nhwc problems stage dy channel-major (`dy_channel_major`): row-major GEMM operands.
f32 is not served: the f32 GEMM with a reduction of N*prod(U) and a 64x64 output runs at
half the speed of the im2col GEMM's (benchmarks/CPU_SPEED.md), and f16 has no native GEMM."""
from __future__ import annotations

import itertools
import math

import torch

from ..args import ConvArgs
from ..problems.conv import ConvProblem, empty_in_layout
from ..search.solver import Solver, register
from .cpu_gemm import cpu_has_amx, cpu_has_native_bf16, workspace
from .cpu_im2col import physical

_ALIGN = 64
MAX_WORKSPACE = 1 << 30     # staged copies of x and dy; above this the blocked im2col solver 12
GROUP_COL_BYTES = 64 << 20  # grouped problems: tap columns of one batched GEMM
_CALL_MS = 0.025            # host + oneDNN dispatch per GEMM call (measured 20-30 us)
REPLICATE_MAX_C = 128       # narrower inputs get x replicated per last-dim tap (see above);
REPLICATE_MAX_C_NCHW = 64   # channel-major 64 x 64 per-tap GEMMs already run near the wide ones
DY_CM_MIN_CF = 1024         # nhwc: dy staged channel-major from this C * F on (dy_channel_major)


def tap_grid(p: ConvProblem) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    """(phase image sizes U = ceil(P / stride), their row-major strides us, prod(U)),
    P = the padded input size. Stride 1: U = P."""
    U = tuple(-(-(i + a + b) // s) for i, a, b, s in zip(p.in_size, p.pad_before, p.pad_after, p.stride))
    us = [1] * len(U)
    for i in range(len(U) - 2, -1, -1):
        us[i] = us[i + 1] * U[i + 1]
    return U, tuple(us), math.prod(U)


def phase_list(p: ConvProblem) -> list[tuple[int, ...]]:
    """The phases of x (residues of the padded input positions mod the stride) that filter
    taps read: at most prod(min(filter, stride)), not prod(stride) (a stride of 10^6 made
    that a list of 10^12 before any solver ran)."""
    return list(itertools.product(*(sorted({f * d % s for f in range(n)})
                                     for n, d, s in zip(p.filter, p.dilation, p.stride))))


def tap_offsets(p: ConvProblem) -> list[tuple[int, int]]:
    """(phase index, flat offset on the phase grid) of each filter tap, taps in row-major
    filter order: tap f reads x_pad[o*s + f*d] = phase (f*d mod s) at o + (f*d div s)."""
    _, us, _ = tap_grid(p)
    index = {ph: i for i, ph in enumerate(phase_list(p))}
    out = []
    for fi in itertools.product(*(range(f) for f in p.filter)):
        fd = [f * d for f, d in zip(fi, p.dilation)]
        ph = tuple(v % s for v, s in zip(fd, p.stride))
        out.append((index[ph], sum((v // s) * u for v, s, u in zip(fd, p.stride, us))))
    return out


def replicas(p: ConvProblem) -> int:
    """Copies of x, one per tap of the last filter dim (1: none): ungrouped, stride 1,
    fewer than REPLICATE_MAX_C input channels (REPLICATE_MAX_C_NCHW for nchw, staged
    channel-major), a last filter dim > 1. Measured at 1 thread (AMX): c3d_small (C = 32)
    nchw 11.2 -> 7.6 ms, rn50_r2 nhwc (C = 64) 13.2 -> 11.8, rn50_r2 nchw 7.2 -> 7.7 (kept off)."""
    cap = REPLICATE_MAX_C_NCHW if p.layout == "nchw" else REPLICATE_MAX_C
    if (not cpu_has_amx() or p.groups != 1 or any(s != 1 for s in p.stride) or p.C >= cap
            or p.filter[-1] == 1):
        return 1
    return p.filter[-1]


def dy_channel_major(p: ConvProblem) -> bool:
    """Stage dy channel-major (K, mt) also for nhwc (x stays position-major): each tap's GEMM
    is then dy (K, mt) . X (mt, C), both operands row-major, 25-30 % faster on AMX than
    X^T . dy (300 vs 400 GFLOP/s at 64 x 64); the transposing dy copy (~1.6 GB/s image by
    image) pays when the taps' GEMMs are large against it, C * F >= DY_CM_MIN_CF (rn50_r3 s2
    nhwc, C*F = 1152: 13.1 -> 11.7 ms; rn50_r2 nhwc, 576, with the 4x slower whole-tensor
    copy: 14.4 -> 20.8 ms). Ungrouped, without replicas, AMX only."""
    return (p.layout == "nhwc" and p.groups == 1 and cpu_has_amx() and replicas(p) == 1
            and p.C * math.prod(p.filter) >= DY_CM_MIN_CF)


def _sizes(p: ConvProblem) -> tuple[int, int, int]:
    """(elements of the x phases (with their replicas), of dy_wide, row length of one x phase)."""
    _, _, ut = tap_grid(p)
    mt = p.N * ut
    row = mt + max(o for _, o in tap_offsets(p))
    return len(phase_list(p)) * p.C * row * replicas(p), p.K * mt, row


def _bytes(n: int, dt: torch.dtype) -> int:
    return -(-n * dt.itemsize // _ALIGN) * _ALIGN


def _group_chunk(p: ConvProblem) -> int:
    """Groups per batched GEMM of the grouped path (0: per-group GEMMs, no column buffer):
    as many as keep the tap columns under GROUP_COL_BYTES."""
    if p.groups == 1:
        return 0
    _, _, ut = tap_grid(p)
    per_group = (p.C // p.groups) * len(tap_offsets(p)) * p.N * ut * p.dtype.itemsize
    return min(p.groups, GROUP_COL_BYTES // per_group)


def workspace_bytes(p: ConvProblem) -> int:
    nx, ndy, _ = _sizes(p)
    _, _, ut = tap_grid(p)
    col = _group_chunk(p) * (p.C // p.groups) * len(tap_offsets(p)) * p.N * ut
    return _bytes(nx, p.dtype) + _bytes(ndy, p.dtype) + _bytes(col, p.dtype)


def phase_copy(p: ConvProblem, ph: tuple[int, ...]) -> tuple[tuple[slice, ...], tuple[slice, ...]] | None:
    """(destination slices on the phase grid, source slices of x) of phase ph:
    phase[u] = x_pad[u*s + rho] = x[u*s + rho - pb] where that is inside x; None if empty."""
    dst, src = [], []
    for rho, s, pb, n, U in zip(ph, p.stride, p.pad_before, p.in_size, tap_grid(p)[0]):
        lo = max(0, -(-(pb - rho) // s))
        hi = min(U - 1, (n - 1 + pb - rho) // s)
        if hi < lo:
            return None
        i0 = lo * s + rho - pb
        dst.append(slice(lo, hi + 1))
        src.append(slice(i0, i0 + (hi - lo) * s + 1, s))
    return tuple(dst), tuple(src)


def _copy_channel_major(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst.copy_(src) for (C, N, ..) views; a channels-last src (a transposition) is copied
    image by image: torch's copy of the whole 4-D transposed view ran 4x slower (8.1 vs
    2.0 ms for an 8x64x56x56 bf16 dy)."""
    if src.dim() > 2 and src.stride(0) == 1 and src.shape[0] > 1:
        for n in range(src.shape[1]):
            dst[:, n].copy_(src[:, n])
    else:
        dst.copy_(src)


def _stage(p: ConvProblem, x: torch.Tensor, dy: torch.Tensor, ws: torch.Tensor, pm: bool
           ) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor | None]:
    """The x phases (one zero-padded, stride-split image grid per phase: (phases, row, C)
    position-major for nhwc inputs, (phases, C, row) channel-major for nchw: the copies
    stay row / plane wise) and dy_wide ((N*prod(U), K) or (K, N*prod(U)); the latter also
    for nhwc when dy_channel_major) in the workspace. Both are zeroed whole (halo, junk and
    slack; one memset each), then filled.
    With replicas (one phase): also REP, (row, r, C) or (C, r, row), whose replica 0 is
    the x phase and replica j holds it shifted by j*d (the zeroed tail is the slack)."""
    U, _, ut = tap_grid(p)
    nx, ndy, row = _sizes(p)
    mt = p.N * ut
    nph = len(phase_list(p))
    r = replicas(p)
    xbuf = ws[:nx * p.dtype.itemsize].view(p.dtype)
    off = _bytes(nx, p.dtype)
    dbuf = ws[off:off + ndy * p.dtype.itemsize].view(p.dtype)
    dbuf.zero_()
    valid = tuple(slice(0, o) for o in p.out_size)
    xs = physical(x, "nhwc") if pm else x.transpose(0, 1)       # (N, sp.., C) | (C, N, sp..)
    rep = None
    if r > 1:   # replicas 1.. are overwritten but for their tails: zero replica 0 and those
        rep = xbuf.view(row, r, p.C) if pm else xbuf.view(p.C, r, row)
        xp = rep[:, 0].unsqueeze(0)                 # (1, row, C) | (1, C, row)
        xp.zero_()
        for j in range(1, r):
            (rep[row - j * p.dilation[-1]:, j] if pm else rep[:, j, row - j * p.dilation[-1]:]).zero_()
    else:
        xbuf.zero_()
        xp = xbuf.view(nph, row, p.C) if pm else xbuf.view(nph, p.C, row)
    if pm and not dy_channel_major(p):
        dyw = dbuf.view(mt, p.K)
        dyw.view(p.N, *U, p.K)[(slice(None), *valid)].copy_(physical(dy, "nhwc"))
    else:
        dyw = dbuf.view(p.K, mt)
        _copy_channel_major(dyw.view(p.K, p.N, *U)[(slice(None), slice(None), *valid)], dy.transpose(0, 1))
    for i, ph in enumerate(phase_list(p)):
        cp = phase_copy(p, ph)
        if cp is None:
            continue
        dst, src = cp
        if pm:
            xp[i, :mt].view(p.N, *U, p.C)[(slice(None), *dst)].copy_(xs[(slice(None), *src)])
        else:
            _copy_channel_major(xp[i, :, :mt].view(p.C, p.N, *U)[(slice(None), slice(None), *dst)],
                                xs[(slice(None), slice(None), *src)])
    d = p.dilation[-1]
    for j in range(1, r):       # replica j = the phase shifted by j*d (long contiguous runs)
        if pm:
            rep[:row - j * d, j].copy_(rep[j * d:, 0])
        else:
            rep[:, j, :row - j * d].copy_(rep[:, 0, j * d:])
    return xp, dyw, mt, rep


def _grouped(p: ConvProblem, xp: torch.Tensor, dyw: torch.Tensor, mt: int, ws: torch.Tensor,
             gc: int) -> torch.Tensor:
    """Grouped problems: the taps' columns of gc groups, col[g, c, f, q] = X_rho_f[g*Cg + c,
    q + off_f] (contiguous copies of whole phase rows: long runs, cheap), then ONE batched
    GEMM per chunk dw^T[g] (Cg*F, Kg) = col[g] (Cg*F, mt) . dy_wide[g]^T (mt, Kg): a
    16-wide per-group GEMM per tap runs at a third of the speed of this K = Cg*F one.
    Each dw element is still one GEMM's output (one rounding). Returns (G, Cg*F, Kg)."""
    G, Kg, Cg = p.groups, p.K // p.groups, p.C // p.groups
    taps = tap_offsets(p)
    F = len(taps)
    nx, ndy, row = _sizes(p)
    off = _bytes(nx, p.dtype) + _bytes(ndy, p.dtype)
    col = ws[off:off + gc * Cg * F * mt * p.dtype.itemsize].view(p.dtype).view(gc * Cg, F, mt)
    out = torch.empty(G, Cg * F, Kg, dtype=p.out_dtype)
    d3 = dyw.view(G, Kg, mt)
    one_phase = len(phase_list(p)) == 1
    _, us, _ = tap_grid(p)
    for g0 in range(0, G, gc):
        g1 = min(G, g0 + gc)
        cc = slice(g0 * Cg, g1 * Cg)
        c = col[:(g1 - g0) * Cg]
        if one_phase:   # stride 1: the taps' offsets are affine in the tap index
            src = xp[0, cc]
            c.view(-1, *p.filter, mt).copy_(src.as_strided(
                (src.shape[0], *p.filter, mt), (row, *(d * u for d, u in zip(p.dilation, us)), 1),
                src.storage_offset()))
        else:
            for t, (ph, o) in enumerate(taps):
                c[:, t].copy_(xp[ph, cc, o:o + mt])
        torch.bmm(c.view(g1 - g0, Cg * F, mt), d3[g0:g1].transpose(1, 2), out=out[g0:g1])
    return out


def _replicated(p: ConvProblem, rep: torch.Tensor, dyw: torch.Tensor, mt: int, pm: bool) -> torch.Tensor:
    """One GEMM per filter row (the taps of the last filter dim at once) on REP (_stage):
    channel-major dw[k, (c, j)] = dy_wide (K, mt) . REP[(c, j), q + off]^T, position-major
    dw[k, (j, c)] = dy_wide^T (K, mt) . REP[q + off, (j, c)]; off = the row's first tap."""
    r = rep.shape[1]
    offs = [o for _, o in tap_offsets(p)][::r]       # first tap of each filter row
    if pm:
        flat = rep.view(rep.shape[0], r * p.C)
        out = torch.empty(len(offs), p.K, r, p.C, dtype=p.out_dtype)
        for t, o in enumerate(offs):      # (K, mt) . (mt, r*C): 5-80 % faster than dw^T
            torch.mm(dyw.t(), flat[o:o + mt], out=out[t].view(p.K, r * p.C))
        src = out.permute(1, 3, 0, 2)                 # (K, C, rows, r)
    else:
        flat = rep.view(p.C * r, rep.shape[2])
        out = torch.empty(len(offs), p.K, p.C, r, dtype=p.out_dtype)
        for t, o in enumerate(offs):
            torch.mm(dyw, flat[:, o:o + mt].t(), out=out[t].view(p.K, p.C * r))
        src = out.permute(1, 2, 0, 3)                 # (K, C, rows, r)
    dw = empty_in_layout(p.w_shape, p.layout, dtype=p.out_dtype)
    dw.copy_(src.reshape(p.K, p.C, *p.filter))
    return dw


def tap_bwd_weights(p: ConvProblem, args: ConvArgs, ws: torch.Tensor) -> torch.Tensor:
    G, Kg, Cg = p.groups, p.K // p.groups, p.C // p.groups
    gc = _group_chunk(p)
    pm = p.layout == "nhwc" and not gc     # the grouped path stages channel-major
    xp, dyw, mt, rep = _stage(p, args.x, args.dy, ws, pm)
    dycm = dy_channel_major(p)
    taps = tap_offsets(p)
    F = len(taps)
    nd = p.ndim
    if rep is not None:
        return _replicated(p, rep, dyw, mt, pm)
    if gc:
        dwt = _grouped(p, xp, dyw, mt, ws, gc).view(G, Cg, *p.filter, Kg)
        dw = empty_in_layout(p.w_shape, p.layout, dtype=p.out_dtype)
        dw.unflatten(0, (G, Kg)).copy_(dwt.permute(0, nd + 2, *range(1, nd + 2)))
        return dw
    # torch.mm (oneDNN's bf16 matmul) takes the transposed, row-strided views in place.
    out = torch.empty(F, G, Kg, Cg, dtype=p.out_dtype)      # tap-major dw pieces
    outt = out.view(F, G, Cg, Kg)                            # position-major: dw^T pieces
    for t, (ph, o) in enumerate(taps):
        for g in range(G):
            ck, kk = slice(g * Cg, (g + 1) * Cg), slice(g * Kg, (g + 1) * Kg)
            if pm and dycm:     # (Kg, mt) . (mt, Cg)
                torch.mm(dyw[kk], xp[ph, o:o + mt, ck], out=out[t, g])
            elif pm:    # (Cg, mt) . (mt, Kg)
                torch.mm(xp[ph, o:o + mt, ck].t(), dyw[:, kk], out=outt[t, g])
            else:     # (Kg, mt) . (mt, Cg)
                torch.mm(dyw[kk], xp[ph, ck, o:o + mt].t(), out=out[t, g])
    src = (outt.transpose(2, 3) if pm and not dycm else out).reshape(*p.filter, p.K, Cg)
    dw = empty_in_layout(p.w_shape, p.layout, dtype=p.out_dtype)
    if p.layout == "nchw":
        dw.copy_(src.permute(nd, nd + 1, *range(nd)))
    else:   # physical (K, filter.., Cg)
        physical(dw, "nhwc").copy_(src.permute(nd, *range(nd), nd + 1))
    return dw


@register
class CpuTapBwdWeights(Solver):
    id = 13
    name = "CpuTapBwdWeights"
    family = "gemm"
    primitive = "conv"
    directions = frozenset({"bwd_weights"})
    devices = frozenset({"cpu"})
    dtypes = frozenset({torch.bfloat16})

    def not_supported_reasons(self, p: ConvProblem) -> list[str]:
        reasons = super().not_supported_reasons(p)
        if math.prod(p.stride) > 16:
            reasons.append(f"stride={p.stride}: more than 16 input phases")
        if p.out_dtype != p.dtype:
            reasons.append(f"out_dtype={p.out_dtype}: the bf16 GEMM output is the result (bf16 only)")
        if not cpu_has_native_bf16():
            reasons.append("CPU without avx512_bf16/amx_bf16: no native bf16 GEMM")
        if p.C // p.groups < 8 or p.K // p.groups < 8:
            reasons.append(f"groups={p.groups}: per-group GEMMs under 8x8 (the im2col GEMM is faster)")
        elif not reasons and workspace_bytes(p) > MAX_WORKSPACE:
            reasons.append(f"workspace {workspace_bytes(p)} bytes (staged x and dy) > {MAX_WORKSPACE}")
        return reasons

    def workspace_size(self, p: ConvProblem) -> int:
        return workspace_bytes(p)

    def estimate(self, p: ConvProblem) -> float:
        # native bf16 GEMM at ~150 GFLOP/s per core on these reduction-heavy shapes (measured
        # 130-210, plus the junk positions), staging (zero + copy) at ~8 GB/s per core, and
        # the per-call cost of G x F small GEMMs (g32 with Cg = 8: slower than solver 12).
        cores = max(1, torch.get_num_threads())
        _, _, pt = tap_grid(p)
        junk = pt / max(1, math.prod(p.out_size))
        t = p.flops() * junk / (150e9 * cores) + 2.0 * workspace_bytes(p) / (8e9 * cores)
        gc, F = _group_chunk(p), len(tap_offsets(p))
        # F GEMMs per group, or per chunk of groups one GEMM + the column copies
        calls = F * p.groups if not gc else -(-p.groups // gc) * (2 if len(phase_list(p)) == 1 else 1 + F)
        return t * 1e3 + _CALL_MS * calls

    def prepare(self, p: ConvProblem):
        nbytes = workspace_bytes(p)

        def invoke(args: ConvArgs) -> torch.Tensor:
            with workspace(nbytes) as ws:
                return tap_bwd_weights(p, args, ws)
        return invoke


__all__ = ["CpuTapBwdWeights", "tap_bwd_weights", "tap_offsets", "workspace_bytes"]
