// The ops `torch.ops.urpe_cpp.forward` / `.backward`: tensors in, tile loops run, tensors out.
//
// The Python side (urpe/kernels/cpp/ops.py) hands over operands already in the compute dtype
// (float or double), each with a contiguous last dim and rows at least a row apart (views of
// (B, L, H, E) projections are read in place, and their gradients written in their layout),
// each bias or gate as (kind, tensor, index):
//   dense     (B|1, H|1, Lq|1, Lk|1), any strides
//   Toeplitz  (H|1, Lq + Lk - 1): the table read at every offset j - pos(i), entry j - i + Lq - 1
//   Toeplitz table (forward only) (H|1, 2K + 1): the table itself, offsets past K clamped
//   Relation  table (H|1, R) and index (B|1, Lq, Lk) int64, every entry in [0, R)
//   Decay     c = cumsum(log_forget) (B|1, H|1, Lk), contiguous (bias only)
//   CrossDecay c (B|1, H|1, Lq + Lk), the last dim contiguous (contiguous for a gradient);
//             a float forward also takes float64 c (rounded on load)
// document ids as (B|1, Lk) int64, contiguous, and the masks as bool (B|1, H|1, Lq|1, Lk|1) and key padding (B|1, Lk|1), any strides; it
// gets back, for a term whose gradient is asked for, the gradient of that same tensor.
// The ops are public, so every argument is checked (`make_problem`, problem.cpp): a wrong one
// raises a RuntimeError naming it, never reads or writes out of bounds.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <limits>
#include <memory>
#include <string>

#include "library.h"
#include "loops.h"
#include "problem.h"

