"""The NCHW <-> NHWC transposing copies (layout_copy.py) through TRITON_INTERPRET=1: the same
values as torch's copy, in the right memory format, for odd channel and pixel counts, 1-D,
2-D and 3-D images, and into a given output."""
import pytest
import torch

from nnprim.conv.layout_copy import Transpose, to_nchw, to_nhwc
from nnprim.problems.conv import layout_of, to_layout


@pytest.mark.parametrize("shape", [(2, 3, 5, 7), (1, 70, 9, 9), (3, 65, 130), (2, 17, 3, 4, 5), (1, 128, 1, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip(shape, dtype):
    t = torch.randn(shape).to(dtype)
    h = to_nhwc(t)
    assert h.shape == t.shape and torch.equal(h, t)
    assert layout_of(h) == "nhwc" or h.is_contiguous()
    assert h.permute(0, *range(2, t.dim()), 1).is_contiguous()
    back = to_nchw(h)
    assert back.is_contiguous() and torch.equal(back, t)
    out = torch.full(shape, float("nan"), dtype=dtype)
    assert to_nchw(h, out) is out and torch.equal(out, t)


def test_already_in_layout_is_not_copied():
    t = to_layout(torch.randn(2, 8, 4, 4), "nhwc")
    assert to_nhwc(t) is t
    c = torch.randn(2, 8, 4, 4)
    assert to_nchw(c) is c


def test_planned_copy_reused_and_fallbacks():
    tr = Transpose((2, 5, 3, 4), "nhwc")
    for seed in range(2):    # the planned launch runs again with new tensors
        t = torch.randn(2, 5, 3, 4, generator=torch.Generator().manual_seed(seed))
        assert torch.equal(tr(t), t)
    odd = torch.randn(2, 4, 5, 3).permute(0, 1, 3, 2)    # other strides: torch's copy
    assert torch.equal(tr(odd), odd) and tr(odd).permute(0, 2, 3, 1).is_contiguous()
    one = Transpose((2, 1, 3, 4), "nhwc")                # C == 1: one layout, nothing to copy
    c1 = torch.randn(2, 1, 3, 4)
    assert torch.equal(one(c1), c1)
    m = torch.randn(3, 4)                                 # below 3 dims: returned as it is
    assert Transpose((3, 4), "nchw")(m) is m


@pytest.mark.parametrize("to", ["nhwc", "nchw"])
def test_huge_image_grid_within_cuda_limits(to):
    """A 4096 x 4096 image has 262144 64-pixel tiles, beyond grid axes 1 and 2's 65535 (the
    H200 fuzz's NCHW 2^31-element conv failed with "invalid argument", 2026-12-04): the
    copy's programs all lie on axis 0."""
    tr = Transpose((8, 16, 4096, 4096), to)
    assert tr.runs
    gx, gy, gz = tr.launch.grid
    assert gx == 8 * 262144 and gy == gz == 1


def test_launch_beyond_grid_limits_is_refused():
    from nnprim.conv.layout_copy import _transpose_kernel
    from nnprim.errors import NotSupportedError
    from nnprim.launch import Launch
    with pytest.raises(NotSupportedError, match="grid axis 1"):
        Launch(_transpose_kernel, (1, 70000, 1), ())
