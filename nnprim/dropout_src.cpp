// The dropout keep flags of nnprim.dropout on the CPU: Philox4x32-10 as Triton's tl.randint
// (key = seed lo/hi words, counter words = counter lo/hi, 0, 0; the first output word), for rows of
// consecutive counters. The torch-op twin (dropout.philox_randint) spends ~100 tensor passes per
// element (2026-12-04: a 1 x 8 x 1024 x 1024 f32 forward with dropout took 4.3 s against torch's
// 0.1 s); this loop keeps the words in registers and vectorises over the row.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <cstdint>

namespace {
using nnprim_native::philox_first;

// out[r, j] = philox(seed, bases[r] + c0 + j) >= threshold  (counters wrap mod 2**64)
at::Tensor keep_rows(int64_t seed, const at::Tensor& bases, int64_t c0, int64_t nc, int64_t threshold) {
  TORCH_CHECK(bases.scalar_type() == at::kLong && bases.dim() == 1, "keep_rows: bases must be 1-D int64");
  const at::Tensor b = bases.contiguous();
  const int64_t R = b.numel();
  at::Tensor out = at::empty({R, nc}, at::kBool);
  const int64_t* bp = b.data_ptr<int64_t>();
  bool* op = out.data_ptr<bool>();
  const uint64_t s = static_cast<uint64_t>(seed);
  const uint32_t k0 = static_cast<uint32_t>(s), k1 = static_cast<uint32_t>(s >> 32);
  const uint64_t thr = static_cast<uint64_t>(threshold);
  at::parallel_for(0, R, std::max<int64_t>(1, 4096 / std::max<int64_t>(nc, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const uint64_t base = static_cast<uint64_t>(bp[r]) + static_cast<uint64_t>(c0);
      bool* o = op + r * nc;
      for (int64_t j = 0; j < nc; ++j) o[j] = philox_first(k0, k1, base + static_cast<uint64_t>(j)) >= thr;
    }
  });
  return out;
}
}  // namespace

TORCH_LIBRARY(nnprim_cpu_dropout, m) {
  m.def("keep_rows(int seed, Tensor bases, int c0, int nc, int threshold) -> Tensor");
}
TORCH_LIBRARY_IMPL(nnprim_cpu_dropout, CPU, m) { m.impl("keep_rows", &keep_rows); }
