// Direct grouped convolution for narrow groups on AVX-512 (nnprim/conv/cpu_group_direct.py): an
// output row block of 8 channels x 32 positions (or 4 x 48, 1 x 64; <= 16 zmm accumulators, f32)
// takes every channel and tap of its group from the NCHW planes, with the padding as masked loads. f32 by FMA; bf16 by
// AVX512-BF16 dot products over channel pairs (x rows c and c+1 interleaved in registers, weights
// packed in pairs), f32 accumulation either way. Groups of 16 / 32 output channels go through the
// channel-vector kernel instead (run_cv: a zmm of output channels per position, x broadcast from a
// zero-padded staged copy). Built by nnprim/native.py.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {
// Output channels per register block (the packed weights' last dim): 8 for groups of >= 8 output
// channels (x 32 positions), 4 (x 48) and 1 (x 64, depthwise) for narrower ones; each keeps <= 16
// accumulators.
constexpr int nv_max(int kb) { return kb == 8 ? 2 : kb == 4 ? 3 : 4; }

inline __mmask16 lanes(int64_t lo, int64_t hi) {   // lanes i with lo <= i < hi (clamped to 0..16)
  lo = std::max<int64_t>(lo, 0);
  hi = std::min<int64_t>(hi, 16);
  if (hi <= lo) return 0;
  return (__mmask16)((((uint32_t)1 << hi) - 1) & ~(((uint32_t)1 << lo) - 1));
}

inline __mmask32 lanes32(int64_t lo, int64_t hi) {   // lanes i with lo <= i < hi (clamped to 0..32)
  lo = std::max<int64_t>(lo, 0);
  hi = std::min<int64_t>(hi, 32);
  if (hi <= lo) return 0;
  return (__mmask32)((((uint64_t)1 << hi) - 1) & ~(((uint64_t)1 << lo) - 1));
}

// Element policies: what a step of the channel loop loads (x type T, weight type WT, channels STEP,
// input positions per output position SW) and how it multiplies.
struct F32 {              // one channel per step, w as f32
  using T = float;
  using WT = float;
  using M = __mmask16;
  static constexpr int STEP = 1, SW = 1;
  static inline M mask(int64_t lo, int64_t hi) { return lanes(lo, hi); }
  static inline __m512 load(const T* r, int64_t, bool, M m) { return _mm512_maskz_loadu_ps(m, r); }
  static inline __m512 bcast(const WT* w) { return _mm512_set1_ps(*w); }
  static inline __m512 madd(__m512 acc, __m512 b, __m512 x) { return _mm512_fmadd_ps(b, x, acc); }
};

struct F32S2 : F32 {      // stride 2 along the row: 32 inputs loaded, the even ones kept
  using M = __mmask32;
  static constexpr int SW = 2;
  static inline M mask(int64_t lo, int64_t hi) { return lanes32(lo, hi); }
  static inline __m512 load(const T* r, int64_t, bool, M m) {
    const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    return _mm512_permutex2var_ps(_mm512_maskz_loadu_ps((__mmask16)m, r), even,
                                  _mm512_maskz_loadu_ps((__mmask16)(m >> 16), r + 16));
  }
};

#if defined(__AVX512BF16__)
#define NNPRIM_DIRECT_BF16 1
struct BF16 {             // a channel pair per step: lanes hold (x[c], x[c+1]) of a position, w (w[c], w[c+1])
  using T = at::BFloat16;
  using WT = int32_t;
  using M = __mmask16;
  static constexpr int STEP = 2, SW = 1;
  static inline M mask(int64_t lo, int64_t hi) { return lanes(lo, hi); }
  static inline __m512 load(const T* r, int64_t plane, bool second, M m) {
    const __m512i lo = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, r));
    const __m512i hi = second ? _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, r + plane)) : _mm512_setzero_si512();
    return _mm512_castsi512_ps(_mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
  }
  static inline __m512 bcast(const WT* w) { return _mm512_castsi512_ps(_mm512_set1_epi32(*w)); }
  static inline __m512 madd(__m512 acc, __m512 b, __m512 x) {
    return _mm512_dpbf16_ps(acc, (__m512bh)x, (__m512bh)b);
  }
};
#endif

// The post-ops the forward applies to each output block while it is in registers (f32 y only), after
// the bias: + res_scale * res (y-shaped, contiguous, f32), then relu with a negative slope.
struct Epi {
  const float* res = nullptr;
  float res_scale = 1.f;
  bool relu = false;
  float slope = 0.f;
  inline __m512 apply(__m512 v, int64_t off, __mmask16 m) const {   // off: the element's index in y
    if (res) v = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, res + off), _mm512_set1_ps(res_scale), v);
    if (relu) v = _mm512_add_ps(_mm512_max_ps(v, _mm512_setzero_ps()),
                                _mm512_mul_ps(_mm512_min_ps(v, _mm512_setzero_ps()), _mm512_set1_ps(slope)));
    return v;
  }
};

template <class Y>
inline void store_row(Y* y, int64_t off, __mmask16 m, __m512 v, const Epi& ep);
template <>
inline void store_row<float>(float* y, int64_t off, __mmask16 m, __m512 v, const Epi& ep) {
  _mm512_mask_storeu_ps(y + off, m, ep.apply(v, off, m));
}
#ifdef NNPRIM_DIRECT_BF16
template <>
inline void store_row<at::BFloat16>(at::BFloat16* y, int64_t off, __mmask16 m, __m512 v, const Epi&) {
  _mm256_mask_storeu_epi16(y + off, m, (__m256i)_mm512_cvtneps_pbh(v));
}
#endif

