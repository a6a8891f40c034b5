"""Problems from command-line flags and suite specs, shared by the `conv`, `attn`,
`find`, `explain`, `bench` and `db build-system` commands."""
from __future__ import annotations

import argparse

import torch

from ..errors import BadParameterError
from ..problems.attention import AttentionProblem
from ..problems.conv import ConvProblem
from .suites import load_suite

DTYPES = {"f32": torch.float32, "fp32": torch.float32, "float32": torch.float32, "f16": torch.float16,
          "fp16": torch.float16, "float16": torch.float16, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}


def parse_dtype(s: str) -> torch.dtype:
    try:
        return DTYPES[s.lower()]
    except KeyError:
        raise BadParameterError(f"dtype={s!r} is not one of f32, f16, bf16") from None


def default_dtype(dtype: str | None, device: str) -> torch.dtype:
    """One default for every command: bf16 on CUDA, f32 on CPU."""
    return parse_dtype(dtype or ("bf16" if device == "cuda" else "f32"))


def pick_device(s: str) -> str:
    if s == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if s not in ("cpu", "cuda"):
        raise BadParameterError(f"device={s!r} is not one of auto, cpu, cuda")
    if s == "cuda" and not torch.cuda.is_available():
        raise BadParameterError("device='cuda' but no CUDA device is available")
    return s


