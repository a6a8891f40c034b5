"""Tile tuning for the flash attention solvers: `benchmarks/attention.py --tune`.

Times the candidate forward tiles (BM, BN, warps, stages, TMA) and backward tiles
(BM, BN, warps, stages) listed in attention.py's FWD_CANDS / BWD_CANDS on the chosen
suite problems, next to the peers, and writes attention_<date>_tune.json. The winners
go into nnprim/attention/configs.py's TABLE (keyed by arch, head-dim bucket, sequence
bucket, causal, dtype class).

    PYTHONUNBUFFERED=1 python benchmarks/tune_attention.py \
        --subset train_d64_s4096,train_d128_s4096,train_d256_s4096 --out $OUT
"""
import runpy
import sys
from pathlib import Path

if __name__ == "__main__":
    if "--tune" not in sys.argv:
        sys.argv.append("--tune")
    runpy.run_path(str(Path(__file__).with_name("attention.py")), run_name="__main__")
