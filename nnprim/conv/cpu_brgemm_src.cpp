// Native CPU convolution around oneDNN's batch-reduce GEMM micro-kernel as torch exports it
// (at::native::cpublas::brgemm: AMX for bf16 with VNNI-packed B, oneDNN's GEMM otherwise).
// Built by nnprim/native.py; the Python side (nnprim/conv/cpu_brgemm.py) stages the operands.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/native/CPUBlas.h>
#include <torch/library.h>
#include <algorithm>
#include <cstring>
#if defined(__AVX512BW__) || (defined(__AMX_TILE__) && defined(__AMX_BF16__))
#include <immintrin.h>
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#define NNPRIM_AMX 1
#endif
#include <type_traits>
#include <array>
#include <utility>
#include <vector>

namespace fbgemm {   // exported by libtorch_cpu (ATen's cpu/utils.h transposes with it)
template <typename T>
void transpose_simd(int64_t M, int64_t N, const T* src, int64_t ld_src, T* dst, int64_t ld_dst);
}

namespace {
using fVec = at::vec::Vectorized<float>;
namespace cb = at::native::cpublas;
constexpr int64_t NB = 64;      // columns of a VNNI-packed B block

// Grow-only scratch of the calling / worker thread (contents left from its last use): fresh
// buffers past malloc's mmap threshold cost a page fault per 4 KiB page each call (~1 us on
// these VMs; rn50_r4's weight gradient ~1 ms of 10, the bf16 in-place forward 235 a call)
template <typename T>
T* scratch(std::vector<T>& v, size_t n) {
  if (v.size() < n) v.resize(n);
  return v.data();
}

#ifdef NNPRIM_AMX
// Our own AMX micro-kernel for the forward's common case (bf16, channels per group a multiple of
// 32): a 32-position x 32-channel f32 block stays in four tile registers across EVERY tap and
// channel step (oneDNN's batch-reduce: torch's brgemm takes one A/B pair per call, so its C
// goes to memory between the runs). Tiles: 0-3 C (2 x 2 of 16 x 16 f32), 4-5 A (16 positions x
// 32 channels), 6-7 B (16 channel pairs x 16 output channels x 2, read from the VNNI blocks at
// a 256-byte row stride).
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

bool amx_permitted() {     // Linux: a process asks once for the AMX tile state
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /*ARCH_REQ_XCOMP_PERM*/, 18 /*XTILEDATA*/) == 0;
  return ok;
}

void amx_config() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }
  _tile_loadconfig(&cfg);
}

// acc[0 .. 32 ceil(M/32)) x [0, KP) = sum over runs r of A (positions g0 + m + off_r, channels
// cg0 + k) . B (rows row0_r + k of group g's VNNI blocks wg, Rw rows each), k < Kd_r step 32
inline void amx_block(const at::BFloat16* xp, const at::BFloat16* wg, const int64_t* rp, int64_t NR, int64_t R,
                      int64_t C, int64_t Rw, int64_t g0, int64_t cg0, int64_t M, int64_t KP, int64_t Kg, int64_t ps,
                      float* acc) {
  const int64_t sa = C * 2 * ps;     // bytes between the A rows of consecutive grid positions
  for (int64_t m0 = 0; m0 < M; m0 += 32) {
    for (int64_t n0 = 0; n0 < Kg; n0 += 32) {      // 32-column blocks holding outputs (KP pads to 64)
      _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
      const at::BFloat16* wk = wg + (n0 / NB) * Rw * NB + (n0 % NB) * 2;    // block kb, column n0 % 64
      for (int64_t r = 0; r < NR; ++r) {
        const int64_t* t = rp + 4 * r;
        const at::BFloat16* a = xp + (t[0] * R + (g0 + m0) * ps + t[1]) * C + cg0;
        const at::BFloat16* b = wk + t[3] * NB;          // row pair (row0 / 2) at 128 elements each
        for (int64_t c0 = 0; c0 < t[2]; c0 += 32) {
          _tile_loadd(4, a + c0, sa);
          _tile_loadd(5, a + c0 + 16 * C * ps, sa);
          _tile_loadd(6, b + c0 * NB, 256);
          _tile_loadd(7, b + c0 * NB + 32, 256);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 4, 7);
          _tile_dpbf16ps(2, 5, 6);
          _tile_dpbf16ps(3, 5, 7);
        }
      }
      float* c = acc + m0 * KP + n0;
      _tile_stored(0, c, KP * 4);
      _tile_stored(1, c + 16, KP * 4);
      _tile_stored(2, c + 16 * KP, KP * 4);
      _tile_stored(3, c + 16 * KP + 16, KP * 4);
    }
  }
}
#endif

using nnprim_native::interleave_rows;   // nnprim/native_helpers.h, prepended by nnprim/native.py

struct Grid {                   // flat position g = ((n U0 + u0) U1 + u1) U2 + u2, valid in [lo, hi)
  int64_t U0, U1, U2, lo0, lo1, lo2, hi0, hi1, hi2;
};

// The post-ops the forward applies to each output row while it is in cache, after the bias: a
// residual (y-shaped, channels contiguous, f32 or bf16) times res_scale, then relu with a
// negative slope. Other chains run on the whole output afterwards (cpu_brgemm.py).
struct Epilogue {
  const char* res = nullptr;
  bool res_bf16 = false;
  int64_t rs0 = 0, rs1 = 0, rs2 = 0, rs3 = 0;   // residual strides (elements) of (N, Y0, Y1, Y2)
  float res_scale = 1.f;
  bool relu = false;
  float slope = 0.f;
};

// row (n of them) += scale * residual row r, then relu; tmp holds a bf16 residual row as f32
inline void epilogue_row(float* row, const Epilogue& ep, const char* r, float* tmp, int64_t n) {
  if (r) {
    const float* f = reinterpret_cast<const float*>(r);
    if (ep.res_bf16) {
      at::vec::convert(reinterpret_cast<const at::BFloat16*>(r), tmp, n);
      f = tmp;
    }
    const fVec sc(ep.res_scale);
    int64_t k = 0;
    for (; k + fVec::size() <= n; k += fVec::size())
      at::vec::fmadd(fVec::loadu(f + k), sc, fVec::loadu(row + k)).store(row + k);
    for (; k < n; ++k) row[k] += ep.res_scale * f[k];
  }
  if (ep.relu) {
    const fVec zero(0.f), sl(ep.slope);
    int64_t k = 0;
    for (; k + fVec::size() <= n; k += fVec::size()) {
      const fVec v = fVec::loadu(row + k);
      (at::vec::maximum(v, zero) + at::vec::minimum(v, zero) * sl).store(row + k);
    }
    for (; k < n; ++k) row[k] = row[k] > 0.f ? row[k] : row[k] * ep.slope;
  }
}

// an output row: acc row (+ bias) (+ the row epilogue) into dst
template <typename TO>
inline void emit_row(float* arow, const float* bias, const Epilogue& ep, const char* rrow, float* rtmp, TO* dst,
                     int64_t Kg) {
  if (bias) {
    int64_t k = 0;
    for (; k + fVec::size() <= Kg; k += fVec::size()) (fVec::loadu(arow + k) + fVec::loadu(bias + k)).store(arow + k);
    for (; k < Kg; ++k) arow[k] += bias[k];
  }
  if (ep.res || ep.relu) epilogue_row(arow, ep, rrow, rtmp, Kg);
  if constexpr (std::is_same_v<TO, float>) std::memcpy(dst, arow, Kg * sizeof(float));
  else at::vec::convert(arow, dst, Kg);
}

#if defined(__AVX512BF16__)
// One depth pair of a register-blocked vdpbf16ps tile (br_tile here, cpu_wgrad_src.cpp's wg_tile):
// acc[m] (16 NV f32) += the bf16 pair a[m lda], a[m lda + 1] broadcast . b's VNNI pair row (32 NV
// elements)
template <int MB, int NV>
inline void dpbf16_pair(__m512 (&acc)[MB][NV], const uint16_t* a, int64_t lda, const uint16_t* b) {
  __m512bh bv[NV];
  for (int v = 0; v < NV; ++v) bv[v] = (__m512bh)_mm512_loadu_si512(b + 32 * v);
  for (int m = 0; m < MB; ++m) {
    int32_t pair;
    std::memcpy(&pair, a + m * lda, 4);
    const __m512bh av = (__m512bh)_mm512_set1_epi32(pair);
    for (int v = 0; v < NV; ++v) acc[m][v] = _mm512_dpbf16_ps(acc[m][v], av, bv[v]);
  }
}

