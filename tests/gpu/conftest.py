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
    config.addinivalue_line("markers", "bigmem: allocates several GiB; few at a time across xdist workers")


# bigmem tests at once: 8 ran the H200 out of memory, 1 serialised the suite; whole decode modules
# are bigmem, so their 211 tests ran 3 at a time (2026-12-04: 400 s, 42 not started; the rest of
# the setup time was this wait): NNPRIM_GPU_BIGMEM_SLOTS tries more
BIGMEM_SLOTS = int(os.environ.get("NNPRIM_GPU_BIGMEM_SLOTS", "3"))


@pytest.fixture(autouse=True)
def _few_bigmem_tests_at_a_time(request):
    """Tests marked bigmem (8k-32k contexts, FP8 references) take one of BIGMEM_SLOTS file
    locks, so 8 xdist workers sharing one GPU do not run more of them together than its
    memory holds, and give their memory back to the other workers when done."""
    if request.node.get_closest_marker("bigmem") is None or not torch.cuda.is_available():
        yield
        return
    import fcntl
    import tempfile
    import time
    files = [open(os.path.join(tempfile.gettempdir(), f"nnprim-gpu-bigmem-{i}.lock"), "w")
             for i in range(BIGMEM_SLOTS)]
    held = None
    try:
        while held is None:
            for f in files:
                try:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    held = f
                    break
                except BlockingIOError:
                    pass
            else:
                time.sleep(0.05)
        try:
            yield
        finally:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    finally:
        for f in files:
            f.close()   # closing releases the lock held on it


@pytest.fixture
def gluon_on(monkeypatch):
    """The Gluon solvers' test modules run them even where the environment switches them off
    (NNPRIM_GLUON=0, nnprim/gluon_support.py)."""
    monkeypatch.setenv("NNPRIM_GLUON", "1")
