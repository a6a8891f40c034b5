"""End to end on the GPU: nnprim against torch (cuDNN / torch SDPA) in the same run, eager
and under torch.compile, each pair built with the same initial weights and data.

- resnet50: torchvision's ResNet-50 training step (SGD, bf16 autocast, channels-last,
  batch 128), its convolutions as nnprim.nn.Conv2d (ResNet's convolutions are followed
  by BatchNorm in training, so there is no bias or residual for the conv to fuse).
- llama: a Llama-style decoder training step (4 layers, 32 query / 8 KV heads of 128,
  SwiGLU, RMSNorm, RoPE, S 4096, batch 2, bf16 autocast), attention through nnprim.sdpa
  vs F.scaled_dot_product_attention(enable_gqa=True).
- decode: one decode step of the same decoder (no MLP weights updated; batch 64, 8k
  cached tokens per layer), bf16 K/V and 4-bit (s4, group 64) K/V for nnprim against
  torch SDPA on the bf16 cache.

Per row: median step time (CUDA events, after warm-up), images/s or tokens/s, peak
memory (the whole run's, and after the warm-up steps: nnprim's first steps run its finds), and
for training the loss curve; the note compares the curves.

    python3 benchmarks/e2e.py --models resnet50,llama,decode --modes eager,compile --out $OUT/e2e.json
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import nnprim  # noqa: E402

DEV = "cuda"
DRY = "--dry" in sys.argv  # a CPU run of the script itself at toy sizes
if DRY:
    DEV = "cpu"
ROWS: list[dict] = []


def save(path: str) -> None:
    meta = dict(date=time.strftime("%Y-%m-%d"), device=torch.cuda.get_device_name() if DEV == "cuda" else "cpu",
                torch=torch.__version__)
    with open(path, "w") as f:
        json.dump(dict(meta=meta, rows=ROWS), f, indent=1)


def timed_steps(step, steps: int, warm: int) -> tuple[list[float], list[float], int]:
    """(losses of every step, ms of the steps after `warm`, peak bytes of the warm-up steps);
    the peak memory stats restart after the warm-up (nnprim's first steps run its finds)."""
    losses, times, warm_peak = [], [], 0
    for i in range(steps):
        if i == warm and DEV == "cuda":
            torch.cuda.synchronize()
            warm_peak = torch.cuda.max_memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        if DEV == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            loss = step(i)
            b.record()
            b.synchronize()
            ms = a.elapsed_time(b)
        else:
            t0 = time.perf_counter()
            loss = step(i)
            ms = (time.perf_counter() - t0) * 1e3
        losses.append(float(loss))
        if i >= warm:
            times.append(ms)
    return losses, times, warm_peak


def _reset_peak() -> None:
    if DEV == "cuda":
        torch.cuda.reset_peak_memory_stats()


def record(model: str, impl: str, mode: str, unit: str, per_step: float, losses, times, warm_peak: int,
           extra=None):
    """warm_peak: timed_steps' peak bytes of the warm-up (the stats count the steps after it)."""
    ms = statistics.median(times)
    steady = torch.cuda.max_memory_allocated() if DEV == "cuda" else None
    whole = max(steady, warm_peak) if steady is not None else None
    gb = (lambda b: None if b is None else round(b / 2**30, 2))  # noqa: E731
    row = dict(model=model, impl=impl, mode=mode, step_ms=round(ms, 3), throughput=round(per_step / ms * 1e3, 1),
               unit=unit, peak_mem_gb=gb(whole), steady_peak_mem_gb=gb(steady),
               losses=[round(v, 5) for v in losses], **(extra or {}))
    ROWS.append(row)
    print(f"{model:<9} {impl:<7} {mode:<8} {ms:9.2f} ms/step  {row['throughput']:>10} {unit}  "
          f"peak {row['peak_mem_gb']} GB (after warm-up {row['steady_peak_mem_gb']})  "
          f"loss {losses[0]:.4f} -> {losses[-1]:.4f}", flush=True)
    return row


# ---- ResNet-50 ----------------------------------------------------------------------------
def to_nnprim_convs(module: nn.Module) -> nn.Module:
    """Replace every torch.nn.Conv2d by nnprim.nn.Conv2d with the same weights."""
    for name, child in module.named_children():
        if isinstance(child, nn.Conv2d):
            new = nnprim.nn.Conv2d(child.in_channels, child.out_channels, child.kernel_size, stride=child.stride,
                                   padding=child.padding, dilation=child.dilation, groups=child.groups,
                                   bias=child.bias is not None, device=child.weight.device, dtype=child.weight.dtype)
            with torch.no_grad():
                new.weight.copy_(child.weight)
                if child.bias is not None:
                    new.bias.copy_(child.bias)
            setattr(module, name, new)
        else:
            to_nnprim_convs(child)
    return module


def bench_resnet50(modes, steps: int, warm: int, batch: int, res: int) -> None:
    import torchvision
    torch.manual_seed(0)
    base = torchvision.models.resnet50().to(DEV).to(memory_format=torch.channels_last)
    g = torch.Generator(device=DEV).manual_seed(1)
    data = [(torch.randn(batch, 3, res, res, device=DEV, generator=g).contiguous(memory_format=torch.channels_last),
             torch.randint(0, 1000, (batch,), device=DEV, generator=g)) for _ in range(4)]
    models = {"torch": base, "nnprim": to_nnprim_convs(copy.deepcopy(base))}
    t0 = time.perf_counter()
    probs = nnprim.warmup.problems_of(
        lambda m, x: F.cross_entropy(_autocast(m, x), data[0][1]), models["nnprim"], data[0][0])
    info = nnprim.warmup.warmup(probs, workers=1 if DRY else 12)
    print(f"resnet50 nnprim warmup: {info} ({time.perf_counter() - t0:.1f} s)", flush=True)
    for mode in modes:
        for impl, m0 in models.items():
            m = copy.deepcopy(m0)
            opt = torch.optim.SGD(m.parameters(), lr=0.02, momentum=0.9)
            fwd = torch.compile(m) if mode == "compile" else m

            def step(i, m=m, fwd=fwd, opt=opt):
                x, y = data[i % len(data)]
                loss = F.cross_entropy(_autocast(fwd, x), y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                return loss.detach()
            _reset_peak()
            losses, times, warm_peak = timed_steps(step, steps, warm)
            record("resnet50", impl, mode, "img/s", batch, losses, times, warm_peak, dict(batch=batch))
            del m, opt, fwd


def _autocast(fn, *args):
    with torch.autocast(DEV, dtype=torch.bfloat16):
        return fn(*args)


# ---- Llama-style decoder ----------------------------------------------------------------------
class RMSNorm(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.w = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype) * self.w.to(x.dtype)


def rope(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1]
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    ang = pos.float()[:, None] * inv[None, :]
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), -1).flatten(-2)


