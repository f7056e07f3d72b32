// `torch.ops.urpe_cpp.all_finite(tensors) -> bool`: whether every entry of every CPU tensor is
// finite, answered as a plain bool (no tensor is read on the host, so no `.item()`).
//
// urpe.attention asks this of q, k and v on every eager CPU call (the non-finite rule of
// urpe/kernels/nonfinite.py runs its exact, slower path only when the answer is no). A
// reduction with torch ops costs several op calls (about 35 us at a decoding shape); this is
// one call and a vectorised pass over the bits: a float is inf or NaN exactly when its exponent
// bits are all ones.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "checks.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

namespace urpe_cpp {
namespace {

constexpr int64_t kGrain = 1 << 16;  // entries per parallel chunk
// Up to this many entries a tensor is checked on the calling thread: the keys or values of a
// decoding step up to Lk = 2048 (B = 1, H = 8, D = 32). Measured (cache-warm, min of 300):
// 11 us on one thread vs 8 us on two at 2^18 entries, 38 vs 13 us at 2^19; but a parallel
// region waits for a busy core's time slice when another process runs there (milliseconds),
// and the kernel runs such a step on one thread (gemm.cpp's kSerialFewRowsWork).
constexpr int64_t kSerialEntries = 1 << 19;

// Threads the check of n contiguous entries runs on.
int64_t check_threads(int64_t n) {
  if (n <= kSerialEntries || at::in_parallel_region()) return 1;
  return std::min<int64_t>(at::get_num_threads(), (n + kGrain - 1) / kGrain);
}

// Whether any of n entries of `bits` has all of `mask`'s bits set.
template <typename Bits>
bool any_exponent_full(const Bits* __restrict bits, int64_t n, Bits mask) {
  unsigned bad = 0;
#pragma omp simd reduction(| : bad)
  for (int64_t i = 0; i < n; ++i) bad |= static_cast<unsigned>((bits[i] & mask) == mask);
  return bad != 0;
}

template <typename Bits>
bool contiguous_finite(const Bits* bits, int64_t n, Bits mask) {
  if (check_threads(n) == 1) return !any_exponent_full(bits, n, mask);
  std::atomic<bool> bad{false};
  at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
    if (!bad.load(std::memory_order_relaxed) &&
        any_exponent_full(bits + begin, end - begin, mask))
      bad.store(true, std::memory_order_relaxed);
  });
  return !bad.load();
}

// Rows along a last dim of stride 1 (a transposed or sliced view, such as q = x.view(B, L, H,
// D).transpose(1, 2)): walked without a copy, the last two dims by plain loops (a training
// step's rows are short: D = 16 entries each, so the walk itself must cost next to nothing).
template <typename Bits>
bool strided_finite(const at::Tensor& t, Bits mask) {
  const Bits* base = reinterpret_cast<const Bits*>(t.const_data_ptr());
  const int64_t dims = t.dim();
  const int64_t row = t.size(dims - 1);
  const int64_t rows = dims >= 2 ? t.size(dims - 2) : 1;
  const int64_t row_stride = dims >= 2 ? t.stride(dims - 2) : 0;
  const int64_t outer = t.numel() / (row * rows);
  std::vector<int64_t> at_index(std::max<int64_t>(dims - 2, 0), 0);
  for (int64_t o = 0; o < outer; ++o) {
    int64_t offset = 0;
    for (int64_t d = 0; d < dims - 2; ++d) offset += at_index[d] * t.stride(d);
    unsigned bad = 0;
    for (int64_t r = 0; r < rows; ++r)
      bad |= any_exponent_full(base + offset + r * row_stride, row, mask);
    if (bad) return false;
    for (int64_t d = dims - 3; d >= 0; --d) {  // next outer index, last dim fastest
      if (++at_index[d] < t.size(d)) break;
      at_index[d] = 0;
    }
  }
  return true;
}

template <typename Bits>
bool finite_as(const at::Tensor& t, Bits mask) {
  // contiguous, or a permutation of contiguous memory (q = x.view(B, L, H, D).transpose(1, 2)):
  // its numel entries lie in one run from its first entry on, checked as one flat array
  if (t.is_contiguous() || t.is_non_overlapping_and_dense())
    return contiguous_finite(reinterpret_cast<const Bits*>(t.const_data_ptr()), t.numel(), mask);
  if (t.dim() > 0 && t.stride(-1) == 1 && t.size(-1) > 0) return strided_finite(t, mask);
  const at::Tensor copy = t.contiguous();
  return contiguous_finite(reinterpret_cast<const Bits*>(copy.const_data_ptr()), copy.numel(),
                           mask);
}

}  // namespace

bool all_finite(const std::vector<at::Tensor>& tensors) {
  for (const at::Tensor& t : tensors) {
    TORCH_CHECK(t.device().is_cpu(), "urpe_cpp::all_finite: CPU tensors only, got ", t.device());
    if (t.numel() == 0) continue;
    bool finite = true;
    switch (t.scalar_type()) {
      case at::kFloat: finite = finite_as<uint32_t>(t, 0x7f800000u); break;
      case at::kDouble: finite = finite_as<uint64_t>(t, 0x7ff0000000000000ull); break;
      case at::kHalf: finite = finite_as<uint16_t>(t, uint16_t{0x7c00}); break;
      case at::kBFloat16: finite = finite_as<uint16_t>(t, uint16_t{0x7f80}); break;
      default:
        TORCH_CHECK(!at::isFloatingType(t.scalar_type()),
                    "urpe_cpp::all_finite: unsupported dtype ", t.scalar_type());
        continue;  // integers and bools are always finite
    }
    if (!finite) return false;
  }
  return true;
}

TORCH_LIBRARY_FRAGMENT(urpe_cpp, m) {
  m.def("all_finite(Tensor[] tensors) -> bool", &all_finite);
  // the threads all_finite checks a contiguous tensor of `entries` on (for the tests)
  m.def("all_finite_threads(int entries) -> int", &check_threads);
}

}  // namespace urpe_cpp
