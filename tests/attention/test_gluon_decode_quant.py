"""Solver 133 (`gluon_decode_q4`) without a GPU: its register unpack emulated bit by bit
against KVQuant's own unpacking (which head-dim column each mma position holds, exact
16-bit values), its applicability and split choice. The kernel itself runs in
tests/gpu/test_gluon_decode_q4_gpu.py; its sm_90 compile in tests/test_compile_sm90.py."""
import re
from dataclasses import replace

import pytest
import torch

from nnprim.attention import gluon_decode_quant as q4
from nnprim.problems.attention import AttentionProblem
from nnprim.quant import quantize_kv
from nnprim.search.solver import REGISTRY


def _u32(x: int) -> int:
    return x & 0xFFFFFFFF


def _run_ptx(asm: str, regs: dict[str, int]) -> dict[str, int]:
    """Interpret the few PTX instructions the unpack uses (mov, shr, prmt, lop3 with the LUTs
    0x6A / 0xEA, sub of 16-bit float pairs) on 32-bit integers."""
    def val(tok: str) -> int:
        tok = tok.strip()
        return regs[tok] if tok in regs else int(tok, 0)

    for line in asm.splitlines():
        m = re.match(r"\s*([a-z0-9.]+)\s+([^;]*);", line)
        if not m or m.group(1) == ".reg":
            continue
        op, args = m.group(1), [a.strip() for a in m.group(2).split(",")]
        d = args[0]
        if op == "mov.b32":
            regs[d] = _u32(val(args[1]))
        elif op == "shr.u32":
            regs[d] = val(args[1]) >> val(args[2])
        elif op == "prmt.b32":
            a, b, sel = val(args[1]), val(args[2]), val(args[3])
            pool = a | (b << 32)
            regs[d] = sum(((pool >> (8 * ((sel >> (4 * i)) & 7))) & 0xFF) << (8 * i) for i in range(4))
        elif op == "lop3.b32":
            a, b, c, lut = (val(x) for x in args[1:])
            regs[d] = _u32(((a & b) ^ c) if lut == 0x6A else ((a & b) | c))
        elif op.startswith("sub.rn."):
            dt = torch.bfloat16 if "bf16x2" in op else torch.float16
            x = torch.tensor([val(args[1])], dtype=torch.int32).view(dt)
            y = torch.tensor([val(args[2])], dtype=torch.int32).view(dt)
            regs[d] = int((x - y).view(torch.int32)[0]) & 0xFFFFFFFF
        else:
            raise AssertionError(f"unexpected PTX op {op}")
    return regs


def _halves(word: int, dt) -> list[float]:
    return torch.tensor([word], dtype=torch.int64).to(torch.int32).view(dt).float().tolist()


