"""AttentionProblem: the descriptor of one scaled-dot-product attention call.

q (B, Hq, Sq, D), k (B, Hkv, Sk, D), v (B, Hkv, Sk, Dv), Hq % Hkv == 0.
The mask is described by its kind and broadcast shape (4 ints, 1 = broadcast)."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from .. import fp8 as _fp8
from ..dropout import check_device_seed
from ..errors import BadParameterError, NotSupportedError
from ..paged import check_block_table, check_page_values, check_pool_params, pool_shape
from ..quant import KVQuant
from ..search.capture import capturing
from .common import check_float_dtype, dtype_name

CAUSAL = (None, "top_left", "bottom_right")


def normalize_causal(causal) -> str | None:
    if causal is None or causal is False:
        return None
    if causal is True:
        return "top_left"
    if causal in ("top_left", "bottom_right"):
        return causal
    raise BadParameterError(f"causal={causal!r} must be None, True, 'top_left' or 'bottom_right'")


def _shape4(name: str, t) -> tuple[int, int, int, int]:
    if isinstance(t, KVQuant):
        return t.shape
    if not isinstance(t, torch.Tensor):
        raise BadParameterError(f"{name} must be a torch.Tensor (or KVQuant for k/v), got {type(t).__name__}")
    if t.dim() != 4:
        raise BadParameterError(f"{name} must be 4-D (B, H, S, D), got shape {tuple(t.shape)}")
    return tuple(t.shape)


def check_kv_lens_values(kv_lens: torch.Tensor, Sk: int) -> None:
    if kv_lens.numel() == 0:
        return
    lo, hi = int(kv_lens.min()), int(kv_lens.max())
    if lo < 0 or hi > Sk:
        raise BadParameterError(f"kv_lens values must lie in [0, Sk={Sk}], got min {lo}, max {hi}")


def _paged(q, k, v, block_table, kv_lens, direction: str) -> tuple[int, int]:
    """Validate page pools k, v (num_pages, Hkv, page_size, D) and their block table;
    (page_size, num_pages)."""
    if direction != "fwd":
        raise NotSupportedError("sdpa_backward with paged K/V (block_table) is not supported: paged caches "
                                "serve inference (forward only)")
    B = q.shape[0]
    check_block_table(block_table, B, q.device)
    nk, _, pk, _ = pool_shape("k", k)
    nv, _, pv, _ = pool_shape("v", v)
    if (nk, pk) != (nv, pv):
        raise BadParameterError(f"k page pool (num_pages={nk}, page_size={pk}) and v page pool "
                                f"(num_pages={nv}, page_size={pv}) must match")
    if kv_lens is None:
        raise BadParameterError("paged K/V (block_table=...) need kv_lens=: the number of valid keys per sequence")
    check_pool_params("k", k)
    check_pool_params("v", v)
    return pk, nk
def _fp8_options(fp8: bool, q, descales, B: int, Hq: int, Hkv: int, out_dtype, check_values: bool
                 ) -> tuple[str | None, torch.dtype | None]:
    """(descale granularity letters of q, k, v, output dtype) of an FP8 call; (None, None)
    otherwise, where descales are an error and out_dtype must be q's."""
    if not fp8:
        for name, d in zip(_fp8.DESCALE_NAMES, descales):
            if d is not None:
                raise BadParameterError(f"{name} is only for float8 inputs (q.dtype={q.dtype})")
        if out_dtype is not None and out_dtype != q.dtype:
            raise NotSupportedError(f"out_dtype={out_dtype} with q.dtype={q.dtype}: only float8 inputs choose "
                                    "their output dtype")
        return None, None
    if out_dtype is not None and out_dtype not in _fp8.OUT_DTYPES:
        raise BadParameterError(f"out_dtype={out_dtype} must be one of torch.bfloat16, torch.float16, "
                                "torch.float32")
    kinds = ""
    for name, d, H in zip(_fp8.DESCALE_NAMES, descales, (Hq, Hkv, Hkv)):
        kinds += _fp8.descale_kind(name, d, B, H, q.device)
        if check_values:
            _fp8.check_descale_values(name, d)
    return kinds, out_dtype or torch.bfloat16


