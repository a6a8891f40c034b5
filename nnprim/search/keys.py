"""Problems back from their keys: find-db records hold `problem.key()` strings, and the
learned model (learned.py) asks each solver's own `estimate` about recorded problems.

`problem_from_key(key)` parses a conv or attention key ('|deterministic' ignored) and
returns the problem only when its `key()` gives the same string back; anything else
(another primitive, a key of an older or newer format, impossible sizes) gives None, never
an exception. Keys do not hold every detail (a binary post-op's tensor, a mask's values):
what they hold is what solvers' applicability and estimates read."""
from __future__ import annotations

import ast
import re

import torch

from ..problems.attention import AttentionProblem
from ..problems.common import DTYPE_NAMES
from ..problems.conv import ConvProblem

_DTYPES = {name: dt for dt, name in DTYPE_NAMES.items()}
_DTYPE_RE = "|".join(sorted(_DTYPES, key=len, reverse=True))


def _dtype(name: str) -> torch.dtype | None:
    dt = _DTYPES.get(name) or getattr(torch, name, None)
    return dt if isinstance(dt, torch.dtype) else None


def _ints(s: str) -> tuple[int, ...]:
    return tuple(int(v) for v in s.split("x"))


def _tokens(rest: list[str]) -> list[str]:
    """Optional key parts: '-' also occurs inside a part (a negative post-op value, a
    float like 1e-05), so a piece that starts with no letter belongs to the one before."""
    out: list[str] = []
    for t in rest:
        if out and not (t[:1].isalpha() and t not in ("inf", "nan")):
            out[-1] += "-" + t
        else:
            out.append(t)
    return out


def _post_op(tok: str) -> tuple:
    kind, *vals = tok.split(":")
    if kind == "sum" and len(vals) == 1:
        return ("sum", float(vals[0]))
    if kind == "eltwise" and len(vals) == 3:
        return ("eltwise", vals[0], float(vals[1]), float(vals[2]))
    if kind == "binary" and len(vals) == 2:
        shape = ast.literal_eval(vals[1])
        if isinstance(shape, tuple) and all(isinstance(v, int) for v in shape):
            return ("binary", vals[0], shape)
    raise ValueError(tok)


def _conv(parts: list[str]) -> ConvProblem | None:
    nd = int(parts[0][4:-1])
    direction = parts[1]
    m = re.fullmatch(r"n(\d+)c(\d+)i([\dx]+)", parts[2])
    mk = re.fullmatch(r"k(\d+)f([\dx]+)", parts[3])
    mp = re.fullmatch(r"p([\dx]+)_([\dx]+)", parts[6])
    md = re.fullmatch(rf"({_DTYPE_RE})({_DTYPE_RE})", parts[10])
    if None in (m, mk, mp, md) or not parts[5].startswith("s") or not parts[7].startswith("d") \
            or not parts[8].startswith("g"):
        return None
    N, C, ins = int(m.group(1)), int(m.group(2)), _ints(m.group(3))
    K, flt = int(mk.group(1)), _ints(mk.group(2))
    g = int(parts[8][1:])
    if len(ins) != nd or len(flt) != nd or g < 1 or C % g:
        return None
    has_bias, post_ops = False, []
    for tok in _tokens(parts[12:]):
        if tok == "bias" and not has_bias and not post_ops:
            has_bias = True
        else:
            post_ops.append(_post_op(tok))
    return ConvProblem.create(direction, (N, C, *ins), (K, C // g, *flt), dtype=_DTYPES[md.group(1)],
                              layout=parts[9], device=parts[11], stride=_ints(parts[5][1:]),
                              padding=tuple(zip(_ints(mp.group(1)), _ints(mp.group(2)))),
                              dilation=_ints(parts[7][1:]), groups=g, out_dtype=_DTYPES[md.group(2)],
                              has_bias=has_bias, post_ops=tuple(post_ops))


def _quant(s: str) -> tuple:
    """KVQuant.signature() from its key part: five fields, then the layout (an int) and
    "keys" (keys-contiguous codes) where present."""
    v = s.split(":")
    tail = v[5:]
    keys = bool(tail) and tail[-1] == "keys"
    tail = tail[:-1] if keys else tail
    if len(v) < 5 or len(tail) > 1 or (tail and not tail[0].isdigit()):
        raise ValueError(s)
    sig = (v[0], int(v[1]), v[2], v[3], None if v[4] == "None" else v[4])
    return sig + tuple(int(x) for x in tail) + (("keys",) if keys else ())


def _attn(parts: list[str]) -> AttentionProblem | None:
    mb = re.fullmatch(r"b(\d+)hq(\d+)hkv(\d+)", parts[2])
    ms = re.fullmatch(r"sq(\d+)sk(\d+)", parts[3])
    md = re.fullmatch(r"d(\d+)dv(\d+)", parts[4])
    dtype = _dtype(parts[5])
    if None in (mb, ms, md, dtype) or not parts[7].startswith("c"):
        return None
    B, Hq, Hkv = map(int, mb.groups())
    causal = parts[7][1:]
    kw: dict = dict(direction=parts[1], B=B, Hq=Hq, Hkv=Hkv, Sq=int(ms.group(1)), Sk=int(ms.group(2)),
                    D=int(md.group(1)), Dv=int(md.group(2)), dtype=dtype, device=parts[6],
                    causal=None if causal == "none" else causal)
    if min(B, Hq, Hkv) < 1 or Hq % Hkv:
        return None
    for tok in _tokens(parts[8:]):
        if tok in ("kvlens", "infz", "lse"):
            kw[{"kvlens": "has_kv_lens", "infz": "inf_as_zero", "lse": "return_lse"}[tok]] = True
        elif tok.startswith("sc"):
            kw["invert_scale"] = tok.endswith("inv")
            kw["scale"] = tok[2:-3] if kw["invert_scale"] else tok[2:]
            if kw["scale"] not in ("default", "float", "tensor"):
                return None
        elif tok.startswith(("kq", "vq")):
            kw["k_quant" if tok[0] == "k" else "v_quant"] = _quant(tok[2:])
        elif tok.startswith("pg"):
            kw["page_size"] = int(tok[2:])
        elif tok.startswith("ds"):
            kw["descale"] = tok[2:]
        elif tok.startswith("m"):
            mm = re.fullmatch(r"m(bool|additive)([\dx]+)", tok)
            if mm is None:
                return None
            kw["mask"], kw["mask_shape"] = mm.group(1), _ints(mm.group(2))
        elif tok.startswith("p"):
            kw["dropout_p"] = float(tok[1:])
        elif tok.startswith("o"):
            kw["out_dtype"] = _dtype(tok[1:])
        else:
            return None
    return AttentionProblem(**kw)


def problem_from_key(key: str) -> ConvProblem | AttentionProblem | None:
    """The problem whose `key()` is `key`, or None (see the module doc)."""
    if not isinstance(key, str):
        return None
    key = key.split("|")[0]
    parts = key.split("-")
    try:
        if re.fullmatch(r"conv[123]d", parts[0]) and len(parts) >= 12:
            p = _conv(parts)
        elif parts[0] == "attn" and len(parts) >= 8:
            p = _attn(parts)
        else:
            return None
    except Exception:  # a malformed key of a known kind: not a problem this version can build
        return None
    return p if p is not None and p.key() == key else None
