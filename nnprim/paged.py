"""Paged K/V caches: page pools, block tables, the gather to a contiguous cache and the
append of new tokens.

A page pool is a tensor (or a `KVQuant` whose data, grouped scales and zero points are)
of shape (num_pages, Hkv, page_size, D); `block_table` (B, max_pages) int32 names each
sequence's pages in order: key j of sequence b lives in page block_table[b, j // page_size],
row j % page_size. Only the first ceil(kv_lens[b] / page_size) entries of a row are read,
so the rest may hold anything (e.g. -1). The logical cache is (B, Hkv, max_pages *
page_size, D); `kv_lens` (required) says how many of its keys are valid.

    gather_pages(pool, block_table)            -> the contiguous (B, Hkv, Sk, D) cache
    to_pages(cache, block_table, num_pages)    -> a pool holding a contiguous cache
    append_kv(k_pages, v_pages, block_table, kv_lens, k_new, v_new, *, symmetric=None)
                                               -> new kv_lens (the pools are written in place)

The kernels address pages themselves (nnprim/attention/paging.py); the reference and the
CPU solvers gather (`gathered`)."""
from __future__ import annotations

import torch

from .errors import BadParameterError, NotSupportedError
from .quant import KVQuant, quantize_kv
from .search.capture import capturing


def pool_shape(name: str, t) -> tuple[int, int, int, int]:
    """(num_pages, Hkv, page_size, D) of a page pool (tensor or KVQuant)."""
    if isinstance(t, KVQuant):
        return t.shape
    if not isinstance(t, torch.Tensor):
        raise BadParameterError(f"{name} must be a torch.Tensor or KVQuant page pool, got {type(t).__name__}")
    if t.dim() != 4:
        raise BadParameterError(f"{name} page pool must be 4-D (num_pages, Hkv, page_size, D), got shape "
                                f"{tuple(t.shape)}")
    return tuple(t.shape)


def check_block_table(block_table, B: int, device: torch.device) -> tuple[int, int]:
    """Validate block_table's type, dtype, rank, batch and device; (B, max_pages)."""
    if not isinstance(block_table, torch.Tensor):
        raise BadParameterError(f"block_table must be an int32 tensor (B, max_pages), got "
                                f"{type(block_table).__name__}")
    if block_table.dtype != torch.int32:
        raise BadParameterError(f"block_table.dtype={block_table.dtype} must be torch.int32")
    if block_table.dim() != 2:
        raise BadParameterError(f"block_table must be 2-D (B, max_pages), got shape {tuple(block_table.shape)}")
    if block_table.shape[0] != B:
        raise BadParameterError(f"block_table shape {tuple(block_table.shape)} must have B={B} rows")
    if block_table.shape[1] < 1:
        raise BadParameterError(f"block_table shape {tuple(block_table.shape)} must have at least one page column")
    if block_table.device != device:
        raise BadParameterError(f"block_table is on {block_table.device} but q is on {device}")
    return tuple(block_table.shape)


def check_page_values(block_table: torch.Tensor, kv_lens: torch.Tensor, num_pages: int, page_size: int) -> None:
    """The pages each sequence uses (its first ceil(kv_lens / page_size) entries) lie in
    [0, num_pages). A device sync on GPUs: callers check on CPU tensors or when asked."""
    if block_table.numel() == 0:
        return
    used = (kv_lens.to(torch.int64).clamp(min=0) + page_size - 1) // page_size
    cols = torch.arange(block_table.shape[1], device=block_table.device)
    bad = (cols[None, :] < used[:, None]) & ((block_table < 0) | (block_table >= num_pages))
    if bool(bad.any()):
        b, j = (int(x) for x in bad.nonzero()[0])
        raise BadParameterError(f"block_table[{b}, {j}]={int(block_table[b, j])} is not a page of the pool "
                                f"(num_pages={num_pages}) but sequence {b} uses it (kv_lens={int(kv_lens[b])})")