// acc[j][v] = bias + sum over c < Cg, taps (kh, kw) of w[kb*8 + j, c, kh, kw] * x[c, ih, ow0 + v*16 + lane + kw*dw - pw].
// The filter rows whose input row exists are listed first, so the channel loop runs a flat loop
// over them; KWT > 0 fixes the filter width at compile time (the kw loop unrolled: lane masks in
// mask registers, offsets immediate), 0 takes it at run time. Every loop touching acc has
// constant bounds, so GCC keeps the KB x NV accumulators in registers (a runtime bound put them
// on the stack: a store per accumulator per tap).
template <class E, class Y, int KB, int NV, int KWT>
inline void block(const typename E::T* x, const typename E::WT* wb, const float* bias, Y* y, int64_t Cg, int64_t H,
                  int64_t W, int64_t KH, int64_t KW_, int64_t oh, int64_t ow0, int64_t OH, int64_t OW, int64_t ph,
                  int64_t pw, int64_t dh, int64_t dw, int64_t nk, int64_t sh, int64_t yoff, const Epi& ep) {
  constexpr int MAXR = 64;
  const int64_t KW = KWT > 0 ? KWT : KW_;
  int64_t xo[MAXR], wo[MAXR];
  int nr = 0;
  for (int64_t kh = 0; kh < KH; ++kh) {
    const int64_t ih = oh * sh + kh * dh - ph;
    if (ih < 0 || ih >= H) continue;
    xo[nr] = ih * W + ow0 * E::SW - pw;
    wo[nr] = kh * KW * KB;
    ++nr;
  }
  typename E::M mk[16][NV];   // x lanes inside the row, per kw
  for (int64_t kw = 0; kw < KW; ++kw)
    for (int v = 0; v < NV; ++v) {
      const int64_t base = (ow0 + v * 16) * E::SW + kw * dw - pw;
      mk[kw][v] = E::mask(-base, W - base);
    }
  const int64_t n_out = OW - ow0;
  if (ep.res)   // the residual's rows, fetched while the block computes (as in cv_block)
    for (int64_t j = 0; j < nk; ++j) {
      const float* r = ep.res + yoff + j * OH * OW + oh * OW + ow0;
      const int64_t nw = std::min<int64_t>(n_out, NV * 16);
      for (int64_t q = 0; q < nw; q += 16) _mm_prefetch((const char*)(r + q), _MM_HINT_T0);
      _mm_prefetch((const char*)(r + nw - 1), _MM_HINT_T0);
    }
  __m512 acc[KB][NV];
#pragma GCC unroll 8
  for (int j = 0; j < KB; ++j)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[j][v] = _mm512_set1_ps(bias != nullptr && j < nk ? bias[j] : 0.f);
  const int64_t plane = H * W, wstride = KH * KW * KB;
  for (int64_t c = 0; c < Cg; c += E::STEP) {
    const typename E::T* xp = x + c * plane;
    const typename E::WT* wc = wb + (c / E::STEP) * wstride;
    const bool second = c + 1 < Cg;
    for (int r = 0; r < nr; ++r) {
      const typename E::T* xr = xp + xo[r];
      const typename E::WT* wr = wc + wo[r];
#pragma GCC unroll 8
      for (int64_t kw = 0; kw < KW; ++kw) {
        __m512 xv[NV];
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) xv[v] = E::load(xr + kw * dw + v * 16 * E::SW, plane, second, mk[kw][v]);
        const typename E::WT* wt = wr + kw * KB;
#pragma GCC unroll 8
        for (int j = 0; j < KB; ++j) {
          const __m512 b = E::bcast(wt + j);
#pragma GCC unroll 4
          for (int v = 0; v < NV; ++v) acc[j][v] = E::madd(acc[j][v], b, xv[v]);
        }
      }
    }
  }
#pragma GCC unroll 8
  for (int j = 0; j < KB; ++j) {
    if (j >= nk) break;
    const int64_t yr = yoff + j * OH * OW + oh * OW + ow0;
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) store_row<Y>(y, yr + v * 16, lanes(0, n_out - v * 16), acc[j][v], ep);
  }
}

template <class E, class Y, int KB, int NV>
inline void block_kw(const typename E::T* x, const typename E::WT* wb, const float* bias, Y* y, int64_t Cg, int64_t H,
                     int64_t W, int64_t KH, int64_t KW, int64_t oh, int64_t ow0, int64_t OH, int64_t OW, int64_t ph,
                     int64_t pw, int64_t dh, int64_t dw, int64_t nk, int64_t sh, int64_t yoff, const Epi& ep) {
  switch (KW) {
    case 3: return block<E, Y, KB, NV, 3>(x, wb, bias, y, Cg, H, W, KH, KW, oh, ow0, OH, OW, ph, pw, dh, dw, nk, sh, yoff, ep);
    case 1: return block<E, Y, KB, NV, 1>(x, wb, bias, y, Cg, H, W, KH, KW, oh, ow0, OH, OW, ph, pw, dh, dw, nk, sh, yoff, ep);
    case 5: return block<E, Y, KB, NV, 5>(x, wb, bias, y, Cg, H, W, KH, KW, oh, ow0, OH, OW, ph, pw, dh, dw, nk, sh, yoff, ep);
    case 7: return block<E, Y, KB, NV, 7>(x, wb, bias, y, Cg, H, W, KH, KW, oh, ow0, OH, OW, ph, pw, dh, dw, nk, sh, yoff, ep);
    default: return block<E, Y, KB, NV, 0>(x, wb, bias, y, Cg, H, W, KH, KW, oh, ow0, OH, OW, ph, pw, dh, dw, nk, sh, yoff, ep);
  }
}

template <class E, class Y, int KB>
inline void row_blocks(const typename E::T* xg, const typename E::WT* wb, const float* bb, Y* yb, int64_t Cg,
                       int64_t H, int64_t W, int64_t KH, int64_t KW, int64_t oh, int64_t OH, int64_t OW, int64_t ph,
                       int64_t pw, int64_t dh, int64_t dw, int64_t nk, int64_t sh, int64_t yoff, const Epi& ep) {
  constexpr int NVM = nv_max(KB);
  for (int64_t ow0 = 0; ow0 < OW;) {
    const int64_t nv = std::min<int64_t>(NVM, (OW - ow0 + 15) / 16);
    switch (nv) {
      case 1: block_kw<E, Y, KB, 1>(xg, wb, bb, yb, Cg, H, W, KH, KW, oh, ow0, OH, OW, ph, pw, dh, dw, nk, sh, yoff, ep); break;
      case 2: block_kw<E, Y, KB, (NVM >= 2 ? 2 : 1)>(xg, wb, bb, yb, Cg, H, W, KH, KW, oh, ow0, OH, OW, ph, pw, dh, dw, nk, sh, yoff, ep); break;
      case 3: block_kw<E, Y, KB, (NVM >= 3 ? 3 : 1)>(xg, wb, bb, yb, Cg, H, W, KH, KW, oh, ow0, OH, OW, ph, pw, dh, dw, nk, sh, yoff, ep); break;
      default: block_kw<E, Y, KB, NVM>(xg, wb, bb, yb, Cg, H, W, KH, KW, oh, ow0, OH, OW, ph, pw, dh, dw, nk, sh, yoff, ep); break;
    }
    ow0 += 16 * nv;
  }
}

