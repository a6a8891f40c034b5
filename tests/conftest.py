"""Test session setup. Without a GPU, Triton kernels run through the interpreter on CPU
(set before triton is imported anywhere); with one (tests/gpu on the H200) they compile.
The find-db lives in a per-session temp dir."""
import os
import tempfile

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("NNPRIM_CACHE_DIR", tempfile.mkdtemp(prefix="nnprim-test-cache-"))
# native CPU builds (nnprim/native.py, ~15 s each) shared by this session's processes, also the
# CLI tests' subprocesses with their own cache dirs
os.environ.setdefault("NNPRIM_NATIVE_DIR", os.path.join(os.environ["NNPRIM_CACHE_DIR"], "native"))
