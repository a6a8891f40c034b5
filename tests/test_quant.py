"""Quantized K/V format: packing order, dequantization formula, round-trip error within
half a quantization step, validation."""
import pytest
import torch

from nnprim.errors import BadParameterError
from nnprim.quant import KVQuant, quantize_kv

RANGES = {"s8": (-128, 127), "u8": (0, 255), "s4": (-8, 7), "u4": (0, 15)}


def _codes_by_loops(data: torch.Tensor, dtype: str) -> torch.Tensor:
    """Independent unpacking: element 2i in the low nibble, 2i+1 in the high nibble."""
    if dtype in ("s8", "u8"):
        return data.to(torch.int64)
    B, H, S, Dh = data.shape
    out = torch.empty(B, H, S, 2 * Dh, dtype=torch.int64)
    flat = data.reshape(-1, Dh).tolist()
    res = []
    for row in flat:
        r = []
        for byte in row:
            for nib in (byte & 0xF, byte >> 4):
                r.append(nib - 16 if dtype == "s4" and nib >= 8 else nib)
        res.append(r)
    out.copy_(torch.tensor(res).reshape(B, H, S, 2 * Dh))
    return out


@pytest.mark.parametrize("dtype", ["s8", "u8", "s4", "u4"])
def test_unpack_and_dequantize_formula(dtype):
    g = torch.Generator().manual_seed(1)
    B, H, S, D, G = 2, 3, 5, 8, 4
    lo, hi = RANGES[dtype]
    codes = torch.randint(lo, hi + 1, (B, H, S, D), generator=g)
    if dtype in ("s4", "u4"):
        nib = codes & 0xF
        data = (nib[..., 0::2] | (nib[..., 1::2] << 4)).to(torch.uint8)
    else:
        data = codes.to(torch.int8 if dtype == "s8" else torch.uint8)
    assert torch.equal(_codes_by_loops(data, dtype), codes)
    scales = torch.rand(B, H, S, D // G, generator=g) + 0.1
    zps = torch.randint(lo, hi + 1, (B, H, S, D // G), generator=g).float()
    kq = KVQuant(data, scales, zps, dtype, G)
    assert kq.shape == (B, H, S, D) and kq.head_dim == D
    assert torch.equal(kq.unpack().to(torch.int64), codes)
    want = (codes.double() - zps.double().repeat_interleave(G, -1)) * scales.double().repeat_interleave(G, -1)
    torch.testing.assert_close(kq.dequantize(torch.float64), want, rtol=0, atol=0)
    # per-tensor scale, no zero point
    kt = KVQuant(data, torch.tensor(0.25), None, dtype)
    torch.testing.assert_close(kt.dequantize(torch.float64), codes.double() * 0.25, rtol=0, atol=0)
    assert kt.signature() == (dtype, D, "t", "float32", None)
    assert kq.signature() == (dtype, G, "g", "float32", "g")


@pytest.mark.parametrize("in_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("group", [None, 4, 16])
@pytest.mark.parametrize("dtype", ["s8", "u8", "s4", "u4"])
def test_round_trip_within_half_step(dtype, group, symmetric, in_dtype):
    g = torch.Generator().manual_seed(7)
    B, H, S, D = 2, 3, 7, 16
    x = (torch.randn(B, H, S, D, generator=g) * 3 + 0.5).to(in_dtype)
    x[0, 0, 0] = torch.rand(D, generator=g).to(in_dtype) + 1.0   # all-positive group (asym. zero point)
    x[0, 0, 1] = 0                                               # all-zero group
    kq = quantize_kv(x, dtype, group_size=group, symmetric=symmetric)
    G = D if group is None else group
    lo, hi = RANGES[dtype]
    codes = kq.unpack()
    assert int(codes.min()) >= lo and int(codes.max()) <= hi
    assert kq.scales.shape == (B, H, S, D // G)
    assert kq.scales.dtype == (in_dtype if in_dtype != torch.float32 else torch.float32)
    if kq.zero_points is not None:
        zp = kq.zero_points
        assert torch.equal(zp, zp.round()) and float(zp.min()) >= lo and float(zp.max()) <= hi
    step = kq.scales.double().repeat_interleave(G, -1)
    err = (kq.dequantize(torch.float64) - x.double()).abs()
    assert bool((err <= 0.5 * step * (1 + 1e-5) + 1e-30).all()), float((err / step).max())
    assert float(err[0, 0, 1].max()) == 0.0


def test_validation():
    d = torch.zeros(1, 1, 2, 8, dtype=torch.int8)
    s = torch.ones(1)
    with pytest.raises(BadParameterError, match="dtype"):
        KVQuant(d, s, dtype="s3")
    with pytest.raises(BadParameterError, match="uint8"):
        KVQuant(d, s, dtype="u8")
    with pytest.raises(BadParameterError, match="group_size"):
        KVQuant(d, s, dtype="s8", group_size=3)
    with pytest.raises(BadParameterError, match="even"):
        KVQuant(torch.zeros(1, 1, 2, 3, dtype=torch.uint8), s, dtype="s4", group_size=3)
    with pytest.raises(BadParameterError, match="scales shape"):
        KVQuant(d, torch.ones(1, 1, 2, 3), dtype="s8", group_size=4)
    with pytest.raises(BadParameterError, match="4-D"):
        KVQuant(d[0], s, dtype="s8")
    with pytest.raises(BadParameterError, match="zero_points dtype"):
        KVQuant(d, s, torch.zeros(1, dtype=torch.bool), dtype="s8")
    with pytest.raises(BadParameterError, match="group_size"):
        quantize_kv(torch.randn(1, 1, 2, 72), "s8", group_size=64)
    with pytest.raises(BadParameterError, match="even"):
        quantize_kv(torch.randn(1, 1, 2, 5), "s4", group_size=None)
    with pytest.raises(BadParameterError, match="floating"):
        quantize_kv(torch.ones(1, 1, 2, 4, dtype=torch.int32), "s8", group_size=None)


# ---- issue 14: fp8, per-head scales, layouts --------------------------------------

@pytest.mark.parametrize("per", ["head", "tensor"])
def test_fp8_round_trip(per):
    x = torch.randn(2, 3, 7, 16, dtype=torch.float64) * torch.tensor([1.0, 10.0, 0.1]).view(1, 3, 1, 1)
    kq = quantize_kv(x, "fp8_e4m3", scale_per=per)
    assert kq.data.dtype == torch.float8_e4m3fn and kq.zero_points is None and kq.layout == 1
    assert kq.scales.shape == ((2, 3) if per == "head" else (1,))
    sc = kq.scales.double().reshape(2, 3, 1, 1) if per == "head" else kq.scales.double()
    err = (kq.dequantize(torch.float64) - x).abs()
    assert (err <= x.abs() * 2.0 ** -4 + sc * 2.0 ** -9).all()
    assert kq.signature() == ("fp8_e4m3", 16, "h" if per == "head" else "t", "float32", None)


@pytest.mark.parametrize("dtype", ["s4", "u4", "s8"])
def test_layout_conversion_round_trip(dtype):
    x = torch.randn(2, 2, 5, 24)
    k0 = quantize_kv(x, dtype, group_size=8, symmetric=False, layout=0)
    k1 = k0.to_layout(1)
    assert k1.layout == 1 and torch.equal(k1.dequantize(), k0.dequantize())
    assert torch.equal(k1.to_layout(0).data, k0.data)
    assert torch.equal(quantize_kv(x, dtype, group_size=8, symmetric=False).data, k1.data)
    if dtype != "s8":   # nibble e of every 8 elements at (0, 1, 4, 5, 2, 3, 6, 7)[e]
        assert not torch.equal(k1.data, k0.data)
        assert k1.signature()[-1] == 1 and len(k0.signature()) == 5
    v1 = quantize_kv(x, dtype, group_size=8, order="keys")
    assert v1.data.stride(-2) == 1 and v1.to_layout(0).data.stride(-2) == 1


def test_per_head_scales_and_defaults():
    x = torch.randn(2, 3, 4, 10)
    kq = quantize_kv(x, "s4", scale_per="head", symmetric=False)
    assert kq.scales.shape == (2, 3) and kq.zero_points.shape == (2, 3) and kq.layout == 0  # D % 8 != 0
    assert (kq.dequantize() - x).abs().max() <= kq.scales.max() / 2 + 1e-6


def test_fp8_and_layout_errors():
    x = torch.randn(1, 2, 3, 16)
    d8 = torch.zeros(1, 2, 3, 16).to(torch.float8_e4m3fn)
    with pytest.raises(BadParameterError, match="zero_points"):
        KVQuant(d8, torch.tensor(1.0), torch.tensor(0.0), "fp8_e4m3")
    with pytest.raises(BadParameterError, match="per head"):
        KVQuant(d8, torch.ones(1, 2, 3, 1), None, "fp8_e4m3")
    with pytest.raises(BadParameterError, match="scale_per"):
        quantize_kv(x, "fp8_e4m3", scale_per="group")
    with pytest.raises(BadParameterError, match="layout"):
        quantize_kv(torch.randn(1, 1, 2, 12), "s4", group_size=4, layout=1)
    with pytest.raises(BadParameterError, match="layout"):
        KVQuant(torch.zeros(1, 1, 2, 8, dtype=torch.int8), torch.tensor(1.0), dtype="s8", layout=2)
    with pytest.raises(BadParameterError, match="role"):
        quantize_kv(x, "s8", role="q")
    with pytest.raises(BadParameterError, match="float8"):
        KVQuant(torch.zeros(1, 1, 2, 8, dtype=torch.int8), torch.tensor(1.0), dtype="fp8_e4m3")


@pytest.mark.parametrize("dtype", ["s4", "u4", "s8", "u8", "fp8_e4m3"])
def test_role_v_picks_the_order_the_kernels_read_fastest(dtype):
    """role="v": 4-bit codes keys-contiguous (solver 128's V tiles), 8-bit and fp8 codes rows
    (keys-contiguous s8 V measured 1.3-1.6x slower through the API); order= overrides it, and
    either order holds the same values."""
    x = torch.randn(2, 2, 40, 32)
    kw = {} if dtype == "fp8_e4m3" else dict(group_size=16)
    v = quantize_kv(x, dtype, role="v", **kw)
    assert v.keys_contiguous == (dtype in ("s4", "u4"))
    for order in ("rows", "keys"):
        o = quantize_kv(x, dtype, role="v", order=order, **kw)
        assert o.keys_contiguous == (order == "keys")
        assert torch.equal(o.dequantize(), v.dequantize())
    assert not quantize_kv(x, dtype, role="k", **kw).keys_contiguous
    with pytest.raises(BadParameterError, match="order"):
        quantize_kv(x, dtype, order="cols", **kw)


@pytest.mark.parametrize("dtype", ["s4", "s8", "fp8_e4m3"])
def test_signature_keeps_the_storage_order(dtype):
    """Keys-contiguous codes (order="keys") sign as such: the problem key (and so the find-db
    record) differs from the rows one, and find's random arguments rebuild the same order."""
    from nnprim.problems.attention import AttentionProblem
    from nnprim.search.random_args import _kv_quant
    x = torch.randn(2, 2, 40, 32)
    kw = {} if dtype == "fp8_e4m3" else dict(group_size=16)
    rows, keys = quantize_kv(x, dtype, **kw), quantize_kv(x, dtype, order="keys", **kw)
    assert keys.keys_contiguous and not rows.keys_contiguous
    assert keys.signature() == rows.signature() + ("keys",)
    for t in (rows, keys):
        again = _kv_quant(t.signature(), (2, 2, 40, 32), "cpu", torch.Generator().manual_seed(0))
        assert again.signature() == t.signature()
    q = torch.randn(2, 4, 1, 32)
    pr, pk = (AttentionProblem.from_tensors(q, rows, v) for v in (rows, keys))
    assert pr.key() != pk.key() and pk.key().endswith("keys")


@pytest.mark.parametrize("dtype", ["s4", "u4"])
@pytest.mark.parametrize("layout", [0, 1])
def test_dequantize_matches_nibble_reference(dtype, layout):
    """The table-free unpack (s4 biased by 8, grouped terms broadcast) equals the codes read
    nibble by nibble from the documented layout, bit for bit, in every output dtype."""
    from nnprim.quant import NIB1
    x = torch.randn(2, 3, 24, 32, generator=torch.Generator().manual_seed(1))
    for kw in (dict(symmetric=False), dict(scale_per="head"), dict(order="keys")):
        t = quantize_kv(x, dtype, 16, layout=layout, **kw)
        words = t.data.contiguous().view(*t.data.shape[:-1], -1, 4).to(torch.int64)
        word = words[..., 0] | words[..., 1] << 8 | words[..., 2] << 16 | words[..., 3] << 24
        nib = NIB1 if layout == 1 else tuple(range(8))
        codes = torch.stack([(word >> (4 * nib[e])) & 15 for e in range(8)], -1).flatten(-2)
        if dtype == "s4":
            codes = torch.where(codes >= 8, codes - 16, codes)
        assert torch.equal(t.unpack(), codes.to(torch.int32))
        for out in (torch.float32, torch.float64, torch.bfloat16):
            ref = codes.to(out)
            g = t.group

            def ex(v, out=out, g=g):
                v = v.to(out)
                return v[:, :, None, None] if v.dim() == 2 else v.repeat_interleave(g, -1) if v.dim() == 4 else v
            if t.zero_points is not None:
                ref = ref - ex(t.zero_points)
            assert torch.equal(t.dequantize(out), ref * ex(t.scales))


def test_quantize_kv_scale_dtype_edges():
    """A float64 scale of a zero row was 2.2e-308 (0 in f32: NaN codes); a scale past f16's range
    was inf; group_size / scale_dtype / symmetric of the wrong type were truncated or a torch error."""
    z = torch.zeros(1, 2, 4, 32)
    kq = quantize_kv(z, "fp8_e4m3", None, scale_dtype=torch.float64)
    assert torch.equal(kq.dequantize(), z)
    with pytest.raises(BadParameterError, match="scale_dtype"):
        quantize_kv(torch.full((1, 2, 4, 32), 1e7), "s8", None, scale_dtype=torch.float16)
    for bad in (dict(group_size=2.5), dict(group_size=True), dict(scale_dtype=torch.int32), dict(symmetric="no")):
        with pytest.raises(BadParameterError):
            quantize_kv(torch.randn(1, 2, 4, 32), "s8", **bad)
    kq = quantize_kv(torch.randn(1, 2, 4, 32), "s8", 8)
    with pytest.raises(BadParameterError, match="group_size"):
        KVQuant(kq.data, kq.scales, None, "s8", 8.5)
