// Rows of a group by runs (`by_runs` in forward.cpp and backward.cpp) whose own documents each
// hold fewer than kShortRow keys of the tile, such as a padded tail with one document id per
// token (each query sees itself). Each such row runs start to end in scalar steps, forward
// (products, logits, weights, output row) and backward (products, logits, weights, dS, the
// term gradients, dQ, dK, dV), without the per-row dispatch of the general row loops (~1k
// instructions per row forward, ~2k backward: several times the row's own arithmetic). The
// steps are those of the general loops at LANES = 1, in the same order.
#pragma once

#include "loops.h"

#if defined(__AVX__)
#include <immintrin.h>
#endif

namespace urpe_cpp {

// whether every row of a group by runs sees fewer than kShortRow keys of the tile
inline bool short_runs(const KeyRun* runs, int64_t bq) {
  for (int64_t r = 0; r < bq; ++r) {
    if (runs[r].second - runs[r].first >= kShortRow) return false;
  }
  return true;
}

// Such rows are memory-bound: each reads its query's rows and its keys' rows, all cold, and
// writes rows of the output or gradients. The rows kPrefetchAhead rows on are asked for while
// this one runs (a prefetch never faults: addresses past a tensor's end are harmless).
constexpr int64_t kPrefetchAhead = 2;

// the cache lines of `bytes` bytes from p, for reading or (`write`) writing
template <bool WRITE = false, typename A>
URPE_INLINE void prefetch_row(const A* p, int64_t bytes) {
  for (int64_t at = 0; at < bytes; at += 64) {
    __builtin_prefetch(reinterpret_cast<const char*>(p) + at, WRITE ? 1 : 0);
  }
}

// the first key of row r + kPrefetchAhead of a group (past the group: the keys after its last
// row's, as the next group's runs continue them)
inline int64_t key_ahead(const KeyRun* runs, int64_t bq, int64_t r) {
  const int64_t ahead = r + kPrefetchAhead;
  return ahead < bq ? runs[ahead].first : runs[bq - 1].second + (ahead - bq);
}

// whether row r of a group (r < bq) meets exactly one key of the tile
inline bool one_key(const KeyRun* runs, int64_t bq, int64_t r) {
  return r < bq && runs[r].second - runs[r].first == 1;
}

// y = 0 + a x (as a zeroed row += a x gives it) over n entries
template <typename T, typename A>
URPE_INLINE void set_scaled(T* __restrict y, T a, const A* __restrict x, int64_t n) {
#pragma omp simd
  for (int64_t e = 0; e < n; ++e) y[e] = T(0) + a * value<T>(x[e]);
}

// whether the n entries of x are all finite: x * 0 is NaN exactly for inf and NaN
template <typename T>
URPE_INLINE bool finite_row(const T* __restrict x, int64_t n) {
  T probe = 0;
#pragma omp simd reduction(+ : probe)
  for (int64_t e = 0; e < n; ++e) probe += x[e] * T(0);
  return probe == T(0);
}

// A query that meets one key in its block's first tile (a padded token with its own id)
// writes its output row, and backward its row of dQ (and, where no other query reached that
// key first, the key's rows of dK and dV: `ZeroedKeys::take_fresh`), whole and once; none is
// read again (l = 1: no division follows). Stored past the caches, their lines are not first fetched for
// writing (a fifth of such a row's memory traffic, forward). y = 0 + a x, as set_scaled, for
// float rows of whole 32-byte lines (else set_scaled); whether y is all finite, found in the
// same pass. `end_streaming` orders the stores before the work item ends.
template <typename T, typename A>
URPE_INLINE bool stream_scaled(T* __restrict y, T a, const A* __restrict x, int64_t n) {
#if defined(__AVX__)
  if constexpr (std::is_same_v<T, float> && std::is_same_v<A, float>) {
    if (reinterpret_cast<uintptr_t>(y) % 32 == 0 && n % 8 == 0) {
      const __m256 scale = _mm256_set1_ps(a), zero = _mm256_setzero_ps();
      __m256 probe = zero;  // y * 0: NaN exactly in the lanes that met an inf or NaN
      for (int64_t e = 0; e < n; e += 8) {
        const __m256 ye = _mm256_add_ps(zero, _mm256_mul_ps(scale, _mm256_loadu_ps(x + e)));
        _mm256_stream_ps(y + e, ye);
        probe = _mm256_add_ps(probe, _mm256_mul_ps(ye, zero));
      }
      return _mm256_movemask_ps(_mm256_cmp_ps(probe, probe, _CMP_UNORD_Q)) == 0;
    }
  }
#endif
  set_scaled(y, a, x, n);
  return finite_row(y, n);
}

// the stores of stream_scaled, ordered before whatever follows (another thread's reads)
inline void end_streaming() {
#if defined(__AVX__)
  _mm_sfence();
#endif
}

// The online statistic and output rows of a group after one tile, for its short runs.
template <typename T>
struct ShortRowsState {
  T* row_max;  // (bq) m_i
  T* row_sum;  // (bq) l_i
  T* acc;      // the block's output rows, ldo apart
  int64_t ldo;
  bool first;  // the block's first tile: acc is written, not read
};

// One tile of a group by runs whose rows are all short (`short_runs`): for row r, its keys
// runs[r] = [lo, hi): logits x = qk_scale q.k (bfloat16 operands: their product, scaled with
// the logits as `row_scale` says) + B + M, hidden pairs at the normalisation's hidden logit,
// weights f(x, statistic) C dropout, and acc_r = alpha acc_r + sum_j weight_j v_j (every key of
// the run taken, those past the causal edge at weight 0, so a NaN value row reaches the output).
// q: the group's first query row; k, v: the kv head's first rows (A: T or bfloat16 bits).
template <typename T, typename A>
void forward_short_runs(const Problem<T>& P, int64_t b, int64_t h, int64_t i0, int64_t bq,
                        const KeyRun* runs, const A* q, const A* k, const A* v, T qk_scale,
                        T logit_scale, const ShortRowsState<T>& state) {
  const int64_t d = P.dim, dv = P.vdim, ldq = P.q_rows.si, ldk = P.k_rows.si, ldv = P.v_rows.si;
  const int64_t row0 = (b * P.heads + h) * P.lq + i0;  // flat index of the group's first row
  const T hidden = P.hidden_logit();
  const bool fixed = P.power() == 0;
  const int64_t norm = P.norm;
  bool streamed = false;
  for (int64_t r = 0; r < bq; ++r) {
    const auto [lo, hi] = runs[r];
    const int64_t n = hi - lo, i = i0 + r;
    T x[kShortRow], bias_buf[kShortRow], mask_buf[kShortRow], gate_buf[kShortRow];
    T keep[kShortRow];
    uint8_t flag_buf[kShortRow];
    const int64_t key = key_ahead(runs, bq, r);
    prefetch_row(q + (r + kPrefetchAhead) * ldq, d * sizeof(A));
    prefetch_row(k + key * ldk, d * sizeof(A));
    prefetch_row(v + key * ldv, dv * sizeof(A));
    if (!state.first || !one_key(runs, bq, r + kPrefetchAhead)) {  // (else streamed)
      prefetch_row<true>(state.acc + (r + kPrefetchAhead) * state.ldo, dv * sizeof(T));
    }
    for (int64_t j = 0; j < n; ++j) x[j] = qk_scale * dot<T>(q + r * ldq, k + (lo + j) * ldk, d);
    if (P.nonfinite != nullptr) {  // checked by the products, as the general loop does
      for (int64_t j = 0; j < n; ++j) {
        if (!std::isfinite(x[j])) P.nonfinite->store(true, std::memory_order_relaxed);
      }
    }
    // the logits of the keys before the causal edge (a row's own keys share its document:
    // only the masks may hide them)
    const int64_t vis = P.hiding.visible(i, lo, n);
    const uint8_t* flags = P.hiding.mask_flags(b, h, i, lo, vis, vis, flag_buf);
    const T* bias = P.bias.present() ? P.bias.row(b, h, i, lo, vis, vis, bias_buf) : nullptr;
    const T* mask =
        P.float_mask.present() ? P.float_mask.row(b, h, i, lo, vis, vis, mask_buf) : nullptr;
    T row_max = -std::numeric_limits<T>::infinity();
    for (int64_t j = 0; j < vis; ++j) {
      T y = x[j];
      if (logit_scale != T(1)) y *= logit_scale;
      if (bias != nullptr) y += bias[j];
      if (mask != nullptr) y += mask[j];
      if (flags != nullptr && flags[j]) y = hidden;
      x[j] = y;
      row_max = y > row_max ? y : row_max;
    }
    const T* c = P.gate.present()
                     ? masked_gate_row(P.gate, b, h, i, lo, vis, vis, flags, gate_buf)
                     : nullptr;
    if (P.dropout.on) P.dropout.row(P.counter(b, h, i, lo), vis, P.kept, keep);
    // weights and the online statistic, as normalise_row
    T& m = state.row_max[r];
    T& l = state.row_sum[r];
    const T m_new = fixed ? m : std::max(m, row_max);
    const T shift = fixed ? (norm == kExp ? P.fixed[row0 + r] : T(0))
                          : (std::isfinite(m_new) ? m_new : T(0));
    const T inv_n = norm == kRelu2 ? T(1) / P.fixed[row0 + r] : T(1);
    T lane_sum = 0;
    for (int64_t j = 0; j < vis; ++j) {
      T p;
      if (norm == kRelu2) {
        const T relu = x[j] < T(0) ? T(0) : x[j];  // NaN stays NaN, as torch.relu keeps it
        p = relu * relu * inv_n;
      } else {
        p = exp_value(x[j] - shift);
      }
      if (norm == kSoftmax) lane_sum += p;
      if (norm == kL2) lane_sum += p * p;
      if (c != nullptr) p *= c[j];
      if (P.dropout.on) p *= keep[j];
      if constexpr (std::is_same_v<A, uint16_t>) p = bf16_value(bf16_bits(p));  // as A V takes it
      x[j] = p;
    }
    for (int64_t j = vis; j < n; ++j) x[j] = T(0);  // past the causal edge
    T* row = state.acc + r * state.ldo;
    if (!fixed) {
      const T sum = T(0) + lane_sum;
      if (!state.first) {
        const T alpha = exp_value(m - shift);  // m <= shift, or m = -inf: 0
        l *= norm == kSoftmax ? alpha : alpha * alpha;
        if (alpha != T(1)) {
#pragma omp simd
          for (int64_t e = 0; e < dv; ++e) row[e] *= alpha;
        }
      }
      l += sum;
      m = m_new;
    }
    // The output row checked as written, or here while in cache: for its NaN/inf value rows,
    // which reach it through every weight (0 too). The final division by the normaliser (>= 1)
    // keeps a finite row finite, so forward_item's check after it may be left out.
    bool finite;
    if (state.first && n == 1) {
      finite = stream_scaled(row, x[0], v + lo * ldv, dv);
      streamed = true;
    } else {
      int64_t j = 0;  // the first tile: 0 + the first key's term, in the one pass
      if (state.first && n > 0) {
        set_scaled(row, x[0], v + lo * ldv, dv);
        j = 1;
      } else if (state.first) {
        std::fill(row, row + dv, T(0));
      }
      for (; j < n; ++j) add_scaled(row, x[j], v + (lo + j) * ldv, dv);
      finite = P.nonfinite == nullptr || finite_row(row, dv);
    }
    if (P.nonfinite != nullptr && !finite) P.nonfinite->store(true, std::memory_order_relaxed);
  }
  if (streamed) end_streaming();
}

// The rows of dK and dV a work item accumulates into (kv head hk of batch b, its split copy),
// zeroed as its blocks first reach them: rows [0, end) are zero or hold sums, and a tile that
// may write keys before `key` calls `up_to(key)` first; `rest` zeroes the rows none reached. So
// the zeros are written just before the products read them back, in cache (a padded tail of one
// document per token reaches a few rows a block; zeroing all Lk rows up front went to memory).
// A short row whose one key is the next row not reached takes it (`take_fresh`): it writes that
// row's single term with `stream_scaled` instead of zeroing it and summing into it.
template <typename T>
struct ZeroedKeys {
  T* dk;
  T* dv;
  int64_t dk_stride, dv_stride, dim, vdim, lk;
  int64_t end = 0;

