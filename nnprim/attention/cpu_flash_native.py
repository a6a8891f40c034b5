"""Native CPU flash attention: forward (solver 117 `cpu_flash_fwd_native`) and backward (118
`cpu_flash_bwd_native`), issue 16.

Solver 115 (cpu_flash.py) runs the forward as a dozen torch ops per score tile: its scores
are f32 GEMMs (torch's CPU ops have no bf16 GEMM with an f32 result), and every tile goes
through memory between the ops. This one is a C++ loop (nnprim/native.py builds it once per
machine) over (b, query head, block of QB query rows), parallel over those with ATen's pool,
around oneDNN's batch-reduce GEMM micro-kernel as torch exports it
(`at::native::cpublas::brgemm`, the kernel of torch's own CPU flash attention: AMX for bf16
with f32 accumulation; elsewhere, and for f32, its plain path, oneDNN's GEMM):

    per key block of KB keys:  S = Q K^T (f32)     P = exp(scale S - m') (masked: 0)
                               l = l e^(m - m') + rowsum P,   acc = acc e^(m - m') + P V
    o = acc / l,  lse = m + log l

With bf16 on AMX or avx512_bf16 (`vnni_packs`), K^T and V are laid out once per call and
(b, kv head) in 64-column VNNI blocks (the B layout of oneDNN's bf16 brgemm: K by one SIMD
transpose of 32-bit words per block, V by interleaving key rows in pairs; zero past Sk and Dv),
so every query block and every query head of a GQA group reuses them; f32 reads K^T (one SIMD
transpose per call) and V in place through brgemm's plain path (for bf16 that path is oneDNN's
GEMM, which packs B on every call: 2.2-2.5x slower than VNNI blocks on an AMD EPYC). The softmax runs on ATen's 16-lane vectors
while the tile is in cache; P is rounded to bf16 for the P V product in bf16 problems (as
torch's kernel does). f32 takes ATen's `exp_u20` (o within ~4e-7 of float64); bf16 its faster
`fexp_u20` (~5e-5 relative: lse within ~3e-5 of float64, far below bf16's rounding).

Backward (118), per (b, kv head) so that dK and dV sum the G query heads' terms without
atomics and dQ accumulates in place: K^T and V^T once per head (fbgemm's SIMD transpose), then
per key block of 256 keys and block of 64 query rows S = Q K^T and dP = dO V^T (f32),
P = exp(scale S - lse), dS = P (dP - D) with D = rowsum(dO O) (0 on rows that see no key),
and dV += P^T dO, dK += dS^T Q, dQ += dS K with P and dS in the input dtype (transposed by
the same SIMD transpose): f32 through brgemm's plain path (oneDNN's GEMM); bf16 where
`vnni_packs` with every B operand in VNNI blocks, packed once per (b, kv head): K^T and V^T as
the forward's K, the rows of K, Q and dO in pairs (an odd query or key tail padded with zeros).

Covers: f32 and bf16, GQA/MQA, causal (both alignments), no mask, float scale (inverted or
not), softmax_inf_as_zero, return_lse, dropout (nnprim.dropout's keep flags computed per
row of each tile: the forward scales the kept P before P V, the backward takes them in dV and
dS), last dims contiguous (any other strides). Rows that see no key: lse = -inf, o = NaN (0
with softmax_inf_as_zero), zero gradients, as solvers 115/116. Everything else (masks,
kv_lens, f16, quantized / paged / FP8 K/V) stays with 115/116.
"""
from __future__ import annotations

import functools
import math

import torch

from .. import alloc
from ..args import AttnArgs
from ..dropout import dropout_scale, dropout_threshold, seed_value, wrap64
from ..native import NATIVE_HELPERS, NativeLibrary
from ..problems.attention import AttentionProblem
from ..search.solver import register
from .cpu_flash import _CpuFlashBase, _native_bf16, cpu_backward, cpu_forward, plan

