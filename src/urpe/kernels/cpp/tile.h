// The pieces every tile of the C++ CPU kernel uses: the problem's sizes and tensors, how a bias,
// gate or mask row is read and how its gradient is gathered, which pairs are hidden, exp,
// dropout and the matrix products. forward.cpp and backward.cpp hold the two loops.
//
// Layout (row-major, contiguous, in the compute dtype T = float or double):
//   q (B, H, Lq, D), k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv); query head h reads kv head h / G.
//   Query i sits at position i + Lk - Lq (the last query meets the last key), so with
//   causal masking it sees keys j <= i + Lk - Lq.
// A score tile is bq queries x n keys; everything per element happens on rows of it while the
// tile is in cache.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace urpe_cpp {

// Normalisations (urpe.kernels.normalization): weights a = f(s, r_i) for a row statistic r_i.
enum Norm : int64_t { kSoftmax = 0, kExp = 1, kL2 = 2, kRelu2 = 3 };
// How a bias or gate is given.
// kDecay: a `Decay` bias -|c[pos(i)] - c[j]|, read from c = cumsum(log_forget) (B|1, H|1, Lk).
// kToeplitzTable: a Toeplitz table itself (H|1, 2K + 1) over offsets -K..K, for a forward whose
// offsets and padding lie inside it (no column clamped): read as kToeplitz rows in place,
// without building them (a decoding step's gate; `make_term`).
// kCrossDecay: a `CrossDecay` bias -|c[i] - c[Lq + j]|, c (B|1, H|1, Lq + Lk) holding the queries'
// cumulative sums, then the keys' (chunks of one sequence apart: context parallelism).
// (codes 0..6)
enum Kind : int64_t {
  kNone = 0, kDense, kToeplitz, kRelation, kDecay, kToeplitzTable, kCrossDecay
};

// Row loops vectorise only where every call in them is inlined; GCC stops inlining a helper
// once a file has many instantiations of the loops unless told to.
#if defined(__GNUC__)
#define URPE_INLINE inline __attribute__((always_inline))
#else
#define URPE_INLINE inline
#endif

// ---------------------------------------------------------------------------------------------
// exp

// exp(x) in float: Cephes' range reduction and polynomial (about 1 ulp), branch-free so that a
// row loop vectorises. exp(-inf) = 0 exactly (hidden pairs), NaN stays NaN, inf stays inf;
// results below FLT_MIN are flushed to 0.
URPE_INLINE float exp_value(float x) {
  const float lo = -87.33654475f, hi = 88.72283905f;
  float xc = x < lo ? lo : x;
  xc = xc > hi ? hi : xc;
  // n = round(x / ln 2): adding 1.5 * 2^23 leaves no fraction bits (|x / ln 2| < 2^22)
  const float magic = 12582912.0f;
  const float n = (xc * 1.44269504088896341f + magic) - magic;
  float r = xc - n * 0.693359375f;  // ln 2 in two parts, exact products
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  // 2^n as two factors, so that n = 128 (x just below hi) stays representable
  const int32_t e = static_cast<int32_t>(n);
  const int32_t e1 = e >> 1, e2 = e - e1;  // floor(e / 2): both in [-64, 64]
  const int32_t b1 = (e1 + 127) << 23, b2 = (e2 + 127) << 23;
  float f1, f2;
  std::memcpy(&f1, &b1, sizeof f1);
  std::memcpy(&f2, &b2, sizeof f2);
  const float y = p * f1 * f2;
  return x < lo ? 0.0f : (x > hi ? std::numeric_limits<float>::infinity() : y);
}

inline double exp_value(double x) { return std::exp(x); }

// ---------------------------------------------------------------------------------------------
// Row spans. A row loop runs over `span` = the visible keys rounded up to kLanes, in blocks of
// exactly kLanes (an inner loop of a fixed count vectorises whole, with no scalar remainder or
// alignment peeling: on short rows, L = 24 or causal diagonal tiles, scalar exp calls in those
// cost a third of the time). Every row a loop reads is readable for span entries (tiles
// and buffers are allocated rounded up, Toeplitz rows carry kLanes entries of padding), and
// the loops mask the entries past the visible ones themselves.

constexpr int64_t kLanes = 16;  // ops.py pads Toeplitz rows by as many entries

inline int64_t padded(int64_t n) { return (n + kLanes - 1) / kLanes * kLanes; }

// ---------------------------------------------------------------------------------------------
// Row helpers (n contiguous entries)

