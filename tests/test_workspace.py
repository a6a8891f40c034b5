"""`workspace_size(problem)` of every GPU solver against what its invoker really allocates
beyond its outputs, on the CPU (Triton interpreter): conv buffers go through
nnprim.workspace.empty, decode partials through decode._empty, flash buffers through
nnprim.alloc.empty in their modules; each is wrapped to record sizes. tests/gpu/test_workspace.py
checks the same against torch.cuda.max_memory_allocated on the GPU (where the flash
kernels' TMA descriptors add Triton scratch, formula checked here)."""
from __future__ import annotations

import pytest
import torch

from nnprim import alloc, workspace
from nnprim.attention import decode, flash_bwd, flash_bwd_atomic, flash_fwd
from nnprim.conv import direct, im2col_gemm
from nnprim.problems.attention import AttentionProblem
from nnprim.problems.conv import ConvProblem
from nnprim.search.random_args import random_args
from nnprim.search.solver import REGISTRY


def _recorder(monkeypatch, module, attr: str) -> list[int]:
    """Wrap module.attr(shape, dtype, device) to record the bytes it allocates."""
    sizes: list[int] = []
    orig = getattr(module, attr)

    def rec(shape, dtype, device):
        t = orig(shape, dtype, device)
        sizes.append(t.numel() * t.element_size())
        return t
    monkeypatch.setattr(module, attr, rec)
    return sizes


class _AllocRecorder:
    """Stands in for `nnprim.alloc` in one module: records the sizes of what it allocates."""

    def __init__(self) -> None:
        self.sizes: list[int] = []

    def empty(self, shape, dtype, device, strides=None):
        t = alloc.empty(shape, dtype, device, strides)
        self.sizes.append(t.untyped_storage().nbytes())
        return t


def _nbytes(outs) -> int:
    outs = outs if isinstance(outs, tuple) else (outs,)
    return sum(t.numel() * t.element_size() for t in outs if t is not None)


CONV = [  # (direction, x, w, options, layout, dtype)
    ("fwd", (2, 6, 7, 5), (4, 3, 3, 3), dict(padding=1, groups=2), "nhwc", torch.float32),
    ("fwd", (2, 6, 7, 5), (4, 6, 3, 2), dict(padding=((1, 0), (0, 1)), stride=2), "nchw", torch.bfloat16),
    ("fwd", (2, 8, 4, 4), (6, 8, 1, 1), {}, "nhwc", torch.float32),                 # x is the column matrix
    ("bwd_data", (2, 6, 7, 5), (4, 3, 3, 3), dict(padding=1, groups=2, stride=(2, 1)), "nchw", torch.float32),
    ("bwd_data", (2, 4, 9), (6, 4, 3), dict(padding=1), "nhwc", torch.float16),
    ("bwd_weights", (3, 6, 7, 5), (4, 3, 3, 3), dict(padding=1, groups=2), "nchw", torch.float32),
    ("bwd_weights", (2, 4, 5, 5, 5), (4, 4, 3, 3, 3), dict(padding=1), "nhwc", torch.bfloat16),
    ("bwd_weights", (4, 32, 6, 6), (32, 2, 3, 3), dict(padding=1, groups=16), "nhwc", torch.float32),  # direct, [BJ, BC]
    ("bwd_weights", (2, 16, 9, 9), (16, 1, 3, 3), dict(padding=1, groups=16), "nchw", torch.float32),  # direct, tiles
    ("bwd_weights", (1, 4, 33), (4, 1, 33), dict(padding=((32, 0),), groups=4), "nchw", torch.bfloat16),
    ("bwd_weights", (64, 8, 8, 8), (8, 8, 3, 3), dict(padding=1), "nhwc", torch.float32),  # implicit split-K
]


def _conv_problem(case) -> ConvProblem:
    d, x, w, kw, layout, dt = case
    return ConvProblem.create(d, x, w, dtype=dt, layout=layout, **kw)


def _conv_params():
    """Every case without a cap; the small ones (batch <= 4) also with the two block caps."""
    for c in CONV:
        for cap in (None, "images", "rows") if c[1][0] <= 4 else (None,):
            yield pytest.param(c, cap, id=f"{c[0]}-x{'x'.join(map(str, c[1]))}-{c[4]}-{cap or 'nocap'}")


