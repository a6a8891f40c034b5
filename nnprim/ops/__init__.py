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
import torch.autograd.forward_ad as _forward_ad
from torch.library import Library

from ..errors import NotSupportedError

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
        if t is not None and (type(t) not in _PLAIN or t.is_meta):   # meta: the op's fake kernel
            return False
    return True


def forward_ad_level() -> int:
    """The innermost torch.autograd.forward_ad level (-1: none entered)."""
    return _forward_ad._current_level


def check_transforms(name: str, *tensors, vmap_ok: bool = False) -> None:
    """NotSupportedError for what nnprim's ops cannot serve: torch.func's grad / jacrev / jvp /
    jacfwd / hessian (the ops' autograd is torch.autograd's; under jvp the tangent was dropped
    and jacfwd returned zeros), vmap where the op has no batching (vmap_ok: torch's per-sample
    fallback serves it), and forward-mode AD on dual tensors (no JVP rule). Not while compiling
    (the compiler traces the ops themselves)."""
    if torch.compiler.is_compiling():
        return
    if transforms_active():
        from torch._C._functorch import TransformType
        from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters
        keys = {i.key() for i in retrieve_all_functorch_interpreters()}
        bad = [k.name for k in (TransformType.Grad, TransformType.Jvp) if k in keys]
        if TransformType.Vmap in keys and not vmap_ok:
            bad.append("Vmap")
        if bad:
            raise NotSupportedError(f"{name} under torch.func transforms ({', '.join(bad)}) is not supported: use "
                                    "torch.autograd (loss.backward(), torch.autograd.grad) for gradients, and "
                                    "batched calls for vmap")
    if forward_ad_level() >= 0:
        for t in tensors:
            if isinstance(t, torch.Tensor) and _forward_ad.unpack_dual(t).tangent is not None:
                raise NotSupportedError(f"{name}: forward-mode AD (dual tensors) is not supported; use "
                                        "reverse mode (torch.autograd)")


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def c_apply(fn: type[torch.autograd.Function]):
    """fn's apply in C++, without autograd.Function.apply's Python wrapper (2-4 us of a tiny
    call: a closure, the setup_context check, a generator over the arguments). Callers pass
    their tensor arguments through `unwrap` (what the wrapper does outside functorch
    transforms) and take `fn.apply` itself when `transforms_active()`."""
    return torch._C._FunctionBase.__dict__["apply"].__get__(None, fn)


from . import attention, conv  # noqa: E402,F401  (define and register the ops)
