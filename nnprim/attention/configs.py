"""Tile configs of the flash attention kernels (the seed's tuned-config table).

`choose_fwd(problem, arch)` / `choose_bwd(problem, arch)` look up a table keyed by
(arch, head-dim bucket, sequence-length bucket, causal, dtype class); the table is
produced by `benchmarks/tune_attention.py` on the lent H200 and falls back to generic
entries. `NNPRIM_SDPA_CONFIG` overrides the tiles, validated like the seed's
`SDPA_CONFIG`:

    NNPRIM_SDPA_CONFIG="BM,BN,WARPS,STAGES"                      forward only
    NNPRIM_SDPA_CONFIG="fwd=BM,BN,WARPS,STAGES;bwd=BM,BN,WARPS,STAGES"

Forward: BM query rows x BN keys per step. Backward: the dK/dV kernel takes BN keys per
program and steps BM query rows; the dQ kernel uses the transposed tiles (BN query
rows per program, BM keys per step).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ..errors import BadParameterError, NotSupportedError

ENV = "NNPRIM_SDPA_CONFIG"


@dataclass(frozen=True)
class TileConfig:
    block_m: int     # 16..256, power of two
    block_n: int     # 16..256, power of two
    num_warps: int   # 1, 2, 4, 8 or 16
    num_stages: int  # 1..8
    # Triton's automatic warp specialisation of the unmasked key loop (Hopper+: a TMA
    # producer warp group feeds the MMA/softmax consumers); forward only
    warp_specialize: bool = False

    def as_tuple(self) -> tuple[int, int, int, int]:
        return (self.block_m, self.block_n, self.num_warps, self.num_stages)


def validate(cfg: TileConfig, what: str = "config") -> TileConfig:
    for name, v in (("BM", cfg.block_m), ("BN", cfg.block_n)):
        if not (16 <= v <= 256 and v & (v - 1) == 0):
            raise BadParameterError(f"{ENV} {what}: {name}={v} must be a power of two in [16, 256]")
    if cfg.num_warps not in (1, 2, 4, 8, 16):
        raise BadParameterError(f"{ENV} {what}: WARPS={cfg.num_warps} must be 1, 2, 4, 8 or 16")
    if not 1 <= cfg.num_stages <= 8:
        raise BadParameterError(f"{ENV} {what}: STAGES={cfg.num_stages} must be in [1, 8]")
    return cfg


def _parse_four(text: str, what: str) -> TileConfig:
    parts = [p.strip() for p in text.split(",")]
    try:
        vals = [int(p) for p in parts]
    except ValueError:
        vals = []
    if len(vals) != 4:
        raise BadParameterError(
            f"{ENV}={os.environ.get(ENV)!r} is invalid: {what} must be 4 integers "
            f"'BM,BN,WARPS,STAGES', got {text!r}")
    return validate(TileConfig(*vals), what)


def parse_override(text: str | None) -> tuple[TileConfig | None, TileConfig | None]:
    """(forward, backward) overrides from the env string; None where not given."""
    if text is None or not text.strip():
        return None, None
    text = text.strip()
    if "=" not in text:
        return _parse_four(text, "fwd"), None
    fwd = bwd = None
    for item in text.split(";"):
        item = item.strip()
        if not item:
            continue
        key, _, val = item.partition("=")
        key = key.strip().lower()
        if key == "fwd":
            fwd = _parse_four(val, "fwd")
        elif key == "bwd":
            bwd = _parse_four(val, "bwd")
        else:
            raise BadParameterError(
                f"{ENV}={text!r} is invalid: unknown section {key!r} (expected 'fwd=' or 'bwd=')")
    return fwd, bwd


# ---- tuned table ------------------------------------------------------------------
# key: (arch, head-dim bucket, seq bucket, causal, dtype class) -> (fwd, bwd) tuples
# arch: "sm90" (Hopper), "cuda" (any other GPU), "interp" (TRITON_INTERPRET on CPU).
# head-dim bucket: 64 (<= 64), 128 (<= 128), 256 (<= 256); seq bucket: "short" (Sk <=
# 1024), "long"; dtype class: "16" (f16/bf16), "32" (f32).
_T = TileConfig

TABLE: dict[tuple, tuple[TileConfig, TileConfig]] = {
    # Hopper, 16-bit. Backward tiles: benchmarks/results/attention_2026-11-29_tune.json.
    # Forward tiles: benchmarks/results/attention_fwd_ws_2026-11-30_run2.json (every train
    # problem of the suite): at D = 128, 64x64 tiles with 4 warps (two programs per SM, so
    # one program's softmax overlaps the other's MMAs) beat 128-row tiles by 17-27% on
    # short and causal problems; long non-causal ones prefer 128x128, 3 stages
    ("sm90", 64, "short", False, "16"): (_T(128, 64, 8, 3), _T(64, 64, 4, 3)),
    ("sm90", 64, "short", True, "16"): (_T(64, 64, 4, 3), _T(64, 64, 4, 3)),
    ("sm90", 64, "long", False, "16"): (_T(128, 64, 8, 3), _T(64, 64, 4, 3)),
    ("sm90", 64, "long", True, "16"): (_T(128, 64, 8, 3), _T(64, 64, 4, 3)),
    ("sm90", 128, "short", False, "16"): (_T(64, 64, 4, 3), _T(64, 64, 4, 2)),
    ("sm90", 128, "short", True, "16"): (_T(64, 64, 4, 3), _T(64, 64, 4, 2)),
    ("sm90", 128, "long", False, "16"): (_T(128, 128, 8, 3), _T(64, 64, 4, 2)),
    ("sm90", 128, "long", True, "16"): (_T(64, 64, 4, 3), _T(64, 64, 4, 2)),
    # D in (128, 256]: the bwd entry drives the head-dim split dK/dV kernel (DQ_TABLE has
    # the dQ kernel); from benchmarks/results/attention_bwd_d256_2026-11-29.json, best on
    # all six d256 problems
    ("sm90", 256, "short", False, "16"): (_T(128, 64, 8, 2), _T(64, 64, 4, 1)),
    ("sm90", 256, "short", True, "16"): (_T(128, 64, 8, 2), _T(64, 64, 4, 1)),
    ("sm90", 256, "long", False, "16"): (_T(128, 64, 8, 3), _T(64, 64, 4, 1)),
    ("sm90", 256, "long", True, "16"): (_T(128, 64, 8, 3), _T(64, 64, 4, 1)),
}

# generic fallbacks by (dtype class, head-dim bucket)
_GPU_DEFAULT = {
    ("16", 64): (_T(128, 64, 4, 3), _T(64, 64, 4, 2)),
    ("16", 128): (_T(128, 64, 8, 2), _T(64, 64, 4, 2)),
    ("16", 256): (_T(64, 32, 4, 2), _T(32, 32, 4, 1)),
    ("32", 64): (_T(64, 32, 4, 2), _T(32, 32, 4, 1)),
    ("32", 128): (_T(64, 32, 4, 2), _T(32, 32, 4, 1)),
    ("32", 256): (_T(32, 32, 4, 1), _T(16, 32, 4, 1)),
}
_INTERP = (_T(16, 16, 4, 1), _T(16, 16, 4, 1))


# dQ kernel for head dims > 128 (flash_bwd.use_split): (tiles, split) where the tiles are
# in the backward notation (BM keys per step, BN query rows per program, warps, stages)
# and split says whether dQ is cut into column halves too (False: the fused dQ kernel,
# which fits without spilling with short key steps). A missing entry means "the bwd
# entry, split". The split dK/dV kernel reads the TABLE's bwd entry.
DQ_TABLE: dict[tuple, tuple[TileConfig, bool]] = {
    # fused dQ, 128 query rows per program, 32-key steps, 8 warps: no spills, S and dP
    # formed once (the split dQ kernel forms them per half and was 1.7-2.5x slower)
    ("sm90", 256, sb, c, "16"): (_T(32, 128, 8, 2), False)
    for sb in ("short", "long") for c in (False, True)
}


# Five-GEMM backward (solvers 123/124, flash_bwd_atomic.py): BM query rows per step, BN
# keys per program, by (arch, head-dim bucket, dtype class). Each program holds dK and dV
# (BN x D f32 each) and a BM x D f32 dQ partial, so large head dims take short tiles and
# 8 warps (D = 256: 2 x 64 x 256 f32 over 256 threads = 128 registers of accumulators).
# Untuned first choices; NNPRIM_SDPA_CONFIG's bwd= entry overrides them.
ATOMIC_TABLE: dict[tuple, TileConfig] = {
    ("sm90", 64, "16"): _T(64, 128, 8, 2),
    ("sm90", 128, "16"): _T(64, 64, 8, 2),
    ("sm90", 256, "16"): _T(32, 64, 8, 1),
}
_ATOMIC_DEFAULT = {64: _T(32, 64, 4, 2), 128: _T(32, 64, 8, 1), 256: _T(16, 32, 8, 1)}

# configs that had to be shrunk to fit shared memory, by (direction, problem key, cfg, tma,
# ...): a TileConfig (fwd) or a (cfg, dq_cfg) pair (bwd)
FITTED: dict[tuple, object] = {}


def shrink(cfg: TileConfig) -> TileConfig:
    """The next smaller config after an out-of-resources error: fewer stages, then a
    narrower BN, then a shorter BM. Raises NotSupportedError at the bottom."""
    if cfg.num_stages > 1:
        return TileConfig(cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages - 1, cfg.warp_specialize)
    if cfg.block_n > 16:
        return TileConfig(cfg.block_m, cfg.block_n // 2, cfg.num_warps, 2)
    if cfg.block_m > 16:
        return TileConfig(cfg.block_m // 2, cfg.block_n, cfg.num_warps, 2)
    raise NotSupportedError(f"no tile config fits the GPU's shared memory (last tried {cfg})")


def device_arch(device: str) -> str:
    if device != "cuda":
        return "interp"
    major, _ = torch.cuda.get_device_capability()
    return "sm90" if major == 9 else "cuda"


def table_key(problem, arch: str) -> tuple:
    d = max(problem.D, problem.Dv)
    dbucket = 64 if d <= 64 else (128 if d <= 128 else 256)
    sbucket = "short" if problem.Sk <= 1024 else "long"
    dclass = "32" if problem.dtype == torch.float32 else "16"
    return (arch, dbucket, sbucket, problem.causal is not None, dclass)


# Forward tiles where pages are shorter than the key block, so K/V rows are gathered by
# pointer (no TMA box spans pages): H200, B 2 x Sq 2k over 16k keys in 16-key pages, D 128
# bf16, 3.53 ms against 4.30 for the table's 64 x 64 (benchmarks/diag/paged_prefill_probe.py,
# results/paged_prefill_probe_2026-12-01_s12.json); 128 x 32 and 64 x 32 ran 5.4-6.3 ms.
PAGED_ROWS_FWD = TileConfig(128, 128, 8, 3)


def choose(problem, arch: str | None = None) -> tuple[TileConfig, TileConfig]:
    """(forward, backward) tiles for `problem`; NNPRIM_SDPA_CONFIG wins."""
    arch = arch or device_arch(problem.device)
    if arch == "interp":
        fwd, bwd = _INTERP
    else:
        key = table_key(problem, arch)
        hit = TABLE.get(key)
        fwd, bwd = hit if hit is not None else _GPU_DEFAULT[(key[4], key[1])]
        if problem.page_size % fwd.block_n and max(problem.D, problem.Dv) <= 128:
            fwd = PAGED_ROWS_FWD
    ofwd, obwd = parse_override(os.environ.get(ENV))
    return ofwd or fwd, obwd or bwd


def choose_dq(problem, arch: str | None = None) -> tuple[TileConfig | None, bool | None]:
    """(dQ tiles, dQ split) for head dims > 128; (None, None) means "the bwd tiles, split
    like dK/dV" (always so when NNPRIM_SDPA_CONFIG gives bwd tiles: they then drive every
    backward kernel)."""
    arch = arch or device_arch(problem.device)
    if arch == "interp" or parse_override(os.environ.get(ENV))[1] is not None:
        return None, None
    return DQ_TABLE.get(table_key(problem, arch), (None, None))


def choose_bwd_atomic(problem, arch: str | None = None) -> TileConfig:
    """Tiles of the five-GEMM backward (ATOMIC_TABLE); NNPRIM_SDPA_CONFIG's bwd= wins."""
    arch = arch or device_arch(problem.device)
    override = parse_override(os.environ.get(ENV))[1]
    if override is not None:
        return override
    if arch == "interp":
        return _INTERP[1]
    _, dbucket, _, _, dclass = table_key(problem, arch)
    return ATOMIC_TABLE.get((arch, dbucket, dclass), _ATOMIC_DEFAULT[dbucket])
