"""Native Winograd transforms for the CPU Winograd solvers (cpu_winograd.py), issue 16.

The torch-op transforms (cpu_winograd._input_transform / _output_transform) cost 60-70 % of a
Winograd forward on the suite's 3x3 layers: each 1-D pass is a dozen whole-block add/sub ops,
every one a trip through memory. Here each tile's alpha x alpha values of a run of channels
are loaded once, both passes run in registers and the result is stored once: B^T d B into V
(alpha^2, tiles, C) and A^T M A (+ bias) into y's block, the same buffers and formulas
(cpu_winograd.PROGRAMS' F(4,3) and F(2,3)) as the torch path, parallel over tiles with ATen's
OpenMP pool. nchw tensors meet the channels-innermost transforms through 16 x 16 blocks
transposed in registers (AVX-512; plain loops elsewhere): `wino_stage` copies an nchw x
(f32/bf16/f16) into the zero-padded channels-last f32 buffer, and `wino_output` writes an
nchw y by tile rows, each run of 16 filters through a (m, row, 16) scratch (rn50_r2_3x3,
2 threads, EPYC: staging 1.0-1.35 -> 0.45-0.55 ms, output + copy 2.3-3.3 -> 1.3-1.8 ms,
as the nhwc output's). `wino_fused` chains the three for one group of tile rows at a time per
core (input transform, the alpha^2 GEMMs on an f32 register tile, output transform), so V and M
never leave the core's cache (cpu_winograd.fuses says where: small U).

The source below is built once per machine (nnprim/native.py) and loaded as torch ops
(`torch.ops.nnprim_cpu.*`). Where that fails (no compiler, another platform) or
NNPRIM_CPU_NATIVE=0, `ops()` returns None and the torch-op transforms run: the results agree
to f32 rounding either way."""
from __future__ import annotations

from ..native import NATIVE_HELPERS, NativeLibrary