@pytest.mark.parametrize("f16", [False, True])
@pytest.mark.parametrize("dtype", ["s4", "u4"])
@pytest.mark.parametrize("layout", [0, 1])
def test_k_unpack_positions_and_values(f16, dtype, layout):
    """Position k of K's first / second operand = code of head-dim column natural_dim_k(k) + OFF."""
    D = 128
    x = torch.randn(1, 1, 1, D)
    kq = quantize_kv(x, dtype, group_size=64, layout=layout)
    codes = kq.unpack()[0, 0, 0]
    words = kq.data[0, 0, 0].view(torch.int32)        # D / 8 little-endian words
    dt = torch.float16 if f16 else torch.bfloat16
    off = q4.code_offset(dtype == "s4")
    asm = q4._asm_k(f16, dtype == "s4")
    kk = torch.arange(D // 2)
    for second in (False, True):
        nat = q4.natural_dim_k(kk, second, D, layout)
        assert sorted(set(nat.tolist())) == sorted(nat.tolist())
        for k in range(D // 2):   # k = 16 i + 8 q1 + 2 c + q0: word c * D/32 + i, register 2 (second) + q1, half q0
            q0, c, q1, i = k & 1, (k >> 1) & 3, (k >> 3) & 1, k >> 4
            w = int(words[c * (D // 32) + i]) & 0xFFFFFFFF
            out = _run_ptx(asm, {"$4": w})
            got = _halves(out[f"${2 * int(second) + q1}"], dt)[q0]
            assert got == float(codes[int(nat[k])]) + off
    both = torch.cat([q4.natural_dim_k(kk, False, D, layout), q4.natural_dim_k(kk, True, D, layout)])
    assert sorted(both.tolist()) == list(range(D))


@pytest.mark.parametrize("f16", [False, True])
@pytest.mark.parametrize("dtype", ["s4", "u4"])
@pytest.mark.parametrize("DV", [64, 128])
def test_v_unpack_positions_and_values(f16, dtype, DV):
    """Register s of the V unpack pairs the even and odd key's nibble s; output column n of
    the accumulator holds head-dim column natural_dim_v(n)."""
    x = torch.randn(1, 1, 2, DV)
    vq = quantize_kv(x, dtype, group_size=32, layout=1)
    codes = vq.unpack()[0, 0]                          # (2 keys, DV)
    words = vq.data[0, 0].reshape(2, -1).view(torch.int32)
    dt = torch.float16 if f16 else torch.bfloat16
    off = q4.code_offset(dtype == "s4")
    asm = q4._asm_v(f16, dtype == "s4")
    nat = q4.natural_dim_v(torch.arange(DV), DV, 1)
    assert sorted(nat.tolist()) == list(range(DV))
    vw = DV // 64
    for n in range(DV):       # n = 64 i + 32 a1 + 16 a0 + 8 q1 + r: word r * Dv/64 + i, register 2 (a0 + 2 a1) + q1
        r, q1, a, i = n & 7, (n >> 3) & 1, (n >> 4) & 3, n >> 6
        wi = r * vw + i
        out = _run_ptx(asm, {"$8": int(words[0, wi]) & 0xFFFFFFFF, "$9": int(words[1, wi]) & 0xFFFFFFFF})
        pair = _halves(out[f"${2 * a + q1}"], dt)
        assert pair == [float(codes[0, int(nat[n])]) + off, float(codes[1, int(nat[n])]) + off]


def _problem(**kw):
    base = dict(direction="fwd", device="cuda", B=8, Hq=32, Hkv=8, Sq=1, Sk=32768, D=128, Dv=128,
                dtype=torch.bfloat16, k_quant=("s4", 64, "g", "bfloat16", None, 1),
                v_quant=("s4", 64, "g", "bfloat16", None, 1))
    return AttentionProblem(**(base | kw))


def test_applicability():
    assert q4._q4_reasons(_problem()) == []
    assert q4._q4_reasons(_problem(k_quant=("s8", 64, "g", "bfloat16", None)))       # 8-bit codes
    assert q4._q4_reasons(_problem(v_quant=("s4", 64, "g", "bfloat16", None, 1, "keys")))
    assert q4._q4_reasons(_problem(D=256, Dv=256))
    assert q4._q4_reasons(_problem(dtype=torch.float32))
    assert q4._q4_reasons(_problem(Sq=4))            # 4 heads x 4 rows x 2 groups > 16 rows
    assert q4._q4_reasons(_problem(Sq=4, k_quant=("s4", 128, "g", "bfloat16", None, 1),
                                   v_quant=("s4", 128, "g", "bfloat16", None, 1))) == []
    assert q4._q4_reasons(_problem(k_quant=("s4", 32, "g", "bfloat16", None, 1)))    # 4 and 2 groups
    assert q4._q4_reasons(_problem(mask="bool"))
    # on a machine without a Hopper GPU the solver says so
    assert REGISTRY.get("gluon_decode_q4").not_supported_reasons(_problem(device="cpu"))


def test_splits_fill_resident_slots_once():
    cfg = q4.default_config(_problem())
    assert cfg.maxnreg == 168 and q4.resident_per_sm(cfg) == 12      # the ring's register cap
    assert q4.choose_splits(_problem(), cfg, num_sms=132) == 24          # 64 KV heads x 24 = 1536 <= 1584
    assert q4.choose_splits(_problem(B=64, Sk=8192), cfg, num_sms=132) == 3
    assert q4.choose_splits(_problem(B=256, Sk=8192), cfg, num_sms=132) == 1
    assert q4.choose_splits(_problem(B=1, Hq=4, Hkv=1, Sk=200), cfg, num_sms=132) == 2   # >= 4 key blocks each
    registers = replace(cfg, ring=0, maxnreg=None)                     # 232 registers: 8 an SM
    assert q4.resident_per_sm(registers) == 8 and q4.choose_splits(_problem(), registers, num_sms=132) == 16


def test_default_config_caps():
    """Ring depth per variant under the one register cap that keeps 12 programs an SM."""
    zp = ("u4", 64, "g", "bfloat16", "g", 1)
    g32 = ("s4", 32, "g", "bfloat16", None, 1)
    zp32 = ("u4", 32, "g", "bfloat16", "g", 1)
    assert (q4.default_config(_problem()).ring, q4.default_config(_problem()).maxnreg) == (2, 168)
    c = q4.default_config(_problem(k_quant=zp, v_quant=zp))
    assert (c.ring, c.maxnreg) == (3, 168)
    c = q4.default_config(_problem(k_quant=zp, v_quant=zp, page_size=64))
    assert (c.ring, c.maxnreg) == (2, 168)
    c = q4.default_config(_problem(Hq=8, k_quant=g32, v_quant=g32))
    assert (c.ring, c.maxnreg) == (2, 168)
    c = q4.default_config(_problem(Hq=8, k_quant=zp32, v_quant=zp32))
    assert (c.ring, c.maxnreg) == (2, 168)


def test_resident_per_sm_by_register_file_quarter():
    """Warps live in one of an SM's four 16K register files: 168 registers give 3 each, 176 two."""
    def cfg(r):
        return q4.Q4Config(block_n=32, block_m=16, num_warps=1, num_stages=1, maxnreg=r)
    assert [q4.resident_per_sm(cfg(r)) for r in (128, 160, 168, 176, 200, 232, None)] == [16, 12, 12, 8, 8, 8, 8]


def test_codes_off_words_run_122():
    """Codes off 32-bit words (an odd byte offset or row stride) go to 122's plan, which reads
    bytes: same results."""
    from nnprim.args import AttnArgs
    from nnprim.attention import decode_quant
    from nnprim.quant import KVQuant
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 1, 64, generator=g)
    k, v = torch.randn(1, 1, 40, 64, generator=g), torch.randn(1, 1, 40, 64, generator=g)
    kq, vq = quantize_kv(k, "s4", group_size=32), quantize_kv(v, "u4", group_size=32, symmetric=False)

    def shifted(t: KVQuant) -> KVQuant:
        buf = torch.empty(t.data.numel() + 1, dtype=torch.uint8)[1:]
        data = buf.view(t.data.shape)
        data.copy_(t.data)
        return KVQuant(data, t.scales, t.zero_points, t.dtype, t.group_size, t.layout)
    ks, vs = shifted(kq), shifted(vq)
    assert not q4.words_ok(ks.data) and q4.words_ok(kq.data)
    p = AttentionProblem(direction="fwd", device="cpu", B=1, Hq=4, Hkv=1, Sq=1, Sk=40, D=64, Dv=64,
                         dtype=torch.float32, k_quant=ks.signature(), v_quant=vs.signature())
    o, _ = q4.Q4Plan(p, q4.default_config(p))(AttnArgs(q=q, k=ks, v=vs))
    ref, _ = decode_quant.decode_quant_forward(p, AttnArgs(q=q, k=kq, v=vq))
    assert torch.allclose(o, ref, atol=1e-5, rtol=1e-5)
    # rows 33 bytes apart (aligned address, odd stride): the plan itself is 122's
    wide = torch.zeros(1, 1, 40, 33, dtype=torch.uint8)
    wide[..., :32] = kq.data
    kw = KVQuant(wide[..., :32], kq.scales, kq.zero_points, kq.dtype, kq.group_size, kq.layout)
    assert not q4.words_ok(kw.data)
    o2, _ = q4.Q4Plan(p, q4.default_config(p))(AttnArgs(q=q, k=kw, v=vq))
    assert torch.allclose(o2, ref, atol=1e-5, rtol=1e-5)


def test_paged_addressing_modes():
    """Paged problems apply; how a 32-key block finds its rows per page size; pools whose
    offsets pass int32 take the int64 variant (meta tensors: the shapes without the memory)."""
    from nnprim.quant import KVQuant
    assert q4._q4_reasons(_problem(page_size=16)) == []
    assert REGISTRY.get("gluon_decode_q4").paged
    assert [q4.page_mode(p, 32) for p in (0, 32, 64, 256, 16, 48, 8)] == [0, 1, 1, 1, 2, 3, 3]

    def pool(pages: int, zp: bool) -> KVQuant:
        data = torch.empty(pages, 8, 64, 64, dtype=torch.uint8, device="meta")
        sc = torch.empty(pages, 8, 64, 2, dtype=torch.bfloat16, device="meta")
        return KVQuant.trusted(data, sc, sc if zp else None, "u4" if zp else "s4", 64, 1)
    assert q4.pools_fit_int32(pool(1000, True), pool(1000, False))
    # codes are addressed in 32-bit words: 2^31 of them (8 GiB) at 32 KiB a page is 262144 pages
    assert q4.pools_fit_int32(pool(262000, False), pool(1000, False))
    assert not q4.pools_fit_int32(pool(263000, False), pool(1000, False))
