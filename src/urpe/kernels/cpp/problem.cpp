// Checks a call's arguments and unpacks them into a Problem (problem.h): operands, terms
// (make_term), masks, documents and their runs, and the block ranges by which tiles are skipped.
#include "problem.h"

#include <c10/util/safe_numerics.h>

#include <algorithm>
#include <initializer_list>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "loops.h"

namespace urpe_cpp {

at::ScalarType compute_type(const at::Tensor& q) {
  const at::ScalarType type = q.scalar_type();
  TORCH_CHECK(type == at::kDouble || type == at::kFloat || type == at::kBFloat16,
              "urpe_cpp: q, k, v must be float64, float32 or bfloat16, got ", type);
  return type == at::kBFloat16 ? at::kFloat : type;
}

int64_t stride_or_zero(const at::Tensor& t, int64_t dim) {
  return t.size(dim) == 1 ? 0 : t.stride(dim);
}

bool readable_rows(const at::Tensor& t) {
  return t.dim() == 4 && (t.size(3) <= 1 || t.stride(3) == 1) &&
         (t.size(2) <= 1 || t.stride(2) >= t.size(3));
}

Rows rows_of(const at::Tensor& t) {
  Rows rows;
  rows.sb = stride_or_zero(t, 0);
  rows.sh = stride_or_zero(t, 1);
  rows.si = t.size(2) <= 1 ? std::max<int64_t>(t.size(3), 1) : t.stride(2);
  return rows;
}

void check_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), "urpe_cpp: ", name, " must be a CPU tensor, got ", t.device());
}

void check_blas_rows(const at::Tensor& t, const Rows& rows, int64_t width, const char* name) {
  TORCH_CHECK(width <= kMaxBlas && rows.si <= kMaxBlas, "urpe_cpp: ", name,
              "'s rows must hold fewer than 2^31 entries and lie fewer than 2^31 apart (BLAS "
              "takes int sizes), got shape ", t.sizes(), " with strides ", t.strides());
}

void check_rows(const at::Tensor& t, int64_t numel, at::ScalarType type, const char* name,
                const char* what) {
  check_cpu(t, name);
  TORCH_CHECK(t.scalar_type() == type, "urpe_cpp: ", name, " must be ", type, ", got ",
              t.scalar_type());
  TORCH_CHECK(t.is_contiguous() && t.numel() == numel, "urpe_cpp: ", name, " must be ", numel,
              " contiguous entries ", what, ", got shape ", t.sizes());
}