template <class E, class Y, int KB>
void run(const at::Tensor& x, const at::Tensor& wp, const float* bd, at::Tensor& y, int64_t G, int64_t Cg, int64_t Kg,
         at::IntArrayRef pad, at::IntArrayRef dil, int64_t sh, const Epi& ep) {
  const int64_t N = x.size(0), C = x.size(1), H = x.size(2), W = x.size(3);
  const int64_t K = y.size(1), OH = y.size(2), OW = y.size(3);
  const int64_t KH = wp.size(3), KW = wp.size(4), nkb = wp.size(1), cs = wp.size(2);
  const auto* xd = reinterpret_cast<const typename E::T*>(x.data_ptr());
  const auto* wd = reinterpret_cast<const typename E::WT*>(wp.data_ptr());
  auto* yd = reinterpret_cast<Y*>(y.data_ptr());
  const int64_t ph = pad[0], pw = pad[1], dh = dil[0], dw = dil[1];
  at::parallel_for(0, N * G * OH, 1, [&](int64_t begin, int64_t end) {
    for (int64_t it = begin; it < end; ++it) {
      const int64_t oh = it % OH, g = (it / OH) % G, n = it / (OH * G);
      const auto* xg = xd + (n * C + g * Cg) * H * W;
      for (int64_t kb = 0; kb < nkb; ++kb) {
        const int64_t k0 = g * Kg + kb * KB, nk = std::min<int64_t>(KB, Kg - kb * KB);
        row_blocks<E, Y, KB>(xg, wd + (g * nkb + kb) * cs * KH * KW * KB, bd != nullptr ? bd + k0 : nullptr,
                             yd, Cg, H, W, KH, KW, oh, OH, OW, ph, pw, dh, dw, nk, sh, (n * K + k0) * OH * OW, ep);
      }
    }
  });
}

template <class E, class Y>
void run_kb(const at::Tensor& x, const at::Tensor& wp, const float* bd, at::Tensor& y, int64_t G, int64_t Cg,
            int64_t Kg, at::IntArrayRef pad, at::IntArrayRef dil, int64_t sh, const Epi& ep) {
  switch (wp.size(5)) {
    case 8: return run<E, Y, 8>(x, wp, bd, y, G, Cg, Kg, pad, dil, sh, ep);
    case 4: return run<E, Y, 4>(x, wp, bd, y, G, Cg, Kg, pad, dil, sh, ep);
    case 1: return run<E, Y, 1>(x, wp, bd, y, G, Cg, Kg, pad, dil, sh, ep);
    default: TORCH_CHECK(false, "group_direct_fwd: channel blocks of 8, 4 or 1");
  }
}


// Channel-vector kernel (16 or 32 output channels a group, wp's KB = Kg): a zmm holds 16 output
// channels of one position, so a block of UR positions of a row x NK vectors keeps UR * NK
// accumulators while every input channel and tap of the group streams through: per (c, tap) NK
// weight loads and UR * NK FMAs whose x operand is a broadcast from memory (no masks, no lanes
// wasted on a partial row, as oneDNN's blocked kernels do). x comes from a zero-padded staging
// copy of the item's rows (so taps never test bounds); the block is transposed 16 positions at a
// time into y's channel rows, with the epilogue. f32 (CvF32) by FMA; bf16 (CvBF16) a channel pair
// per step: x staged as 32-bit words (x[2p], x[2p+1]) of a position, the weights packed in pairs,
// one vdpbf16ps per position and vector (32 multiply-adds).
struct CvF32 {
  using X = float;     // a staged element: one channel of a position
  using WT = float;
  static constexpr int STEP = 1;
  static inline __m512 bcast(const X* x) { return _mm512_set1_ps(*x); }
  static inline __m512 wload(const WT* w) { return _mm512_loadu_ps(w); }
  static inline __m512 madd(__m512 acc, __m512 b, __m512 w) { return _mm512_fmadd_ps(b, w, acc); }
  // staged row q.. of channel c (and c + 1 for pairs): n values of x's row
  static inline void stage(X* dst, const float* a, const float*, int64_t n) { std::memcpy(dst, a, n * sizeof(float)); }
};

#ifdef NNPRIM_DIRECT_BF16
struct CvBF16 {
  using X = uint32_t;  // a staged element: the channel pair (low: 2p, high: 2p + 1) of a position
  using WT = int32_t;
  static constexpr int STEP = 2;
  static inline __m512 bcast(const X* x) { return _mm512_castsi512_ps(_mm512_set1_epi32((int)*x)); }
  static inline __m512 wload(const WT* w) { return _mm512_castsi512_ps(_mm512_loadu_si512(w)); }
  static inline __m512 madd(__m512 acc, __m512 b, __m512 w) { return _mm512_dpbf16_ps(acc, (__m512bh)b, (__m512bh)w); }
  // rows a (channel 2p) and b (2p + 1, nullptr past an odd group's end: zero) interleaved
  static inline void stage(X* dst, const at::BFloat16* a, const at::BFloat16* b, int64_t n) {
    const auto* a16 = reinterpret_cast<const uint16_t*>(a);
    const auto* b16 = reinterpret_cast<const uint16_t*>(b);
    for (int64_t q = 0; q < n; q += 16) {
      const __mmask16 m = lanes(0, n - q);
      const __m512i lo = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, a16 + q));
      const __m512i hi = b16 ? _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, b16 + q)) : _mm512_setzero_si512();
      _mm512_mask_storeu_epi32(dst + q, m, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    }
  }
};
#endif

