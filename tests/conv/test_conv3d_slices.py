"""3-D backward weights through the 2-D solvers (solver 36, conv3d_slices.py) against the
float64 reference, through TRITON_INTERPRET=1 with the Triton 2-D solver, NaN-poisoned
outputs: depth and H padding (none, same, asymmetric), odd sizes, H dilation, W stride, K != C;
the tall images' geometry; applicability."""
import pytest
import torch

from nnprim.conv import conv3d_slices as cs
from nnprim.problems.conv import ConvProblem
from nnprim.search.solver import REGISTRY

from . import solver_check


def _run(p, a, out):
    return cs.SlicesPlan(p)(a, out)


RUN = {"bwd_weights": _run}
CASES = [
    ((2, 8, 4, 5, 6), (16, 8, 3, 3, 3), dict(padding=1)),
    ((1, 16, 3, 6, 7), (8, 16, 3, 3, 3), dict(padding=0)),
    ((2, 8, 5, 4, 9), (8, 8, 3, 3, 3), dict(padding=((2, 0), (0, 1), (1, 1)), stride=(1, 1, 2))),
    ((1, 8, 4, 7, 5), (16, 8, 2, 3, 1), dict(padding=((1, 0), (2, 2), (0, 0)), dilation=(1, 2, 1))),
    ((3, 16, 2, 3, 3), (16, 16, 1, 1, 1), dict()),
]


@pytest.fixture
def poisoned_empty(monkeypatch):
    """torch.empty returns NaN-filled float tensors: a tall-image element the plan does not
    write (padding slice, separator row) shows in the result."""
    real = torch.empty

    def empty(*a, **kw):
        t = real(*a, **kw)
        return t.fill_(float("nan")) if t.is_floating_point() else t
    monkeypatch.setattr(torch, "empty", empty)


@pytest.mark.parametrize("case", CASES, ids=solver_check.case_id)
def test_bf16_vs_reference(case, poisoned_empty):
    xs, ws, kw = case
    p = ConvProblem.create("bwd_weights", xs, ws, dtype=torch.bfloat16, layout="nhwc", **kw)
    solver_check.check(RUN, p)


def test_tall_geometry_pairs_every_tap():
    """Rows per slice H + sep (sep = the H padding), Dp = D + depth padding slices per image; the
    2-D problem's output rows end past the last real dy row."""
    p = ConvProblem.create("bwd_weights", (8, 64, 16, 56, 56), (128, 64, 3, 3, 3), dtype=torch.bfloat16,
                           layout="nhwc", device="cuda", padding=1)
    g = cs.geometry(p)
    assert (g["sep"], g["R"], g["Dp"], g["S"]) == (1, 57, 18, 144) and g["rows_out"] == g["rows"] == 144 * 57
    t = cs.twin(p)
    assert t.N == 1 and t.in_size == (144 * 57, 56) and t.out_size == (144 * 57, 56) and t.filter == (3, 3)


def test_applicability():
    s = REGISTRY.get("conv3d_via_2d_bwd_weights")
    mk = lambda xs=(2, 16, 4, 8, 8), ws=(16, 16, 3, 3, 3), **kw: ConvProblem.create(  # noqa: E731
        "bwd_weights", xs, ws, device="cuda", **{"dtype": torch.bfloat16, "layout": "nhwc", "padding": 1, **kw})
    # on a machine without a GPU only the device reason may remain for the problems it serves
    ok = [r for r in s.not_supported_reasons(mk()) if "device" not in r and "2-D solver" not in r]
    assert ok == []
    for bad, why in ((mk(layout="nchw"), "NDHWC"), (mk(stride=(2, 1, 1)), "depth stride"),
                     (mk(dilation=(2, 1, 1)), "depth stride"), (mk(stride=(1, 2, 1)), "H stride"),
                     (mk((2, 16, 8, 8), (16, 16, 3, 3)), "3-D"), (mk(groups=2, ws=(16, 8, 3, 3, 3)), "groups")):
        assert any(why in r for r in s.not_supported_reasons(bad)), (why, s.not_supported_reasons(bad))
    p = mk()
    assert s.workspace_size(p) > 2 * (torch.Size(p.x_shape).numel() + torch.Size(p.y_shape).numel())