namespace {

// The shape `check_broadcasts` asks for, written out: "(2|1, 4|1, 7)".
std::string expected_shape(at::IntArrayRef full, int64_t exact_from) {
  std::string shape = "(";
  for (int64_t d = 0; d < static_cast<int64_t>(full.size()); ++d) {
    shape += (d > 0 ? ", " : "") + std::to_string(full[d]) + (d < exact_from ? "|1" : "");
  }
  return shape + ")";
}

// t has t.dim() == full.size() and each size is the full one, or 1 (broadcast) for the dims
// before `exact_from`: from there on the loops read every entry (a decay's or the document
// ids' keys), so a dim of 1 there would be read past its end.
void check_broadcasts(const at::Tensor& t, at::IntArrayRef full, const char* name,
                      const char* dims, int64_t exact_from) {
  bool ok = t.dim() == static_cast<int64_t>(full.size());
  for (int64_t d = 0; ok && d < t.dim(); ++d) {
    ok = t.size(d) == full[d] || (d < exact_from && t.size(d) == 1);
  }
  TORCH_CHECK(ok, "urpe_cpp: ", name, " must have shape ", dims, ", here ",
              expected_shape(full, exact_from), ", got ", t.sizes());
}

// whether the product of the sizes (a size of 0 counted as 1) fits in int64
bool product_fits(std::initializer_list<int64_t> sizes) {
  int64_t total = 1;
  for (int64_t size : sizes) {
    if (c10::mul_overflows(total, std::max<int64_t>(size, 1), &total)) return false;
  }
  return true;
}

// every relation index lies in [0, relations): one min/max pass
void check_relation_range(const at::Tensor& index, int64_t relations, const char* name) {
  if (index.numel() == 0) return;
  const auto [low, high] = at::aminmax(index);
  const int64_t lo = low.item<int64_t>(), hi = high.item<int64_t>();
  TORCH_CHECK(lo >= 0 && hi < relations, "urpe_cpp: the ", name, " relation index must lie in [0, ",
              relations, ") (its table's width), got ", lo < 0 ? lo : hi);
}

template <typename T>
Term<T> make_term(int64_t kind, const OptTensor& tensor, const OptTensor& index, int64_t batch,
                  int64_t heads, int64_t lq, int64_t lk, const char* name) {
  TORCH_CHECK(kind >= kNone && kind <= kCrossDecay, "urpe_cpp: unknown ", name, " kind ", kind,
              " (0 none, 1 dense, 2 Toeplitz, 3 relation, 4 decay, 5 Toeplitz table, "
              "6 cross decay)");
  Term<T> term;
  if (kind == kNone) return term;
  TORCH_CHECK(tensor.has_value(), "urpe_cpp: a ", name, " of kind ", kind, " needs its tensor");
  const at::Tensor& t = *tensor;
  check_cpu(t, name);
  // a float call's cross decay may keep its sums in float64 (a KV cache's: no copy per step)
  const bool wide = kind == kCrossDecay && std::is_same_v<T, float> &&
                    t.scalar_type() == at::kDouble;
  TORCH_CHECK(wide || t.scalar_type() == c10::CppTypeToScalarType<T>::value, "urpe_cpp: the ",
              name, " must be in the compute dtype ", c10::CppTypeToScalarType<T>::value,
              kind == kCrossDecay ? " (or float64 for a float32 one)" : "", ", got ",
              t.scalar_type());
  term.kind = kind;
  if (wide) {
    term.wide = t.data_ptr<double>();
  } else {
    term.data = t.data_ptr<T>();
  }
  term.lq = lq;
  if (kind == kDense) {
    check_broadcasts(t, {batch, heads, lq, lk}, name, "(B|1, H|1, Lq|1, Lk|1)", 4);
    term.sb = stride_or_zero(t, 0);
    term.sh = stride_or_zero(t, 1);
    term.si = stride_or_zero(t, 2);
    term.sj = stride_or_zero(t, 3);
    return term;
  }
  if (kind == kDecay) {
    check_broadcasts(t, {batch, heads, lk}, name,
                     "(B|1, H|1, Lk) as a decay (cumsum(log_forget), one entry per key)", 2);
    TORCH_CHECK(t.is_contiguous(), "urpe_cpp: a decay ", name, " must be contiguous");
    term.sb = stride_or_zero(t, 0);
    term.sh = stride_or_zero(t, 1);
    term.row_len = lk;
    return term;
  }
  if (kind == kCrossDecay) {
    check_broadcasts(t, {batch, heads, lq + lk}, name,
                     "(B|1, H|1, Lq + Lk) cumulative log_forget, the queries' first", 2);
    // rows read where they lie: a growing cache's sums, rows its capacity apart (no copy per
    // decoding step); a gradient's layout wants them contiguous (`make_grad`)
    TORCH_CHECK(t.size(2) <= 1 || t.stride(2) == 1, "urpe_cpp: a cross decay ", name,
                " must have a contiguous last dim");
    term.sb = stride_or_zero(t, 0);
    term.sh = stride_or_zero(t, 1);
    term.row_len = lq + lk;
    return term;
  }
  TORCH_CHECK(t.dim() == 2 && t.is_contiguous() && (t.size(0) == 1 || t.size(0) == heads),
              "urpe_cpp: a ", name, " table must be 2-D, contiguous, with 1 or H = ", heads,
              " rows, got shape ", t.sizes());
  TORCH_CHECK(kind != kToeplitz || t.size(1) == lq + lk - 1 + kLanes, "urpe_cpp: a Toeplitz ",
              name, " must hold Lq + Lk - 1 = ", lq + lk - 1, " offsets and ", kLanes,
              " entries of padding, got ", t.size(1));
  term.row_len = t.size(1);
  term.per_head = t.size(0) > 1;
  if (kind == kToeplitzTable) {
    // entry e (offset e - (Lk - 1)) of head h's row is column e + K - (Lk - 1)
    TORCH_CHECK(t.size(1) % 2 == 1, "urpe_cpp: a Toeplitz ", name, " table (kind 5) must be of "
                "odd width 2K + 1 (offsets -K..K), got width ", t.size(1));
    const int64_t reach = (t.size(1) - 1) / 2;
    if (lk - 1 <= reach && lq - 1 + kLanes <= reach) {  // no column clamped: rows in place
      term.kind = kToeplitz;
      term.data += reach - (lk - 1);
    } else {  // columns clamped per row segment (`Term::clamped_row`)
      term.shift = reach + lq - lk;
    }
  }
  if (kind == kRelation) {
    TORCH_CHECK(index.has_value() && index->scalar_type() == at::kLong,
                "urpe_cpp: a relation ", name, " needs a (B|1, Lq, Lk) int64 index");
    check_cpu(*index, "relation index");
    const std::string index_name = std::string("the ") + name + " relation index";
    check_broadcasts(*index, {batch, lq, lk}, index_name.c_str(), "(B|1, Lq, Lk)", 1);
    check_relation_range(*index, t.size(1), name);
    term.index = index->data_ptr<int64_t>();
    term.ib = stride_or_zero(*index, 0);
    term.ii = index->stride(1);
    term.ij = index->stride(2);
  }
  return term;
}

// The document ids, where given: contiguous int64 (B|1, Lk), or (B|1, Lq + Lk) with the
// queries' own ids first, then the keys' (queries apart from the keys).
void set_documents(Hiding& hiding, const at::Tensor& ids, int64_t batch, int64_t lq, int64_t lk) {
  check_cpu(ids, "documents");
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.is_contiguous(),
              "urpe_cpp: documents must be contiguous int64");
  const bool apart = lq > 0 && ids.dim() == 2 && ids.size(1) == lq + lk;
  check_broadcasts(ids, {batch, apart ? lq + lk : lk}, "documents",
                   apart ? "(B|1, Lq + Lk), the queries' ids then the keys'"
                         : "(B|1, Lk), one id per key",
                   1);
  const int64_t* data = ids.data_ptr<int64_t>();
  hiding.docs = data + (apart ? lq : 0);
  hiding.query_docs = apart ? data : nullptr;
  hiding.docs_sb = ids.size(0) == 1 ? 0 : ids.size(1);
}

