// Direct grouped convolution for narrow groups in f32 on AVX-512 (nnprim/conv/cpu_group_direct.py):
// an output row block of 8 channels x 32 positions (16 zmm accumulators) takes every channel and
// tap of its group from the NCHW planes, with the padding as masked loads. Built by nnprim/native.py.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>
#include <algorithm>
#include <cstdint>

namespace {
constexpr int KB = 8;     // output channels per register block (the packed weights' last dim)

inline __mmask16 lanes(int64_t lo, int64_t hi) {   // lanes i with lo <= i < hi (clamped to 0..16)
  lo = std::max<int64_t>(lo, 0);
  hi = std::min<int64_t>(hi, 16);
  if (hi <= lo) return 0;
  return (__mmask16)((((uint32_t)1 << hi) - 1) & ~(((uint32_t)1 << lo) - 1));
}

// acc[j][v] = bias + sum over c < Cg, taps (kh, kw) of w[kb*8 + j, c, kh, kw] * x[c, ih, ow0 + v*16 + lane + kw*dw - pw].
// The taps whose input row exists are listed first (x offset, weight offset, lane masks), so the
// channel loop runs one flat tap loop; every loop touching acc has constant bounds, so GCC keeps
// the 8 x NV accumulators in registers (otherwise: a stack store per accumulator per tap).
template <int NV>
inline void block(const float* x, const float* wb, const float* bias, float* y, int64_t Cg, int64_t H, int64_t W,
                  int64_t KH, int64_t KW, int64_t oh, int64_t ow0, int64_t OH, int64_t OW, int64_t ph, int64_t pw,
                  int64_t dh, int64_t dw, int64_t nk) {
  constexpr int MAXT = 64;
  int64_t xo[MAXT], wo[MAXT];
  __mmask16 mk[MAXT][NV];
  int nt = 0;
  for (int64_t kh = 0; kh < KH; ++kh) {
    const int64_t ih = oh + kh * dh - ph;
    if (ih < 0 || ih >= H) continue;
    for (int64_t kw = 0; kw < KW; ++kw) {
      xo[nt] = ih * W + ow0 + kw * dw - pw;
      wo[nt] = (kh * KW + kw) * KB;
      for (int v = 0; v < NV; ++v) {
        const int64_t base = ow0 + v * 16 + kw * dw - pw;
        mk[nt][v] = lanes(-base, W - base);
      }
      ++nt;
    }
  }
  __m512 acc[KB][NV];
#pragma GCC unroll 8
  for (int j = 0; j < KB; ++j)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[j][v] = _mm512_set1_ps(bias != nullptr && j < nk ? bias[j] : 0.f);
  const int64_t plane = H * W, wstride = KH * KW * KB;
  for (int64_t c = 0; c < Cg; ++c) {
    const float* xp = x + c * plane;
    const float* wc = wb + c * wstride;
    for (int t = 0; t < nt; ++t) {
      __m512 xv[NV];
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) xv[v] = _mm512_maskz_loadu_ps(mk[t][v], xp + xo[t] + v * 16);
      const float* wt = wc + wo[t];
#pragma GCC unroll 8
      for (int j = 0; j < KB; ++j) {
        const __m512 b = _mm512_set1_ps(wt[j]);
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) acc[j][v] = _mm512_fmadd_ps(b, xv[v], acc[j][v]);
      }
    }
  }
  const int64_t n_out = OW - ow0;
#pragma GCC unroll 8
  for (int j = 0; j < KB; ++j) {      // constant bounds: a runtime j < nk bound put acc on the stack
    if (j >= nk) break;
    float* yr = y + j * OH * OW + oh * OW + ow0;
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) _mm512_mask_storeu_ps(yr + v * 16, lanes(0, n_out - v * 16), acc[j][v]);
  }
}

// x (N, C, H, W) f32 contiguous; wp (G, ceil(Kg/8), Cg, KH, KW, 8) f32 (zero rows past Kg);
// y (N, K, OH, OW) f32 contiguous, every element written; stride 1.
void group_direct_fwd(const at::Tensor& x, const at::Tensor& wp, const c10::optional<at::Tensor>& bias,
                      at::Tensor& y, int64_t G, int64_t Cg, int64_t Kg, at::IntArrayRef pad, at::IntArrayRef dil) {
  TORCH_CHECK(x.is_contiguous() && wp.is_contiguous() && y.is_contiguous(), "group_direct_fwd: contiguous operands");
  TORCH_CHECK(x.scalar_type() == at::kFloat && wp.scalar_type() == at::kFloat && y.scalar_type() == at::kFloat,
              "group_direct_fwd: f32 operands");
  TORCH_CHECK(wp.size(3) * wp.size(4) <= 64, "group_direct_fwd: at most 64 taps");
  const int64_t N = x.size(0), C = x.size(1), H = x.size(2), W = x.size(3);
  const int64_t K = y.size(1), OH = y.size(2), OW = y.size(3);
  const int64_t KH = wp.size(3), KW = wp.size(4), nkb = wp.size(1);
  const float* xd = x.data_ptr<float>();
  const float* wd = wp.data_ptr<float>();
  const float* bd = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* yd = y.data_ptr<float>();
  const int64_t ph = pad[0], pw = pad[1], dh = dil[0], dw = dil[1];
  at::parallel_for(0, N * G * OH, 1, [&](int64_t begin, int64_t end) {
    for (int64_t it = begin; it < end; ++it) {
      const int64_t oh = it % OH, g = (it / OH) % G, n = it / (OH * G);
      const float* xg = xd + (n * C + g * Cg) * H * W;
      for (int64_t kb = 0; kb < nkb; ++kb) {
        const int64_t k0 = g * Kg + kb * KB, nk = std::min<int64_t>(KB, Kg - kb * KB);
        const float* wb = wd + (g * nkb + kb) * Cg * KH * KW * KB;
        const float* bb = bd != nullptr ? bd + k0 : nullptr;
        float* yb = yd + (n * K + k0) * OH * OW;
        for (int64_t ow0 = 0; ow0 < OW; ow0 += 32) {
          if (OW - ow0 > 16)
            block<2>(xg, wb, bb, yb, Cg, H, W, KH, KW, oh, ow0, OH, OW, ph, pw, dh, dw, nk);
          else
            block<1>(xg, wb, bb, yb, Cg, H, W, KH, KW, oh, ow0, OH, OW, ph, pw, dh, dw, nk);
        }
      }
    }
  });
}
}  // namespace

TORCH_LIBRARY(nnprim_cpu_group, m) {
  m.def("group_direct_fwd(Tensor x, Tensor wp, Tensor? bias, Tensor(a!) y, int G, int Cg, int Kg, int[] pad, "
        "int[] dil) -> ()");
}

TORCH_LIBRARY_IMPL(nnprim_cpu_group, CPU, m) {
  m.impl("group_direct_fwd", group_direct_fwd);
}
