// One decoding step of FoX's forget gates (forget_step.cpp), shared with the Python entry.
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace urpe_cpp {

// A token's log forget gates, log f = logsigmoid(x W^T + b), added to the running float64 sums
// c that urpe.hf keeps beside a KV cache (urpe/hf/forget_history.py, `Cumulative`).
//   x: (B, 1, D), the layer's input at the new token; weight: (H, D); bias: (H) or none.
//   sums: (B, H, capacity) float64, contiguous: slot 0 holds c of the last token, slots
//   1 .. length the sums of every token so far; capacity >= length + 2.
// Writes c of the new token to slot 0 and to slot length + 1; returns log f (B, 1, H) in x's
// dtype, float32 for bfloat16 and float16 (as the Python step rounds them). Returns nothing,
// and changes nothing, where x, weight and bias are not CPU tensors of one floating dtype laid
// out as above (x's rows of stride 1, weight and bias contiguous).
std::optional<at::Tensor> forget_step(const at::Tensor& x, const at::Tensor& weight,
                                      const std::optional<at::Tensor>& bias,
                                      const at::Tensor& sums, int64_t length);

}  // namespace urpe_cpp