template <typename T>
inline void add_row(T* __restrict s, const T* __restrict t, int64_t n) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) s[j] += t[j];
}

template <typename T>
inline void fill_row(T* s, T value, int64_t n) {
  std::fill(s, s + n, value);
}

template <typename T>
inline T row_max(const T* __restrict s, int64_t n) {
  T m = -std::numeric_limits<T>::infinity();
#pragma omp simd reduction(max : m)
  for (int64_t j = 0; j < n; ++j) m = s[j] > m ? s[j] : m;
  return m;
}

// ---------------------------------------------------------------------------------------------
// Matrix products on row-major blocks. BLAS where the torch build exports it (Linux wheels
// carry MKL or OpenBLAS with the Fortran symbols), else at::mm on views of the same memory.

// C (m x n) = alpha * A (m x k) * B^T (B: n x k) + beta * C
template <typename T>
void gemm_nt(int64_t m, int64_t n, int64_t k, T alpha, const T* a, int64_t lda, const T* b,
             int64_t ldb, T beta, T* c, int64_t ldc);
// C (m x n) = alpha * A (m x k) * B (k x n) + beta * C
template <typename T>
void gemm_nn(int64_t m, int64_t n, int64_t k, T alpha, const T* a, int64_t lda, const T* b,
             int64_t ldb, T beta, T* c, int64_t ldc);
// C (m x n) = alpha * A^T (A: k x m) * B (k x n) + beta * C
template <typename T>
void gemm_tn(int64_t m, int64_t n, int64_t k, T alpha, const T* a, int64_t lda, const T* b,
             int64_t ldb, T beta, T* c, int64_t ldc);

// gemm_nt and gemm_nn for a few rows of A by plain loops, whatever the sizes: every product
// is taken (no BLAS may skip a zero factor), so a NaN or inf in B reaches C, even through a
// zero weight (the forward loop's check of q, k and v by their results relies on it).
template <typename T>
void rows_nt(int64_t m, int64_t n, int64_t k, T alpha, const T* a, int64_t lda, const T* b,
             int64_t ldb, T* c, int64_t ldc);
template <typename T>
void rows_nn(int64_t m, int64_t n, int64_t k, const T* a, int64_t lda, const T* b, int64_t ldb,
             T beta, T* c, int64_t ldc);
// Products this small (a decoding step: one query row against a head's keys) cost less as
// plain loops than a BLAS call's dispatch and packing. Only for one row: with more, the dot
// products' horizontal sums make the loops slower than BLAS (measured, one thread, the whole
// forward_if_finite call at H = 8: 2 x 128 x 32 tiles 23 us by loops vs 19 by BLAS, 4 x 128 x 32
// 40 vs 23; short training rows, 24 x 24 x 16 tiles, ran 2x slower in the backward pass).
constexpr int64_t kDirectWork = 1 << 14;
constexpr int64_t kDirectRows = 1;
inline bool product_by_loops(int64_t m, int64_t n, int64_t k) {
  return m <= kDirectRows && m * n * k <= kDirectWork;
}

// rows_nt and rows_nn on bfloat16 operands into float (each operand exact in float, sums in
// float, as the bf16 BLAS routine below): a decoding step's NaN/inf in a bfloat16 cache is then
// found in its results too.
void rows_nt(int64_t m, int64_t n, int64_t k, float alpha, const uint16_t* a, int64_t lda,
             const uint16_t* b, int64_t ldb, float* c, int64_t ldc);
void rows_nn(int64_t m, int64_t n, int64_t k, const uint16_t* a, int64_t lda, const uint16_t* b,
             int64_t ldb, float beta, float* c, int64_t ldc);

// Which product routine runs: "blas" or "aten".
const char* gemm_route();

// The same three products on bfloat16 operands (bits as uint16_t) into float: BLAS's
// bf16 x bf16 -> f32 routine (MKL's gemm_bf16bf16f32, on AMX or AVX512-BF16 where the CPU has
// them), as SDPA multiplies bfloat16. Only where `bf16_products()`.
bool bf16_products();
void gemm_nt(int64_t m, int64_t n, int64_t k, float alpha, const uint16_t* a, int64_t lda,
             const uint16_t* b, int64_t ldb, float beta, float* c, int64_t ldc);
void gemm_nn(int64_t m, int64_t n, int64_t k, float alpha, const uint16_t* a, int64_t lda,
             const uint16_t* b, int64_t ldb, float beta, float* c, int64_t ldc);
