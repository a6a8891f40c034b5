"""The tile walk of the Gluon backward kernels (127 `gluon_flash_bwd`, 130
`gluon_flash_bwd_d256`) in float64 torch, shared by their emulation tests: TMA-like
zero-padded operands, the query-block range of a key block, and the consumers' two flat
loops over (query head of the group, query block). The index arithmetic is written again
here, not imported from the kernels, so the emulations check that it covers every row and
masks what it must."""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch


@dataclass
class Padded:
    q: torch.Tensor       # (B, Hq, m_end, D), zero rows past Sq
    do: torch.Tensor
    k: torch.Tensor       # (B, Hkv, n_pad, D), zero rows past Sk
    v: torch.Tensor
    lse2: torch.Tensor    # (B, Hq, m_end): +inf past Sq and where a row sees no key
    delta: torch.Tensor   # rowsum(dO O), 0 past Sq and where a row sees no key
    shift: int            # Sk - Sq for bottom-right causal, else 0
    m_end: int
    n_pad: int


def padded(p, q, k, v, do, o, lse, BM: int, BN: int) -> Padded:
    B, Hq, Sq, Sk = p.B, p.Hq, p.Sq, p.Sk
    m_end, n_pad = -(-Sq // BM) * BM, -(-Sk // BN) * BN

    def pad(t, n):
        return torch.cat([t, t.new_zeros(*t.shape[:-2], n - t.shape[-2], t.shape[-1])], -2)
    lse2 = torch.where(torch.isneginf(lse), torch.inf, lse)
    lse2 = torch.cat([lse2, lse2.new_full((B, Hq, m_end - Sq), torch.inf)], -1)
    delta = torch.where(torch.isneginf(lse), 0.0, (o * do).sum(-1))
    delta = torch.cat([delta, delta.new_zeros(B, Hq, m_end - Sq)], -1)
    shift = Sk - Sq if p.causal == "bottom_right" else 0
    return Padded(pad(q, m_end), pad(do, m_end), pad(k, n_pad), pad(v, n_pad), lse2, delta, shift, m_end, n_pad)


def query_range(p, t: Padded, start_n: int, BM: int, BN: int) -> tuple[int, int]:
    """(lo, full) of the key block at start_n: query blocks [lo, m_end) see a key of it,
    [lo, full) need element masks."""
    if p.causal:
        lo = max(start_n - t.shift, 0) // BM * BM
        full = -(-max(start_n + BN - 1 - t.shift, 0) // BM) * BM
    else:
        lo = full = 0
    lo = min(lo, t.m_end)
    full = max(min(full, t.m_end), lo)
    if start_n + BN > p.Sk:
        full = t.m_end
    return lo, full


def flat_steps(p, t: Padded, lo: int, full: int, hk: int, BM: int) -> Iterator[tuple[bool, int, int]]:
    """(masked, query head, start_m) in the consumers' order: [lo, full) of every head of the
    group with element masks, then [full, m_end) of every head without."""
    G = p.group
    for masked, m0, m1 in ((True, lo, full), (False, full, t.m_end)):
        g, start_m = 0, m0
        for _ in range(G * ((m1 - m0) // BM)):
            yield masked, hk * G + g, start_m
            start_m += BM
            if start_m >= m1:
                start_m, g = m0, g + 1