// Hiding::run_begin / run_end, where every row's documents are runs of keys (packed sequences,
// padding with one id per token among them): a query block then reads only the keys of its
// queries' runs, and groups of few queries each read only their own (forward.cpp). Not where
// the queries' ids are given apart (every key of a block is read, as without runs).
void set_document_runs(Hiding& hiding, int64_t batch, int64_t lq, int64_t lk) {
  if (hiding.query_docs != nullptr) return;
  const int64_t rows = hiding.docs_sb == 0 ? 1 : batch;
  std::vector<int64_t> begin(rows * lq), end(rows * lq), starts(lk), ends(lk);
  std::vector<std::pair<int64_t, int64_t>> runs;  // (id, first key) of each run
  for (int64_t row = 0; row < rows; ++row) {
    const int64_t* id = hiding.docs + row * hiding.docs_sb;
    runs.clear();
    for (int64_t j = 0; j < lk; ++j) {
      const bool starts_run = j == 0 || id[j] != id[j - 1];
      if (starts_run) runs.emplace_back(id[j], j);
      starts[j] = runs.back().second;
    }
    for (int64_t j = lk - 1; j >= 0; --j) ends[j] = j + 1 < lk && id[j + 1] == id[j] ? ends[j + 1] : j + 1;
    std::sort(runs.begin(), runs.end());
    for (size_t r = 1; r < runs.size(); ++r) {
      if (runs[r].first == runs[r - 1].first) return;  // an id in two runs: every key
    }
    for (int64_t i = 0; i < lq; ++i) {
      const int64_t pos = i + lk - lq, at = row * lq + i;
      if (pos < 0) {  // before the first key: no document
        begin[at] = end[at] = 0;
        continue;
      }
      begin[at] = starts[pos];
      end[at] = ends[pos];
    }
  }
  hiding.run_begin = std::move(begin);
  hiding.run_end = std::move(end);
}

