"""FP8 attention forward (nnprim.fp8, solver 125 flash_fwd_fp8) on the CPU: the Triton kernel
under TRITON_INTERPRET=1 at small shapes with tails (poisoned outputs, float64 reference of the
dequantised inputs), the e4m3 rounding emulation, the reference (100) and CPU (115) paths, the
public API (descale forms, out_dtype, torch.compile, problem keys) and its errors."""
from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

import nnprim
from nnprim import fp8
from nnprim.args import AttnArgs
from nnprim.attention import flash_fwd_fp8 as F
from nnprim.attention.reference import reference_forward, sdpa_reference
from nnprim.errors import BadParameterError, NotSupportedError
from nnprim.problems.attention import AttentionProblem
from nnprim.search.solver import REGISTRY

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

E4 = torch.float8_e4m3fn
# P is rounded to e4m3 (unit roundoff 2**-4) for the PV product: relative norm errors of a few
# 1e-2 against the float64 reference (bf16's P rounding gives ~3e-3); lse uses unrounded P.
FP8_TOL = 5e-2


def make(B=2, Hq=4, Hkv=2, Sq=37, Sk=45, D=24, Dv=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    Dv = D if Dv is None else Dv
    return tuple((torch.randn(s, generator=g) * 1.5).to(E4)
                 for s in ((B, Hq, Sq, D), (B, Hkv, Sk, D), (B, Hkv, Sk, Dv)))


def descales(B, Hq, Hkv, kinds="hth", seed=1):
    """(q, k, v) descales by letter: n None, t 1-element tensor, f float, h (B, H) tensor."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for kind, H in zip(kinds, (Hq, Hkv, Hkv)):
        out.append({"n": None, "t": torch.tensor([0.8]), "f": 1.25, "z": torch.tensor(0.6),
                    "h": 0.5 + torch.rand(B, H, generator=g)}[kind])
    return out


def rel_err(x, ref) -> float:
    fin = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(x), fin), "non-finite entries differ from the reference"
    x, ref = x.double()[fin], ref[fin]
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def run_kernel(q, k, v, ds, **opts):
    p = AttentionProblem.from_tensors(q, k, v, q_descale=ds[0], k_descale=ds[1], v_descale=ds[2],
                                      return_lse=True, **opts)
    s = REGISTRY.get("flash_fwd_fp8")
    assert s.is_applicable(p), s.not_supported_reasons(p)
    a = AttnArgs(q, k, v, attn_mask=opts.get("attn_mask"), scale=opts.get("scale"), kv_lens=opts.get("kv_lens"),
                 seed=opts.get("seed", 0), offset=opts.get("offset", 0), q_descale=ds[0], k_descale=ds[1],
                 v_descale=ds[2])
    B, Hq, Sq, _ = q.shape
    o, lse = s.prepare(p)(a, out=torch.full((B, Hq, Sq, v.shape[-1]), float("nan"), dtype=p.result_dtype),
                          lse_out=torch.full((B, Hq, Sq), float("nan")))
    ro, rl = reference_forward(p, a)
    assert o.dtype == p.result_dtype and lse.dtype == torch.float32
    return rel_err(o, ro), rel_err(lse, rl)


# ---- the kernel under the interpreter ------------------------------------------------------

@pytest.mark.parametrize("kinds,causal", [("hth", None), ("tnf", "top_left"), ("nhh", "bottom_right"),
                                          ("zzz", "bottom_right")])
def test_kernel_gqa_tails_descales(kinds, causal):
    q, k, v = make()
    e, el = run_kernel(q, k, v, descales(2, 4, 2, kinds), causal=causal)
    assert e < FP8_TOL and el < 1e-5, (e, el)


def test_kernel_dv_ne_d_rectangular_mqa():
    q, k, v = make(B=1, Hq=3, Hkv=1, Sq=45, Sk=19, D=40, Dv=20)
    e, el = run_kernel(q, k, v, descales(1, 3, 1, "hhh"), causal="top_left")
    assert e < FP8_TOL and el < 1e-5, (e, el)


def test_kernel_masks_kvlens_scale_inf_as_zero():
    q, k, v = make(B=2, Hq=2, Hkv=2, Sq=21, Sk=50, D=32)
    g = torch.Generator().manual_seed(3)
    keep = torch.rand(2, 1, 21, 50, generator=g) < 0.7
    keep[1, :, 4] = False                                   # a fully masked row -> 0
    ds = descales(2, 2, 2, "hhh")
    e, el = run_kernel(q, k, v, ds, attn_mask=keep, softmax_inf_as_zero=True, scale=0.3)
    assert e < FP8_TOL and el < 1e-5
    add = torch.randn(21, 50, generator=g)
    e, el = run_kernel(q, k, v, ds, attn_mask=add, kv_lens=torch.tensor([50, 17]), causal="bottom_right",
                       scale=torch.tensor(2.0), invert_scale=True)
    assert e < FP8_TOL and el < 1e-5


def test_kernel_dropout_matches_reference():
    q, k, v = make(B=1, Hq=2, Hkv=1, Sq=20, Sk=33, D=16)
    e, el = run_kernel(q, k, v, descales(1, 2, 1, "ttt"), dropout_p=0.3, seed=5, offset=9)
    assert e < FP8_TOL and el < 1e-5


def test_kernel_out_dtypes_and_no_lse():
    q, k, v = make(B=1, Hq=2, Hkv=2, Sq=17, Sk=18, D=16)
    for dt in (torch.float16, torch.float32):
        o = nnprim.sdpa(q, k, v, q_descale=0.5, out_dtype=dt, solver="flash_fwd_fp8")
        ref, _ = sdpa_reference(q, k, v, q_descale=0.5)
        assert o.dtype == dt and rel_err(o, ref) < FP8_TOL


@triton.jit
def _round_kernel(X, Y, N: tl.constexpr):
    o = tl.arange(0, N)
    tl.store(Y + o, F._round_e4m3(tl.load(X + o)))


def test_round_e4m3_is_torch_rne():
    """The interpreter's rounding of P equals torch's (and the GPU's cvt.rn) e4m3 cast, bit
    for bit, over normals, subnormals, ties and binade carries up to 256."""
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.rand(4096, generator=g) * 2.0 ** torch.randint(-16, 9, (4096,), generator=g),
                   torch.tensor([0.0, 2.0 ** -10, 3 * 2.0 ** -10, 0.03124, 0.0625 * 1.0625, 0.0625 * 1.1875,
                                 0.4999, 255.9, 256.0])])
    n = triton.next_power_of_2(x.numel())
    x = torch.cat([x, torch.zeros(n - x.numel())])
    y = torch.empty_like(x)
    _round_kernel[(1,)](x, y, n)
    assert torch.equal(y, x.to(E4).float())


# ---- reference, CPU solver, public API ---------------------------------------------------------

def test_reference_and_cpu_dequantise():
    q, k, v = make(B=2, Hq=4, Hkv=2, Sq=9, Sk=12, D=8)
    dq, dk, dv = descales(2, 4, 2, "hfh")
    deq = (q.double() * dq[:, :, None, None].double(), k.double() * 1.25, v.double() * dv[:, :, None, None].double())
    want, wl = sdpa_reference(*deq, causal="top_left")
    for solver in ("attn_reference_fwd", "cpu_flash_fwd"):
        o, lse = nnprim.sdpa(q, k, v, q_descale=dq, k_descale=dk, v_descale=dv, causal="top_left",
                             return_lse=True, solver=solver, out_dtype=torch.float32)
        assert o.dtype == torch.float32
        assert rel_err(o, want) < 1e-5 and rel_err(lse, wl) < 1e-5, solver
    assert nnprim.sdpa(q, k, v).dtype == torch.bfloat16            # default output; heuristic choice


def test_problem_keys_keep_fp8_apart():
    q, k, v = make(B=1, Hq=2, Hkv=1, Sq=4, Sk=4, D=8)
    base = AttentionProblem.from_tensors(q.float(), k.float(), v.float())
    assert "ds" not in base.key() and base.out_dtype is None and base.descale is None
    keys = {AttentionProblem.from_tensors(q, k, v, q_descale=dq, out_dtype=od).key()
            for dq in (None, 0.5, torch.ones(1, 2)) for od in (None, torch.float32)}
    assert len(keys) == 6 and all("float8_e4m3fn" in key for key in keys)
    p = AttentionProblem.from_tensors(q, k, v, q_descale=torch.ones(1, 2), k_descale=0.5)
    assert p.descale == "htn" and p.result_dtype == torch.bfloat16 and p.fp8


def test_flash_fwd_and_decode_not_applicable_to_fp8():
    q, k, v = make(B=1, Hq=2, Hkv=1, Sq=4, Sk=4, D=8)
    p = AttentionProblem.from_tensors(q, k, v)
    for name in ("flash_fwd", "decode"):
        s = next((s for s in REGISTRY.all("attention") if s.name == name), None)
        if s is not None:
            assert not s.is_applicable(p)
    assert not REGISTRY.get("flash_fwd_fp8").is_applicable(AttentionProblem.from_tensors(q.float(), k.float(),
                                                                                       v.float()))


def test_torch_compile_and_fake():
    q, k, v = make(B=1, Hq=2, Hkv=1, Sq=8, Sk=8, D=16)
    dq = torch.full((1, 2), 0.5)

    def fn(q):
        return nnprim.sdpa(q, k, v, q_descale=dq, k_descale=0.5, out_dtype=torch.float32)
    want = fn(q)
    got = torch.compile(fn, fullgraph=True, backend="aot_eager")(q)
    assert got.dtype == torch.float32 and torch.allclose(got, want)


def test_no_grad_through_fp8():
    q, k, v = make(B=1, Hq=2, Hkv=1, Sq=4, Sk=4, D=8)
    with pytest.raises(NotSupportedError, match="k requires grad"):
        nnprim.sdpa(q, k.clone().requires_grad_(), v)
    with pytest.raises(NotSupportedError, match="v_descale requires grad"):
        nnprim.sdpa(q, k, v, v_descale=torch.tensor(0.5, requires_grad=True))
    with torch.no_grad():
        assert nnprim.sdpa(q.clone().requires_grad_(), k, v).shape == (1, 2, 4, 8)
    with pytest.raises(NotSupportedError, match="float8"):
        nnprim.sdpa_backward(torch.randn(1, 2, 4, 8), q, k, v, torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4))


@pytest.mark.parametrize("kw,err,match", [
    (dict(k="bf16"), BadParameterError, "FP8 attention needs q, k and v"),
    (dict(v="e5m2"), NotSupportedError, "float8_e5m2"),
    (dict(q_descale=torch.ones(2, 3)), BadParameterError, r"q_descale shape \(2, 3\)"),
    (dict(k_descale=torch.ones(1, 1, dtype=torch.float16)), BadParameterError, "k_descale.dtype"),
    (dict(v_descale=-1.0), BadParameterError, "v_descale"),
    (dict(v_descale=torch.tensor([0.0])), BadParameterError, "v_descale must hold positive"),
    (dict(q_descale="x"), BadParameterError, "q_descale"),
    (dict(out_dtype=torch.float8_e4m3fn), BadParameterError, "out_dtype"),
    (dict(out_dtype="bf16"), BadParameterError, "out_dtype"),
])
def test_errors(kw, err, match):
    q, k, v = make(B=1, Hq=2, Hkv=1, Sq=4, Sk=4, D=8)
    if kw.pop("k", None):
        k = k.to(torch.bfloat16)
    if kw.pop("v", None):
        v = v.float().to(torch.float8_e5m2)
    with pytest.raises(err, match=match):
        nnprim.sdpa(q, k, v, **kw)


def test_descales_and_out_dtype_on_non_fp8_inputs():
    q, k, v = (t.float() for t in make(B=1, Hq=2, Hkv=1, Sq=4, Sk=4, D=8))
    with pytest.raises(BadParameterError, match="k_descale is only for float8"):
        nnprim.sdpa(q, k, v, k_descale=torch.tensor(1.0))
    with pytest.raises(NotSupportedError, match="out_dtype"):
        nnprim.sdpa(q, k, v, out_dtype=torch.bfloat16)
    assert nnprim.sdpa(q, k, v, out_dtype=torch.float32).dtype == torch.float32


def test_dequantize_helper():
    x = torch.randn(2, 3, 4, 5).to(E4)
    d = torch.rand(2, 3) + 0.5
    assert torch.equal(fp8.dequantize(x, d, torch.float64), x.double() * d.double()[:, :, None, None])
    assert torch.equal(fp8.dequantize(x, 2.0, torch.float32), x.float() * 2)


def test_find_with_random_descales():
    """find's random inputs carry descales of the problem's granularity; the FP8 kernel's
    result on them passes find's check against the reference (tolerance for FP8)."""
    from nnprim.search.numerics import rel_error, tolerance
    from nnprim.search.random_args import random_args
    q, k, v = make(B=1, Hq=2, Hkv=1, Sq=20, Sk=24, D=16)
    p = AttentionProblem.from_tensors(q, k, v, q_descale=torch.ones(1, 2), k_descale=0.5, return_lse=True)
    a = random_args(p)
    assert a.q_descale.shape == (1, 2) and a.k_descale.shape == () and a.v_descale is None
    ours = REGISTRY.get("flash_fwd_fp8").prepare(p)(a)
    ref = REGISTRY.get("attn_reference_fwd").prepare(p)(a)
    assert rel_error(ours, ref) < tolerance(p.dtype)
    assert nnprim.find(p, exhaustive=True)[0].solver == "cpu_flash_fwd"   # CPU: interpreted Triton not timed


def test_shrink_keeps_fp8_key_steps():
    T = F._T
    assert F.shrink(T(128, 128, 8, 2)) == T(128, 128, 8, 1)
    assert F.shrink(T(128, 32, 8, 1)) == T(64, 32, 8, 2)
    with pytest.raises(NotSupportedError):
        F.shrink(T(16, 32, 4, 1))
