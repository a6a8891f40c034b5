"""Held-out problems: seeded random valid layers of common model families, never a suite
problem. `benchmarks/regret.py` measures selection on them; `nnprim db build-system
--models` finds them (with another seed) into the system db.

Families (suite spec dicts, conv or attention, with the direction):
  resnet        3x3 / 1x1 convolutions of the four stages, stride-2 downsampling
  convnext      depthwise 7x7, 1x1 expansion (x4) and projection, 4x4/s4 stem, 2x2/s2 downsampling
  unet          3x3 convolutions at four resolutions, 2x2/s2 downsampling
  efficientnet  depthwise 3x3/5x5 (stride 1, 2), 1x1 expansion / projection
  vit           patch embedding (16x16/s16, 14x14/s14) and encoder attention (D 64, S 197/257)
  llama         causal GQA attention, D 128, Hq 32 / Hkv 8 (8B) or 64 / 8 (70B), training shapes
  mistral       causal GQA attention, D 128, Hq 32 / Hkv 8, longer sequences
  whisper       conv1d k3 front end (stride 1, 2) and encoder / cross attention (D 64)
  decode        one to eight new queries over a long KV cache (bottom-right causal, GQA, D 128)
Conv problems get one of fwd / bwd_data / bwd_weights; attention fwd or bwd (decode: fwd).
`scale="tiny"` shrinks every size so that the CPU (CI) runs a problem in milliseconds."""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from importlib import resources

FAMILIES = ("resnet", "convnext", "unet", "efficientnet", "vit", "llama", "mistral", "whisper", "decode")
CONV_DIRECTIONS = ("fwd", "bwd_data", "bwd_weights")


@dataclass(frozen=True)
class HeldOut:
    name: str
    family: str
    kind: str        # "conv" | "attn"
    direction: str
    spec: dict

    def to_json(self) -> dict:
        return dict(name=self.name, family=self.family, kind=self.kind, direction=self.direction, spec=self.spec)


