"""Index and launch limits of the GPU solvers (issue 11): every reason a solver gives for a
huge problem, checked on problem descriptors alone (no allocation), and the huge problems
that must stay served (int64 bases, bounded workspaces) rather than refused."""
from __future__ import annotations

import pytest
import torch

from nnprim.conv import direct, im2col_gemm, implicit_gemm, implicit_gemm_bwd
from nnprim.errors import NotSupportedError
from nnprim.limits import INT32_MAX, TILE_HEADROOM, fits_int32, grid_reasons, int32_reasons, span
from nnprim.problems.attention import AttentionProblem
from nnprim.problems.conv import ConvProblem
from nnprim.search.solver import REGISTRY

DIRS = ("fwd", "bwd_data", "bwd_weights")
GPU_CONV = {d: [f"implicit_gemm_{d}", f"gemm_{d}", f"direct_{d}"] for d in DIRS}


def conv(direction, x, w, **kw) -> ConvProblem:
    return ConvProblem.create(direction, x, w, dtype=kw.pop("dtype", torch.bfloat16), device="cuda", **kw)


def reasons(name: str, p) -> list[str]:
    return REGISTRY.get(name).not_supported_reasons(p)


def test_helpers():
    assert fits_int32(INT32_MAX - TILE_HEADROOM) and not fits_int32(INT32_MAX - TILE_HEADROOM + 1)
    assert int32_reasons((("a", 10), ("b", 2 ** 31))) == [f"b = {2 ** 31} elements; its int32 indexing needs "
                                                          f"<= {INT32_MAX - TILE_HEADROOM}"]
    assert grid_reasons(((0, "x", 2 ** 31 - 1), (1, "y", 65535))) == []
    assert grid_reasons(((2, "z", 65536),)) == ["grid axis 2 (z) = 65536 programs exceeds CUDA's limit 65535"]
    assert span((2, 3, 4), (12, 4, 1)) == 24 and span((2, 3), (1, 1000)) == 2002 and span((0, 5), (5, 1)) == 0


@pytest.mark.parametrize("direction", DIRS)
def test_long_causal_depthwise_conv1d_is_served_with_bounded_workspaces(direction):
    """Issue 11's problem: every GPU family applies, no workspace near the 192 GiB asked before."""
    p = conv(direction, (8, 768, 8192), (768, 1, 8192), padding=((8191, 0),), groups=768)
    for name in GPU_CONV[direction]:
        assert reasons(name, p) == [], name
    assert REGISTRY.get(f"gemm_{direction}").workspace_size(p) <= im2col_gemm.WORKSPACE_CAP
    assert len(im2col_gemm.row_blocks(p)) > 8 * 100          # slices of one image's rows
    assert REGISTRY.get(f"direct_{direction}").workspace_size(p) <= direct.WORKSPACE_CAP
    assert REGISTRY.get(f"implicit_gemm_{direction}").workspace_size(p) <= 2 ** 28


@pytest.mark.parametrize("direction", DIRS)
def test_2_31_element_outputs_are_served(direction):
    """y (or dx) of 2**31 elements: int64 image bases, not a refusal; gemm in bounded blocks."""
    p = conv(direction, (32, 64, 1024, 1024), (64, 64, 3, 3), padding=1, layout="nhwc")
    assert reasons(f"implicit_gemm_{direction}", p) == []
    assert reasons(f"gemm_{direction}", p) == []
    assert REGISTRY.get(f"gemm_{direction}").workspace_size(p) <= im2col_gemm.WORKSPACE_CAP


@pytest.mark.parametrize("direction", DIRS)
@pytest.mark.parametrize("what,x,w,kw", [
    ("rows of y (N*OD*OH*OW)", (1, 1, 2 ** 31 + 5), (1, 1, 3), {}),
    ("rows of x (N*D*H*W)", (1, 1, 2 ** 31 + 5), (1, 1, 7), dict(stride=4)),
    ("one image of x (C*D*H*W)", (1, 2048, 1024, 1024), (8, 2048, 1, 1), dict(stride=4)),
    ("one image of y (K*OD*OH*OW)", (1, 8, 1024, 1024), (2048, 8, 1, 1), {}),
    ("w (K*C/groups*taps)", (1, 16384, 3, 3), (16384, 16384, 3, 3), {}),
], ids=["rows_y", "rows_x", "image_x", "image_y", "w"])
def test_int32_reasons(direction, what, x, w, kw):
    p = conv(direction, x, w, **kw)
    for name in (f"implicit_gemm_{direction}", f"gemm_{direction}"):
        assert any(r.startswith(what) and "int32 indexing" in r for r in reasons(name, p)), (name, reasons(name, p))