// 16 f32 lanes (m) of a y row: f32 with the epilogue, or bf16 rounded once
inline void cv_store(float* y, int64_t off, __mmask16 m, __m512 v, const Epi& ep) {
  _mm512_mask_storeu_ps(y + off, m, ep.apply(v, off, m));
}
#ifdef NNPRIM_DIRECT_BF16
inline void cv_store(at::BFloat16* y, int64_t off, __mmask16 m, __m512 v, const Epi&) {
  _mm256_mask_storeu_epi16(y + off, m, (__m256i)_mm512_cvtneps_pbh(v));
}
#endif

struct CvGeom {
  int64_t Cs, KH, KW, Hs, Ws, dh, dw;   // Cs staged channels (pairs for bf16), each an Hs x Ws plane
};

template <class E, class Y, int NK, int UR, int SW>
inline void cv_block(const typename E::X* xs, const typename E::WT* wp, const float* bias, Y* y, const CvGeom& g,
                     int64_t r0, int64_t ow0, int64_t nw, int64_t OHW, int64_t yoff, const Epi& ep) {
  // the residual's rows of this block (16 * NK planes apart: no hardware prefetcher follows them)
  // fetched while the block computes (reading them at the store cost 0.4 ms of grouped_g8's 1.6)
  // (prefetching y's lines for writing as well: no gain, 31 alternated calls)
  if (ep.res)
    for (int64_t i = 0; i < 16 * NK; ++i) {
      const float* r = ep.res + yoff + i * OHW + ow0;
      for (int64_t q = 0; q < nw; q += 16) _mm_prefetch((const char*)(r + q), _MM_HINT_T0);   // every line
      _mm_prefetch((const char*)(r + nw - 1), _MM_HINT_T0);
    }
  __m512 acc[UR][NK];
#pragma GCC unroll 4
  for (int k = 0; k < NK; ++k) {
    const __m512 b = bias ? _mm512_loadu_ps(bias + 16 * k) : _mm512_setzero_ps();
#pragma GCC unroll 32
    for (int j = 0; j < UR; ++j) acc[j][k] = b;
  }
  const int64_t plane = g.Hs * g.Ws;
  for (int64_t c = 0; c < g.Cs; ++c) {
    const typename E::WT* wc = wp + c * g.KH * g.KW * 16 * NK;
    for (int64_t kh = 0; kh < g.KH; ++kh) {
      const typename E::X* xr = xs + c * plane + (r0 + kh * g.dh) * g.Ws + ow0 * SW;
      for (int64_t kw = 0; kw < g.KW; ++kw) {
        const typename E::WT* wt = wc + (kh * g.KW + kw) * 16 * NK;
        const typename E::X* xt = xr + kw * g.dw;
        __m512 wv[NK];
#pragma GCC unroll 4
        for (int k = 0; k < NK; ++k) wv[k] = E::wload(wt + 16 * k);
#pragma GCC unroll 32
        for (int j = 0; j < UR; ++j) {
          const __m512 b = E::bcast(xt + j * SW);   // SW constant: offsets immediate
#pragma GCC unroll 4
          for (int k = 0; k < NK; ++k) acc[j][k] = E::madd(acc[j][k], b, wv[k]);
        }
      }
    }
  }
  // positions j0..j0+15 of channel vector k -> 16 channel rows of y
#pragma GCC unroll 4
  for (int k = 0; k < NK; ++k)
#pragma GCC unroll 2
    for (int j0 = 0; j0 < UR; j0 += 16) {
      __m512 t[16];
#pragma GCC unroll 16
      for (int j = 0; j < 16; ++j) t[j] = j0 + j < UR ? acc[j0 + j][k] : _mm512_setzero_ps();
      nnprim_native::transpose16_regs(t);   // nnprim/native_helpers.h, prepended
      const __mmask16 m = lanes(0, nw - j0);
      if (!m) break;
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) cv_store(y, yoff + (16 * k + i) * OHW + ow0 + j0, m, t[i], ep);
    }
}

// a row's blocks of `per` positions (cv_per); UR: per as a compile-time constant
template <int NK>
constexpr int cv_urm() { return NK == 1 ? 28 : 12; }   // accumulators + NK weights + a broadcast <= 32 zmm

template <int NK>
inline int64_t cv_per(int64_t OW) {   // positions a block: a multiple of 4, blocks as even as that allows
  const int64_t nb = (OW + cv_urm<NK>() - 1) / cv_urm<NK>();
  return ((OW + nb - 1) / nb + 3) / 4 * 4;
}

template <class E, class Y, int NK, int SW>
inline void cv_row(const typename E::X* xs, const typename E::WT* wp, const float* bias, Y* y, const CvGeom& g,
                   int64_t r0, int64_t OW, int64_t OHW, int64_t yoff, const Epi& ep) {
  constexpr int URM = cv_urm<NK>();
  const int64_t per = cv_per<NK>(OW);
  for (int64_t ow0 = 0; ow0 < OW; ow0 += per) {
    const int64_t nw = std::min(per, OW - ow0);
#define NNPRIM_CV(U) cv_block<E, Y, NK, (U <= URM ? U : URM), SW>(xs, wp, bias, y, g, r0, ow0, nw, OHW, yoff, ep)
    switch (per) {
      case 4: NNPRIM_CV(4); break;
      case 8: NNPRIM_CV(8); break;
      case 12: NNPRIM_CV(12); break;
      case 16: NNPRIM_CV(16); break;
      case 20: NNPRIM_CV(20); break;
      case 24: NNPRIM_CV(24); break;
      default: NNPRIM_CV(28); break;
    }
#undef NNPRIM_CV
  }
}