namespace urpe_cpp {
namespace {

constexpr int64_t kMaxSplits = 8;

// nonfinite, direct: see Problem::nonfinite (null: q, k and v were checked); without
// `with_stat` the statistic (for a backward pass) goes to scratch memory and an undefined tensor
// is returned
std::tuple<at::Tensor, at::Tensor> run_forward(std::atomic<bool>* nonfinite, bool direct,
                                               bool with_stat, URPE_FORWARD_PARAMS) {
  const at::TensorOptions options = q.options().dtype(compute_type(q));
  at::Tensor out, stat;
  AT_DISPATCH_FLOATING_TYPES(compute_type(q), "urpe_cpp::forward", [&] {
    Problem<scalar_t> P = make_problem<scalar_t>(URPE_PROBLEM_ARGS);
    P.nonfinite = nonfinite;
    P.direct = direct;
    std::unique_ptr<std::atomic<uint8_t>[]> finite_keys;  // (all 0: none checked yet)
    if (nonfinite != nullptr && !direct) {
      finite_keys.reset(new std::atomic<uint8_t>[P.batch * P.kv_heads * P.key_blocks()]());
      P.finite_keys = finite_keys.get();
    }
    // (B, Lq, H, Dv) memory: the caller's (B, Lq, H * Dv) rows are a view of it, not a copy
    out = at::empty({P.batch, P.lq, P.heads, P.vdim}, options).transpose(1, 2);
    std::vector<scalar_t> scratch;
    scalar_t* stat_data;
    if (with_stat) {
      stat = at::empty({P.batch, P.heads, P.lq}, options);
      stat_data = stat.data_ptr<scalar_t>();
    } else {
      scratch.resize(P.batch * P.heads * P.lq);
      stat_data = scratch.data();
    }
    forward_loop<scalar_t>(P, out.data_ptr<scalar_t>(), rows_of(out), stat_data);
  });
  return {out, stat};
}

std::tuple<at::Tensor, at::Tensor> forward(URPE_FORWARD_PARAMS) {
  return run_forward(nullptr, false, true, URPE_PROBLEM_ARGS);
}

// `forward` for a caller that has not checked q, k, v and wants no gradient: (out, true), or
// (empty, false) without a result when any of them holds a NaN or inf in a row that a computed
// tile reads (the caller then applies the non-finite rule). One op call instead of two, and no
// pass over the rows of tiles the loop skips: a row of 512 real tokens and 3,584 padded ones
// checked up front read 8x the data its tiles do (Problem::nonfinite). For one query row per
// head the loop checks q, k and v by the logits and outputs it computes instead
// (Problem::direct): a pass over Lq x Lk logits instead of Lk x (D + Dv) keys and values, on
// data already in cache.
std::tuple<at::Tensor, bool> forward_checked(URPE_FORWARD_PARAMS) {
  // One query row per head: the products run as loops over every key (rows_nt, rows_nn),
  // whatever the cache's length, so that the cache is read once, not checked first and read
  // again (a long cache does not fit in the caches: the check doubled the call's memory
  // traffic). As fast as BLAS's gemv for one row, which streams the same keys.
  const bool direct =
      q.dim() == 4 && k.dim() == 4 && v.dim() == 4 &&
      (q.scalar_type() == at::kFloat || q.scalar_type() == at::kDouble ||
       q.scalar_type() == at::kBFloat16) &&
      std::min(q.size(2), block_q) <= kDirectRows;
  std::atomic<bool> nonfinite{false};
  at::Tensor out = std::get<0>(run_forward(&nonfinite, direct, false, URPE_PROBLEM_ARGS));
  if (nonfinite.load()) return {at::empty({0}, q.options()), false};
  return {out, true};
}

// `forward` for a call with gradients whose q, k and v nobody checked: (out, stat, true), or
// (empty, empty, false) where a row that a computed tile reads holds a NaN or inf (the caller
// then applies the non-finite rule). The check rides on the loop's own reads, as in
// `forward_checked`: a separate pass over q, k and v up front read all of a padded tail's rows,
// which the tiles skip (24 MB for 4,096 rows of 8 x 64 heads).
std::tuple<at::Tensor, at::Tensor, bool> forward_checked_with_stat(URPE_FORWARD_PARAMS) {
  std::atomic<bool> nonfinite{false};
  auto [out, stat] = run_forward(&nonfinite, false, true, URPE_PROBLEM_ARGS);
  if (nonfinite.load()) {
    const at::Tensor none = at::empty({0}, q.options());
    return {none, none, false};
  }
  return {out, stat, true};
}

}  // namespace

// `forward_checked` with only the arguments a decoding step has (no dropout, documents or fixed
// statistic; no statistic returned): at a decoding shape a call through torch.ops costs
// several microseconds, as much as the kernel itself, and each argument adds to it. Also
// handed to Python without the dispatcher (entry.cpp, declared in library.h).
std::tuple<at::Tensor, bool> forward_if_finite(URPE_DECODING_PARAMS) {
  const OptTensor documents, fixed, dropout_seed;
  const double dropout_p = 0.0;
  const int64_t dropout_threshold = 0;
  return forward_checked(URPE_PROBLEM_ARGS);
}

namespace {

// A gradient of q, k or v, laid out as empty_like lays out the tensor (what the ops' fake
// implementations promise, and no copy for a view of a (B, L, H, E) projection), or
// contiguous where those rows could not be written.
at::Tensor gradient_like(const at::Tensor& t, const at::TensorOptions& options) {
  at::Tensor grad = at::empty_like(t, options);
  return readable_rows(grad) ? grad : at::empty(t.sizes(), options);
}

// `copies` gradients of t, stacked in a leading dim, left for the work items to zero (each its
// own rows, in cache, on its own thread): one is laid out as gradient_like
at::Tensor gradient_copies(const at::Tensor& t, int64_t copies, const at::TensorOptions& options,
                           Rows& rows, int64_t& copy_stride) {
  at::Tensor grads;
  if (copies == 1) {
    grads = gradient_like(t, options).unsqueeze(0);
  } else {
    std::vector<int64_t> sizes{copies};
    sizes.insert(sizes.end(), t.sizes().begin(), t.sizes().end());
    grads = at::empty(sizes, options);
  }
  rows = rows_of(grads.select(0, 0));
  copy_stride = grads.stride(0);
  return grads;
}

// The gradient of a term (kind, tensor) into a fresh tensor; tables get one copy per worker.
template <typename T>
TermGrad<T> make_grad(const Term<T>& term, const at::Tensor& tensor, at::Tensor& grad,
                      int64_t workers) {
  TORCH_CHECK(term.wide == nullptr, "urpe_cpp: a cross decay's gradient needs its c in the "
              "compute dtype (float64 sums are read by a forward only)");
  TermGrad<T> g;
  g.layout = term;
  if (term.kind == kDense) {
    grad = at::zeros(tensor.sizes(), tensor.options());
    g.sb = stride_or_zero(grad, 0);
    g.sh = stride_or_zero(grad, 1);
    g.si = stride_or_zero(grad, 2);
    g.sj = stride_or_zero(grad, 3);
  } else {  // tables and decay: one copy per worker, laid out as the term
    TORCH_CHECK(tensor.is_contiguous(), "urpe_cpp: the gradient of a term needs it contiguous");
    std::vector<int64_t> sizes{workers};
    for (int64_t size : tensor.sizes()) sizes.push_back(size);
    grad = at::zeros(sizes, tensor.options());
    g.slot_size = tensor.numel();
  }
  g.data = grad.data_ptr<T>();
  return g;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> backward(
    const at::Tensor& grad_out, const at::Tensor& stat, const at::Tensor& out,
    URPE_FORWARD_PARAMS, bool needs_bias, bool needs_gate, bool needs_mask,
    int64_t items_per_thread) {
  // (a table read in place has no gradient layout here: its offsets start mid-row)
  TORCH_CHECK(bias_kind != kToeplitzTable && gate_kind != kToeplitzTable,
              "urpe_cpp: the backward takes Toeplitz terms as rows (kind 2), not tables (5)");
  TORCH_CHECK(items_per_thread > 0, "urpe_cpp: items_per_thread must be positive, got ",
              items_per_thread);
  const at::TensorOptions options = q.options().dtype(compute_type(q));
  at::Tensor dq = gradient_like(q, options);
  at::Tensor dk, dv, dbias, dgate, dmask;
  AT_DISPATCH_FLOATING_TYPES(compute_type(q), "urpe_cpp::backward", [&] {
    const Problem<scalar_t> P = make_problem<scalar_t>(URPE_PROBLEM_ARGS);
    const int64_t rows = P.batch * P.heads * P.lq;
    check_cpu(grad_out, "grad_out");
    TORCH_CHECK(grad_out.scalar_type() == q.scalar_type(), "urpe_cpp: grad_out must be ",
                q.scalar_type(), " like q, got ", grad_out.scalar_type());
    TORCH_CHECK(readable_rows(grad_out) &&
                    grad_out.sizes() == at::IntArrayRef({P.batch, P.heads, P.lq, P.vdim}),
                "urpe_cpp: grad_out must be (B, H, Lq, Dv) like the output, with a contiguous "
                "last dim and rows at least a row apart, got shape ", grad_out.sizes(),
                " with strides ", grad_out.strides());
    check_rows(stat, rows, compute_type(q), "stat", "(B, H, Lq)");
    check_cpu(out, "out");
    TORCH_CHECK(out.scalar_type() == compute_type(q), "urpe_cpp: out must be ", compute_type(q),
                " (the compute dtype), got ", out.scalar_type());
    TORCH_CHECK(readable_rows(out) &&
                    out.sizes() == at::IntArrayRef({P.batch, P.heads, P.lq, P.vdim}),
                "urpe_cpp: out must be the forward's (B, H, Lq, Dv) output, with a contiguous "
                "last dim and rows at least a row apart, got shape ", out.sizes(),
                " with strides ", out.strides());
    Gradients<scalar_t> G;
    if (P.bf16()) {
      G.grad_out16 = reinterpret_cast<const uint16_t*>(grad_out.const_data_ptr<at::BFloat16>());
    } else {
      G.grad_out = grad_out.data_ptr<scalar_t>();
    }
    G.stat = stat.data_ptr<scalar_t>();
    G.out = out.data_ptr<scalar_t>();
    G.out_rows = rows_of(out);
    G.grad_out_rows = rows_of(grad_out);
    check_blas_rows(out, G.out_rows, P.vdim, "out");
    check_blas_rows(grad_out, G.grad_out_rows, P.vdim, "grad_out");
    G.dq = dq.data_ptr<scalar_t>();
    G.dq_rows = rows_of(dq);
    // a dense gradient broadcast over a dim keeps that dim inside one work item
    const std::pair<const Term<scalar_t>*, const OptTensor*> dense[] = {
        {needs_bias ? &P.bias : nullptr, &bias},
        {needs_gate ? &P.gate : nullptr, &gate},
        {needs_mask ? &P.float_mask : nullptr, &float_mask}};
    bool rows_shared = false;
    for (const auto& [term, tensor] : dense) {
      if (term == nullptr || term->kind != kDense) continue;
      const at::Tensor& t = **tensor;
      G.serial_batch = G.serial_batch || (t.size(0) == 1 && P.batch > 1);
      G.serial_heads = G.serial_heads || (t.size(1) == 1 && P.kv_heads > 1);
      rows_shared = rows_shared || (t.size(2) == 1 && P.lq > 1);
    }
    // Few (batch, kv head) items for the threads: split the query blocks into ranges with
    // their own dk, dv copies (at most kMaxSplits copies), so that a slow thread can be helped.
    // (No items at B = 0, no blocks at Lq = 0: one split. `wanted` in double: a huge
    // items_per_thread asks for the most splits, not an overflow.)
    const int64_t blocks = (P.lq + P.block_q - 1) / P.block_q;
    const int64_t items = (G.serial_batch ? 1 : P.batch) * (G.serial_heads ? 1 : P.kv_heads);
    const double most = static_cast<double>(std::max<int64_t>(1, std::min(blocks, kMaxSplits)));
    const double wanted = static_cast<double>(items_per_thread) *
                          static_cast<double>(workers_for(items * blocks, P.work(), P.lq));
    const double per_item = items > 0 ? std::ceil(wanted / static_cast<double>(items)) : 1.0;
    G.splits = rows_shared ? 1 : static_cast<int64_t>(std::clamp(per_item, 1.0, most));
    const int64_t workers = workers_for(items * G.splits, P.work(), P.lq);
    dk = gradient_copies(k, G.splits, options, G.dk_rows, G.dk_split);
    dv = gradient_copies(v, G.splits, options, G.dv_rows, G.dv_split);
    G.dk = dk.data_ptr<scalar_t>();
    G.dv = dv.data_ptr<scalar_t>();
    if (needs_bias && P.bias.present()) G.bias = make_grad(P.bias, *bias, dbias, workers);
    if (needs_gate && P.gate.present()) G.gate = make_grad(P.gate, *gate, dgate, workers);
    if (needs_mask && P.float_mask.present()) {
      G.float_mask = make_grad(P.float_mask, *float_mask, dmask, workers);
    }
    backward_loop<scalar_t>(P, G);
  });
  // sum the split copies of dk, dv and the per-worker copies of table gradients (one copy is
  // taken as it is: a sum over a dim of 1 would cost a zero fill and a copy of dk and dv)
  const at::Tensor none = at::empty({0}, options);
  auto total = [](const at::Tensor& copies) {
    return copies.size(0) == 1 ? copies.select(0, 0) : copies.sum(0);
  };
  auto finish = [&](const at::Tensor& grad, int64_t kind) -> at::Tensor {
    if (!grad.defined()) return none;
    return kind == kDense ? grad : total(grad);
  };
  return {dq, total(dk), total(dv), finish(dbias, bias_kind), finish(dgate, gate_kind),
          finish(dmask, kDense)};
}

// exp as the tile loops compute it, elementwise (for the tests of its accuracy)
at::Tensor exp_values(const at::Tensor& x) {
  check_cpu(x, "x");
  at::Tensor in = x.contiguous();
  at::Tensor out = at::empty_like(in);
  AT_DISPATCH_FLOATING_TYPES(in.scalar_type(), "urpe_cpp::exp_values", [&] {
    const scalar_t* src = in.data_ptr<scalar_t>();
    scalar_t* dst = out.data_ptr<scalar_t>();
    for (int64_t e = 0; e < in.numel(); ++e) dst[e] = exp_value(src[e]);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(urpe_cpp, m) {
  m.def(
      "forward(Tensor q, Tensor k, Tensor v, int bias_kind, Tensor? bias, Tensor? bias_index, "
      "int gate_kind, Tensor? gate, Tensor? gate_index, Tensor? float_mask, Tensor? bool_mask, "
      "Tensor? key_padding, Tensor? documents, Tensor? fixed, bool causal, int norm, "
      "float scale, float dropout_p, int dropout_threshold, Tensor? dropout_seed, int block_q, int block_k) "
      "-> (Tensor, Tensor)",
      &forward);
  m.def(
      "forward_if_finite(Tensor q, Tensor k, Tensor v, int bias_kind, Tensor? bias, "
      "Tensor? bias_index, int gate_kind, Tensor? gate, Tensor? gate_index, Tensor? float_mask, "
      "Tensor? bool_mask, Tensor? key_padding, bool causal, int norm, float scale, int block_q, "
      "int block_k) -> (Tensor, bool)",
      &forward_if_finite);
  m.def(
      "forward_checked(Tensor q, Tensor k, Tensor v, int bias_kind, Tensor? bias, "
      "Tensor? bias_index, int gate_kind, Tensor? gate, Tensor? gate_index, Tensor? float_mask, "
      "Tensor? bool_mask, Tensor? key_padding, Tensor? documents, Tensor? fixed, bool causal, "
      "int norm, float scale, float dropout_p, int dropout_threshold, Tensor? dropout_seed, "
      "int block_q, int block_k) -> (Tensor, bool)",
      &forward_checked);
  m.def(
      "forward_checked_with_stat(Tensor q, Tensor k, Tensor v, int bias_kind, Tensor? bias, "
      "Tensor? bias_index, int gate_kind, Tensor? gate, Tensor? gate_index, Tensor? float_mask, "
      "Tensor? bool_mask, Tensor? key_padding, Tensor? documents, Tensor? fixed, bool causal, "
      "int norm, float scale, float dropout_p, int dropout_threshold, Tensor? dropout_seed, "
      "int block_q, int block_k) -> (Tensor, Tensor, bool)",
      &forward_checked_with_stat);
  m.def(
      "backward(Tensor grad_out, Tensor stat, Tensor out, Tensor q, Tensor k, Tensor v, "
      "int bias_kind, Tensor? bias, Tensor? bias_index, int gate_kind, Tensor? gate, "
      "Tensor? gate_index, Tensor? float_mask, Tensor? bool_mask, Tensor? key_padding, "
      "Tensor? documents, Tensor? fixed, bool causal, int norm, float scale, float dropout_p, "
      "int dropout_threshold, Tensor? dropout_seed, int block_q, int block_k, bool needs_bias, "
      "bool needs_gate, bool needs_mask, int items_per_thread) "
      "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
      &backward);
  m.def("gemm_route() -> str", [] { return std::string(gemm_route()); });
  m.def("exp_values(Tensor x) -> Tensor", &exp_values);
  m.def("bf16_products() -> bool", [] { return bf16_products(); });
  // the threads a tile loop of `count` work items, `work` multiply-adds and `query_rows` query
  // rows per head runs on (for the tests of when a call stays on one thread)
  m.def("workers(int count, float work, int query_rows) -> int", &workers_for);
  // whether at::parallel_for can spread the tiles over threads (built with OpenMP)
  m.def("threaded() -> bool", [] {
#ifdef _OPENMP
    return true;
#else
    return false;
#endif
  });
}

}  // namespace urpe_cpp
