"""Which solver each problem of a graphed nn.Conv2d training step chose, and from where
(test_cuda_graph_training_step saw the reference chosen for its backward weights on
2026-12-01). Prints find's log and the chosen solvers."""
from __future__ import annotations

import logging
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import torch  # noqa: E402

import nnprim  # noqa: E402
from nnprim.search.context import context  # noqa: E402

logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")
torch.manual_seed(1)
conv = nnprim.nn.Conv2d(32, 32, 3, padding=1, device="cuda", dtype=torch.bfloat16)
x = torch.randn(8, 32, 16, 16, device="cuda", dtype=torch.bfloat16).contiguous(memory_format=torch.channels_last)
x.requires_grad_()
mode = sys.argv[1] if len(sys.argv) > 1 else "graph"
if mode == "graph":
    graphed = torch.cuda.make_graphed_callables(conv, (x,))
    y = graphed(x)
else:
    y = conv(x)
y.float().square().sum().backward()
torch.cuda.synchronize()
for p, b in context(torch.device("cuda")).chosen.items():
    print("CHOSEN", p.key(), b.solver.name, "forced" if b.forced else "")