def _conv(N, C, K, spatial, f, stride=1, groups=1, pad=None, layout="nhwc") -> dict:
    f = list(f) if isinstance(f, (list, tuple)) else [f] * len(spatial)
    pad = [k // 2 for k in f] if pad is None else pad
    return dict(N=N, C=C, K=K, spatial=list(spatial), filter=f, stride=stride, padding=pad, dilation=1,
                groups=groups, layout=layout)


def _attn(B, Hq, Hkv, Sq, Sk, D, causal=None) -> dict:
    return dict(B=B, Hq=Hq, Hkv=Hkv, Sq=Sq, Sk=Sk, D=D, causal=causal)


def _resnet(r: random.Random) -> dict:
    stage = r.randrange(4)
    hw, c = (56, 28, 14, 7)[stage], (64, 128, 256, 512)[stage]
    N = r.choice((1, 8, 16, 32, 64))
    kind = r.choice(("3x3", "1x1_in", "1x1_out", "down3x3", "down1x1"))
    if kind == "3x3":
        return _conv(N, c, c, (hw, hw), 3)
    if kind == "1x1_in":
        return _conv(N, 4 * c, c, (hw, hw), 1)
    if kind == "1x1_out":
        return _conv(N, c, 4 * c, (hw, hw), 1)
    if kind == "down3x3":
        return _conv(N, c, c, (2 * hw, 2 * hw), 3, stride=2)
    return _conv(N, 2 * c, 4 * c, (2 * hw, 2 * hw), 1, stride=2)


def _convnext(r: random.Random) -> dict:
    stage = r.randrange(4)
    hw, c = (56, 28, 14, 7)[stage], (96, 192, 384, 768)[stage]
    N = r.choice((1, 4, 16, 32))
    kind = r.choice(("dw7", "dw7", "expand", "project", "stem", "down"))
    if kind == "dw7":
        return _conv(N, c, c, (hw, hw), 7, groups=c)
    if kind == "expand":
        return _conv(N, c, 4 * c, (hw, hw), 1)
    if kind == "project":
        return _conv(N, 4 * c, c, (hw, hw), 1)
    if kind == "stem":
        return _conv(N, 3, 96, (224, 224), 4, stride=4, pad=0)
    return _conv(N, c, 2 * c, (2 * hw, 2 * hw), 2, stride=2, pad=0)


def _unet(r: random.Random) -> dict:
    level = r.randrange(4)
    hw, c = (128, 64, 32, 16)[level], (64, 128, 256, 512)[level]
    N = r.choice((1, 2, 4, 8))
    kind = r.choice(("3x3", "3x3_in", "down"))
    if kind == "3x3":
        return _conv(N, c, c, (hw, hw), 3)
    if kind == "3x3_in":  # decoder: concatenated skip
        return _conv(N, 2 * c, c, (hw, hw), 3)
    return _conv(N, c, c, (2 * hw, 2 * hw), 2, stride=2, pad=0)


def _efficientnet(r: random.Random) -> dict:
    hw, c = r.choice(((112, 16), (56, 24), (28, 40), (14, 80), (14, 112), (7, 192)))
    N = r.choice((1, 8, 32, 64))
    e = r.choice((1, 6))
    kind = r.choice(("dw", "dw", "expand", "project"))
    if kind == "dw":
        k, s = r.choice((3, 5)), r.choice((1, 1, 2))
        return _conv(N, c * e, c * e, (hw * s, hw * s), k, stride=s, groups=c * e)
    if kind == "expand":
        return _conv(N, c, 6 * c, (hw, hw), 1)
    return _conv(N, 6 * c, c, (hw, hw), 1)


def _vit(r: random.Random) -> tuple[str, dict]:
    if r.random() < 0.4:
        p = r.choice((16, 14))
        return "conv", _conv(r.choice((1, 8, 32, 64)), 3, r.choice((384, 768, 1024)), (224, 224), p, stride=p, pad=0)
    S = r.choice((197, 257))
    H = r.choice((6, 12, 16))
    return "attn", _attn(r.choice((1, 8, 32, 64)), H, H, S, S, 64)


def _llama(r: random.Random) -> dict:
    Hq, Hkv = r.choice(((32, 8), (64, 8), (32, 32)))
    S = r.choice((512, 1024, 2048, 3072))
    return _attn(r.choice((1, 2, 4)), Hq, Hkv, S, S, 128, "top_left")


def _mistral(r: random.Random) -> dict:
    S = r.choice((1536, 2048, 6144))
    return _attn(r.choice((1, 2)), 32, 8, S, S, 128, "top_left")


def _whisper(r: random.Random) -> tuple[str, dict]:
    d = r.choice((384, 512, 768, 1024, 1280))
    kind = r.choice(("conv1", "conv2", "enc", "cross"))
    N = r.choice((1, 4, 16))
    if kind == "conv1":
        return "conv", _conv(N, 80, d, (3000,), 3, layout="nchw")
    if kind == "conv2":
        return "conv", _conv(N, d, d, (3000,), 3, stride=2, layout="nchw")
    H = d // 64
    if kind == "enc":
        return "attn", _attn(N, H, H, 1500, 1500, 64)
    return "attn", _attn(N, H, H, r.choice((1, 4, 32, 224)), 1500, 64)


def _decode(r: random.Random) -> dict:
    Hq, Hkv = r.choice(((32, 8), (64, 8), (32, 32), (40, 8)))
    Sk = r.choice((600, 1500, 3000, 5000, 12000, 20000))
    return _attn(r.choice((1, 4, 8, 24, 48)), Hq, Hkv, r.choice((1, 2, 3, 4, 8)), Sk, 128, "bottom_right")


_MAKERS = {"resnet": _resnet, "convnext": _convnext, "unet": _unet, "efficientnet": _efficientnet,
           "vit": _vit, "llama": _llama, "mistral": _mistral, "whisper": _whisper, "decode": _decode}


def shrink(kind: str, spec: dict) -> dict:
    """The same layer at CPU-test size (a few thousand MACs), still valid."""
    s = dict(spec)
    if kind == "conv":
        depthwise = s["groups"] > 1 and s["groups"] == s["C"] == s["K"]
        s["N"] = min(s["N"], 2)
        s["C"] = 3 if s["C"] == 3 else min(s["C"], 8)
        s["K"] = min(s["K"], 8)
        if depthwise:
            s["K"] = s["groups"] = s["C"]
        s["spatial"] = [max(min(v, 12), f) for v, f in zip(s["spatial"], s["filter"])]
        return s
    Sk = 16 if s["Sq"] == s["Sk"] else 24
    s.update(B=min(s["B"], 2), Hq=min(s["Hq"], 4), Hkv=min(s["Hkv"], 4 if s["Hq"] == s["Hkv"] else 2),
             Sq=min(s["Sq"], 16), Sk=min(s["Sk"], Sk), D=min(s["D"], 32))
    if s["Hq"] % s["Hkv"]:
        s["Hkv"] = 1
    return s


def _suite_specs() -> set[str]:
    out = set()
    for f in ("conv_gpu.json", "conv_cpu.json", "attention_gpu.json"):
        try:
            data = json.loads(resources.files("nnprim.data.suites").joinpath(f).read_text())
        except (OSError, ModuleNotFoundError):
            continue
        for p in data.get("problems", []):
            out.add(_ident(p))
    return out


_IDENT_FIELDS = ("N", "C", "K", "spatial", "filter", "stride", "groups", "B", "Hq", "Hkv", "Sq", "Sk", "D")


def _ident(spec: dict) -> str:
    return json.dumps({k: spec.get(k) for k in _IDENT_FIELDS}, sort_keys=True)


NCHW_FAMILIES = ("resnet", "unet")  # CNN layers a user may call in torch's default (NCHW) format
NCHW_SHARE = 0.25


def generate(count: int, seed: int = 0, families=None, *, scale: str = "full") -> list[HeldOut]:
    """`count` distinct held-out problems, families taken in turn (seeded; the same
    arguments give the same list). `scale`: "full" or "tiny" (CPU tests)."""
    fams = list(families or FAMILIES)
    bad = [f for f in fams if f not in _MAKERS]
    if bad:
        from ..errors import BadParameterError
        raise BadParameterError(f"families={bad} are not among {', '.join(FAMILIES)}")
    r = random.Random(seed)
    suites = _suite_specs()
    seen: set[str] = set()
    out: list[HeldOut] = []
    tries = 0
    while len(out) < count and tries < 50 * count + 100:
        fam = fams[tries % len(fams)]
        tries += 1
        made = _MAKERS[fam](r)
        kind, spec = made if isinstance(made, tuple) else ("conv" if "N" in made else "attn", made)
        if kind == "conv" and fam in NCHW_FAMILIES and r.random() < NCHW_SHARE:
            spec = dict(spec, layout="nchw")  # torch's default memory format, as many users call
        if _ident(spec) in suites:
            continue
        if scale == "tiny":
            spec = shrink(kind, spec)
        if kind == "conv":
            direction = r.choice(CONV_DIRECTIONS)
        else:
            direction = "fwd" if fam == "decode" or r.random() < 0.5 else "bwd"
        ident = _ident(spec) + direction
        if ident in seen:
            continue
        seen.add(ident)
        name = f"{fam}{len(out)}_{kind}_{direction}"
        out.append(HeldOut(name, fam, kind, direction, spec))
    return out
