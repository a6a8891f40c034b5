"""Test session setup: Triton kernels run through the interpreter on CPU (set before
triton is imported anywhere), and the find-db lives in a per-session temp dir."""
import os
import tempfile

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("NNPRIM_CACHE_DIR", tempfile.mkdtemp(prefix="nnprim-test-cache-"))
