"""Direct grouped convolution for narrow groups (solvers 83, 84, 85, native AVX-512) against the
float64 reference: NaN-poisoned outputs, odd sizes and widths past one or two 16-lane vectors,
output channels per group not a multiple of the 8-channel block (1, 3, 4, 12), dilation,
asymmetric padding, 1D and 2D, nchw and nhwc, f32 and bf16 (odd group widths: a last channel
pair with one channel), the f32 channel-vector kernel (16 / 32 output channels a group), bias and
post-ops (per chunk of images, or in the kernel's block epilogue)."""

import pytest
import torch

from nnprim.conv import cpu_group_direct
from nnprim.conv.cpu_gemm import cpu_flags
from nnprim.conv.cpu_group_direct import BF16, CpuGroupDirectBwdData, CpuGroupDirectBwdWeights, CpuGroupDirectFwd, _four
from nnprim.conv.cpu_im2col import F32
from nnprim.conv.reference import reference
from nnprim.post_ops import Binary, Eltwise, Sum
from nnprim.problems.conv import ConvProblem, empty_in_layout

from . import solver_check

pytestmark = pytest.mark.skipif(not cpu_group_direct.LIBRARY.expected() or "avx512f" not in cpu_flags(),
                                reason="needs AVX-512 and the native library")
SOLVERS = {"fwd": CpuGroupDirectFwd, "bwd_data": CpuGroupDirectBwdData, "bwd_weights": CpuGroupDirectBwdWeights}
SHAPES = {
    "g8_16": ((2, 32, 9, 28), (32, 4, 3, 3), dict(padding=1, groups=8)),
    "g4_k12_wide": ((2, 16, 5, 37), (48, 4, 3, 3), dict(padding=1, groups=4)),
    "g2_k16_w28": ((2, 32, 6, 28), (32, 16, 3, 3), dict(padding=1, groups=2)),   # flat blocks, a short tail
    "g2_w28_dil": ((1, 32, 9, 28), (32, 16, 3, 5), dict(padding=(2, 4), dilation=2, groups=2)),   # flat, dilated
    "g3_odd": ((2, 9, 7, 5), (6, 3, 3, 2), dict(padding=((1, 0), (2, 1)), groups=3)),
    "g8_dil": ((2, 16, 9, 8), (16, 2, 3, 3), dict(padding=2, dilation=2, groups=8)),
    "depthwise": ((2, 5, 7, 19), (10, 1, 3, 3), dict(padding=1, groups=5)),
    "depthwise_wide": ((2, 6, 9, 83), (6, 1, 3, 3), dict(padding=1, groups=6)),
    "g2_k4_w50": ((1, 6, 7, 50), (8, 3, 3, 3), dict(padding=(1, 2), groups=2)),
    "g2_nopad_5x4": ((1, 4, 8, 33), (6, 2, 5, 4), dict(groups=2)),
    "1d_g4": ((2, 8, 50), (8, 2, 7), dict(padding=((4, 2),), dilation=2, groups=4)),
    "g2_k5_7x5": ((2, 6, 12, 21), (10, 3, 7, 5), dict(padding=(3, 1), dilation=(1, 2), groups=2)),
    "g8_s2": ((2, 32, 11, 45), (32, 4, 3, 3), dict(stride=2, padding=1, groups=8)),
    "dw_s2_dil": ((2, 6, 13, 70), (6, 1, 3, 5), dict(stride=(3, 2), padding=(1, 4), dilation=(1, 2), groups=6)),
    "1d_s2": ((2, 8, 67), (12, 2, 5), dict(stride=2, padding=2, groups=4)),
    # the channel-vector kernel (16 / 32 output channels a group): 32-wide groups at stride 2,
    # rows of several blocks (63 = 24 + 24 + 15) in bands of rows (2 items), 32 input channels, 1D
    "g4_k32_s2": ((2, 64, 9, 45), (128, 16, 3, 3), dict(stride=2, padding=1, groups=4)),
    "g2_k16_bands": ((1, 32, 37, 61), (32, 16, 3, 3), dict(padding=(1, 2), groups=2)),
    "g2_c32_k16": ((2, 64, 7, 30), (32, 32, 3, 3), dict(padding=(2, 1), dilation=(2, 1), groups=2)),
    "1d_g2_k16": ((2, 32, 50), (32, 16, 5), dict(padding=((3, 1),), groups=2)),
    "g2_c3_k16": ((2, 6, 7, 19), (32, 3, 3, 3), dict(padding=1, groups=2)),   # bf16: a lone last channel
}


