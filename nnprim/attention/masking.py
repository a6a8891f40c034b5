"""Score bias and key visibility of one attention call, in float64 (reference and tests).

For the (B, Hq, Sq, Sk) score block (or a sub-block of batches x query heads x query
rows, indexed globally) key j is visible to query i of batch entry b iff all of:
- causal "top_left":      j <= i
- causal "bottom_right":  j <= i + (L_b - Sq), L_b = kv_lens[b] if given else Sk
- kv_lens:                j <  kv_lens[b]
- bool attn_mask:         mask[b, h, i, j] is True (broadcast)
- additive attn_mask:     mask[b, h, i, j] != -inf (broadcast)
The bias is the additive mask (0 without one) where visible and -inf elsewhere, so
scores = scale * q.k + bias. A row with no visible key is "fully masked".
"""
from __future__ import annotations

import torch


def _sub(rng: range, sl: slice | None) -> range:
    return rng[sl] if sl is not None else rng


def visibility(B: int, Hq: int, Sq: int, Sk: int, *, causal: str | None = None,
               attn_mask: torch.Tensor | None = None, kv_lens: torch.Tensor | None = None,
               device=None, batches: slice | None = None, heads: slice | None = None,
               rows: slice | None = None) -> torch.Tensor:
    """Bool (nb, nh, nr, Sk): True where key j is visible to query i (see module doc);
    `batches`, `heads`, `rows` select a sub-block (indices stay global)."""
    bs, hs, rs = _sub(range(B), batches), _sub(range(Hq), heads), _sub(range(Sq), rows)
    dev = torch.device(device) if device is not None else (
        attn_mask.device if attn_mask is not None else torch.device("cpu"))
    i = torch.arange(rs.start, rs.stop, rs.step, device=dev).view(1, 1, -1, 1)
    j = torch.arange(Sk, device=dev).view(1, 1, 1, Sk)
    vis = torch.ones(len(bs), len(hs), len(rs), Sk, dtype=torch.bool, device=dev)
    if kv_lens is not None:
        L = kv_lens.to(device=dev, dtype=torch.int64)[bs.start:bs.stop:bs.step].view(-1, 1, 1, 1)
        vis &= j < L
    else:
        L = torch.full((len(bs), 1, 1, 1), Sk, dtype=torch.int64, device=dev)
    if causal == "top_left":
        vis &= j <= i
    elif causal == "bottom_right":
        vis &= j <= i + (L - Sq)
    elif causal is not None:
        raise ValueError(f"causal={causal!r}")
    if attn_mask is not None:
        m = _mask_block(attn_mask, Sk, bs, hs, rs).to(dev)
        vis &= m if m.dtype == torch.bool else m != float("-inf")
    return vis


def _mask_block(attn_mask: torch.Tensor, Sk: int, bs: range, hs: range, rs: range) -> torch.Tensor:
    m = attn_mask.reshape((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape))
    if m.shape[0] != 1:
        m = m[bs.start:bs.stop:bs.step]
    if m.shape[1] != 1:
        m = m[:, hs.start:hs.stop:hs.step]
    if m.shape[2] != 1:
        m = m[:, :, rs.start:rs.stop:rs.step]
    return m.expand(len(bs), len(hs), len(rs), Sk)


MASK_FLOOR = -torch.finfo(torch.float32).max / 1.4426950408889634   # -FMAX / log2(e)


def score_bias(B: int, Hq: int, Sq: int, Sk: int, *, causal: str | None = None,
               attn_mask: torch.Tensor | None = None, kv_lens: torch.Tensor | None = None,
               device=None, batches: slice | None = None, heads: slice | None = None,
               rows: slice | None = None, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """(nb, nh, nr, Sk) in `dtype`: additive mask (or 0) where visible, -inf elsewhere."""
    vis = visibility(B, Hq, Sq, Sk, causal=causal, attn_mask=attn_mask, kv_lens=kv_lens,
                     device=device, batches=batches, heads=heads, rows=rows)
    bias = torch.zeros(vis.shape, dtype=dtype, device=vis.device)
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        bs, hs, rs = _sub(range(B), batches), _sub(range(Hq), heads), _sub(range(Sq), rows)
        bias += _mask_block(attn_mask, Sk, bs, hs, rs).to(device=vis.device, dtype=dtype)
        # finite values past -FMAX / log2(e) act as that bound, as in the log2-domain kernels
        # (cpu_flash._log2_safe): finfo.min there overflowed to -inf; the same lse follows
        bias.clamp_(min=MASK_FLOOR)
    return bias.masked_fill_(~vis, float("-inf"))


def problem_bias(problem, args, *, batches: slice | None = None, heads: slice | None = None,
                 rows: slice | None = None, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """score_bias for an AttentionProblem and its AttnArgs."""
    return score_bias(problem.B, problem.Hq, problem.Sq, problem.Sk, causal=problem.causal,
                      attn_mask=args.attn_mask, kv_lens=args.kv_lens, device=args.q.device,
                      batches=batches, heads=heads, rows=rows, dtype=dtype)


def fully_masked_rows(problem, args) -> torch.Tensor:
    """Bool (B, Hq, Sq): rows with no visible key (o = NaN or 0, lse = -inf)."""
    vis = visibility(problem.B, problem.Hq, problem.Sq, problem.Sk, causal=problem.causal,
                     attn_mask=args.attn_mask, kv_lens=args.kv_lens, device=args.q.device)
    return ~vis.any(dim=-1)