// rows per work item: whole output planes where the items still outnumber the threads 8 to 1 and
// the staged plane fits in a quarter of L2; bands of rows otherwise
inline int64_t cv_band(int64_t NG, int64_t OH, int64_t Cs, int64_t Ws, int64_t sh, int64_t reach) {
  const int64_t threads = at::get_num_threads();
  int64_t rb = OH;
  while (rb > 1 && (NG * ((OH + rb - 1) / rb) < 8 * threads || Cs * ((rb - 1) * sh + reach) * Ws * 4 > (256 << 10)))
    rb = (rb + 1) / 2;
  return rb;
}

template <class E, class Y, int NK, int SW>
void run_cv(const at::Tensor& x, const at::Tensor& wp, const float* bd, at::Tensor& y, int64_t G, int64_t Cg,
            at::IntArrayRef pad, at::IntArrayRef dil, at::IntArrayRef stride, const Epi& ep) {
  using X = typename E::X;
  using XIn = std::conditional_t<E::STEP == 2, at::BFloat16, float>;
  const int64_t N = x.size(0), C = x.size(1), H = x.size(2), W = x.size(3);
  const int64_t K = y.size(1), OH = y.size(2), OW = y.size(3), Kg = 16 * NK, Cs = (Cg + E::STEP - 1) / E::STEP;
  const int64_t KH = wp.size(3), KW = wp.size(4);
  const int64_t ph = pad[0], pw = pad[1], dh = dil[0], dw = dil[1], sh = stride[0], per = cv_per<NK>(OW);
  // staged columns: every computed position (whole blocks) with its taps
  const int64_t Ws = ((OW + per - 1) / per * per - 1) * SW + (KW - 1) * dw + 1, reach = (KH - 1) * dh + 1;
  const int64_t rb = cv_band(N * G, OH, Cs, Ws, sh, reach), nbands = (OH + rb - 1) / rb;
  const XIn* xd = reinterpret_cast<const XIn*>(x.data_ptr());
  const auto* wd = reinterpret_cast<const typename E::WT*>(wp.data_ptr());
  Y* yd = reinterpret_cast<Y*>(y.data_ptr());
  at::parallel_for(0, N * G * nbands, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<X> stage;
    for (int64_t it = begin; it < end; ++it) {
      const int64_t band = it % nbands, g = (it / nbands) % G, n = it / (nbands * G);
      const int64_t oh0 = band * rb, oh1 = std::min(OH, oh0 + rb), ih0 = oh0 * sh - ph;
      const CvGeom geo{Cs, KH, KW, (oh1 - oh0 - 1) * sh + reach, Ws, dh, dw};
      if ((int64_t)stage.size() < Cs * geo.Hs * Ws) stage.resize(Cs * geo.Hs * Ws);
      X* xs = stage.data();
      // x rows ih0.. of the group's channels (pairs), columns -pw.. (zeros outside x)
      const int64_t c_lo = std::min(std::max<int64_t>(pw, 0), Ws), c_hi = std::max(c_lo, std::min(Ws, W + pw));
      for (int64_t c = 0; c < Cs; ++c) {
        const XIn* xa = xd + ((n * C + g * Cg + c * E::STEP) * H) * W;
        const XIn* xb = E::STEP == 2 && c * 2 + 1 < Cg ? xa + H * W : nullptr;
        for (int64_t r = 0; r < geo.Hs; ++r) {
          X* dst = xs + (c * geo.Hs + r) * Ws;
          const int64_t ih = ih0 + r;
          if (ih < 0 || ih >= H) {
            std::memset(dst, 0, Ws * sizeof(X));
            continue;
          }
          std::memset(dst, 0, c_lo * sizeof(X));
          const int64_t o = ih * W + c_lo - pw;
          E::stage(dst + c_lo, xa + o, xb ? xb + o : nullptr, c_hi - c_lo);
          std::memset(dst + c_hi, 0, (Ws - c_hi) * sizeof(X));
        }
      }
      const auto* wg = wd + g * Cs * KH * KW * Kg;
      const float* bg = bd ? bd + g * Kg : nullptr;
      for (int64_t oh = oh0; oh < oh1; ++oh)
        cv_row<E, Y, NK, SW>(xs, wg, bg, yd, geo, (oh - oh0) * sh, OW, OH * OW, (n * K + g * Kg) * OH * OW + oh * OW, ep);
    }
  });
}

template <class E, class Y>
void run_cv_any(const at::Tensor& x, const at::Tensor& wp, const float* bd, at::Tensor& y, int64_t G, int64_t Cg,
                int64_t Kg, at::IntArrayRef pad, at::IntArrayRef dil, at::IntArrayRef stride, const Epi& ep) {
  TORCH_CHECK(wp.size(1) == 1 && wp.size(5) == Kg && (Kg == 16 || Kg == 32),
              "group_direct_fwd: channel vectors of the whole group (16 or 32)");
  if (stride[1] == 1)
    return Kg == 16 ? run_cv<E, Y, 1, 1>(x, wp, bd, y, G, Cg, pad, dil, stride, ep)
                    : run_cv<E, Y, 2, 1>(x, wp, bd, y, G, Cg, pad, dil, stride, ep);
  TORCH_CHECK(stride[1] == 2, "group_direct_fwd: row stride 1 or 2");
  return Kg == 16 ? run_cv<E, Y, 1, 2>(x, wp, bd, y, G, Cg, pad, dil, stride, ep)
                  : run_cv<E, Y, 2, 2>(x, wp, bd, y, G, Cg, pad, dil, stride, ep);
}