def pack_weights(p: ConvProblem, w: torch.Tensor) -> torch.Tensor:
    """The native `group_direct_pack`'s layout in torch ops (its specification),
    KB = channel_block(Kg). f32: (G, ceil(Kg/KB), Cg, KH, KW, KB) f32; bf16: (G, ceil(Kg/KB),
    ceil(Cg/2), KH, KW, KB) int32, each the bf16 pair of channels (2p, 2p + 1) with 2p in the low
    half (the AVX512-BF16 dot product's order); zero past Kg and Cg."""
    G, Kg, Cg = p.groups, p.K // p.groups, p.C // p.groups
    kb = cpu_group_direct.channel_block(Kg)
    step = 2 if p.dtype == BF16 else 1
    nkb, ncs = -(-Kg // kb), -(-Cg // step)
    w4 = _four(w.to(p.dtype if step == 2 else F32)).reshape(G, Kg, Cg, *_four(w).shape[2:])
    w4 = torch.nn.functional.pad(w4, (0, 0, 0, 0, 0, ncs * step - Cg, 0, nkb * kb - Kg))
    w4 = w4.view(G, nkb, kb, ncs, step, *w4.shape[3:])          # (G, nkb, kb, ncs, step, KH, KW)
    w4 = w4.permute(0, 1, 3, 5, 6, 2, 4).contiguous()          # (G, nkb, ncs, KH, KW, kb, step)
    return w4.view(torch.int32).squeeze(-1) if step == 2 else w4.squeeze(-1)



@pytest.fixture(autouse=True)
def poison(monkeypatch):
    monkeypatch.setattr(cpu_group_direct, "empty_in_layout",
                        lambda shape, layout, **kw: empty_in_layout(shape, layout, **kw).fill_(float("nan")))


BF16_OK = "avx512_bf16" in cpu_flags()
DTYPES = [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(not BF16_OK, reason="no AVX512-BF16"))]
# bf16: one rounding of an f32 result (relative rms ~2^-9 / sqrt(3)); f32 against float64
TOL = {torch.float32: 1e-6, torch.bfloat16: 4e-3}


def run(direction, xs, ws, layout, bias=False, post_ops=(), dtype=torch.float32, **kw):
    p, args = solver_check.random_case(direction, xs, ws, layout=layout, dtype=dtype, bias=bias,
                                       post_ops=post_ops, **kw)
    reasons = SOLVERS[direction]().not_supported_reasons(p)
    if reasons:
        return p, None, None, reasons
    return p, SOLVERS[direction]().prepare(p)(args), reference(p, args), []


