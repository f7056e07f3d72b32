// The forward tile loop. One work item is (batch, head, query block); for each key block it
//   S = scale Q K^T + B + M   (one product, then per row while S is in cache:)
//   hidden pairs -> the normalisation's hidden logit, P = f(S, running statistic), P *= C,
//   dropout, and acc = alpha acc + P V (one product),
// with the online statistic m_i (max), l_i = sum_j exp(s_ij - m_i)^power of FlashAttention.
// At the end out_i = acc_i / l_i^(1/power) and r_i = m_i + log(l_i) / power is saved for the
// backward pass (normalisations with a fixed statistic save it as given).
#include "loops.h"

namespace urpe_cpp {
namespace {

template <typename T>
struct ForwardScratch {
  std::vector<T> s, values, mask_values, dropout, row_max, row_sum, alpha;
  std::vector<uint8_t> flags;
  std::vector<uint16_t> s16;  // the weights tile in bfloat16, for bfloat16 operands

  ForwardScratch(int64_t bq, int64_t bk, bool bf16)
      : s(bq * bk), values(bk), mask_values(bk), dropout(bk), row_max(bq), row_sum(bq),
        alpha(bq), flags(bk), s16(bf16 ? bq * bk : 0) {}
};

// The tile's two products, on T operands or on the problem's bfloat16 ones.
// S (bq, n; rows ld apart) = scale Q K^T for query rows `row0`.. and keys `j0`..
template <typename T>
void scores(const Problem<T>& P, int64_t row0, int64_t kv0, int64_t j0, int64_t bq, int64_t n,
            T* s, int64_t ld) {
  const int64_t d = P.dim;
  if constexpr (std::is_same_v<T, float>) {
    if (P.bf16()) {
      return gemm_nt(bq, n, d, P.scale, P.q16 + row0 * d, d, P.k16 + (kv0 + j0) * d, d, 0.0f, s,
                     ld);
    }
  }
  gemm_nt<T>(bq, n, d, P.scale, P.q + row0 * d, d, P.k + (kv0 + j0) * d, d, T(0), s, ld);
}

// acc (bq, Dv) = beta acc + A V for the weights A (bq, n; rows ld apart) and keys `j0`..
template <typename T>
void accumulate(const Problem<T>& P, ForwardScratch<T>& W, int64_t kv0, int64_t j0, int64_t bq,
                int64_t n, const T* a, int64_t ld, T beta, T* acc) {
  const int64_t dv = P.vdim;
  if constexpr (std::is_same_v<T, float>) {
    if (P.bf16()) {  // A in bfloat16 as SDPA does; the sum stays float
      to_bf16(a, W.s16.data(), bq * ld);
      return gemm_nn(bq, dv, n, 1.0f, W.s16.data(), ld, P.v16 + (kv0 + j0) * dv, dv, beta, acc,
                     dv);
    }
  }
  gemm_nn<T>(bq, dv, n, T(1), a, ld, P.v + (kv0 + j0) * dv, dv, beta, acc, dv);
}

// Weights of one row from its logits, in one pass over its span: P = f(s, shift) (exp(s -
// shift), or relu(s)^2 / n for relu2; 0 at hidden logits), times the gate row c (hidden pairs 0
// in it, entries past the first `vis` not read as numbers) and the dropout scale row keep.
// Returns sum_j P^power before the gate, for the online normalisations.
template <typename T, int64_t NORM, bool GATE, bool DROPOUT>
T weights_loop(T* __restrict s, int64_t vis, int64_t span, T shift, T inv_n,
               const T* __restrict c, const T* __restrict keep) {
  T lane_sum[kLanes] = {};  // one running sum per lane: reduced across lanes once, at the end
  for (int64_t block = 0; block < span; block += kLanes) {
#pragma omp simd
    for (int64_t lane = 0; lane < kLanes; ++lane) {
      const int64_t j = block + lane;
      T p;
      if constexpr (NORM == kRelu2) {
        const T relu = s[j] > T(0) ? s[j] : T(0);
        p = relu * relu * inv_n;
      } else {
        p = exp_value(s[j] - shift);
      }
      if constexpr (NORM == kSoftmax) lane_sum[lane] += p;
      if constexpr (NORM == kL2) lane_sum[lane] += p * p;
      if constexpr (GATE) {  // a gate past the edge may be inf; the load itself is always safe
        const T cj = c[j];
        p *= j < vis ? cj : T(0);
      }
      if constexpr (DROPOUT) p *= keep[j];
      s[j] = p;
    }
  }
  T sum = 0;
#pragma omp simd reduction(+ : sum)
  for (int64_t lane = 0; lane < kLanes; ++lane) sum += lane_sum[lane];
  return sum;
}

// Logits (already with B, M and hidden pairs) -> weights for one row segment, `vis` keys before
// the causal edge. Updates the online statistic (m, l) and returns the factor by which the
// row's earlier accumulation is rescaled (1 for a fixed statistic).
template <typename T>
T normalise_row(const Problem<T>& P, T* s, int64_t vis, int64_t span, T row_max, int64_t i_flat,
                bool first, T& m, T& l, const T* c, const T* keep) {
  const bool fixed = P.power() == 0;
  const T m_new = fixed ? m : std::max(m, row_max);
  // the shift: r for a fixed statistic (0 for relu2, which reads inv_n), else the running max
  T shift = fixed ? (P.norm == kExp ? P.fixed[i_flat] : T(0))
                  : (std::isfinite(m_new) ? m_new : T(0));
  const T inv_n = P.norm == kRelu2 ? T(1) / P.fixed[i_flat] : T(1);
  const T sum = with_norm(
      [&](auto norm) {
        return with_flags(
            [&](auto gate, auto dropout) {
              return weights_loop<T, norm, gate, dropout>(s, vis, span, shift, inv_n, c, keep);
            },
            c != nullptr, keep != nullptr);
      },
      P.norm);
  if (fixed) return T(1);
  T alpha = T(1);
  if (!first) {
    alpha = exp_value(m - shift);  // m <= shift, or m = -inf: 0
    l *= P.norm == kSoftmax ? alpha : alpha * alpha;
  }
  l += sum;
  m = m_new;
  return alpha;
}

template <typename T>
void forward_item(const Problem<T>& P, ForwardScratch<T>& W, int64_t b, int64_t h, int64_t i0,
                  int64_t i1, T* out, T* stat) {
  const int64_t bq = i1 - i0, dv = P.vdim, hk = h / P.groups;
  const int64_t kv0 = (b * P.kv_heads + hk) * P.lk;     // flat index of the kv head's first key
  T* acc = out + ((b * P.heads + h) * P.lq + i0) * dv;  // (bq, Dv), the output rows
  const int64_t row0 = (b * P.heads + h) * P.lq + i0;   // flat index of the block's first row
  const int power = P.power();
  std::fill(W.row_max.begin(), W.row_max.end(), -std::numeric_limits<T>::infinity());
  std::fill(W.row_sum.begin(), W.row_sum.end(), T(0));
  const int64_t key_end = P.hiding.key_end(i1, P.lk);
  bool first = true;
  for (int64_t j0 = 0; j0 < key_end; j0 += P.block_k) {
    const int64_t n = std::min(P.block_k, key_end - j0), ld = padded(n);
    T* s_tile = W.s.data();  // (bq, n) with rows ld apart
    scores(P, row0, kv0, j0, bq, n, s_tile, ld);
    bool rescale = false;
    for (int64_t r = 0; r < bq; ++r) {
      const int64_t i = i0 + r;
      T* s = s_tile + r * ld;
      const int64_t vis = P.hiding.visible(i, j0, n), span = padded(vis);
      const uint8_t* flags = P.hiding.flags(b, h, i, j0, vis, span, W.flags.data());
      const T row_max = logits_row(P, W.values.data(), W.mask_values.data(), b, h, i, j0, vis,
                                   span, flags, s);
      const T* c = nullptr;
      if (P.gate.present()) {
        c = masked_gate_row(P.gate, b, h, i, j0, vis, span, flags, W.values.data());
      }
      const T* keep = nullptr;
      if (P.dropout.on) {
        P.dropout.row(P.counter(b, h, i, j0), span, P.kept, W.dropout.data());
        keep = W.dropout.data();
      }
      const T alpha = normalise_row(P, s, vis, span, row_max, row0 + r, first, W.row_max[r],
                                    W.row_sum[r], c, keep);
      W.alpha[r] = alpha;
      rescale = rescale || alpha != T(1);
      if (span < n) fill_row(s + span, T(0), n - span);  // the keys past the causal edge
    }
    if (rescale && !first) {
      for (int64_t r = 0; r < bq; ++r) {
        const T alpha = W.alpha[r];
        if (alpha == T(1)) continue;
        T* row = acc + r * dv;
#pragma omp simd
        for (int64_t e = 0; e < dv; ++e) row[e] *= alpha;
      }
    }
    accumulate(P, W, kv0, j0, bq, n, s_tile, ld, first ? T(0) : T(1), acc);
    first = false;
  }
  if (first) std::fill(acc, acc + bq * dv, T(0));  // no key is visible to this block
  for (int64_t r = 0; r < bq; ++r) {
    if (power == 0) {
      stat[row0 + r] = P.fixed[row0 + r];
      continue;
    }
    const T l = W.row_sum[r];
    const T norm = l > T(0) ? (power == 1 ? l : std::sqrt(l)) : T(1);
    T* row = acc + r * dv;
    const T inv = T(1) / norm;
#pragma omp simd
    for (int64_t e = 0; e < dv; ++e) row[e] *= inv;
    stat[row0 + r] = l > T(0) ? W.row_max[r] + std::log(l) / T(power)
                              : std::numeric_limits<T>::infinity();
  }
}

}  // namespace

template <typename T>
void forward_loop(const Problem<T>& P, T* out, T* stat) {
  const int64_t bq = P.block_q, blocks = (P.lq + bq - 1) / bq;
  const int64_t count = P.batch * P.heads * blocks;
  const int64_t workers = workers_for(count, P.work());
  const int64_t rows = P.batch * P.heads;
  std::vector<std::unique_ptr<ForwardScratch<T>>> scratch(workers);
  run_items(count, workers, [&](int64_t worker, int64_t index) {
    if (!scratch[worker]) {
      scratch[worker] =
          std::make_unique<ForwardScratch<T>>(P.tile_queries(), P.tile_keys(), P.bf16());
    }
    // the last query blocks first: under causal masking they meet the most keys
    const int64_t block = blocks - 1 - index / rows, bh = index % rows;
    const int64_t i0 = block * bq, i1 = std::min(P.lq, i0 + bq);
    forward_item(P, *scratch[worker], bh / P.heads, bh % P.heads, i0, i1, out, stat);
  });
}

template void forward_loop<float>(const Problem<float>&, float*, float*);
template void forward_loop<double>(const Problem<double>&, double*, double*);

}  // namespace urpe_cpp