// x (N, C, H, W) contiguous, f32 or bf16; wp (G, ceil(Kg/KB), Cg, KH, KW, KB) f32 for f32 x, or
// (G, ceil(Kg/KB), ceil(Cg/2), KH, KW, KB) int32 bf16 pairs, KB 8, 4 or 1, (channel 2p in the low half) for bf16 x,
// zero past Kg / Cg; KB = Kg = 16 or 32: the channel-vector kernel; bias f32; y (N, K, OH, OW)
// contiguous f32 (or bf16 for bf16 x), every element written; stride (any along columns of rows, 1 or 2
// along a row; 2 in f32 or the channel-vector kernel only); res: y-shaped contiguous f32 (f32 y).
void group_direct_fwd(const at::Tensor& x, const at::Tensor& wp, const c10::optional<at::Tensor>& bias,
                      at::Tensor& y, int64_t G, int64_t Cg, int64_t Kg, at::IntArrayRef pad, at::IntArrayRef dil,
                      at::IntArrayRef stride, const c10::optional<at::Tensor>& res, double res_scale, bool relu,
                      double relu_slope) {
  TORCH_CHECK(x.is_contiguous() && wp.is_contiguous() && y.is_contiguous(), "group_direct_fwd: contiguous operands");
  TORCH_CHECK(wp.size(3) <= 64 && wp.size(4) <= 16, "group_direct_fwd: filter at most 64 x 16");
  TORCH_CHECK(!bias.has_value() || bias->scalar_type() == at::kFloat, "group_direct_fwd: f32 bias");
  const bool cv = wp.size(5) == 16 || wp.size(5) == 32;
  TORCH_CHECK(stride[0] >= 1 && (stride[1] == 1 || (stride[1] == 2 && (cv || x.scalar_type() == at::kFloat))),
              "group_direct_fwd: row stride 1 (or 2 in f32 or the channel-vector kernel)");
  Epi ep;
  ep.relu = relu;
  ep.slope = static_cast<float>(relu_slope);
  if (res.has_value()) {
    TORCH_CHECK(res->is_contiguous() && res->sizes() == y.sizes() && res->scalar_type() == at::kFloat &&
                y.scalar_type() == at::kFloat, "group_direct_fwd: res contiguous f32 like y (f32)");
    ep.res = res->data_ptr<float>();
    ep.res_scale = static_cast<float>(res_scale);
  }
  TORCH_CHECK(!relu || y.scalar_type() == at::kFloat, "group_direct_fwd: relu on f32 y");
  const float* bd = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  const int64_t sh = stride[0];
  if (x.scalar_type() == at::kFloat) {
    TORCH_CHECK(wp.scalar_type() == at::kFloat && y.scalar_type() == at::kFloat, "group_direct_fwd: f32 w and y");
    if (cv) return run_cv_any<CvF32, float>(x, wp, bd, y, G, Cg, Kg, pad, dil, stride, ep);
    if (stride[1] == 2) return run_kb<F32S2, float>(x, wp, bd, y, G, Cg, Kg, pad, dil, sh, ep);
    return run_kb<F32, float>(x, wp, bd, y, G, Cg, Kg, pad, dil, sh, ep);
  }
#ifdef NNPRIM_DIRECT_BF16
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && wp.scalar_type() == at::kInt, "group_direct_fwd: bf16 x, int32 w");
  if (y.scalar_type() == at::kBFloat16)
    return cv ? run_cv_any<CvBF16, at::BFloat16>(x, wp, bd, y, G, Cg, Kg, pad, dil, stride, ep)
              : run_kb<BF16, at::BFloat16>(x, wp, bd, y, G, Cg, Kg, pad, dil, sh, ep);
  TORCH_CHECK(y.scalar_type() == at::kFloat, "group_direct_fwd: y f32 or bf16");
  return cv ? run_cv_any<CvBF16, float>(x, wp, bd, y, G, Cg, Kg, pad, dil, stride, ep)
            : run_kb<BF16, float>(x, wp, bd, y, G, Cg, Kg, pad, dil, sh, ep);
#else
  TORCH_CHECK(false, "group_direct_fwd: bf16 needs AVX512-BF16 (built without it)");
#endif
}

// Backward weights, f32: dw[g*Kg + k, c, kh, kw] = sum over n, oh, ow of dy[n, g*Kg + k, oh, ow] *
// x[n, g*Cg + c, oh + kh*dh - ph, ow + kw*dw - pw]. A work item (group, pair of output channels,
// input channel, chunk of up to 3 filter rows, chunk of up to 3 filter columns) streams every
// output row: per 16 positions one load of dy per output channel and one masked load of x per
// tap feed WK x 3 x 3 accumulators (lanes = partial sums over positions), reduced across lanes at
// the end. All filter rows of a chunk in one item read each dy row once for 9 taps (a first
// version with one filter row per item and 4 output channels moved 1.5x the L2 traffic:
// grouped_g8 2.3-3.2 ms). Rows of x outside the image read a zero row.
constexpr int WK = 2;
constexpr int MAXV = 64;            // 16-position vectors per output row (OW <= 1024)

template <int NKH, int NKW>
inline void wgrad_item(const float* x, const float* dy, const float* zero, float* dw, int64_t N, int64_t C, int64_t H,
                       int64_t W, int64_t K, int64_t OH, int64_t OW, int64_t g, int64_t Cg, int64_t Kg, int64_t k0,
                       int64_t nk, int64_t c, int64_t kh0, int64_t kw0, int64_t KH, int64_t KW, int64_t ph, int64_t pw,
                       int64_t dh, int64_t dw_) {
  const int64_t nv = (OW + 15) / 16;
  __mmask16 mo[MAXV], mx[MAXV][NKW];
  for (int64_t v = 0; v < nv; ++v) {
    mo[v] = lanes(0, OW - v * 16);
    for (int j = 0; j < NKW; ++j) {
      const int64_t base = v * 16 + (kw0 + j) * dw_ - pw;
      mx[v][j] = lanes(-base, W - base) & mo[v];
    }
  }
  __m512 acc[WK][NKH][NKW];
#pragma GCC unroll 2
  for (int k = 0; k < WK; ++k)
#pragma GCC unroll 3
    for (int i = 0; i < NKH; ++i)
#pragma GCC unroll 3
      for (int j = 0; j < NKW; ++j) acc[k][i][j] = _mm512_setzero_ps();
  for (int64_t n = 0; n < N; ++n) {
    const float* xp = x + (n * C + g * Cg + c) * H * W;
    const float* dy0 = dy + (n * K + g * Kg + k0) * OH * OW;
    for (int64_t oh = 0; oh < OH; ++oh) {
      const float* xr[NKH];
#pragma GCC unroll 3
      for (int i = 0; i < NKH; ++i) {
        const int64_t ih = oh + (kh0 + i) * dh - ph;
        xr[i] = (ih >= 0 && ih < H ? xp + ih * W : zero) - pw;
      }
      const float* dyr = dy0 + oh * OW;
      for (int64_t v = 0; v < nv; ++v) {
        __m512 d[WK];
#pragma GCC unroll 2
        for (int k = 0; k < WK; ++k)
          d[k] = k < nk ? _mm512_maskz_loadu_ps(mo[v], dyr + k * OH * OW + v * 16) : _mm512_setzero_ps();
#pragma GCC unroll 3
        for (int i = 0; i < NKH; ++i)
#pragma GCC unroll 3
          for (int j = 0; j < NKW; ++j) {
            const __m512 xv = _mm512_maskz_loadu_ps(mx[v][j], xr[i] + v * 16 + (kw0 + j) * dw_);
#pragma GCC unroll 2
            for (int k = 0; k < WK; ++k) acc[k][i][j] = _mm512_fmadd_ps(d[k], xv, acc[k][i][j]);
          }
      }
    }
  }
#pragma GCC unroll 2
  for (int k = 0; k < WK; ++k) {
    if (k >= nk) break;
#pragma GCC unroll 3
    for (int i = 0; i < NKH; ++i)
#pragma GCC unroll 3
      for (int j = 0; j < NKW; ++j)
        dw[(((g * Kg + k0 + k) * Cg + c) * KH + kh0 + i) * KW + kw0 + j] = _mm512_reduce_add_ps(acc[k][i][j]);
  }
}