def check(p, out, ref):
    solver_check.check_result(p, out, ref, TOL[p.dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("direction", list(SOLVERS))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_directions(shape, direction, layout, dtype):
    xs, ws, kw = SHAPES[shape]
    p, out, ref, reasons = run(direction, xs, ws, layout, dtype=dtype, **kw)
    if reasons:
        # bwd_data: padding past the span (no transposed forward); backward directions: stride 1;
        # bwd_weights: f32 only; bf16: row stride 1 outside the channel-vector kernel
        strided = any(st != 1 for st in p.stride)
        assert direction == "bwd_data" or strided or (direction == "bwd_weights" and dtype != torch.float32), reasons
        pytest.skip("; ".join(reasons))
    check(p, out, ref)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("chunk", [1 << 20, 1], ids=["whole", "per_image"])
def test_fwd_bias_post_ops(chunk, dtype, monkeypatch):
    """The chain per chunk of images (its Sum / Binary operands indexed by the chunk)."""
    monkeypatch.setattr(cpu_group_direct, "POST_OP_CHUNK_BYTES", chunk)
    xs, ws, kw = (3, 6, 9, 21), (9, 2, 3, 3), dict(padding=1, groups=3)
    g = torch.Generator().manual_seed(3)
    y_shape = (3, 9, 9, 21)
    ops = (Sum(torch.randn(y_shape, generator=g), scale=0.5), Eltwise("gelu_tanh"),
           Binary("mul", torch.randn(1, 9, 1, 1, generator=g)), Eltwise("relu", alpha=0.1))
    p, out, ref, _ = run("fwd", xs, ws, "nchw", bias=True, post_ops=ops, dtype=dtype, **kw)
    check(p, out, ref)


EPILOGUE_SHAPES = {"vector": ((2, 32, 6, 30), (32, 16, 3, 3), dict(padding=1, groups=2)),
                   "vector_k32_s2": ((2, 32, 7, 35), (64, 16, 3, 3), dict(stride=2, padding=1, groups=2)),
                   "rows": ((3, 6, 9, 21), (9, 2, 3, 3), dict(padding=1, groups=3))}


@pytest.mark.parametrize("chain", ["sum_relu", "add", "leaky"])
@pytest.mark.parametrize("shape", list(EPILOGUE_SHAPES))
def test_fwd_epilogue_in_kernel(shape, chain):
    """Residual (Sum with a scale, or Binary add) and relu (with a slope) applied per block in the
    kernel: the chunked torch-op path is not taken."""
    xs, ws, kw = EPILOGUE_SHAPES[shape]
    y_shape = ConvProblem.create("fwd", xs, ws, dtype=F32, **kw).y_shape
    res = torch.randn(y_shape, generator=torch.Generator().manual_seed(5))
    ops = {"sum_relu": (Sum(res, scale=0.5), Eltwise("relu")), "add": (Binary("add", res),),
           "leaky": (Eltwise("relu", alpha=0.1),)}[chain]
    p, out, ref, _ = run("fwd", xs, ws, "nchw", bias=True, post_ops=ops, **kw)
    assert cpu_group_direct.epilogue(p, ops) is not None
    assert bool(cpu_group_direct.vector_block(p)) == shape.startswith("vector")
    check(p, out, ref)


@pytest.mark.parametrize("G, K, Cg, kb", [(2, 32, 16, 16), (4, 128, 16, 32), (3, 12, 5, 4), (2, 16, 3, 8)])
def test_native_twin_packing(G, K, Cg, kb):
    """twin=True packs the backward data's forward filter (w transposed per group, rotated by
    180 degrees) from w itself."""
    w = torch.randn(K, Cg, 3, 2)
    Kg = K // G
    wt = w.unflatten(0, (G, Kg)).transpose(1, 2).flip(3, 4).reshape(G * Cg, Kg, 3, 2).contiguous()
    ops = cpu_group_direct.LIBRARY.ops()
    assert torch.equal(ops.group_direct_pack(w, G, kb, True), ops.group_direct_pack(wt, G, kb))


@pytest.mark.skipif(not BF16_OK, reason="no AVX512-BF16")
def test_packed_weights_bf16_pairs():
    """(G, ceil(Kg/8), ceil(Cg/2), KH, KW, 8) int32: channel 2p in the low half, 2p + 1 high,
    a zero high half for an odd group width."""
    p = ConvProblem.create("fwd", (1, 6, 5, 5), (16, 3, 3, 2), dtype=torch.bfloat16, groups=2)
    w = torch.randn(p.w_shape).bfloat16()
    wp = pack_weights(p, w)
    assert wp.shape == (2, 1, 2, 3, 2, 8) and wp.dtype == torch.int32
    pair = wp[1, 0, 0, 2, 1, 4:5].view(torch.bfloat16)
    assert torch.equal(pair, torch.stack([w[8 + 4, 0, 2, 1], w[8 + 4, 1, 2, 1]]))
    assert not wp[1, 0, 1, 2, 1, 4:5].view(torch.int16)[1:].any()


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("G, K, Cg", [(2, 30, 3), (8, 128, 16), (5, 10, 1), (3, 12, 2), (4, 4, 5)])
def test_native_packing_matches(G, K, Cg, dtype):
    p = ConvProblem.create("fwd", (1, G * Cg, 5, 5), (K, Cg, 3, 2), dtype=dtype, groups=G)
    w = torch.randn(p.w_shape).to(dtype)
    kb = cpu_group_direct.channel_block(K // G)
    assert torch.equal(cpu_group_direct.LIBRARY.ops().group_direct_pack(w, G, kb), pack_weights(p, w))


def test_channel_blocks():
    assert [cpu_group_direct.channel_block(k) for k in (1, 2, 3, 4, 5, 6, 8, 12, 16, 20)] == \
        [1, 1, 1, 4, 1, 1, 8, 4, 8, 4]


def test_packed_weights():
    """(G, ceil(Kg/8), Cg, KH, KW, 8): channel k of block b at [.., b, .., k % 8], zeros past Kg."""
    p = ConvProblem.create("fwd", (1, 6, 5, 5), (30, 3, 3, 2), dtype=torch.float32, groups=2)
    w = torch.randn(p.w_shape)
    wp = pack_weights(p, w)
    assert wp.shape == (2, 2, 3, 3, 2, 8)
    assert torch.equal(wp[1, 1, 2, 0, 1, 3], w[15 + 11, 2, 0, 1])
    assert not wp[:, 1, ..., 7].any()


def test_not_applicable():
    for d, xs, ws, kw in (("fwd", (1, 8, 8, 8), (8, 8, 3, 3), {}),                       # groups 1
                          ("fwd", (1, 256, 8, 8), (256, 128, 3, 3), dict(groups=2)),     # wide groups
                          ("fwd", (1, 8, 8, 8), (8, 4, 3, 3), dict(stride=(1, 3), groups=2)),
                          ("bwd_data", (1, 8, 8, 8), (8, 4, 3, 3), dict(stride=2, padding=1, groups=2)),
                          ("fwd", (1, 4, 5, 6, 7), (4, 2, 3, 3, 3), dict(groups=2)),      # 3D
                          ("bwd_data", (1, 8, 8, 8), (8, 4, 3, 3), dict(padding=3, groups=2))):
        p = ConvProblem.create(d, xs, ws, dtype=torch.float32, **kw)
        assert SOLVERS[d]().not_supported_reasons(p), (d, xs, ws, kw)
    f16 = ConvProblem.create("fwd", (1, 8, 8, 8), (8, 4, 3, 3), dtype=torch.float16, groups=2)
    assert CpuGroupDirectFwd().not_supported_reasons(f16)


@pytest.mark.parametrize("direction", ["fwd", "bwd_data"])
def test_bf16_ranks_without_amx(direction, monkeypatch):
    """Without AMX the direct kernel's bf16 rate (measured ~3x the AMX Xeon's there) ranks it ahead
    of solver 80/81's VNNI brgemm on narrow groups (grouped_g8); with AMX the brgemm stays ahead."""
    from nnprim.conv import cpu_brgemm
    p = ConvProblem.create(direction, (8, 128, 28, 28), (128, 16, 3, 3), padding=1, groups=8, dtype=BF16)
    brgemm = {"fwd": cpu_brgemm.CpuBrgemmFwd, "bwd_data": cpu_brgemm.CpuBrgemmBwdData}[direction]()
    direct = {"fwd": CpuGroupDirectFwd, "bwd_data": CpuGroupDirectBwdData}[direction]()
    for module in (cpu_brgemm, cpu_group_direct):
        monkeypatch.setattr(module, "cpu_has_amx", lambda: False)
    monkeypatch.setattr(cpu_brgemm, "cpu_has_native_bf16", lambda: True)
    assert direct.estimate(p) < brgemm.estimate(p)
    for module in (cpu_brgemm, cpu_group_direct):
        monkeypatch.setattr(module, "cpu_has_amx", lambda: True)
    assert direct.estimate(p) > brgemm.estimate(p)
