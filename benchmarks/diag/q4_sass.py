"""Solver 133's main loop in sm_90 SASS, compiled offline (no GPU: compile_check's stub
driver, Triton's bundled nvdisasm): instructions per 32-key step, by class.

Usage: TRITON_INTERPRET=0 python benchmarks/diag/q4_sass.py [--cases s4:64:0,u4:64zp:0,s4:64:64,s4:64:16]
       [--dump CASE_INDEX]   (a case is fmt:group[zp]:page[:ringN][:rN]; Hq 32, Hkv 8, D 128, bf16 q, Sq 1)
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import sys
from dataclasses import replace

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.dirname(__file__))
from nnprim.testing.compile_check import _cubin_usage, install_compile_only  # noqa: E402

install_compile_only()
import torch  # noqa: E402
from sass_count import back_edges, disassemble  # noqa: E402

from nnprim.attention import gluon_decode_quant as q4  # noqa: E402
from nnprim.problems.attention import AttentionProblem  # noqa: E402
from nnprim.search.random_args import random_args  # noqa: E402

CLASSES = {  # SASS opcode -> class (the rest: "other")
    "unpack": ("LOP3", "PRMT", "SHF", "HADD2", "HFMA2", "HMUL2"),
    "mma": ("HMMA",),
    "load": ("LDG", "LD", "CCTL", "LDS", "STS"),
    "f32": ("FADD", "FMUL", "FFMA", "FMNMX", "MUFU", "FSEL", "FSETP", "F2FP", "F2F"),
    "int/addr": ("IMAD", "IADD3", "LEA", "VIMNMX", "IMNMX", "ISETP", "SEL", "MOV", "LOP", "IABS", "I2F", "UIADD3",
                 "ULEA", "UIMAD", "UMOV", "USEL", "UISETP", "ULOP3", "USHF", "UMNMX", "UPRMT", "S2R", "R2UR"),
    "shfl": ("SHFL",),
}


def paths(body: list[str]) -> tuple[list[str], list[str]]:
    """The shortest and the longest path through the loop body (forward branches only: the
    body's if / else), as instruction lists; the fast path of a step is the shortest."""
    labels = {}
    instrs = []
    for x in body:
        if x.startswith("LABEL "):
            labels[x.split()[1]] = len(instrs)
        else:
            instrs.append(x)
    n = len(instrs)
    succ: list[list[int]] = []
    for i, x in enumerate(instrs):
        m = re.search(r"BRA\s+`?\(?\.?(L_x_\d+)", x)
        s: list[int] = []
        if m and labels.get(m.group(1), -1) > i:
            s.append(labels[m.group(1)])
        if not (m and not x.startswith("@")) and i + 1 < n:
            s.append(i + 1)
        succ.append(s)
    INF = float("inf")
    best = [(INF, None)] * (n + 1)
    worst = [(-1, None)] * (n + 1)
    best[0] = worst[0] = (1, None)
    for i in range(n):
        for j in succ[i]:
            if best[i][0] + 1 < best[j][0]:
                best[j] = (best[i][0] + 1, i)
            if worst[i][0] + 1 > worst[j][0]:
                worst[j] = (worst[i][0] + 1, i)

    def walk(t):
        out, i = [], n - 1
        while i is not None:
            out.append(instrs[i])
            i = t[i][1]
        return out[::-1]
    return walk(best), walk(worst)


def loops_with_labels(cubin: bytes) -> list[list[str]]:
    """The MMA loops' instructions (in code order) with 'LABEL L_x_N' lines where their labels are."""
    instrs, labels = disassemble(cubin)
    at: dict[int, list[str]] = {}
    for name, i in labels.items():
        at.setdefault(i, []).append(name)
    loops = []
    for lo, hi in back_edges(instrs, labels):
        out = []
        for i in range(lo, hi):
            out += [f"LABEL {name}" for name in at.get(i, []) if i > lo]
            out.append(instrs[i])
        loops.append(out)
    return loops


def classify(op: str) -> str:
    for cls, ops in CLASSES.items():
        if op in ops:
            return cls
    return "other"


def case_config(p, opts: list[str]):
    """133's default config with a case's options: ringN (cp.async ring of N slots), rN (register cap)."""
    cfg = q4.default_config(p)
    for o in opts:
        if o.startswith("ring"):
            cfg = replace(cfg, ring=int(o[4:]))
        elif o.startswith("r"):
            cfg = replace(cfg, maxnreg=int(o[1:]))
        else:
            raise SystemExit(f"unknown case option {o!r}")
    return cfg


def compile_case(spec: str):
    fmt, grp, page, *opts = spec.split(":")
    zp = grp.endswith("zp")
    group = int(grp.removesuffix("zp"))
    sig = (fmt, group, "g", "bfloat16", "g" if zp else None, 1)
    p = AttentionProblem(direction="fwd", device="cpu", B=2, Hq=32, Hkv=8, Sq=1, Sk=3072 if int(page) else 4096, D=128, Dv=128,
                         dtype=torch.bfloat16, k_quant=sig, v_quant=sig, page_size=int(page))
    kern = q4._gluon_decode_q4_kernel
    before = {id(ck) for c in kern.device_caches.values() for ck in c[0].values()}
    q4.Q4Plan(p, case_config(p, opts))(random_args(p, seed=0))
    return [ck for c in kern.device_caches.values() for ck in c[0].values() if id(ck) not in before][-1]


def report(name: str, full: list[str], ck, dump: bool) -> None:
    body, slow = paths(full)
    ops = [re.sub(r"^@!?U?P\w+\s+", "", x).split()[0].split(".")[0] for x in body]
    cls = collections.Counter(classify(o) for o in ops)
    top = collections.Counter(ops).most_common(10)
    print(f"{name}: {len(body)} instr / shortest step ({len(slow)} longest, {sum(not x.startswith('LABEL') for x in full)}"
          f" in the loop), {_cubin_usage(ck)} | "
          + " ".join(f"{k} {v}" for k, v in cls.most_common()) + " | " + " ".join(f"{k}:{v}" for k, v in top),
          flush=True)
    if dump:
        print("\n".join(body))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="s4:64:0,u4:64zp:0,s4:64:64,s4:64:16,s4:64:48")
    ap.add_argument("--dump", type=int, default=-1, help="print the loop of this case")
    a = ap.parse_args()
    for i, spec in enumerate(a.cases.split(",")):
        ck = compile_case(spec)
        for li, full in enumerate(loops_with_labels(ck.asm["cubin"])):
            report(f"{spec} loop {li}", full, ck, i == a.dump)


if __name__ == "__main__":
    main()