// Batch-reduce bf16 tile on avx512_bf16 (the forward without AMX): c (MB x 16 NV f32, row stride
// ldc) = sum over i < nb of A_i (MB rows sa apart, depth d: channel pairs broadcast) . B_i (VNNI
// pairs, 2 NB elements a pair row), accumulated in registers across the batch. torch's brgemm
// takes one A/B pair a call: the forward's filter rows and passes went through C in memory.
template <int MB, int NV>
void br_tile(const at::BFloat16* const* a, const at::BFloat16* const* b, int64_t nb, int64_t sa, int64_t depth,
             float* c, int64_t ldc) {
  __m512 acc[MB][NV];
  for (int m = 0; m < MB; ++m)
    for (int v = 0; v < NV; ++v) acc[m][v] = _mm512_setzero_ps();
  for (int64_t i = 0; i < nb; ++i) {
    const uint16_t* ai = reinterpret_cast<const uint16_t*>(a[i]);
    const uint16_t* bi = reinterpret_cast<const uint16_t*>(b[i]);
    for (int64_t d = 0; d < depth; d += 2) dpbf16_pair<MB, NV>(acc, ai + d, sa, bi + d * NB);
  }
  for (int m = 0; m < MB; ++m)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(c + m * ldc + 16 * v, acc[m][v]);
}

using BrTile = void (*)(const at::BFloat16* const*, const at::BFloat16* const*, int64_t, int64_t, int64_t, float*,
                        int64_t);
template <int NV, int... M>
constexpr std::array<BrTile, sizeof...(M)> br_table(std::integer_sequence<int, M...>) {
  return {&br_tile<M + 1, NV>...};
}
constexpr int64_t br_rows(int64_t nv) { return nv == 1 ? 16 : 24 / nv; }   // accumulators + B in 32 zmm

BrTile br_pick(int64_t nv, int64_t mb) {
  static const std::array<BrTile, 16> t1 = br_table<1>(std::make_integer_sequence<int, 16>{});
  static const std::array<BrTile, 12> t2 = br_table<2>(std::make_integer_sequence<int, 12>{});
  static const std::array<BrTile, 8> t3 = br_table<3>(std::make_integer_sequence<int, 8>{});
  static const std::array<BrTile, 6> t4 = br_table<4>(std::make_integer_sequence<int, 6>{});
  switch (nv) {
    case 1: return t1[mb - 1];
    case 2: return t2[mb - 1];
    case 3: return t3[mb - 1];
    default: return t4[mb - 1];
  }
}

// out (M x KP f32) = sum over i < nb of A_i (M rows sa apart) . B_i, B_i's 64-column VNNI blocks
// Rw rows apart (nkb of them, Kn output columns)
inline void br_gemm(const at::BFloat16* const* a, const at::BFloat16* const* b, int64_t nb, int64_t M, int64_t sa,
                    int64_t depth, int64_t Kn, int64_t Rw, int64_t KP, float* out) {
  thread_local std::vector<const at::BFloat16*> ab;
  if (ab.size() < static_cast<size_t>(2 * nb)) ab.resize(2 * nb);
  const at::BFloat16** ak = ab.data();
  const at::BFloat16** bk = ab.data() + nb;
  for (int64_t kb = 0; kb * NB < Kn; ++kb) {
    const int64_t nv = (std::min(NB, Kn - kb * NB) + 15) / 16, mbmax = br_rows(nv);
    for (int64_t i = 0; i < nb; ++i) bk[i] = b[i] + kb * Rw * NB;
    for (int64_t m0 = 0; m0 < M; m0 += mbmax) {
      const int64_t mb = std::min(mbmax, M - m0);
      for (int64_t i = 0; i < nb; ++i) ak[i] = a[i] + m0 * sa;
      br_pick(nv, mb)(ak, bk, nb, sa, depth, out + m0 * KP + kb * NB, KP);
    }
  }
}
#endif

// The forward at a 3-wide, left-padded-by-1 last dim reading NHWC x in place (no staging; one
// group; bf16 on the AMX kernel (C a multiple of 32), f32 on oneDNN's GEMM). Output column j of a
// filter row reads x columns j s - 1, j s, j s + 1; column -1 (and S2) is the pad. The work is
// split into passes, GEMMs whose A rows are all inside x, each into its own f32 buffer:
//   stride 2: A rows 2C apart, one per output; pass 0 columns 2j, 2j + 1 x taps 1, 2 (depth 2C),
//             pass 1 column 2j + 1 x tap 0: output column j + 1's tap-0 term, y[j] = acc[j] + sh[j - 1]
//   stride 1: consecutive lines are consecutive rows of x (NHWC), so a block of L lines is one
//             run of L S2 positions q: pass 0 the staged kernel's GEMM (A rows C apart, depth 3C:
//             taps 0-2 on x[q - 1 .. q + 1]) for q = 1 .. L S2 - 2, which is output column j of
//             every line but its first and last (those read the pad, or the neighbouring line);
//             pass 1 column 0 of each line (x[0 .. 1] x taps 1, 2; A rows S2 C apart), pass 2
//             column S2 - 1 (x[S2 - 2 .. S2 - 1] x taps 0, 1; only with a right pad)
// Filter rows outside x (the leading dims' halo) are left out. Tiles hold exactly a pass's rows
// (16 + the rest): no junk rows.
struct Pass {
  int64_t a_off, sa, M, depth, b_off;   // A: first element, row stride; rows; depth; first weight row
};

#ifdef NNPRIM_AMX
inline void amx_config_rows(int top, int bottom) {
  TileConfig cfg;
  const int rows[8] = {top, top, bottom, bottom, top, bottom, 16, 16};
  for (int t = 0; t < 8; ++t) { cfg.rows[t] = static_cast<uint8_t>(rows[t]); cfg.colsb[t] = 64; }
  _tile_loadconfig(&cfg);
}

// A group of passes with the same rows, 32-row block by block (stride 2: both passes read the
// block's A rows while they are in L1, the nineteenth session's order)
//   rows_x[i]  the block's x row of the i-th valid filter row, wrow[i] its first weight row
//   wg (nkb, Rw, 64) VNNI blocks in filter order (rows (f, c));  out[p] (32 ceil(M/32), KP)
inline void amx_passes(const at::BFloat16* const* rows_x, const int64_t* wrow, int64_t nrows, const at::BFloat16* wg,
                       const Pass* pass, float* const* out, int npass, int64_t Rw, int64_t KP, int64_t Kg, int& cfg) {
  const int64_t M = pass[0].M;
  for (int64_t m0 = 0; m0 < M; m0 += 32) {
    const int top = static_cast<int>(std::min<int64_t>(16, M - m0));
    const int bottom = static_cast<int>(std::min<int64_t>(16, M - m0 - top));
    if (cfg != top * 32 + bottom) { amx_config_rows(top, std::max(1, bottom)); cfg = top * 32 + bottom; }
    for (int64_t n0 = 0; n0 < Kg; n0 += 32) {
      const at::BFloat16* wk = wg + (n0 / NB) * Rw * NB + (n0 % NB) * 2;
      for (int p = 0; p < npass; ++p) {
        const Pass& ps = pass[p];
        const int64_t sab = 2 * ps.sa;     // bytes between A rows
        _tile_zero(0); _tile_zero(1);
        if (bottom) { _tile_zero(2); _tile_zero(3); }
        for (int64_t i = 0; i < nrows; ++i) {
          const at::BFloat16* a = rows_x[i] + ps.a_off + m0 * ps.sa;
          const at::BFloat16* b = wk + (wrow[i] + ps.b_off) * NB;
          for (int64_t c0 = 0; c0 < ps.depth; c0 += 32) {
            _tile_loadd(4, a + c0, sab);
            _tile_loadd(6, b + c0 * NB, 256);
            _tile_loadd(7, b + c0 * NB + 32, 256);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            if (bottom) {
              _tile_loadd(5, a + c0 + 16 * ps.sa, sab);
              _tile_dpbf16ps(2, 5, 6);
              _tile_dpbf16ps(3, 5, 7);
            }
          }
        }
        float* c = out[p] + m0 * KP + n0;
        _tile_stored(0, c, KP * 4);
        _tile_stored(1, c + 16, KP * 4);
        if (bottom) {
          _tile_stored(2, c + 16 * KP, KP * 4);
          _tile_stored(3, c + 16 * KP + 16, KP * 4);
        }
      }
    }
  }
}
#endif