def positive_int(s: str) -> int:
    """argparse type: an int >= 1 (a 0 once fell back to the flag's default, -3 reached torch)."""
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {s!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {v}")
    return v


def ints(s: str) -> list[int]:
    try:
        return [int(v) for v in s.replace("x", ",").split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {s!r}") from None


# ---- problems from specs ------------------------------------------------------------------
def per_dim(v, nd: int, name: str):
    v = list(v) if isinstance(v, (list, tuple)) else [v]
    if len(v) == nd and all(isinstance(e, (list, tuple)) and len(e) == 2 for e in v):
        return [(int(a), int(b)) for a, b in v]             # already (before, after) pairs
    if len(v) == 1:
        return int(v[0])
    if len(v) == nd:
        return [int(e) for e in v]
    if name == "padding" and len(v) == 2 * nd:
        return [(int(v[2 * i]), int(v[2 * i + 1])) for i in range(nd)]
    raise BadParameterError(f"{name}={v} must have 1 or {nd} values")


def conv_problem(spec: dict, *, dtype: torch.dtype, device: str, direction: str = "fwd",
                 layout: str | None = None, bias: bool = False) -> ConvProblem:
    """spec: {N, C, K, spatial, filter, stride, padding, dilation, groups, layout} (suite format)."""
    try:
        spatial, filt = [int(v) for v in spec["spatial"]], [int(v) for v in spec["filter"]]
        nd = len(spatial)
        x_shape = (int(spec.get("N", 1)), int(spec["C"]), *spatial)
        w_shape = (int(spec["K"]), int(spec["C"]) // int(spec.get("groups", 1)), *filt)
    except (KeyError, TypeError, ValueError) as e:
        raise BadParameterError(f"conv spec {spec!r} is incomplete or malformed ({e})") from None
    return ConvProblem.create(direction, x_shape, w_shape, dtype=dtype, layout=layout or spec.get("layout", "nchw"),
                              device=device, stride=per_dim(spec.get("stride", 1), nd, "stride"),
                              padding=per_dim(spec.get("padding", 0), nd, "padding"),
                              dilation=per_dim(spec.get("dilation", 1), nd, "dilation"),
                              groups=int(spec.get("groups", 1)), has_bias=bias)


def attn_problem(spec: dict, *, dtype: torch.dtype, device: str, direction: str = "fwd") -> AttentionProblem:
    """spec: {B, Hq, Hkv, Sq, Sk, D, Dv, causal, mask, dropout, kv_quant, group_size, symmetric, scale_dtype,
    scale_per, layout, order, page_size, kv_lens}; a page_size makes k and v page pools (nnprim.paged)."""
    try:
        B, Hq = int(spec.get("B", 1)), int(spec["Hq"])
        Hkv, Sq = int(spec.get("Hkv") or Hq), int(spec["Sq"])
        Sk, D = int(spec.get("Sk") or Sq), int(spec["D"])
        Dv = int(spec.get("Dv") or D)
    except (KeyError, TypeError, ValueError) as e:
        raise BadParameterError(f"attention spec {spec!r} is incomplete or malformed ({e})") from None
    if min(B, Hq, Hkv, Sq, Sk, D, Dv) < 1 or Hq % Hkv:
        raise BadParameterError(f"attention spec {spec!r}: sizes must be positive and Hq % Hkv == 0")
    causal = spec.get("causal")
    if causal is True:
        causal = "bottom_right" if Sq < Sk else "top_left"
    causal = None if causal in (None, False, "none") else causal
    if causal not in (None, "top_left", "bottom_right"):
        raise BadParameterError(f"causal={causal!r} must be none, top_left or bottom_right")
    mask = spec.get("mask") or "none"
    if mask not in ("none", "bool", "additive"):
        raise BadParameterError(f"mask={mask!r} must be none, bool or additive")
    quant = _kv_signature(spec, dtype, D), _kv_signature(spec, dtype, Dv)
    page = int(spec.get("page_size") or 0)
    if page and (page < 1 or Sk % page):
        raise BadParameterError(f"attention spec {spec!r}: page_size={page} must divide Sk={Sk}")
    return AttentionProblem(direction=direction, B=B, Hq=Hq, Hkv=Hkv, Sq=Sq, Sk=Sk, D=D, Dv=Dv, dtype=dtype,
                            device=device, causal=causal, mask=mask,
                            mask_shape=(1, 1, Sq, Sk) if mask != "none" else (),
                            dropout_p=float(spec.get("dropout", 0.0)), return_lse=direction == "bwd",
                            has_kv_lens=bool(page or spec.get("kv_lens")), k_quant=quant[0], v_quant=quant[1],
                            page_size=page)


_SCALE_DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}


def quant_options(spec: dict, d: int) -> tuple[str, dict] | None:
    """(dtype, keyword arguments of quantize_kv) of a spec's kv_quant fields for head dim d, or
    None: group_size defaults to d, symmetric to false for unsigned codes (a zero point per
    group), scale_dtype (bf16 / f16 / f32) to quantize_kv's (the cache's 16-bit dtype)."""
    q = spec.get("kv_quant")
    if not q:
        return None
    from ..quant import QUANT_DTYPES
    if q not in QUANT_DTYPES:
        raise BadParameterError(f"kv_quant={q!r} must be one of {QUANT_DTYPES}")
    sdt = spec.get("scale_dtype")
    if sdt is not None and sdt not in _SCALE_DTYPES:
        raise BadParameterError(f"scale_dtype={sdt!r} must be one of {tuple(_SCALE_DTYPES)}")
    return q, dict(group_size=int(spec.get("group_size") or d), symmetric=bool(spec.get("symmetric", q not in ("u8", "u4"))),
                   scale_dtype=_SCALE_DTYPES.get(sdt), scale_per=spec.get("scale_per"), layout=spec.get("layout"),
                   order=spec.get("order"))


def _kv_signature(spec: dict, dtype: torch.dtype, d: int) -> tuple | None:
    """The KVQuant signature the spec's quantize_kv call gives a (., ., ., d) cache of `dtype`
    (quantized from a small sample, so a suite's record matches the user's call exactly)."""
    opts = quant_options(spec, d)
    if opts is None:
        return None
    from ..quant import quantize_kv
    sample_dt = dtype if dtype in (torch.float16, torch.bfloat16, torch.float32) else torch.float32
    return quantize_kv(torch.randn(2, 2, 8, d, dtype=sample_dt), opts[0], **opts[1]).signature()


def add_conv_args(c: argparse.ArgumentParser) -> None:
    """Flags describing one convolution problem."""
    c.add_argument("-n", "--batch", type=positive_int, default=1)
    c.add_argument("-c", "--channels", type=positive_int, required=True, help="input channels C")
    c.add_argument("-k", "--out-channels", type=positive_int, required=True, help="output channels K")
    c.add_argument("--spatial", type=ints, required=True, help="input size, e.g. 56,56 (1-3 dims)")
    c.add_argument("--filter", type=ints, required=True, help="filter size, e.g. 3,3")
    c.add_argument("--stride", type=ints, default=[1])
    c.add_argument("--pad", type=ints, default=[0], help="padding per dim, or before,after pairs as 2*nd ints")
    c.add_argument("--dilation", type=ints, default=[1])
    c.add_argument("-g", "--groups", type=positive_int, default=1)
    c.add_argument("--layout", choices=("nchw", "nhwc"), default="nchw")
    c.add_argument("--direction", choices=("fwd", "bwd_data", "bwd_weights"), default="fwd")
    c.add_argument("--bias", action="store_true")
    c.add_argument("--dtype", default=None, help="f32, f16 or bf16 (default: bf16 on cuda, f32 on cpu)")
    c.add_argument("--device", default="auto", help="auto, cpu or cuda")


def add_attn_args(a: argparse.ArgumentParser) -> None:
    """Flags describing one attention problem."""
    a.add_argument("-b", "--batch", type=positive_int, default=1)
    a.add_argument("--hq", type=positive_int, required=True, help="query heads")
    a.add_argument("--hkv", type=positive_int, default=None, help="key/value heads (default hq)")
    a.add_argument("--sq", type=positive_int, required=True)
    a.add_argument("--sk", type=positive_int, default=None, help="keys (default sq)")
    a.add_argument("-d", "--head-dim", type=positive_int, required=True)
    a.add_argument("--dv", type=positive_int, default=None)
    a.add_argument("--causal", choices=("none", "top_left", "bottom_right"), default="none")
    a.add_argument("--mask", choices=("none", "bool", "additive"), default="none")
    a.add_argument("--dropout", type=float, default=0.0)
    a.add_argument("--kv-quant", choices=("s8", "u8", "s4", "u4"), default=None)
    a.add_argument("--group-size", type=positive_int, default=None)
    a.add_argument("--direction", choices=("fwd", "bwd"), default="fwd")
    a.add_argument("--dtype", default=None, help="f32, f16 or bf16 (default: bf16 on cuda, f32 on cpu)")
    a.add_argument("--device", default="auto", help="auto, cpu or cuda")


def add_problem_parsers(sub, func) -> None:
    """`conv` and `attn` sub-subcommands describing one problem (flags as `nnprim conv/attn`)."""
    c = sub.add_parser("conv", help="a convolution problem")
    add_conv_args(c)
    c.set_defaults(func=func, kind="conv")
    a = sub.add_parser("attn", help="an attention problem")
    add_attn_args(a)
    a.set_defaults(func=func, kind="attn")


def conv_spec(args) -> dict:
    """Suite-format spec from `add_conv_args` flags."""
    if not 1 <= len(args.spatial) <= 3 or len(args.filter) != len(args.spatial):
        raise BadParameterError(f"--spatial {args.spatial} and --filter {args.filter} must both have 1-3 values")
    nd = len(args.spatial)
    return dict(N=args.batch, C=args.channels, K=args.out_channels, spatial=args.spatial, filter=args.filter,
                stride=per_dim(args.stride, nd, "stride"), padding=per_dim(args.pad, nd, "padding"),
                dilation=per_dim(args.dilation, nd, "dilation"), groups=args.groups, layout=args.layout)


def attn_spec(args) -> dict:
    """Suite-format spec from `add_attn_args` flags."""
    return dict(B=args.batch, Hq=args.hq, Hkv=args.hkv or args.hq, Sq=args.sq, Sk=args.sk or args.sq,
                D=args.head_dim, Dv=args.dv or args.head_dim, causal=args.causal, mask=args.mask,
                dropout=args.dropout, kv_quant=args.kv_quant, group_size=args.group_size)


def problem_from_args(args):
    device = pick_device(args.device)
    dtype = default_dtype(args.dtype, device)
    if args.kind == "conv":
        return conv_problem(conv_spec(args), dtype=dtype, device=device, direction=args.direction, bias=args.bias)
    return attn_problem(attn_spec(args), dtype=dtype, device=device, direction=args.direction)


def suite_problems(suite: str, *, dtype: str | None, device: str, directions: str | None):
    """(name, problem) for every problem of a suite and every direction asked."""
    kind, specs = load_suite(suite)
    dev = pick_device(device)
    dt = default_dtype(dtype, dev)
    out = []
    for spec in specs:
        name = spec.get("name", "?")
        if kind == "conv":
            for d in (directions or "fwd").split(","):
                out.append((f"{name}/{d}", conv_problem(spec, dtype=dt, device=dev, direction=d)))
        else:
            dirs = directions or ("fwd,bwd" if spec.get("mode") == "train" else "fwd")
            for d in dirs.split(","):
                out.append((f"{name}/{d}", attn_problem(spec, dtype=dt, device=dev, direction=d)))
    return out


