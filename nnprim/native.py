"""Native CPU code built on the user's machine: a C++ source compiled once with the system
compiler against the installed torch (no ninja, no pip package: `g++` and torch's headers)
into the nnprim cache directory and loaded as torch ops (`torch.ops.<namespace>.*`).

Each library (`NativeLibrary`: the Winograd transforms of conv/cpu_wino_native.py, the flash
attention forward of attention/cpu_flash_native.py) is keyed by its source, torch, Python and
the CPU's flags (it is built with -march=native), so a changed source or machine builds anew;
builds live in <cache dir>/native, or NNPRIM_NATIVE_DIR (the tests share one across processes).
Where the build or the load fails (no compiler, another platform) or NNPRIM_CPU_NATIVE=0,
`ops()` returns None, warns once, and the callers' torch-op paths run."""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
from pathlib import Path

import torch

from .errors import SolverUnavailableError

log = logging.getLogger("nnprim")
ENV = "NNPRIM_CPU_NATIVE"
# C++ helpers several sources share, prepended to their text (a build compiles one file)
NATIVE_HELPERS = Path(__file__).with_name("native_helpers.h").read_text()


def _avx512() -> bool:
    from .conv.cpu_gemm import cpu_flags
    return "avx512f" in cpu_flags()


class NativeLibrary:
    """One C++ source defining the torch ops of `namespace`; built and loaded on first use."""

    def __init__(self, namespace: str, source: str, what: str) -> None:
        self.namespace, self.source, self.what = namespace, source, what
        self._lock = threading.Lock()
        self._ops: object = False     # False: not tried yet; None: unavailable

    def _flags(self) -> list[str]:
        """-march=native, and ATen's 512-bit vector classes where the CPU has AVX-512 (the
        `at::vec::Vectorized` headers pick their width from CPU_CAPABILITY)."""
        flags = ["-O3", "-march=native", "-std=c++17"]
        if _avx512():
            flags += ["-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512"]
        return flags

    def so_path(self) -> Path:
        """The build for this source, torch, Python and CPU (-march=native)."""
        from .conv.cpu_gemm import cpu_flags
        from .search.finddb import cache_dir
        key = hashlib.sha256("\n".join((self.source, torch.__version__, sys.version, os.uname().machine,
                                        " ".join(sorted(cpu_flags())), " ".join(self._flags()))).encode()).hexdigest()[:16]
        root = os.environ.get("NNPRIM_NATIVE_DIR") or os.path.join(cache_dir(), "native")
        return Path(root) / f"{self.namespace}_{key}.so"

    def compile(self, so: Path) -> None:
        """Compile the source into `so` (atomically: a temporary file renamed into place)."""
        from torch.utils.cpp_extension import include_paths, library_paths
        so.parent.mkdir(parents=True, exist_ok=True)
        cxx = os.environ.get("CXX", "g++")
        with tempfile.TemporaryDirectory(dir=so.parent) as tmp:
            src = Path(tmp) / f"{self.namespace}.cpp"
            src.write_text(self.source)
            out = Path(tmp) / so.name
            cmd = [cxx, *self._flags(), "-shared", "-fPIC", "-fopenmp",
                   f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
                   *(f"-I{p}" for p in include_paths()), f"-I{sysconfig.get_paths()['include']}",
                   str(src), "-o", str(out),
                   *(f"-L{p}" for p in library_paths()), "-lc10", "-ltorch_cpu",
                   *(f"-Wl,-rpath,{p}" for p in library_paths())]
            subprocess.run(cmd, check=True, capture_output=True, timeout=600)
            os.replace(out, so)

    def expected(self) -> bool:
        """Whether the library should be there (enabled, Linux, a compiler on PATH), without
        building it: for estimates, which must not compile."""
        if os.environ.get(ENV, "1") == "0" or not sys.platform.startswith("linux"):
            return False
        if self._ops is not False:
            return self._ops is not None
        return shutil.which(os.environ.get("CXX", "g++")) is not None

    def missing_reasons(self) -> list[str]:
        """[] where the library should be there (see `expected`), else the solvers' reason."""
        if self.expected():
            return []
        return [f"the {self.what} cannot be built here (no C++ compiler, not Linux, or {ENV}=0)"]

    def required(self):
        """ops(), for solvers that have no torch-op path: a library that failed to build (after
        the solver was found applicable: the build is lazy) raises SolverUnavailableError, which
        the search treats as this solver failing, not an AttributeError from inside it."""
        ops = self.ops()
        if ops is None:
            raise SolverUnavailableError(f"the {self.what} is unavailable (its build failed or {ENV}=0; the "
                                         "warning logged at the build says why)")
        return ops

    def ops(self):
        """torch.ops.<namespace> once built and loaded (first call: compiles, ~15-40 s), or
        None (disabled, no compiler, not Linux: the callers' torch-op paths run)."""
        if os.environ.get(ENV, "1") == "0":
            return None
        if self._ops is not False:
            return self._ops
        with self._lock:
            if self._ops is not False:
                return self._ops
            result = None
            try:
                if sys.platform.startswith("linux"):
                    so = self.so_path()
                    if not so.exists():
                        log.info("nnprim: building the %s into %s (once per machine)", self.what, so)
                        self.compile(so)
                    torch.ops.load_library(str(so))
                    result = getattr(torch.ops, self.namespace)
            except Exception as e:  # noqa: BLE001 - any build or load failure: the torch-op path
                detail = getattr(e, "stderr", b"") or b""
                log.warning("nnprim: %s unavailable (%s%s); using torch ops", self.what, type(e).__name__,
                            ": " + detail.decode(errors="replace")[-300:] if detail else f": {e}")
            self._ops = result
            return result