def _gather(t: torch.Tensor | None, bt: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor | None:
    """(num_pages, H, P, X) pool -> (B, H, max_pages * P, X) by the block table, zero where
    `valid` (B, max_pages * P) is False; a per-tensor (one-element) parameter stays as it is."""
    if t is None or t.numel() == 1:
        return t
    B, M = bt.shape
    if t.dim() == 2:  # per head, shared by every page (check_pool_params)
        return t[:1].expand(B, t.shape[1])
    _, H, P, X = t.shape
    g = t[bt.reshape(-1)].reshape(B, M, H, P, X)
    g = g.permute(0, 2, 1, 3, 4).reshape(B, H, M * P, X)
    if valid is not None:
        if g.dtype == torch.float8_e4m3fn:  # no masked_fill for fp8: zero bytes are +0.0
            g = g.view(torch.uint8).masked_fill(~valid[:, None, :, None], 0).view(g.dtype)
        else:
            g = g.masked_fill(~valid[:, None, :, None], 0)
    return g


def gather_pages(pool, block_table: torch.Tensor, kv_lens: torch.Tensor | None = None):
    """The contiguous cache (B, Hkv, max_pages * page_size, D) of a page pool (tensor or
    KVQuant, returned as the same kind). Entries outside [0, num_pages) read page 0; with
    kv_lens, keys at or past each sequence's length are 0 (page tails and unused pages may
    hold anything, NaN included, and the solvers that run on the gathered cache read
    keys past kv_lens with zero weight)."""
    num_pages = pool.shape[0]
    bt = block_table.to(torch.int64)
    bt = torch.where((bt >= 0) & (bt < num_pages), bt, torch.zeros_like(bt))
    valid = None
    if kv_lens is not None:
        valid = torch.arange(bt.shape[1] * pool.shape[2], device=bt.device)[None, :] < kv_lens.to(bt.device)[:, None]
    if isinstance(pool, KVQuant):
        return KVQuant.trusted(_gather(pool.data, bt, valid), _gather(pool.scales, bt, valid),
                               _gather(pool.zero_points, bt, valid), pool.dtype, pool.group_size, pool.layout)
    return _gather(pool, bt, valid)


def _scatter(t: torch.Tensor | None, bt: torch.Tensor, num_pages: int) -> torch.Tensor | None:
    if t is None or t.numel() == 1:
        return t
    if t.dim() == 2:  # per head: a pool shares one value per head across its pages
        if t.shape[0] > 1 and not bool((t == t[:1]).all()):
            raise BadParameterError("to_pages: per-head scales / zero points differ between batch entries; "
                                    "a page pool shares one per head")
        return t[:1].expand(num_pages, t.shape[1])
    B, H, S, X = t.shape
    M = bt.shape[1]
    P = S // M
    pool = torch.zeros((num_pages, H, P, X), dtype=t.dtype, device=t.device)
    pool[bt.reshape(-1).to(torch.int64)] = t.reshape(B, H, M, P, X).permute(0, 2, 1, 3, 4).reshape(B * M, H, P, X)
    return pool


def to_pages(cache, block_table: torch.Tensor, num_pages: int | None = None):
    """A page pool (num_pages, H, page_size, X) holding the contiguous cache (B, H, S, X)
    (tensor or KVQuant) at the pages of `block_table` (B, max_pages), page_size =
    S / max_pages; pages no sequence names are zero. The inverse of gather_pages (tests,
    find's random inputs, converting a cache)."""
    M = block_table.shape[1]
    S = cache.shape[2]
    if S % M:
        raise BadParameterError(f"to_pages: the cache's {S} keys are not max_pages={M} whole pages")
    n = int(block_table.max()) + 1 if num_pages is None else num_pages
    if isinstance(cache, KVQuant):
        return KVQuant.trusted(_scatter(cache.data, block_table, n), _scatter(cache.scales, block_table, n),
                               _scatter(cache.zero_points, block_table, n), cache.dtype, cache.group_size,
                               cache.layout)
    return _scatter(cache, block_table, n)


def gathered(args):
    """AttnArgs with k and v gathered into contiguous caches (block_table dropped), 0 past kv_lens."""
    from dataclasses import replace
    bt, lens = args.block_table, args.kv_lens
    return replace(args, k=gather_pages(args.k, bt, lens), v=gather_pages(args.v, bt, lens), block_table=None)


def gathering(invoker):
    """An invoker of the contiguous problem that takes paged AttnArgs (CPU solvers,
    the reference): gathers the pages first."""
    def invoke(args):
        return invoker(gathered(args) if args.block_table is not None else args)
    return invoke


# ---- append -----------------------------------------------------------------------------

def _check_pool_pair(k_pages, v_pages) -> tuple[int, int, int, int, int]:
    nk, hk, pk, dk = pool_shape("k_pages", k_pages)
    nv, hv, pv, dv = pool_shape("v_pages", v_pages)
    if (nk, hk, pk) != (nv, hv, pv):
        raise BadParameterError(f"k_pages {(nk, hk, pk, dk)} and v_pages {(nv, hv, pv, dv)} must have the same "
                                "(num_pages, Hkv, page_size)")
    return nk, hk, pk, dk, dv


def check_pool_params(name: str, pool) -> None:
    """Per-head scales / zero points of a KVQuant page pool ((num_pages, H)) must be one per
    head shared by every page (an expanded (H,) view): the kernels read page 0's."""
    if not isinstance(pool, KVQuant):
        return
    for what, t in (("scales", pool.scales), ("zero_points", pool.zero_points)):
        if t is not None and t.dim() == 2 and t.numel() > 1 and t.shape[0] > 1 and t.stride(0) != 0:
            raise BadParameterError(f"{name}.{what} of a page pool is per (page, head) {tuple(t.shape)}: per-head "
                                    "values must be shared by every page, e.g. s.expand(num_pages, H) of an "
                                    "(H,) tensor (or grouped per token)")


def _static_codes(pool: KVQuant, x: torch.Tensor, name: str) -> torch.Tensor:
    """Codes of new tokens x (B, H, S, D) under the pool's fixed per-tensor / per-head scale
    (and zero point): what a static-scale cache (e.g. fp8 with a calibrated scale) stores."""
    B, H = x.shape[:2]

    def per(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(1, 1, 1, 1).float() if t.numel() == 1 else t[:1].float().reshape(1, H, 1, 1)
    if pool.zero_points is not None and pool.zp_kind == "g":
        raise NotSupportedError(f"append_kv into {name}: a fixed scale with grouped zero points is not supported")
    xs = x.float() / per(pool.scales)
    if pool.is_fp8:
        from .quant import FP8_MAX
        return xs.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    from .quant import _RANGE, _nibbles_from_layout0
    lo, hi = _RANGE[pool.dtype]
    if pool.zero_points is not None:
        xs = xs + per(pool.zero_points)
    q = torch.round(xs).clamp(lo, hi).to(torch.int32)
    if pool.dtype == "s8":
        return q.to(torch.int8)
    if pool.dtype == "u8":
        return q.to(torch.uint8)
    nib = q & 0x0F
    return _nibbles_from_layout0((nib[..., 0::2] | (nib[..., 1::2] << 4)).to(torch.uint8), pool.layout)


def _quantize_like(pool: KVQuant, x: torch.Tensor, name: str, symmetric: bool | None) -> KVQuant:
    """New tokens x (B, H, S, D) quantized as quantize_kv would quantize the whole cache
    into `pool`'s format (per token and group, so the result is the same); with a per-tensor
    or per-head scale, the codes under the pool's fixed scale (its scales stay)."""
    check_pool_params(name, pool)
    if pool.scale_kind != "g":
        return KVQuant.trusted(_static_codes(pool, x, name), pool.scales, pool.zero_points, pool.dtype,
                               pool.group_size, pool.layout)
    if pool.zero_points is not None and pool.zp_kind != "g":
        raise NotSupportedError(f"append_kv into {name} with grouped scales and a per-tensor / per-head zero "
                                "point: needs grouped zero points")
    signed = pool.dtype in ("s8", "s4")
    if symmetric is None:
        symmetric = pool.zero_points is None if signed else True
    q = quantize_kv(x, pool.dtype, pool.group, symmetric=symmetric, scale_dtype=pool.scales.dtype,
                    layout=pool.layout)
    if (q.zero_points is None) != (pool.zero_points is None):
        raise BadParameterError(f"append_kv: {name} {'has' if pool.zero_points is not None else 'has no'} zero "
                                f"points but symmetric={symmetric} quantization of {pool.dtype} "
                                f"{'has none' if q.zero_points is None else 'makes them'}")
    return q


def _parts(t, pool) -> list[torch.Tensor]:
    """The per-token tensors of a K/V argument (codes, and the scales / zero points that are
    grouped in `pool`, the page pool it is written to)."""
    if isinstance(t, KVQuant):
        return [t.data] + [x for x, kind in ((t.scales, pool.scale_kind), (t.zero_points, pool.zp_kind))
                           if kind == "g"]
    return [t]


def contiguous_table(block_table: torch.Tensor | None) -> torch.Tensor | None:
    """The table the kernels index: they take its row stride only (a column-strided view,
    bt[:, ::2], was read as contiguous: wrong pages, and append_kv wrote past the pool)."""
    return block_table if block_table is None or block_table.is_contiguous() else block_table.contiguous()


def append_kv(k_pages, v_pages, block_table: torch.Tensor, kv_lens: torch.Tensor, k_new: torch.Tensor,
              v_new: torch.Tensor, *, symmetric: bool | None = None, check: bool = True) -> torch.Tensor:
    """Write new tokens k_new (B, Hkv, S_new, D) and v_new (B, Hkv, S_new, Dv) into the
    page pools at positions kv_lens[b] .. kv_lens[b] + S_new - 1 of each sequence, in
    place; returns the new kv_lens (kv_lens + S_new, kv_lens' dtype). KVQuant pools are
    quantized on append: grouped (per-token) scales with `quantize_kv`'s quantiser in the
    pool's format (dtype, group size, scale dtype, layout; `symmetric` defaults to "no zero
    points" for s8/s4 pools and True for u8/u4 ones: pass False for asymmetric u8/u4 pools),
    so the pages hold what quantizing the contiguous cache would; per-tensor / per-head
    scales (fp8, static scales) are the pool's and stay: codes = x / scale (+ zero point).
    The pages a write reaches must be in the block table: a sequence that would pass max_pages * page_size keys, or a page id out
    of range, raises BadParameterError (checked on every call, a device sync on GPUs, except
    with check=False or during CUDA graph capture: rows past the table are then skipped). One scatter kernel on GPUs
    (per pair of K/V parts), torch indexing on CPUs."""
    num_pages, H, P, D, Dv = _check_pool_pair(k_pages, v_pages)
    for name, t in (("k_new", k_new), ("v_new", v_new)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise BadParameterError(f"{name} must be a 4-D tensor (B, Hkv, S_new, D), got "
                                    f"{getattr(t, 'shape', type(t).__name__)}")
    B, Hn, S, Dn = k_new.shape
    if tuple(v_new.shape[:3]) != (B, Hn, S):
        raise BadParameterError(f"v_new shape {tuple(v_new.shape)} must match k_new {tuple(k_new.shape)} in "
                                "(B, Hkv, S_new)")
    if Hn != H or Dn != D or v_new.shape[3] != Dv:
        raise BadParameterError(f"k_new {tuple(k_new.shape)} / v_new {tuple(v_new.shape)} must be (B, Hkv={H}, "
                                f"S_new, D={D}) / (B, Hkv, S_new, Dv={Dv}) to match the pools")
    dev = k_new.device
    for name, t in (("k_pages", k_pages), ("v_pages", v_pages), ("v_new", v_new)):
        if t.device != dev:
            raise BadParameterError(f"{name} is on {t.device} but k_new is on {dev}")
    check_block_table(block_table, B, dev)
    block_table = contiguous_table(block_table)
    if not isinstance(kv_lens, torch.Tensor) or kv_lens.dtype not in (torch.int32, torch.int64):
        raise BadParameterError(f"kv_lens must be an int32/int64 tensor (B,), got "
                                f"{getattr(kv_lens, 'dtype', type(kv_lens).__name__)}")
    if tuple(kv_lens.shape) != (B,) or kv_lens.device != dev:
        raise BadParameterError(f"kv_lens (shape {tuple(kv_lens.shape)}, on {kv_lens.device}) must be (B,)=({B},) "
                                f"on {dev}")
    for name, pool, new in (("k_pages", k_pages, k_new), ("v_pages", v_pages, v_new)):
        if not new.is_floating_point():
            raise BadParameterError(f"{name[0]}_new.dtype={new.dtype} must be floating point")
        if isinstance(pool, torch.Tensor) and pool.dtype != new.dtype:
            raise BadParameterError(f"{name[0]}_new.dtype={new.dtype} must match {name}.dtype={pool.dtype}")
    new_lens = kv_lens + S
    capacity = block_table.shape[1] * P
    if check and not capturing(dev):
        lo, hi = int(kv_lens.min()), int(new_lens.max())
        if lo < 0 or hi > capacity:
            raise BadParameterError(f"append_kv: kv_lens (min {lo}) + S_new={S} (max {hi}) must lie in "
                                    f"[0, max_pages * page_size = {capacity}]: a sequence would overflow its pages")
        check_page_values(block_table, new_lens, num_pages, P)
    if S == 0:
        return new_lens
    ks = _quantize_like(k_pages, k_new, "k_pages", symmetric) if isinstance(k_pages, KVQuant) else k_new
    vs = _quantize_like(v_pages, v_new, "v_pages", symmetric) if isinstance(v_pages, KVQuant) else v_new
    dst = _parts(k_pages, k_pages) + _parts(v_pages, v_pages)
    src = _parts(ks, k_pages) + _parts(vs, v_pages)
    if dev.type == "cuda" or _interpret():
        from .attention.paging import scatter_rows
        scatter_rows(dst, src, block_table, kv_lens, P)
    else:
        pos = kv_lens.to(torch.int64)[:, None] + torch.arange(S, device=dev)[None, :]  # (B, S)
        ok = (pos >= 0) & (pos < capacity)   # (all of them once checked)
        pages = torch.gather(block_table.to(torch.int64), 1, torch.where(ok, pos, 0) // P)[ok]
        rows = (pos % P)[ok]
        for d, s in zip(dst, src):
            # d[pages, :, rows] = s (B, H, S, X) -> (B, S, H, X), the rows that fit
            d[pages, :, rows] = s.to(d.dtype).permute(0, 2, 1, 3)[ok]
    return new_lens


def _interpret() -> bool:
    from .launch import interpreting
    return interpreting()


__all__ = ["append_kv", "check_block_table", "check_page_values", "gather_pages", "gathered", "gathering",
           "pool_shape", "to_pages"]