@pytest.mark.parametrize("case,cap", list(_conv_params()))
def test_conv_workspace_is_what_the_invoker_allocates(monkeypatch, case, cap):
    """Every applicable GPU conv solver; the gemm ones also with a cap forcing blocks of one
    image (`images`) or of about a third of one image's rows (`rows`)."""
    p = _conv_problem(case)
    if cap is not None:
        per_row = im2col_gemm._per_row(p, im2col_gemm.geom(p))
        pixels = p.in_size if p.direction == "bwd_data" else p.out_size
        rows = max(3, int(torch.tensor(pixels).prod()) // 3) if cap == "rows" else int(torch.tensor(pixels).prod())
        monkeypatch.setattr(im2col_gemm, "WORKSPACE_CAP", per_row * rows + im2col_gemm.fixed_bytes(p))
    args = random_args(p, seed=1)
    sizes = _recorder(monkeypatch, workspace, "empty")
    checked = []
    for s in REGISTRY.for_problem(p):
        if not s.uses_triton or s.family not in ("gemm", "implicit_gemm", "direct") or not s.is_applicable(p):
            continue
        if cap is not None and s.family != "gemm":
            continue
        sizes.clear()
        s.prepare(p)(args)
        assert sum(sizes) == s.workspace_size(p), (s.name, sizes)
        checked.append(s.name)
    assert checked, REGISTRY.get("gemm_" + p.direction).not_supported_reasons(p)
    if p.direction == "bwd_weights" and p.groups > 1 and p.C // p.groups <= direct.MAX_CH_PER_GROUP:
        assert cap is not None or "direct_bwd_weights" in checked


def test_gemm_blocks_pack_what_is_not_a_view(monkeypatch):
    """NCHW weights are packed for the forward GEMM (a view for NHWC); NCHW dy is packed in
    multi-image backward-weights blocks only: both counted in the workspace."""
    fwd = {lay: im2col_gemm.Plan(ConvProblem.create("fwd", (2, 4, 6, 6), (8, 4, 3, 3), dtype=torch.float32,
                                                    layout=lay, padding=1)) for lay in ("nchw", "nhwc")}
    assert fwd["nchw"].bufs.w_pack == 8 * 4 * 9 and fwd["nhwc"].bufs.w_pack == 0
    bw = ConvProblem.create("bwd_weights", (4, 4, 6, 6), (8, 4, 3, 3), dtype=torch.float32, layout="nchw", padding=1)
    assert im2col_gemm.Plan(bw).pack_dy                      # all four images in one block
    per_row = im2col_gemm._per_row(bw, im2col_gemm.geom(bw))
    monkeypatch.setattr(im2col_gemm, "WORKSPACE_CAP", per_row * 36 + im2col_gemm.fixed_bytes(bw))
    assert not im2col_gemm.Plan(bw).pack_dy                  # one image per block: a view


ATTN = [  # (solver, problem options)
    ("flash_fwd", dict(B=2, Hq=4, Hkv=2, Sq=19, Sk=23, D=16, Dv=16, return_lse=True)),
    ("flash_fwd", dict(B=1, Hq=2, Hkv=1, Sq=5, Sk=40, D=24, Dv=8)),
    ("flash_bwd", dict(B=2, Hq=4, Hkv=2, Sq=19, Sk=23, D=16, Dv=16, direction="bwd", return_lse=True)),
    ("flash_bwd_atomic", dict(B=2, Hq=4, Hkv=2, Sq=19, Sk=23, D=16, Dv=24, direction="bwd", return_lse=True)),
    ("flash_bwd_ordered", dict(B=1, Hq=2, Hkv=1, Sq=37, Sk=23, D=16, Dv=16, direction="bwd", return_lse=True)),
    ("decode_split_k", dict(B=1, Hq=4, Hkv=1, Sq=2, Sk=200, D=16, Dv=16, return_lse=True)),
    ("decode_split_k", dict(B=2, Hq=2, Hkv=2, Sq=1, Sk=20, D=16, Dv=16)),            # one split: none
    ("decode_split_k_quant", dict(B=1, Hq=2, Hkv=1, Sq=1, Sk=150, D=16, Dv=16, k_quant=("s8", 16, "t", "float32", None))),
    ("decode_split_k_quant_grouped", dict(B=1, Hq=2, Hkv=1, Sq=3, Sk=130, D=32, Dv=32,
                                          v_quant=("u4", 16, "g", "float16", "g"))),
]


@pytest.mark.parametrize("name,opts", ATTN, ids=[f"{n}-{i}" for i, (n, _) in enumerate(ATTN)])
def test_attention_workspace_is_what_the_invoker_allocates(monkeypatch, name, opts):
    opts = dict(direction="fwd", dtype=torch.float32, device="cpu") | opts
    p = AttentionProblem(**opts)
    s = REGISTRY.get(name)
    assert s.is_applicable(p), s.not_supported_reasons(p)
    args = random_args(p, seed=2)
    if name.startswith("decode"):
        sizes = _recorder(monkeypatch, decode, "_empty")
    else:
        rec = _AllocRecorder()
        mod = {"flash_fwd": flash_fwd, "flash_bwd": flash_bwd}.get(name, flash_bwd_atomic)
        monkeypatch.setattr(mod, "alloc", rec)
        sizes = rec.sizes
    outs = s.prepare(p)(args)
    assert sum(sizes) - _nbytes(outs) == s.workspace_size(p), (sizes, _nbytes(outs))
    if name.startswith("decode") and p.Sk > 100:
        assert s.workspace_size(p) > 0


def test_flash_tma_scratch_formula(monkeypatch):
    """128 bytes of Triton global scratch per in-kernel TMA descriptor and program; the
    descriptor counts (3 forward, 4 fused backward kernels, 4-8 head-dim split kernels, equal
    chunk widths merged) were read from the sm_90 compilations of these kernels."""
    for mod in (flash_fwd, flash_bwd):
        monkeypatch.setattr(mod, "tma_expected", lambda problem: True)
    p = AttentionProblem(direction="fwd", B=2, Hq=4, Hkv=2, Sq=300, Sk=77, D=64, Dv=64, dtype=torch.bfloat16,
                         device="cpu")   # tiles as under the interpreter; TMA forced on above
    cfg, bcfg = flash_fwd.configs.choose(p)
    assert REGISTRY.get("flash_fwd").workspace_size(p) == 3 * 128 * -(-300 // cfg.block_m) * 8
    pb = p.with_direction("bwd")
    delta = 4 * 2 * 4 * 300
    ws = REGISTRY.get("flash_bwd").workspace_size(pb)
    assert ws == delta + 128 * 4 * max(-(-77 // bcfg.block_n) * 4, -(-300 // bcfg.block_n) * 8)
    count = {(d, dv): flash_bwd._split_descriptors(AttentionProblem(direction="bwd", B=1, Hq=1, Hkv=1, Sq=1, Sk=1,
                                                                    D=d, Dv=dv, dtype=torch.bfloat16, device="cuda"))
             for d, dv in ((160, 160), (256, 256), (160, 64), (256, 200))}
    assert count == {(160, 160): 8, (256, 256): 4, (160, 64): 6, (256, 200): 4}
