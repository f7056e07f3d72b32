// The forward tile loop. One work item is (batch, head, query block); for each key block it
//   S = scale Q K^T + B + M   (one product, then per row while S is in cache:)
//   hidden pairs -> the normalisation's hidden logit, P = f(S, running statistic), P *= C,
//   dropout, and acc = alpha acc + P V (one product),
// with the online statistic m_i (max), l_i = sum_j exp(s_ij - m_i)^power of FlashAttention.
// At the end out_i = acc_i / l_i^(1/power) and r_i = m_i + log(l_i) / power is saved for the
// backward pass (normalisations with a fixed statistic save it as given).
#include "loops.h"
#include "packed.h"
#include "rows_avx512.h"
#include "short_runs.h"

namespace urpe_cpp {
namespace {

inline int64_t round_up(int64_t n, int64_t step) { return (n + step - 1) / step * step; }

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
// S (bq, n; rows ld apart) = scale Q K^T for the query rows from offset q0 on and keys `j0`..
// of the kv head whose first key is at offset k0, but on bfloat16 operands S = Q K^T: BLAS's
// bf16 product takes about 1.7x as long with a factor, so the logits loop applies it
// (`row_scale`).
template <typename T>
void scores(const Problem<T>& P, PackedHead packed, int64_t q0, int64_t k0, int64_t j0,
            int64_t bq, int64_t n, T* s, int64_t ld) {
  const int64_t d = P.dim, ldq = P.q_rows.si, ldk = P.k_rows.si;
  if constexpr (std::is_same_v<T, float>) {
    if (packed.keys != nullptr) {
      gemm_nt_packed(bq, n, d, P.q16 + q0, ldq, packed.keys + j0 * d, s, ld);
      if (packed.values == nullptr) release_packed();  // BLAS multiplies A V
      return;
    }
    if (P.bf16() && P.direct) {
      return rows_nt(bq, n, d, 1.0f, P.q16 + q0, ldq, P.k16 + k0 + j0 * ldk, ldk, s, ld);
    }
    if (P.bf16()) {
      return gemm_nt(bq, n, d, 1.0f, P.q16 + q0, ldq, P.k16 + k0 + j0 * ldk, ldk, 0.0f, s, ld);
    }
  }
  if (P.direct) {
    return rows_nt<T>(bq, n, d, P.scale, P.q + q0, ldq, P.k + k0 + j0 * ldk, ldk, s, ld);
  }
  gemm_nt<T>(bq, n, d, P.scale, P.q + q0, ldq, P.k + k0 + j0 * ldk, ldk, T(0), s, ld);
}

// The factor `scores` left to the logits loop.
template <typename T>
T row_scale(const Problem<T>& P) {
  return P.bf16() ? P.scale : T(1);
}

// acc (bq, Dv; rows ldo apart) = beta acc + A V for the weights A (bq, n; rows ld apart) and
// keys `j0`.. of the kv head whose first value is at offset v0: in `a`, or on bfloat16 operands
// in W.s16 (rounded as SDPA does; the sum stays float).
template <typename T>
void accumulate(const Problem<T>& P, ForwardScratch<T>& W, PackedHead packed, int64_t v0,
                int64_t j0, int64_t bq, int64_t n, const T* a, int64_t ld, T beta, T* acc,
                int64_t ldo) {
  const int64_t dv = P.vdim, ldv = P.v_rows.si;
  if constexpr (std::is_same_v<T, float>) {
    if (packed.values != nullptr) {
      return gemm_nn_packed(bq, n, dv, W.s16.data(), ld, packed.values, P.lk, j0, beta != 0.0f,
                            acc, ldo);
    }
    if (P.bf16() && P.direct) {
      return rows_nn(bq, dv, n, W.s16.data(), ld, P.v16 + v0 + j0 * ldv, ldv, beta, acc, ldo);
    }
    if (P.bf16()) {
      return gemm_nn(bq, dv, n, 1.0f, W.s16.data(), ld, P.v16 + v0 + j0 * ldv, ldv, beta, acc,
                     ldo);
    }
  }
  if (P.direct) {
    return rows_nn<T>(bq, dv, n, a, ld, P.v + v0 + j0 * ldv, ldv, beta, acc, ldo);
  }
  gemm_nn<T>(bq, dv, n, T(1), a, ld, P.v + v0 + j0 * ldv, ldv, beta, acc, ldo);
}

// Whether a tile's products run query by query over the keys of its own document only (a run
// of keys: `Hiding::run_begin`): the tiles of a group of kRunGroup queries (`for_query_groups`),
// whose short documents make the group's tile mostly hidden pairs (with one id per padded
// token each query sees one key of the group's kRunGroup: 1/16 of the products, and no BLAS
// call, whose packing costs more than such a tile's product). Each row then runs as a tile of
// its own keys: its flags, logits, gate, dropout and weights over those alone.
template <typename T>
bool by_runs(const Problem<T>& P, PackedHead packed, int64_t bq) {
  return !P.direct && packed.keys == nullptr && bq <= kRunGroup && !P.hiding.run_begin.empty();
}

// `scores` by runs: each query's logits with the keys of its document only (`runs`: its keys
// [lo, hi) in the tile, `Hiding::own_keys`), row r's from its start on (the row then runs as
// a tile of its own keys: keys lo.., hi - lo of them). q: the block's first row; k: the kv
// head's first key (A: T, or bfloat16 bits, whose product leaves the scale to the logits loop
// as `scores` does).
template <typename T, typename A>
void scores_by_runs(const KeyRun* runs, int64_t bq, int64_t d, T scale, const A* q, int64_t ldq,
                    const A* k, int64_t ldk, T* s_tile, int64_t ld) {
  for (int64_t r = 0; r < bq; ++r) {
    const auto [lo, hi] = runs[r];
    T* s = s_tile + r * ld - lo;
    for (int64_t j = lo; j < hi; ++j) s[j] = scale * dot<T>(q + r * ldq, k + j * ldk, d);
  }
}

// `accumulate` by runs: each output row (acc, rows ldo apart) = beta acc + the weights of its
// document's keys (a: T, or bfloat16 bits, from the row's start as `scores_by_runs` leaves
// them) times their values (v: the kv head's first). Every weight of those keys is taken, 0
// too, so that a NaN or inf value row reaches the output (`flag_nonfinite`).
template <typename T, typename A>
void accumulate_by_runs(const KeyRun* runs, int64_t bq, int64_t dv, const A* a, int64_t ld,
                        const A* v, int64_t ldv, T beta, T* acc, int64_t ldo) {
  for (int64_t r = 0; r < bq; ++r) {
    const auto [lo, hi] = runs[r];
    T* row = acc + r * ldo;
    if (beta == T(0)) std::fill(row, row + dv, T(0));
    for (int64_t j = lo; j < hi; ++j) add_scaled(row, value<T>(a[r * ld + j - lo]), v + j * ldv, dv);
  }
}

// Whether any of the rows x (rows x cols, ld apart) has an entry with all of `mask`'s bits set:
// a float, double or bfloat16 is inf or NaN exactly when its exponent bits are all ones.
template <typename Bits>
bool any_exponent_full(const Bits* x, int64_t rows, int64_t cols, int64_t ld, Bits mask) {
  unsigned bad = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const Bits* __restrict row = x + r * ld;
#pragma omp simd reduction(| : bad)
    for (int64_t e = 0; e < cols; ++e) bad |= static_cast<unsigned>((row[e] & mask) == mask);
  }
  return bad != 0;
}

// Whether any of the rows x (rows x cols, ld apart) holds a NaN or inf.
template <typename T>
bool any_nonfinite(const T* x, int64_t rows, int64_t cols, int64_t ld) {
  if constexpr (sizeof(T) == 4) {
    return any_exponent_full(reinterpret_cast<const uint32_t*>(x), rows, cols, ld, 0x7f800000u);
  } else {
    return any_exponent_full(reinterpret_cast<const uint64_t*>(x), rows, cols, ld,
                             uint64_t{0x7ff0000000000000ull});
  }
}

inline bool any_nonfinite(const uint16_t* x, int64_t rows, int64_t cols, int64_t ld) {
  return any_exponent_full(x, rows, cols, ld, uint16_t{0x7f80});
}

// For a problem whose q, k and v were not checked up front (`Problem::nonfinite`), products
// by BLAS: raises the flag where a row of q, k or v that the tile (queries i0.., keys j0..)
// reads holds a NaN or inf; q's rows with the block's first tile (`first`), k's and v's once
// per whole key block and kv head (`Problem::finite_keys`). Every pair the non-finite rule
// looks at lies in a tile the loop computes; the rows of skipped tiles (a padded tail) are
// never read. The operands themselves are checked, not the products: BLAS may skip a 0
// weight, and 0 * NaN would then not reach the output. The rows are in cache, just read by
// the products.
template <typename T>
void flag_operands(const Problem<T>& P, int64_t b, int64_t h, int64_t i0, int64_t bq, int64_t j0,
                   int64_t n, bool first) {
  const int64_t hk = h / P.groups, d = P.dim, dv = P.vdim;
  const int64_t q0 = P.q_rows.at(b, h, i0), k0 = P.k_rows.at(b, hk, j0);
  const int64_t v0 = P.v_rows.at(b, hk, j0);
  const int64_t ldq = P.q_rows.si, ldk = P.k_rows.si, ldv = P.v_rows.si;
  // a tile that covers its key block (a causal edge or a document may cut it short) checks the
  // block's rows for every tile that reads them later
  const bool whole = j0 % P.block_k == 0 && n == std::min(P.block_k, P.lk - j0);
  std::atomic<uint8_t>& known =
      P.finite_keys[(b * P.kv_heads + hk) * P.key_blocks() + j0 / P.block_k];
  const bool keys = !(whole && known.load(std::memory_order_relaxed));  // to be checked
  bool bad;
  if (P.bf16()) {
    bad = (first && any_nonfinite(P.q16 + q0, bq, d, ldq)) ||
          (keys && (any_nonfinite(P.k16 + k0, n, d, ldk) ||
                    any_nonfinite(P.v16 + v0, n, dv, ldv)));
  } else {
    bad = (first && any_nonfinite(P.q + q0, bq, d, ldq)) ||
          (keys && (any_nonfinite(P.k + k0, n, d, ldk) || any_nonfinite(P.v + v0, n, dv, ldv)));
  }
  if (bad) P.nonfinite->store(true, std::memory_order_relaxed);
  if (keys && whole && !bad) known.store(1, std::memory_order_relaxed);
}

// For a problem whose q, k and v were not checked up front, one query row (`Problem::direct`):
// raises the flag where any of the rows x (rows x cols, ld apart) holds a NaN or inf. Run on
// the logits q.k before B and M join them (a product by rows_nt of a row holding NaN/inf is NaN or inf,
// whatever the other row holds: 0 * inf = NaN), and on the output rows (rows_nn takes every
// weight, 0 too, times every value row of the tiles it reads). Keys of tiles the loop skips
// are hidden from every query of the block, which they would not reach under the non-finite
// rule either. A finite q.k that overflows raises it too: the caller then applies the rule.
template <typename T>
void flag_nonfinite(const Problem<T>& P, const T* x, int64_t rows, int64_t cols, int64_t ld) {
  if (any_nonfinite(x, rows, cols, ld)) P.nonfinite->store(true, std::memory_order_relaxed);
}

// Weights of one row from its logits, in one pass over its span: P = f(s, shift) (exp(s -
// shift), or relu(s)^2 / n for relu2; 0 at hidden logits), times the gate row c (hidden pairs 0
// in it, entries past the first `vis` not read as numbers) and the dropout scale row keep, into
// s, or (BF16) rounded to bfloat16 into s16. Returns sum_j P^power before the gate, for the
// online normalisations.
template <typename T, int64_t NORM, bool GATE, bool DROPOUT, bool BF16, int64_t LANES>
T weights_loop(T* __restrict s, uint16_t* __restrict s16, int64_t vis, int64_t span, T shift,
               T inv_n, const T* __restrict c, const T* __restrict keep) {
#if URPE_AVX512
  if constexpr (std::is_same_v<T, float> && NORM != kRelu2 && LANES == kLanes) {
    return weights_avx512<NORM, GATE, DROPOUT, BF16>(s, s16, vis, span, shift, c, keep);
  }
#endif
  T lane_sum[LANES] = {};  // one running sum per lane: reduced across lanes once, at the end
  for (int64_t block = 0; block < span; block += LANES) {
#pragma omp simd
    for (int64_t lane = 0; lane < LANES; ++lane) {
      const int64_t j = block + lane;
      T p;
      if constexpr (NORM == kRelu2) {
        const T relu = s[j] < T(0) ? T(0) : s[j];  // NaN stays NaN, as torch.relu keeps it
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
      if constexpr (BF16) {
        s16[j] = bf16_bits(p);
      } else {
        s[j] = p;
      }
    }
  }
  T sum = 0;
#pragma omp simd reduction(+ : sum)
  for (int64_t lane = 0; lane < LANES; ++lane) sum += lane_sum[lane];
  return sum;
}

// logits_row (tile.h), its loop in AVX-512 registers for float
template <typename T>
T row_logits(const Problem<T>& P, ForwardScratch<T>& W, int64_t b, int64_t h, int64_t i,
             int64_t j0, int64_t vis, int64_t span, const uint8_t* flags, T* s, T scale) {
#if URPE_AVX512
  if constexpr (std::is_same_v<T, float>) {
    if (whole_blocks(span)) {
      const float* bias =
          P.bias.present() ? P.bias.row(b, h, i, j0, vis, span, W.values.data()) : nullptr;
      const float* mask = P.float_mask.present()
                              ? P.float_mask.row(b, h, i, j0, vis, span, W.mask_values.data())
                              : nullptr;
      return with_flags(
          [&](auto has_scale, auto has_bias, auto has_mask, auto has_flags) {
            return logits_avx512<has_scale, has_bias, has_mask, has_flags>(
                s, vis, span, scale, bias, mask, flags, P.hidden_logit());
          },
          scale != 1.0f, bias != nullptr, mask != nullptr, flags != nullptr);
    }
  }
#endif
  return logits_row(P, W.values.data(), W.mask_values.data(), b, h, i, j0, vis, span, flags, s,
                    scale);
}

// Logits (already with B, M and hidden pairs) -> weights for one row segment, `vis` keys before
// the causal edge, into s or, where s16 is given, into s16 in bfloat16. Updates the online
// statistic (m, l) and returns the factor by which the row's earlier accumulation is rescaled
// (1 for a fixed statistic).
template <typename T>
T normalise_row(const Problem<T>& P, T* s, uint16_t* s16, int64_t vis, int64_t span, T row_max,
                int64_t i_flat, bool first, T& m, T& l, const T* c, const T* keep) {
  const bool fixed = P.power() == 0;
  const T m_new = fixed ? m : std::max(m, row_max);
  // the shift: r for a fixed statistic (0 for relu2, which reads inv_n), else the running max
  T shift = fixed ? (P.norm == kExp ? P.fixed[i_flat] : T(0))
                  : (std::isfinite(m_new) ? m_new : T(0));
  const T inv_n = P.norm == kRelu2 ? T(1) / P.fixed[i_flat] : T(1);
  const T sum = with_norm(
      [&](auto norm) {
        return with_flags(
            [&](auto gate, auto dropout, auto bf16, auto blocks) {
              return weights_loop<T, norm, gate, dropout, bf16, blocks ? kLanes : 1>(
                  s, s16, vis, span, shift, inv_n, c, keep);
            },
            c != nullptr, keep != nullptr, s16 != nullptr, whole_blocks(span));
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

// packed: (b, h)'s kv head's packed keys and values, where they are
template <typename T>
void forward_item(const Problem<T>& P, ForwardScratch<T>& W, PackedHead packed, int64_t b,
                  int64_t h, int64_t i0, int64_t i1, T* out, Rows out_rows, T* stat) {
  const int64_t bq = i1 - i0, dv = P.vdim, hk = h / P.groups;
  const int64_t k0 = P.k_rows.at(b, hk, 0), v0 = P.v_rows.at(b, hk, 0);  // the kv head's rows
  T* acc = out + out_rows.at(b, h, i0);  // (bq, Dv), the output rows, ldo apart
  const int64_t ldo = out_rows.si;
  const int64_t row0 = (b * P.heads + h) * P.lq + i0;   // flat index of the block's first row
  const int power = P.power();
  const T scale = row_scale(P);
  const bool runs = by_runs(P, packed, bq);
  bool all_short = true;  // every tile by `forward_short_runs`, which checks the output rows
  KeyRun own[kRunGroup];  // where `runs`: each row's keys in the tile
  std::fill_n(W.row_max.begin(), bq, -std::numeric_limits<T>::infinity());
  std::fill_n(W.row_sum.begin(), bq, T(0));
  // only the keys of the queries' documents, where those are runs
  const auto [doc_begin, doc_end] = P.hiding.document_keys(b, i0, i1);
  const int64_t key_end = std::min(P.hiding.key_end(i1, P.lk), doc_end);
  bool first = true;
  for (int64_t jb = doc_begin / P.block_k * P.block_k; jb < key_end; jb += P.block_k) {
    if (!P.hiding.shares(b, i0 / P.block_q, jb, P.block_k)) continue;  // no visible pair
    // the tile from the first key of those documents on (packed keys: from its block's start,
    // the layout the packed products read)
    const int64_t j0 = packed.keys != nullptr ? jb : std::max(jb, doc_begin);
    const int64_t n = std::min(jb + P.block_k, key_end) - j0;
    const int64_t ld = packed.keys != nullptr ? round_up(n, kPackedKeys) : padded(n);
    T* s_tile = W.s.data();  // (bq, n) with rows ld apart
    if (runs) {
      for (int64_t r = 0; r < bq; ++r) own[r] = P.hiding.own_keys(b, i0 + r, j0, n);
      const int64_t q0 = P.q_rows.at(b, h, i0), ldq = P.q_rows.si, ldk = P.k_rows.si;
      if (short_runs(own, bq)) {  // each row start to end (short_runs.h)
        const ShortRowsState<T> state{W.row_max.data(), W.row_sum.data(), acc, ldo, first};
        if constexpr (std::is_same_v<T, float>) {
          if (P.bf16()) {
            forward_short_runs(P, b, h, i0, bq, own, P.q16 + q0, P.k16 + k0, P.v16 + v0, T(1),
                               scale, state);
          }
        }
        if (!P.bf16()) {
          forward_short_runs(P, b, h, i0, bq, own, P.q + q0, P.k + k0, P.v + v0, P.scale, T(1),
                             state);
        }
        first = false;
        continue;
      }
      all_short = false;
      if (P.bf16()) {
        scores_by_runs(own, bq, P.dim, T(1), P.q16 + q0, ldq, P.k16 + k0, ldk, s_tile, ld);
      } else {
        scores_by_runs(own, bq, P.dim, P.scale, P.q + q0, ldq, P.k + k0, ldk, s_tile, ld);
      }
    } else {
      scores(P, packed, P.q_rows.at(b, h, i0), k0, j0, bq, n, s_tile, ld);
    }
    if (P.nonfinite != nullptr) {
      if (runs) {  // products by loops: checked by their results, each row's own
        for (int64_t r = 0; r < bq; ++r) {
          flag_nonfinite(P, s_tile + r * ld, 1, own[r].second - own[r].first, ld);
        }
      } else if (P.direct) {
        flag_nonfinite(P, s_tile, bq, n, ld);
      } else {
        flag_operands(P, b, h, i0, bq, j0, n, first);
      }
    }
    bool rescale = false;
    for (int64_t r = 0; r < bq; ++r) {
      const int64_t i = i0 + r;
      T* s = s_tile + r * ld;
      const RowKeys keys = row_keys(P.hiding, b, h, i, j0, n, runs ? own + r : nullptr,
                                    W.flags.data());
      const int64_t row_j0 = keys.j0, row_n = keys.n, vis = keys.vis, span = keys.span;
      const uint8_t* flags = keys.flags;
      const T row_max = row_logits(P, W, b, h, i, row_j0, vis, span, flags, s, scale);
      const T* c = nullptr;
      if (P.gate.present()) {
        c = masked_gate_row(P.gate, b, h, i, row_j0, vis, span, flags, W.values.data());
      }
      const T* keep = nullptr;
      if (P.dropout.on) {
        P.dropout.row(P.counter(b, h, i, row_j0), span, P.kept, W.dropout.data());
        keep = W.dropout.data();
      }
      uint16_t* s16 = P.bf16() ? W.s16.data() + r * ld : nullptr;
      const T alpha = normalise_row(P, s, s16, vis, span, row_max, row0 + r, first,
                                    W.row_max[r], W.row_sum[r], c, keep);
      W.alpha[r] = alpha;
      rescale = rescale || alpha != T(1);
      if (span < row_n) {  // the keys past the causal edge (and an odd tile's pad for A V)
        if (s16 != nullptr) {
          std::fill(s16 + span, s16 + std::min(ld, round_up(row_n, 2)), uint16_t(0));
        } else {
          fill_row(s + span, T(0), row_n - span);
        }
      }
    }
    if (rescale && !first) {
      for (int64_t r = 0; r < bq; ++r) {
        const T alpha = W.alpha[r];
        if (alpha == T(1)) continue;
        T* row = acc + r * ldo;
#pragma omp simd
        for (int64_t e = 0; e < dv; ++e) row[e] *= alpha;
      }
    }
    if (runs) {
      const T beta = first ? T(0) : T(1);
      if (P.bf16()) {
        accumulate_by_runs(own, bq, dv, W.s16.data(), ld, P.v16 + v0, P.v_rows.si, beta, acc, ldo);
      } else {
        accumulate_by_runs(own, bq, dv, s_tile, ld, P.v + v0, P.v_rows.si, beta, acc, ldo);
      }
    } else {
      accumulate(P, W, packed, v0, j0, bq, n, s_tile, ld, first ? T(0) : T(1), acc, ldo);
    }
    first = false;
  }
  if (packed.values != nullptr) release_packed();
  if (first) {  // no key is visible to this block
    for (int64_t r = 0; r < bq; ++r) std::fill(acc + r * ldo, acc + r * ldo + dv, T(0));
  }
  for (int64_t r = 0; r < bq; ++r) {
    if (power == 0) {
      stat[row0 + r] = P.fixed[row0 + r];
      continue;
    }
    const T l = W.row_sum[r];
    const T norm = l > T(0) ? (power == 1 ? l : std::sqrt(l)) : T(1);
    T* row = acc + r * ldo;
    const T inv = T(1) / norm;
    if (inv != T(1)) {  // (l = 1: a row of one key, whose output row may have been streamed)
#pragma omp simd
      for (int64_t e = 0; e < dv; ++e) row[e] *= inv;
    }
    // l = 0: no weight (r = inf gives 0 again in the backward pass); l NaN: a NaN logit, for
    // which the backward pass takes the reference's arithmetic (`row_statistics`)
    // (log(1) = 0 exactly: a row of one visible key, or of one weight with the others 0)
    const T log_l = l == T(1) ? T(0) : std::log(l);
    stat[row0 + r] = l > T(0)    ? W.row_max[r] + log_l / T(power)
                     : l == T(0) ? std::numeric_limits<T>::infinity()
                                 : std::numeric_limits<T>::quiet_NaN();
  }
  if (P.nonfinite != nullptr && (P.direct || (runs && !all_short))) {
    flag_nonfinite(P, acc, bq, dv, ldo);
  }
}

}  // namespace

template <typename T>
void forward_loop(const Problem<T>& P, T* out, Rows out_rows, T* stat) {
  const int64_t bq = P.block_q, blocks = (P.lq + bq - 1) / bq;
  const int64_t count = P.batch * P.heads * blocks;
  const int64_t workers = workers_for(count, P.work(), P.lq);
  const PackedOperands packed = pack_operands(P);
  const int64_t keys = packed.keys ? round_up(P.tile_keys(), kPackedKeys) : P.tile_keys();
  const auto item = [&](ForwardScratch<T>& scratch, int64_t index) {
    // One (batch, head) after another, so that its keys and values stay in cache from one
    // query block to the next; within it the last query blocks first: under causal masking
    // they meet the most keys, and the small ones are left to fill in at the end.
    const int64_t bh = index / blocks, block = blocks - 1 - index % blocks;
    const int64_t b = bh / P.heads, h = bh % P.heads;
    const int64_t i0 = block * bq, i1 = std::min(P.lq, i0 + bq);
    for_query_groups(P.hiding, b, i0, i1, [&](int64_t g0, int64_t g1) {
      forward_item(P, scratch, packed.head(b * P.kv_heads + h / P.groups), b, h, g0, g1, out,
                   out_rows, stat);
    });
  };
  if (workers > 1 && few_query_rows(P.lq)) {
    // A decoding step: contiguous heads per thread, as ATen splits the cache's copy (torch.cat)
    // so each thread copies what it read here, not the other core's lines (BENCHMARKS.md, 42).
    at::parallel_for(0, count, 1, [&](int64_t begin, int64_t end) {
      const BlasThreadsGuard one_thread;
      ForwardScratch<T> scratch(P.tile_queries(), keys, P.bf16());
      for (int64_t index = begin; index < end; ++index) item(scratch, index);
    });
    return;
  }
  std::vector<std::unique_ptr<ForwardScratch<T>>> scratch(workers);
  run_items(count, workers, [&](int64_t worker, int64_t index) {
    if (!scratch[worker]) {
      scratch[worker] = std::make_unique<ForwardScratch<T>>(P.tile_queries(), keys, P.bf16());
    }
    item(*scratch[worker], index);
  }, false, chunk_for(count, workers, P.work()));
}

template void forward_loop<float>(const Problem<float>&, float*, Rows, float*);
template void forward_loop<double>(const Problem<double>&, double*, Rows, double*);

}  // namespace urpe_cpp
