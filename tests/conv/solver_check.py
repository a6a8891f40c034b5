"""Shared check for the GPU conv solver families' tests: run one direction's launcher on
random tensors into a NaN-poisoned output and compare with the float64 reference; and the
NaN poisoning of the CPU solver modules' outputs and workspace (`poison_cpu`)."""
import contextlib

import torch

from nnprim.args import ConvArgs
from nnprim.conv import reference as ref
from nnprim.problems.conv import ConvProblem, empty_in_layout, to_layout

TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}


def case_id(c) -> str:
    """Test id of a (x shape, w shape, options) case."""
    return f"x{'x'.join(map(str, c[0]))}-w{'x'.join(map(str, c[1]))}-" + \
        "-".join(f"{k}{v}" for k, v in c[2].items()).replace(" ", "")


def check(run: dict, p: ConvProblem, bias=None, post_ops=(), seed: int = 1) -> None:
    """`run[direction](p, args, out=...)` agrees with float64 and writes every element."""
    g = torch.Generator().manual_seed(seed)
    mk = lambda s: to_layout(torch.randn(s, generator=g).to(p.dtype), p.layout)  # noqa: E731
    x, w, dy = mk(p.x_shape), mk(p.w_shape), mk(p.y_shape)
    shape = {"fwd": p.y_shape, "bwd_data": p.x_shape, "bwd_weights": p.w_shape}[p.direction]
    out = empty_in_layout(shape, p.layout, dtype=p.out_dtype).fill_(float("nan"))
    out = run[p.direction](p, ConvArgs(x=x, w=w, dy=dy, bias=bias, post_ops=post_ops), out=out)
    exp = {"fwd": lambda: ref.conv_fwd_f64(p, x, w, bias, post_ops),
           "bwd_data": lambda: ref.conv_bwd_data_f64(p, dy, w),
           "bwd_weights": lambda: ref.conv_bwd_weights_f64(p, dy, x)}[p.direction]()
    assert not torch.isnan(out).any(), "unwritten (poisoned) elements remain"
    err = ((out.double() - exp).norm() / exp.norm()).item()
    assert err < TOL[p.dtype], err


def check_depthwise_bf16(run: dict, direction: str) -> None:
    """A depthwise runner on a bf16 problem (40 channels, padding 1) against float64."""
    check(run, ConvProblem.create(direction, (2, 40, 6, 9), (40, 1, 3, 3), dtype=torch.bfloat16, layout="nhwc",
                                  padding=1, groups=40))


def check_depthwise_fused(run: dict) -> None:
    """A depthwise forward runner with bias, a residual sum and ReLU fused, against float64."""
    from nnprim.post_ops import Eltwise, Sum
    p = ConvProblem.create("fwd", (2, 20, 7, 6), (20, 1, 3, 3), dtype=torch.float32, layout="nhwc", padding=1,
                           groups=20, has_bias=True, post_ops=(("sum", 0.5), ("eltwise", "relu", 0.0, 0.0)))
    resid = to_layout(torch.randn(p.y_shape), "nhwc")
    check(run, p, bias=torch.randn(20), post_ops=(Sum(resid, 0.5), Eltwise("relu")))


def check_result(p: ConvProblem, out: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    """A solver's output for p against its float64 reference: shape, dtype, no unwritten (NaN
    poisoned) element, relative norm error below tol."""
    shape = {"fwd": p.y_shape, "bwd_data": p.x_shape, "bwd_weights": p.w_shape}[p.direction]
    assert tuple(out.shape) == tuple(shape) and out.dtype == p.out_dtype
    assert not out.isnan().any(), "unwritten (NaN) elements"
    err = ((out.double() - ref).norm() / ref.norm()).item()
    assert err < tol, err


def random_case(direction, x_shape, w_shape, *, layout="nchw", dtype=torch.float32, out_dtype=None,
                bias=False, post_ops=(), seed=0, **kw) -> tuple[ConvProblem, ConvArgs]:
    """A problem and random never-zero operands for it (|t| < 0.05 replaced by 0.3), in layout."""
    p = ConvProblem.create(direction, x_shape, w_shape, dtype=dtype, layout=layout,
                           out_dtype=out_dtype, has_bias=bias,
                           post_ops=tuple(o.signature() for o in post_ops), **kw)
    g = torch.Generator().manual_seed(seed)

    def rnd(shape):
        t = torch.randn(shape, generator=g)
        t = torch.where(t.abs() < 0.05, torch.full_like(t, 0.3), t)
        return to_layout(t.to(dtype), layout)

    args = ConvArgs(x=rnd(p.x_shape), w=rnd(p.w_shape), dy=rnd(p.y_shape),
                    bias=torch.randn(p.K, generator=g) if bias else None, post_ops=tuple(post_ops))
    return p, args


def poison_cpu(monkeypatch, module) -> list[int]:
    """NaN-filled outputs (`module.empty_in_layout`) and workspace (`module.workspace`: 0xFF
    bytes, NaN in f32, bf16 and f16) for a CPU solver module; the workspace sizes asked."""
    sizes: list[int] = []

    def empty(shape, layout, **kw):
        return empty_in_layout(shape, layout, **kw).fill_(float("nan"))

    @contextlib.contextmanager
    def ws(nbytes):
        sizes.append(nbytes)
        yield torch.full((nbytes,), 255, dtype=torch.uint8)

    monkeypatch.setattr(module, "empty_in_layout", empty)
    monkeypatch.setattr(module, "workspace", ws)
    return sizes
