// `forget_step` (forget_step.h): a transformers model's FoX decoding step in one call.
//
// In Python the step is three torch ops per layer and step (the projection, softplus, the
// float64 add into the kept sums), each microseconds of argument handling around nanoseconds
// of arithmetic; inside a generating model, where each runs with cold caches, issue 42
// measured them at ~35 us per layer and step (in a loop: 12 us). An ATen projection called
// from here still took ~12 us cold (its BLAS route); here a token's H dot products are plain
// loops over B * H rows of D, and the values match the Python step's to rounding (the sums'
// order differs from BLAS's), with log f rounded to the model's dtype as F.linear and softplus
// round them.
#include "forget_step.h"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <optional>
#include <type_traits>

namespace urpe_cpp {
namespace {

constexpr int64_t kLanes = 16;  // independent partial sums: one AVX-512 register of floats

// x . w over d entries, in Acc: kLanes partial sums (a fixed order, which the compiler turns
// into vector multiply-adds without reassociating), then their sum.
template <typename T, typename Acc>
Acc dot(const T* __restrict x, const T* __restrict w, int64_t d) {
  Acc partial[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= d; i += kLanes)
    for (int64_t l = 0; l < kLanes; ++l)
      partial[l] += static_cast<Acc>(x[i + l]) * static_cast<Acc>(w[i + l]);
  Acc sum = 0;
  for (; i < d; ++i) sum += static_cast<Acc>(x[i]) * static_cast<Acc>(w[i]);
  for (int64_t l = 0; l < kLanes; ++l) sum += partial[l];
  return sum;
}

// log(sigmoid(z)) as softplus(z, beta = -1, threshold = 20) computes it (ATen's formula).
template <typename Acc>
Acc log_sigmoid(Acc z) {
  return -z > Acc(20) ? z : -std::log1p(std::exp(-z));
}

}  // namespace

std::optional<at::Tensor> forget_step(const at::Tensor& x, const at::Tensor& weight,
                                      const std::optional<at::Tensor>& bias,
                                      const at::Tensor& sums, int64_t length) {
  const bool cpu = x.is_cpu() && weight.is_cpu() && sums.is_cpu() && (!bias || bias->is_cpu());
  const at::ScalarType dtype = x.scalar_type();
  const bool laid_out = x.dim() == 3 && x.size(1) == 1 && x.stride(2) == 1 && weight.dim() == 2 &&
                        weight.is_contiguous() && weight.size(1) == x.size(2);
  const bool same_dtype = weight.scalar_type() == dtype &&
                          (!bias || (bias->scalar_type() == dtype && bias->is_contiguous() &&
                                     bias->numel() == weight.size(0)));
  if (!cpu || !at::isFloatingType(dtype) || !laid_out || !same_dtype)
    return std::nullopt;  // the caller's Python step computes these
  TORCH_CHECK(sums.scalar_type() == at::kDouble && sums.is_contiguous() && sums.dim() == 3,
              "forget_step: sums must be a contiguous float64 (B, H, capacity) tensor");
  const int64_t batch = sums.size(0), heads = sums.size(1), capacity = sums.size(2);
  const int64_t d = x.size(2);
  TORCH_CHECK(x.size(0) == batch && weight.size(0) == heads,
              "forget_step: x, weight and sums disagree on B or H");
  TORCH_CHECK(length >= 0 && length + 2 <= capacity, "forget_step: no room for a new sum");
  // log f in x's dtype, float32 for half types (a cumulative sum of ~1e-4 steps in half
  // would lose them)
  const bool half = x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf;
  const at::ScalarType row_dtype = half ? at::kFloat : x.scalar_type();
  at::Tensor rows = at::empty({batch, 1, heads}, x.options().dtype(row_dtype));
  double* c = sums.data_ptr<double>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "forget_step", [&] {
    using Acc = at::opmath_type<scalar_t>;  // float for half types, as their products accumulate
    using Row = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
    const scalar_t* w = weight.data_ptr<scalar_t>();
    const scalar_t* b = bias ? bias->data_ptr<scalar_t>() : nullptr;
    Row* out = rows.data_ptr<Row>();
    for (int64_t i = 0; i < batch; ++i) {
      const scalar_t* xi = x.data_ptr<scalar_t>() + i * x.stride(0);
      for (int64_t h = 0; h < heads; ++h) {
        Acc z = dot<scalar_t, Acc>(xi, w + h * d, d);
        if (b) z += static_cast<Acc>(b[h]);
        // F.linear and softplus round their outputs to the dtype: half types too
        z = static_cast<Acc>(static_cast<scalar_t>(z));
        const Row log_f = static_cast<Row>(static_cast<scalar_t>(log_sigmoid(z)));
        out[i * heads + h] = log_f;
        double* row = c + (i * heads + h) * capacity;
        const double next = (length == 0 ? 0.0 : row[0]) + static_cast<double>(log_f);
        row[0] = next;  // c of the last token, read by the next step
        row[length + 1] = next;
      }
    }
  });
  return rows;
}

}  // namespace urpe_cpp