// Lines per block of the stride-1 in-place forward: the fewest padded 32-row tile steps per
// position (56 columns: 4 lines, 222 rows in 7 steps), at most 256 rows, and enough blocks for
// the threads
int64_t lines_per_block(int64_t S2, int64_t lines) {
  const int64_t cap = std::min(std::max<int64_t>(1, 256 / S2), std::max<int64_t>(1, lines / (4 * at::get_num_threads())));
  int64_t best = 1;
  double waste = 1e9;
  for (int64_t L = 1; L <= cap; ++L) {
    const double w = static_cast<double>((L * S2 - 2 + 31) / 32 * 32) / (L * S2);
    if (w <= waste + 1e-9) { waste = w; best = L; }
  }
  return best;
}

// y (N, O0, O1, O2, K) = the convolution of x (N, S0, S1, S2, C; positions C apart, channels
// contiguous) with stride `st` (1 or 2), width 3, pad 1 on the last dim; lead = (s0, s1, d0, d1,
// p0, p1, F0, F1) for the leading dims. bf16 (wp VNNI blocks (1, nkb, Rw, 64)): amx_passes, or
// without AMX (use_amx false) oneDNN's brgemm per filter row, pass and 64 columns; f32: oneDNN's
// GEMM per filter row and pass (wp (1, Rw, K)), the same split
template <typename T, typename TO>
void fwd_in_place_impl(const at::Tensor& x, const at::Tensor& wp, at::Tensor& y, const float* bias,
                       at::IntArrayRef lead, int64_t st, const Epilogue& ep, bool use_amx, bool own_tile) {
  constexpr bool vnni = std::is_same_v<T, at::BFloat16>;
  const bool amx = vnni && use_amx;
#if !defined(__AVX512BF16__)
  own_tile = false;
#endif
  const int64_t N = x.size(0), S0 = x.size(1), S1 = x.size(2), S2 = x.size(3), C = x.size(4), K = y.size(4);
  const int64_t O0 = y.size(1), O1 = y.size(2), O2 = y.size(3);
  const int64_t s0 = lead[0], s1 = lead[1], d0 = lead[2], d1 = lead[3], p0 = lead[4], p1 = lead[5];
  const int64_t F0 = lead[6], F1 = lead[7];
  const int64_t nkb = (K + NB - 1) / NB, KP = vnni ? nkb * NB : K, Rw = vnni ? wp.size(2) : wp.size(1);
  const T* xp = x.data_ptr<T>();
  const T* wpp = wp.data_ptr<T>();
  TO* yp = y.data_ptr<TO>();
  const int64_t xs0 = x.stride(0), xs1 = x.stride(1), xs2 = x.stride(2);
  const int64_t ys0 = y.stride(0), ys1 = y.stride(1), ys2 = y.stride(2), ys3 = y.stride(3);
  // blocks (n, o0, o1, lines): at stride 1, consecutive output lines reading consecutive x lines
  // (s1 = 1, x's lines contiguous) through the same filter rows
  const int64_t L = st == 1 && s1 == 1 && xs2 == S2 * C ? lines_per_block(S2, N * O0 * O1) : 1;
  auto rows_in = [&](int64_t o1) {     // filter rows of the second leading dim inside x, as bits
    int64_t bits = 0;
    for (int64_t f1 = 0; f1 < F1; ++f1) {
      const int64_t i1 = o1 * s1 + f1 * d1 - p1;
      if (i1 >= 0 && i1 < S1) bits |= int64_t{1} << f1;
    }
    return bits;
  };
  std::vector<int64_t> lb;             // (o1, lines) of one (n, o0) plane
  for (int64_t o1 = 0; o1 < O1;) {
    int64_t nl = 1;
    while (nl < L && o1 + nl < O1 && rows_in(o1 + nl) == rows_in(o1)) ++nl;
    lb.push_back(o1);
    lb.push_back(nl);
    o1 += nl;
  }
  const int64_t nlb = static_cast<int64_t>(lb.size()) / 2;
  // the passes of a block of nl lines (Pass::M set per block) and their buffers' rows
  const int npass = st == 2 ? 2 : (O2 == S2 ? 3 : 2);
  Pass pass[3];
  if (st == 2) {
    pass[0] = {0, 2 * C, O2, 2 * C, C};
    pass[1] = {C, 2 * C, O2, C, 0};
  } else {
    pass[0] = {0, C, 0, 3 * C, 0};
    pass[1] = {0, S2 * C, 0, 2 * C, C};
    pass[2] = {(S2 - 2) * C, S2 * C, 0, 2 * C, 0};
  }
  const int64_t rows0 = st == 2 ? O2 : L * S2, rows1 = st == 2 ? O2 : L;
  const int64_t MP0 = (rows0 + 31) / 32 * 32, MP1 = (rows1 + 31) / 32 * 32;
  at::parallel_for(0, N * O0 * nlb, 1, [&](int64_t b0, int64_t b1) {
    thread_local std::vector<float> buf_tl;   // every row a pass reads, it wrote first
    float* buf = scratch(buf_tl, (MP0 + 2 * MP1) * KP);
    std::vector<float> rtmp(ep.res_bf16 ? K : 0);
    float* bufs[3] = {buf, buf + MP0 * KP, buf + (MP0 + MP1) * KP};
    std::vector<const T*> rows_x(F0 * F1);
    std::vector<int64_t> wrow(F0 * F1);
    Pass ps[3] = {pass[0], pass[1], pass[2]};
    [[maybe_unused]] int cfg = -1;
    if (amx) cb::brgemm_release(true);   // torch's brgemm reconfigures after us
    for (int64_t w = b0; w < b1; ++w) {
      const int64_t o1 = lb[2 * (w % nlb)], nl = lb[2 * (w % nlb) + 1], o0 = (w / nlb) % O0, n = w / (nlb * O0);
      if (st == 1) {
        ps[0].M = S2 > 2 ? nl * S2 - 2 : 0;      // S2 = 2: every column a border one
        ps[1].M = ps[2].M = nl;
      }
      int64_t nr = 0;
      for (int64_t f0 = 0; f0 < F0; ++f0)
        for (int64_t f1 = 0; f1 < F1; ++f1) {
          const int64_t i0 = o0 * s0 + f0 * d0 - p0, i1 = o1 * s1 + f1 * d1 - p1;
          if (i0 < 0 || i0 >= S0 || i1 < 0 || i1 >= S1) continue;
          rows_x[nr] = xp + n * xs0 + i0 * xs1 + i1 * xs2;
          wrow[nr++] = (f0 * F1 + f1) * 3 * C;
        }
      // groups of passes with the same rows: stride 2 both; stride 1 the GEMM, then the borders
      const int ng = st == 2 ? 1 : 2;
      const int g0[3] = {0, st == 2 ? npass : 1, npass};
      for (int g = 0; g < ng; ++g) {
        const int p0 = g0[g], np = g0[g + 1] - p0;
        if (ps[p0].M == 0) continue;
        if (amx) {
#ifdef NNPRIM_AMX
          if constexpr (vnni) amx_passes(rows_x.data(), wrow.data(), nr, wpp, ps + p0, bufs + p0, np, Rw, KP, K, cfg);
#endif
        } else if (vnni && own_tile) {
#if defined(__AVX512BF16__)
          if constexpr (vnni) {
            std::vector<const at::BFloat16*> ai(nr), bi(nr);
            for (int p = p0; p < p0 + np; ++p) {
              for (int64_t i = 0; i < nr; ++i) {
                ai[i] = rows_x[i] + ps[p].a_off;
                bi[i] = wpp + (wrow[i] + ps[p].b_off) * NB;
              }
              if (nr == 0) std::fill(bufs[p], bufs[p] + ps[p].M * KP, 0.f);
              else br_gemm(ai.data(), bi.data(), nr, ps[p].M, ps[p].sa, ps[p].depth, K, Rw, KP, bufs[p]);
            }
          }
#endif
        } else {
          for (int64_t i = 0; i < nr; ++i)
            for (int p = p0; p < p0 + np; ++p) {
              if constexpr (vnni) {    // row offsets (wrow, b_off: multiples of C) even: whole VNNI pairs
                for (int64_t kb = 0; kb < nkb; ++kb)
                  cb::brgemm(ps[p].M, std::min(NB, K - kb * NB), ps[p].depth, ps[p].sa, NB, KP, i > 0,
                             rows_x[i] + ps[p].a_off, wpp + (kb * Rw + wrow[i] + ps[p].b_off) * NB,
                             bufs[p] + kb * NB, true);
              } else {
                cb::brgemm(ps[p].M, K, ps[p].depth, ps[p].sa, K, KP, i > 0, rows_x[i] + ps[p].a_off,
                           wpp + (wrow[i] + ps[p].b_off) * K, bufs[p], false);
              }
            }
          if (nr == 0)
            for (int p = p0; p < p0 + np; ++p) std::fill(bufs[p], bufs[p] + ps[p].M * KP, 0.f);
        }
      }
      for (int64_t l = 0; l < nl; ++l) {
        TO* yrow = yp + n * ys0 + o0 * ys1 + (o1 + l) * ys2;
        const char* rrow = ep.res ? ep.res + (n * ep.rs0 + o0 * ep.rs1 + (o1 + l) * ep.rs2) * (ep.res_bf16 ? 2 : 4)
                                  : nullptr;
        for (int64_t j = 0; j < O2; ++j) {
          float* arow;
          if (st == 2) {            // y[j] = acc[j] + sh[j - 1]
            arow = bufs[0] + j * KP;
            if (j > 0) {
              const float* srow = bufs[1] + (j - 1) * KP;
              int64_t k = 0;
              for (; k + fVec::size() <= K; k += fVec::size())
                (fVec::loadu(arow + k) + fVec::loadu(srow + k)).store(arow + k);
              for (; k < K; ++k) arow[k] += srow[k];
            }
          } else {
            arow = j == 0 ? bufs[1] + l * KP : j == S2 - 1 ? bufs[2] + l * KP : bufs[0] + (l * S2 + j - 1) * KP;
          }
          emit_row(arow, bias, ep, rrow ? rrow + j * ep.rs3 * (ep.res_bf16 ? 2 : 4) : nullptr, rtmp.data(),
                   yrow + j * ys3, K);
        }
      }
    }
#ifdef NNPRIM_AMX
    if (amx) _tile_release();
#endif
    if (vnni && !amx) cb::brgemm_release(true);
  });
}

