"""nnprim's primitives as torch.library custom ops (namespace `nnprim`).

Three layers per primitive (as FlashAttention's interface does): the op with a real
implementation (the per-device search context runs the chosen solver) and a fake one
(shapes, strides and dtypes only, for torch.compile / FakeTensor tracing), autograd
registered on the op (its backward calls the backward ops), and the public function in
`nnprim.api` that normalises Python arguments into the op's schema. The compiler sees
opaque ops with known outputs; solver choice happens when an op runs, never while
tracing. In eager mode the public functions call the same implementations directly
(`eager`), with autograd Functions that share the ops' backward formulas."""
import torch
from torch.library import Library

LIB = Library("nnprim", "DEF")
# the compiler must hand the ops their inputs in the eager strides (a layout is part of a
# convolution problem: inductor would otherwise pass NCHW where the model runs NHWC)
TAGS = (torch.Tag.needs_fixed_stride_order,)
unwrap = torch._C._functorch.unwrap_if_dead
transforms_active = torch._C._are_functorch_transforms_active
tracing_state = torch._C._get_tracing_state     # torch.jit.trace: the op is what it records


def eager(*tensors) -> bool:
    """Whether a public call may run the implementations directly, skipping the dispatcher
    (its Python autograd and redispatch cost ~10 us a call): plain tensors or parameters,
    no compiler tracing and no dispatch mode (FakeTensor, proxies, FlopCounter...)."""
    if (torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() or transforms_active()
            or tracing_state() is not None):
        return False
    for t in tensors:
        if t is not None and type(t) not in _PLAIN:
            return False
    return True


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def c_apply(fn: type[torch.autograd.Function]):
    """fn's apply in C++, without autograd.Function.apply's Python wrapper (2-4 us of a tiny
    call: a closure, the setup_context check, a generator over the arguments). Callers pass
    their tensor arguments through `unwrap` (what the wrapper does outside functorch
    transforms) and take `fn.apply` itself when `transforms_active()`."""
    return torch._C._FunctionBase.__dict__["apply"].__get__(None, fn)


from . import attention, conv  # noqa: E402,F401  (define and register the ops)
