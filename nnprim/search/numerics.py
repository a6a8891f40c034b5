"""NaN/Inf scanning (NNPRIM_CHECK_NUMERICS=1, MIOpen's CheckNumerics) and the output
comparison find uses for its safety check.

`check_args` scans an invoker's inputs, `check_outputs` its results; each raises
`NumericsError` naming the first offending tensor with its NaN and Inf counts.
Exceptions to "no Inf": an additive attention mask may hold -inf (that is how one
masks), and lse may be -inf for fully masked rows."""
from __future__ import annotations

import math

import torch

from ..errors import NumericsError
from ..quant import KVQuant

_INF_OK = frozenset({"attn_mask", "lse"})


def _counts(t: torch.Tensor) -> tuple[int, int]:
    if not t.is_floating_point() or t.numel() == 0:
        return 0, 0
    nan = int(torch.isnan(t).sum())
    inf = int(torch.isinf(t).sum())
    return nan, inf


def check_tensor(name: str, t, where: str) -> None:
    if isinstance(t, KVQuant):
        check_tensor(f"{name}.scales", t.scales, where)
        if t.zero_points is not None:
            check_tensor(f"{name}.zero_points", t.zero_points, where)
        return
    if not isinstance(t, torch.Tensor):
        return
    nan, inf = _counts(t)
    if name in _INF_OK:
        inf = 0
    if nan or inf:
        raise NumericsError(f"{where} tensor {name!r} (shape {tuple(t.shape)}) has {nan} NaN and {inf} Inf "
                            f"of {t.numel()} elements")


def check_args(args) -> None:
    """Scan every tensor field of a ConvArgs / AttnArgs (and post-op tensors)."""
    for name, val in vars(args).items():
        if name == "post_ops":
            for i, op in enumerate(val or ()):
                check_tensor(f"post_ops[{i}].tensor", getattr(op, "tensor", None), "input")
        elif name == "scale" and isinstance(val, float):
            if not math.isfinite(val):
                raise NumericsError(f"input scale={val!r} is not finite")
        else:
            check_tensor(name, val, "input")


_OUT_NAMES = {1: ("out",), 2: ("o", "lse"), 3: ("dq", "dk", "dv")}


def check_outputs(out) -> None:
    if isinstance(out, torch.Tensor):
        check_tensor("out", out, "output")
        return
    names = _OUT_NAMES.get(len(out), ())
    for i, t in enumerate(out):
        check_tensor(names[i] if i < len(names) else f"out[{i}]", t, "output")


# ---- comparison for find's safety check -----------------------------------------------
def tolerance(dtype: torch.dtype) -> float:
    """Relative-norm tolerance of find's check against the reference, by input dtype."""
    if dtype == torch.float8_e4m3fn:   # P rounded to e4m3 (3 mantissa bits) in the kernels' PV product
        return 1e-1
    if dtype in (torch.float32, torch.float64):
        return 1e-4
    # f16 keeps 3 more mantissa bits than bf16: 2e-2 let a 2e-2-off solver through where torch's
    # f16 result is 4e-4 off (winograd_f4_bwd_weights, 2026-12-02); the GPU fuzz checks 1e-2 too
    return 1e-2 if dtype == torch.float16 else 2e-2


def _as_tuple(out) -> tuple:
    return (out,) if isinstance(out, torch.Tensor) else tuple(out)


# outputs of one call are judged at a common scale: one that is ~0 where its siblings are not
# is measured against this share of the largest sibling's norm
SIBLING_SCALE = 1e-2


def rel_error(out, ref) -> float:
    """Largest relative Frobenius-norm error over the output tensors of one invoker call.

    Each output's error norm is divided by max(its reference's norm, SIBLING_SCALE x the largest
    reference norm of the call's outputs): an output that is exactly zero in exact arithmetic
    (dq and dk of a one-hot softmax, e.g. a single query that sees one key: float64 leaves
    1e-15 there, every f32 kernel ~1e-6, torch's own SDPA too) is judged by its absolute error
    against the scale of its siblings (dv), not as a ratio of rounding residues.

    NaN/Inf must sit at the same places in both (e.g. a NaN from log of a negative in a
    post-op, or a fully masked attention row); the finite elements are compared.
    Returns inf for a shape mismatch or misplaced non-finite values."""
    outs, refs = _as_tuple(out), _as_tuple(ref)
    if len(outs) != len(refs):
        return math.inf
    pairs = []
    for o, r in zip(outs, refs):
        if o is None and r is None:
            continue
        if o is None or r is None or tuple(o.shape) != tuple(r.shape):
            return math.inf
        o64, r64 = o.detach().to(torch.float64), r.detach().to(torch.float64)
        fo, fr = torch.isfinite(o64), torch.isfinite(r64)
        if not torch.equal(fo, fr):
            return math.inf
        nf = ~fo
        if nf.any() and not torch.equal(torch.nan_to_num(o64[nf], nan=0.0), torch.nan_to_num(r64[nf], nan=0.0)):
            return math.inf  # +inf where the reference has -inf, or inf where it has NaN
        pairs.append((float((o64[fo] - r64[fo]).norm()), float(r64[fo].norm())))
    floor = SIBLING_SCALE * max((n for _, n in pairs), default=0.0)
    worst = 0.0
    for d, n in pairs:
        den = max(n, floor)
        worst = max(worst, d / den if den > 0 else d)
    return worst