// y[n, u - lo, :] (valid grid positions) = sum over runs r: xs[ph_r][g*ps + off_r, group g's Kd_r
// columns read across L consecutive positions] . W rows [row0_r, row0_r + Kd_r)   (+ bias)
//   ps  staged positions per grid position (2: a stride-2 last dim staged whole, not split in phases)
//   xs  (P, R, C) staged positions, zero halo and slack;  runs (nr, 4): phase, offset, Kd, row0
//   wp  VNNI (G, nkb, Rw, 64): row pairs interleaved;  plain (G, Rw, Kg)
//   y   (N, Y0, Y1, Y2, Ktot) any strides but the last (1), in TO
template <typename T, typename TO>
void fwd_impl(const at::Tensor& xs, const at::Tensor& wp, const at::Tensor& runs, at::Tensor& y,
              const float* bias, const Grid& gr, int64_t G, int64_t Cg, int64_t Kg, int64_t MB, bool vnni,
              bool use_amx, int64_t ps, const Epilogue& ep) {
  const int64_t N = y.size(0), C = xs.size(2), R = xs.size(1), NR = runs.size(0);
  const int64_t nkb = (Kg + NB - 1) / NB, KP = vnni ? nkb * NB : Kg, Rw = vnni ? wp.size(2) : wp.size(1);
  // Blocks of whole grid lines (u2 = 0 .. U2-1) of one (n, u0), only lines with valid u0 and
  // u1: the junk lines (bottom halo rows, other phases' rows) cost nothing; a block's first
  // line starts at lo2 and its last ends at hi2 (junk columns inside remain)
  // line: long lines (1-D signals) are cut into segments of 4 MB positions
  const int64_t L0 = gr.hi0 - gr.lo0, L1 = gr.hi1 - gr.lo1, W = gr.hi2 - gr.lo2;
  const int64_t SW = std::min(W, 4 * MB), nseg = (W + SW - 1) / SW;      // segment width
  const int64_t lpb = nseg > 1 ? 1 : std::max<int64_t>(1, std::min(L1, MB / gr.U2));   // lines per block
  const int64_t nlb = (L1 + lpb - 1) / lpb, nblk = N * L0 * nlb * nseg;
  const T* xp = xs.data_ptr<T>();
  const T* wpp = wp.data_ptr<T>();
  const int64_t* rp = runs.data_ptr<int64_t>();
  TO* yp = y.data_ptr<TO>();
  const int64_t ys0 = y.stride(0), ys1 = y.stride(1), ys2 = y.stride(2), ys3 = y.stride(3);
  if (L0 <= 0 || L1 <= 0 || W <= 0) return;
  bool amx = false;
#ifdef NNPRIM_AMX
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    amx = vnni && use_amx && Cg % 32 == 0 && amx_permitted();
    if (amx) for (int64_t r = 0; r < NR; ++r) amx = amx && rp[4 * r + 2] % 32 == 0 && rp[4 * r + 3] % 32 == 0;
  }
#endif
  at::parallel_for(0, nblk * G, 1, [&](int64_t s, int64_t e) {
    std::vector<float> acc(((lpb - 1) * gr.U2 + SW + 32) * KP), rtmp(ep.res_bf16 ? Kg : 0);
#ifdef NNPRIM_AMX
    if (amx) { cb::brgemm_release(true); amx_config(); }   // torch's brgemm reconfigures after us
#endif
    for (int64_t w = s; w < e; ++w) {
      const int64_t blk = w / G, g = w % G, seg = blk % nseg, b2 = blk / nseg;
      const int64_t lb = b2 % nlb, u0 = gr.lo0 + (b2 / nlb) % L0, nn = b2 / (nlb * L0);
      const int64_t u1 = gr.lo1 + lb * lpb, nl = std::min(lpb, gr.hi1 - u1);
      const int64_t g0 = ((nn * gr.U0 + u0) * gr.U1 + u1) * gr.U2 + gr.lo2 + seg * SW;
      const int64_t M = (nl - 1) * gr.U2 + std::min(SW, W - seg * SW);
#ifdef NNPRIM_AMX
      if constexpr (std::is_same_v<T, at::BFloat16>) {
        if (amx) amx_block(xp, wpp + g * nkb * Rw * NB, rp, NR, R, C, Rw, g0, g * Cg, M, KP, Kg, ps, acc.data());
      }
#endif
      for (int64_t r = 0; r < NR && !amx; ++r) {
        const int64_t* t = rp + 4 * r;
        const T* a = xp + (t[0] * R + g0 * ps + t[1]) * C + g * Cg;
        if (vnni) {
          for (int64_t kb = 0; kb < nkb; ++kb)
            cb::brgemm(M, std::min(NB, Kg - kb * NB), t[2], C * ps, NB, KP, r > 0, a,
                       wpp + ((g * nkb + kb) * Rw + t[3]) * NB, acc.data() + kb * NB, true);
        } else {
          cb::brgemm(M, Kg, t[2], C * ps, Kg, KP, r > 0, a, wpp + (g * Rw + t[3]) * Kg, acc.data(), false);
        }
      }
      // row i of acc is column c0 + i - l U2 of line u1 + l; the valid columns are [lo2, hi2)
      // (walked line by line: a division per row cost as much as the GEMMs on narrow groups)
      const int64_t c0 = gr.lo2 + seg * SW;
      for (int64_t l = 0; l < nl; ++l) {
        TO* yrow = yp + nn * ys0 + (u0 - gr.lo0) * ys1 + (u1 + l - gr.lo1) * ys2 + g * Kg;
        const char* rrow = ep.res ? ep.res + (nn * ep.rs0 + (u0 - gr.lo0) * ep.rs1 + (u1 + l - gr.lo1) * ep.rs2 + g * Kg)
                                                 * (ep.res_bf16 ? 2 : 4)
                                  : nullptr;
        const int64_t cend = std::min(gr.hi2, c0 + M - l * gr.U2);
        for (int64_t col = std::max(gr.lo2, c0 - l * gr.U2); col < cend; ++col) {
          float* arow = acc.data() + (l * gr.U2 + col - c0) * KP;
          emit_row(arow, bias ? bias + g * Kg : nullptr, ep,
                   rrow ? rrow + (col - gr.lo2) * ep.rs3 * (ep.res_bf16 ? 2 : 4) : nullptr, rtmp.data(),
                   yrow + (col - gr.lo2) * ys3, Kg);
        }
      }
    }
#ifdef NNPRIM_AMX
    if (amx) _tile_release();
#endif
    if (vnni && !amx) cb::brgemm_release(true);
  });
}

