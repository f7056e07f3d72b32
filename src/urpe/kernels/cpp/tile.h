// The pieces every tile of the C++ CPU kernel uses: the problem's sizes and tensors, exp, row
// helpers, dropout, the matrix products and the logits of a row. Terms (biases, gates, float
// masks and their gradients) are in terms.h, which pairs are hidden in hiding.h, and how work
// items run on threads in threads.h. forward.cpp and backward.cpp hold the two loops.
//
// Layout (row-major, contiguous, in the compute dtype T = float or double):
//   q (B, H, Lq, D), k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv); query head h reads kv head h / G.
//   Query i sits at position i + Lk - Lq (the last query meets the last key), so with
//   causal masking it sees keys j <= i + Lk - Lq.
// A score tile is bq queries x n keys; everything per element happens on rows of it while the
// tile is in cache.
#pragma once

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

#include "hiding.h"
#include "terms.h"
#include "threads.h"

namespace urpe_cpp {

// Normalisations (urpe.kernels.normalization): weights a = f(s, r_i) for a row statistic r_i.
enum Norm : int64_t { kSoftmax = 0, kExp = 1, kL2 = 2, kRelu2 = 3 };

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

// A row of fewer visible keys than this runs its loops entry by entry over those keys alone
// (its span is then vis, not a multiple of kLanes): a query that sees one key, as each padded
// token with an id of its own does, would otherwise pay for kLanes of them (exp included) in
// every loop of both passes.
constexpr int64_t kShortRow = 4;

inline int64_t row_span(int64_t vis) { return vis < kShortRow ? vis : padded(vis); }

// The lanes of a row loop over `span` entries: kLanes, or 1 for a short row's span.
inline bool whole_blocks(int64_t span) { return span % kLanes == 0; }

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
  // With `nonfinite` (not `direct`): per (batch row, kv head, key block), whether its k and v
  // rows were found finite already, so each is checked once, not once per query block and head
  std::atomic<uint8_t>* finite_keys = nullptr;

  int power() const { return norm == kSoftmax ? 1 : (norm == kL2 ? 2 : 0); }
  int64_t key_blocks() const { return (lk + block_k - 1) / block_k; }
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

// The keys of query i in a tile (keys j0.., n of them) as its row loops take them: the tile's,
// or by runs (`own`: the row's document keys [lo, hi), `Hiding::own_keys`) its own, held from
// the row's start; `vis` of them before the causal edge, the `span` the loops run over
// (`row_span`), and flags for them (in buf) where pairs are hidden entry by entry.
struct RowKeys {
  int64_t j0 = 0, n = 0, vis = 0, span = 0;
  const uint8_t* flags = nullptr;
};

URPE_INLINE RowKeys row_keys(const Hiding& hiding, int64_t b, int64_t h, int64_t i,
                             int64_t j0, int64_t n, const KeyRun* own, uint8_t* buf) {
  RowKeys keys;
  keys.j0 = own != nullptr ? own->first : j0;
  keys.n = own != nullptr ? own->second - own->first : n;
  keys.vis = hiding.visible(i, keys.j0, keys.n);
  keys.span = row_span(keys.vis);
  // (a row's own keys share its document: only the masks may hide them)
  keys.flags = own != nullptr ? hiding.mask_flags(b, h, i, keys.j0, keys.vis, keys.span, buf)
                              : hiding.flags(b, h, i, keys.j0, keys.vis, keys.span, buf);
  return keys;
}

// LANES: kLanes, or 1 for a short row (`whole_blocks`)
template <typename T, bool SCALE, bool BIAS, bool MASK, bool FLAGS, int64_t LANES>
T logits_loop(T* __restrict s, int64_t vis, int64_t span, T scale, const T* __restrict bias,
              const T* __restrict mask, const uint8_t* __restrict flags, T hidden) {
  T lane_max[LANES];  // one running max per lane: reduced across lanes once, at the end
  std::fill(lane_max, lane_max + LANES, -std::numeric_limits<T>::infinity());
  for (int64_t block = 0; block < span; block += LANES) {
#pragma omp simd
    for (int64_t lane = 0; lane < LANES; ++lane) {
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
  return row_max(lane_max, LANES);
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
      [&](auto has_scale, auto has_bias, auto has_mask, auto has_flags, auto blocks) {
        return logits_loop<T, has_scale, has_bias, has_mask, has_flags, blocks ? kLanes : 1>(
            s, vis, span, scale, bias, mask, flags, hidden);
      },
      scale != T(1), bias != nullptr, mask != nullptr, flags != nullptr, whole_blocks(span));
}

}  // namespace urpe_cpp
