"""Main-loop SASS instructions per K+V element of the quantized decode kernels (122, 128),
compiled for sm_90 on a machine without a GPU (nnprim.testing.compile_check's stub driver;
Triton's bundled nvdisasm). The loop is the largest backward branch holding the MMAs;
instructions per element = loop instructions x warps / (block_n x (D + Dv)).
Hq 32, Hkv 8, Sk 4096, scales bf16, V keys-contiguous unless --rows (benchmarks/DECODE_QUANT.md).

Usage: TRITON_INTERPRET=0 python benchmarks/diag/sass_count.py [--solver 128] [--rows] [--sq 1]
       [--dtype bfloat16] [--formats s4:32,u4:64:zp,s8:32,fp8_e4m3] [--block-n 128 --warps 4]
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import replace

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from nnprim.testing.compile_check import install_compile_only  # noqa: E402

install_compile_only()
import torch  # noqa: E402
import triton  # noqa: E402

from nnprim.args import AttnArgs  # noqa: E402
from nnprim.attention import decode_quant, decode_swap  # noqa: E402
from nnprim.problems.attention import AttentionProblem  # noqa: E402
from nnprim.quant import quantize_kv  # noqa: E402

NVDISASM = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")


def disassemble(cubin: bytes) -> tuple[list[str], dict[str, int]]:
    """(instructions, label -> index of the instruction it precedes) of a cubin."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([NVDISASM, "-c", f.name], capture_output=True, text=True, check=True).stdout
    labels, instrs = {}, []
    for ln in sass.splitlines():
        if m := re.match(r"\s*\.(L_x_\d+):", ln):
            labels[m.group(1)] = len(instrs)
        elif m := re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(.*?);", ln):
            instrs.append(m.group(1))
    return instrs, labels


def back_edges(instrs: list[str], labels: dict[str, int], needs: str | None = "MMA") -> list[tuple[int, int]]:
    """[start, end) of each loop (a backward branch) holding an instruction containing `needs`."""
    out = []
    for i, ins in enumerate(instrs):
        m = re.search(r"BRA\s+`?\(?\.?(L_x_\d+)", ins)
        if m and labels.get(m.group(1), i + 1) <= i:
            a = labels[m.group(1)]
            if needs is None or any(needs in x for x in instrs[a:i + 1]):
                out.append((a, i + 1))
    return out


def loop_body(cubin: bytes, needs: str | None = "MMA") -> list[str]:
    """Instructions of the largest loop (backward branch) holding an instruction that
    contains `needs` ((H)MMA by default; None: any loop)."""
    instrs, labels = disassemble(cubin)
    loops = back_edges(instrs, labels, needs)
    if not loops:
        return []
    a, b = max(loops, key=lambda r: r[1] - r[0])
    return instrs[a:b]


def count(solver: int, fmt: str, group, zp: bool, role, Sq: int, dtype: torch.dtype, cfg=None) -> str:
    B, Hq, Hkv, Sk, D = 1, 32, 8, 4096, 128
    k, v = torch.randn(B, Hkv, Sk, D), torch.randn(B, Hkv, Sk, D)
    if fmt == "fp8_e4m3":
        kq, vq = quantize_kv(k, fmt), quantize_kv(v, fmt, order="keys" if role == "v" else None)
    else:
        kw = dict(group_size=group, symmetric=not zp, scale_dtype=torch.bfloat16)
        kq, vq = quantize_kv(k, fmt, **kw), quantize_kv(v, fmt, order="keys" if role == "v" else None, **kw)
    p = AttentionProblem(direction="fwd", device="cuda", B=B, Hq=Hq, Hkv=Hkv, Sq=Sq, Sk=Sk, D=D, Dv=D, dtype=dtype,
                         k_quant=kq.signature(), v_quant=vq.signature())
    mod, kern = ((decode_swap, decode_swap._decode_swap_kernel) if solver == 128
                 else (decode_quant, decode_quant._decode_quant_kernel))
    cfg = cfg or mod.default_config(p)
    q = torch.randn(B, Hq, Sq, D, dtype=dtype)
    before = {id(ck) for c in kern.device_caches.values() for ck in c[0].values()}
    main = mod.plan(p, AttnArgs(q=q, k=kq, v=vq), cfg)[0]
    z = lambda t: q if t is None else t  # noqa: E731
    main(q, kq.data, vq.data, kq.scales, z(kq.zero_points), vq.scales, z(vq.zero_points), q, q, q, q, q, q, q, q)
    ck = [ck for c in kern.device_caches.values() for ck in c[0].values() if id(ck) not in before][-1]
    body = loop_body(ck.asm["cubin"])
    ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", x).split()[0].split(".")[0] for x in body)
    w = ck.metadata.num_warps
    top = ", ".join(f"{k}:{n}" for k, n in ops.most_common(8))
    return (f"{solver} {fmt} g{group}{' zp' if zp else ''} V {'keys' if role else 'rows'} Sq {Sq} bn{cfg.block_n} "
            f"w{w}: {len(body)} x {w} -> {len(body) * w / (cfg.block_n * 2 * D):.3f} / element  [{top}]")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--solver", type=int, default=128, choices=(122, 128))
    ap.add_argument("--rows", action="store_true", help="V stored rows (default keys-contiguous)")
    ap.add_argument("--sq", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    ap.add_argument("--formats", default="s4:32,s4:128,u4:64:zp,s8:32,s8:32:zp,u8:64:zp,fp8_e4m3")
    ap.add_argument("--block-n", type=int, default=0)
    ap.add_argument("--warps", type=int, default=4)
    a = ap.parse_args()
    cfg = None
    if a.block_n:
        cfg = (decode_swap.DecodeConfig if a.solver == 128 else decode_quant.QuantDecodeConfig)(
            block_n=a.block_n, block_m=16, num_warps=a.warps, num_stages=3)
    for spec in a.formats.split(","):
        f = spec.split(":")
        group = int(f[1]) if len(f) > 1 and f[1] else None
        print(count(a.solver, f[0], group, "zp" in f[2:], None if a.rows else "v", a.sq, getattr(torch, a.dtype),
                    cfg and replace(cfg)), flush=True)


if __name__ == "__main__":
    main()