void gemm_tn(int64_t m, int64_t n, int64_t k, float alpha, const uint16_t* a, int64_t lda,
             const uint16_t* b, int64_t ldb, float beta, float* c, int64_t ldc);

// float -> bfloat16 bits, rounded to nearest even
URPE_INLINE uint16_t bf16_bits(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

// bfloat16 bits -> float (exact)
URPE_INLINE float bf16_value(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float x;
  std::memcpy(&x, &wide, sizeof x);
  return x;
}

// the same for n entries
inline void to_bf16(const float* __restrict src, uint16_t* __restrict dst, int64_t n) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) dst[j] = bf16_bits(src[j]);
}

// An operand entry as T (bfloat16 bits: exact)
template <typename T>
URPE_INLINE T value(T x) {
  return x;
}
template <typename T>
URPE_INLINE T value(uint16_t bits) {
  return bf16_value(bits);
}

// Products of one query row with the few keys of its own document (`Hiding::own_keys`), as
// loops: x . y over n entries, and y += a x, on T entries or bfloat16 bits (exact in float).
template <typename T, typename A>
URPE_INLINE T dot(const A* __restrict x, const A* __restrict y, int64_t n) {
  T sum = T(0);
#pragma omp simd reduction(+ : sum)
  for (int64_t e = 0; e < n; ++e) sum += value<T>(x[e]) * value<T>(y[e]);
  return sum;
}

template <typename T, typename A>
URPE_INLINE void add_scaled(T* __restrict y, T a, const A* __restrict x, int64_t n) {
#pragma omp simd
  for (int64_t e = 0; e < n; ++e) y[e] += a * value<T>(x[e]);
}

// ---------------------------------------------------------------------------------------------
// Dropout: the reference's hash (urpe.kernels.dropout), so both draw the same mask. The keep
// decision for weight (b, h, i, j) depends on the seed and the flat index only.

inline uint32_t mix32(uint32_t x) {
  x = ((x >> 16) ^ x) * 0x45D9F3Bu;
  x = ((x >> 16) ^ x) * 0x45D9F3Bu;
  return (x >> 16) ^ x;
}

inline uint32_t fold64(int64_t x) { return static_cast<uint32_t>(x ^ (x >> 32)); }

struct Dropout {
  bool on = false;
  uint64_t threshold = 0;  // keep iff bits < threshold = round((1 - p) 2^32)
  uint32_t first = 0, second = 0;
  // where the call's (Lq, Lk) weights sit in the (rows, cols) matrix the counter indexes (the
  // call's own unless its seed tensor places them: urpe.kernels.dropout.seed_placement)
  int64_t row0 = 0, rows = 0, col0 = 0, cols = 0;

  void seed(int64_t seed_value) {
    first = mix32(fold64(seed_value));
    second = mix32(first ^ 0x5BD1E995u);
  }

  // scale[j] = keep(counter0 + j) / (1 - p) for j < n
  template <typename T>
  void row(int64_t counter0, int64_t n, T kept, T* __restrict scale) const {
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) {
      const uint32_t bits = mix32(mix32(fold64(counter0 + j) ^ first) ^ second);
      scale[j] = static_cast<uint64_t>(bits) < threshold ? kept : T(0);
    }
  }
};

// ---------------------------------------------------------------------------------------------
// A bias, gate or float mask, read one row segment (b, h, i, keys j0 .. j0 + n) at a time.

template <typename T>
struct Term {
  int64_t kind = kNone;
  const T* data = nullptr;
  // dense: strides of (b, h, i, j), 0 along a broadcast dim
  int64_t sb = 0, sh = 0, si = 0, sj = 0;
  // Toeplitz: one row of Lq + Lk - 1 values per table head, entry j - i + Lq - 1 (built by the
  // caller from the clamped table, then kLanes entries of padding); Relation: the table
  // (heads, R) and its index (b, i, j)
  int64_t row_len = 0;
  bool per_head = false;
  const int64_t* index = nullptr;
  int64_t ib = 0, ii = 0, ij = 0;
  int64_t lq = 0;

  bool present() const { return kind != kNone; }

  // Tables: where head h's row starts; Toeplitz: where (h, i)'s entry for key j0 sits
  int64_t table_row(int64_t h) const { return per_head ? h * row_len : 0; }
  int64_t toeplitz_entry(int64_t h, int64_t i, int64_t j0) const {
    return table_row(h) + (j0 - i + lq - 1);
  }
  // Relation: the index of (b, i, j0), the next keys ij apart
  const int64_t* relation_index(int64_t b, int64_t i, int64_t j0) const {
    return index + b * ib + i * ii + j0 * ij;
  }