Epilogue make_epilogue(const at::Tensor& y, const c10::optional<at::Tensor>& res, double res_scale, bool relu,
                       double relu_slope) {
  Epilogue ep;
  ep.relu = relu;
  ep.slope = static_cast<float>(relu_slope);
  if (res.has_value()) {
    TORCH_CHECK(res->dim() == 5 && res->stride(4) == 1 && res->sizes() == y.sizes() &&
                (res->scalar_type() == at::kFloat || res->scalar_type() == at::kBFloat16),
                "conv_fwd: res (N, Y0, Y1, Y2, K) like y, f32 or bf16, last dim contiguous");
    ep.res = static_cast<const char*>(res->data_ptr());
    ep.res_bf16 = res->scalar_type() == at::kBFloat16;
    ep.rs0 = res->stride(0); ep.rs1 = res->stride(1); ep.rs2 = res->stride(2); ep.rs3 = res->stride(3);
    ep.res_scale = static_cast<float>(res_scale);
  }
  return ep;
}

void conv_fwd(const at::Tensor& xs, const at::Tensor& wp, const at::Tensor& runs, at::Tensor y,
              const c10::optional<at::Tensor>& bias, at::IntArrayRef grid, int64_t G, int64_t Cg, int64_t Kg,
              int64_t MB, bool vnni, bool use_amx, int64_t ps, const c10::optional<at::Tensor>& res,
              double res_scale, bool relu, double relu_slope) {
  TORCH_CHECK(xs.is_contiguous() && wp.is_contiguous() && runs.is_contiguous(), "conv_fwd: contiguous operands");
  TORCH_CHECK(y.dim() == 5 && y.stride(4) == 1, "conv_fwd: y (N, Y0, Y1, Y2, K), last dim contiguous");
  TORCH_CHECK(grid.size() == 9, "conv_fwd: grid (U0, U1, U2, lo0, lo1, lo2, hi0, hi1, hi2)");
  const Grid gr{grid[0], grid[1], grid[2], grid[3], grid[4], grid[5], grid[6], grid[7], grid[8]};
  const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  const Epilogue ep = make_epilogue(y, res, res_scale, relu, relu_slope);
  if (xs.scalar_type() == at::kBFloat16) {
    if (y.scalar_type() == at::kFloat)
      fwd_impl<at::BFloat16, float>(xs, wp, runs, y, b, gr, G, Cg, Kg, MB, vnni, use_amx, ps, ep);
    else
      fwd_impl<at::BFloat16, at::BFloat16>(xs, wp, runs, y, b, gr, G, Cg, Kg, MB, vnni, use_amx, ps, ep);
  } else {
    TORCH_CHECK(xs.scalar_type() == at::kFloat && y.scalar_type() == at::kFloat && !vnni, "conv_fwd: bf16 or f32");
    fwd_impl<float, float>(xs, wp, runs, y, b, gr, G, Cg, Kg, MB, false, false, ps, ep);
  }
}

// dst[n] (B x A, contiguous) = src[n]^T (src (N, A, B), rows B contiguous): nchw <-> nhwc of whole
// images by fbgemm's SIMD transpose, in slabs of 256 rows (torch's strided copy of a bf16 nchw
// block ran 2-4x slower)
void transpose_images(const at::Tensor& src, at::Tensor dst) {
  TORCH_CHECK(src.dim() == 3 && dst.dim() == 3 && src.stride(2) == 1 && dst.is_contiguous() &&
              src.scalar_type() == dst.scalar_type() && dst.size(0) == src.size(0) && dst.size(1) == src.size(2) &&
              dst.size(2) == src.size(1) && (src.element_size() == 2 || src.element_size() == 4),
              "transpose_images: src (N, A, B) rows contiguous, dst (N, B, A) contiguous, 2- or 4-byte");
  const int64_t N = src.size(0), A = src.size(1), B = src.size(2), ss0 = src.stride(0), ss1 = src.stride(1);
  const int64_t SL = 256, nsl = (A + SL - 1) / SL, es = src.element_size();
  const char* sp = static_cast<const char*>(src.data_ptr());
  char* dp = static_cast<char*>(dst.data_ptr());
  at::parallel_for(0, N * nsl, 1, [&](int64_t s, int64_t e) {
    for (int64_t w = s; w < e; ++w) {
      const int64_t n = w / nsl, a0 = (w % nsl) * SL, na = std::min(SL, A - a0);
      const char* src_p = sp + (n * ss0 + a0 * ss1) * es;
      char* dst_p = dp + (n * A * B + a0) * es;
      if (es == 2)
        fbgemm::transpose_simd<uint16_t>(na, B, reinterpret_cast<const uint16_t*>(src_p), ss1,
                                         reinterpret_cast<uint16_t*>(dst_p), A);
      else
        fbgemm::transpose_simd<float>(na, B, reinterpret_cast<const float*>(src_p), ss1, reinterpret_cast<float*>(dst_p),
                                      A);
    }
  });
}

// the forward of a 3-wide, pad-1 last dim at stride 1 or 2, x read in place (fwd_in_place_impl)
void conv_fwd_in_place(const at::Tensor& x, const at::Tensor& wp, at::Tensor y, const c10::optional<at::Tensor>& bias,
                       at::IntArrayRef lead, int64_t stride, const c10::optional<at::Tensor>& res, double res_scale,
                       bool relu, double relu_slope, bool use_amx, bool own_tile) {
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK(x.dim() == 5 && (bf16 || x.scalar_type() == at::kFloat) && wp.scalar_type() == x.scalar_type() &&
              x.stride(4) == 1 && x.stride(3) == x.size(4) && (!bf16 || x.size(4) % (use_amx ? 32 : 2) == 0),
              "conv_fwd_in_place: x (N, S0, S1, S2, C) bf16 (C % 32 == 0 on AMX, else even) or f32, "
              "positions C apart");
  TORCH_CHECK(y.dim() == 5 && y.stride(4) == 1 && y.size(0) == x.size(0) && lead.size() == 8,
              "conv_fwd_in_place: y (N, O0, O1, O2, K), last dim contiguous");
  // no A row reads past x: stride 2 needs 2 O2 <= S2; stride 1 a right pad of 0 or 1, 2+ columns
  TORCH_CHECK(stride == 2 ? 2 * y.size(3) <= x.size(3)
                          : stride == 1 && x.size(3) >= 2 && y.size(3) <= x.size(3) && y.size(3) + 1 >= x.size(3),
              "conv_fwd_in_place: output columns reading past x");
  const int64_t rows = lead[6] * lead[7] * 3 * x.size(4);
  TORCH_CHECK(wp.is_contiguous() && wp.size(0) == 1 &&
              (bf16 ? wp.dim() == 4 && wp.size(2) == rows
                    : wp.dim() == 3 && wp.size(1) == rows && wp.size(2) == y.size(4)),
              "conv_fwd_in_place: wp (1, nkb, F0 F1 3 C, 64) VNNI (bf16) or (1, F0 F1 3 C, K) (f32)");
  const Epilogue ep = make_epilogue(y, res, res_scale, relu, relu_slope);
  const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  if (!bf16) {
    TORCH_CHECK(y.scalar_type() == at::kFloat, "conv_fwd_in_place: f32 x, f32 y");
    fwd_in_place_impl<float, float>(x, wp, y, b, lead, stride, ep, false, false);
    return;
  }
  if (use_amx) {
#ifdef NNPRIM_AMX
    TORCH_CHECK(amx_permitted(), "conv_fwd_in_place: AMX not permitted");
#else
    TORCH_CHECK(false, "conv_fwd_in_place: use_amx needs the AMX build");
#endif
  }
  if (y.scalar_type() == at::kFloat) fwd_in_place_impl<at::BFloat16, float>(x, wp, y, b, lead, stride, ep, use_amx, own_tile);
  else fwd_in_place_impl<at::BFloat16, at::BFloat16>(x, wp, y, b, lead, stride, ep, use_amx, own_tile);
}

