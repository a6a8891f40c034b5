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


def pytest_configure(config):
    config.addinivalue_line("markers", "bigmem: allocates several GiB; run one at a time across xdist workers")


@pytest.fixture(autouse=True)
def _one_bigmem_test_at_a_time(request):
    """Tests marked bigmem (8k-32k contexts, FP8 references) take a file lock, so 8 xdist
    workers sharing one GPU do not run them together (they ran out of memory that way),
    and give their memory back to the other workers when done."""
    if request.node.get_closest_marker("bigmem") is None or not torch.cuda.is_available():
        yield
        return
    import fcntl
    import tempfile
    with open(os.path.join(tempfile.gettempdir(), "nnprim-gpu-bigmem.lock"), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()



@pytest.fixture
def gluon_opt_in(monkeypatch):
    """The Gluon solvers are opt-in (nnprim/gluon_support.py): their test modules switch them on."""
    monkeypatch.setenv("NNPRIM_GLUON", "1")
