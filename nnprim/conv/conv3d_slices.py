"""3-D backward weights through the 2-D solvers: solver 36 `conv3d_via_2d_bwd_weights`, family
`implicit_gemm`.

The tensor-core kernels of the 2-D convolutions (Gluon 29, stream-K and split slices) have no
3-D twin, and Triton 22's 3-D path ran c3d_3x3x3's backward weights at 0.37x cuDNN on the
H200 (2026-12-02, fourteenth session). With stride and dilation 1 along the depth, the weight
gradient of depth tap fd is a 2-D weight gradient

    dW[:, :, fd] = sum over (n, od) of  wgrad2d(x[n, od + fd - pd_before], dy[n, od])

and all of them read the same dy. Both tensors are laid out once as one tall image (batch 1):
the N x Dp depth slices of x (Dp = D + the depth padding, the padding slices zero, FD - 1 zero
slices after the last image) stacked along H, each followed by `sep` zero rows (sep = the H
padding: a 2-D window never reaches into the next slice), and dy's slices at the same pitch
(zero past OD and OH). Then tap fd is ONE 2-D backward weights of the tall dy against the tall x
shifted by fd slices: the pairs (n, od) x (n, od + fd) line up, and every window that leaves a
slice reads zeros. FD launches of the 2-D solver (Gluon 29 where it applies, else Triton 22)
on the same plan, two copies in, FD small copies out. Work: the zero rows and slices add
(Dp / OD)(H + sep) / OH - 1 of the FLOPs (c3d_3x3x3: 15 %).

Scope: NDHWC (layout nhwc) 3-D, groups 1, bf16 / f16, depth stride and dilation 1, H stride 1
(the slices' pitch must stay the output's), any H dilation and padding, anything along W the
2-D solver takes. Workspace: the two tall images and the 2-D solver's own."""
from __future__ import annotations

import math

import torch

from ..args import ConvArgs
from ..problems.conv import ConvProblem, empty_in_layout
from ..search.solver import REGISTRY, Solver, register

COPY_BYTES_PER_S = 2.8e12   # the tall images' copies (as the layout changes, layout_change.py)
COPY_LAUNCH_S = 1.5e-5
_INNER = ("gluon_implicit_gemm_bwd_weights", "implicit_gemm_bwd_weights")


def geometry(p: ConvProblem) -> dict:
    """The tall images of p: sep (zero rows after each slice), R (rows per slice), Dp (slices
    per image), S (slices in all), rows / rows_out (the 2-D problem's input / output rows)."""
    (D, H, _), (pdb, ptop, _), (pda, pbot, _) = p.in_size, p.pad_before, p.pad_after
    OH = p.out_size[1]
    sep = max(ptop, pbot)
    R, Dp = H + sep, D + pdb + pda
    S = p.N * Dp
    return dict(sep=sep, R=R, Dp=Dp, S=S, rows=S * R, rows_out=S * R + OH - H)


def twin(p: ConvProblem) -> ConvProblem:
    """The 2-D backward weights that each depth tap runs (batch 1, the tall images)."""
    g = geometry(p)
    return ConvProblem.create("bwd_weights", (1, p.C, g["rows"], p.in_size[2]), (p.K, p.C, *p.filter[1:]),
                              dtype=p.dtype, layout="nhwc", device=p.device, stride=p.stride[1:],
                              padding=tuple(zip(p.pad_before[1:], p.pad_after[1:])), dilation=p.dilation[1:],
                              out_dtype=p.out_dtype)


def inner_solver(t: ConvProblem) -> Solver:
    """Gluon 29 where it takes the 2-D problem, else Triton 22."""
    for name in _INNER:
        s = REGISTRY.get(name)
        if s.is_applicable(t):
            return s
    return REGISTRY.get(_INNER[-1])


def _fill(buf: torch.Tensor, t: torch.Tensor, shape: tuple[int, ...], d0: int) -> None:
    """buf's first N*Dp*R rows as (N, Dp, R, cols, ch) slices: t's (N, D', H', cols, ch) at
    slices [d0, d0 + D') and rows [0, H'), zeros elsewhere (the padding slices, the separator
    rows, the rows past them); each element written once."""
    N, Dp, R = shape[:3]
    D, H = t.shape[1], t.shape[2]
    v = buf[:N * Dp * R].view(shape)
    v[:, d0:d0 + D, :H] = t
    v[:, :d0].zero_()
    v[:, d0 + D:].zero_()
    v[:, d0:d0 + D, H:].zero_()
    buf[N * Dp * R:].zero_()