@dataclass(frozen=True)
class AttentionProblem:
    direction: str  # "fwd" | "bwd"
    B: int
    Hq: int
    Hkv: int
    Sq: int
    Sk: int
    D: int
    Dv: int
    dtype: torch.dtype
    device: str
    causal: str | None = None
    mask: str = "none"  # "none" | "bool" | "additive"
    mask_shape: tuple[int, ...] = ()  # broadcast shape, padded to 4 dims
    scale: str = "default"  # "default" | "float" | "tensor"
    invert_scale: bool = False
    dropout_p: float = 0.0
    has_kv_lens: bool = False
    inf_as_zero: bool = False
    return_lse: bool = False
    k_quant: tuple | None = None  # KVQuant.signature()
    v_quant: tuple | None = None
    page_size: int = 0  # paged K/V (nnprim.paged): keys per page; Sk = max_pages * page_size; 0 = contiguous
    # FP8 inputs (nnprim.fp8): output dtype and descale granularity of q, k, v ("n"/"t"/"h")
    out_dtype: torch.dtype | None = None
    descale: str | None = None

    @classmethod
    def from_tensors(cls, q: torch.Tensor, k, v, *, attn_mask: torch.Tensor | None = None,
                     causal=None, scale=None, invert_scale: bool = False, dropout_p: float = 0.0,
                     kv_lens: torch.Tensor | None = None, softmax_inf_as_zero: bool = False,
                     return_lse: bool = False, direction: str = "fwd",
                     seed: int = 0, offset: int = 0, check_values: bool = True,
                     block_table: torch.Tensor | None = None, q_descale=None, k_descale=None, v_descale=None,
                     out_dtype: torch.dtype | None = None) -> AttentionProblem:
        """Validate a call; `check_values=False` skips the kv_lens (and block_table) value
        ranges and the descale positivity (a device sync; fake tensors have no values;
        skipped too while a CUDA graph is captured on q's device).
        With `block_table`, k and v are page pools (num_pages, Hkv, page_size, D)
        (nnprim.paged)."""
        if direction not in ("fwd", "bwd"):
            raise BadParameterError(f"direction={direction!r} must be 'fwd' or 'bwd'")
        B, Hq, Sq, D = _shape4("q", q)
        check_values = check_values and not capturing(q.device)   # no value can be read there
        page_size = 0
        if block_table is not None:   # first: page pools get their own shape's words in the errors
            page_size, num_pages = _paged(q, k, v, block_table, kv_lens, direction)
        Bk, Hkv, Sk, Dk = _shape4("k", k)
        Bv, Hv, Skv, Dv = _shape4("v", v)
        if block_table is not None:
            Bk = Bv = B
            Sk = Skv = block_table.shape[1] * page_size
        fp8 = _fp8.check_inputs(q, k, v)
        if not fp8:
            check_float_dtype("q", q)
        for name, t in (("k", k), ("v", v)):
            if isinstance(t, torch.Tensor) and not fp8:
                check_float_dtype(name, t)
                if t.dtype != q.dtype:
                    raise BadParameterError(f"{name}.dtype={t.dtype} must match q.dtype={q.dtype}")
            if t.device != q.device:
                raise BadParameterError(f"{name} is on {t.device} but q is on {q.device}")
        if min(B, Hq, Sq, D) < 1 or min(Bk, Hkv, Sk, Dk) < 1 or min(Bv, Hv, Skv, Dv) < 1:
            raise BadParameterError(
                f"q {(B, Hq, Sq, D)}, k {(Bk, Hkv, Sk, Dk)}, v {(Bv, Hv, Skv, Dv)} must have positive sizes")
        if not (B == Bk == Bv):
            raise BadParameterError(f"batch sizes differ: q B={B}, k B={Bk}, v B={Bv}")
        if Hkv != Hv:
            raise BadParameterError(f"k heads Hkv={Hkv} and v heads {Hv} must match")
        if Hq % Hkv:
            raise BadParameterError(f"q heads Hq={Hq} must be a multiple of k/v heads Hkv={Hkv}")
        if Dk != D:
            raise BadParameterError(f"k head dim {Dk} must equal q head dim D={D}")
        if Skv != Sk:
            raise BadParameterError(f"k has Sk={Sk} keys but v has {Skv}")
        causal_n = normalize_causal(causal)
        mask_kind, mshape = "none", ()
        if attn_mask is not None:
            if not isinstance(attn_mask, torch.Tensor):
                raise BadParameterError(f"attn_mask must be a tensor, got {type(attn_mask).__name__}")
            if attn_mask.device != q.device:
                raise BadParameterError(f"attn_mask is on {attn_mask.device} but q is on {q.device}")
            if attn_mask.dtype == torch.bool:
                mask_kind = "bool"
            elif attn_mask.is_floating_point():
                mask_kind = "additive"
            else:
                raise BadParameterError(f"attn_mask.dtype={attn_mask.dtype} must be bool or floating point")
            full = (B, Hq, Sq, Sk)
            if attn_mask.dim() > 4:
                raise BadParameterError(f"attn_mask shape {tuple(attn_mask.shape)} has more than 4 dims")
            ms = (1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape)
            for m, f in zip(ms, full):
                if m not in (1, f):
                    raise BadParameterError(
                        f"attn_mask shape {tuple(attn_mask.shape)} is not broadcastable to (B, Hq, Sq, Sk)={full}")
            mshape = ms
        if scale is None:
            scale_kind = "default"
        elif isinstance(scale, torch.Tensor):
            if scale.numel() != 1:
                raise BadParameterError(f"scale tensor must have one element, got shape {tuple(scale.shape)}")
            if not scale.is_floating_point():
                raise BadParameterError(f"scale tensor dtype={scale.dtype} must be floating point")
            if scale.device.type == "cpu":      # read without a device sync (later values: scale_value)
                sv = float(scale.detach().to(torch.float64).reshape(()))
                if not math.isfinite(sv) or sv == 0:
                    raise BadParameterError(f"scale={sv!r} (a tensor's value) must be finite and non-zero")
            scale_kind = "tensor"
        elif isinstance(scale, (int, float)) and not isinstance(scale, bool):
            if not math.isfinite(scale) or scale == 0:
                raise BadParameterError(f"scale={scale!r} must be finite and non-zero")
            scale_kind = "float"
        else:
            raise BadParameterError(f"scale={scale!r} must be None, a float or a one-element tensor")
        if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p < 1.0:
            raise BadParameterError(f"dropout_p={dropout_p!r} must be a float in [0, 1)")
        counters = (("seed", seed), ("offset", offset))
        if isinstance(seed, torch.Tensor):     # a device seed (nnprim.dropout)
            check_device_seed(seed, q.device)
            counters = counters[1:]
        for name, val in counters:
            if isinstance(val, bool) or not isinstance(val, int) or val < 0 or val >= 2**63:
                raise BadParameterError(f"{name}={val!r} must be a non-negative int below 2**63"
                                        + (" or a one-element int64 tensor on q's device" if name == "seed" else ""))
        if kv_lens is not None:
            if not isinstance(kv_lens, torch.Tensor) or kv_lens.dtype not in (torch.int32, torch.int64):
                raise BadParameterError(f"kv_lens must be an int32/int64 tensor, got {getattr(kv_lens, 'dtype', kv_lens)!r}")
            if tuple(kv_lens.shape) != (B,):
                raise BadParameterError(f"kv_lens shape {tuple(kv_lens.shape)} must be (B,)=({B},)")
            if kv_lens.device != q.device:
                raise BadParameterError(f"kv_lens is on {kv_lens.device} but q is on {q.device}")
            if check_values:
                check_kv_lens_values(kv_lens, Sk)
                if page_size:
                    check_page_values(block_table, kv_lens, num_pages, page_size)
        descale, out_dt = _fp8_options(fp8, q, (q_descale, k_descale, v_descale), B, Hq, Hkv, out_dtype,
                                       check_values)
        kq = k.signature() if isinstance(k, KVQuant) else None
        vq = v.signature() if isinstance(v, KVQuant) else None
        return cls(direction=direction, B=B, Hq=Hq, Hkv=Hkv, Sq=Sq, Sk=Sk, D=D, Dv=Dv,
                   dtype=q.dtype, device=q.device.type, causal=causal_n, mask=mask_kind,
                   mask_shape=mshape, scale=scale_kind, invert_scale=bool(invert_scale),
                   dropout_p=float(dropout_p), has_kv_lens=kv_lens is not None,
                   inf_as_zero=bool(softmax_inf_as_zero), return_lse=bool(return_lse),
                   k_quant=kq, v_quant=vq, page_size=page_size, out_dtype=out_dt, descale=descale)

    def __post_init__(self) -> None:
        if self.direction == "bwd" and self.quantized:
            raise NotSupportedError("sdpa_backward with quantized K/V is not supported: "
                                    "quantized K/V have no gradient; dequantize first")
        if self.direction == "bwd" and self.page_size:
            raise NotSupportedError("sdpa_backward with paged K/V (block_table) is not supported: paged caches "
                                    "serve inference (forward only)")
        if self.direction == "bwd" and self.fp8:
            raise NotSupportedError("sdpa_backward with float8 inputs is not supported: FP8 attention is "
                                    "forward only (not differentiable)")

    # ---- derived -------------------------------------------------------------------
    @property
    def group(self) -> int:
        """Query heads per K/V head (GQA ratio)."""
        return self.Hq // self.Hkv

    @property
    def quantized(self) -> bool:
        return self.k_quant is not None or self.v_quant is not None

    @property
    def fp8(self) -> bool:
        """q, k, v are float8_e4m3fn (nnprim.fp8)."""
        return self.dtype == _fp8.FP8

    @property
    def result_dtype(self) -> torch.dtype:
        """dtype of o: out_dtype for FP8 inputs, else q's."""
        return self.out_dtype or self.dtype

    def causal_fraction(self) -> float:
        """Fraction of the (Sq, Sk) score matrix that is computed under the causal mask."""
        if self.causal is None:
            return 1.0
        Sq, Sk = self.Sq, self.Sk
        shift = 0 if self.causal == "top_left" else Sk - Sq  # key j visible to row i iff j <= i + shift
        kept = sum(min(Sk, max(0, i + shift + 1)) for i in range(Sq)) if Sq <= 4096 else \
            sum(min(Sk, max(0, i + shift + 1)) for i in range(0, Sq, Sq // 4096)) * (Sq // 4096)
        return kept / (Sq * Sk)

    def flops(self) -> float:
        """Forward FLOPs (2 GEMMs); backward is 2.5x this by convention."""
        f = 2.0 * self.B * self.Hq * self.Sq * self.Sk * (self.D + self.Dv) * self.causal_fraction()
        return f * (2.5 if self.direction == "bwd" else 1.0)

    def bytes(self) -> float:
        """Minimum bytes: read q, k, v once, write o (forward)."""
        e = torch.tensor([], dtype=self.dtype).element_size()

        def kv_bytes(quant, d):
            n = self.B * self.Hkv * self.Sk * d
            if quant is None:
                return n * e
            bits = 4 if quant[0] in ("s4", "u4") else 8
            per = {"t": 1, "h": self.B * self.Hkv, "g": n // quant[1]}
            return n * bits / 8 + per[quant[2]] * 2 + per.get(quant[4], 0) * 2

        qo = self.B * self.Hq * self.Sq * (self.D + self.Dv) * e
        total = qo + kv_bytes(self.k_quant, self.D) + kv_bytes(self.v_quant, self.Dv)
        return total * (2.0 if self.direction == "bwd" else 1.0)

    def key(self) -> str:
        parts = ["attn", self.direction, f"b{self.B}hq{self.Hq}hkv{self.Hkv}",
                 f"sq{self.Sq}sk{self.Sk}", f"d{self.D}dv{self.Dv}", dtype_name(self.dtype),
                 self.device, f"c{self.causal or 'none'}"]
        if self.mask != "none":
            parts.append(f"m{self.mask}{'x'.join(map(str, self.mask_shape))}")
        parts.append(f"sc{self.scale}{'inv' if self.invert_scale else ''}")
        if self.dropout_p:
            parts.append(f"p{self.dropout_p:g}")
        if self.has_kv_lens:
            parts.append("kvlens")
        if self.inf_as_zero:
            parts.append("infz")
        if self.return_lse:
            parts.append("lse")
        for name, qs in (("kq", self.k_quant), ("vq", self.v_quant)):
            if qs is not None:
                parts.append(name + ":".join(str(x) for x in qs))
        if self.page_size:
            parts.append(f"pg{self.page_size}")
        if self.fp8:
            parts.append(f"o{dtype_name(self.result_dtype)}-ds{self.descale}")
        return "-".join(parts)

    def class_key(self) -> str:
        """Key without the sizes B, Hq, Hkv, Sq, Sk (head dims stay: kernels specialise on them)."""
        k = self.key().split("-")
        return "-".join([k[0], k[1], f"g{self.group}", "thin" if self.Sq <= 16 else "long"] + k[4:])

    def with_direction(self, direction: str) -> AttentionProblem:
        return replace(self, direction=direction, return_lse=True if direction == "bwd" else self.return_lse)
