"""fast_exp2: the polynomial path's arithmetic (emulated in float32 step by step, as the PTX
runs it) against exp2 in float64, and the PTX it emits (the GPU tests run it in solver 126)."""
from __future__ import annotations

import numpy as np
import pytest

from nnprim.attention import fast_exp2


def test_polynomial_error_bound():
    rng = np.random.default_rng(0)
    x = np.concatenate([-rng.exponential(6.0, 200_000), -rng.uniform(0, 1, 20_000), [0.0, -0.5, -1.5, -124.9, -125.0],
                        rng.uniform(0, 1e-6, 100)]).astype(np.float32)
    got = fast_exp2.exp2_poly_reference(x).astype(np.float64)
    ref = np.exp2(x.astype(np.float64))
    assert np.all(np.isfinite(got)) and np.all(got > 0)
    assert np.max(np.abs(got / ref - 1.0)) <= fast_exp2.MAX_REL_ERR


def test_below_the_clamp_stays_tiny_and_normal():
    """Under -125 the result is 2^-125-ish (a normal f32), never a wrapped exponent."""
    got = fast_exp2.exp2_poly_reference(np.float32([-125.4, -126.0, -300.0, -1e30]))
    assert np.all(got > 0) and np.all(got < 2.0 ** -124)


@pytest.mark.parametrize("poly", [1, 2, 3])
def test_asm_splits_four_elements(poly):
    asm = fast_exp2.exp2_asm(poly)
    assert asm.count("ex2.approx.ftz.f32") == 4 - poly
    assert asm.count("fma.rn.f32") == 3 * poly
    for i in range(4):   # every output written once, from its own input
        assert asm.count(f"${i}, ") == 1 and f"${i + 4}" in asm