// dw[f, g] (Cg, Kg) = sum over grid positions q: X_ph(f)[q + off_f, g*Cg + c] dy[q, g*Kg + k]
//   xs (P, R, C) staged positions (the forward's), dyg (M, K) dy on the grid (zero at junk and
//   past the grid), taps (F, 2): phase, offset; chunks (nch, 2): disjoint position ranges (start,
//   length; multiples of 32 with VNNI) covering every valid position; dw (F, G, Cg, Kg) in TO.
// A work item is one (chunk, group): the chunk's x rows [q0, q0 + len + reach) of each phase are
// transposed into a thread-local (Cg, len + reach) block (in L2), whose column offsets are every
// tap's A operand (channel rows: a transposed view of the whole grid would stream Cg rows of the
// full grid length, ~4x slower); B is dy packed once in VNNI blocks (G, nkb, M2, 64) with position
// pairs interleaved (AMX) or read in place (plain). Each thread accumulates its own f32 partial of
// dw; the partials are summed at the end.
template <typename T, typename TO>
void wgrad_impl(const at::Tensor& xs, const at::Tensor& dyg, const at::Tensor& taps, const at::Tensor& chunks,
                at::Tensor& dw, int64_t G, int64_t Cg, int64_t Kg, bool vnni) {
  using Bits = std::conditional_t<std::is_same_v<T, float>, float, uint16_t>;
  const int64_t P = xs.size(0), R = xs.size(1), C = xs.size(2), M = dyg.size(0), K = dyg.size(1);
  const int64_t F = taps.size(0), M2 = (M + 1) / 2 * 2, nch = chunks.size(0);
  const int64_t nkb = (Kg + NB - 1) / NB, KP = vnni ? nkb * NB : Kg;
  const int64_t* tp = taps.data_ptr<int64_t>();
  const int64_t* chp = chunks.data_ptr<int64_t>();
  int64_t reach = 0, maxlen = 0;
  for (int64_t f = 0; f < F; ++f) reach = std::max(reach, tp[2 * f + 1]);
  for (int64_t i = 0; i < nch; ++i) {
    TORCH_CHECK(chp[2 * i] >= 0 && chp[2 * i] + chp[2 * i + 1] <= M2 && chp[2 * i] + chp[2 * i + 1] + reach <= R &&
                (!vnni || (chp[2 * i] % 2 == 0 && chp[2 * i + 1] % 2 == 0)), "conv_wgrad: bad chunk");
    maxlen = std::max(maxlen, chp[2 * i + 1]);
  }
  const T* xp = xs.data_ptr<T>();
  const T* dp = dyg.data_ptr<T>();
  at::Tensor dpk;
  const T* bp = dp;
  if (vnni) {   // (G, nkb, M2/2, 64, 2): rows 2i, 2i+1 interleaved; zero past M and Kg
    dpk = at::empty({G, nkb, M2, NB}, dyg.options());
    uint16_t* dst0 = reinterpret_cast<uint16_t*>(dpk.data_ptr<T>());
    const uint16_t* src = reinterpret_cast<const uint16_t*>(dp);
    const int64_t RB = 256, nrb = (M2 + RB - 1) / RB;
    at::parallel_for(0, G * nkb * nrb, 1, [&](int64_t s, int64_t e) {
      for (int64_t w = s; w < e; ++w) {
        const int64_t gk = w / nrb, rb = w % nrb, g = gk / nkb, kb = gk % nkb;
        const int64_t c0 = g * Kg + kb * NB, nn = std::min(NB, Kg - kb * NB);
        uint16_t* dst = dst0 + gk * M2 * NB;
        for (int64_t r = rb * RB; r < std::min(M2, (rb + 1) * RB); r += 2) {
          uint16_t* d = dst + r * NB;
          interleave_rows(r < M ? src + r * K + c0 : nullptr, r + 1 < M ? src + (r + 1) * K + c0 : nullptr, d, nn);
          if (nn < NB) std::memset(d + 2 * nn, 0, (NB - nn) * 4);
        }
      }
    });
    bp = dpk.data_ptr<T>();
  }
  const int64_t nthr = at::get_num_threads(), per = F * G * Cg * KP;
  std::vector<float> part(nthr * per);
  std::vector<char> used(nthr * F * G, 0);
  at::parallel_for(0, nch * G, 1, [&](int64_t s, int64_t e) {
    const int64_t th = at::get_thread_num();
    float* mine = part.data() + th * per;
    char* fresh = used.data() + th * F * G;
    const int64_t LW = maxlen + reach;                  // local block row length
    std::vector<T> local(P * Cg * LW);
    for (int64_t w = s; w < e; ++w) {
      const int64_t ch = w / G, g = w % G, q0 = chp[2 * ch], len = chp[2 * ch + 1];
      const int64_t lw = len + reach, kd = vnni ? len : std::min(len, M - q0);
      for (int64_t ph = 0; ph < P; ++ph)
        fbgemm::transpose_simd<Bits>(lw, Cg, reinterpret_cast<const Bits*>(xp + (ph * R + q0) * C + g * Cg), C,
                                     reinterpret_cast<Bits*>(local.data() + ph * Cg * LW), LW);
      for (int64_t f = 0; f < F; ++f) {
        const T* a = local.data() + tp[2 * f] * Cg * LW + tp[2 * f + 1];
        float* c = mine + (f * G + g) * Cg * KP;
        const bool add = fresh[f * G + g];
        fresh[f * G + g] = 1;
        if (vnni) {
          for (int64_t kb = 0; kb < nkb; ++kb)
            cb::brgemm(Cg, std::min(NB, Kg - kb * NB), kd, LW, NB, KP, add, a, bp + ((g * nkb + kb) * M2 + q0) * NB,
                       c + kb * NB, true);
        } else {
          cb::brgemm(Cg, Kg, kd, LW, K, KP, add, a, bp + q0 * K + g * Kg, c, false);
        }
      }
    }
    if (vnni) cb::brgemm_release(true);
  });
  TO* op = dw.data_ptr<TO>();
  at::parallel_for(0, F * G * Cg, 16, [&](int64_t s, int64_t e) {
    std::vector<float> row(KP);
    for (int64_t w = s; w < e; ++w) {     // w = (f, g, c): dw row
      const int64_t fg = w / Cg, c = w % Cg;
      std::fill(row.begin(), row.end(), 0.f);
      for (int64_t th = 0; th < nthr; ++th) {
        if (!used[th * F * G + fg]) continue;
        const float* src = part.data() + th * per + (fg * Cg + c) * KP;
        int64_t k = 0;
        for (; k + fVec::size() <= Kg; k += fVec::size())
          (fVec::loadu(row.data() + k) + fVec::loadu(src + k)).store(row.data() + k);
        for (; k < Kg; ++k) row[k] += src[k];
      }
      if constexpr (std::is_same_v<TO, float>) std::memcpy(op + w * Kg, row.data(), Kg * sizeof(float));
      else at::vec::convert(row.data(), op + w * Kg, Kg);
    }
  });
}