  // Decay: (b, h)'s row of c (row_len = Lk entries), and c at query i's position (0 before
  // the first key, where a query sees no key). CrossDecay: the row holds Lq + Lk entries, the
  // queries' own c first; the keys' start at `decay_keys`.
  bool is_decay() const { return kind == kDecay || kind == kCrossDecay; }
  const T* decay_row(int64_t b, int64_t h) const { return data + b * sb + h * sh; }
  int64_t decay_keys() const { return kind == kCrossDecay ? lq : 0; }
  // the entry of the row that query i reads (-1: none)
  int64_t decay_query_entry(int64_t i) const {
    if (kind == kCrossDecay) return i;
    const int64_t pos = i + row_len - lq;
    return pos >= 0 ? pos : -1;
  }
  T decay_query(const T* c, int64_t i) const {
    const int64_t entry = decay_query_entry(i);
    return entry >= 0 ? c[entry] : T(0);
  }

  // The values of keys [j0, j0 + n) at a pointer readable for `span` >= n entries (what lies
  // past n is anything: the loops mask it); `buf` (span entries) holds them where they must be
  // gathered.
  const T* row(int64_t b, int64_t h, int64_t i, int64_t j0, int64_t n, int64_t span,
               T* buf) const {
    if (kind == kToeplitz) return data + toeplitz_entry(h, i, j0);
    if (kind == kRelation) {
      const T* table = data + table_row(h);
      const int64_t* idx = relation_index(b, i, j0);
      for (int64_t j = 0; j < n; ++j) buf[j] = table[idx[j * ij]];
      return buf;
    }
    if (is_decay()) {
      const T* c = decay_row(b, h) + decay_keys() + j0;
      const T cq = decay_query(decay_row(b, h), i);
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) buf[j] = -std::abs(cq - c[j]);
      return buf;
    }
    const T* p = data + b * sb + h * sh + i * si + j0 * sj;
    if (sj == 1 && span == n) return p;  // past n the tensor may end
    for (int64_t j = 0; j < n; ++j) buf[j] = p[j * sj];
    return buf;
  }
};

// Where a term's gradient goes, laid out as the term itself (`layout`: its kind, table rows
// and relation index). Tables: one private copy per worker (`slot`), summed after the loop.
// Dense: the gradient tensor itself (contiguous, the term's shape), written by the one work
// item that owns each entry (see backward.cpp).
template <typename T>
struct TermGrad {
  Term<T> layout;
  T* data = nullptr;
  int64_t sb = 0, sh = 0, si = 0, sj = 0;  // dense: strides, 0 along a broadcast dim
  int64_t slot_size = 0;                   // tables: entries per worker copy

  bool present() const { return layout.present(); }

  // Toeplitz: where the gradient of keys [j0, ...) of row (h, i) accumulates, contiguous;
  // other kinds: nullptr (use `add`)
  T* row_target(int64_t slot, int64_t h, int64_t i, int64_t j0) const {
    if (layout.kind != kToeplitz) return nullptr;
    return data + slot * slot_size + layout.toeplitz_entry(h, i, j0);
  }

  void add(int64_t slot, int64_t b, int64_t h, int64_t i, int64_t j0, int64_t n,
           const T* __restrict g) const {
    if (layout.kind == kToeplitz) {
      T* __restrict dst = row_target(slot, h, i, j0);
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) dst[j] += g[j];
    } else if (layout.kind == kRelation) {
      T* dst = data + slot * slot_size + layout.table_row(h);
      const int64_t* idx = layout.relation_index(b, i, j0);
      for (int64_t j = 0; j < n; ++j) dst[idx[j * layout.ij]] += g[j];
    } else if (layout.is_decay()) {
      // d/dc of -|c_q - c_j|: -sign to the query's entry, +sign to each key's. In SIMD lanes
      // (c and the gradient rows are apart): a serial sum's add latency per key cost more
      // than the rest of the decay's work (issue 42).
      const T* row = layout.decay_row(b, h);
      T* dst = data + slot * slot_size + b * layout.sb + h * layout.sh;
      const T* __restrict c = row + layout.decay_keys() + j0;
      T* __restrict dst_keys = dst + layout.decay_keys() + j0;
      const T cq = layout.decay_query(row, i);
      T total = 0;
#pragma omp simd reduction(+ : total)
      for (int64_t j = 0; j < n; ++j) {
        const T cj = c[j], gj = g[j];
        const T signed_g = cq > cj ? gj : (cq < cj ? -gj : T(0));
        dst_keys[j] += signed_g;
        total += signed_g;
      }
      const int64_t entry = layout.decay_query_entry(i);
      if (entry >= 0) dst[entry] -= total;
    } else {
      T* dst = data + b * sb + h * sh + i * si + j0 * sj;
      if (sj == 0) {
        T sum = 0;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < n; ++j) sum += g[j];
        *dst += sum;
      } else {
        for (int64_t j = 0; j < n; ++j) dst[j * sj] += g[j];
      }
    }
  }
};

