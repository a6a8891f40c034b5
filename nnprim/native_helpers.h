// Helpers shared by the native CPU sources (nnprim/native.py: NATIVE_HELPERS is prepended to the
// sources that use them): the VNNI interleave (oneDNN's bf16 brgemm takes B with pairs of K rows
// interleaved) and a 16 x 16 f32 register transpose.
#include <cstdint>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace nnprim_native {
#if defined(__AVX512F__)
// r[i] lane j -> r[j] lane i (16 x 16 f32): pairs of rows interleaved per 128-bit lane, then 4 x 4
// blocks within the lanes, then the 128-bit lanes across the 16 rows
inline void transpose16_regs(__m512 r[16]) {
  __m512 t[16];
#pragma GCC unroll 8
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
#pragma GCC unroll 4
  for (int i = 0; i < 16; i += 4) {             // r[i + q] lane L: column 4L + q of rows i..i+3
    const __m512d a = _mm512_castps_pd(t[i]), b = _mm512_castps_pd(t[i + 1]);
    const __m512d c = _mm512_castps_pd(t[i + 2]), d = _mm512_castps_pd(t[i + 3]);
    r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
    r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
    r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
    r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
  }
#pragma GCC unroll 4
  for (int q = 0; q < 4; ++q) {                 // gather lane L of r[q], r[4 + q], .. into row 4L + q
    const __m512 v1 = _mm512_shuffle_f32x4(r[q], r[4 + q], 0x44), v2 = _mm512_shuffle_f32x4(r[q], r[4 + q], 0xEE);
    const __m512 w1 = _mm512_shuffle_f32x4(r[8 + q], r[12 + q], 0x44), w2 = _mm512_shuffle_f32x4(r[8 + q], r[12 + q], 0xEE);
    t[q] = _mm512_shuffle_f32x4(v1, w1, 0x88);
    t[4 + q] = _mm512_shuffle_f32x4(v1, w1, 0xDD);
    t[8 + q] = _mm512_shuffle_f32x4(v2, w2, 0x88);
    t[12 + q] = _mm512_shuffle_f32x4(v2, w2, 0xDD);
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}
#endif

// d[2c] = r0[c], d[2c + 1] = r1[c] for c < n (r0 / r1 null: zeros); n <= 64. The VNNI interleave
// of two rows, 32 columns per AVX-512 step.
inline void interleave_rows(const uint16_t* r0, const uint16_t* r1, uint16_t* d, int64_t n) {
  int64_t c = 0;
#if defined(__AVX512BW__)
  if (r0 && r1) {
    static const __m512i lo = [] { alignas(64) uint16_t ix[32]; for (int i = 0; i < 32; ++i) ix[i] = (i % 2 ? 32 : 0) + i / 2;
                                   return _mm512_load_si512(ix); }();
    static const __m512i hi = [] { alignas(64) uint16_t ix[32]; for (int i = 0; i < 32; ++i) ix[i] = (i % 2 ? 32 : 0) + 16 + i / 2;
                                   return _mm512_load_si512(ix); }();
    for (; c + 32 <= n; c += 32) {
      const __m512i a = _mm512_loadu_si512(r0 + c), b = _mm512_loadu_si512(r1 + c);
      _mm512_storeu_si512(d + 2 * c, _mm512_permutex2var_epi16(a, lo, b));
      _mm512_storeu_si512(d + 2 * c + 32, _mm512_permutex2var_epi16(a, hi, b));
    }
  }
#endif
  for (; c < n; ++c) {
    d[2 * c] = r0 ? r0[c] : 0;
    d[2 * c + 1] = r1 ? r1[c] : 0;
  }
}
// Philox4x32-10 as Triton's tl.randint: key = (k0, k1) (the seed's words), counter words = (counter
// lo, counter hi, 0, 0); the first output word (nnprim.dropout's definition of the keep flags)
inline uint32_t philox_first(uint32_t k0, uint32_t k1, uint64_t counter) {
  constexpr uint32_t KEY_A = 0x9E3779B9u, KEY_B = 0xBB67AE85u, ROUND_A = 0xD2511F53u, ROUND_B = 0xCD9E8D57u;
  uint32_t c0 = static_cast<uint32_t>(counter), c1 = static_cast<uint32_t>(counter >> 32), c2 = 0, c3 = 0;
#pragma GCC unroll 10
  for (int r = 0; r < 10; ++r) {
    const uint64_t pb = static_cast<uint64_t>(ROUND_B) * c2, pa = static_cast<uint64_t>(ROUND_A) * c0;
    const uint32_t n0 = static_cast<uint32_t>(pb >> 32) ^ c1 ^ k0;
    const uint32_t n2 = static_cast<uint32_t>(pa >> 32) ^ c3 ^ k1;
    c1 = static_cast<uint32_t>(pb);
    c3 = static_cast<uint32_t>(pa);
    c0 = n0;
    c2 = n2;
    k0 += KEY_A;
    k1 += KEY_B;
  }
  return c0;
}

// A call's dropout: element (b, h, i, j) is kept iff philox(seed, offset + ((b Hq + h) Sq + i) Sk + j)
// >= threshold (threshold 0: no dropout); kept probabilities are scaled by inv_keep
struct Dropout {
  uint32_t k0 = 0, k1 = 0;
  uint64_t offset = 0, threshold = 0;
  float inv_keep = 1.f;
  Dropout(int64_t seed, int64_t off, int64_t thr, double inv)
      : k0(static_cast<uint32_t>(static_cast<uint64_t>(seed))),
        k1(static_cast<uint32_t>(static_cast<uint64_t>(seed) >> 32)),
        offset(static_cast<uint64_t>(off)), threshold(static_cast<uint64_t>(thr)), inv_keep(static_cast<float>(inv)) {}
  bool on() const { return threshold != 0; }
  // the counter of (row, key 0): row = (b Hq + h) Sq + i
  uint64_t row_base(int64_t row, int64_t Sk) const {
    return offset + static_cast<uint64_t>(row) * static_cast<uint64_t>(Sk);
  }
  // the factors (0 or inv_keep) of keys j < n of a row whose counter base is `base`: a loop of its
  // own, so that the compiler vectorises the ten rounds across keys (32 x 32 -> 64-bit multiplies)
  void factors(uint64_t base, int64_t n, float* out) const {
    const uint32_t a = k0, b = k1;
    const uint64_t thr = threshold;
    const float inv = inv_keep;
    for (int64_t j = 0; j < n; ++j) out[j] = philox_first(a, b, base + static_cast<uint64_t>(j)) >= thr ? inv : 0.f;
  }
};

}  // namespace nnprim_native
