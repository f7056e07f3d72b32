// What library.cpp shares with the Python entry (entry.cpp): the forward of a decoding step.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

namespace urpe_cpp {

using OptTensor = std::optional<at::Tensor>;

#define URPE_DECODING_PARAMS                                                                  \
  const at::Tensor &q, const at::Tensor &k, const at::Tensor &v, int64_t bias_kind,            \
      const OptTensor &bias, const OptTensor &bias_index, int64_t gate_kind,                    \
      const OptTensor &gate, const OptTensor &gate_index, const OptTensor &float_mask,          \
      const OptTensor &bool_mask, const OptTensor &key_padding, bool causal, int64_t norm,      \
      double scale, int64_t block_q, int64_t block_k

// The op urpe_cpp::forward_if_finite (library.cpp): (out, true), or (empty, false) where q, k
// or v holds a NaN or inf that the call reads.
std::tuple<at::Tensor, bool> forward_if_finite(URPE_DECODING_PARAMS);

}  // namespace urpe_cpp
