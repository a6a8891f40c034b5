"""blockdiag.py on CPU (the pack kernel under the Triton interpreter): the Gluon kernels'
grouped mode emulated in float64 (per tile of BN output channels, a dense convolution of the
tile's CB input channels with its packed filter block) equals the grouped convolution,
forward and backward data; the geometry keeps whole groups and names what it cannot tile."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from nnprim.conv import blockdiag, gluon_conv
from nnprim.conv.reference import conv_bwd_data_f64, conv_fwd_f64
from nnprim.problems.conv import ConvProblem
from nnprim.search.solver import REGISTRY

F64 = torch.float64


def emulate(fp: ConvProblem, d: blockdiag.DiagGeometry, x: torch.Tensor, wb: torch.Tensor) -> torch.Tensor:
    """The kernel's DIAG mode: tile j's outputs from x channels (j*BN // Kg) * Cg .. + CB."""
    taps = math.prod(fp.filter)
    ys = []
    for j in range(-(-fp.K // d.BN)):
        rows = slice(j * d.BN, min(fp.K, (j + 1) * d.BN))
        c0 = (j * d.BN // d.Kg) * d.Cg
        xj = x[:, c0:c0 + d.CB]
        xj = F.pad(xj, (0, 0, 0, 0, 0, d.CB - xj.shape[1]))     # channels past C read as zeros
        wj = wb[rows].reshape(-1, taps, d.CB).permute(0, 2, 1).reshape(-1, d.CB, *fp.filter)
        pj = ConvProblem.create("fwd", xj.shape, wj.shape, dtype=F64, device="cpu", padding=fp.padding,
                                dilation=fp.dilation, stride=fp.stride)
        ys.append(conv_fwd_f64(pj, xj, wj))
    return torch.cat(ys, 1)


CASES = [  # (x, w, groups, options)
    ((2, 128, 7, 6), (128, 4, 3, 3), 32, dict(padding=1)),          # ResNeXt g32: Cg = Kg = 4, BN 64
    ((1, 64, 5, 5), (128, 8, 3, 3), 8, dict(padding=1)),            # Kg 16, Cg 8: CB 32
    ((2, 96, 6, 5), (48, 16, 3, 3), 6, dict(padding=(1, 0))),       # K not a multiple of BN: a short tile
    ((1, 64, 4, 5, 6), (64, 8, 3, 3, 3), 8, dict(padding=1)),       # 3-D
    ((2, 128, 6, 7), (256, 32, 1, 1), 4, {}),                       # 1x1, wide groups
]


@pytest.mark.parametrize("x,w,groups,kw", CASES, ids=[f"g{c[2]}-{c[1]}" for c in CASES])
@pytest.mark.parametrize("direction", ["fwd", "bwd_data"])
def test_packed_tiles_equal_the_grouped_convolution(x, w, groups, kw, direction):
    p = ConvProblem.create(direction, x, w, dtype=torch.bfloat16, layout="nhwc", device="cpu", groups=groups, **kw)
    fp = gluon_conv.forward_view(p) if direction == "bwd_data" else p
    d = blockdiag.diag_geometry(fp)
    assert d is not None and d.BN % d.Kg == 0 and d.CB == d.BN // d.Kg * d.Cg
    g = torch.Generator().manual_seed(0)
    wt = torch.randn(p.w_shape, generator=g, dtype=F64)
    taps = math.prod(p.filter)
    wb = torch.full((fp.K, taps * d.CB), float("nan"), dtype=F64)       # every entry written
    blockdiag.pack(wt.to(memory_format=torch.channels_last if len(x) == 4 else torch.channels_last_3d)
                   .permute(0, *range(2, len(x)), 1).contiguous(), fp, d, direction == "bwd_data", wb)
    assert torch.isfinite(wb).all()
    if direction == "fwd":
        xin = torch.randn(p.x_shape, generator=g, dtype=F64)
        torch.testing.assert_close(emulate(fp, d, xin, wb), conv_fwd_f64(p, xin, wt))
    else:
        dy = torch.randn(p.y_shape, generator=g, dtype=F64)
        torch.testing.assert_close(emulate(fp, d, dy, wb), conv_bwd_data_f64(p, dy, wt))


def test_geometry_prefers_64_channel_tiles_and_names_narrow_groups():
    mk = lambda C, K, g: ConvProblem.create("fwd", (1, C, 8, 8), (K, C // g, 3, 3), dtype=torch.bfloat16,  # noqa: E731
                                            layout="nhwc", device="cuda", groups=g, padding=1)
    assert blockdiag.diag_geometry(mk(128, 128, 32)) == blockdiag.DiagGeometry(64, 64, 4, 4)
    assert blockdiag.diag_geometry(mk(256, 256, 2)) == blockdiag.DiagGeometry(128, 128, 128, 128)
    assert blockdiag.diag_geometry(mk(128, 128, 64)) is None      # 2 channels a group
    assert blockdiag.diag_geometry(mk(144, 144, 144)) is None     # depthwise: its own solvers
    assert blockdiag.diag_geometry(mk(64, 96, 8)) is None         # Kg 12 divides no BN
    s27 = REGISTRY.get("gluon_implicit_gemm_fwd")
    assert "no tile of whole groups" in " | ".join(s27.not_supported_reasons(mk(128, 128, 64)))
    assert not gluon_conv.shape_reasons(mk(128, 128, 32))
    assert s27.estimate(mk(128, 128, 32)) is not None
    assert s27.workspace_size(mk(128, 128, 32)) == 128 * 9 * 64 * 2
    bwd = ConvProblem.create("bwd_data", (1, 128, 8, 8), (128, 4, 3, 3), dtype=torch.bfloat16, layout="nhwc",
                             device="cuda", groups=32, padding=1, stride=2)
    assert "grouped backward data needs stride 1" in " | ".join(gluon_conv.shape_reasons(bwd))


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_grouped_backward_data_past_the_flipped_padding_is_named_not_raised(device):
    """A grouped backward data whose padding exceeds dilation*(filter-1) has no forward view:
    the Gluon solvers name why instead of raising while the registry asks them; the public
    call on CPU runs another solver."""
    p = ConvProblem.create("bwd_data", (1, 64, 9, 9), (64, 8, 3, 3), dtype=torch.bfloat16, layout="nhwc",
                           device=device, groups=8, padding=3)
    for name in ("gluon_implicit_gemm_fwd", "gluon_implicit_gemm_bwd_data", "gluon_implicit_gemm_bwd_weights"):
        s = REGISTRY.get(name)
        assert s.not_supported_reasons(p) and s.workspace_size(p) == 0
    assert "negative padding" in " | ".join(gluon_conv.shape_reasons(p))
    if device == "cpu":
        import nnprim
        g = torch.Generator().manual_seed(0)
        dy = torch.randn(p.y_shape, generator=g).to(torch.bfloat16).to(memory_format=torch.channels_last)
        w = torch.randn(p.w_shape, generator=g).to(torch.bfloat16).to(memory_format=torch.channels_last)
        dx = nnprim.conv_backward_data(dy, w, p.x_shape, padding=3, groups=8)
        torch.testing.assert_close(dx.double(), conv_bwd_data_f64(p, dy, w), atol=0.3, rtol=5e-2)