@pytest.mark.parametrize("direction", DIRS)
def test_direct_int32_reason(direction):
    p = conv(direction, (1, 4096, 1024, 512), (4096, 1, 3, 3), padding=1, groups=4096)   # one image: 2**31
    assert any(r.startswith("one image of x") for r in reasons(f"direct_{direction}", p))


def test_gemm_cap_reason():
    p = conv("fwd", (1, 65536, 4096), (1, 65536, 4096))       # one GEMM row: 65536 * 4096 bf16 columns
    (r,) = [r for r in reasons("gemm_fwd", p) if "cap" in r]
    assert r.startswith(f"one GEMM row needs {65536 * 4096 * 2 + 4} B")
    assert reasons("implicit_gemm_fwd", p) == []


@pytest.mark.parametrize("direction", ("fwd", "bwd_data"))
def test_direct_grid_reason(direction):
    c = 2 ** 21                                                 # 131072 blocks of 16 channels
    p = conv(direction, (1, c, 4), (c, 1, 3), padding=1, groups=c)
    assert any("grid axis 1" in r for r in reasons(f"direct_{direction}", p))
    assert reasons(f"implicit_gemm_{direction}", p) == []      # groups folded into grid axis 0


def test_groups_beyond_a_grid_axis_are_served():
    p = conv("fwd", (1, 65536, 8, 8), (65536, 1, 3, 3), padding=1, groups=65536)
    for name in GPU_CONV["fwd"]:
        assert reasons(name, p) == [], name


def test_strided_views_beyond_int32_are_refused():
    """A view whose strides reach past int32 within one image: NotSupportedError when the
    plan for those strides is made (before anything runs); a far batch stride is fine."""
    dense = conv("fwd", (2, 4, 8, 8), (4, 4, 3, 3), padding=1)
    dw = conv("fwd", (2, 4, 8, 8), (4, 1, 3, 3), padding=1, groups=4)
    far = (2 ** 34, 2 ** 30, 8, 1)                             # channel stride 2**30: 4 channels span 3 * 2**30
    makers = ((dense, lambda p, s: implicit_gemm.FwdPlan(p, strides=s)), (dense, im2col_gemm.Plan),
              (dw, lambda p, s: direct.DirectPlan(p, strides=s)))
    for p, make in makers:
        rest = tuple(implicit_gemm.layout_strides(sh, "nchw") for sh in (p.w_shape, p.y_shape))
        with pytest.raises(NotSupportedError, match="x strides"):
            make(p, (far, *rest))
        make(p, ((2 ** 33, 64, 8, 1), *rest))


def test_split_k_workspace_stays_int32():
    p = conv("bwd_weights", (64, 32768, 4, 4), (32768, 32768, 1, 1), layout="nhwc")   # w = 2**30 elements
    assert implicit_gemm_bwd.max_split(p) == 1
    assert direct._max_split(p) == 1


def _attn(**kw) -> AttentionProblem:
    fields = dict(direction="fwd", B=1, Hq=8, Hkv=8, Sq=128, Sk=128, D=64, Dv=64, dtype=torch.float16, device="cuda")
    return AttentionProblem(**(fields | kw))


def test_flash_grid_reason():
    p = _attn(B=1024, Hq=128, Hkv=64, Sq=4, Sk=8, D=16, Dv=16)
    for name in ("flash_fwd", "flash_bwd"):
        q = p if name == "flash_fwd" else p.with_direction("bwd")
        assert any("grid axis 1" in r and str(1024 * 128) in r for r in reasons(name, q)), reasons(name, q)
    assert reasons("decode_split_k", p) == []                  # (b, kv head) on grid axis 0


def test_decode_grid_reason():
    p = _attn(B=1, Hq=2 ** 19, Hkv=1, Sq=16, Sk=64, D=16, Dv=16)
    assert any("grid axis 2" in r for r in reasons("decode_split_k", p))
    q = _attn(B=1, Hq=2 ** 19, Hkv=1, Sq=16, Sk=64, D=32, Dv=32, k_quant=("s8", 16, "t", "float32", None))
    assert any("grid axis 2" in r for r in reasons("decode_split_k_quant_grouped", q))


def test_huge_attention_is_served():
    """2**31-element q / o (Sq >> Sk) and a 2**31-element K/V cache: 64-bit offsets, no reasons."""
    big_q = _attn(B=2, Hq=64, Hkv=8, Sq=131072, Sk=64, D=128, Dv=128, dtype=torch.bfloat16)
    assert reasons("flash_fwd", big_q) == [] and reasons("flash_bwd", big_q.with_direction("bwd")) == []
    cache = _attn(B=1, Hq=32, Hkv=16, Sq=1, Sk=2 ** 20, D=128, Dv=128, dtype=torch.bfloat16)
    assert reasons("decode_split_k", cache) == [] and reasons("flash_fwd", cache) == []
