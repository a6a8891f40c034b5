"""nnprim.alloc.empty: torch.empty's shape, strides, dtype and device, without the fill that
torch's deterministic mode adds (the invokers write every element they allocate)."""
from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.profiler import ProfilerActivity, profile

from nnprim import alloc


@pytest.fixture(params=[False, True], ids=["default", "deterministic"])
def mode(request):
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(request.param)
    yield request.param
    torch.use_deterministic_algorithms(before)


@pytest.mark.parametrize("shape,strides", [((3, 5, 7), None), ((2, 0, 4), None), ((), None),
                                           ((4, 6, 5), (30, 1, 6)), ((2, 3), (1, 2))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_matches_torch_empty(mode, shape, strides, dtype):
    t = alloc.empty(shape, dtype, "cpu", strides)
    ref = torch.empty(shape, dtype=dtype) if strides is None else torch.empty_strided(shape, strides, dtype=dtype)
    assert t.shape == ref.shape and t.stride() == ref.stride() and t.dtype == dtype
    assert t.untyped_storage().nbytes() >= ref.untyped_storage().nbytes()
    t.fill_(3)   # every element writable, none aliased by another
    assert (t == 3).all() and t.double().sum().item() == 3 * t.numel()


def _filled_shapes(fn) -> list:
    """Input shapes of the fill ops fn runs (the empty tensor that alloc.empty sets its storage
    into is filled too, with no element to write)."""
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    return [e.input_shapes[0] for e in prof.events() if "fill" in e.name and e.input_shapes
            and e.input_shapes[0] not in ([0], [])]


def test_no_fill_in_deterministic_mode(mode):
    assert not _filled_shapes(lambda: alloc.empty((64, 64), torch.float32, "cpu"))
    # torch's own empty fills here: what alloc.empty avoids
    assert bool(_filled_shapes(lambda: torch.empty((64, 64)))) == mode


def test_fake_and_meta_tensors(mode):
    """Under FakeTensorMode (the ops' fake impls under torch.compile) and on the meta device:
    torch.empty's tensors, no storage set."""
    with FakeTensorMode():
        t = alloc.empty((3, 4), torch.bfloat16, "cpu", (1, 3))
        assert isinstance(t, FakeTensor) and t.shape == (3, 4) and t.stride() == (1, 3)
    m = alloc.empty((5, 2), torch.float32, "meta")
    assert m.is_meta and m.shape == (5, 2)
