"""Planned Triton launches for the GPU invokers: everything but the data pointers is
fixed when the invoker is planned (`Solver.prepare`, or the first call with a given set
of strides), so the hot path is a tuple concatenation and one call into Triton's C
launcher.

A `Launch` holds the kernel, its grid, its launch options and the tail of its
positional argument list (every scalar and constexpr, in signature order); kernels
put their per-call tensor arguments first, so a call is `launch(x, w, y, ...)`.
The first call goes through the JIT (compile, or cache lookup) and keeps the compiled
kernel; later calls launch it directly, skipping the binder, the specialisation key
and the cache lookup (~20-40 us of Python per launch), as long as the pointers keep
the 16-byte alignment the kernel was specialised for and no launch hook (profiler)
is installed; otherwise they take the JIT path again. Under TRITON_INTERPRET=1
every call takes the JIT path (the interpreter has no compiled kernel)."""
from __future__ import annotations

import inspect
import os
from collections.abc import Callable

import torch
from triton import knobs
from triton.tools.tensor_descriptor import TensorDescriptor

from . import alloc
from .errors import NotSupportedError
from .limits import grid_reasons

try:  # Gluon's host descriptor (it carries the shared-memory layout) launches the same way
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor
    DESCRIPTOR_TYPES: tuple[type, ...] = (TensorDescriptor, GluonTensorDescriptor)
except Exception:  # noqa: BLE001 - a Triton without Gluon
    DESCRIPTOR_TYPES = (TensorDescriptor,)


def interpreting() -> bool:
    """True when Triton runs through its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def ensure_allocator(device: torch.device) -> None:
    """A scratch allocator (in-kernel TMA descriptors) for the calling thread when it has
    none: for kernels launched outside the search context (tests, benchmarks), which
    installs its own around every call."""
    from triton.runtime import _allocation
    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        _allocation._allocator.set(lambda size, align, stream: alloc.empty((size,), torch.int8, device))


def _stream() -> int:
    """The current CUDA stream's raw handle (what Triton's own launch path passes)."""
    return torch._C._cuda_getCurrentRawStream(torch._C._cuda_getDevice())


def descriptor(t: torch.Tensor, shape, strides, block) -> TensorDescriptor:
    """A host TMA descriptor of `t` whose shape, strides, block and alignment the plan has
    checked once: built without TensorDescriptor's per-call validation."""
    d = object.__new__(TensorDescriptor)
    d.base, d.shape, d.strides, d.block_shape, d.padding = t, shape, strides, block, "zero"
    return d


def _hooked() -> bool:
    """A launch hook (profiler) is installed: launches must go through Triton's path.
    (Triton 3.6 keeps an always-present, possibly empty HookChain there.)"""
    h = knobs.runtime.launch_enter_hook
    return h is not None and bool(getattr(h, "calls", True))


def int_width(v) -> int:
    """The type Triton passes a scalar argument as: 0 i32, 1 i64, 2 u64; a tensor (a device
    seed: a pointer) 3, or 4 when its address is not 16-byte aligned (pointers specialise on
    that)."""
    if isinstance(v, torch.Tensor):
        return 3 if v.data_ptr() & 15 == 0 else 4
    return 0 if -2 ** 31 <= v < 2 ** 31 else 1 if -2 ** 63 <= v < 2 ** 63 else 2


def aligned16(*ts) -> int:
    """A bit per argument: its tensor's data pointer is 16-byte aligned (None and
    non-tensors count as aligned). Part of a plan key."""
    bits = 0
    for t in ts:
        bits = (bits << 1) | (not isinstance(t, torch.Tensor) or t.data_ptr() & 15 == 0)
    return bits


def _aligned(ptrs: tuple) -> tuple[bool, ...]:
    return tuple(t.data_ptr() % 16 == 0 for t in ptrs if isinstance(t, torch.Tensor))


def _positional(kernel, n_given: int, options: dict) -> tuple:
    """The values of the kernel parameters after the first `n_given` (constexprs passed as
    keywords, or their defaults), in signature order: the compiled launcher takes every
    parameter positionally."""
    names = kernel.arg_names[n_given:]
    params = kernel.signature.parameters
    out = []
    for n in names:
        if n in options:
            out.append(options[n])
        elif params[n].default is not inspect.Parameter.empty:
            out.append(params[n].default)
        else:
            raise TypeError(f"{kernel.fn.__name__}: no value for parameter {n!r}")
    return tuple(out)