// The gate row with hidden pairs (flags) set to 0, so that a gate holding inf or NaN where a
// pair is hidden leaves its weight and gradients exactly 0 (the loops mask the causal tail).
template <typename T>
const T* masked_gate_row(const Term<T>& gate, int64_t b, int64_t h, int64_t i, int64_t j0,
                         int64_t n, int64_t span, const uint8_t* flags, T* buf) {
  const T* c = gate.row(b, h, i, j0, n, span, buf);
  if (flags == nullptr) return c;
  for (int64_t j = 0; j < n; ++j) buf[j] = flags[j] ? T(0) : c[j];
  return buf;
}

// ---------------------------------------------------------------------------------------------
// Which pairs are hidden: causal masking (a contiguous tail of each row segment), key padding,
// documents and a boolean attn_mask (flags per entry).

// keys [lo, hi) of a row
using KeyRun = std::pair<int64_t, int64_t>;

struct Hiding {
  bool causal = false;
  int64_t shift = 0;              // Lk - Lq: query i sees keys j <= i + shift
  const bool* pad = nullptr;      // (B|1, Lk|1), True = padded
  int64_t pad_sb = 0, pad_sj = 0;  // its strides, 0 along a broadcast dim
  const bool* keep = nullptr;     // bool attn_mask, True = takes part
  int64_t kb = 0, kh = 0, ki = 0, kj = 0;
  const int64_t* docs = nullptr;  // document ids (B|1, Lk), contiguous along the keys
  int64_t docs_sb = 0;
  int64_t lk = 0;  // keys
  // the queries' own ids where they are given apart ((B|1, Lq + Lk) ids, these the first Lq of
  // each row, docs the rest): query i's document is query_docs[i], not the id at pos(i)
  const int64_t* query_docs = nullptr;
  // Tiles no pair of which is visible, found from ranges per (batch row, block) (`block_rows`
  // rows of them, 0: none kept): the smallest and largest document id (0 for every position
  // without documents) of the block's queries (none for queries before the first key, unless
  // their ids are given apart) and of its keys that key padding leaves visible (none where all
  // are padded).
  std::vector<int64_t> query_lo, query_hi, key_lo, key_hi;
  int64_t block_rows = 0, query_blocks = 0, key_blocks = 0;

  // whether query block qb and the key block starting at j0 may hold a visible pair in row b
  // (false: the tile is skipped, forward and backward; it would contribute exactly nothing)
  bool shares(int64_t b, int64_t qb, int64_t j0, int64_t block_k) const {
    if (block_rows == 0) return true;
    const int64_t row = block_rows == 1 ? 0 : b, kb_ = j0 / block_k;
    const int64_t q = row * query_blocks + qb, k = row * key_blocks + kb_;
    return query_lo[q] <= key_hi[k] && key_lo[k] <= query_hi[q];
  }

  // Where each row's documents are runs (no id in two runs of keys): per (row of docs, query)
  // the keys [begin, end) of its document (empty before the first key); else empty vectors.
  std::vector<int64_t> run_begin, run_end;

  // keys [begin, end) that hold every key the queries [i0, i1) of row b may share a document
  // with: the span of their runs, or all keys
  std::pair<int64_t, int64_t> document_keys(int64_t b, int64_t i0, int64_t i1) const {
    if (run_begin.empty()) return {0, lk};
    const int64_t* begin = run_begin.data() + (docs_sb == 0 ? 0 : b) * (lk - shift);
    const int64_t* end = run_end.data() + (docs_sb == 0 ? 0 : b) * (lk - shift);
    int64_t lo = std::numeric_limits<int64_t>::max(), hi = 0;
    for (int64_t i = i0; i < i1; ++i) {
      if (begin[i] >= end[i]) continue;
      lo = std::min(lo, begin[i]);
      hi = std::max(hi, end[i]);
    }
    return {std::min(lo, hi), hi};
  }