SOURCE = r"""
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/native/CPUBlas.h>
#include <torch/library.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace fbgemm {   // exported by libtorch_cpu (ATen's cpu/utils.h transposes with it)
template <typename T>
void transpose_simd(int64_t M, int64_t N, const T* src, int64_t ld_src, T* dst, int64_t ld_dst);
}

namespace {
using fVec = at::vec::Vectorized<float>;
namespace cb = at::native::cpublas;
constexpr int64_t NB = 64;          // columns of a packed block (oneDNN's pack: at most 64)
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

inline float row_max(const float* s, int64_t n, float scale) {
  fVec vm(NEG_INF);
  int64_t j = 0;
  for (; j + fVec::size() <= n; j += fVec::size()) vm = at::vec::maximum(vm, fVec::loadu(s + j));
  float m = at::vec::vec_reduce_all<float>([](fVec& a, fVec& b) { return at::vec::maximum(a, b); }, vm);
  for (; j < n; ++j) m = std::max(m, s[j]);
  return m * scale;   // scale > 0 here (a negative scale is folded into q by the caller)
}

// min(x, 0), NaN kept (min's second operand is returned when one is NaN): the backward's scale s -
// lse is <= 0 in exact arithmetic, but lse holds rounded products while fmsub subtracts from the
// exact one, off by up to half an ulp of the score (128 at 3e9: exp overflowed)
inline fVec non_positive(const fVec& x) {
#if defined(CPU_CAPABILITY_AVX512)
  return fVec(_mm512_min_ps(_mm512_setzero_ps(), static_cast<__m512>(x)));
#elif defined(CPU_CAPABILITY_AVX2)
  return fVec(_mm256_min_ps(_mm256_setzero_ps(), static_cast<__m256>(x)));
#else
  return at::vec::minimum(x, fVec(0.f));
#endif
}

// p[j] = exp(scale s[j] - m) for j < n, 0 for n <= j < width; returns the sum
// exp(scale x - m): f32 with ATen's exp_u20 (o within ~4e-7 of float64); bf16 with its faster
// fexp_u20 (a degree-3 polynomial of 2^frac: ~5e-5 relative, far below bf16's rounding of P
// and o; 20 % of the bf16 forward's time on the suite's problems)
template <bool FAST>
inline fVec exp_scaled(const float* s, const fVec& vs, const fVec& vm) {
  fVec x = at::vec::fmsub(fVec::loadu(s), vs, vm);   // |x| off by <= 0.5 here: rows past 1e7 come rounded
  if constexpr (FAST) return x.fexp_u20();
  else return x.exp_u20();
}

template <typename T>
inline float exp_row(const float* s, T* p, int64_t n, int64_t width, float scale, float m) {
  fVec vs(scale), vm(m), sum(0.f);
  int64_t j = 0;
  if constexpr (std::is_same_v<T, float>) {
    for (; j + fVec::size() <= n; j += fVec::size()) {
      fVec x = exp_scaled<false>(s + j, vs, vm);
      sum = sum + x;
      x.store(p + j);
    }
  } else {                      // two f32 vectors -> one bf16 vector (round to nearest even)
    for (; j + 2 * fVec::size() <= n; j += 2 * fVec::size()) {
      fVec x0 = exp_scaled<true>(s + j, vs, vm), x1 = exp_scaled<true>(s + j + fVec::size(), vs, vm);
      sum = sum + x0 + x1;
#if defined(__AVX512BF16__) && defined(CPU_CAPABILITY_AVX512)
      _mm512_storeu_si512(reinterpret_cast<void*>(p + j),
                          (__m512i)_mm512_cvtne2ps_pbh(static_cast<__m512>(x1), static_cast<__m512>(x0)));
#else
      at::vec::convert_from_float<T>(x0, x1).store(p + j);
#endif
    }
  }
  float total = at::vec::vec_reduce_all<float>([](fVec& a, fVec& b) { return a + b; }, sum);
  for (; j < n; ++j) {
    float x = std::exp(s[j] * scale - m);
    total += x;
    p[j] = static_cast<T>(x);
  }
  for (; j < width; ++j) p[j] = static_cast<T>(0.f);
  return total;
}

inline void scale_row(float* a, int64_t n, float f) {
  fVec vf(f);
  int64_t j = 0;
  for (; j + fVec::size() <= n; j += fVec::size()) (fVec::loadu(a + j) * vf).store(a + j);
  for (; j < n; ++j) a[j] *= f;
}

template <typename T>
void flash_fwd_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& o,
                    at::Tensor& lse, double scale_d, int64_t causal, bool inf_as_zero, int64_t QB, int64_t KB,
                    bool use_vnni, bool keys_as_rows, const nnprim_native::Dropout& drop) {
  // q (B, Hq, Sq, D), k (B, Hkv, Sk, D), v (B, Hkv, Sk, Dv): last dims contiguous
  const int64_t B = q.size(0), Hq = q.size(1), Sq = q.size(2), D = q.size(3);
  const int64_t Hkv = k.size(1), Sk = k.size(2), Dv = v.size(3), G = Hq / Hkv;
  const int64_t shift = causal == 2 ? Sk - Sq : 0;
  const float scale = static_cast<float>(scale_d);
  constexpr bool BF = std::is_same_v<T, at::BFloat16>;
  // VNNI blocks where oneDNN's bf16 brgemm takes them (the caller asks: AMX or avx512_bf16,
  // `vnni_packs`); else (and when the caller asks: tests) the plain layout through brgemm's
  // fallback, oneDNN's bf16 -> f32 GEMM
  // keys_as_rows (few query rows): S^T = K Q^T reads K where it lies, so neither K nor V is
  // copied (the plain path reads V in place too); S comes back by a transpose of the small tile
  const bool vnni = BF && use_vnni && !keys_as_rows;
  const int64_t nkb = (Sk + NB - 1) / NB, SkP = nkb * NB;
  const int64_t ndv = (Dv + NB - 1) / NB, DvP = ndv * NB;
  const T* qp = q.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  using Bits = std::conditional_t<BF, uint16_t, float>;

  // without VNNI: K^T (B*Hkv, D, Sk), the B operand of S = Q K^T, transposed in 256-key slabs
  // (fbgemm's SIMD transpose; ATen's strided copy costs ~2.5 ns an element)
  const bool kt_copy = !vnni && !keys_as_rows;
  at::Tensor kt = kt_copy ? at::empty({B * Hkv, D, Sk}, q.options()) : at::Tensor();
  T* ktw = kt_copy ? kt.data_ptr<T>() : nullptr;
  const T* ktp = ktw;
  const T* kp = k.data_ptr<T>();
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1), ks2 = k.stride(2);
  if (kt_copy) {
    const int64_t SL = 256, nsl = (Sk + SL - 1) / SL;
    at::parallel_for(0, B * Hkv * nsl, 1, [&](int64_t s, int64_t e) {
      for (int64_t w = s; w < e; ++w) {
        const int64_t bh = w / nsl, k0 = (w % nsl) * SL, b = bh / Hkv, h = bh % Hkv;
        fbgemm::transpose_simd<Bits>(std::min(SL, Sk - k0), D,
                                     reinterpret_cast<const Bits*>(kp + b * ks0 + h * ks1 + k0 * ks2), ks2,
                                     reinterpret_cast<Bits*>(ktw + bh * D * Sk + k0), Sk);
      }
    });
  }
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), qs2 = q.stride(2);
  const int64_t vs0 = v.stride(0), vs1 = v.stride(1), vs2 = v.stride(2);

  // bf16 on AMX / AVX512-BF16: K^T and V in VNNI blocks of 64 columns (the B layout of oneDNN's
  // bf16 brgemm, what cpublas::pack writes), once per call and (b, kv head):
  // kp [B*Hkv][nkb][D/2][64][2]: element (d, key n) at ((d/2)*64 + n)*2 + d%2, i.e. the 32-bit
  //   words (d pairs) of 64 key rows transposed: one SIMD transpose per block, no K^T copy;
  // vq [B*Hkv][ndv][SkP/2][64][2]: rows 2i and 2i+1 of a 64-column block interleaved.
  // Zero past Sk and Dv.
  at::Tensor kpack, vpack;
  T* kpp = nullptr;
  T* vqp = nullptr;
  if (vnni) {
    kpack = at::empty({B * Hkv, nkb, D, NB}, q.options());
    vpack = at::empty({B * Hkv, ndv, SkP, NB}, q.options());
    kpp = kpack.data_ptr<T>();
    vqp = vpack.data_ptr<T>();
    at::parallel_for(0, B * Hkv * (nkb + ndv), 1, [&](int64_t s, int64_t e) {
      for (int64_t w = s; w < e; ++w) {
        const int64_t bh = w / (nkb + ndv), blk = w % (nkb + ndv);
        const int64_t b = bh / Hkv, h = bh % Hkv;
        if (blk < nkb) {          // keys [blk*64, +64): 32-bit words (d pairs) transposed
          const T* src = kp + b * ks0 + h * ks1 + blk * NB * ks2;
          T* dst = kpp + (bh * nkb + blk) * D * NB;
          const int64_t nn = std::min(NB, Sk - blk * NB);
          if (nn < NB) std::memset(dst, 0, D * NB * sizeof(T));     // keys past Sk: zero columns
          fbgemm::transpose_simd<float>(nn, D / 2, reinterpret_cast<const float*>(src), ks2 / 2,
                                        reinterpret_cast<float*>(dst), NB);
        } else {                  // columns [j*64, +64) of V: key rows interleaved in pairs
          const int64_t j = blk - nkb, nn = std::min(NB, Dv - j * NB);
          const uint16_t* src = reinterpret_cast<const uint16_t*>(vp + b * vs0 + h * vs1 + j * NB);
          uint16_t* dst = reinterpret_cast<uint16_t*>(vqp + (bh * ndv + j) * SkP * NB);
          for (int64_t r = 0; r < SkP; r += 2) {
            uint16_t* d = dst + r * NB;
            nnprim_native::interleave_rows(r < Sk ? src + r * vs2 : nullptr, r + 1 < Sk ? src + (r + 1) * vs2 : nullptr,
                                           d, nn);
            if (nn < NB) std::memset(d + 2 * nn, 0, (NB - nn) * 2 * sizeof(uint16_t));   // columns past Dv
          }
        }
      }
    });
  }

  const int64_t nqb = (Sq + QB - 1) / QB;
  T* op = o.data_ptr<T>();             // (B, Hq, Sq, Dv) in the inputs' dtype
  float* lp = lse.data_ptr<float>();
  at::parallel_for(0, B * Hq * nqb, 1, [&](int64_t s, int64_t e) {
    std::vector<float> S(QB * KB), acc(QB * DvP), m(QB), l(QB), St(keys_as_rows ? KB * QB : 0);
    std::vector<float> keep(drop.on() ? KB : 0);        // a row's dropout factors
    std::vector<T> P(BF ? QB * KB : 0), qt(keys_as_rows ? D * QB : 0);
    for (int64_t w = s; w < e; ++w) {
      const int64_t bhq = w / nqb, r0 = (w % nqb) * QB;
      const int64_t b = bhq / Hq, hq = bhq % Hq, bh = b * Hkv + hq / G;
      const int64_t M = std::min(QB, Sq - r0);
      const T* qrow = qp + b * qs0 + hq * qs1 + r0 * qs2;
      const T* krow = kp + b * ks0 + (hq / G) * ks1;
      if (keys_as_rows)                                  // Q^T (D x M): the B operand of S^T = K Q^T
        fbgemm::transpose_simd<Bits>(M, D, reinterpret_cast<const Bits*>(qrow), qs2, reinterpret_cast<Bits*>(qt.data()),
                                     M);
      const T* vrow = vp + b * vs0 + (hq / G) * vs1;
      std::fill(acc.begin(), acc.begin() + M * DvP, 0.f);
      std::fill(m.begin(), m.begin() + M, NEG_INF);
      std::fill(l.begin(), l.begin() + M, 0.f);
      int64_t kend = Sk;
      if (causal) kend = std::min(Sk, std::max<int64_t>(r0 + M - 1 + shift + 1, 0));
      for (int64_t k0 = 0; k0 < kend; k0 += KB) {
        const int64_t nk = std::min(KB, kend - k0);
        const int64_t width = vnni ? round_up(nk, NB) : nk;   // P columns the P V product reads
        if (vnni) {
          for (int64_t c = 0; c < width; c += NB)         // S[:, c:c+64] = Q K^T[:, k0+c ...]
            cb::brgemm(M, NB, D, qs2, NB, KB, false, qrow, kpp + (bh * nkb + (k0 + c) / NB) * D * NB,
                       S.data() + c, true);
        } else if (keys_as_rows) {                        // S^T (nk x M) = K Q^T, then S = (S^T)^T
          cb::brgemm(nk, M, D, ks2, M, M, false, krow + k0 * ks2, qt.data(), St.data(), false);
          fbgemm::transpose_simd<float>(nk, M, St.data(), M, S.data(), KB);
        } else {
          cb::brgemm(M, nk, D, qs2, Sk, KB, false, qrow, ktp + bh * D * Sk + k0, S.data(), false);
        }
        for (int64_t i = 0; i < M; ++i) {
          int64_t n = nk;
          if (causal) n = std::min(nk, std::max<int64_t>(r0 + i + shift + 1 - k0, 0));
          float* srow = S.data() + i * KB;
          // scores past 1e7: the rounded products stored first, so that exp's argument agrees with
          // the max (fmsub's exact product is up to half an ulp off it: 128 at 3e9, and the row
          // underflowed to 0 or overflowed). rmax, max(s) scale rounded, is the max of the
          // rounded products: the same mi either way
          const float rmax = n > 0 ? row_max(srow, n, scale) : NEG_INF;
          const bool rounded = std::fabs(rmax) > 1e7f && rmax != NEG_INF;
          if (rounded) scale_row(srow, n, scale);
          const float sc = rounded ? 1.f : scale;
          const float mi = n > 0 ? std::max(m[i], rmax) : m[i];
          const float alpha = (mi == NEG_INF) ? 1.f : std::exp(m[i] - mi);
          float sum = 0.f;
          if constexpr (BF) {
            T* prow = P.data() + i * KB;
            if (mi == NEG_INF) std::fill(prow, prow + width, static_cast<T>(0.f));
            else sum = exp_row(srow, prow, n, width, sc, mi);
          } else {
            if (mi == NEG_INF) std::fill(srow, srow + width, 0.f);
            else sum = exp_row(srow, srow, n, width, sc, mi);
          }
          if (drop.on() && mi != NEG_INF) {   // l sums the kept and the dropped; P V takes the kept, scaled
            drop.factors(drop.row_base(bhq * Sq + r0 + i, Sk) + static_cast<uint64_t>(k0), n, keep.data());
            if constexpr (BF) {
              T* prow = P.data() + i * KB;
              for (int64_t j = 0; j < n; ++j) prow[j] = static_cast<T>(static_cast<float>(prow[j]) * keep[j]);
            } else {
              for (int64_t j = 0; j < n; ++j) srow[j] *= keep[j];
            }
          }
          if (alpha != 1.f) scale_row(acc.data() + i * DvP, Dv, alpha);
          l[i] = l[i] * alpha + sum;
          m[i] = mi;
        }
        if (vnni) {
          for (int64_t j = 0; j < ndv; ++j)              // acc[:, j*64 ...] += P V[k0 ..., j*64 ...]
            cb::brgemm(M, NB, width, KB, NB, DvP, true, P.data(), vqp + ((bh * ndv + j) * SkP + k0) * NB,
                       acc.data() + j * NB, true);
        } else if constexpr (BF) {
          cb::brgemm(M, Dv, nk, KB, vs2, DvP, true, P.data(), vrow + k0 * vs2, acc.data(), false);
        } else {
          cb::brgemm(M, Dv, nk, KB, vs2, DvP, true, S.data(), vrow + k0 * vs2, acc.data(), false);
        }
      }
      for (int64_t i = 0; i < M; ++i) {          // o = acc / l in place, then to T
        T* orow = op + ((bhq * Sq) + r0 + i) * Dv;
        float* arow = acc.data() + i * DvP;
        if (l[i] > 0.f) {
          scale_row(arow, Dv, 1.f / l[i]);
          lp[bhq * Sq + r0 + i] = m[i] + std::log(l[i]);
        } else {                                      // a row that sees no key
          std::fill(arow, arow + Dv, inf_as_zero ? 0.f : std::numeric_limits<float>::quiet_NaN());
          lp[bhq * Sq + r0 + i] = NEG_INF;
        }
        at::vec::convert(arow, orow, Dv);
      }
    }
    if (vnni) cb::brgemm_release(true);
  });
}

// T [rows][cols] of x (f32, row stride ldx) -> dst [cols][rows] (row stride rows) in T
template <typename T>
inline void to_t_transposed(const float* x, int64_t rows, int64_t cols, int64_t ldx, T* tmp, T* dst) {
  using Bits = std::conditional_t<std::is_same_v<T, float>, float, uint16_t>;
  for (int64_t r = 0; r < rows; ++r)
    at::vec::convert(x + r * ldx, tmp + r * cols, cols);
  fbgemm::transpose_simd<Bits>(rows, cols, reinterpret_cast<const Bits*>(tmp), cols, reinterpret_cast<Bits*>(dst),
                               rows);
}

template <typename T>
void flash_bwd_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& dout,
                    const at::Tensor& lse, const at::Tensor& delta, at::Tensor& dq, at::Tensor& dk, at::Tensor& dv,
                    double scale_d, int64_t causal, int64_t QB, int64_t KB, bool use_vnni,
                    const nnprim_native::Dropout& drop) {
  // q, dout (B, Hq, Sq, D / Dv), k, v (B, Hkv, Sk, D / Dv): last dims contiguous; lse, delta
  // (B, Hq, Sq) f32 contiguous (delta 0 on rows that see no key); dq, dk, dv f32 contiguous
  const int64_t B = q.size(0), Hq = q.size(1), Sq = q.size(2), D = q.size(3);
  const int64_t Hkv = k.size(1), Sk = k.size(2), Dv = v.size(3), G = Hq / Hkv;
  // bf16 with every B operand in VNNI blocks of 64 columns (the caller asks where oneDNN's brgemm
  // takes them: AMX or avx512_bf16; its plain bf16 path is oneDNN's GEMM, which packs B per call),
  // per (b, kv head): K^T and V^T as the forward's K (32-bit words transposed: S, dP), K's rows
  // in pairs (dQ), and the G heads' Q and dO rows in pairs (dK, dV); odd depths (a query block's
  // or key block's tail) padded with a zero row / column
  constexpr bool BF = std::is_same_v<T, at::BFloat16>;
  const bool vnni = BF && use_vnni;
  const int64_t nkb = (Sk + NB - 1) / NB, ndk = (D + NB - 1) / NB, ndv = (Dv + NB - 1) / NB;
  const int64_t SkE = round_up(Sk, 2), SqE = round_up(Sq, 2);
  const int64_t shift = causal == 2 ? Sk - Sq : 0;
  const float scale = static_cast<float>(scale_d);
  using Bits = std::conditional_t<std::is_same_v<T, float>, float, uint16_t>;
  const T* qp = q.data_ptr<T>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  const T* dop = dout.data_ptr<T>();
  const float* lp = lse.data_ptr<float>();
  const float* dlp = delta.data_ptr<float>();
  float* dqp = dq.data_ptr<float>();
  float* dkp = dk.data_ptr<float>();
  float* dvp = dv.data_ptr<float>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), qs2 = q.stride(2);
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1), ks2 = k.stride(2);
  const int64_t vs0 = v.stride(0), vs1 = v.stride(1), vs2 = v.stride(2);
  const int64_t ds0 = dout.stride(0), ds1 = dout.stride(1), ds2 = dout.stride(2);
  // one (b, kv head) per work item: its dK, dV sum over the G query heads without atomics, and
  // its G heads' dQ accumulate in dq itself (no other item writes them)
  at::parallel_for(0, B * Hkv, 1, [&](int64_t s, int64_t e) {
    std::vector<T> kt(vnni ? 0 : D * Sk), vt(vnni ? 0 : Dv * Sk), tmp((QB + 1) * KB), pt(KB * (QB + 1)),
        dst(KB * (QB + 1)), dsb(QB * (KB + 1));
    std::vector<T> kw(vnni ? nkb * D * NB : 0), vw(vnni ? nkb * Dv * NB : 0), kr(vnni ? ndk * SkE * NB : 0),
        qr(vnni ? G * ndk * SqE * NB : 0), dor(vnni ? G * ndv * SqE * NB : 0);
    std::vector<float> S((QB + 1) * KB), dP((QB + 1) * KB), dka(KB * D), dva(KB * Dv);
    std::vector<float> keep(drop.on() ? KB : 0);        // a row's dropout factors
    // rows [0, n) of src (row stride ld, cols columns) in pairs, 64-column blocks of R rows: dst
    // [cols/64][R][64] (R even; rows past n zero)
    auto pairs = [&](const T* src, int64_t ld, int64_t n, int64_t cols, int64_t R, T* dst) {
      for (int64_t j = 0; j * NB < cols; ++j) {
        const int64_t nn = std::min(NB, cols - j * NB);
        const uint16_t* sp = reinterpret_cast<const uint16_t*>(src + j * NB);
        for (int64_t r = 0; r < R; r += 2) {
          uint16_t* d = reinterpret_cast<uint16_t*>(dst + (j * R + r) * NB);
          nnprim_native::interleave_rows(r < n ? sp + r * ld : nullptr, r + 1 < n ? sp + (r + 1) * ld : nullptr, d, nn);
          if (nn < NB) std::memset(d + 2 * nn, 0, (NB - nn) * 2 * sizeof(uint16_t));
        }
      }
    };
    // rows of src (Sk x cols) as 32-bit words transposed per 64 rows: dst [nkb][cols][64] (zero past Sk)
    auto words_t = [&](const T* src, int64_t ld, int64_t cols, T* dst) {
      for (int64_t blk = 0; blk < nkb; ++blk) {
        const int64_t nn = std::min(NB, Sk - blk * NB);
        T* d = dst + blk * cols * NB;
        if (nn < NB) std::memset(d, 0, cols * NB * sizeof(T));
        fbgemm::transpose_simd<float>(nn, cols / 2, reinterpret_cast<const float*>(src + blk * NB * ld), ld / 2,
                                      reinterpret_cast<float*>(d), NB);
      }
    };
    for (int64_t w = s; w < e; ++w) {
      const int64_t b = w / Hkv, h = w % Hkv;
      const T* kh = kp + b * ks0 + h * ks1;
      const T* vh = vp + b * vs0 + h * vs1;
      if (vnni) {
        words_t(kh, ks2, D, kw.data());
        words_t(vh, vs2, Dv, vw.data());
        pairs(kh, ks2, Sk, D, SkE, kr.data());
        for (int64_t g = 0; g < G; ++g) {
          pairs(qp + b * qs0 + (h * G + g) * qs1, qs2, Sq, D, SqE, qr.data() + g * ndk * SqE * NB);
          pairs(dop + b * ds0 + (h * G + g) * ds1, ds2, Sq, Dv, SqE, dor.data() + g * ndv * SqE * NB);
        }
      } else {
        fbgemm::transpose_simd<Bits>(Sk, D, reinterpret_cast<const Bits*>(kh), ks2,
                                     reinterpret_cast<Bits*>(kt.data()), Sk);
        fbgemm::transpose_simd<Bits>(Sk, Dv, reinterpret_cast<const Bits*>(vh), vs2,
                                     reinterpret_cast<Bits*>(vt.data()), Sk);
      }
      for (int64_t g = 0; g < G; ++g)
        std::fill(dqp + ((b * Hq + h * G + g) * Sq) * D, dqp + ((b * Hq + h * G + g + 1) * Sq) * D, 0.f);
      for (int64_t k0 = 0; k0 < Sk; k0 += KB) {
        const int64_t nk = std::min(KB, Sk - k0);
        std::fill(dka.begin(), dka.begin() + nk * D, 0.f);
        std::fill(dva.begin(), dva.begin() + nk * Dv, 0.f);
        // query rows that see a key of the block: r + shift >= k0
        const int64_t rlo = causal ? std::max<int64_t>(k0 - shift, 0) / QB * QB : 0;
        for (int64_t g = 0; g < G; ++g) {
          const int64_t hq = h * G + g, bhq = b * Hq + hq;
          for (int64_t r0 = rlo; r0 < Sq; r0 += QB) {
            const int64_t M = std::min(QB, Sq - r0);
            const T* qi = qp + b * qs0 + hq * qs1 + r0 * qs2;
            const T* doi = dop + b * ds0 + hq * ds1 + r0 * ds2;
            if (vnni) {
              for (int64_t c = 0; c < nk; c += NB) {
                cb::brgemm(M, NB, D, qs2, NB, KB, false, qi, kw.data() + (k0 + c) / NB * D * NB, S.data() + c, true);
                cb::brgemm(M, NB, Dv, ds2, NB, KB, false, doi, vw.data() + (k0 + c) / NB * Dv * NB, dP.data() + c,
                           true);
              }
            } else {
              cb::brgemm(M, nk, D, qs2, Sk, KB, false, qi, kt.data() + k0, S.data(), false);
              cb::brgemm(M, nk, Dv, ds2, Sk, KB, false, doi, vt.data() + k0, dP.data(), false);
            }
            for (int64_t i = 0; i < M; ++i) {
              float* srow = S.data() + i * KB;
              float* prow = dP.data() + i * KB;
              const float l = lp[bhq * Sq + r0 + i], di = dlp[bhq * Sq + r0 + i];
              int64_t n = nk;
              if (causal) n = std::min(nk, std::max<int64_t>(r0 + i + shift + 1 - k0, 0));
              if (l == NEG_INF) n = 0;
              const fVec vs(scale), vl(l), vd(di);
              int64_t j = 0;
              if (drop.on()) {   // dV takes the kept P (scaled); dS = P (dP kept, scaled - D)
                drop.factors(drop.row_base(bhq * Sq + r0 + i, Sk) + static_cast<uint64_t>(k0), n, keep.data());
                for (; j + fVec::size() <= n; j += fVec::size()) {
                  const fVec p = non_positive(at::vec::fmsub(fVec::loadu(srow + j), vs, vl)).exp_u20();
                  const fVec f = fVec::loadu(keep.data() + j);
                  (p * f).store(srow + j);
                  (p * (fVec::loadu(prow + j) * f - vd)).store(prow + j);
                }
                for (; j < n; ++j) {
                  const float p = std::exp(std::min(srow[j] * scale - l, 0.f)), f = keep[j];
                  srow[j] = p * f;
                  prow[j] = p * (prow[j] * f - di);
                }
              }
              for (; j + fVec::size() <= n; j += fVec::size()) {   // P = exp(scale S - lse), dS = P (dP - D)
                fVec p = non_positive(at::vec::fmsub(fVec::loadu(srow + j), vs, vl)).exp_u20();
                p.store(srow + j);
                (p * (fVec::loadu(prow + j) - vd)).store(prow + j);
              }
              for (; j < n; ++j) {
                const float p = std::exp(std::min(srow[j] * scale - l, 0.f));
                srow[j] = p;
                prow[j] = p * (prow[j] - di);
              }
              for (; j < nk; ++j) srow[j] = prow[j] = 0.f;
            }
            // dV += P^T dO, dK += dS^T Q, dQ += dS K (P and dS in the input dtype)
            if (vnni) {     // depths M and nk made even by a zero row of P / dS and a zero column of dS
              const int64_t Mp = round_up(M, 2), nkE = round_up(nk, 2);
              if (Mp > M) {
                std::fill(S.data() + M * KB, S.data() + M * KB + nk, 0.f);
                std::fill(dP.data() + M * KB, dP.data() + M * KB + nk, 0.f);
              }
              to_t_transposed(S.data(), Mp, nk, KB, tmp.data(), pt.data());
              to_t_transposed(dP.data(), Mp, nk, KB, tmp.data(), dst.data());
              for (int64_t i = 0; i < M; ++i) {
                at::vec::convert(dP.data() + i * KB, dsb.data() + i * nkE, nk);
                if (nkE > nk) dsb[i * nkE + nk] = static_cast<T>(0.f);
              }
              const T* qg = qr.data() + g * ndk * SqE * NB;
              const T* dog = dor.data() + g * ndv * SqE * NB;
              for (int64_t j = 0; j < ndv; ++j)
                cb::brgemm(nk, std::min(NB, Dv - j * NB), Mp, Mp, NB, Dv, true, pt.data(), dog + (j * SqE + r0) * NB,
                           dva.data() + j * NB, true);
              for (int64_t j = 0; j < ndk; ++j) {
                cb::brgemm(nk, std::min(NB, D - j * NB), Mp, Mp, NB, D, true, dst.data(), qg + (j * SqE + r0) * NB,
                           dka.data() + j * NB, true);
                cb::brgemm(M, std::min(NB, D - j * NB), nkE, nkE, NB, D, true, dsb.data(),
                           kr.data() + (j * SkE + k0) * NB, dqp + (bhq * Sq + r0) * D + j * NB, true);
              }
            } else {
              to_t_transposed(S.data(), M, nk, KB, tmp.data(), pt.data());
              to_t_transposed(dP.data(), M, nk, KB, tmp.data(), dst.data());
              for (int64_t i = 0; i < M; ++i) at::vec::convert(dP.data() + i * KB, dsb.data() + i * nk, nk);
              cb::brgemm(nk, Dv, M, M, ds2, Dv, true, pt.data(), doi, dva.data(), false);
              cb::brgemm(nk, D, M, M, qs2, D, true, dst.data(), qi, dka.data(), false);
              cb::brgemm(M, D, nk, nk, ks2, D, true, dsb.data(), kh + k0 * ks2, dqp + (bhq * Sq + r0) * D, false);
            }
          }
        }
        float* dkrow = dkp + ((b * Hkv + h) * Sk + k0) * D;
        for (int64_t x = 0; x < nk * D; ++x) dkrow[x] = dka[x] * scale;
        std::copy(dva.begin(), dva.begin() + nk * Dv, dvp + ((b * Hkv + h) * Sk + k0) * Dv);
      }
      for (int64_t g = 0; g < G; ++g) {
        float* d = dqp + ((b * Hq + h * G + g) * Sq) * D;
        for (int64_t x = 0; x < Sq * D; ++x) d[x] *= scale;
      }
    }
    if (vnni) cb::brgemm_release(true);
  });
}

void flash_bwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& dout,
               const at::Tensor& lse, const at::Tensor& delta, at::Tensor& dq, at::Tensor& dk, at::Tensor& dv,
               double scale, int64_t causal, int64_t q_block, int64_t kv_block, bool use_vnni, int64_t seed,
               int64_t offset, int64_t threshold, double inv_keep) {
  const nnprim_native::Dropout drop(seed, offset, threshold, inv_keep);
  TORCH_CHECK(!use_vnni || (kv_block % NB == 0 && q_block % 2 == 0), "flash_bwd: VNNI needs 64-key blocks, even q blocks");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1 && dout.stride(3) == 1,
              "last dims must be contiguous");
  TORCH_CHECK(lse.is_contiguous() && delta.is_contiguous() && dq.is_contiguous() && dk.is_contiguous() &&
              dv.is_contiguous(), "lse, delta, dq, dk, dv: contiguous");
  if (q.scalar_type() == at::kBFloat16)
    flash_bwd_impl<at::BFloat16>(q, k, v, dout, lse, delta, dq, dk, dv, scale, causal, q_block, kv_block, use_vnni,
                                 drop);
  else if (q.scalar_type() == at::kFloat)
    flash_bwd_impl<float>(q, k, v, dout, lse, delta, dq, dk, dv, scale, causal, q_block, kv_block, false, drop);
  else
    TORCH_CHECK(false, "flash_bwd: bf16 or f32");
}

void flash_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& o, at::Tensor& lse,
               double scale, int64_t causal, bool inf_as_zero, int64_t q_block, int64_t kv_block, bool use_vnni,
               bool keys_as_rows, int64_t seed, int64_t offset, int64_t threshold, double inv_keep) {
  const nnprim_native::Dropout drop(seed, offset, threshold, inv_keep);
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1, "last dims must be contiguous");
  TORCH_CHECK(o.is_contiguous() && lse.is_contiguous() && o.scalar_type() == q.scalar_type(),
              "o: contiguous, q's dtype");
  TORCH_CHECK(kv_block % NB == 0 && q_block > 0, "kv_block must be a multiple of 64");
  if (q.scalar_type() == at::kBFloat16)
    flash_fwd_impl<at::BFloat16>(q, k, v, o, lse, scale, causal, inf_as_zero, q_block, kv_block, use_vnni,
                                 keys_as_rows, drop);
  else if (q.scalar_type() == at::kFloat)
    flash_fwd_impl<float>(q, k, v, o, lse, scale, causal, inf_as_zero, q_block, kv_block, false, keys_as_rows, drop);
  else
    TORCH_CHECK(false, "flash_fwd: bf16 or f32");
}
bool vnni_packs() { return cb::could_pack(at::kBFloat16); }
}  // namespace

TORCH_LIBRARY(nnprim_cpu_attn, m) {
  m.def("vnni_packs() -> bool");
  m.def("flash_fwd(Tensor q, Tensor k, Tensor v, Tensor(a!) o, Tensor(b!) lse, float scale, int causal, "
        "bool inf_as_zero, int q_block, int kv_block, bool use_vnni, bool keys_as_rows=False, int seed=0, "
        "int offset=0, int threshold=0, float inv_keep=1.0) -> ()");
  m.def("flash_bwd(Tensor q, Tensor k, Tensor v, Tensor dout, Tensor lse, Tensor delta, Tensor(a!) dq, "
        "Tensor(b!) dk, Tensor(c!) dv, float scale, int causal, int q_block, int kv_block, bool use_vnni=False, "
        "int seed=0, int offset=0, int threshold=0, float inv_keep=1.0) -> ()");
}
TORCH_LIBRARY_IMPL(nnprim_cpu_attn, CPU, m) {
  m.impl("flash_fwd", &flash_fwd);
  m.impl("flash_bwd", &flash_bwd);
}
TORCH_LIBRARY_IMPL(nnprim_cpu_attn, CompositeExplicitAutograd, m) {
  m.impl("vnni_packs", &vnni_packs);
}
"""

