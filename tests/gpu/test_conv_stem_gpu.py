"""Small-channel stem solvers (70/71/72) at real sizes on the GPU: forced through the
public API, and every tile variant the probe times through its plan, against float64,
bounded by torch's (cuDNN's) same-dtype error."""
import pytest
import torch
import torch.nn.functional as F
from gpu_helpers import assert_close

import nnprim
from nnprim.args import ConvArgs
from nnprim.conv import stem
from nnprim.problems.conv import ConvProblem

CL = torch.channels_last
CASES = [  # (x, w, stride, padding)
    ((8, 3, 224, 224), (64, 3, 7, 7), 2, 3),      # rn50_conv1 at N=8
    ((5, 3, 97, 101), (64, 3, 7, 7), 2, 3),       # odd sizes, tails
    ((4, 1, 33, 35), (32, 1, 5, 5), 1, 2),
    ((6, 4, 64, 63), (128, 4, 3, 3), 2, 1),       # K tiled
    ((3, 3, 61, 59), (96, 3, 4, 4), 4, 0),        # patchify
]


def _tensors(xs, ws, stride, pad, dtype=torch.bfloat16):
    torch.manual_seed(0)
    x = torch.randn(xs, device="cuda").to(dtype).to(memory_format=CL)
    w = (torch.randn(ws, device="cuda") / (ws[1] * ws[2] * ws[3]) ** 0.5).to(dtype).to(memory_format=CL)
    dy = torch.randn_like(F.conv2d(x, w, stride=stride, padding=pad))
    return x, w, dy


def _bwd(dy, x, w, stride, pad, mask):
    return torch.ops.aten.convolution_backward(dy, x, w, None, [stride] * 2, [pad] * 2, [1, 1], False, [0, 0], 1, mask)


@pytest.mark.parametrize("xs,ws,stride,pad", CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_stem_api(xs, ws, stride, pad, dtype):
    x, w, dy = _tensors(xs, ws, stride, pad, dtype)
    kw = dict(stride=stride, padding=pad)
    x64, w64, dy64 = x.double(), w.double(), dy.double()
    bias = torch.randn(ws[0], device="cuda", dtype=dtype)
    y = nnprim.conv_forward(x, w, bias, post_ops=(nnprim.Eltwise("relu"),), solver="stem_fwd", **kw)
    # y in x's layout; a C = 1 x is plainly contiguous too, which the contract reads as NCHW
    assert y.is_contiguous(memory_format=torch.contiguous_format if x.is_contiguous() else CL)
    assert_close("fwd", y, F.relu(F.conv2d(x, w, bias, **kw)), F.relu(F.conv2d(x64, w64, bias.double(), **kw)))
    dx_ref, dw_ref, _ = _bwd(dy64, x64, w64, stride, pad, [True, True, False])
    dx_t, dw_t, _ = _bwd(dy, x, w, stride, pad, [True, True, False])
    dx = nnprim.conv_backward_data(dy, w, tuple(x.shape), solver="stem_bwd_data", **kw)
    assert_close("bwd_data", dx, dx_t, dx_ref)
    dw = nnprim.conv_backward_weights(dy, x, tuple(w.shape), solver="stem_bwd_weights", **kw)
    assert_close("bwd_weights", dw, dw_t, dw_ref)


@pytest.mark.parametrize("direction", list(stem.VARIANTS))
def test_stem_variants(direction):
    """Every tile variant of benchmarks/stem_probe.py on rn50_conv1 (N=8), NaN-poisoned."""
    xs, ws, stride, pad = CASES[0]
    x, w, dy = _tensors(xs, ws, stride, pad)
    p = ConvProblem.create(direction, xs, ws, dtype=torch.bfloat16, layout="nhwc", device="cuda",
                           stride=stride, padding=pad)
    x64, w64, dy64 = x.double(), w.double(), dy.double()
    if direction == "fwd":
        ref, theirs = F.conv2d(x64, w64, stride=stride, padding=pad), F.conv2d(x, w, stride=stride, padding=pad)
    else:
        i = 0 if direction == "bwd_data" else 1
        mask = [i == 0, i == 1, False]
        ref, theirs = _bwd(dy64, x64, w64, stride, pad, mask)[i], _bwd(dy, x, w, stride, pad, mask)[i]
    for tile in stem.VARIANTS[direction]:
        out = torch.full_like(ref, float("nan"), dtype=torch.bfloat16).to(memory_format=CL)
        out = stem.plan(p, tile)(ConvArgs(x=x, w=w, dy=dy), out)
        assert_close(f"{direction} {tile}", out, theirs, ref)