class Layer(nn.Module):
    def __init__(self, d: int, hq: int, hkv: int, ffn: int, use_nnprim: bool):
        super().__init__()
        self.hq, self.hkv, self.hd, self.use_nnprim = hq, hkv, d // hq, use_nnprim
        self.n1, self.n2 = RMSNorm(d), RMSNorm(d)
        self.wq = nn.Linear(d, hq * self.hd, bias=False)
        self.wk = nn.Linear(d, hkv * self.hd, bias=False)
        self.wv = nn.Linear(d, hkv * self.hd, bias=False)
        self.wo = nn.Linear(hq * self.hd, d, bias=False)
        self.w1 = nn.Linear(d, ffn, bias=False)
        self.w3 = nn.Linear(d, ffn, bias=False)
        self.w2 = nn.Linear(ffn, d, bias=False)

    def attend(self, q, k, v, causal: bool, cache=None):
        if self.use_nnprim:
            if cache is not None:
                return nnprim.sdpa(q, cache[0], cache[1])
            return nnprim.sdpa(q, k, v, causal="top_left" if causal else None)
        if cache is not None:
            return F.scaled_dot_product_attention(q, cache[0], cache[1], enable_gqa=True)
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)

    def forward(self, x, pos, cache=None):
        B, S, _ = x.shape
        h = self.n1(x)
        q = rope(self.wq(h).view(B, S, self.hq, self.hd).transpose(1, 2), pos)
        k = rope(self.wk(h).view(B, S, self.hkv, self.hd).transpose(1, 2), pos)
        v = self.wv(h).view(B, S, self.hkv, self.hd).transpose(1, 2)
        o = self.attend(q, k, v, causal=cache is None, cache=cache)
        x = x + self.wo(o.transpose(1, 2).reshape(B, S, -1))
        h = self.n2(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


_SIZES = dict(layers=2, d=256, hq=4, hkv=2, ffn=512, vocab=1000) if DRY else {}


class Decoder(nn.Module):
    def __init__(self, use_nnprim: bool, layers=4, d=4096, hq=32, hkv=8, ffn=14336, vocab=32000):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Layer(d, hq, hkv, ffn, use_nnprim) for _ in range(layers))
        self.norm = RMSNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, tokens, pos, caches=None):
        x = self.emb(tokens)
        for i, layer in enumerate(self.layers):
            x = layer(x, pos, None if caches is None else caches[i])
        return self.head(self.norm(x))