  ZeroedKeys(const Problem<T>& P, const Gradients<T>& G, int64_t split, int64_t b, int64_t hk)
      : dk(G.dk + split * G.dk_split + G.dk_rows.at(b, hk, 0)),
        dv(G.dv + split * G.dv_split + G.dv_rows.at(b, hk, 0)),
        dk_stride(G.dk_rows.si),
        dv_stride(G.dv_rows.si),
        dim(P.dim),
        vdim(P.vdim),
        lk(P.lk) {}

  void up_to(int64_t key) {
    for (; end < std::min(key, lk); ++end) {
      std::fill(dk + end * dk_stride, dk + end * dk_stride + dim, T(0));
      std::fill(dv + end * dv_stride, dv + end * dv_stride + vdim, T(0));
    }
  }
  void rest() { up_to(lk); }
  // whether row `key` is the next one not reached (those before it zeroed first); if so it is
  // now reached, and its caller writes it whole
  bool take_fresh(int64_t key) {
    up_to(key);
    if (key != end || key >= lk) return false;
    ++end;
    return true;
  }
};

// The keys' gradient rows of a work item and the group's rows of dQ, for `backward_short_runs`.
template <typename T>
struct ShortRowsGrads {
  T* dq;  // the group's first row of dQ (rows G.dq_rows.si apart): written where `first`
  const T* stat;   // (bq) the rows' r_i, delta_i (`row_statistics`)
  const T* delta;
  int64_t worker;  // the table gradients' slot
  bool first;
  ZeroedKeys<T>* zeroed;  // the item's dK, dV copies (from the kv head's first row), how far reached
  const T* next_out;  // O's row bq on from the group's first (rows ld_out apart): prefetched
  int64_t ld_out;
};

// The backward pass of one tile of a group by runs whose rows are all short: for row r and its
// keys [lo, hi): S = scale q.k + B + M, dA = dO.v, P = f(S, r), A = dropout(P C), dC = dA P,
// dS by the normalisation's rule, the term gradients, then dV_j += A dO, dK_j += scale dS q,
// dQ (+)= scale dS k (A and dS rounded to bfloat16 for bfloat16 operands, as SDPA takes them).
// q, dout: the group's first rows; k, v: the kv head's first rows (A: T or bfloat16 bits).
template <typename T, typename A>
void backward_short_runs(const Problem<T>& P, const Gradients<T>& G, int64_t b, int64_t h,
                         int64_t i0, int64_t bq, const KeyRun* runs, const A* q, const A* dout,
                         const A* k, const A* v, const ShortRowsGrads<T>& out) {
  const int64_t d = P.dim, dv = P.vdim, ldq = P.q_rows.si, ldk = P.k_rows.si, ldv = P.v_rows.si;
  const int64_t ldo = G.grad_out_rows.si, lddq = G.dq_rows.si, lddk = G.dk_rows.si;
  const int64_t lddv = G.dv_rows.si, norm = P.norm;
  const T hidden = P.hidden_logit();
  ZeroedKeys<T>& zeroed = *out.zeroed;
  bool streamed = false;
  for (int64_t r = 0; r < bq; ++r) {
    const auto [lo, hi] = runs[r];
    const int64_t n = hi - lo, i = i0 + r;
    T s[kShortRow], da[kShortRow], bias_buf[kShortRow], mask_buf[kShortRow];
    T gate_buf[kShortRow], keep[kShortRow], dgate_buf[kShortRow];
    uint8_t flag_buf[kShortRow];
    const int64_t key = key_ahead(runs, bq, r), ahead = r + kPrefetchAhead;
    prefetch_row(q + ahead * ldq, d * sizeof(A));
    prefetch_row(dout + ahead * ldo, dv * sizeof(A));
    prefetch_row(k + key * ldk, d * sizeof(A));
    prefetch_row(v + key * ldv, dv * sizeof(A));
    if (!out.first || !one_key(runs, bq, ahead)) {  // (else streamed)
      prefetch_row<true>(out.dq + ahead * lddq, d * sizeof(T));
    }
    if (!one_key(runs, bq, ahead) || key < zeroed.end) {  // (else streamed)
      prefetch_row<true>(zeroed.dk + key * lddk, d * sizeof(T));
      prefetch_row<true>(zeroed.dv + key * lddv, dv * sizeof(T));
    }
    // and the next group's rows of O and dO, which its first step reads (`row_deltas`)
    prefetch_row(out.next_out + r * out.ld_out, dv * sizeof(T));
    prefetch_row(dout + (bq + r) * ldo, dv * sizeof(A));
    for (int64_t j = 0; j < n; ++j) {
      s[j] = P.scale * dot<T>(q + r * ldq, k + (lo + j) * ldk, d);
      da[j] = dot<T>(dout + r * ldo, v + (lo + j) * ldv, dv);
    }
    const int64_t vis = P.hiding.visible(i, lo, n);
    const uint8_t* flags = P.hiding.mask_flags(b, h, i, lo, vis, vis, flag_buf);
    const T* bias = P.bias.present() ? P.bias.row(b, h, i, lo, vis, vis, bias_buf) : nullptr;
    const T* mask =
        P.float_mask.present() ? P.float_mask.row(b, h, i, lo, vis, vis, mask_buf) : nullptr;
    // A hidden pair has P = 0 and dP = 0, so dS = 0, unless delta is inf or NaN: then dS and
    // dC of hidden pairs are set to 0 after the loop, and the term gradients go through buffers
    // (`backward_row`)
    const T stat = out.stat[r], delta = out.delta[r];
    const bool clear = !std::isfinite(delta);
    if (P.dropout.on) P.dropout.row(P.counter(b, h, i, lo), vis, P.kept, keep);
    const T* c = P.gate.present()
                     ? masked_gate_row(P.gate, b, h, i, lo, vis, vis, flags, gate_buf)
                     : nullptr;
    T* dgate = nullptr;
    if (c != nullptr && G.gate.present()) {
      dgate = clear ? nullptr : G.gate.row_target(out.worker, h, i, lo);
      if (dgate == nullptr) {
        dgate = dgate_buf;
        fill_row(dgate, T(0), vis);
      }
    }
    T* dbias = G.bias.present() && !clear ? G.bias.row_target(out.worker, h, i, lo) : nullptr;
    const T inv_n = norm == kRelu2 ? T(1) / stat : T(1);
    const bool write_a = c != nullptr || P.dropout.on || norm == kRelu2;  // else A is P
    for (int64_t j = 0; j < vis; ++j) {
      T x = s[j];
      if (bias != nullptr) x += bias[j];
      if (mask != nullptr) x += mask[j];
      if (flags != nullptr && flags[j]) x = hidden;
      if (norm == kRelu2) {
        x = x < T(0) ? T(0) : x;  // (NaN stays NaN, as torch.relu keeps it)
      } else {
        x = exp_value(x - stat);
      }
      const T p = norm == kRelu2 ? x * x * inv_n : x;
      T dd = da[j];
      if (P.dropout.on) dd *= keep[j];
      T weight = p, dp = dd;
      if (c != nullptr) {
        weight = p * c[j];
        if (dgate != nullptr) dgate[j] += dd * p;
        dp = dd * c[j];
      }
      if (P.dropout.on) weight *= keep[j];
      T ds;
      if (norm == kSoftmax) {
        ds = p * (dp - delta);
      } else if (norm == kL2) {
        ds = (dp - p * delta) * p;
      } else if (norm == kExp) {
        ds = p * dp;
      } else {  // relu's gradient is 0 where relu(s) = 0 (even times an inf or NaN dP)
        ds = x == T(0) ? T(0) : dp * x * (T(2) * inv_n);
      }
      da[j] = ds;
      if (dbias != nullptr) dbias[j] += ds;
      s[j] = write_a ? weight : x;
    }
    if (clear) {
      for (int64_t j = 0; j < vis; ++j) {
        if (flags == nullptr || !flags[j]) continue;
        da[j] = T(0);
        if (dgate != nullptr) dgate[j] = T(0);
      }
    }
    if (dgate == dgate_buf) G.gate.add(out.worker, b, h, i, lo, vis, dgate);
    if (G.bias.present() && dbias == nullptr) G.bias.add(out.worker, b, h, i, lo, vis, da);
    if (G.float_mask.present()) G.float_mask.add(out.worker, b, h, i, lo, vis, da);
    for (int64_t j = vis; j < n; ++j) s[j] = da[j] = T(0);  // past the causal edge
    // the products, as `gradients_by_runs`
    T* dq_row = out.dq + r * lddq;
    const bool stream = out.first && n == 1;  // dQ's row written whole once (`stream_scaled`)
    if (out.first && !stream) std::fill(dq_row, dq_row + d, T(0));
    // the key's rows of dK and dV written whole where no other query has reached them
    const bool fresh = n == 1 && zeroed.take_fresh(lo);
    if (!fresh) zeroed.up_to(hi);
    for (int64_t j = 0; j < n; ++j) {
      T weight = s[j], grad = da[j];
      if constexpr (std::is_same_v<A, uint16_t>) {
        weight = bf16_value(bf16_bits(weight));
        grad = bf16_value(bf16_bits(grad));
      }
      grad *= P.scale;
      if (fresh) {
        stream_scaled(zeroed.dv + lo * lddv, weight, dout + r * ldo, dv);
        stream_scaled(zeroed.dk + lo * lddk, grad, q + r * ldq, d);
        streamed = true;
      } else {
        add_scaled(zeroed.dv + (lo + j) * lddv, weight, dout + r * ldo, dv);
        add_scaled(zeroed.dk + (lo + j) * lddk, grad, q + r * ldq, d);
      }
      if (stream) {
        stream_scaled(dq_row, grad, k + (lo + j) * ldk, d);
        streamed = true;
      } else {
        add_scaled(dq_row, grad, k + (lo + j) * ldk, d);
      }
    }
  }
  if (streamed) end_streaming();
}

}  // namespace urpe_cpp
