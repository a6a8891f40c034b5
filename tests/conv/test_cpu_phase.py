"""Strided backward data as per-phase stride-1 forward convolutions (cpu_phase, used by
solver 11) against the float64 reference: NaN-poisoned outputs and workspace, odd
sizes, dilation sharing a factor with the stride (phases no tap reaches), padding past
the filter span (cropped dy), groups, 1D/3D, both layouts; bf16 within ~one rounding."""

import pytest
import torch

from nnprim.args import ConvArgs
from nnprim.conv import cpu_gemm
from nnprim.conv.cpu_gemm import CpuGemmConfig, make_plan, prepare_with
from nnprim.conv.reference import reference
from nnprim.problems.conv import ConvProblem, to_layout

from . import solver_check

SHAPES = {
    "s2_3x3_pad1": ((2, 5, 9, 11), (4, 5, 3, 3), dict(stride=2, padding=1)),
    "s2_d2_gaps": ((1, 3, 9, 8), (4, 3, 3, 2), dict(stride=2, dilation=2, padding=(2, 1))),
    "s3_pad_over_span": ((2, 4, 10, 7), (6, 2, 2, 3), dict(stride=(3, 2), padding=((2, 3), (0, 1)), groups=2)),
    "s2_1x1_tail": ((2, 8, 7, 6), (6, 8, 1, 1), dict(stride=2)),
    "s4_k3_d3": ((1, 2, 13), (3, 2, 3), dict(stride=4, dilation=3, padding=((1, 2),))),
    "3d_mixed": ((1, 4, 5, 6, 7), (4, 2, 3, 2, 3), dict(stride=(2, 1, 3), padding=(1, 0, 2), groups=2)),
}


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    solver_check.poison_cpu(monkeypatch, cpu_gemm)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_strided_bwd_data(shape, layout, dtype):
    xs, wsh, kw = SHAPES[shape]
    p = ConvProblem.create("bwd_data", xs, wsh, dtype=dtype, layout=layout, **kw)
    # "auto" takes the phases with the native bf16 GEMM only; "on" forces them
    assert make_plan(p, CpuGemmConfig(phases="on")).phases is not None
    g = torch.Generator().manual_seed(1)

    def rnd(s):
        t = torch.randn(s, generator=g)
        return to_layout(torch.where(t.abs() < 0.05, torch.full_like(t, 0.3), t).to(dtype), layout)

    args = ConvArgs(x=rnd(p.x_shape), w=rnd(p.w_shape), dy=rnd(p.y_shape))
    for cfg in (CpuGemmConfig(phases="on"), CpuGemmConfig(block_bytes=900, threads="pool", nthr=2, phases="on")):
        out = prepare_with(p, cfg)(args)
        ref = reference(p, args)
        assert tuple(out.shape) == p.x_shape and out.dtype == dtype
        assert not out.isnan().any(), "unwritten (NaN) elements"
        err = ((out.double() - ref).norm() / ref.norm()).item()
        if dtype == torch.float32:
            assert err < 1e-5, err
        else:   # each dx element is one GEMM's output: ~one bf16 rounding
            one = ((ref.to(dtype).double() - ref).norm() / ref.norm()).item()
            assert err <= 1.5 * one + 1e-6, (err, one)