void conv_wgrad(const at::Tensor& xt, const at::Tensor& dyg, const at::Tensor& taps, const at::Tensor& chunks,
                at::Tensor dw, int64_t G, int64_t Cg, int64_t Kg, bool vnni) {
  TORCH_CHECK(xt.dim() == 3 && xt.size(2) == G * Cg, "conv_wgrad: x staged position-major (P, rows, C)");
  TORCH_CHECK(xt.is_contiguous() && dyg.is_contiguous() && taps.is_contiguous() && chunks.is_contiguous() &&
              dw.is_contiguous(), "conv_wgrad: contiguous operands");
  if (xt.scalar_type() == at::kBFloat16) {
    if (dw.scalar_type() == at::kFloat) wgrad_impl<at::BFloat16, float>(xt, dyg, taps, chunks, dw, G, Cg, Kg, vnni);
    else wgrad_impl<at::BFloat16, at::BFloat16>(xt, dyg, taps, chunks, dw, G, Cg, Kg, vnni);
  } else {
    TORCH_CHECK(xt.scalar_type() == at::kFloat && dw.scalar_type() == at::kFloat && !vnni, "conv_wgrad: bf16 or f32");
    wgrad_impl<float, float>(xt, dyg, taps, chunks, dw, G, Cg, Kg, false);
  }
}
// B operand of the kernels from weight rows: logical rows are src3[g'] (A x B) rows, or its
// columns when `transpose` (fbgemm's SIMD transpose first), flattened over g'; out group g takes
// rows index[g, :] (columns zero-padded to 64 in VNNI blocks (G, nkb, Rw, 64), pairs of rows
// interleaved; plain (G, Rw, cols))
// VNNI blocks straight from rows whose pairs are adjacent in memory: src (G*cols, rows) bf16,
// i.e. logical row pairs (2p, 2p+1) of group g's (rows x cols) matrix are the 32-bit word p of
// each source line; one SIMD transpose of 32-bit words per (g, 64-column block)
at::Tensor pack_b_pairs(const at::Tensor& src, int64_t G) {
  TORCH_CHECK(src.dim() == 2 && src.is_contiguous() && src.element_size() == 2 && src.size(1) % 2 == 0,
              "pack_b_pairs: (G*cols, rows) bf16 with an even row count");
  const int64_t cols = src.size(0) / G, rows = src.size(1), nkb = (cols + NB - 1) / NB;
  at::Tensor out = at::empty({G, nkb, rows, NB}, src.options());
  const float* sp = reinterpret_cast<const float*>(src.data_ptr());
  float* op = reinterpret_cast<float*>(out.data_ptr());
  at::parallel_for(0, G * nkb, 1, [&](int64_t s, int64_t e) {
    for (int64_t w = s; w < e; ++w) {
      const int64_t g = w / nkb, kb = w % nkb, nn = std::min(NB, cols - kb * NB);
      float* dst = op + w * (rows / 2) * NB;
      if (nn < NB) std::memset(dst, 0, (rows / 2) * NB * sizeof(float));
      fbgemm::transpose_simd<float>(nn, rows / 2, sp + (g * cols + kb * NB) * (rows / 2), rows / 2, dst, NB);
    }
  });
  return out;
}

// VNNI blocks (1, nkb, F R, 64) of one group's filter w3 (K, C, F) bf16, any strides: forward
// (twin false) rows (f, c), columns k; the stride-1 backward data's forward twin (twin true) rows
// (f', k), columns c of the tap f = F - 1 - f' (W transposed, rotated by 180 degrees). One pass,
// no permuted copies first (nchw rn50_r4: the permuting copy, flip and repack took 1.2 ms).
at::Tensor pack_taps(const at::Tensor& w3, bool twin) {
  TORCH_CHECK(w3.dim() == 3 && w3.scalar_type() == at::kBFloat16, "pack_taps: w3 (K, C, F) bf16");
  const int64_t K = w3.size(0), C = w3.size(1), F = w3.size(2);
  const int64_t R = twin ? K : C, cols = twin ? C : K, nkb = (cols + NB - 1) / NB;
  TORCH_CHECK(R % 2 == 0, "pack_taps: an even row channel count");
  const int64_t sk = w3.stride(0), sc = w3.stride(1), sf = w3.stride(2);
  const int64_t si = twin ? sk : sc, sj = twin ? sc : sk;     // strides of the row / column channel
  at::Tensor out = at::empty({1, nkb, F * R, NB}, w3.options());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w3.data_ptr());
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  if (!twin && sf == 1 && sc == F) {     // nchw forward: 64 k rows of (c, f) transposed, then c pairs interleaved
    const int64_t CC = 32, ncc = (C + CC - 1) / CC;
    at::parallel_for(0, nkb * ncc, 1, [&](int64_t s, int64_t e) {
      thread_local std::vector<uint16_t> tmp_buf;
      if (tmp_buf.size() < static_cast<size_t>(CC * F * NB)) tmp_buf.resize(CC * F * NB);
      uint16_t* tmp = tmp_buf.data();
      for (int64_t w = s; w < e; ++w) {
        const int64_t kb = w / ncc, c0 = (w % ncc) * CC, nc = std::min(CC, C - c0), j0 = kb * NB;
        const int64_t nn = std::min(NB, cols - j0);
        fbgemm::transpose_simd<uint16_t>(nn, nc * F, wp + j0 * sk + c0 * F, sk, tmp, NB);   // tmp[(c, f)][j]
        for (int64_t f = 0; f < F; ++f)
          for (int64_t c = 0; c < nc; c += 2) {
            uint16_t* d = op + (kb * F * R + f * R + c0 + c) * NB;
            interleave_rows(tmp + (c * F + f) * NB, tmp + ((c + 1) * F + f) * NB, d, nn);
            if (nn < NB) std::memset(d + 2 * nn, 0, (NB - nn) * 4);
          }
      }
    });
    return out;
  }
  // items (column block, row pair): its source, 2 x 64 x F elements, is two runs of (j, f) or
  // (f, j) blocks in nchw / channels-last (read once, in L1)
  at::parallel_for(0, nkb * (R / 2), 4, [&](int64_t s, int64_t e) {
    for (int64_t w = s; w < e; ++w) {
      const int64_t kb = w / (R / 2), i = (w % (R / 2)) * 2, j0 = kb * NB, nn = std::min(NB, cols - j0);
      const uint16_t* r0 = wp + i * si + j0 * sj;
      const uint16_t* r1 = r0 + si;
      for (int64_t fo = 0; fo < F; ++fo) {
        const int64_t f = twin ? F - 1 - fo : fo;
        uint16_t* d = op + (kb * F * R + fo * R + i) * NB;
        for (int64_t j = 0; j < nn; ++j) {
          d[2 * j] = r0[j * sj + f * sf];
          d[2 * j + 1] = r1[j * sj + f * sf];
        }
        if (nn < NB) std::memset(d + 2 * nn, 0, (NB - nn) * 4);
      }
    }
  });
  return out;
}

at::Tensor pack_b(const at::Tensor& src3, bool transpose, const at::Tensor& index, bool vnni) {
  TORCH_CHECK(src3.dim() == 3 && src3.is_contiguous() && index.dim() == 2 && index.is_contiguous(), "pack_b: operands");
  const int64_t Gs = src3.size(0), A = src3.size(1), B = src3.size(2);
  const int64_t rows = transpose ? B : A, cols = transpose ? A : B;
  const int64_t G = index.size(0), Rw = index.size(1), es = src3.element_size();
  TORCH_CHECK(!vnni || (Rw % 2 == 0 && es == 2), "pack_b: VNNI needs bf16 and an even row count");
  at::Tensor lg = src3;
  if (transpose) {
    lg = at::empty({Gs, B, A}, src3.options());
    at::parallel_for(0, Gs, 1, [&](int64_t s, int64_t e) {
      for (int64_t g = s; g < e; ++g) {
        if (es == 2)
          fbgemm::transpose_simd<uint16_t>(A, B, reinterpret_cast<const uint16_t*>(src3.data_ptr()) + g * A * B, B,
                                           reinterpret_cast<uint16_t*>(lg.data_ptr()) + g * A * B, A);
        else
          fbgemm::transpose_simd<float>(A, B, reinterpret_cast<const float*>(src3.data_ptr()) + g * A * B, B,
                                        reinterpret_cast<float*>(lg.data_ptr()) + g * A * B, A);
      }
    });
  }
  const char* lp = static_cast<const char*>(lg.data_ptr());
  const int64_t* ip = index.data_ptr<int64_t>();
  (void)rows;      // index: rows of the flattened (Gs * rows, cols) source, built once per problem by _Plan
  if (!vnni) {
    at::Tensor out = at::empty({G, Rw, cols}, src3.options());
    char* op = static_cast<char*>(out.data_ptr());
    at::parallel_for(0, G * Rw, 64, [&](int64_t s, int64_t e) {
      for (int64_t r = s; r < e; ++r) std::memcpy(op + r * cols * es, lp + ip[r] * cols * es, cols * es);
    });
    return out;
  }
  const int64_t nkb = (cols + NB - 1) / NB;
  at::Tensor out = at::empty({G, nkb, Rw, NB}, src3.options());
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  const uint16_t* lw = reinterpret_cast<const uint16_t*>(lp);
  at::parallel_for(0, G * (Rw / 2), 16, [&](int64_t s, int64_t e) {
    for (int64_t w = s; w < e; ++w) {
      const int64_t g = w / (Rw / 2), r = (w % (Rw / 2)) * 2;
      const uint16_t* r0 = lw + ip[g * Rw + r] * cols;
      const uint16_t* r1 = lw + ip[g * Rw + r + 1] * cols;
      for (int64_t kb = 0; kb < nkb; ++kb) {
        uint16_t* d = op + ((g * nkb + kb) * Rw + r) * NB;
        const int64_t c0 = kb * NB, nn = std::min(NB, cols - c0);
        interleave_rows(r0 + c0, r1 + c0, d, nn);
        if (nn < NB) std::memset(d + 2 * nn, 0, (NB - nn) * 4);
      }
    }
  });
  return out;
}

