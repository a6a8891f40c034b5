"""nnprim's primitives as torch.library custom ops (namespace `nnprim`).

Three layers per primitive (as FlashAttention's interface does): the op with a real
implementation (the per-device search context runs the chosen solver) and a fake one
(shapes, strides and dtypes only, for torch.compile / FakeTensor tracing), autograd
registered on the op (its backward calls the backward ops), and the public function in
`nnprim.api` that normalises Python arguments into the op's schema. The compiler sees
opaque ops with known outputs; solver choice happens when an op runs, never while
tracing."""
from torch.library import Library

LIB = Library("nnprim", "DEF")

from . import attention, conv  # noqa: E402,F401  (define and register the ops)