// Per block of queries and of keys, the range of document ids it holds, keys hidden by padding
// left out (`Hiding::shares`): a tile whose two ranges are disjoint is skipped. Exact for any
// ids, and it skips most tiles when each document is one run of keys, and every tile of a
// padded tail (whose keys are all padded, or whose queries are in documents of padding only).
void set_block_ranges(Hiding& hiding, int64_t batch, int64_t lq, int64_t lk, int64_t block_q,
                      int64_t block_k) {
  if (hiding.docs == nullptr && hiding.pad == nullptr) return;
  const bool per_row = (hiding.docs != nullptr && hiding.docs_sb != 0) ||
                       (hiding.pad != nullptr && hiding.pad_sb != 0);
  const int64_t rows = per_row ? batch : 1;
  hiding.block_rows = rows;
  hiding.query_blocks = (lq + block_q - 1) / block_q;
  hiding.key_blocks = (lk + block_k - 1) / block_k;
  const int64_t none_lo = std::numeric_limits<int64_t>::max();
  const int64_t none_hi = std::numeric_limits<int64_t>::min();
  hiding.query_lo.assign(rows * hiding.query_blocks, none_lo);
  hiding.query_hi.assign(rows * hiding.query_blocks, none_hi);
  hiding.key_lo.assign(rows * hiding.key_blocks, none_lo);
  hiding.key_hi.assign(rows * hiding.key_blocks, none_hi);
  for (int64_t row = 0; row < rows; ++row) {
    const int64_t shift = row * hiding.docs_sb;
    const int64_t* id = hiding.docs == nullptr ? nullptr : hiding.docs + shift;
    const int64_t* query_id = hiding.query_docs == nullptr ? nullptr : hiding.query_docs + shift;
    const bool* pad = hiding.pad == nullptr ? nullptr : hiding.pad + row * hiding.pad_sb;
    for (int64_t j = 0; j < lk; ++j) {
      if (pad != nullptr && pad[j * hiding.pad_sj]) continue;
      const int64_t k = row * hiding.key_blocks + j / block_k, own = id ? id[j] : 0;
      hiding.key_lo[k] = std::min(hiding.key_lo[k], own);
      hiding.key_hi[k] = std::max(hiding.key_hi[k], own);
    }
    // queries at pos >= 0 (one before the first key is in no document), every query where
    // their ids are given apart; without documents every query is in document 0
    const int64_t first = id != nullptr && query_id == nullptr ? std::max<int64_t>(0, lq - lk) : 0;
    for (int64_t i = first; i < lq; ++i) {
      const int64_t q = row * hiding.query_blocks + i / block_q;
      const int64_t own = query_id ? query_id[i] : id ? id[i + lk - lq] : 0;
      hiding.query_lo[q] = std::min(hiding.query_lo[q], own);
      hiding.query_hi[q] = std::max(hiding.query_hi[q], own);
    }
  }
}

}  // namespace