// Stage a logical (N, C, S0, S1, S2) tensor (any strides; the channel stride 1 or not) onto
// position-major phase grids: out[ph, ((n U0 + u0) U1 + u1) U2 + u2, c] = x[n, c, i] with
// i_d = u_d s_d + rho_d - pb_d where 0 <= i_d < S_d, else 0; rows past N prod(U) zero.
// phases (P, 3): rho per dim. Channel-strided sources (nchw) go through one SIMD transpose
// of each source row.
void stage(const at::Tensor& x, at::Tensor out, at::IntArrayRef U, at::IntArrayRef st, at::IntArrayRef pb,
           const at::Tensor& phases) {
  TORCH_CHECK(x.dim() == 5 && out.dim() == 3 && out.is_contiguous() && out.scalar_type() == x.scalar_type(),
              "stage: x (N, C, S0, S1, S2), out (P, rows, C)");
  const int64_t N = x.size(0), C = x.size(1), S0 = x.size(2), S1 = x.size(3), S2 = x.size(4);
  const int64_t P = out.size(0), R = out.size(1), es = x.element_size();
  const int64_t U0 = U[0], U1 = U[1], U2 = U[2], M = N * U0 * U1;     // rows of U2 positions
  TORCH_CHECK(R >= M * U2 && out.size(2) == C && phases.size(0) == P, "stage: out too small");
  const int64_t xs0 = x.stride(0), xs1 = x.stride(1), xs2 = x.stride(2), xs3 = x.stride(3), xs4 = x.stride(4);
  const char* xp = static_cast<const char*>(x.data_ptr());
  char* op = static_cast<char*>(out.data_ptr());
  const int64_t* php = phases.data_ptr<int64_t>();
  const bool cl = xs1 == 1;                 // channels contiguous (nhwc)
  at::parallel_for(0, P * M, 8, [&](int64_t s, int64_t e) {
    std::vector<char> tmp(cl ? 0 : S2 * C * es);
    int64_t last = -1;                      // the source row held in tmp
    for (int64_t w = s; w < e; ++w) {
      const int64_t ph = w / M, m = w % M, u1 = m % U1, u0 = (m / U1) % U0, n = m / (U0 * U1);
      const int64_t* rho = php + 3 * ph;
      char* dst = op + (ph * R + m * U2) * C * es;
      const int64_t i0 = u0 * st[0] + rho[0] - pb[0], i1 = u1 * st[1] + rho[1] - pb[1];
      if (i0 < 0 || i0 >= S0 || i1 < 0 || i1 >= S1) { std::memset(dst, 0, U2 * C * es); continue; }
      const char* row = xp + (n * xs0 + i0 * xs2 + i1 * xs3) * es;
      const char* src = row;
      int64_t pitch = xs4 * es;
      if (st[2] == 1) {                     // one contiguous span of the source row, zero around
        const int64_t a = std::clamp<int64_t>(pb[2] - rho[2], 0, U2), b = std::clamp<int64_t>(S2 + pb[2] - rho[2], a, U2);
        std::memset(dst, 0, a * C * es);
        std::memset(dst + b * C * es, 0, (U2 - b) * C * es);
        const int64_t i2 = a + rho[2] - pb[2];
        if (cl && xs4 == C) {
          std::memcpy(dst + a * C * es, row + i2 * xs4 * es, (b - a) * C * es);
          continue;
        }
        if (!cl && xs4 == 1 && b > a) {     // (C, b - a) at stride xs1 -> (b - a, C)
          if (es == 2)
            fbgemm::transpose_simd<uint16_t>(C, b - a, reinterpret_cast<const uint16_t*>(row) + i2, xs1,
                                             reinterpret_cast<uint16_t*>(dst) + a * C, C);
          else
            fbgemm::transpose_simd<float>(C, b - a, reinterpret_cast<const float*>(row) + i2, xs1,
                                          reinterpret_cast<float*>(dst) + a * C, C);
          continue;
        }
      }
      if (!cl) {                            // (C, S2) at strides (xs1, xs4) -> (S2, C)
        const int64_t key = (n * S0 + i0) * S1 + i1;
        if (key != last) {
          if (xs4 == 1) {
            if (es == 2)
              fbgemm::transpose_simd<uint16_t>(C, S2, reinterpret_cast<const uint16_t*>(row), xs1,
                                               reinterpret_cast<uint16_t*>(tmp.data()), C);
            else
              fbgemm::transpose_simd<float>(C, S2, reinterpret_cast<const float*>(row), xs1,
                                            reinterpret_cast<float*>(tmp.data()), C);
          } else {
            for (int64_t c = 0; c < C; ++c)
              for (int64_t j = 0; j < S2; ++j)
                std::memcpy(tmp.data() + (j * C + c) * es, row + (c * xs1 + j * xs4) * es, es);
          }
          last = key;
        }
        src = tmp.data();
        pitch = C * es;
      }
      for (int64_t u2 = 0; u2 < U2; ++u2) {
        const int64_t i2 = u2 * st[2] + rho[2] - pb[2];
        char* d = dst + u2 * C * es;
        if (i2 < 0 || i2 >= S2) std::memset(d, 0, C * es);
        else std::memcpy(d, src + i2 * pitch, C * es);
      }
    }
  });
  if (R > M * U2)
    for (int64_t ph = 0; ph < P; ++ph) std::memset(op + (ph * R + M * U2) * C * es, 0, (R - M * U2) * C * es);
}
}  // namespace

TORCH_LIBRARY(nnprim_cpu_conv, m) {
  m.def("conv_fwd(Tensor xs, Tensor wp, Tensor runs, Tensor(a!) y, Tensor? bias, int[] grid, int G, int Cg, "
        "int Kg, int MB, bool vnni, bool use_amx, int ps, Tensor? res=None, float res_scale=1.0, bool relu=False, "
        "float relu_slope=0.0) -> ()");
  m.def("conv_fwd_in_place(Tensor x, Tensor wp, Tensor(a!) y, Tensor? bias, int[] lead, int stride, "
        "Tensor? res=None, float res_scale=1.0, bool relu=False, float relu_slope=0.0, bool use_amx=True, "
        "bool own_tile=True) -> ()");
  m.def("conv_wgrad(Tensor xt, Tensor dyg, Tensor taps, Tensor chunks, Tensor(a!) dw, int G, int Cg, int Kg, "
        "bool vnni) -> ()");
  m.def("pack_b(Tensor src3, bool transpose, Tensor index, bool vnni) -> Tensor");
  m.def("pack_b_pairs(Tensor src, int G) -> Tensor");
  m.def("pack_taps(Tensor w3, bool twin) -> Tensor");
  m.def("transpose_images(Tensor src, Tensor(a!) dst) -> ()");
  m.def("stage(Tensor x, Tensor(a!) out, int[] U, int[] stride, int[] pad_before, Tensor phases) -> ()");
}
TORCH_LIBRARY_IMPL(nnprim_cpu_conv, CPU, m) {
  m.impl("conv_fwd", &conv_fwd);
  m.impl("conv_fwd_in_place", &conv_fwd_in_place);
  m.impl("conv_wgrad", &conv_wgrad);
  m.impl("transpose_images", &transpose_images);
  m.impl("pack_b", &pack_b);
  m.impl("pack_b_pairs", &pack_b_pairs);
  m.impl("pack_taps", &pack_taps);
  m.impl("stage", &stage);
}