LIBRARY = NativeLibrary("nnprim_cpu_attn", NATIVE_HELPERS + SOURCE, "native CPU flash attention")
# query rows per work item and keys per softmax step: a 128 x 1024 f32 score tile (512 KB, in L2);
# of (64, 128, 256) x (512, 1024) on the benchmark's problems this was the best or within its
# noise (benchmarks/attention_cpu.py, 2026-12-01)
Q_BLOCK = 128
KV_BLOCK = 1024
# bf16 with K / V in VNNI blocks (AMX): 256 keys per step, the 128 x 256 score tile and its bf16
# P next to the head's packed K / V in a core's 2 MB L2. Against 1024 on the AMX machine
# (2026-12-02, 2 threads, torch's SDPA interleaved, S1024 D64 / S2048 D128): 0.81-0.89x ->
# 0.86-0.97x torch in three runs; f32 keeps 1024 (1.02-1.11x vs 1.00-1.03x with 256). VNNI blocks
# without AMX (AMD EPYC, 2026-12-03, 9 alternated calls): 1024 keys 7.4 / 48.7 ms, 256 7.8 / 51.6
KV_BLOCK_VNNI = 256
SHORT_Q = 64        # query rows per head up to which the forward reads K / V in place (keys_as_rows)
BWD_Q_BLOCK = 64    # backward: a 64 x 256 tile of S, dP, P^T, dS^T per step
BWD_KV_BLOCK = 256
_CAUSAL = {None: 0, "top_left": 1, "bottom_right": 2}