template <typename T>
Problem<T> make_problem(URPE_FORWARD_PARAMS) {
  // bfloat16 operands are multiplied as they are (the compute dtype T is then float)
  const bool bf16 = std::is_same_v<T, float> && q.scalar_type() == at::kBFloat16;
  for (const at::Tensor* t : {&q, &k, &v}) {
    TORCH_CHECK(t->device().is_cpu() && readable_rows(*t),
                "urpe_cpp: q, k, v must be 4-D CPU tensors with a contiguous last dim and rows "
                "at least a row apart, got shapes ", q.sizes(), ", ", k.sizes(), ", ", v.sizes(),
                " with strides ", q.strides(), ", ", k.strides(), ", ", v.strides());
    TORCH_CHECK(t->scalar_type() == (bf16 ? at::kBFloat16 : c10::CppTypeToScalarType<T>::value),
                "urpe_cpp: q, k, v must share the compute dtype (or bfloat16), got ",
                q.scalar_type(), ", ", k.scalar_type(), ", ", v.scalar_type());
  }
  TORCH_CHECK(k.size(0) == q.size(0) && v.size(0) == q.size(0) && v.size(1) == k.size(1) &&
                  v.size(2) == k.size(2) && k.size(3) == q.size(3),
              "urpe_cpp: q (B, H, Lq, D), k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv) do not agree: "
              "got ", q.sizes(), ", ", k.sizes(), ", ", v.sizes());
  TORCH_CHECK(!bf16 || bf16_products(), "urpe_cpp: no bf16 x bf16 -> f32 BLAS in this build");
  Problem<T> P;
  P.batch = q.size(0);
  P.heads = q.size(1);
  P.lq = q.size(2);
  P.dim = q.size(3);
  P.kv_heads = k.size(1);
  P.lk = k.size(2);
  P.vdim = v.size(3);
  TORCH_CHECK(P.kv_heads > 0 && P.heads % P.kv_heads == 0, "urpe_cpp: q's heads (", P.heads,
              ") must be a multiple of k's and v's (", P.kv_heads, ")");
  P.groups = P.heads / P.kv_heads;
  // the flat index of a weight (b, h, i, j) (the dropout counter) and the work items' counts
  TORCH_CHECK(product_fits({P.batch, std::max(P.heads, P.kv_heads), P.lq, P.lk}) &&
                  P.vdim <= kMaxBlas / std::max<int64_t>(P.heads, 1),
              "urpe_cpp: B * H * Lq * Lk must fit in int64 and H * Dv (the output's row "
              "stride) in int, got B, H, Hkv, Lq, Lk, Dv = ", P.batch, ", ", P.heads, ", ",
              P.kv_heads, ", ", P.lq, ", ", P.lk, ", ", P.vdim);
  P.q_rows = rows_of(q);
  P.k_rows = rows_of(k);
  P.v_rows = rows_of(v);
  check_blas_rows(q, P.q_rows, P.dim, "q");
  check_blas_rows(k, P.k_rows, P.dim, "k");
  check_blas_rows(v, P.v_rows, P.vdim, "v");
  if (bf16) {
    P.q16 = reinterpret_cast<const uint16_t*>(q.const_data_ptr<at::BFloat16>());
    P.k16 = reinterpret_cast<const uint16_t*>(k.const_data_ptr<at::BFloat16>());
    P.v16 = reinterpret_cast<const uint16_t*>(v.const_data_ptr<at::BFloat16>());
  } else {
    P.q = q.data_ptr<T>();
    P.k = k.data_ptr<T>();
    P.v = v.data_ptr<T>();
  }
  const int64_t B = P.batch, H = P.heads, lq = P.lq, lk = P.lk;
  P.bias = make_term<T>(bias_kind, bias, bias_index, B, H, lq, lk, "bias");
  P.gate = make_term<T>(gate_kind, gate, gate_index, B, H, lq, lk, "gate");
  P.float_mask = make_term<T>(float_mask.has_value() ? kDense : kNone, float_mask, {}, B, H, lq,
                              lk, "float attn_mask");
  Hiding& hiding = P.hiding;
  hiding.causal = causal;
  hiding.shift = P.lk - P.lq;
  hiding.lk = P.lk;
  if (key_padding.has_value()) {  // any strides: a key dim of 1 stands for every key
    check_cpu(*key_padding, "key_padding");
    TORCH_CHECK(key_padding->scalar_type() == at::kBool, "urpe_cpp: key_padding must be bool");
    check_broadcasts(*key_padding, {B, lk}, "key_padding", "(B|1, Lk|1)", 2);
    hiding.pad = key_padding->data_ptr<bool>();
    hiding.pad_sb = stride_or_zero(*key_padding, 0);
    hiding.pad_sj = stride_or_zero(*key_padding, 1);
  }
  if (bool_mask.has_value()) {
    check_cpu(*bool_mask, "bool_mask");
    TORCH_CHECK(bool_mask->scalar_type() == at::kBool, "urpe_cpp: bool_mask must be bool");
    check_broadcasts(*bool_mask, {B, H, lq, lk}, "bool_mask", "(B|1, H|1, Lq|1, Lk|1)",
                     4);
    hiding.keep = bool_mask->data_ptr<bool>();
    hiding.kb = stride_or_zero(*bool_mask, 0);
    hiding.kh = stride_or_zero(*bool_mask, 1);
    hiding.ki = stride_or_zero(*bool_mask, 2);
    hiding.kj = stride_or_zero(*bool_mask, 3);
  }
  TORCH_CHECK(norm >= kSoftmax && norm <= kRelu2, "urpe_cpp: unknown normalisation ", norm);
  P.norm = norm;
  if (P.power() == 0) {
    TORCH_CHECK(fixed.has_value(), "urpe_cpp: this normalisation needs its (B, H, Lq) statistic");
    check_rows(*fixed, B * H * lq, c10::CppTypeToScalarType<T>::value, "fixed", "(B, H, Lq)");
    P.fixed = fixed->data_ptr<T>();
  }
  P.scale = static_cast<T>(scale);
  TORCH_CHECK(dropout_p >= 0.0 && dropout_p < 1.0, "urpe_cpp: dropout_p must be in [0, 1), got ",
              dropout_p);
  if (dropout_p > 0.0) {
    P.dropout.on = true;
    TORCH_CHECK(dropout_threshold >= 0 && dropout_threshold <= (int64_t{1} << 32),
                "urpe_cpp: dropout_threshold must lie in [0, 2^32] (keep where 32 random bits "
                "are below it), got ", dropout_threshold);
    P.dropout.threshold = static_cast<uint64_t>(dropout_threshold);
    // the seed stays a tensor up to here (no host read in Python); read once, on the CPU
    // the seed alone, or (seed, first row, rows, first column, columns): where the call's
    // weights sit in the larger matrix whose flat indices the counter hashes
    TORCH_CHECK(dropout_seed.has_value() &&
                    (dropout_seed->numel() == 1 || dropout_seed->numel() == 5) &&
                    dropout_seed->device().is_cpu() &&
                    at::isIntegralType(dropout_seed->scalar_type(), /*includeBool=*/true),
                "urpe_cpp: dropout needs its seed as a one-element integer CPU tensor (or five: "
                "seed, first row, rows, first column, columns)");
    const at::Tensor numbers = dropout_seed->reshape(-1).to(at::kLong);
    const int64_t* placed = numbers.data_ptr<int64_t>();
    P.dropout.seed(placed[0]);
    P.dropout.rows = lq;
    P.dropout.cols = lk;
    if (numbers.numel() == 5) {
      P.dropout.row0 = placed[1];
      P.dropout.rows = placed[2];
      P.dropout.col0 = placed[3];
      P.dropout.cols = placed[4];
      TORCH_CHECK(placed[1] >= 0 && placed[1] + lq <= placed[2] && placed[3] >= 0 &&
                      placed[3] + lk <= placed[4],
                  "urpe_cpp: the dropout seed places the call's ", lq, " x ", lk,
                  " weights outside its ", placed[2], " x ", placed[4], " matrix");
    }
    P.kept = T(1) / static_cast<T>(1.0 - dropout_p);
  }
  TORCH_CHECK(block_q > 0 && block_k > 0, "urpe_cpp: tile sizes must be positive, got ", block_q,
              " x ", block_k);
  // a tile longer than the call is the whole call (the same tiles; and counts of tiles, which
  // round up by adding the tile size, cannot overflow)
  P.block_q = std::min(block_q, std::max<int64_t>(lq, 1));
  P.block_k = std::min(block_k, std::max<int64_t>(lk, 1));
  TORCH_CHECK(P.block_k <= kMaxBlas - kPackedKeys && P.block_q <= kMaxBlas,
              "urpe_cpp: tiles of 2^31 keys or more do not fit BLAS's int sizes, got ", P.block_q,
              " x ", P.block_k);
  if (documents.has_value()) {
    set_documents(hiding, *documents, B, lq, lk);
    set_document_runs(hiding, B, lq, lk);
  }
  set_block_ranges(hiding, B, lq, lk, P.block_q, P.block_k);
  return P;
}

template Problem<float> make_problem<float>(URPE_FORWARD_PARAMS);
template Problem<double> make_problem<double>(URPE_FORWARD_PARAMS);

}  // namespace urpe_cpp