template <int NKH>
inline void wgrad_cols(int64_t nkw, const float* x, const float* dy, const float* zero, float* dw, int64_t N,
                       int64_t C, int64_t H, int64_t W, int64_t K, int64_t OH, int64_t OW, int64_t g, int64_t Cg,
                       int64_t Kg, int64_t k0, int64_t nk, int64_t c, int64_t kh0, int64_t kw0, int64_t KH, int64_t KW,
                       int64_t ph, int64_t pw, int64_t dh, int64_t dw_) {
  switch (nkw) {
    case 3: return wgrad_item<NKH, 3>(x, dy, zero, dw, N, C, H, W, K, OH, OW, g, Cg, Kg, k0, nk, c, kh0, kw0, KH, KW, ph, pw, dh, dw_);
    case 2: return wgrad_item<NKH, 2>(x, dy, zero, dw, N, C, H, W, K, OH, OW, g, Cg, Kg, k0, nk, c, kh0, kw0, KH, KW, ph, pw, dh, dw_);
    default: return wgrad_item<NKH, 1>(x, dy, zero, dw, N, C, H, W, K, OH, OW, g, Cg, Kg, k0, nk, c, kh0, kw0, KH, KW, ph, pw, dh, dw_);
  }
}

// x (N, C, H, W), dy (N, K, OH, OW), dw (K, Cg, KH, KW): f32, contiguous; stride 1; OW <= 1024.
void group_direct_wgrad(const at::Tensor& x, const at::Tensor& dy, at::Tensor& dw, int64_t G, at::IntArrayRef pad,
                        at::IntArrayRef dil) {
  TORCH_CHECK(x.is_contiguous() && dy.is_contiguous() && dw.is_contiguous(), "group_direct_wgrad: contiguous operands");
  TORCH_CHECK(x.scalar_type() == at::kFloat && dy.scalar_type() == at::kFloat && dw.scalar_type() == at::kFloat,
              "group_direct_wgrad: f32 operands");
  const int64_t N = x.size(0), C = x.size(1), H = x.size(2), W = x.size(3);
  const int64_t K = dy.size(1), OH = dy.size(2), OW = dy.size(3);
  const int64_t Cg = dw.size(1), KH = dw.size(2), KW = dw.size(3), Kg = K / G;
  TORCH_CHECK(OW <= 16 * MAXV, "group_direct_wgrad: output width <= 1024");
  const int64_t nkb = (Kg + WK - 1) / WK, nrc = (KH + 2) / 3, ncc = (KW + 2) / 3;
  const std::vector<float> zero(W, 0.f);
  const float* xd = x.data_ptr<float>();
  const float* dyd = dy.data_ptr<float>();
  float* dwd = dw.data_ptr<float>();
  const int64_t ph = pad[0], pw = pad[1], dh = dil[0], dw_ = dil[1];
  // items in (group, channel pair, input channel, row chunk, column chunk) order: a thread's
  // contiguous range keeps one group's x and dy in its L2
  at::parallel_for(0, G * nkb * Cg * nrc * ncc, 1, [&](int64_t begin, int64_t end) {
    for (int64_t it = begin; it < end; ++it) {
      int64_t r = it;
      const int64_t cc = r % ncc; r /= ncc;
      const int64_t rc = r % nrc; r /= nrc;
      const int64_t c = r % Cg; r /= Cg;
      const int64_t kb = r % nkb, g = r / nkb;
      const int64_t k0 = kb * WK, nk = std::min<int64_t>(WK, Kg - k0), kh0 = rc * 3, kw0 = cc * 3;
      const int64_t nkh = std::min<int64_t>(3, KH - kh0), nkw = std::min<int64_t>(3, KW - kw0);
      if (nkh == 3)
        wgrad_cols<3>(nkw, xd, dyd, zero.data(), dwd, N, C, H, W, K, OH, OW, g, Cg, Kg, k0, nk, c, kh0, kw0, KH, KW, ph, pw, dh, dw_);
      else if (nkh == 2)
        wgrad_cols<2>(nkw, xd, dyd, zero.data(), dwd, N, C, H, W, K, OH, OW, g, Cg, Kg, k0, nk, c, kh0, kw0, KH, KW, ph, pw, dh, dw_);
      else
        wgrad_cols<1>(nkw, xd, dyd, zero.data(), dwd, N, C, H, W, K, OH, OW, g, Cg, Kg, k0, nk, c, kh0, kw0, KH, KW, ph, pw, dh, dw_);
    }
  });
}