class SlicesPlan:
    """Invoker: the tall images, FD launches of the 2-D plan, dW's depth taps filled."""

    def __init__(self, p: ConvProblem):
        self.p, self.g, self.t = p, geometry(p), twin(p)
        self.inner = inner_solver(self.t).prepare(self.t)

    def __call__(self, args: ConvArgs, out: torch.Tensor | None = None) -> torch.Tensor:
        p, g = self.p, self.g
        W, OW = p.in_size[2], p.out_size[2]
        FD, pdb, R, Dp, S = p.filter[0], p.pad_before[0], g["R"], g["Dp"], g["S"]
        dev = args.x.device
        # physical NDHWC (channels last) views of x (N, C, D, H, W) and dy (N, K, OD, OH, OW)
        x, dy = args.x.permute(0, 2, 3, 4, 1), args.dy.permute(0, 2, 3, 4, 1)
        xt = torch.empty(((S + FD - 1) * R, W, p.C), dtype=p.dtype, device=dev)
        _fill(xt, x, (p.N, Dp, R, W, p.C), pdb)
        rows_out = g["rows_out"]
        dyt = torch.empty((max(rows_out, S * R), OW, p.K), dtype=p.dtype, device=dev)
        _fill(dyt, dy, (p.N, Dp, R, OW, p.K), 0)
        dy2 = dyt[:rows_out].unsqueeze(0).permute(0, 3, 1, 2)           # (1, K, rows_out, OW), channels last
        if out is None:
            out = empty_in_layout(p.w_shape, p.layout, dtype=p.out_dtype, device=dev)
        for fd in range(FD):
            x2 = xt[fd * R:fd * R + g["rows"]].unsqueeze(0).permute(0, 3, 1, 2)   # slices fd.. of the tall x
            out[:, :, fd] = self.inner(ConvArgs(x=x2, dy=dy2))
        return out


@register
class Conv3dViaSlicesBwdWeights(Solver):
    """3-D backward weights as one 2-D backward weights per depth tap over tall images."""
    id = 36
    name = "conv3d_via_2d_bwd_weights"
    family = "implicit_gemm"
    primitive = "conv"
    directions = frozenset({"bwd_weights"})
    devices = frozenset({"cuda"})
    dtypes = frozenset({torch.bfloat16, torch.float16})
    uses_triton = True

    def not_supported_reasons(self, problem) -> list[str]:
        reasons = super().not_supported_reasons(problem)
        if reasons and reasons[0].startswith("serves"):
            return reasons
        p = problem
        if p.ndim != 3:
            return reasons + ["serves 3-D convolutions (1-D and 2-D run the 2-D solvers directly)"]
        if p.layout != "nhwc":
            reasons.append("layout nchw: NDHWC (channels last) only")
        if p.groups != 1:
            reasons.append(f"groups={p.groups}: groups 1 only")
        if p.stride[0] != 1 or p.dilation[0] != 1:
            reasons.append(f"depth stride {p.stride[0]} / dilation {p.dilation[0]}: both 1 only (the taps' "
                           "slices must pair od with od + fd)")
        if p.stride[1] != 1:
            reasons.append(f"H stride {p.stride[1]}: 1 only (the tall image's slices must keep the output's pitch)")
        if reasons:
            return reasons
        t = twin(p)
        return [f"2-D solver {inner_solver(t).name}: {r}" for r in inner_solver(t).not_supported_reasons(t)]

    def workspace_size(self, problem) -> int:
        """The tall x and dy (the solver's temporaries) and the 2-D solver's workspace."""
        p, g = problem, geometry(problem)
        e = torch.tensor([], dtype=p.dtype).element_size()
        tall = ((g["S"] + p.filter[0] - 1) * g["R"] * p.in_size[2] * p.C
                + max(g["rows_out"], g["rows"]) * p.out_size[2] * p.K)
        t = twin(p)
        return tall * e + inner_solver(t).workspace_size(t)

    def estimate(self, problem) -> float | None:
        t = twin(problem)
        inner = inner_solver(t).estimate(t)
        if inner is None:
            return None
        e = torch.tensor([], dtype=problem.dtype).element_size()
        copies = 2 * (math.prod(problem.x_shape) + math.prod(problem.y_shape)) * e    # read + written once
        return problem.filter[0] * inner + (copies / COPY_BYTES_PER_S + 4 * COPY_LAUNCH_S) * 1e3

    def prepare(self, problem):
        return SlicesPlan(problem)