def scope_reasons(problem: AttentionProblem) -> list[str]:
    """What solvers 117/118 leave to 115/116."""
    reasons = []
    if problem.dtype not in (torch.float32, torch.bfloat16):
        reasons.append(f"dtype {problem.dtype}: bf16 or f32 only (cpu_flash_fwd covers f16)")
    for what, on in (("masks", problem.mask != "none"), ("kv_lens", problem.has_kv_lens),
                     ("quantized K/V", bool(problem.k_quant or problem.v_quant)),
                     ("paged K/V", bool(problem.page_size)), ("FP8", problem.fp8),
                     ("a tensor scale", problem.scale == "tensor")):
        if on:
            reasons.append(f"{what} not supported (cpu_flash_fwd covers them)")
    if problem.dtype == torch.bfloat16 and (problem.D % 2 or problem.Dv % 2):
        reasons.append(f"odd head dims D={problem.D}, Dv={problem.Dv} in bf16 (VNNI pairs)")
    reasons += LIBRARY.missing_reasons()
    return reasons


def _dropout(problem: AttentionProblem, args: AttnArgs) -> tuple[int, int, int, float]:
    """(seed as int64 bits, offset, threshold, 1 / (1 - p)) of the kernels' dropout (threshold 0: none)."""
    if problem.dropout_p <= 0:
        return 0, 0, 0, 1.0
    return (wrap64(seed_value(args.seed)), wrap64(args.offset), dropout_threshold(problem.dropout_p),
            dropout_scale(problem.dropout_p))


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _even_rows(t: torch.Tensor) -> torch.Tensor:
    """bf16 rows at even strides and offsets (the kernels read 16-bit pairs as 32-bit words)."""
    if t.dtype == torch.bfloat16 and (t.stride(2) % 2 or t.storage_offset() % 2 or t.stride(1) % 2 or t.stride(0) % 2):
        return t.contiguous()
    return t


