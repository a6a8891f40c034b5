"""GPU tests (the H200): every module here is skipped without CUDA. Run them there with
`python3 -m pytest -q tests/gpu` (nnprim chooses solvers by find as users' calls do)."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if os.sep + "gpu" + os.sep in str(item.fspath):
            item.add_marker(skip)