  // keys [lo, hi) of the tile (keys j0.., n of them) in the document of query i of row b,
  // where documents are runs
  KeyRun own_keys(int64_t b, int64_t i, int64_t j0, int64_t n) const {
    const int64_t at = (docs_sb == 0 ? 0 : b) * (lk - shift) + i;
    const int64_t lo = std::clamp(run_begin[at], j0, j0 + n);  // (an empty run: [j0, j0))
    return {lo, std::clamp(run_end[at], lo, j0 + n)};
  }

  // keys [j0, j0 + n) that come before the causal edge for query i
  int64_t visible(int64_t i, int64_t j0, int64_t n) const {
    if (!causal) return n;
    return std::min(n, std::max<int64_t>(0, i + shift - j0 + 1));
  }

  // the keys [0, end) that some query of [i0, i1) may see
  int64_t key_end(int64_t i1, int64_t lk) const {
    if (!causal) return lk;
    return std::min(lk, std::max<int64_t>(0, i1 - 1 + shift + 1));
  }

  // flags[j] != 0 where padding or the bool mask hides the pair, for the n keys from j0, at a
  // pointer readable for span >= n entries; nullptr when neither mask exists
  const uint8_t* flags(int64_t b, int64_t h, int64_t i, int64_t j0, int64_t n, int64_t span,
                       uint8_t* buf) const {
    const uint8_t* base = mask_flags(b, h, i, j0, n, span, buf);
    if (docs == nullptr) return base;
    const int64_t* row = docs + b * docs_sb;
    const int64_t pos = i + shift;
    if (query_docs == nullptr && pos < 0) {  // before the first key: in no document
      std::fill(buf, buf + n, uint8_t{1});
      return buf;
    }
    const int64_t own = query_docs != nullptr ? query_docs[b * docs_sb + i] : row[pos];
    for (int64_t j = 0; j < n; ++j) {
      buf[j] = static_cast<uint8_t>((base != nullptr && base[j]) || row[j0 + j] != own);
    }
    return buf;
  }

  // `flags` from key padding and the bool mask alone
  const uint8_t* mask_flags(int64_t b, int64_t h, int64_t i, int64_t j0, int64_t n,
                            int64_t span, uint8_t* buf) const {
    if (keep == nullptr) {
      if (pad == nullptr) return nullptr;
      const bool* pp = pad + b * pad_sb + j0 * pad_sj;
      // past n the mask may end
      if (pad_sj == 1 && span == n) return reinterpret_cast<const uint8_t*>(pp);
      for (int64_t j = 0; j < n; ++j) buf[j] = static_cast<uint8_t>(pp[j * pad_sj]);
      return buf;
    }
    const bool* kp = keep + b * kb + h * kh + i * ki + j0 * kj;
    if (pad != nullptr) {
      const bool* pp = pad + b * pad_sb + j0 * pad_sj;
      for (int64_t j = 0; j < n; ++j) {
        buf[j] = static_cast<uint8_t>(pp[j * pad_sj] || !kp[j * kj]);
      }
    } else {
      for (int64_t j = 0; j < n; ++j) buf[j] = static_cast<uint8_t>(!kp[j * kj]);
    }
    return buf;
  }
};

// Queries of a group where a block is split by its documents' runs.
constexpr int64_t kRunGroup = 16;

// Runs body(g0, g1) over the query block [i0, i1): once, or per group of kRunGroup queries
// where its documents are runs and the groups' own runs hold at most half of the pairs the
// block's would (short documents, such as padding with one id per token: the block's span of
// runs is a diagonal tile in which each query sees a few keys).
template <typename F>
void for_query_groups(const Hiding& hiding, int64_t b, int64_t i0, int64_t i1, const F& body) {
  if (hiding.run_begin.empty() || i1 - i0 <= kRunGroup) return body(i0, i1);
  const auto [lo, hi] = hiding.document_keys(b, i0, i1);
  int64_t grouped = 0;  // query-key pairs of the groups' spans
  for (int64_t g0 = i0; g0 < i1; g0 += kRunGroup) {
    const int64_t g1 = std::min(i1, g0 + kRunGroup);
    const auto [glo, ghi] = hiding.document_keys(b, g0, g1);
    grouped += (ghi - glo) * (g1 - g0);
  }
  if (2 * grouped > (hi - lo) * (i1 - i0)) return body(i0, i1);
  for (int64_t g0 = i0; g0 < i1; g0 += kRunGroup) body(g0, std::min(i1, g0 + kRunGroup));
}

