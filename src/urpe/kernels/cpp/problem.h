// A call's arguments checked and unpacked into a Problem (problem.cpp): the ops are public
// (torch.ops.urpe_cpp.*), so every argument is checked, cheaply, and a wrong one raises a
// RuntimeError naming it instead of reading or writing out of bounds. Also the checks and row
// layouts library.cpp's ops share with it.
#pragma once

#include <ATen/ATen.h>

#include <limits>

#include "library.h"
#include "tile.h"

namespace urpe_cpp {

// The arguments of the forward op (and the backward's after its first three), as parameters
// and as the arguments passed on
#define URPE_PROBLEM_ARGS                                                                     \
  q, k, v, bias_kind, bias, bias_index, gate_kind, gate, gate_index, float_mask, bool_mask,  \
      key_padding, documents, fixed, causal, norm, scale, dropout_p, dropout_threshold,       \
      dropout_seed, block_q, block_k

#define URPE_FORWARD_PARAMS                                                                    \
  const at::Tensor &q, const at::Tensor &k, const at::Tensor &v, int64_t bias_kind,             \
      const OptTensor &bias, const OptTensor &bias_index, int64_t gate_kind,                     \
      const OptTensor &gate, const OptTensor &gate_index, const OptTensor &float_mask,           \
      const OptTensor &bool_mask, const OptTensor &key_padding, const OptTensor &documents,      \
      const OptTensor &fixed, bool causal, int64_t norm, double scale, double dropout_p,         \
      int64_t dropout_threshold, const OptTensor &dropout_seed, int64_t block_q, int64_t block_k

// BLAS takes sizes and leading dimensions as int: a (B, H, L, E) operand's rows (`rows`, E
// entries each) must be shorter, and lie closer together, than 2^31 entries.
constexpr int64_t kMaxBlas = std::numeric_limits<int>::max();

// float for bfloat16 operands, else their own dtype
at::ScalarType compute_type(const at::Tensor& q);

// t's stride along dim, 0 where the dim has one entry (broadcast)
int64_t stride_or_zero(const at::Tensor& t, int64_t dim);

// Whether a 4-D tensor's rows can be read where they lie: the last dim contiguous and rows at
// least a row apart (the products take them with that leading dimension).
bool readable_rows(const at::Tensor& t);

// The rows of a 4-D tensor that `readable_rows` accepts (a single row counts as a row apart).
Rows rows_of(const at::Tensor& t);

void check_cpu(const at::Tensor& t, const char* name);

// a (B, H, L, E) operand's rows fit BLAS's int sizes (`kMaxBlas`)
void check_blas_rows(const at::Tensor& t, const Rows& rows, int64_t width, const char* name);

// t holds `numel` entries (`what`) of dtype `type`, contiguous, on the CPU
void check_rows(const at::Tensor& t, int64_t numel, at::ScalarType type, const char* name,
                const char* what);

// The Problem of one forward or backward call (T: the compute dtype, float or double), its
// terms, masks, documents and the ranges that let tiles be skipped set up.
template <typename T>
Problem<T> make_problem(URPE_FORWARD_PARAMS);

}  // namespace urpe_cpp