def _set_backend(model: nn.Module, use_nnprim: bool) -> nn.Module:
    for layer in model.layers:
        layer.use_nnprim = use_nnprim
    return model


def bench_llama(modes, steps: int, warm: int, batch: int, seq: int) -> None:
    torch.manual_seed(0)
    base = Decoder(False, **_SIZES).to(DEV)
    g = torch.Generator(device=DEV).manual_seed(2)
    data = [torch.randint(0, base.head.out_features, (batch, seq + 1), device=DEV, generator=g) for _ in range(4)]
    pos = torch.arange(seq, device=DEV)
    for mode in modes:
        for impl in ("torch", "nnprim"):
            m = _set_backend(copy.deepcopy(base), impl == "nnprim")
            opt = torch.optim.SGD(m.parameters(), lr=0.05)
            fwd = torch.compile(m) if mode == "compile" else m

            def step(i, fwd=fwd, opt=opt):
                t = data[i % len(data)]
                logits = _autocast(fwd, t[:, :-1], pos)
                loss = F.cross_entropy(logits.float().flatten(0, 1), t[:, 1:].flatten())
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                return loss.detach()
            _reset_peak()
            losses, times, warm_peak = timed_steps(step, steps, warm)
            record("llama", impl, mode, "tok/s", batch * seq, losses, times, warm_peak, dict(batch=batch, seq=seq))
            del m, opt, fwd


@torch.no_grad()
def bench_decode(modes, steps: int, warm: int, batch: int, ctx: int) -> None:
    torch.manual_seed(0)
    model = Decoder(False, **_SIZES).to(DEV).to(torch.bfloat16).eval()
    g = torch.Generator(device=DEV).manual_seed(3)
    hkv, hd = model.layers[0].hkv, model.layers[0].hd
    caches = [(torch.randn(batch, hkv, ctx, hd, device=DEV, dtype=torch.bfloat16, generator=g),
               torch.randn(batch, hkv, ctx, hd, device=DEV, dtype=torch.bfloat16, generator=g))
              for _ in model.layers]
    qcaches = [tuple(nnprim.quantize_kv(t, "s4", group_size=64) for t in c) for c in caches]
    tokens = torch.randint(0, model.head.out_features, (batch, 1), device=DEV, generator=g)
    pos = torch.tensor([ctx], device=DEV)
    ref = None
    for mode in modes:
        for impl, kv in (("torch", caches), ("nnprim", caches), ("nnprim-s4", qcaches)):
            m = _set_backend(model, impl != "torch")
            fwd = torch.compile(m) if mode == "compile" else m
            logits = fwd(tokens, pos, kv)
            if impl == "torch" and mode == modes[0]:
                ref = logits.float()
            err = float((logits.float() - ref).norm() / ref.norm())
            _reset_peak()
            _, times, warm_peak = timed_steps(lambda i, fwd=fwd, kv=kv: fwd(tokens, pos, kv)[0, 0, 0], steps, warm)
            record("decode", impl, mode, "tok/s", batch, [err], times, warm_peak, dict(batch=batch, context=ctx,
                                                                              rel_err_vs_torch=round(err, 5)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="resnet50,llama,decode")
    ap.add_argument("--modes", default="eager,compile")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--warm", type=int, default=5)
    ap.add_argument("--dry", action="store_true", help="a CPU run at toy sizes (checks the script)")
    ap.add_argument("--out", default=f"benchmarks/results/e2e_{time.strftime('%Y-%m-%d')}.json")
    a = ap.parse_args()
    modes = a.modes.split(",")
    torch.backends.cudnn.benchmark = True
    for name in a.models.split(","):
        t0 = time.perf_counter()
        try:
            if name == "resnet50":
                bench_resnet50(modes, a.steps, a.warm, 2 if DRY else 128, 32 if DRY else 224)
            elif name == "llama":
                bench_llama(modes, a.steps, a.warm, 1 if DRY else 2, 64 if DRY else 4096)
            elif name == "decode":
                bench_decode(modes, a.steps, a.warm, 2 if DRY else 64, 128 if DRY else 8192)
        except Exception as e:  # keep what the other models measured
            ROWS.append(dict(model=name, error=f"{type(e).__name__}: {e}"))
            print(f"{name}: {type(e).__name__}: {e}", flush=True)
        print(f"{name}: {time.perf_counter() - t0:.1f} s", flush=True)
        save(a.out)
        if DEV == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