SOURCE = r"""
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <algorithm>
#include <array>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define NNPRIM_WINO_AVX512 1
#endif

namespace {
// 16 f32 lanes: one AVX-512 register (two AVX2 ones where -march=native has no AVX-512)
typedef float v16 __attribute__((vector_size(64)));
constexpr int L = 16;

inline v16 load(const float* p, int n) {
  v16 v = {};
  if (n == L) std::memcpy(&v, p, sizeof(v));
  else std::memcpy(&v, p, sizeof(float) * n);
  return v;
}
inline void store(float* p, v16 v, int n) {
  if (n == L) std::memcpy(p, &v, sizeof(v));
  else std::memcpy(p, &v, sizeof(float) * n);
}

// 1-D B^T (F(4,3): A = 6, F(2,3): A = 4) of d[0], d[s], .. into o[0], o[os], ..
template <int A> inline void bt(const v16* d, int s, v16* o, int os);
template <> inline void bt<6>(const v16* d, int s, v16* o, int os) {
  v16 d0 = d[0], d1 = d[s], d2 = d[2 * s], d3 = d[3 * s], d4 = d[4 * s], d5 = d[5 * s];
  v16 a = d4 - 4.f * d2, b = d3 - 4.f * d1, e = d4 - d2, f = 2.f * (d3 - d1);
  o[0] = 4.f * d0 - 5.f * d2 + d4;
  o[os] = a + b;
  o[2 * os] = a - b;
  o[3 * os] = e + f;
  o[4 * os] = e - f;
  o[5 * os] = 4.f * d1 - 5.f * d3 + d5;
}
template <> inline void bt<4>(const v16* d, int s, v16* o, int os) {
  v16 d0 = d[0], d1 = d[s], d2 = d[2 * s], d3 = d[3 * s];
  o[0] = d0 - d2;
  o[os] = d1 + d2;
  o[2 * os] = d2 - d1;
  o[3 * os] = d1 - d3;
}
// 1-D A^T: A inputs, A - 2 outputs
template <int A> inline void at(const v16* d, int s, v16* o, int os);
template <> inline void at<6>(const v16* d, int s, v16* o, int os) {
  v16 d1 = d[s], d2 = d[2 * s], d3 = d[3 * s], d4 = d[4 * s];
  v16 sm = d1 + d2, Sm = d3 + d4, e = d1 - d2, E = d3 - d4;
  o[0] = d[0] + sm + Sm;
  o[os] = e + 2.f * E;
  o[2 * os] = sm + 4.f * Sm;
  o[3 * os] = e + 8.f * E + d[5 * s];
}
template <> inline void at<4>(const v16* d, int s, v16* o, int os) {
  o[0] = d[0] + d[s] + d[2 * s];
  o[os] = d[s] - d[2 * s] - d[3 * s];
}

// ---- nchw <-> channels-innermost: 16 x 16 blocks transposed in registers --------------------
// The strided copies torch would do instead run element by element (issue 16: rn50_r2_3x3 nchw
// spent 1.5 + 2.0 ms of ~13 there). dst[j * ds + i] = src[i * ss + j] for i < nr, j < nc
// (nr, nc <= 16), converted to f32.
#if NNPRIM_WINO_AVX512
template <typename T> inline __m512 load_row(const T* p, __mmask16 k);
template <> inline __m512 load_row<float>(const float* p, __mmask16 k) { return _mm512_maskz_loadu_ps(k, p); }
template <> inline __m512 load_row<at::BFloat16>(const at::BFloat16* p, __mmask16 k) {
  const __m512i u = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
}
template <> inline __m512 load_row<at::Half>(const at::Half* p, __mmask16 k) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, p));
}

using nnprim_native::transpose16_regs;   // nnprim/native_helpers.h, prepended
#endif

template <typename T>
inline void transpose16(const T* src, int64_t ss, float* dst, int64_t ds, int nr, int nc) {
#if NNPRIM_WINO_AVX512
  __m512 r[16];
  const __mmask16 cm = (__mmask16)((1u << nc) - 1), rm = (__mmask16)((1u << nr) - 1);
  for (int i = 0; i < 16; ++i) r[i] = i < nr ? load_row<T>(src + i * ss, cm) : _mm512_setzero_ps();
  transpose16_regs(r);
  for (int j = 0; j < nc; ++j) _mm512_mask_storeu_ps(dst + j * ds, rm, r[j]);
#else
  for (int i = 0; i < nr; ++i)
    for (int j = 0; j < nc; ++j) dst[j * ds + i] = static_cast<float>(src[i * ss + j]);
#endif
}

// P[n, pt + h, pl + w, c] = x[n, c, h, w] (x: w contiguous, any dtype; P: (., Hp, Wp, C) f32)
template <typename T>
void stage_rows(const T* x, float* P, int64_t nb, int64_t C, int64_t H, int64_t W, int64_t sn, int64_t sc,
                int64_t sh, int64_t Hp, int64_t Wp, int64_t pt, int64_t pl) {
  // rows h innermost: each thread reads 16 channel planes as long streams (the prefetchers'
  // case; 16 short rows per (n, h) ran 2.4x the nhwc copy's time, this ~1.3x)
  const int64_t CB = (C + L - 1) / L;
  at::parallel_for(0, nb * CB * H, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t h = r % H, c0 = (r / H) % CB * L, n = r / (H * CB);
      const T* src = x + n * sn + c0 * sc + h * sh;
      float* dst = P + ((n * Hp + pt + h) * Wp + pl) * C + c0;
      const int nr = (int)std::min<int64_t>(L, C - c0);
      for (int64_t w0 = 0; w0 < W; w0 += L)
        transpose16<T>(src + w0, sc, dst + w0 * C, C, nr, (int)std::min<int64_t>(L, W - w0));
    }
  });
}

// V[(i*A + j), t, c] = (B^T d B)[i][j] of tile t = (n, th, tw) of P (nb, Hp, Wp, C), rows
// r0 + m*th.., columns m*tw..
template <int A>
void input_tiles(const float* P, float* V, int64_t Hp, int64_t Wp, int64_t C, int64_t r0, int64_t thn,
                 int64_t TW, int64_t tiles) {
  constexpr int M = A - 2;
  at::parallel_for(0, tiles, 8, [&](int64_t t0, int64_t t1) {
    v16 d[A * A], h[A * A];
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n = t / (thn * TW), th = (t / TW) % thn, tw = t % TW;
      const float* base = P + ((n * Hp + r0 + M * th) * Wp + M * tw) * C;
      for (int64_t c0 = 0; c0 < C; c0 += L) {
        const int nc = (int)std::min<int64_t>(L, C - c0);
        for (int i = 0; i < A; ++i)
          for (int j = 0; j < A; ++j) d[i * A + j] = load(base + (i * Wp + j) * C + c0, nc);
        for (int j = 0; j < A; ++j) bt<A>(d + j, A, h + j, A);        // columns: h = B^T d
        for (int i = 0; i < A; ++i) bt<A>(h + i * A, 1, d + i * A, 1);  // rows: d = h B
        for (int e = 0; e < A * A; ++e) store(V + ((int64_t)e * tiles + t) * C + c0, d[e], nc);
      }
    }
  });
}

// y[n, k, row, col] (strided) = (A^T M A)[r][s] (+ bias[k]) of tile t = (n, th, tw) of
// Mp (A*A, tiles, K); rows >= `rows` and cols >= `cols` (the tails) are not written
template <int A>
void output_tiles(const float* Mp, const float* bias, float* y, int64_t sn, int64_t sk, int64_t sh, int64_t sw,
                  int64_t K, int64_t thn, int64_t TW, int64_t tiles, int64_t rows, int64_t cols) {
  constexpr int M = A - 2;
  at::parallel_for(0, tiles, 8, [&](int64_t t0, int64_t t1) {
    v16 m[A * A], z[M * A], o[M * M];
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n = t / (thn * TW), th = (t / TW) % thn, tw = t % TW;
      const int64_t R = std::min<int64_t>(M, rows - M * th), S = std::min<int64_t>(M, cols - M * tw);
      if (R <= 0 || S <= 0) continue;
      for (int64_t k0 = 0; k0 < K; k0 += L) {
        const int nk = (int)std::min<int64_t>(L, K - k0);
        for (int e = 0; e < A * A; ++e) m[e] = load(Mp + ((int64_t)e * tiles + t) * K + k0, nk);
        for (int j = 0; j < A; ++j) at<A>(m + j, A, z + j, A);          // columns: z = A^T m
        for (int r = 0; r < M; ++r) at<A>(z + r * A, 1, o + r * M, 1);   // rows: o = z A
        if (bias) {
          const v16 b = load(bias + k0, nk);
          for (int e = 0; e < M * M; ++e) o[e] += b;
        }
        for (int r = 0; r < R; ++r) {
          float* row = y + n * sn + (M * th + r) * sh + (M * tw) * sw + k0 * sk;
          for (int s = 0; s < S; ++s) {
            if (sk == 1) {
              store(row + s * sw, o[r * M + s], nk);
            } else {
              float tmp[L];
              std::memcpy(tmp, &o[r * M + s], sizeof(tmp));
              for (int c = 0; c < nk; ++c) row[s * sw + c * sk] = tmp[c];
            }
          }
        }
      }
    }
  });
}

// output_tiles for a y with channels outermost and columns contiguous (nchw, sw == 1): per tile
// row of images and run of 16 channels, the tiles' outputs go to a (M, TW*M, 16) scratch, then
// 16 x 16 transposes write y's rows (a scalar scatter per element costs more than the transform)
template <int A>
void output_rows(const float* Mp, const float* bias, float* y, int64_t sn, int64_t sk, int64_t sh, int64_t K,
                 int64_t thn, int64_t TW, int64_t tiles, int64_t rows, int64_t cols) {
  constexpr int M = A - 2;
  at::parallel_for(0, tiles / TW, 1, [&](int64_t q0, int64_t q1) {
    std::vector<float> loc((size_t)M * TW * M * L);
    v16 m[A * A], z[M * A], o[M * M];
    for (int64_t q = q0; q < q1; ++q) {           // q = n * thn + th
      const int64_t n = q / thn, th = q % thn;
      const int64_t R = std::min<int64_t>(M, rows - M * th), TWv = std::min<int64_t>(TW, (cols + M - 1) / M);
      if (R <= 0) continue;
      for (int64_t k0 = 0; k0 < K; k0 += L) {
        const int nk = (int)std::min<int64_t>(L, K - k0);
        const v16 b = bias ? load(bias + k0, nk) : v16{};
        for (int64_t tw = 0; tw < TWv; ++tw) {
          const int64_t t = q * TW + tw;
          for (int e = 0; e < A * A; ++e) m[e] = load(Mp + ((int64_t)e * tiles + t) * K + k0, nk);
          for (int j = 0; j < A; ++j) at<A>(m + j, A, z + j, A);
          for (int r = 0; r < M; ++r) at<A>(z + r * A, 1, o + r * M, 1);
          for (int r = 0; r < R; ++r)
            for (int s = 0; s < M; ++s) store(loc.data() + ((r * TW + tw) * M + s) * L, o[r * M + s] + b, L);
        }
        for (int r = 0; r < R; ++r) {
          float* row = y + n * sn + (M * th + r) * sh + k0 * sk;
          const float* src = loc.data() + r * TW * M * L;
          for (int64_t c0 = 0; c0 < cols; c0 += L)
            transpose16<float>(src + c0 * L, L, row + c0, sk, (int)std::min<int64_t>(L, cols - c0), nk);
        }
      }
    }
  });
}

// ---- the fused forward: per group of tile rows, V and M stay in this core's cache ----------
// c (MB x 16 NV f32, row stride ldc) = a (MB rows lda apart, depth C) . b (C rows ldb apart, 16 NV
// columns): the accumulators stay in registers over the whole depth
template <int MB, int NV>
void f32_tile(const float* a, int64_t lda, const float* b, int64_t ldb, int64_t C, float* c, int64_t ldc,
              bool add) {
  v16 acc[MB][NV];
  for (int i = 0; i < MB; ++i)
    for (int v = 0; v < NV; ++v) {
      if (add) std::memcpy(&acc[i][v], c + i * ldc + L * v, sizeof(v16));
      else acc[i][v] = v16{};
    }
  for (int64_t k = 0; k < C; ++k) {
    v16 bv[NV];
    for (int v = 0; v < NV; ++v) std::memcpy(&bv[v], b + k * ldb + L * v, sizeof(v16));
    for (int i = 0; i < MB; ++i) {
#ifdef NNPRIM_WINO_AVX512
      const __m512 s = _mm512_set1_ps(a[i * lda + k]);
      for (int v = 0; v < NV; ++v) acc[i][v] = (v16)_mm512_fmadd_ps(s, (__m512)bv[v], (__m512)acc[i][v]);
#else
      const float s = a[i * lda + k];
      for (int v = 0; v < NV; ++v) acc[i][v] += s * bv[v];
#endif
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int v = 0; v < NV; ++v) std::memcpy(c + i * ldc + L * v, &acc[i][v], sizeof(v16));
}

using F32Tile = void (*)(const float*, int64_t, const float*, int64_t, int64_t, float*, int64_t, bool);
template <int NV, int... M>
constexpr std::array<F32Tile, sizeof...(M)> f32_table(std::integer_sequence<int, M...>) {
  return {&f32_tile<M + 1, NV>...};
}

// c (G x K, row stride K) (+)= a (G x C) . b (C x K), K a multiple of 16: row blocks of at most 6
// (the accumulators and B's 4 vectors in 32 registers), split evenly (no 1- or 2-row tail)
void f32_gemm(const float* a, const float* b, float* c, int64_t G, int64_t C, int64_t K, bool add) {
  static const std::array<F32Tile, 6> t1 = f32_table<1>(std::make_integer_sequence<int, 6>{});
  static const std::array<F32Tile, 6> t2 = f32_table<2>(std::make_integer_sequence<int, 6>{});
  static const std::array<F32Tile, 6> t3 = f32_table<3>(std::make_integer_sequence<int, 6>{});
  static const std::array<F32Tile, 6> t4 = f32_table<4>(std::make_integer_sequence<int, 6>{});
  const int64_t nt = (G + 5) / 6;
  for (int64_t k0 = 0; k0 < K; k0 += 4 * L) {
    const int nv = (int)std::min<int64_t>(4, (K - k0) / L);
    const auto& tab = nv == 4 ? t4 : nv == 3 ? t3 : nv == 2 ? t2 : t1;
    for (int64_t i = 0, g0 = 0; i < nt; ++i) {
      const int64_t mb = G / nt + (i < G % nt);
      tab[mb - 1](a + g0 * C, C, b + k0, K, C, c + g0 * K + k0, K, add);
      g0 += mb;
    }
  }
}

// y block (no, K, rows, cols; any strides) = A^T [sum_fd sum_c (B^T d_{n+fd} B) U_fd] A (+ bias) of
// the staged images P (no + taps - 1, Hp, Wp, C), tile rows [r0 / m, r0 / m + thn); U (taps, A*A, C,
// K) contiguous, K % 16 == 0. taps 3: a 3-D problem's depth taps, its depth slices the images.
// Work items are groups of R whole tile rows: their V (A*A, G, C) and M (A*A, G, K), G = R*TW,
// live in a per-thread scratch (sized to stay in L2) instead of memory-sized buffers between
// three passes; an nchw y (sw == 1) is written through output_rows' 16 x 16 transposes
template <int A>
void fused_rows(const float* P, const float* U, const float* bias, float* y, int64_t sn, int64_t sk, int64_t sh,
                int64_t sw, int64_t Hp, int64_t Wp, int64_t C, int64_t K, int64_t r0, int64_t nb, int64_t thn,
                int64_t TW, int64_t rows, int64_t cols, int64_t R, int64_t taps) {
  constexpr int M = A - 2;
  const int64_t nq = nb * thn, groups = (nq + R - 1) / R;     // nb: output images
  const bool nchw = sw == 1 && sk != 1;
  at::parallel_for(0, groups, 1, [&](int64_t q0, int64_t q1) {
    thread_local std::vector<float> scratch;
    const int64_t G = R * TW;
    const size_t need = (size_t)A * A * G * (C + K) + (size_t)M * TW * M * L;
    if (scratch.size() < need) scratch.resize(need);
    float* V = scratch.data();
    float* Mt = V + (size_t)A * A * G * C;
    float* loc = Mt + (size_t)A * A * G * K;
    v16 d[A * A], h[A * A], z[M * A], o[M * M];
    for (int64_t grp = q0; grp < q1; ++grp) {
      const int64_t qa = grp * R, qb = std::min(nq, qa + R), g = (qb - qa) * TW;
      for (int64_t fd = 0; fd < taps; ++fd) {
        for (int64_t t = 0; t < g; ++t) {                     // input transform into V
          const int64_t q = qa + t / TW, n = q / thn + fd, th = q % thn, tw = t % TW;
          const float* base = P + ((n * Hp + r0 + M * th) * Wp + M * tw) * C;
          for (int64_t c0 = 0; c0 < C; c0 += L) {
            const int nc = (int)std::min<int64_t>(L, C - c0);
            for (int i = 0; i < A; ++i)
              for (int j = 0; j < A; ++j) d[i * A + j] = load(base + (i * Wp + j) * C + c0, nc);
            for (int j = 0; j < A; ++j) bt<A>(d + j, A, h + j, A);
            for (int i = 0; i < A; ++i) bt<A>(h + i * A, 1, d + i * A, 1);
            for (int e = 0; e < A * A; ++e) store(V + ((int64_t)e * g + t) * C + c0, d[e], nc);
          }
        }
        const float* Uf = U + fd * A * A * C * K;
        for (int e = 0; e < A * A; ++e)                         // the A*A GEMMs (+ the earlier taps')
          f32_gemm(V + (int64_t)e * g * C, Uf + (int64_t)e * C * K, Mt + (int64_t)e * g * K, g, C, K, fd > 0);
      }
      for (int64_t qq = qa; qq < qb; ++qq) {                    // output transform, tile row by row
        const int64_t n = qq / thn, th = qq % thn, tb = (qq - qa) * TW;
        const int64_t Rv = std::min<int64_t>(M, rows - M * th);
        if (Rv <= 0) continue;
        for (int64_t k0 = 0; k0 < K; k0 += L) {
          const v16 b = bias ? load(bias + k0, L) : v16{};
          for (int64_t tw = 0; tw < TW; ++tw) {
            const int64_t S = std::min<int64_t>(M, cols - M * tw);
            if (S <= 0) continue;
            v16 mm[A * A];
            for (int e = 0; e < A * A; ++e) mm[e] = load(Mt + ((int64_t)e * g + tb + tw) * K + k0, L);
            for (int j = 0; j < A; ++j) at<A>(mm + j, A, z + j, A);
            for (int r = 0; r < M; ++r) at<A>(z + r * A, 1, o + r * M, 1);
            for (int r = 0; r < Rv; ++r)
              for (int s2 = 0; s2 < M; ++s2) {
                if (nchw) {
                  store(loc + ((r * TW + tw) * M + s2) * L, o[r * M + s2] + b, L);
                } else if (s2 < S) {
                  float* dst = y + n * sn + (M * th + r) * sh + (M * tw + s2) * sw + k0 * sk;
                  const v16 val = o[r * M + s2] + b;
                  if (sk == 1) {
                    store(dst, val, L);
                  } else {
                    float tmp[L];
                    std::memcpy(tmp, &val, sizeof(tmp));
                    for (int c = 0; c < L; ++c) dst[c * sk] = tmp[c];
                  }
                }
              }
          }
          if (nchw)
            for (int r = 0; r < Rv; ++r) {
              float* row = y + n * sn + (M * th + r) * sh + k0 * sk;
              const float* src = loc + r * TW * M * L;
              for (int64_t c0 = 0; c0 < cols; c0 += L)
                transpose16<float>(src + c0 * L, L, row + c0, sk, (int)std::min<int64_t>(L, cols - c0), L);
            }
        }
      }
    }
  });
}

void wino_fused(const at::Tensor& P, const at::Tensor& U, const std::optional<at::Tensor>& bias, const at::Tensor& y,
                int64_t m, int64_t r0, int64_t thn, int64_t TW, int64_t R, int64_t taps) {
  TORCH_CHECK(P.dim() == 4 && P.is_contiguous() && P.scalar_type() == at::kFloat, "P: contiguous f32 (nb, Hp, Wp, C)");
  TORCH_CHECK(m == 4 || m == 2, "m must be 2 or 4");
  const int64_t a = m + 2, nb = P.size(0), Hp = P.size(1), Wp = P.size(2), C = P.size(3);
  TORCH_CHECK(taps >= 1 && taps <= nb, "taps: 1 .. images");
  TORCH_CHECK(U.dim() == 4 && U.is_contiguous() && U.scalar_type() == at::kFloat && U.size(0) == taps &&
              U.size(1) == a * a && U.size(2) == C, "U: contiguous f32 (taps, alpha^2, C, K)");
  const int64_t K = U.size(3), no = nb - taps + 1;
  TORCH_CHECK(K % L == 0, "K must be a multiple of 16");
  TORCH_CHECK(y.dim() == 4 && y.scalar_type() == at::kFloat && y.size(0) == no && y.size(1) == K,
              "y: f32 (images - taps + 1, K, rows, cols)");
  TORCH_CHECK(y.size(2) <= m * thn && y.size(3) <= m * TW, "y larger than the tiles");
  TORCH_CHECK(r0 + m * thn + 2 <= Hp && m * TW + 2 <= Wp && R >= 1, "tiles outside P");
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->is_contiguous() && bias->scalar_type() == at::kFloat && bias->numel() == K, "bias: f32 (K)");
    b = bias->data_ptr<float>();
  }
  auto fn = m == 4 ? fused_rows<6> : fused_rows<4>;
  fn(P.data_ptr<float>(), U.data_ptr<float>(), b, y.data_ptr<float>(), y.stride(0), y.stride(1), y.stride(2),
     y.stride(3), Hp, Wp, C, K, r0, no, thn, TW, y.size(2), y.size(3), R, taps);
}

// U (alpha^2, C, K) = G w G^T of the 3 x 3 filters w (logical (K, C, 3, 3), any strides; flipped:
// the 180-degree rotated filters), G (alpha, 3): 16 filters (k) at a time in registers, two
// separable passes (alpha * 9 + alpha^2 * 3 FMAs a lane), U's K rows written once. The torch
// path (a transposing copy, then a (alpha^2 x 9) . (9 x C K) mm) ran 0.44-0.67 / 0.78-0.97 ms at
// C = K = 256 (F(2,3) / F(4,3), 2 threads, EPYC), this one 0.29-0.39 / 0.50-0.53 (the AVX-512
// gather of f32 taps: 0.37-0.44 / 0.64-0.76 with scalar loads)
template <typename T>
void filter_rows(const T* w, const float* G, float* U, int64_t A, int64_t C, int64_t K, int64_t sk, int64_t sc,
                 int64_t sr, int64_t ss, bool flipped) {
#ifdef NNPRIM_WINO_AVX512
  const bool gather = sk > 0 && sk * (L - 1) < (1ll << 31);    // 32-bit lane offsets
  const __m512i lanes = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                           _mm512_set1_epi32((int)(gather ? sk : 0)));
#endif
  // items (16 filters, a run of 64 channels), the channels innermost: each filter row's channels
  // are read in order (c outermost, nchw filters' 9 KB row stride put the 16 rows in 4 L1 sets)
  constexpr int64_t CRUN = 64;
  const int64_t kbs = (K + L - 1) / L, cruns = (C + CRUN - 1) / CRUN;
  at::parallel_for(0, kbs * cruns, 1, [&](int64_t i0, int64_t i1) {
    v16 wv[9], t[6 * 3];
    float tmp[L];
    for (int64_t item = i0; item < i1; ++item)
      for (int64_t c = (item % cruns) * CRUN, k0 = (item / cruns) * L, ce = std::min(C, c + CRUN); c < ce; ++c) {
        const int nk = (int)std::min<int64_t>(L, K - k0);
        for (int r = 0; r < 3; ++r)
          for (int s2 = 0; s2 < 3; ++s2) {
            const T* src = w + k0 * sk + c * sc + (flipped ? 2 - r : r) * sr + (flipped ? 2 - s2 : s2) * ss;
#ifdef NNPRIM_WINO_AVX512
            if constexpr (std::is_same_v<T, float>) {
              if (gather) {
                wv[r * 3 + s2] = (v16)_mm512_mask_i32gather_ps(_mm512_setzero_ps(), (__mmask16)((1u << nk) - 1),
                                                               lanes, src, 4);
                continue;
              }
            }
#endif
            for (int l = 0; l < L; ++l) tmp[l] = l < nk ? static_cast<float>(src[l * sk]) : 0.f;
            std::memcpy(&wv[r * 3 + s2], tmp, sizeof(tmp));
          }
        for (int64_t i = 0; i < A; ++i)               // t[i][s] = sum_r G[i][r] w[r][s]
          for (int s2 = 0; s2 < 3; ++s2)
            t[i * 3 + s2] = G[i * 3] * wv[s2] + G[i * 3 + 1] * wv[3 + s2] + G[i * 3 + 2] * wv[6 + s2];
        for (int64_t i = 0; i < A; ++i)               // U[i][j] = sum_s t[i][s] G[j][s]
          for (int64_t j = 0; j < A; ++j) {
            const v16 u = t[i * 3] * G[j * 3] + t[i * 3 + 1] * G[j * 3 + 1] + t[i * 3 + 2] * G[j * 3 + 2];
            store(U + ((i * A + j) * C + c) * K + k0, u, nk);
          }
      }
  });
}

void wino_filter(const at::Tensor& w, const at::Tensor& G, const at::Tensor& U, bool flipped) {
  TORCH_CHECK(w.dim() == 4 && w.size(2) == 3 && w.size(3) == 3, "w: (K, C, 3, 3)");
  TORCH_CHECK(G.dim() == 2 && G.size(1) == 3 && G.size(0) <= 6 && G.is_contiguous() &&
              G.scalar_type() == at::kFloat, "G: contiguous f32 (alpha <= 6, 3)");
  const int64_t A = G.size(0), K = w.size(0), C = w.size(1);
  TORCH_CHECK(U.is_contiguous() && U.scalar_type() == at::kFloat && U.numel() == A * A * C * K,
              "U: contiguous f32 (alpha^2, C, K)");
  const float* g = G.data_ptr<float>();
  float* u = U.data_ptr<float>();
  const int64_t sk = w.stride(0), sc = w.stride(1), sr = w.stride(2), ss = w.stride(3);
  switch (w.scalar_type()) {
    case at::kFloat: filter_rows(w.data_ptr<float>(), g, u, A, C, K, sk, sc, sr, ss, flipped); break;
    case at::kBFloat16: filter_rows(w.data_ptr<at::BFloat16>(), g, u, A, C, K, sk, sc, sr, ss, flipped); break;
    case at::kHalf: filter_rows(w.data_ptr<at::Half>(), g, u, A, C, K, sk, sc, sr, ss, flipped); break;
    default: TORCH_CHECK(false, "w: f32, bf16 or f16");
  }
}

// Mp (E, T, K) (+)= V (E, T, C) . U (E, C, K), the blocked pass's alpha^2 GEMMs on the f32
// register tile: no packing copies and no zero fill of Mp (MKL's sgemm spent ~35 % of its time
// there on rn50_r4's 36 (128 x 256) . (256 x 256) products; here 10-15 % faster than torch.bmm at
// 1 and 2 threads). Rows within an e contiguous (V and Mp may be slices along T). Work items are
// (e, a run of at most 48 rows): U[e]'s column blocks stay in L2 across the run's row tiles
inline bool rows_dense(const at::Tensor& t) { return t.dim() == 3 && t.stride(2) == 1 && t.stride(1) == t.size(2); }

void wino_gemm(const at::Tensor& V, const at::Tensor& U, const at::Tensor& Mp, bool add) {
  TORCH_CHECK(rows_dense(V) && V.scalar_type() == at::kFloat, "V: f32 (E, T, C), rows contiguous");
  TORCH_CHECK(U.dim() == 3 && U.is_contiguous() && U.scalar_type() == at::kFloat && U.size(0) == V.size(0) &&
              U.size(1) == V.size(2), "U: contiguous f32 (E, C, K)");
  TORCH_CHECK(rows_dense(Mp) && Mp.scalar_type() == at::kFloat && Mp.size(0) == V.size(0) &&
              Mp.size(1) == V.size(1) && Mp.size(2) == U.size(2), "Mp: f32 (E, T, K), rows contiguous");
  const int64_t E = V.size(0), T = V.size(1), C = V.size(2), K = U.size(2), sv = V.stride(0), sm = Mp.stride(0);
  TORCH_CHECK(K % L == 0, "K must be a multiple of 16");
  constexpr int64_t RUN = 48;
  const int64_t runs = (T + RUN - 1) / RUN;
  const float* v = V.data_ptr<float>();
  const float* u = U.data_ptr<float>();
  float* mp = Mp.data_ptr<float>();
  at::parallel_for(0, E * runs, 1, [&](int64_t w0, int64_t w1) {
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t e = w / runs, t0 = (w % runs) * RUN, t1 = std::min(T, t0 + RUN);
      f32_gemm(v + e * sv + t0 * C, u + e * C * K, mp + e * sm + t0 * K, t1 - t0, C, K, add);
    }
  });
}

void wino_input(const at::Tensor& P, const at::Tensor& V, int64_t m, int64_t r0, int64_t thn, int64_t TW) {
  TORCH_CHECK(P.dim() == 4 && P.is_contiguous() && P.scalar_type() == at::kFloat, "P: contiguous f32 (nb, Hp, Wp, C)");
  TORCH_CHECK(V.is_contiguous() && V.scalar_type() == at::kFloat, "V: contiguous f32");
  TORCH_CHECK(m == 4 || m == 2, "m must be 2 or 4");
  const int64_t nb = P.size(0), Hp = P.size(1), Wp = P.size(2), C = P.size(3), tiles = nb * thn * TW;
  const int64_t a = m + 2;
  TORCH_CHECK(V.numel() >= a * a * tiles * C, "V too small");
  TORCH_CHECK(r0 + m * thn + 2 <= Hp && m * TW + 2 <= Wp, "tiles outside P");
  auto fn = m == 4 ? input_tiles<6> : input_tiles<4>;
  fn(P.data_ptr<float>(), V.data_ptr<float>(), Hp, Wp, C, r0, thn, TW, tiles);
}

void wino_output(const at::Tensor& Mp, const std::optional<at::Tensor>& bias, const at::Tensor& y, int64_t m,
                 int64_t thn, int64_t TW) {
  TORCH_CHECK(Mp.dim() == 3 && Mp.is_contiguous() && Mp.scalar_type() == at::kFloat, "Mp: contiguous f32");
  TORCH_CHECK(y.dim() == 4 && y.scalar_type() == at::kFloat, "y: f32 (nb, K, rows, cols)");
  TORCH_CHECK(m == 4 || m == 2, "m must be 2 or 4");
  const int64_t a = m + 2, tiles = Mp.size(1), K = Mp.size(2);
  TORCH_CHECK(Mp.size(0) == a * a && y.size(1) == K && tiles == y.size(0) * thn * TW, "shapes");
  TORCH_CHECK(y.size(2) <= m * thn && y.size(3) <= m * TW, "y larger than the tiles");
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->is_contiguous() && bias->scalar_type() == at::kFloat && bias->numel() == K, "bias: f32 (K)");
    b = bias->data_ptr<float>();
  }
  if (y.stride(3) == 1 && y.stride(1) != 1) {
    auto fn = m == 4 ? output_rows<6> : output_rows<4>;
    fn(Mp.data_ptr<float>(), b, y.data_ptr<float>(), y.stride(0), y.stride(1), y.stride(2), K, thn, TW, tiles,
       y.size(2), y.size(3));
    return;
  }
  auto fn = m == 4 ? output_tiles<6> : output_tiles<4>;
  fn(Mp.data_ptr<float>(), b, y.data_ptr<float>(), y.stride(0), y.stride(1), y.stride(2), y.stride(3), K, thn, TW,
     tiles, y.size(2), y.size(3));
}

void wino_stage(const at::Tensor& x, const at::Tensor& P, int64_t pt, int64_t pl) {
  TORCH_CHECK(x.dim() == 4 && x.stride(3) == 1, "x: (nb, C, H, W) with W contiguous");
  TORCH_CHECK(P.dim() == 4 && P.is_contiguous() && P.scalar_type() == at::kFloat, "P: contiguous f32 (nb, Hp, Wp, C)");
  const int64_t nb = x.size(0), C = x.size(1), H = x.size(2), W = x.size(3), Hp = P.size(1), Wp = P.size(2);
  TORCH_CHECK(P.size(0) == nb && P.size(3) == C && pt >= 0 && pl >= 0 && pt + H <= Hp && pl + W <= Wp,
              "x outside P");
  const int64_t sn = x.stride(0), sc = x.stride(1), sh = x.stride(2);
  float* d = P.data_ptr<float>();
  switch (x.scalar_type()) {
    case at::kFloat: stage_rows(x.data_ptr<float>(), d, nb, C, H, W, sn, sc, sh, Hp, Wp, pt, pl); break;
    case at::kBFloat16: stage_rows(x.data_ptr<at::BFloat16>(), d, nb, C, H, W, sn, sc, sh, Hp, Wp, pt, pl); break;
    case at::kHalf: stage_rows(x.data_ptr<at::Half>(), d, nb, C, H, W, sn, sc, sh, Hp, Wp, pt, pl); break;
    default: TORCH_CHECK(false, "x: f32, bf16 or f16");
  }
}
}  // namespace

TORCH_LIBRARY(nnprim_cpu, lib) {
  lib.def("wino_input(Tensor P, Tensor(a!) V, int m, int r0, int thn, int TW) -> ()");
  lib.def("wino_output(Tensor Mp, Tensor? bias, Tensor(a!) y, int m, int thn, int TW) -> ()");
  lib.def("wino_stage(Tensor x, Tensor(a!) P, int pt, int pl) -> ()");
  lib.def("wino_filter(Tensor w, Tensor G, Tensor(a!) U, bool flipped) -> ()");
  lib.def("wino_gemm(Tensor V, Tensor U, Tensor(a!) Mp, bool add) -> ()");
  lib.def("wino_fused(Tensor P, Tensor U, Tensor? bias, Tensor(a!) y, int m, int r0, int thn, int TW, int R, "
          "int taps) -> ()");
}
TORCH_LIBRARY_IMPL(nnprim_cpu, CPU, lib) {
  lib.impl("wino_input", &wino_input);
  lib.impl("wino_output", &wino_output);
  lib.impl("wino_stage", &wino_stage);
  lib.impl("wino_fused", &wino_fused);
  lib.impl("wino_gemm", &wino_gemm);
  lib.impl("wino_filter", &wino_filter);
}
"""

LIBRARY = NativeLibrary("nnprim_cpu", NATIVE_HELPERS + SOURCE, "native CPU Winograd transforms")


def expected() -> bool:
    """Whether the native transforms should be there, without building them (estimates)."""
    return LIBRARY.expected()


def ops():
    """torch.ops.nnprim_cpu once the native transforms are built and loaded (first call:
    compiles, ~20-40 s), or None (disabled, no compiler, not Linux/x86: the torch-op path runs)."""
    return LIBRARY.ops()
