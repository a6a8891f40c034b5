"""Winograd backward weights' numerics emulated in torch (CPU): dW = G^T [sum over tiles of
(A dY A^T) (.) (B^T x B)] G with the transformed operands rounded to TF32 (10 mantissa bits, as
solvers 56/57's GEMM takes them) or kept in f32, f32 accumulation, the result rounded to the
input dtype; relative norm error against the float64 weight gradient, N 2, C = K = 16, 56 x 56.
2026-12-02: F(4) on f16 inputs 3.0e-3 with TF32 operands (2.1e-4 from the output rounding
alone), F(2) 5.1e-4; bf16 3.5e-3 / 1.6e-3. The H200 kernel measured 2.3e-2 (f16) and > 2e-2
(bf16, find's check), well past this ideal: winograd_f4_bwd_weights is f32 only.

    python benchmarks/diag/winograd_wgrad_numerics.py
"""
import torch

from nnprim.conv.winograd_math import F23, F43, matrix

torch.manual_seed(0)
def tf32(t):
    i = t.float().contiguous().view(torch.int32)
    i = (i + 0x1000) & ~0x1FFF
    return i.view(torch.float32)
def run(T, N=2, C=16, K=16, H=56, W=56, dt=torch.float16, round_ops=True):
    m, a = T.m, T.alpha
    BT, G, AT = matrix(T.BT), matrix(T.G), matrix(T.AT)
    x = torch.randn(N, C, H, W).to(dt).double()
    dy = torch.randn(N, K, H, W).to(dt).double()
    xp = torch.nn.functional.pad(x, (1, 1 + (-W) % m, 1, 1 + (-H) % m))
    dyp = torch.nn.functional.pad(dy, (0, (-W) % m, 0, (-H) % m))
    # tiles
    d = xp.unfold(2, a, m).unfold(3, a, m)             # N, C, th, tw, a, a
    g = dyp.unfold(2, m, m).unfold(3, m, m)            # N, K, th, tw, m, m
    V = torch.einsum('ip,nctupq,jq->nctuij', BT, d, BT)   # B^T d B
    Y = torch.einsum('pi,nktupq,qj->nktuij', AT, g, AT)   # A dY A^T  (a x a)
    V32, Y32 = V.float(), Y.float()
    if round_ops:
        V32, Y32 = tf32(V32), tf32(Y32)
    dU = torch.einsum('nktuij,nctuij->kcij', Y32, V32)   # f32 accumulate
    dW = torch.einsum('pi,kcpq,qj->kcij', G.float(), dU, G.float()).double()   # G^T dU G (3x3)
    ref = torch.nn.grad.conv2d_weight(x, (K, C, 3, 3), dy, padding=1)
    dWo = dW.to(dt).double()
    return float((dWo - ref).norm() / ref.norm()), float((ref.to(dt).double() - ref).norm() / ref.norm())
for name, T in (("F(2)", F23), ("F(4)", F43)):
    for dt in (torch.float16, torch.bfloat16):
        e, e_out = run(T, dt=dt)
        e_exact, _ = run(T, dt=dt, round_ops=False)
        print(name, dt, f"tf32 operands {e:.2e}  f32 operands {e_exact:.2e}  output rounding alone {e_out:.2e}")
