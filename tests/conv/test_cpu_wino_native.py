"""Native Winograd transforms (cpu_wino_native.py): the same V and y blocks as the torch-op
transforms (tails in channels, rows and columns; both tile sizes; strided outputs), and the
fallback when they cannot be built or are switched off."""
import logging

import pytest
import torch

from nnprim.conv import cpu_wino_native as native
from nnprim.conv import cpu_winograd as cw
from nnprim.native import NativeLibrary
from nnprim.problems.conv import ConvProblem, to_layout

needs_native = pytest.mark.skipif(native.ops() is None, reason="no C++ compiler: the torch-op path only")


def _setup(x_shape, K, layout, m, padding=1):
    g = torch.Generator().manual_seed(sum(x_shape) + K + m)
    x = to_layout(torch.randn(x_shape, generator=g), layout)
    p = ConvProblem.create("fwd", x_shape, (K, x_shape[1], 3, 3), dtype=torch.float32, layout=layout, padding=padding)
    plan = cw.make_plan(p, m, block_bytes=1)          # tile rows of one image per block
    ws = torch.full((plan.workspace_bytes(),), 255, dtype=torch.uint8)
    _, bufs = cw._carve(plan, ws)
    return p, plan, x, bufs[0], g


@needs_native
@pytest.mark.parametrize("m", [2, 4])
@pytest.mark.parametrize("x_shape,K", [((2, 19, 9, 13), 21), ((1, 32, 8, 8), 16), ((1, 3, 5, 6), 5)])
def test_input_transform_matches_torch_ops(monkeypatch, m, x_shape, K):
    p, plan, x, buf, _ = _setup(x_shape, K, "nhwc", m)
    for i, blk in enumerate(plan.blocks[:3]):
        P = cw._stage(plan, x, blk, buf["stage"], i == 0)
        got = cw._input_transform(plan, P, blk, buf).clone()
        with monkeypatch.context() as mp:
            mp.setattr(native, "ops", lambda: None)
            want = cw._input_transform(plan, P, blk, buf)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@needs_native
@pytest.mark.parametrize("m", [2, 4])
@pytest.mark.parametrize("layout", ["nhwc", "nchw"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("x_shape,K", [((2, 5, 11, 7), 19), ((1, 3, 6, 37), 33)])
def test_output_transform_matches_torch_ops(monkeypatch, m, layout, bias, x_shape, K):
    """Odd output sizes (partial last tiles), K not a multiple of 16, rows longer than 16
    (the nchw path's 16 x 16 transposes, full and masked), an f32 y in NHWC or NCHW (both
    written in place: a plan with the native transforms has no f32 block)."""
    p, plan, _, buf, g = _setup(x_shape, K, layout, m)
    assert "y" not in buf
    b = torch.randn(p.K, generator=g) if bias else None
    for blk in plan.blocks[:3]:
        tiles = blk.nb * (blk.th1 - blk.th0) * plan.TW
        Mp = torch.randn(plan.alpha ** 2, tiles, p.K, generator=g)
        ys = []
        for use_native in (True, False):
            y = torch.full(p.y_shape, float("nan")).contiguous(
                memory_format=torch.channels_last if layout == "nhwc" else torch.contiguous_format)
            with monkeypatch.context() as mp:
                if not use_native:
                    mp.setattr(native, "ops", lambda: None)
                cw._output_transform(plan, Mp.clone(), blk, y, b, [], buf)
            ys.append(y)
        torch.testing.assert_close(ys[0], ys[1], rtol=1e-5, atol=1e-5, equal_nan=True)
        r0, r1 = plan.m * blk.th0, min(plan.m * blk.th1, p.out_size[0])
        assert not torch.isnan(ys[0][blk.n0:blk.n1, :, r0:r1]).any()


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("x_shape,pad", [((2, 19, 7, 37), (1, 2)), ((1, 33, 3, 16), (0, 0)),
                                         ((3, 5, 2, 3), (2, 1))])
def test_stage_nchw(dtype, x_shape, pad):
    """wino_stage: P[n, pt + h, pl + w, c] = x[n, c, h, w] exactly (conversion to f32 is
    exact), nothing else of P written; x a strided view (every other channel and image; as
    the 3-D path's depth slices, channels not outermost)."""
    g = torch.Generator().manual_seed(sum(x_shape))
    N, C, H, W = x_shape
    big = torch.randn(2 * N, 2 * C, H, W, generator=g).to(dtype)
    x = big[::2, ::2]
    (pt, pl), (Hp, Wp) = pad, (H + pad[0] + 3, W + pad[1] + 2)
    for src in (x, big[:N, :C].transpose(0, 1).contiguous().transpose(0, 1)):
        P = torch.full((N, Hp, Wp, C), float("nan"))
        native.ops().wino_stage(src, P, pt, pl)
        want = torch.full_like(P, float("nan"))
        want[:, pt:pt + H, pl:pl + W] = src.float().permute(0, 2, 3, 1)
        torch.testing.assert_close(P, want, rtol=0, atol=0, equal_nan=True)


def test_switched_off(monkeypatch):
    monkeypatch.setenv("NNPRIM_CPU_NATIVE", "0")
    assert native.ops() is None and not native.expected()


def test_build_failure_falls_back(monkeypatch, tmp_path, caplog):
    """A failed build (no compiler here) logs once and leaves the torch-op path."""
    lib = NativeLibrary(native.LIBRARY.namespace, native.LIBRARY.source, native.LIBRARY.what)
    monkeypatch.setattr(native, "LIBRARY", lib)
    monkeypatch.setattr(lib, "so_path", lambda: tmp_path / "missing.so")
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with caplog.at_level(logging.WARNING, logger="nnprim"):
        assert native.ops() is None
        assert native.ops() is None
    assert sum("native CPU Winograd" in r.message for r in caplog.records) == 1
    assert not native.expected()
