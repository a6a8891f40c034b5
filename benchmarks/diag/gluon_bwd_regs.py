"""Registers, spills, shared memory and SASS counts of solver 127's main kernel
(nnprim/attention/gluon_bwd.py) per tile config, and of solver 130's (head dim 256,
nnprim/attention/gluon_bwd_d256.py: `--dims 256`, its own config names), compiled for sm_90 on
a machine without a GPU (nnprim.testing.compile_check's stub driver; Triton's bundled cuobjdump
and nvdisasm).

Per config and causal mode: REG (the kernel's launch register count; setmaxnreg then gives
the consumers 240), STACK (bytes of stack per thread: the spills), the dynamic shared
memory, and SASS counts over the whole kernel: instructions, STL/LDL (spill stores and
loads), HGMMA, REDG (the dQ atomic reductions); and any ptxas warning (a serialised wgmma).

Usage: TRITON_INTERPRET=0 python benchmarks/diag/gluon_bwd_regs.py [--dims 64,128]
       [--configs default,wg_dq,s3,...] [--causal none,top_left] [--dump DIR]
       TRITON_INTERPRET=0 python benchmarks/diag/gluon_bwd_regs.py --dims 256 --configs default,atomic
       --causal none,top_left,bottom_right
The config names are those of gluon_bwd.CONFIGS, at d256 gluon_bwd_d256.CONFIGS
(benchmarks/gluon_bwd.py times the same; d256 ones as d256_<name>); a name that the head
dim's module lacks is skipped.
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from nnprim.testing.compile_check import _cubin_usage, install_compile_only  # noqa: E402

install_compile_only()
import torch  # noqa: E402
import triton  # noqa: E402

from nnprim.attention import gluon_bwd, gluon_bwd_d256  # noqa: E402
from nnprim.problems.attention import AttentionProblem  # noqa: E402
from nnprim.search.random_args import random_args  # noqa: E402

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
NVDISASM, PTXAS = os.path.join(BIN, "nvdisasm"), os.path.join(BIN, "ptxas")


def ptxas_warnings(ptx: str) -> str:
    """ptxas -v's warnings on the kernel's PTX (e.g. wgmma serialised: every wgmma then waits
    for the previous one), '' when none."""
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        r = subprocess.run([PTXAS, "-arch=sm_90a", "-v", src, "-o", os.path.join(d, "k.cubin")],
                           capture_output=True, text=True)
    return " ".join(ln.strip() for ln in (r.stdout + r.stderr).splitlines() if "warning" in ln.lower())


def sass_counts(cubin: bytes) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([NVDISASM, "-c", f.name], capture_output=True, text=True, check=True).stdout
    ops = collections.Counter()
    for ln in sass.splitlines():
        if m := re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(.*?);", ln):
            ops[re.sub(r"^@!?U?P\w+\s+", "", m.group(1)).split()[0].split(".")[0]] += 1
    return dict(instr=sum(ops.values()), STL=ops["STL"], LDL=ops["LDL"], HGMMA=ops["HGMMA"], REDG=ops["REDG"])


def measure(d: int, name: str, causal: str | None, dump: str | None = None) -> str:
    if d == 256:
        if name not in gluon_bwd_d256.CONFIGS:
            return f"d{d} {name:10s} (no such d256 config: {list(gluon_bwd_d256.CONFIGS)})"
        cfg, plan, kern = gluon_bwd_d256.CONFIGS[name](), gluon_bwd_d256.GluonBwdD256Plan, \
            gluon_bwd_d256._gluon_bwd_d256_kernel
    else:
        if name not in gluon_bwd.CONFIGS:
            return f"d{d} {name:10s} (no such config: {list(gluon_bwd.CONFIGS)})"
        cfg, plan, kern = gluon_bwd.CONFIGS[name](d), gluon_bwd.GluonBwdPlan, gluon_bwd._gluon_bwd_kernel
    p = AttentionProblem(direction="bwd", device="cpu", return_lse=True, B=1, Hq=4, Hkv=1, Sq=300, Sk=333, D=d,
                         Dv=d, dtype=torch.bfloat16, causal=causal)
    before = {id(ck) for c in kern.device_caches.values() for ck in c[0].values()}
    pl = plan(p, cfg)
    pl(random_args(p, seed=0))
    cfg = pl.cfg      # as the plan runs it (gluon_bwd.rotation: no rotated walk under causal masking)
    new = [ck for c in kern.device_caches.values() for ck in c[0].values() if id(ck) not in before]
    if not new:
        return f"d{d} {name:10s} {causal or 'none':9s} (already compiled: same constexprs as an earlier config)"
    ck = new[-1]
    if dump:
        os.makedirs(dump, exist_ok=True)
        with open(os.path.join(dump, f"d{d}_{name}_{causal or 'none'}.cubin"), "wb") as f:
            f.write(ck.asm["cubin"])
    s = sass_counts(ck.asm["cubin"])
    keys = ("STAGES",) + tuple(k for k in cfg if k not in ("BLOCK_M", "BLOCK_N", "STAGES", "num_warps", "maxnreg"))
    c = " ".join(f"{k}={cfg[k]}" for k in keys)
    return (f"d{d} {name:10s} {causal or 'none':9s} {_cubin_usage(ck):28s} smem={ck.metadata.shared:6d} "
            f"sass={s['instr']:5d} STL={s['STL']:3d} LDL={s['LDL']:3d} HGMMA={s['HGMMA']:3d} REDG={s['REDG']:3d}  {c}"
            + (f"  PTXAS: {w}" if (w := ptxas_warnings(ck.asm["ptx"])) else ""))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dims", default="64,128")
    ap.add_argument("--configs", default=",".join(gluon_bwd.CONFIGS))
    ap.add_argument("--causal", default="none,top_left")
    ap.add_argument("--dump", default=None, help="folder for the cubins (nvdisasm -c them)")
    a = ap.parse_args()
    for d in (int(x) for x in a.dims.split(",")):
        for name in a.configs.split(","):
            for causal in a.causal.split(","):
                try:
                    print(measure(d, name, None if causal == "none" else causal, a.dump), flush=True)
                except Exception as e:  # noqa: BLE001 - a config that does not compile is a result
                    print(f"d{d} {name} {causal}: FAILED {type(e).__name__}: {str(e)[:600]}", flush=True)


if __name__ == "__main__":
    main()