// ---------------------------------------------------------------------------------------------
// One call: sizes, operands, terms, masks.

// Where the rows of a (B, H, L, E) operand or gradient lie: element strides over batch, head
// and row, the last dim contiguous. q, k, v are read, and dq, dk, dv written, in the caller's
// layout: a model's projections give views of (B, L, H, E) that would otherwise be copied
// before the kernel and their gradients copied back after it.
struct Rows {
  int64_t sb = 0, sh = 0, si = 0;
  int64_t at(int64_t b, int64_t h, int64_t i) const { return b * sb + h * sh + i * si; }
};

template <typename T>
struct Problem {
  int64_t batch = 0, heads = 0, kv_heads = 0, lq = 0, lk = 0, dim = 0, vdim = 0;
  int64_t groups = 1;  // query heads per kv head
  Rows q_rows, k_rows, v_rows;  // q (B, H, Lq, D), k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv)
  const T *q = nullptr, *k = nullptr, *v = nullptr;
  // bfloat16 operands, multiplied as they are (T = float): then q, k, v above are null
  const uint16_t *q16 = nullptr, *k16 = nullptr, *v16 = nullptr;
  Term<T> bias, gate, float_mask;
  Hiding hiding;
  int64_t norm = kSoftmax;
  const T* fixed = nullptr;  // (B, H, Lq): r_i known up front (exp, relu2)
  T scale = 1;
  Dropout dropout;
  T kept = 1;  // 1 / (1 - p)
  int64_t block_q = 0, block_k = 0;
  // Where q, k and v were not checked for NaN/inf up front (`forward_if_finite`,
  // `forward_checked`): the forward loop raises this flag where an operand row that a tile it
  // computes reads is not finite (see forward.cpp), so that the rows of skipped tiles (a padded
  // tail) are never read. `direct`: one query row per head, whose products run as loops and
  // are checked by their logits and outputs instead.
  std::atomic<bool>* nonfinite = nullptr;
  bool direct = false;

  int power() const { return norm == kSoftmax ? 1 : (norm == kL2 ? 2 : 0); }
  bool bf16() const { return q16 != nullptr; }
  // queries and keys (rounded up to kLanes) of the largest tile: what per-worker scratch holds
  int64_t tile_queries() const { return std::min(block_q, lq); }
  // multiply-adds of the two products of the forward pass (the backward's five scale with it)
  double work() const {
    return static_cast<double>(batch) * heads * lq * lk * static_cast<double>(dim + vdim);
  }
  int64_t tile_keys() const { return padded(std::min(block_k, lk)); }
  T hidden_logit() const {
    return norm == kRelu2 ? T(0) : -std::numeric_limits<T>::infinity();
  }
  // flat index of weight (b, h, i, j0), placed as the seed says: the dropout counter
  int64_t counter(int64_t b, int64_t h, int64_t i, int64_t j0) const {
    return ((b * heads + h) * dropout.rows + dropout.row0 + i) * dropout.cols + dropout.col0 + j0;
  }
};

// Runtime switches as compile-time constants: with_flags(f, a, b) calls
// f(std::bool_constant<a>{}, std::bool_constant<b>{}). Row loops take their optional pieces
// this way, never as a null check inside the loop: vectorised, such a check becomes a masked
// load, which on AVX-512 costs a fault-suppression assist per iteration where the pointer is
// null.
template <typename F>
decltype(auto) with_flags(F&& f, bool a) {
  if (a) return f(std::true_type{});
  return f(std::false_type{});
}

template <typename F, typename... Bools>
decltype(auto) with_flags(F&& f, bool a, Bools... rest) {
  return with_flags([&](auto first) {
    return with_flags([&](auto... others) { return f(first, others...); }, rest...);
  }, a);
}

// with_norm(f, norm) calls f(std::integral_constant<int64_t, norm>{}).
template <typename F>
decltype(auto) with_norm(F&& f, int64_t norm) {
  switch (norm) {
    case kSoftmax: return f(std::integral_constant<int64_t, kSoftmax>{});
    case kExp: return f(std::integral_constant<int64_t, kExp>{});
    case kL2: return f(std::integral_constant<int64_t, kL2>{});
    default: return f(std::integral_constant<int64_t, kRelu2>{});
  }
}

