"""Scaled dot-product attention solvers.

reference.py (ids 100-101, float64 from first principles; also `reference_forward` /
`reference_backward` for tests), masking.py (float64 score bias / visibility shared by
the reference and tests), flash_fwd.py / flash_bwd.py (Triton, ids 110-119), decode.py
(Triton split-K decoding, ids 120-129), configs.py (tile configs). Solver modules are
imported by nnprim._solvers, not here, so importing one module stays cheap."""