def _direct(c) -> tuple | None:
    """(C launcher, its leading arguments) of compiled kernel `c` when it takes no TMA
    descriptor and no global or profile scratch: Triton's per-launch Python wrapper
    (CudaLauncher.__call__) would only allocate that scratch, ~2-3 us per launch on the
    H200's host. None for another Triton's launcher (then c.run serves)."""
    try:
        run = c.run
        if run.global_scratch_size or run.profile_scratch_size:
            return None
        return run.launch, (c.function, run.launch_cooperative_grid, run.launch_pdl, None, None, c.packed_metadata,
                            None, None, None)
    except AttributeError:
        return None


class _HostTMA:
    """Direct launch of a kernel that takes host TMA descriptors, without Triton's
    per-launch Python wrapper (which walks every argument and encodes each descriptor
    again): the descriptors' CUtensorMaps are cached by (address, shape, strides, block),
    which is all they encode. Built from the compiled launcher's parts; `make` returns
    None where that launcher is not the wrapped kind this knows (then the plain path runs)."""

    __slots__ = ("raw", "function", "head", "meta", "maps", "keyed")

    @classmethod
    def make(cls, c, n_ptrs: int) -> _HostTMA | None:
        try:
            run = c.run
            cv = inspect.getclosurevars(run.launch).nonlocals
            idx, meta = sorted(cv["tensordesc_indices"]), cv["tensordesc_meta"]
            if run.global_scratch_size or run.profile_scratch_size or not idx or idx[-1] >= n_ptrs:
                return None
            self = cls()
            self.raw, self.function = cv["launcher"], c.function
            self.head = (run.launch_cooperative_grid, run.launch_pdl, None, None, c.packed_metadata, None, None, None)
            self.meta = dict(zip(idx, meta))
            self.maps = {}
            self.keyed = {}
            return self
        except Exception:  # noqa: BLE001 - another Triton: the plain path still works
            return None

    def expand(self, i: int, d) -> list:
        key = (d.base.data_ptr(), tuple(d.shape), tuple(d.strides), tuple(d.block_shape), i)
        out = self.maps.get(key)
        if out is None:
            if len(self.maps) >= 256:
                self.maps.clear()
            out = self.maps[key] = _make_tensordesc_arg(d, self.meta[i])
        return out

    def encoded(self, key, descriptors: Callable[[], tuple]) -> tuple:
        """The encoded form of `descriptors()` under the caller's `key` (built when new)."""
        enc = self.keyed.get(key)
        if enc is None:
            if len(self.keyed) >= 256:
                self.keyed.clear()
            enc = self.keyed[key] = self.encode(descriptors())
        return enc

    def encode(self, descs: tuple) -> tuple:
        """The launcher's arguments of the leading descriptor arguments `descs`."""
        args: list = []
        for i, d in enumerate(descs):
            args.extend(self.expand(i, d))
        return tuple(args)

    def __call__(self, grid: tuple, ptrs: tuple, tail: tuple) -> None:
        args: list = []
        for i, p in enumerate(ptrs):
            if i in self.meta:
                args.extend(self.expand(i, p))
            else:
                args.append(p)
        self.raw(grid[0], grid[1], grid[2], _stream(), self.function, *self.head, *args, *tail)

    def run_encoded(self, grid: tuple, encoded: tuple, rest: tuple, tail: tuple) -> None:
        self.raw(grid[0], grid[1], grid[2], _stream(), self.function, *self.head, *encoded, *rest, *tail)


def _make_tensordesc_arg(d, meta) -> list:
    from triton.backends.nvidia.driver import make_tensordesc_arg
    return make_tensordesc_arg(d, meta)


