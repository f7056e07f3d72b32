// The two tile loops (forward.cpp, backward.cpp), called by library.cpp.
#pragma once

#include <memory>

#include "tile.h"

namespace urpe_cpp {

// out (B, H, Lq, Dv) and stat (B, H, Lq): written, not read.
template <typename T>
void forward_loop(const Problem<T>& P, T* out, T* stat);

// What the backward pass reads and writes besides the problem.
template <typename T>
struct Gradients {
  const T* grad_out = nullptr;  // (B, H, Lq, Dv)
  const uint16_t* grad_out16 = nullptr;  // the same in bfloat16, with the problem's operands
  const T* stat = nullptr;      // (B, H, Lq), the forward's row statistic
  const T* delta = nullptr;     // (B, H, Lq): sum_e dO_ie O_ie
  T* dq = nullptr;              // (B, H, Lq, D), written
  T* dk = nullptr;              // (splits, B, Hkv, Lk, D), zeroed by the caller, accumulated
  T* dv = nullptr;              // (splits, B, Hkv, Lk, Dv), likewise
  int64_t splits = 1;           // query-block ranges that keep their own dk, dv
  TermGrad<T> bias, gate, float_mask;
  // dense gradients that broadcast over batch or kv heads: those dims stay in one work item
  bool serial_batch = false, serial_heads = false;
};

template <typename T>
void backward_loop(const Problem<T>& P, const Gradients<T>& G);

}  // namespace urpe_cpp