template <typename T, bool SCALE, bool BIAS, bool MASK, bool FLAGS>
T logits_loop(T* __restrict s, int64_t vis, int64_t span, T scale, const T* __restrict bias,
              const T* __restrict mask, const uint8_t* __restrict flags, T hidden) {
  T lane_max[kLanes];  // one running max per lane: reduced across lanes once, at the end
  std::fill(lane_max, lane_max + kLanes, -std::numeric_limits<T>::infinity());
  for (int64_t block = 0; block < span; block += kLanes) {
#pragma omp simd
    for (int64_t lane = 0; lane < kLanes; ++lane) {
      const int64_t j = block + lane;
      T x = s[j];
      if constexpr (SCALE) x *= scale;
      if constexpr (BIAS) x += bias[j];
      if constexpr (MASK) x += mask[j];
      if constexpr (FLAGS) x = flags[j] ? hidden : x;
      x = j < vis ? x : hidden;
      s[j] = x;
      lane_max[lane] = x > lane_max[lane] ? x : lane_max[lane];
    }
  }
  return row_max(lane_max, kLanes);
}

// Logits of one row in one pass: s = scale s + B + M over its span, pairs hidden by flags and
// those past the first `vis` keys (the causal edge) at the normalisation's hidden logit; returns
// the row's max. bias_buf, mask_buf: room for the row's bias and float-mask values where they
// must be gathered (tile_keys() entries each). scale: what the scores product left out (1: none).
template <typename T>
T logits_row(const Problem<T>& P, T* bias_buf, T* mask_buf, int64_t b, int64_t h, int64_t i,
             int64_t j0, int64_t vis, int64_t span, const uint8_t* flags, T* s,
             T scale = T(1)) {
  const T* bias = P.bias.present() ? P.bias.row(b, h, i, j0, vis, span, bias_buf) : nullptr;
  const T* mask =
      P.float_mask.present() ? P.float_mask.row(b, h, i, j0, vis, span, mask_buf) : nullptr;
  const T hidden = P.hidden_logit();
  return with_flags(
      [&](auto has_scale, auto has_bias, auto has_mask, auto has_flags) {
        return logits_loop<T, has_scale, has_bias, has_mask, has_flags>(s, vis, span, scale, bias,
                                                                        mask, flags, hidden);
      },
      scale != T(1), bias != nullptr, mask != nullptr, flags != nullptr);
}

// Runs item(worker, index) for index in [0, count) on torch's intra-op threads. Workers take
// the next index as they finish one (a shared counter), so a thread slowed by another process
// on its core takes fewer items instead of holding everyone back. `worker` < workers(count)
// names per-worker scratch.
// `work`: the call's multiply-adds; a call too small to repay waking another thread (a short
// row) runs on the calling thread alone, and so does one of few query rows (`query_rows` per
// head, a decoding step) up to a larger size.
int64_t workers_for(int64_t count, double work = 1e30, int64_t query_rows = 1 << 30);

// How many consecutive items a worker takes from the shared counter at once, for `count` items
// of `work` multiply-adds in all on `workers` threads (1 for items that are long on their own).
int64_t chunk_for(int64_t count, int64_t workers, double work);

// While alive, BLAS calls from this thread run on this thread alone. torch turns MKL's dynamic
// thread adjustment off (mkl_set_dynamic(false)), so a product called inside a parallel region
// would otherwise start a team of its own on cores the other workers already use.
class BlasThreadsGuard {
 public:
  BlasThreadsGuard();
  ~BlasThreadsGuard();
  BlasThreadsGuard(const BlasThreadsGuard&) = delete;
  BlasThreadsGuard& operator=(const BlasThreadsGuard&) = delete;

 private:
  int previous_ = -1;
};

// `chunk`: items taken at once (`chunk_for`). `fixed`: worker w takes items w, w + workers, ...
// instead, so that which worker sums what into its private table gradients is the same on every
// run (deterministic mode).
template <typename F>
void run_items(int64_t count, int64_t workers, const F& item, bool fixed = false,
               int64_t chunk = 1) {
  std::atomic<int64_t> next{0};
  auto drain = [&](int64_t worker) {
    const BlasThreadsGuard one_thread;
    if (fixed) {
      for (int64_t index = worker; index < count; index += workers) item(worker, index);
      return;
    }
    for (int64_t begin = next.fetch_add(chunk); begin < count; begin = next.fetch_add(chunk)) {
      const int64_t end = std::min(count, begin + chunk);
      for (int64_t index = begin; index < end; ++index) item(worker, index);
    }
  };
  if (workers <= 1) {
    drain(0);
    return;
  }
  at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
    for (int64_t worker = begin; worker < end; ++worker) drain(worker);
  });
}

}  // namespace urpe_cpp