class Launch:
    """kernel[grid](*ptrs, *tail, **options), planned once. `options` holds the launch
    options (num_warps, num_stages) and any constexprs not in the tail."""

    __slots__ = ("kernel", "grid", "tail", "options", "compiled", "align", "fast", "full_tail", "tma", "all_aligned",
                 "counters_at", "direct")

    def __init__(self, kernel, grid: tuple[int, ...], tail: tuple, *, counters_at: int | None = None, **options):
        self.kernel = kernel
        self.grid = tuple(grid) + (1,) * (3 - len(grid))
        # the driver answers a grid beyond CUDA's limits with "invalid argument" at launch;
        # solvers refuse such problems, and a plan that slips through says why here
        over = grid_reasons((axis, getattr(kernel, "__name__", str(kernel)), n) for axis, n in enumerate(self.grid))
        if over:
            raise NotSupportedError("; ".join(over))
        self.tail = tuple(tail)
        self.options = options
        self.compiled = None
        self.align = None
        self.full_tail = None
        self.tma: _HostTMA | None = None
        # (C launcher, its leading arguments) of a compiled kernel that needs no scratch
        self.direct: tuple | None = None
        self.fast = not interpreting()
        self.all_aligned = False
        # tail[counters_at], tail[counters_at + 1]: the dropout seed and offset, which change
        # on every call (`with_counters`); the kernel must not specialise on them
        self.counters_at = counters_at

    def with_counters(self, seed: int, offset: int) -> Launch:
        """This launch with the dropout counters (seed, offset) in its tail: itself when they
        are its own, else a copy that shares the compiled kernel (the kernels list seed and
        offset in `do_not_specialize`; a plan keyed by them re-planned, and took Triton's JIT
        path, on every dropout call). Plans key the counters' kinds (`int_width`): a kernel
        compiled for an i32 seed cannot take a 64-bit one, nor an int a device seed."""
        i = self.counters_at
        if i is None or (self.tail[i] is seed or type(seed) is int and self.tail[i] == seed) \
                and self.tail[i + 1] == offset:
            return self
        new = Launch.__new__(Launch)
        for name in Launch.__slots__:
            setattr(new, name, getattr(self, name))
        new.tail = self.tail[:i] + (seed, offset) + self.tail[i + 2:]
        if self.full_tail is not None:
            new.full_tail = new.tail + self.full_tail[len(self.tail):]
        return new

    def ready(self) -> bool:
        """Launches by address (`run_addresses`, `run_keyed_addresses`) may run: compiled
        with every tensor argument 16-byte aligned, and no launch hook installed."""
        return self.all_aligned and not _hooked()

    def run_addresses(self, *args) -> None:
        """Launch with every pointer argument given as its int address, each 16-byte aligned
        (the caller checked): the C launcher takes an int as the address itself, where for a
        tensor it calls data_ptr() and the driver's cuPointerGetAttribute (one each per
        tensor argument, ~1 us on the H200's host). Only after `ready()`."""
        self._fast(self.compiled, args)

    def run_keyed_addresses(self, key, descriptors: Callable[[], tuple], *rest) -> None:
        """`run_keyed` with `rest`'s pointers given as int addresses, 16-byte aligned (the
        caller checked). Only after `ready()`."""
        tma = self.tma
        tma.run_encoded(self.grid, tma.encoded(key, descriptors), rest, self.full_tail)

    def _fast(self, c, ptrs: tuple):
        g = self.grid
        if self.tma is not None:
            self.tma(g, ptrs, self.full_tail)
        elif self.direct is not None:
            raw, head = self.direct
            raw(g[0], g[1], g[2], _stream(), *head, *ptrs, *self.full_tail)
        else:
            c.run(g[0], g[1], g[2], _stream(), c.function, c.packed_metadata, None, None, None, *ptrs,
                  *self.full_tail)
        return c

    def run_aligned(self, *ptrs):
        """Launch when the caller's plan key already fixes the pointers' 16-byte alignment
        (skips the per-pointer check)."""
        c = self.compiled
        if c is not None and not _hooked():
            return self._fast(c, ptrs)
        return self(*ptrs)

    def run_keyed(self, key, descriptors: Callable[[], tuple], *rest):
        """Launch a kernel whose leading arguments are host TMA descriptors, built by
        `descriptors()` only when `key` is new. `key` must fix everything they encode apart
        from what the plan fixed (the data pointers and strides): then the encoded
        CUtensorMaps are reused and a call costs no descriptor objects (~10-20 us of Python
        for three or four). `rest` are the other per-call arguments (pointers, scalars)."""
        tma = self.tma
        if tma is not None and self.compiled is not None and not _hooked():
            tma.run_encoded(self.grid, tma.encoded(key, descriptors), rest, self.full_tail)
            return self.compiled
        return self(*descriptors(), *rest)

    def __call__(self, *ptrs):
        """Launch; returns the compiled kernel (None under the interpreter)."""
        c = self.compiled
        if c is not None and _aligned(ptrs) == self.align and not _hooked():
            return self._fast(c, ptrs)
        c = self.kernel[self.grid](*ptrs, *self.tail, **self.options)
        if self.fast and c is not None and hasattr(c, "packed_metadata"):
            c.run  # noqa: B018  (loads the module and builds the launcher now)
            if self.full_tail is None:
                self.full_tail = self.tail + _positional(self.kernel, len(ptrs) + len(self.tail), self.options)
            has_desc = any(isinstance(p, DESCRIPTOR_TYPES) for p in ptrs)
            self.tma = _HostTMA.make(c, len(ptrs)) if has_desc else None
            self.direct = None if has_desc else _direct(c)
            self.compiled = c
            self.align = _aligned(ptrs)
            self.all_aligned = all(self.align) and (self.tma is not None or not has_desc)
        return c
