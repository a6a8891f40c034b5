"""What a call may do while a CUDA graph is being captured on its device.

No host read of device values can run there (torch's `.item()`, `bool(t.any())`: the
driver refuses the sync and the capture is invalidated), so value checks that read
kv_lens, block tables or descale factors are skipped while capturing (the kernels clamp
what they read) and no find runs (policy.select takes the heuristic's choice)."""
from __future__ import annotations

import torch


def capturing(device: torch.device) -> bool:
    """Whether the current stream of `device` (a CUDA device) is being captured."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()
