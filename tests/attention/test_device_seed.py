"""A device seed (nnprim.dropout): `seed` as a one-element int64 tensor on q's device drops
exactly the positions of the same int seed, in every solver family (the Triton kernels load
it: TRITON_INTERPRET=1 here, compiled in tests/gpu), forward and backward through autograd;
bad seeds are refused by name; the dispatcher's op takes one as `seed_tensor`."""
from __future__ import annotations

import pytest
import torch

import nnprim

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

SEED = 2 ** 40 + 12345


def _qkv(Sq=19, Sk=23, D=16, grad=False):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, Sq, D, generator=g)
    k = torch.randn(2, 2, Sk, D, generator=g)
    v = torch.randn(2, 2, Sk, D, generator=g)
    return [t.requires_grad_(grad) for t in (q, k, v)]


@pytest.mark.parametrize("solver,Sq", [(None, 19), ("flash_fwd", 19), ("decode_split_k", 2)])
def test_forward_same_mask_as_the_int_seed(solver, Sq):
    q, k, v = _qkv(Sq)
    dev_seed = torch.tensor([SEED])
    a = nnprim.sdpa(q, k, v, dropout_p=0.4, seed=SEED, offset=3, solver=solver)
    b = nnprim.sdpa(q, k, v, dropout_p=0.4, seed=dev_seed, offset=3, solver=solver)
    assert torch.equal(a, b)
    c = nnprim.sdpa(q, k, v, dropout_p=0.4, seed=torch.tensor([SEED + 1]), offset=3, solver=solver)
    assert not torch.equal(a, c)


@pytest.mark.parametrize("bwd", [None, "flash_bwd", "flash_bwd_atomic"])
def test_autograd_same_grads_as_the_int_seed(bwd):
    grads = []
    for seed in (SEED, torch.tensor(SEED).reshape(1)):
        q, k, v = _qkv(grad=True)
        o = nnprim.sdpa(q, k, v, dropout_p=0.3, seed=seed, causal="top_left")
        if bwd is None:
            o.sum().backward()
            grads.append((o.detach(), q.grad, k.grad, v.grad))
        else:
            o, lse = nnprim.sdpa(q, k, v, dropout_p=0.3, seed=seed, causal="top_left", return_lse=True)
            do = torch.ones_like(o)
            grads.append((o.detach(), *nnprim.sdpa_backward(do, q.detach(), k.detach(), v.detach(), o.detach(), lse,
                                                            dropout_p=0.3, seed=seed, causal="top_left",
                                                            solver=bwd)))
    for a, b in zip(*grads):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-6)


def test_bad_device_seeds_are_refused_by_name():
    q, k, v = _qkv()
    for bad in (torch.tensor([1.0]), torch.tensor([1, 2]), torch.tensor([1], dtype=torch.int32)):
        with pytest.raises(nnprim.BadParameterError, match="seed"):
            nnprim.sdpa(q, k, v, dropout_p=0.1, seed=bad)


def test_the_dispatcher_op_takes_a_device_seed():
    """The op (torch.compile, tensor subclasses) takes it as `seed_tensor`, forward and backward."""
    q, k, v = _qkv()
    seed = torch.tensor([SEED])
    want = nnprim.sdpa(q, k, v, dropout_p=0.3, seed=SEED)
    o, lse = torch.ops.nnprim.sdpa_forward(q, k, v, None, None, None, None, "", "", None, None, None, "", None,
                                           False, 0.3, 0, 0, False, True, None, seed_tensor=seed)
    assert torch.equal(o, want)
    do = torch.randn_like(o)
    got = torch.ops.nnprim.sdpa_backward(do, q, k, v, o, lse, None, None, None, "", None, False, 0.3, 0, 0,
                                         False, None, seed_tensor=seed)
    ref = nnprim.sdpa_backward(do, q, k, v, o, lse, dropout_p=0.3, seed=SEED)
    for g, r in zip(got, ref):
        assert torch.equal(g, r)
    qg = q.clone().requires_grad_()
    compiled = torch.compile(lambda a, s: nnprim.sdpa(a, k, v, dropout_p=0.3, seed=s), backend="eager",
                             fullgraph=True)
    y = compiled(qg, seed)
    assert torch.allclose(y, want, atol=1e-6)
    y.backward(do)
    qr = q.clone().requires_grad_()
    nnprim.sdpa(qr, k, v, dropout_p=0.3, seed=SEED).backward(do)
    assert torch.allclose(qg.grad, qr.grad, atol=1e-6)


def test_a_bad_device_seed_after_a_good_call_is_refused():
    """The call memo skips the problem's checks on a known signature: the seed's are per call."""
    q, k, v = _qkv()
    nnprim.sdpa(q, k, v, dropout_p=0.1, seed=torch.tensor([3]))
    with pytest.raises(nnprim.BadParameterError, match="seed"):
        nnprim.sdpa(q, k, v, dropout_p=0.1, seed=torch.tensor([3], dtype=torch.int32))
    with pytest.raises(nnprim.BadParameterError, match="seed"):
        nnprim.sdpa(q, k, v, dropout_p=0.1, seed=-1)
