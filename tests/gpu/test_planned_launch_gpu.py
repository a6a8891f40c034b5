"""The planned launch paths (addresses instead of tensors, `Launch.run_addresses` /
`run_keyed_addresses`, and the public calls' signature memo) against torch, on repeated
calls: fresh and reused outputs, a 1x1 filter's contiguous weight (strides on size-1 dims
other than channels-last's), misaligned inputs and bias (the tensor path), forced solvers
of every direction."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from gpu_helpers import assert_close

import nnprim

DEV = "cuda"
BF16 = torch.bfloat16
CL = torch.channels_last

# (x shape, w shape, padding, {direction: forced solver})
CASES = [
    ((16, 256, 14, 14), (128, 256, 1, 1), 0,
     {"fwd": "implicit_gemm_fwd", "bwd_data": "implicit_gemm_bwd_data", "bwd_weights": "implicit_gemm_bwd_weights"}),
    ((8, 128, 28, 28), (128, 128, 3, 3), 1,
     {"fwd": "implicit_gemm_fwd", "bwd_data": "implicit_gemm_bwd_data", "bwd_weights": "implicit_gemm_bwd_weights"}),
    ((8, 128, 28, 28), (128, 128, 3, 3), 1,
     {"fwd": "gluon_implicit_gemm_fwd", "bwd_data": "gluon_implicit_gemm_bwd_data",
      "bwd_weights": "gluon_implicit_gemm_bwd_weights"}),
    ((16, 256, 14, 14), (128, 256, 1, 1), 0,
     {"fwd": "gluon_implicit_gemm_fwd", "bwd_data": "gluon_implicit_gemm_bwd_data",
      "bwd_weights": "gluon_implicit_gemm_bwd_weights"}),
]


def _misaligned(t: torch.Tensor) -> torch.Tensor:
    """A copy of dense t (same strides) whose data pointer is 2 bytes past a 16-byte boundary."""
    buf = torch.empty(t.numel() + 8, dtype=t.dtype, device=t.device)
    out = buf[1:].as_strided(t.shape, t.stride())
    out.copy_(t)
    assert out.data_ptr() % 16 and out.stride() == t.stride()
    return out


def _ids(c) -> str:
    return f"x{'x'.join(map(str, c[0]))}-w{'x'.join(map(str, c[1]))}-{c[3]['fwd']}"


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_repeated_calls_every_direction(case):
    xs, ws, pad, solvers = case
    g = torch.Generator(device=DEV).manual_seed(0)
    x64 = torch.randn(xs, device=DEV, dtype=torch.float64, generator=g)
    w64 = torch.randn(ws, device=DEV, dtype=torch.float64, generator=g) / (ws[1] * ws[2] * ws[3]) ** 0.5
    b64 = torch.randn(ws[0], device=DEV, dtype=torch.float64, generator=g)
    y64 = F.conv2d(x64, w64, b64, padding=pad)
    dy64 = torch.randn(y64.shape, device=DEV, dtype=torch.float64, generator=g)
    x, w, b = x64.to(BF16).to(memory_format=CL), w64.to(BF16).to(memory_format=CL), b64.to(BF16)
    dy = dy64.to(BF16).to(memory_format=CL)
    ref_dx = torch.nn.grad.conv2d_input(xs, w64, dy64, padding=pad)
    ref_dw = torch.nn.grad.conv2d_weight(x64, ws, dy64, padding=pad)
    t_y = F.conv2d(x, w, b, padding=pad)
    t_dx = torch.nn.grad.conv2d_input(xs, w, dy, padding=pad)
    t_dw = torch.nn.grad.conv2d_weight(x, ws, dy, padding=pad)
    # standard tensors (three calls: the first compiles, later ones take the planned path),
    # a contiguous (not channels-last) copy of w, misaligned x / w / bias / dy
    variants = [(x, w, b, dy)] * 3 + [(x, w.contiguous(), b, dy), (_misaligned(x), _misaligned(w), b, _misaligned(dy)),
                                      (x, w, _misaligned(b), dy), (x, w, b, dy)]
    for xv, wv, bv, dyv in variants:
        y = nnprim.conv_forward(xv, wv, bv, padding=pad, solver=solvers["fwd"])
        assert_close("y", y, t_y, y64)
        dx = nnprim.conv_backward_data(dyv, wv, xs, padding=pad, solver=solvers["bwd_data"])
        assert_close("dx", dx, t_dx, ref_dx)
        dw = nnprim.conv_backward_weights(dyv, xv, ws, padding=pad, solver=solvers["bwd_weights"])
        assert_close("dw", dw, t_dw, ref_dw)


def test_default_calls_with_grad_and_without():
    """The signature memo serves the no-grad call and the autograd Function alike."""
    x = torch.randn(8, 64, 56, 56, device=DEV, dtype=BF16).to(memory_format=CL)
    w = (torch.randn(64, 64, 1, 1, device=DEV, dtype=BF16) / 8).contiguous()
    for _ in range(3):
        with torch.no_grad():
            y0 = nnprim.conv_forward(x, w)
        xg = x.clone().requires_grad_()
        y1 = nnprim.conv_forward(xg, w)
        y1.float().sum().backward()
        torch.testing.assert_close(y0, y1.detach(), rtol=0, atol=0)
        ref = F.conv2d(x.double(), w.double())
        assert_close("y", y0, F.conv2d(x, w), ref)
        gx = torch.nn.grad.conv2d_input(x.shape, w.double(), torch.ones_like(ref))
        assert_close("dx", xg.grad, torch.nn.grad.conv2d_input(x.shape, w, torch.ones_like(y0)), gx)