def _empty(shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The kernels' outputs (tests poison them: every element must be written), without torch's
    deterministic-mode fill (nnprim.alloc)."""
    return alloc.empty(shape, dtype, "cpu")


@functools.cache
def vnni_packs(ops) -> bool:
    """Whether oneDNN's bf16 brgemm takes VNNI-packed B operands on this CPU: the forward then
    packs K / V (one answer per library handle: it is the CPU's). torch's `could_pack` answers
    for AMX only; with avx512_bf16 alone the micro-kernel (vdpbf16ps) takes them too."""
    return bool(ops.vnni_packs()) or _native_bf16()


def keys_as_rows(problem: AttentionProblem) -> bool:
    """Few query rows per head (decode, short chunks): S^T = K Q^T with K and V read where they
    lie, instead of packing (VNNI) or transposing all of K and V per call for GEMMs that
    have too few rows to repay it."""
    return problem.Sq <= SHORT_Q


def forward(problem: AttentionProblem, args: AttnArgs, ops, q_block: int = Q_BLOCK, kv_block: int | None = None,
            vnni: bool = True, by_keys: bool | None = None):
    """(o in q's dtype, lse f32) of one call. vnni=False: the plain-layout bf16 path that CPUs
    without AMX take (tests run it everywhere); by_keys: `keys_as_rows` (None: as it decides);
    kv_block None: KV_BLOCK_VNNI where K / V are packed in VNNI blocks, else KV_BLOCK."""
    scale = args.scale_value(problem.invert_scale)
    q, k, v = (_last_dim_contiguous(t) for t in (args.q, args.k, args.v))
    k = _even_rows(k)       # the VNNI packing reads K rows as 32-bit words (pairs of d)
    if scale < 0:           # the kernel's row max assumes scale > 0: the sign goes into q
        q, scale = -q, -scale
    o = _empty((problem.B, problem.Hq, problem.Sq, problem.Dv), q.dtype)
    lse = _empty((problem.B, problem.Hq, problem.Sq))
    by_keys = keys_as_rows(problem) if by_keys is None else by_keys
    if kv_block is None:
        packs = vnni and not by_keys and problem.dtype == torch.bfloat16 and bool(ops.vnni_packs())
        kv_block = KV_BLOCK_VNNI if packs else KV_BLOCK     # AMX's block; avx512_bf16 alone keeps 1024
    vnni = vnni and vnni_packs(ops)
    ops.flash_fwd(q, k, v, o, lse, scale, _CAUSAL[problem.causal], problem.inf_as_zero, q_block, kv_block, vnni,
                  by_keys, *_dropout(problem, args))
    return o, lse


def backward(problem: AttentionProblem, args: AttnArgs, ops, q_block: int = BWD_Q_BLOCK,
             kv_block: int = BWD_KV_BLOCK, vnni: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) in q's, k's, v's dtypes from args.do, args.o, args.lse. bf16 takes VNNI blocks
    where `vnni_packs` (and the blocks keep the pairs: even query blocks, 64-key multiples);
    vnni=False: the plain layout (tests)."""
    scale = args.scale_value(problem.invert_scale)
    q, k, v, do = (_even_rows(_last_dim_contiguous(t)) for t in (args.q, args.k, args.v, args.do))
    lse = args.lse.float().contiguous()
    # D_i = rowsum(dO * O), 0 on rows that see no key (their o is NaN or 0)
    delta = (do.float() * args.o.float()).sum(-1).masked_fill_(lse == -math.inf, 0.0).contiguous()
    dq = _empty(tuple(q.shape))
    dk, dv = _empty(tuple(k.shape)), _empty(tuple(v.shape))
    vnni = (vnni and problem.dtype == torch.bfloat16 and q_block % 2 == 0 and kv_block % 64 == 0
            and vnni_packs(ops))
    ops.flash_bwd(q, k, v, do, lse, delta, dq, dk, dv, scale, _CAUSAL[problem.causal], q_block, kv_block, vnni,
                  *_dropout(problem, args))
    return tuple(t if t.dtype == r.dtype else t.to(r.dtype) for t, r in ((dq, args.q), (dk, args.k), (dv, args.v)))


# against 115 / 116 on the benchmark's problems (2026-12-01, this session's AMX machine, 1 thread):
# forward f32 ~1.3x, bf16 ~2.0x; backward f32 ~1.3x, bf16 ~1.7-2.0x
NATIVE_SPEEDUP = {torch.float32: 1.2, torch.bfloat16: 2.0}
NATIVE_SPEEDUP_BWD = {torch.float32: 1.2, torch.bfloat16: 1.7}


class _NativeBase(_CpuFlashBase):
    """117 / 118: the scope of the kernels, the torch-op solver's estimate over the measured
    speed-up, and that solver's path when the library could not be built (warned once; the
    solvers are not applicable from then on)."""
    dtypes = frozenset({torch.float32, torch.bfloat16})

    def not_supported_reasons(self, problem) -> list[str]:
        return super().not_supported_reasons(problem) or scope_reasons(problem)

    def estimate(self, problem: AttentionProblem) -> float:
        return super().estimate(problem) / self.speedup.get(problem.dtype, 1.0)

    def prepare(self, problem: AttentionProblem):
        ops = LIBRARY.ops()
        if ops is None:
            pl = plan(problem)
            return self.invoker(problem, lambda args: self.fallback(problem, args, pl))
        return self.invoker(problem, lambda args: self.native(problem, args, ops))

    def invoker(self, problem: AttentionProblem, run):
        return run


@register
class CpuFlashForwardNative(_NativeBase):
    """Forward in C++ around oneDNN's brgemm: invoker(args) -> (o, lse f32 or None unless return_lse)."""
    id = 117
    name = "cpu_flash_fwd_native"
    directions = frozenset({"fwd"})
    native, fallback = staticmethod(forward), staticmethod(cpu_forward)
    speedup = NATIVE_SPEEDUP

    def invoker(self, problem: AttentionProblem, run):
        def invoke(args: AttnArgs):
            o, lse = run(args)
            return o, (lse if problem.return_lse else None)
        return invoke


@register
class CpuFlashBackwardNative(_NativeBase):
    """Backward in C++ around oneDNN's GEMMs: invoker(args) -> (dq, dk, dv) in q's, k's, v's dtypes."""
    id = 118
    name = "cpu_flash_bwd_native"
    directions = frozenset({"bwd"})
    native, fallback = staticmethod(backward), staticmethod(cpu_backward)
    speedup = NATIVE_SPEEDUP_BWD
