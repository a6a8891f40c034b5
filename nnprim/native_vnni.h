// VNNI packing shared by the native CPU sources (nnprim/native.py: VNNI_HELPERS is prepended to
// the sources that use it): oneDNN's bf16 brgemm takes B with pairs of K rows interleaved.
#include <cstdint>
#if defined(__AVX512BW__)
#include <immintrin.h>
#endif

namespace nnprim_native {
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
}  // namespace nnprim_native
