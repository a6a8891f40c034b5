"""What torch users reach beyond plain eager and compiled calls (found by fuzzing the public API):
torch.func transforms and forward-mode AD (clear errors, no silently dropped tangents), meta
tensors (shapes through the ops' fake kernels), environment settings read one by one, a native
library that failed to build (its solvers fall back), a reference-only find record."""
import logging
import os
import subprocess
import sys

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F

import nnprim
from nnprim.conv import cpu_brgemm
from nnprim.errors import SolverUnavailableError
from nnprim.search.modes import Settings

x = torch.randn(2, 4, 8, 8)
w = torch.randn(5, 4, 3, 3)
q = torch.randn(1, 2, 5, 8)
k = torch.randn(1, 2, 7, 8)
v = torch.randn(1, 2, 7, 8)


@pytest.mark.parametrize("call", [
    lambda: torch.func.grad(lambda ww: nnprim.conv_forward(x, ww, padding=1).square().sum())(w),
    lambda: torch.func.jacrev(lambda kk: nnprim.sdpa(q, kk, v))(k),
    lambda: torch.func.jacfwd(lambda xx: nnprim.conv_forward(xx, w, padding=1))(x[:1, :, :3, :3]),
    lambda: torch.func.vmap(lambda xx: nnprim.conv_forward(xx, w, padding=1))(x[:, None].repeat(1, 2, 1, 1, 1)),
], ids=["grad", "jacrev", "jacfwd", "vmap_conv"])
def test_torch_func_transforms_raise(call):
    """jacfwd returned an all-zero Jacobian (the tangent dropped); grad / jacrev / vmap raised
    torch-internal RuntimeErrors."""
    with pytest.raises(nnprim.NotSupportedError, match="torch.func"):
        call()


def test_vmap_of_sdpa_runs():
    out = torch.func.vmap(nnprim.sdpa)(q[None], k[None], v[None])
    torch.testing.assert_close(out[0], F.scaled_dot_product_attention(q, k, v), rtol=1e-5, atol=1e-5)


def test_forward_mode_ad_raises():
    with fwAD.dual_level():
        with pytest.raises(nnprim.NotSupportedError, match="forward-mode AD"):
            nnprim.conv_forward(fwAD.make_dual(x, torch.randn_like(x)), w, padding=1)
        with pytest.raises(nnprim.NotSupportedError, match="forward-mode AD"):
            nnprim.sdpa(fwAD.make_dual(q, torch.randn_like(q)), k, v)
        y = nnprim.conv_forward(x, w, padding=1)          # no tangent: served
        torch.testing.assert_close(y, F.conv2d(x, w, padding=1), rtol=1e-4, atol=1e-4)


def test_meta_tensors_through_the_public_calls():
    xm, wm = x.to("meta"), w.to("meta")
    assert nnprim.conv_forward(xm, wm, padding=1).shape == (2, 5, 8, 8)
    assert nnprim.conv_backward_data(torch.empty(2, 5, 8, 8, device="meta"), wm, (2, 4, 8, 8), padding=1).shape \
        == (2, 4, 8, 8)
    assert nnprim.sdpa(q.to("meta"), k.to("meta"), v.to("meta")).shape == (1, 2, 5, 8)
    assert nnprim.nn.Conv2d(4, 5, 3, device="meta")(xm).shape == (2, 5, 6, 6)
    assert nnprim.nn.Attention(8, 2, device="meta")(torch.empty(2, 6, 8, device="meta")).shape == (2, 6, 8)


def test_environment_settings_read_one_by_one(caplog):
    """A typo in one variable dropped every other setting (determinism, strictness among them)."""
    s = Settings()
    with caplog.at_level(logging.WARNING, logger="nnprim"):
        s._load({"NNPRIM_FIND_MODE": "hybird", "NNPRIM_DETERMINISTIC": "1", "NNPRIM_STRICT": "enabled",
                 "NNPRIM_DISABLE": "winogard,gemm", "NNPRIM_WORKSPACE_LIMIT": "lots"})
    assert (s.find_mode, s.deterministic, s.strict, s.disabled, s.workspace_limit) == \
        ("hybrid", True, True, frozenset({"winogard", "gemm"}), None)
    text = "\n".join(caplog.messages)
    for needle in ("NNPRIM_FIND_MODE", "NNPRIM_STRICT", "winogard", "NNPRIM_WORKSPACE_LIMIT"):
        assert needle in text
    with pytest.raises(nnprim.BadParameterError, match="no_such_family"):
        nnprim.disable_families("no_such_family")
    with pytest.raises(nnprim.BadParameterError, match="NNPRIM_FIND_MODE"):     # reload: from Python, raises
        Settings().reload({"NNPRIM_FIND_MODE": "hybird"})


def test_a_native_library_that_failed_to_build(monkeypatch):
    """Its solvers were applicable and raised AttributeError from inside (ops() None)."""
    monkeypatch.setattr(cpu_brgemm.LIBRARY, "ops", lambda: None)
    xb, wb = torch.randn(1, 32, 6, 6), torch.randn(32, 32, 3, 3)
    with pytest.raises(SolverUnavailableError, match="native CPU convolution"):
        nnprim.conv_forward(xb, wb, padding=1, solver="cpu_brgemm_fwd")


def test_a_reference_only_record_does_not_win(tmp_path):
    """find(workspace_limit=0) records only the float64 reference; a later process's default
    call timed the other solvers and still ran the reference (it timed fastest on a tiny problem)."""
    common = ("import torch, nnprim; x = torch.randn(1, 8, 9, 9); w = torch.randn(8, 8, 3, 3); "
              "p = nnprim.ConvProblem.from_tensors(x, w, direction='fwd', padding=1); ")
    env = {kk: vv for kk, vv in os.environ.items() if kk != "TRITON_INTERPRET"}     # CPU solvers only
    env.update(NNPRIM_CACHE_DIR=str(tmp_path), NNPRIM_STRICT="1")
    steps = ["print([r.solver for r in nnprim.find(p, workspace_limit=0)])",
             "from nnprim.search.context import context; nnprim.conv_forward(x, w, padding=1); "
             "print([b.solver.family for b in context('cpu').chosen.values()])"]
    outs = [subprocess.run([sys.executable, "-c", common + step], env=env, capture_output=True, text=True,
                           timeout=240) for step in steps]
    assert outs[0].returncode == 0 and "ConvReference" in outs[0].stdout, outs[0].stderr
    assert outs[1].returncode == 0, outs[1].stderr
    assert "reference" not in outs[1].stdout
