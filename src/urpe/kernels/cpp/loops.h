// The two tile loops (forward.cpp, backward.cpp), called by library.cpp.
#pragma once

#include <memory>

#include "tile.h"

namespace urpe_cpp {

// Keys packed for the AMX tile kernel (oneDNN's brgemm through ATen's cpublas, as ATen's own
// CPU flash attention multiplies bfloat16): BLAS's bf16 product packs both operands on every
// call and, at a score tile's shape (K = D = 64), runs at a third of that kernel's speed.
// Packed once per call, in blocks of kPackedKeys keys (zeros past the last key).
constexpr int64_t kPackedKeys = 64;
// whether this build and CPU have the kernel, for head width d
bool packed_keys_available(int64_t d);
// entries of one kv head's packed keys (lk keys of width d)
int64_t packed_keys_size(int64_t lk, int64_t d);
// k (lk, d; rows ldk apart) in bfloat16 -> packed (packed_keys_size entries)
void pack_keys(const uint16_t* k, int64_t lk, int64_t d, int64_t ldk, uint16_t* packed);
// S (m x n; rows ld apart, ld >= n rounded up to kPackedKeys) = Q (m x d; rows ldq apart) K^T
// for the keys from a block's start on: `packed` points into pack_keys' output at that block
void gemm_nt_packed(int64_t m, int64_t n, int64_t d, const uint16_t* q, int64_t ldq,
                    const uint16_t* packed, float* s, int64_t ld);
// Values packed likewise, in column blocks of at most kPackedKeys (Dv a multiple of 16)
bool packed_values_available(int64_t dv);
int64_t packed_values_size(int64_t lk, int64_t dv);
// v (lk, dv; rows ldv apart) in bfloat16 -> packed (packed_values_size entries)
void pack_values(const uint16_t* v, int64_t lk, int64_t dv, int64_t ldv, uint16_t* packed);
// acc (m x dv) = A V, or += where `add`, for the weights A (m x n in bfloat16, rows ld apart,
// ld >= n rounded up to 2 with a 0 at column n where n is odd) and the keys j0.. (j0 a
// multiple of kPackedKeys) of the kv head whose packed values (lk keys) start at `packed`; acc's
// rows lie ldc apart
void gemm_nn_packed(int64_t m, int64_t n, int64_t dv, const uint16_t* a, int64_t ld,
                    const uint16_t* packed, int64_t lk, int64_t j0, bool add, float* acc,
                    int64_t ldc);
// Ends a run of packed products on this thread: the kernel keeps the AMX tiles configured
// between calls, and BLAS's own AMX code changes them, so the next BLAS call must come after.
void release_packed();

// out (B, H, Lq, Dv; rows at out_rows) and stat (B, H, Lq): written, not read.
template <typename T>
void forward_loop(const Problem<T>& P, T* out, Rows out_rows, T* stat);

// What the backward pass reads and writes besides the problem.
template <typename T>
struct Gradients {
  const T* grad_out = nullptr;  // (B, H, Lq, Dv), rows at grad_out_rows
  const uint16_t* grad_out16 = nullptr;  // the same in bfloat16, with the problem's operands
  const T* stat = nullptr;      // (B, H, Lq), the forward's row statistic
  const T* out = nullptr;       // (B, H, Lq, Dv), the forward's output, rows at out_rows
  T* dq = nullptr;              // (B, H, Lq, D), written
  T* dk = nullptr;              // (splits, B, Hkv, Lk, D), zeroed by each work item, accumulated
  T* dv = nullptr;              // (splits, B, Hkv, Lk, Dv), likewise
  Rows grad_out_rows, out_rows, dq_rows, dk_rows, dv_rows;
  int64_t dk_split = 0, dv_split = 0;  // strides of dk's and dv's split copies
  int64_t splits = 1;           // query-block ranges that keep their own dk, dv
  TermGrad<T> bias, gate, float_mask;
  // dense gradients that broadcast over batch or kv heads: those dims stay in one work item
  bool serial_batch = false, serial_heads = false;
};

template <typename T>
void backward_loop(const Problem<T>& P, const Gradients<T>& G);

}  // namespace urpe_cpp