// w (K, Cg, KH, KW) contiguous -> the kernel's packed weights (see group_direct_fwd) in blocks of KB
// output channels, in one pass (the same permutation in torch ops cost ~0.1 ms a call: a tenth of
// grouped_g8's forward). twin: pack the weights of the backward data's forward instead (its K' = C
// output channels and Cg' = Kg inputs: w'[g*Cg + c, k, f] = w[g*Kg + k, c, F-1-f]), with no
// transposed, flipped copy of w first.
std::vector<int64_t> packed_sizes(const at::Tensor& w, int64_t G, int64_t KB, bool twin) {
  TORCH_CHECK(w.dim() == 4 && w.is_contiguous(), "group_direct_pack: contiguous (K, Cg, KH, KW)");
  TORCH_CHECK(KB == 8 || KB == 4 || KB == 1 || KB == 16 || KB == 32,
              "group_direct_pack: blocks of 8, 4 or 1 channels, or 16 or 32 (the channel-vector kernel)");
  TORCH_CHECK(w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16, "group_direct_pack: f32 or bf16");
  const int64_t Kg = twin ? w.size(1) : w.size(0) / G, Cg = twin ? w.size(0) / G : w.size(1);
  const int64_t cs = w.scalar_type() == at::kFloat ? Cg : (Cg + 1) / 2;
  return {G, (Kg + KB - 1) / KB, cs, w.size(2), w.size(3), KB};
}

void pack_into(const at::Tensor& w, int64_t G, int64_t KB, bool twin, void* out) {
  const auto sz = packed_sizes(w, G, KB, twin);
  const int64_t KH = w.size(2), KW = w.size(3), T = KH * KW, nkb = sz[1], cs = sz[2];
  const int64_t K = twin ? w.size(1) * G : w.size(0), Cg = twin ? w.size(0) / G : w.size(1), Kg = K / G;
  // element (k, c, t) of the packed problem's filter within w
  const auto src_at = [&](int64_t k, int64_t c, int64_t t) {
    if (!twin) return (k * Cg + c) * T + t;
    const int64_t g = k / Kg;   // w'[g*Kg' + k', c', t] = w[g*Cg' + c', k', T-1-t]
    return ((g * Cg + c) * Kg + k % Kg) * T + (T - 1 - t);
  };
  std::memset(out, 0, sizeof(float) * G * nkb * cs * T * KB);
  if (w.scalar_type() == at::kFloat) {
    const float* src = w.data_ptr<float>();
    float* dst = static_cast<float*>(out);
    for (int64_t k = 0; k < K; ++k) {
      const int64_t g = k / Kg, kk = k % Kg, kb = kk / KB, j = kk % KB;
      for (int64_t c = 0; c < Cg; ++c)
        for (int64_t t = 0; t < T; ++t) dst[(((g * nkb + kb) * cs + c) * T + t) * KB + j] = src[src_at(k, c, t)];
    }
    return;
  }
  const uint16_t* src = reinterpret_cast<const uint16_t*>(w.data_ptr());
  uint32_t* dst = static_cast<uint32_t*>(out);
  for (int64_t k = 0; k < K; ++k) {
    const int64_t g = k / Kg, kk = k % Kg, kb = kk / KB, j = kk % KB;
    for (int64_t c = 0; c < Cg; ++c)
      for (int64_t t = 0; t < T; ++t)
        dst[(((g * nkb + kb) * cs + c / 2) * T + t) * KB + j] |= (uint32_t)src[src_at(k, c, t)] << (16 * (c % 2));
  }
}

at::Tensor group_direct_pack(const at::Tensor& w, int64_t G, int64_t KB, bool twin) {
  auto out = at::empty(packed_sizes(w, G, KB, twin), w.options().dtype(w.scalar_type() == at::kFloat ? at::kFloat : at::kInt));
  pack_into(w, G, KB, twin, out.data_ptr());
  return out;
}

// The forward from unpacked weights: packed into the calling thread's buffer (no allocation, no
// second op call: the separate pack op cost ~0.05 ms a call, 8 % of grouped_g8 at half batch).
void group_direct_fwd_w(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
                        at::Tensor& y, int64_t G, int64_t Cg, int64_t Kg, int64_t KB, bool twin, at::IntArrayRef pad,
                        at::IntArrayRef dil, at::IntArrayRef stride, const c10::optional<at::Tensor>& res,
                        double res_scale, bool relu, double relu_slope) {
  thread_local std::vector<float> buf;
  const auto sz = packed_sizes(w, G, KB, twin);
  int64_t n = 1;
  for (auto v : sz) n *= v;
  if ((int64_t)buf.size() < n) buf.resize(n);
  pack_into(w, G, KB, twin, buf.data());
  const auto wp = at::from_blob(buf.data(), sz, w.options().dtype(w.scalar_type() == at::kFloat ? at::kFloat : at::kInt));
  group_direct_fwd(x, wp, bias, y, G, Cg, Kg, pad, dil, stride, res, res_scale, relu, relu_slope);
}
}  // namespace

TORCH_LIBRARY(nnprim_cpu_group, m) {
  m.def("group_direct_fwd(Tensor x, Tensor wp, Tensor? bias, Tensor(a!) y, int G, int Cg, int Kg, int[] pad, "
        "int[] dil, int[] stride, Tensor? res=None, float res_scale=1.0, bool relu=False, float relu_slope=0.0) -> ()");
  m.def("group_direct_pack(Tensor w, int G, int KB, bool twin=False) -> Tensor");
  m.def("group_direct_fwd_w(Tensor x, Tensor w, Tensor? bias, Tensor(a!) y, int G, int Cg, int Kg, int KB, bool twin, "
        "int[] pad, int[] dil, int[] stride, Tensor? res=None, float res_scale=1.0, bool relu=False, "
        "float relu_slope=0.0) -> ()");
  m.def("group_direct_wgrad(Tensor x, Tensor dy, Tensor(a!) dw, int G, int[] pad, int[] dil) -> ()");
}

TORCH_LIBRARY_IMPL(nnprim_cpu_group, CPU, m) {
  m.impl("group_direct_fwd", group_direct_fwd);
  m.impl("group_direct_pack", group_direct_pack);
  m.impl("group_direct_fwd_w", group_direct_fwd_w);
  m.impl("group_direct_wgrad", group_direct_wgrad);
}
