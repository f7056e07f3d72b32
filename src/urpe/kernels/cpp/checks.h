// Checks shared by the ops (checks.cpp).
#pragma once

#include <ATen/ATen.h>

#include <vector>

namespace urpe_cpp {

// Whether every entry of every (CPU) tensor is finite; integer and bool tensors always are.
bool all_finite(const std::vector<at::Tensor>& tensors);

}  // namespace urpe_cpp
