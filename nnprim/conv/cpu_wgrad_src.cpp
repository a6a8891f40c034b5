// bf16 backward weights on avx512_bf16 without AMX (nnprim/conv/cpu_wgrad.py): appended to
// cpu_brgemm_src.cpp's text (one library, its includes and helpers).
//
// dw[f, g] (Cg x Kg) = sum over valid output positions q: X_ph(f)[q + off_f, g Cg + c] dy[q, g Kg + k].
// torch's brgemm (one A/B pair a call) made this a call per (chunk, tap, 64 columns) with C in
// memory between calls, a reduction over whole 32-position blocks of the grid (junk columns
// included: rn50_r4 224 of 256 positions per image against 196 valid) and 64-column B blocks
// for 16-channel groups. Here our own register-blocked vdpbf16ps tile keeps an MB x 16 NV f32
// block in registers across every valid line segment of a chunk, B blocks are as wide as the
// group (16-64 columns), and threads split the output (no partials to sum), written in dw's own layout.
#include <array>
#include <utility>

namespace {
// (scratch(): cpu_brgemm_src.cpp's grow-only thread scratch)

#if defined(__AVX512BF16__)
using WgTile = void (*)(const uint16_t*, int64_t, const uint16_t*, int64_t, const int64_t*, int64_t, float*, int64_t,
                        bool);

// c (MB x 16 NV f32, row stride ldc) (+)= sum over the even position pairs q of segs (start, length;
// both even, relative to a and b): the pair a[m lda + q], a[m lda + q + 1] broadcast (x^T rows)
// times b's VNNI row pair q / 2 (ldb elements a row pair: columns interleaved in pairs)
template <int MB, int NV>
void wg_tile(const uint16_t* a, int64_t lda, const uint16_t* b, int64_t ldb, const int64_t* segs, int64_t nseg,
             float* c, int64_t ldc, bool add) {
  __m512 acc[MB][NV];
  for (int m = 0; m < MB; ++m)
    for (int v = 0; v < NV; ++v) acc[m][v] = add ? _mm512_loadu_ps(c + m * ldc + 16 * v) : _mm512_setzero_ps();
  for (int64_t s = 0; s < nseg; ++s) {
    const int64_t q1 = segs[2 * s] + segs[2 * s + 1];
    for (int64_t q = segs[2 * s]; q < q1; q += 2) dpbf16_pair<MB, NV>(acc, a + q, lda, b + (q / 2) * ldb);
  }
  for (int m = 0; m < MB; ++m)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(c + m * ldc + 16 * v, acc[m][v]);
}

constexpr int WG_MAX_MB = 16;
// rows per tile for NV vectors of columns: MB * NV accumulators + NV B vectors + a broadcast in
// the 32 zmm registers
constexpr int wg_rows(int nv) { return nv == 1 ? 16 : 24 / nv; }

template <int NV, int... M>
constexpr std::array<WgTile, sizeof...(M)> wg_table(std::integer_sequence<int, M...>) {
  return {&wg_tile<M + 1, NV>...};
}

WgTile wg_pick(int64_t nv, int64_t mb) {
  static const std::array<WgTile, WG_MAX_MB> t1 = wg_table<1>(std::make_integer_sequence<int, WG_MAX_MB>{});
  static const std::array<WgTile, 12> t2 = wg_table<2>(std::make_integer_sequence<int, 12>{});
  static const std::array<WgTile, 8> t3 = wg_table<3>(std::make_integer_sequence<int, 8>{});
  static const std::array<WgTile, 6> t4 = wg_table<4>(std::make_integer_sequence<int, 6>{});
  switch (nv) {
    case 1: return t1[mb - 1];
    case 2: return t2[mb - 1];
    case 3: return t3[mb - 1];
    default: return t4[mb - 1];
  }
}

// xt (P, C, R) bf16: x on the phase grids channel-major (stage_cm); dy (N, K, O0, O1, O2) bf16, any
// strides, on the grid U (3) of M positions (pack_dy); taps (F, 2): phase, offset; chunks (nch, 4):
// start, span (both even), first and end segment; segs (nseg, 2): absolute start and length (even)
// of the valid line runs, sorted and disjoint, each chunk's inside [start, start + span);
// dw f32 / bf16 with element (k, c, f) at k sk + c sc + f sf: rows k of (c, f) or (f, c).
// dy (N, K, O0, O1, O2) bf16, any strides, into VNNI blocks on the grid U: dpk (G, nkb, M2, W),
// row pair q / 2 of grid position q = ((n U0 + o0) U1 + o1) U2 + o2 holding columns k in pairs
// (position q even, q + 1). Only pairs of the valid lines are written (the segments read no
// other): a line's own positions, zero for a neighbour position that no line holds. nchw rows
// (positions contiguous) pair up as 32-bit words: one SIMD transpose per line and block;
// channels-contiguous rows are interleaved two at a time.
void pack_dy(const at::Tensor& dy, const int64_t* U, int64_t G, int64_t Kg, int64_t W, int64_t M2, uint16_t* dpk) {
  const int64_t N = dy.size(0), O0 = dy.size(2), O1 = dy.size(3), O2 = dy.size(4), nkb = (Kg + W - 1) / W;
  const int64_t ds0 = dy.stride(0), ds1 = dy.stride(1), ds2 = dy.stride(2), ds3 = dy.stride(3), ds4 = dy.stride(4);
  const int64_t U0 = U[0], U1 = U[1], U2 = U[2], lines = N * O0 * O1;
  const uint16_t* dp = reinterpret_cast<const uint16_t*>(dy.data_ptr());
  auto valid = [&](int64_t q) {       // grid position q holds an output
    const int64_t u2 = q % U2, u1 = (q / U2) % U1, u0 = (q / (U2 * U1)) % U0;
    return q >= 0 && q < N * U0 * U1 * U2 && u2 < O2 && u1 < O1 && u0 < O0;
  };
  const bool words = ds4 == 1 && ds1 % 2 == 0 && O2 > 1;
  at::parallel_for(0, lines * G * nkb, 8, [&](int64_t s, int64_t e) {
    for (int64_t w = s; w < e; ++w) {
      const int64_t gk = w % (G * nkb), l = w / (G * nkb), g = gk / nkb, kb = gk % nkb;
      const int64_t o1 = l % O1, o0 = (l / O1) % O0, n = l / (O0 * O1);
      const int64_t a = ((n * U0 + o0) * U1 + o1) * U2, k0 = g * Kg + kb * W, nn = std::min(W, Kg - kb * W);
      const uint16_t* src = dp + n * ds0 + o0 * ds2 + o1 * ds3 + k0 * ds1;    // (k, o2) at k ds1 + o2 ds4
      uint16_t* blk = dpk + gk * M2 * W;
      auto half = [&](int64_t q, int64_t o2) {     // position q's half of its pair (o2 < 0: zero)
        uint16_t* d = blk + (q / 2) * 2 * W + (q & 1);
        for (int64_t k = 0; k < nn; ++k) d[2 * k] = o2 >= 0 ? src[k * ds1 + o2 * ds4] : 0;
        for (int64_t k = nn; k < W; ++k) d[2 * k] = 0;
      };
      int64_t o2s = 0, o2e = O2;
      if (a % 2) {                   // first position odd: pairs with a - 1
        half(a, 0);
        if (!valid(a - 1)) half(a - 1, -1);
        o2s = 1;
      }
      if ((O2 - o2s) % 2) {          // last position even: pairs with a + O2
        half(a + O2 - 1, O2 - 1);
        if (!valid(a + O2)) half(a + O2, -1);
        o2e = O2 - 1;
      }
      const int64_t np = (o2e - o2s) / 2;
      if (np == 0) continue;
      uint16_t* d0 = blk + (a + o2s) * W;       // row pair (a + o2s) / 2
      if (words) {
        fbgemm::transpose_simd<float>(nn, np, reinterpret_cast<const float*>(src + o2s), ds1 / 2,
                                      reinterpret_cast<float*>(d0), W);
        if (nn < W)
          for (int64_t i = 0; i < np; ++i) std::memset(d0 + i * 2 * W + 2 * nn, 0, (W - nn) * 4);
      } else if (ds1 == 1) {
        for (int64_t i = 0; i < np; ++i) {
          const int64_t o2 = o2s + 2 * i;
          interleave_rows(src + o2 * ds4, src + (o2 + 1) * ds4, d0 + i * 2 * W, nn);
          if (nn < W) std::memset(d0 + i * 2 * W + 2 * nn, 0, (W - nn) * 4);
        }
      } else {
        for (int64_t i = 0; i < np; ++i) {
          uint16_t* d = d0 + i * 2 * W;
          for (int64_t k = 0; k < W; ++k) {
            d[2 * k] = k < nn ? src[k * ds1 + (o2s + 2 * i) * ds4] : 0;
            d[2 * k + 1] = k < nn ? src[k * ds1 + (o2s + 2 * i + 1) * ds4] : 0;
          }
        }
      }
    }
  });
}

template <typename TO>
void wgrad_vnni_impl(const at::Tensor& xt, const at::Tensor& dy, const int64_t* U, int64_t M, const at::Tensor& taps, const at::Tensor& chunks,
                     const at::Tensor& segs, at::Tensor& dw, int64_t sk, int64_t sc, int64_t sf, int64_t G, int64_t Cg,
                     int64_t Kg) {
  const int64_t C = xt.size(1), R = xt.size(2);
  const int64_t F = taps.size(0), M2 = (M + 1) / 2 * 2, nch = chunks.size(0);
  const int64_t W = std::min<int64_t>(64, (Kg + 15) / 16 * 16), nkb = (Kg + W - 1) / W, KP = nkb * W;
  const int64_t* tp = taps.data_ptr<int64_t>();
  const int64_t* chp = chunks.data_ptr<int64_t>();
  const int64_t* sp = segs.data_ptr<int64_t>();
  int64_t reach = 0;
  for (int64_t f = 0; f < F; ++f) {
    TORCH_CHECK(0 <= tp[2 * f] && tp[2 * f] < xt.size(0) && tp[2 * f + 1] >= 0, "conv_wgrad_vnni: bad tap");
    reach = std::max(reach, tp[2 * f + 1]);
  }
  for (int64_t i = 0; i < nch; ++i) {
    const int64_t* ch = chp + 4 * i;
    TORCH_CHECK(ch[0] >= 0 && ch[0] % 2 == 0 && ch[1] % 2 == 0 && ch[0] + ch[1] <= M2 && ch[0] + ch[1] + reach <= R &&
                0 <= ch[2] && ch[2] <= ch[3] && ch[3] <= segs.size(0), "conv_wgrad_vnni: bad chunk");
    for (int64_t s = ch[2]; s < ch[3]; ++s)
      TORCH_CHECK(sp[2 * s] % 2 == 0 && sp[2 * s + 1] % 2 == 0 && sp[2 * s] >= ch[0] &&
                  sp[2 * s] + sp[2 * s + 1] <= ch[0] + ch[1], "conv_wgrad_vnni: segment outside its chunk");
  }
  thread_local std::vector<uint16_t> dpk_buf;
  thread_local std::vector<float> x_buf;
  uint16_t* dst0 = scratch(dpk_buf, G * nkb * M2 * W);
  pack_dy(dy, U, G, Kg, W, M2, dst0);
  const uint16_t* bp = dst0;
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(xt.data_ptr());
  // dw's row k is (c, f) (nchw: sf == 1) or (f, c) (channels-last): the tiles accumulate into X
  // (G, F Cg, KP) f32 with rows in that order (MB rows c of one tap: F or 1 rows apart), and X^T
  // is written out in blocks of 64 k. Threads split the output, not the positions: items
  // (g, kb, c block, tap), each thread's range of them for every chunk in turn (one chunk's B
  // and x^T in L2 serve all of its items), so no thread partials are summed (0.4-0.8 ms of 10 on
  // rn50_r4: 2.4 MB a thread through memory)
  const int64_t FC = F * Cg, mbmax = wg_rows(W / 16), nmb = (Cg + mbmax - 1) / mbmax;
  auto row0 = [&](int64_t mi) { return mi * (Cg / nmb) + std::min(mi, Cg % nmb); };   // blocks within a row
  const bool cf_rows = sf == 1;
  const int64_t ldc = cf_rows ? F * KP : KP;
  float* X = scratch(x_buf, G * FC * KP);
  std::vector<int64_t> rel(2 * segs.size(0));
  for (int64_t i = 0; i < nch; ++i)
    for (int64_t j = chp[4 * i + 2]; j < chp[4 * i + 3]; ++j) {
      rel[2 * j] = sp[2 * j] - chp[4 * i];
      rel[2 * j + 1] = sp[2 * j + 1];
    }
  // Each thread takes a run of items of equal rows (a tile's time goes with its rows): on few items
  // (c3d_small: 6 blocks x 27 taps) equal item counts left one thread 18 % idle at the end
  const int64_t items = G * nkb * nmb * F, nth = std::min<int64_t>(at::get_num_threads(), items);
  std::vector<int64_t> cut(nth + 1, items);
  for (int64_t t = 0, w = 0, acc = 0; t < nth; ++t) {
    while (w < items && acc * nth < t * FC * G * nkb) acc += row0((w / F) % nmb + 1) - row0((w / F) % nmb), ++w;
    cut[t] = w;
  }
  if (nch == 0) std::fill(X, X + G * FC * KP, 0.f);      // no valid position: dw = 0
  at::parallel_for(0, nth, 1, [&](int64_t ts, int64_t te) {
    const int64_t s = cut[ts], e = cut[te];
    for (int64_t i = 0; i < nch; ++i) {
      const int64_t* ch = chp + 4 * i;
      const int64_t q0 = ch[0];
      for (int64_t w = s; w < e; ++w) {       // w = ((g nkb + kb) nmb + mblock) F + f
        const int64_t f = w % F, mi = (w / F) % nmb, gk = w / (F * nmb), g = gk / nkb, kb = gk % nkb;
        const int64_t m0 = row0(mi), mb = row0(mi + 1) - m0;
        float* c = X + (g * FC + (cf_rows ? m0 * F + f : f * Cg + m0)) * KP + kb * W;
        wg_pick(W / 16, mb)(xp + (tp[2 * f] * C + g * Cg + m0) * R + q0 + tp[2 * f + 1], R,
                            bp + (gk * M2 + q0) * W, 2 * W, rel.data() + 2 * ch[2], ch[3] - ch[2], c, ldc, i > 0);
      }
    }
  });
  TO* op = dw.data_ptr<TO>();
  const int64_t nk64 = (Kg + 63) / 64;
  at::parallel_for(0, G * nk64, 1, [&](int64_t s, int64_t e) {
    thread_local std::vector<float> t_buf;
    float* t = scratch(t_buf, 64 * FC);
    for (int64_t w = s; w < e; ++w) {
      const int64_t g = w / nk64, k0 = (w % nk64) * 64, nk = std::min<int64_t>(64, Kg - k0);
      fbgemm::transpose_simd<float>(FC, nk, X + g * FC * KP + k0, KP, t, FC);
      for (int64_t j = 0; j < nk; ++j) at::vec::convert(t + j * FC, op + (g * Kg + k0 + j) * sk, FC);
    }
  });
}
#endif

// One grid line of 2-byte elements: dst[j] = src[j - a] for a <= j < b, else 0, j < n, in masked
// 32-element AVX-512 steps (a line is 8-60 elements: memset / memcpy calls per line cost ~25 ns a
// line, 0.8 ms a call on rn50_r4's 32 K lines). False: not done here (no AVX-512 BW).
inline bool grid_line(uint16_t* dst, const uint16_t* src, int64_t a, int64_t b, int64_t n) {
#if defined(__AVX512BW__)
  for (int64_t j0 = 0; j0 < n; j0 += 32) {
    const int64_t lo = std::clamp<int64_t>(a - j0, 0, 32), hi = std::clamp<int64_t>(b - j0, lo, 32);
    const __mmask32 in = static_cast<__mmask32>(((hi == 32 ? ~0ull : (1ull << hi) - 1) >> lo) << lo);
    const __mmask32 out = static_cast<__mmask32>(n - j0 >= 32 ? ~0u : (1u << (n - j0)) - 1);
    const __m512i v = in ? _mm512_maskz_loadu_epi16(in, src + (j0 - a)) : _mm512_setzero_si512();
    _mm512_mask_storeu_epi16(dst + j0, out, v);
  }
  return true;
#else
  (void)dst, (void)src, (void)a, (void)b, (void)n;
  return false;
#endif
}

// Stage a logical (N, C, S0, S1, S2) bf16 tensor (any strides) onto channel-major phase grids:
// out[ph, c, ((n U0 + u0) U1 + u1) U2 + u2] = x[n, c, i], i_d = u_d s_d + rho_d - pb_d where inside
// x, else 0; columns past N prod(U) zero. Channels-contiguous x (nhwc): a plane of grid lines at a
// time, built position-major with its zeros in a buffer (in L2), then one SIMD transpose into the
// C rows. Else a (phase, c, n) plane at a time (contiguous in out). (Line by line, a memset per
// channel and line side: 1.7 ms on rn50_r3_3x3s2_nhwc, 0.5 ms on rn50_r4.)
void stage_cm(const at::Tensor& x, at::Tensor out, at::IntArrayRef U, at::IntArrayRef st, at::IntArrayRef pb,
              const at::Tensor& phases) {
  TORCH_CHECK(x.dim() == 5 && out.dim() == 3 && out.is_contiguous() && out.scalar_type() == x.scalar_type() &&
              x.element_size() == 2 && phases.is_contiguous() && phases.dim() == 2 && phases.size(1) == 3 &&
              U.size() == 3 && st.size() == 3 && pb.size() == 3, "stage_cm: x (N, C, S0, S1, S2) 2-byte, out (P, C, rows)");
  const int64_t N = x.size(0), C = x.size(1), S0 = x.size(2), S1 = x.size(3), S2 = x.size(4);
  const int64_t P = out.size(0), R = out.size(2), U0 = U[0], U1 = U[1], U2 = U[2], L = N * U0 * U1;
  TORCH_CHECK(out.size(1) == C && phases.size(0) == P && R >= L * U2, "stage_cm: out too small");
  const int64_t xs0 = x.stride(0), xs1 = x.stride(1), xs2 = x.stride(2), xs3 = x.stride(3), xs4 = x.stride(4);
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t* php = phases.data_ptr<int64_t>();
  // grid line (n, u0, u1) of phase ph: its source row (null: outside x), grid columns [a, b) inside x
  auto line = [&](const int64_t* rho, int64_t n, int64_t u0, int64_t u1, int64_t& a, int64_t& b) -> const uint16_t* {
    const int64_t i0 = u0 * st[0] + rho[0] - pb[0], i1 = u1 * st[1] + rho[1] - pb[1], s2 = st[2];
    a = b = 0;
    if (i0 < 0 || i0 >= S0 || i1 < 0 || i1 >= S1) return nullptr;
    a = pb[2] > rho[2] ? std::min<int64_t>((pb[2] - rho[2] + s2 - 1) / s2, U2) : 0;
    b = S2 + pb[2] - rho[2] > 0 ? std::clamp<int64_t>((S2 + pb[2] - rho[2] + s2 - 1) / s2, a, U2) : a;
    return xp + n * xs0 + i0 * xs2 + i1 * xs3 + (a * s2 + rho[2] - pb[2]) * xs4;
  };
  if (xs1 == 1 && C > 1) {      // a (phase, n, u0) plane of U1 lines at a time, position-major in tmp
    at::parallel_for(0, P * N * U0, 1, [&](int64_t s, int64_t e) {
      thread_local std::vector<uint16_t> tmp_buf;
      uint16_t* tmp = scratch(tmp_buf, U1 * U2 * C);
      for (int64_t w = s; w < e; ++w) {
        const int64_t ph = w / (N * U0), n = (w / U0) % N, u0 = w % U0;
        const int64_t* rho = php + 3 * ph;
        for (int64_t u1 = 0; u1 < U1; ++u1) {
          uint16_t* t = tmp + u1 * U2 * C;
          int64_t a, b;
          const uint16_t* src = line(rho, n, u0, u1, a, b);
          std::memset(t, 0, a * C * 2);
          std::memset(t + b * C, 0, (U2 - b) * C * 2);
          if (b == a) continue;     // src is null: the line is outside x
          if (st[2] * xs4 == C) std::memcpy(t + a * C, src, (b - a) * C * 2);
          else for (int64_t j = a; j < b; ++j) std::memcpy(t + j * C, src + (j - a) * st[2] * xs4, C * 2);
        }
        fbgemm::transpose_simd<uint16_t>(U1 * U2, C, tmp, C, op + ph * C * R + (n * U0 + u0) * U1 * U2, R);
      }
    });
  } else {                      // a (phase, c, n) plane at a time
    at::parallel_for(0, P * C * N, 1, [&](int64_t s, int64_t e) {
      for (int64_t w = s; w < e; ++w) {
        const int64_t ph = w / (C * N), c = (w / N) % C, n = w % N, step = st[2] * xs4;
        const int64_t* rho = php + 3 * ph;
        uint16_t* dst = op + (ph * C + c) * R + n * U0 * U1 * U2;
        for (int64_t u0 = 0; u0 < U0; ++u0)
          for (int64_t u1 = 0; u1 < U1; ++u1, dst += U2) {
            int64_t a, b;
            const uint16_t* src = line(rho, n, u0, u1, a, b);
            if (src) src += c * xs1;
            if (step == 1 && grid_line(dst, src, a, b, U2)) continue;
            for (int64_t j = 0; j < a; ++j) dst[j] = 0;
            for (int64_t j = a; j < b; ++j) dst[j] = src[(j - a) * step];
            for (int64_t j = b; j < U2; ++j) dst[j] = 0;
          }
      }
    });
  }
  if (R > L * U2)
    for (int64_t pc = 0; pc < P * C; ++pc) std::memset(op + pc * R + L * U2, 0, (R - L * U2) * 2);
}

void conv_wgrad_vnni(const at::Tensor& xt, const at::Tensor& dy, at::IntArrayRef U, const at::Tensor& taps,
                     const at::Tensor& chunks, const at::Tensor& segs, at::Tensor dw, int64_t sk, int64_t sc, int64_t sf,
                     int64_t G, int64_t Cg, int64_t Kg) {
#if defined(__AVX512BF16__)
  TORCH_CHECK(xt.dim() == 3 && xt.size(1) == G * Cg && xt.scalar_type() == at::kBFloat16 &&
              dy.scalar_type() == at::kBFloat16 && dy.dim() == 5 && dy.size(1) == G * Kg && U.size() == 3 &&
              U[0] >= dy.size(2) && U[1] >= dy.size(3) && U[2] >= dy.size(4),
              "conv_wgrad_vnni: xt (P, G Cg, rows), dy (N, G Kg, O0, O1, O2) bf16 on a grid U >= O");
  TORCH_CHECK(xt.is_contiguous() && taps.is_contiguous() && chunks.is_contiguous() &&
              segs.is_contiguous() && chunks.dim() == 2 && chunks.size(1) == 4 && segs.dim() == 2 &&
              segs.size(1) == 2 && taps.dim() == 2 && taps.size(1) == 2, "conv_wgrad_vnni: operands");
  const int64_t F = taps.size(0), M = dy.size(0) * U[0] * U[1] * U[2];
  TORCH_CHECK(dw.numel() == G * Kg * Cg * F && dw.is_non_overlapping_and_dense() && sk == Cg * F &&
              ((sc == F && sf == 1) || (sc == 1 && sf == Cg)), "conv_wgrad_vnni: dw rows k of (c, f) or (f, c)");
  if (dw.scalar_type() == at::kFloat)
    wgrad_vnni_impl<float>(xt, dy, U.data(), M, taps, chunks, segs, dw, sk, sc, sf, G, Cg, Kg);
  else {
    TORCH_CHECK(dw.scalar_type() == at::kBFloat16, "conv_wgrad_vnni: dw f32 or bf16");
    wgrad_vnni_impl<at::BFloat16>(xt, dy, U.data(), M, taps, chunks, segs, dw, sk, sc, sf, G, Cg, Kg);
  }
#else
  TORCH_CHECK(false, "conv_wgrad_vnni: built without avx512_bf16");
#endif
}
}  // namespace

TORCH_LIBRARY_FRAGMENT(nnprim_cpu_conv, m) {
  m.def("conv_wgrad_vnni(Tensor xt, Tensor dy, int[] U, Tensor taps, Tensor chunks, Tensor segs, Tensor(a!) dw, int sk, "
        "int sc, int sf, int G, int Cg, int Kg) -> ()");
  m.def("stage_cm(Tensor x, Tensor(a!) out, int[] U, int[] stride, int[] pad_before, Tensor phases) -> ()");
}
TORCH_LIBRARY_IMPL(nnprim_cpu_conv, CPU, m) {
  m.impl("conv_wgrad_vnni", &conv_wgrad_vnni);
  m.impl("stage_cm", &stage_cm);
}
