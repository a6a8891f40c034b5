"""nnprim.launch: the keyed TMA launch encodes descriptors once per key and falls back to
the plain path before the first compile and under a launch hook (no GPU needed: the
compiled kernel and its TMA launcher are stand-ins)."""
from nnprim import launch as L


class _FakeTMA:
    encoded = L._HostTMA.encoded      # the real key cache over a stand-in encoder

    def __init__(self):
        self.keyed: dict = {}
        self.encodes: list = []
        self.runs: list = []

    def encode(self, descs):
        self.encodes.append(descs)
        return tuple(f"enc:{d}" for d in descs)

    def run_encoded(self, grid, enc, rest, tail):
        self.runs.append((grid, enc, rest, tail))


def _planned(monkeypatch):
    ln = L.Launch.__new__(L.Launch)
    ln.grid, ln.full_tail, ln.compiled, ln.tma = (4, 1, 1), ("t",), object(), _FakeTMA()
    plain = []
    monkeypatch.setattr(L.Launch, "__call__", lambda self, *a: plain.append(a) or self.compiled)
    monkeypatch.setattr(L, "_hooked", lambda: False)
    return ln, plain


def test_run_keyed_encodes_once_per_key(monkeypatch):
    ln, plain = _planned(monkeypatch)
    built = []

    def descs(tag):
        return lambda: built.append(tag) or (f"{tag}q", f"{tag}k")

    ln.run_keyed((1, 2), descs("a"), "lse", 3)
    ln.run_keyed((1, 2), descs("b"), "lse", 4)   # same key: not rebuilt
    ln.run_keyed((5, 2), descs("c"), "lse", 5)
    assert built == ["a", "c"] and not plain
    assert [r[1] for r in ln.tma.runs] == [("enc:aq", "enc:ak")] * 2 + [("enc:cq", "enc:ck")]
    assert [r[2] for r in ln.tma.runs] == [("lse", 3), ("lse", 4), ("lse", 5)]
    assert all(r[0] == (4, 1, 1) and r[3] == ("t",) for r in ln.tma.runs)


def test_run_keyed_plain_path_before_compile_and_when_hooked(monkeypatch):
    ln, plain = _planned(monkeypatch)
    ln.compiled = None
    ln.run_keyed((1,), lambda: ("d",), "x")
    assert plain == [("d", "x")] and not ln.tma.runs
    ln.compiled = object()
    monkeypatch.setattr(L, "_hooked", lambda: True)   # a profiler's launch hook sees every launch
    ln.run_keyed((1,), lambda: ("e",), "y")
    assert plain[-1] == ("e", "y") and not ln.tma.runs


def test_launches_by_address_only_when_ready(monkeypatch):
    """run_addresses / run_keyed_addresses: only after a compile with every tensor argument
    16-byte aligned and without a launch hook; addresses go to the launcher as given."""
    ln, _ = _planned(monkeypatch)
    fast = []
    monkeypatch.setattr(L.Launch, "_fast", lambda self, c, ptrs: fast.append(ptrs))
    ln.all_aligned = False
    assert not ln.ready()
    ln.all_aligned = True
    assert ln.ready()
    ln.run_addresses(4096, 8192, 3)
    assert fast == [(4096, 8192, 3)]
    ln.run_keyed_addresses((7,), lambda: ("q",), 4096, 5)
    ln.run_keyed_addresses((7,), lambda: ("r",), 8192, 6)      # same key: the encoded form is reused
    assert ln.tma.encodes == [("q",)] and [r[1:3] for r in ln.tma.runs] == [(("enc:q",), (4096, 5)),
                                                                            (("enc:q",), (8192, 6))]
    monkeypatch.setattr(L, "_hooked", lambda: True)
    assert not ln.ready()


class _Run:
    """A stand-in for Triton's CudaLauncher: its C launcher and scratch sizes."""

    def __init__(self, scratch: int = 0):
        self.global_scratch_size, self.profile_scratch_size = scratch, 0
        self.launch_cooperative_grid, self.launch_pdl = False, True
        self.calls: list = []
        self.launch = lambda *a: self.calls.append(("raw", a))

    def __call__(self, *a):
        self.calls.append(("wrapper", a))


class _Compiled:
    def __init__(self, scratch: int = 0):
        self.run, self.function, self.packed_metadata = _Run(scratch), "fn", "meta"


def test_direct_launch_skips_the_wrapper_only_without_scratch(monkeypatch):
    """A planned kernel that needs no scratch goes to the C launcher with the arguments
    Triton's wrapper would give it; one with global scratch keeps the wrapper (which
    allocates that scratch per launch)."""
    monkeypatch.setattr(L, "_stream", lambda: 7)
    for scratch, kind in ((0, "raw"), (256, "wrapper")):
        c = _Compiled(scratch)
        ln = L.Launch.__new__(L.Launch)
        ln.grid, ln.full_tail, ln.tma, ln.direct = (4, 2, 1), ("t", 3), None, L._direct(c)
        ln._fast(c, (1024, 2048))
        (got, args), = c.run.calls
        assert got == kind
        if kind == "raw":
            assert args == (4, 2, 1, 7, "fn", False, True, None, None, "meta", None, None, None, 1024, 2048, "t", 3)
        else:
            assert args == (4, 2, 1, 7, "fn", "meta", None, None, None, 1024, 2048, "t", 3)
    assert L._direct(object()) is None       # another Triton's launcher: the wrapper path
