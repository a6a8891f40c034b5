"""Dropout RNG: torch Philox vs Triton's tl.randint / the jit helper (bit for bit under the
interpreter), keep-rate statistics, threshold edge cases, purity of the mask."""
import math

import pytest
import torch
import triton
import triton.language as tl

from nnprim.dropout import dropout_keep, dropout_keep_block, dropout_keep_mask, dropout_scale, dropout_threshold, philox_randint
from nnprim.errors import BadParameterError


@triton.jit
def _randint_kernel(out, seed, offset, N: tl.constexpr):
    c = tl.arange(0, N).to(tl.int64) + offset
    tl.store(out + tl.arange(0, N), tl.randint(seed, c).to(tl.int64))


@triton.jit
def _keep_kernel(out, seed, offset, Hq, Sq, Sk, threshold, TRANSPOSED: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    pm = tl.program_id(2)
    rows = pm * BM + tl.arange(0, BM)
    cols = tl.arange(0, BN)
    if TRANSPOSED:  # keys along dim 0, as a backward kernel walking K blocks would
        keep = dropout_keep(seed, offset, b, h, rows[None, :], cols[:, None], Hq, Sq, Sk, threshold)
        ptr = out + ((b * Hq + h) * Sq + rows[None, :]) * Sk + cols[:, None]
        msk = (rows[None, :] < Sq) & (cols[:, None] < Sk)
    else:
        keep = dropout_keep(seed, offset, b, h, rows[:, None], cols[None, :], Hq, Sq, Sk, threshold)
        ptr = out + ((b * Hq + h) * Sq + rows[:, None]) * Sk + cols[None, :]
        msk = (rows[:, None] < Sq) & (cols[None, :] < Sk)
    tl.store(ptr, keep.to(tl.int8), mask=msk)


def test_philox_known_answer():
    # Random123 known-answer vector: Philox4x32-10, counter 0, key 0 -> first word 0x6627e8d5
    assert int(philox_randint(0, torch.zeros(1, dtype=torch.int64))[0]) == 0x6627E8D5


@pytest.mark.parametrize("seed,offset", [(0, 0), (1, 1), (12345, 2**40 + 7), (2**62 + 5, 2**63 - 40),
                                         (2**32 - 1, 2**32 - 20)])
def test_philox_matches_tl_randint(seed, offset):
    out = torch.full((64,), -1, dtype=torch.int64)
    _randint_kernel[(1,)](out, seed, offset, N=64)
    counters = torch.arange(64, dtype=torch.int64) + offset  # wraps past 2**63 like int64 in Triton
    ref = philox_randint(seed, counters)
    assert torch.equal(out, ref)
    assert int(ref.min()) >= 0 and int(ref.max()) < 2**32


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("p,seed,offset", [(0.1, 7, 0), (0.5, 1, 1), (0.9, 2**40 + 3, 2**63 - 100),
                                           (0.37, 99, 123456789)])
def test_jit_helper_bit_equal(p, seed, offset, transposed):
    B, Hq, Sq, Sk = 2, 3, 13, 11
    out = torch.full((B, Hq, Sq, Sk), 5, dtype=torch.int8)
    _keep_kernel[(B, Hq, triton.cdiv(Sq, 8))](out, seed, offset, Hq, Sq, Sk, dropout_threshold(p),
                                               TRANSPOSED=transposed, BM=8, BN=16)
    assert not (out == 5).any(), "kernel left elements unwritten"
    ref = dropout_keep_mask(seed, offset, B, Hq, Sq, Sk, p)
    assert torch.equal(out.bool(), ref)


def test_threshold_and_scale():
    assert dropout_threshold(0.0) == 0
    assert dropout_threshold(0.5) == 2**31
    assert dropout_threshold(0.25) == 2**30
    assert dropout_threshold(1.0 - 2**-40) == 2**32 - 1   # capped
    assert dropout_threshold(1e-12) == 0                    # keeps everything
    assert dropout_scale(0.2) == pytest.approx(1.25)
    for bad in (-0.1, 1.0, True, "0.1"):
        with pytest.raises(BadParameterError):
            dropout_threshold(bad)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_rate(p):
    B, Hq, Sq, Sk = 2, 4, 64, 200
    keep = dropout_keep_mask(2024, 17, B, Hq, Sq, Sk, p)
    n = keep.numel()
    rate = keep.double().mean().item()
    sigma = math.sqrt(p * (1 - p) / n)
    assert abs(rate - (1 - p)) < 5 * sigma
    # neighbours (j, j+1) and (i, i+1) are uncorrelated
    k = keep.double() - rate
    for a, b in ((k[..., 1:], k[..., :-1]), (k[:, :, 1:], k[:, :, :-1])):
        corr = (a * b).mean().item() / (p * (1 - p))
        assert abs(corr) < 5 / math.sqrt(a.numel())
    # each (b, h) block has its own stream
    assert not torch.equal(keep[0, 0], keep[0, 1]) and not torch.equal(keep[0, 0], keep[1, 0])


def test_mask_is_pure_function_of_indices():
    B, Hq, Sq, Sk, p = 3, 4, 5, 7, 0.3
    full = dropout_keep_mask(5, 9, B, Hq, Sq, Sk, p)
    assert torch.equal(full, dropout_keep_mask(5, 9, B, Hq, Sq, Sk, p))
    sub = dropout_keep_mask(5, 9, B, Hq, Sq, Sk, p, batches=slice(1, 3), heads=slice(2, 3))
    assert torch.equal(sub, full[1:3, 2:3])
    sub = dropout_keep_mask(5, 9, B, Hq, Sq, Sk, p, heads=slice(1, 3), rows=slice(3, 5))
    assert torch.equal(sub, full[:, 1:3, 3:5])
    # element-wise definition
    thr = dropout_threshold(p)
    for (b, h, i, j) in [(0, 0, 0, 0), (2, 3, 4, 6), (1, 2, 3, 1)]:
        counter = 9 + ((b * Hq + h) * Sq + i) * Sk + j
        r = int(philox_randint(5, torch.tensor([counter]))[0])
        assert bool(full[b, h, i, j]) == (r >= thr)
        assert bool(dropout_keep_block(5, 9, b, h, i, j, Hq, Sq, Sk, thr)) == (r >= thr)
    # offset shifts the counter stream: offset + Sk selects the next row's values
    shifted = dropout_keep_mask(5, 9 + Sk, B, Hq, Sq, Sk, p)
    assert torch.equal(shifted.reshape(-1)[:-Sk], full.reshape(-1)[Sk:])
    assert dropout_keep_mask(5, 9, B, Hq, Sq, Sk, 0.0).all()


@pytest.mark.parametrize("seed,offset", [(0, 0), (12345, 2**40 + 7), (2**62 + 5, 2**63 - 40), (2**63 + 9, 3),
                                         (2**32 - 1, 2**32 - 20)])
def test_native_block_equals_the_torch_ops(seed, offset):
    """The CPU's native Philox (dropout_src.cpp) gives the torch-op twin's flags bit for bit,
    counters wrapping past 2**63 included; other column patterns take the torch ops."""
    from nnprim.dropout import _NATIVE, dropout_counter
    if _NATIVE.ops() is None:
        pytest.skip("no native build on this machine")
    Hq, Sq, Sk, thr = 6, 37, 53, dropout_threshold(0.3)
    b = torch.arange(2).view(-1, 1, 1, 1, 1)
    h = (torch.arange(1, 3).view(1, -1, 1, 1) * 3 + torch.arange(3).view(1, 1, -1, 1)).unsqueeze(-1)
    i = torch.arange(5, 21).view(1, 1, 1, -1, 1)
    j = torch.arange(7, 50).view(1, 1, 1, 1, -1)
    got = dropout_keep_block(seed, offset, b, h, i, j, Hq, Sq, Sk, thr)
    want = philox_randint(seed, dropout_counter(offset, b, h, i, j, Hq, Sq, Sk)) >= thr
    assert got.shape == want.shape and torch.equal(got, want)
    odd = j[..., ::2]                                      # not consecutive: the torch ops
    assert torch.equal(dropout_keep_block(seed, offset, b, h, i, odd, Hq, Sq, Sk, thr), want[..., ::2])
