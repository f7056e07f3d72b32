// Biases, gates and float masks as the tile loops read them (Term: one row segment at a time)
// and where their gradients go (TermGrad).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace urpe_cpp {

// How a bias or gate is given.
// kDecay: a `Decay` bias -|c[pos(i)] - c[j]|, read from c = cumsum(log_forget) (B|1, H|1, Lk).
// kToeplitzTable: a Toeplitz table itself (H|1, 2K + 1) over offsets -K..K, for a forward: read
// in place, without building its rows per call (a decoding step's gate; `make_term`). Where the
// call's offsets and padding lie inside it, as kToeplitz rows; else each row segment reads its
// columns clamped to the table's edges (past the reach K, every offset shares an edge entry).
// kCrossDecay: a `CrossDecay` bias -|c[i] - c[Lq + j]|, c (B|1, H|1, Lq + Lk) holding the queries'
// cumulative sums, then the keys' (chunks of one sequence apart: context parallelism). A float
// forward may read float64 sums (`wide`: a KV cache's, kept in double), each rounded on load.
// (codes 0..6)
enum Kind : int64_t {
  kNone = 0, kDense, kToeplitz, kRelation, kDecay, kToeplitzTable, kCrossDecay
};

// A bias, gate or float mask, read one row segment (b, h, i, keys j0 .. j0 + n) at a time.

template <typename T>
struct Term {
  int64_t kind = kNone;
  const T* data = nullptr;
  // kCrossDecay with T = float: c in float64 instead of `data` (forward only)
  const double* wide = nullptr;
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
  // kToeplitzTable read clamped: the table column of key j0 in row i is j0 - i + shift
  int64_t shift = 0;

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
    if (kind == kToeplitzTable) return clamped_row(h, i, j0, n, span, buf);
    if (kind == kRelation) {
      const T* table = data + table_row(h);
      const int64_t* idx = relation_index(b, i, j0);
      for (int64_t j = 0; j < n; ++j) buf[j] = table[idx[j * ij]];
      return buf;
    }
    if (wide != nullptr) return wide_decay_row(b, h, i, j0, n, buf);
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

  // A table's columns for keys [j0, j0 + n) of row i: where they and the `span` read past
  // them lie inside the table, in place; else gathered, each clamped to the table's edges
  const T* clamped_row(int64_t h, int64_t i, int64_t j0, int64_t n, int64_t span,
                       T* buf) const {
    const T* table = data + table_row(h);
    const int64_t first = j0 - i + shift;
    if (first >= 0 && first + span <= row_len) return table + first;
    // keys [0, below) read column 0, [below, above) their own columns, [above, n) the last
    const int64_t below = std::clamp<int64_t>(-first, 0, n);
    const int64_t above = std::clamp<int64_t>(row_len - first, below, n);
    std::fill(buf, buf + below, table[0]);
    if (above > below) std::copy(table + first + below, table + first + above, buf + below);
    std::fill(buf + above, buf + n, table[row_len - 1]);
    return buf;
  }

  // A cross decay's row from float64 sums: each c rounded to T, then subtracted, so the values
  // are those of the sums converted to T first (what the reference reads: `CrossDecay`)
  const T* wide_decay_row(int64_t b, int64_t h, int64_t i, int64_t j0, int64_t n, T* buf) const {
    const double* row = wide + b * sb + h * sh;
    const double* c = row + lq + j0;
    const T cq = static_cast<T>(row[i]);
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) buf[j] = -std::abs(cq - static_cast<T>(c[j]));
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

}  // namespace urpe_cpp
