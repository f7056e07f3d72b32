// The backward tile loop. Each tile is recomputed from the saved row statistic r_i:
//   S = scale Q K^T + B + M,  P = f(S, r),  dA = dropout(dO V^T),  A = dropout(P C),
//   dV += A^T dO,  dC = dA P,  dP = dA C,  dS = the normalisation's rule(dP, P, delta),
//   dQ += scale dS K,  dK += scale dS^T Q,  bias and float-mask gradients += dS,
// five products per tile and the rest per row while the tile is in cache; a group of queries
// in short documents takes its products query by query over each one's own keys instead
// (`scores_by_runs`).
//
// A work item owns what it writes: the rows of dQ of its query blocks, and dK, dV of its
// (batch, kv head) in its own split copy (zeroed by the item, summed by the caller). It covers
// every query head that reads the kv head (grouped queries) and, where a dense term's gradient
// broadcasts over the batch or the kv heads, all of those too, so no two items write one entry.
// Table gradients (Toeplitz, Relation) go to one copy per worker; under
// torch.use_deterministic_algorithms each worker takes a fixed share of the items, so those
// copies, and their sum, are the same on every run.
#include <ATen/Context.h>

#include "loops.h"
#include "short_runs.h"

namespace urpe_cpp {
namespace {

template <typename T>
struct BackwardScratch {
  std::vector<T> s, da, values, mask_values, dropout, dgate;
  std::vector<T> delta;  // the block's delta_i = sum_e dO_ie O_ie
  std::vector<T> stat;   // the block's r_i (`row_statistics`)
  std::vector<uint8_t> flags;
  std::vector<uint16_t> s16, da16;  // A and dS in bfloat16, for bfloat16 operands

  BackwardScratch(int64_t bq, int64_t bk, bool bf16)
      : s(bq * bk), da(bq * bk), values(bk), mask_values(bk), dropout(bk), dgate(bk), delta(bq),
        stat(bq), flags(bk), s16(bf16 ? bq * bk : 0), da16(bf16 ? bq * bk : 0) {}
};

// Everything per element of one row once P is known, in one pass: A = dropout(P C) (over s,
// unless A is P itself), dC = dA P (accumulated into dgate), dP = dA C, dS by the
// normalisation's rule (into da), dS accumulated into dbias.
// s: P, or relu(S) for relu2 (whose weight is relu^2 / n); da: dO v_j; c: the gate row with
// hidden pairs set to 0; keep: the dropout scale row.
// LANES: kLanes, or 1 for a short row (`whole_blocks`)
template <typename T, int64_t NORM, bool GATE, bool DROPOUT, bool DGATE, bool DBIAS,
          int64_t LANES>
void gradient_loop(int64_t vis, int64_t span, const T* __restrict c, const T* __restrict keep,
                   T* __restrict s, T* __restrict da, T* __restrict dgate, T* __restrict dbias,
                   T delta, T inv_n) {
  constexpr bool WRITE_A = GATE || DROPOUT || NORM == kRelu2;  // else A is P, already in s
  for (int64_t block = 0; block < span; block += LANES) {
#pragma omp simd
    for (int64_t lane = 0; lane < LANES; ++lane) {
      const int64_t j = block + lane;
      // past the causal edge (and the tile) every term is 0. Loads first, then selects: the
      // span is readable, and a load inside a condition would keep the loop from vectorising.
      const bool seen = j < vis;
      const T x = s[j];
      const T p = NORM == kRelu2 ? x * x * inv_n : x;
      const T da_j = da[j];
      T d = seen ? da_j : T(0);
      if constexpr (DROPOUT) d *= keep[j];
      T weight = p, dp = d;
      if constexpr (GATE) {
        const T c_j = c[j];
        const T cj = seen ? c_j : T(0);
        weight = p * cj;
        if constexpr (DGATE) dgate[j] += d * p;
        dp = d * cj;
      }
      if constexpr (DROPOUT) weight *= keep[j];
      T ds;
      if constexpr (NORM == kSoftmax) {
        ds = p * (dp - delta);
      } else if constexpr (NORM == kL2) {
        ds = (dp - p * delta) * p;
      } else if constexpr (NORM == kExp) {
        ds = p * dp;
      } else {  // relu's gradient is 0 where relu(s) = 0 (even times an inf or NaN dP)
        ds = x == T(0) ? T(0) : dp * x * (T(2) * inv_n);
      }
      da[j] = ds;
      if constexpr (DBIAS) dbias[j] += ds;
      if constexpr (WRITE_A) s[j] = weight;  // P is no longer needed: A takes its place
    }
  }
}

// The row's logits -> P (or relu(S) for relu2) in place over its span, from the saved
// statistic r (hidden logits give 0), LANES at a time (`gradient_loop`).
template <typename T, int64_t LANES>
void weights_by_lanes(bool relu, T* __restrict s, int64_t span, T r) {
  for (int64_t block = 0; block < span; block += LANES) {
    T* __restrict x = s + block;
    if (relu) {
#pragma omp simd  // (NaN stays NaN, as torch.relu keeps it)
      for (int64_t lane = 0; lane < LANES; ++lane) x[lane] = x[lane] < T(0) ? T(0) : x[lane];
    } else {
#pragma omp simd
      for (int64_t lane = 0; lane < LANES; ++lane) x[lane] = exp_value(x[lane] - r);
    }
  }
}

template <typename T>
void weights_row(const Problem<T>& P, T* s, int64_t span, T r) {
  if (whole_blocks(span)) return weights_by_lanes<T, kLanes>(P.norm == kRelu2, s, span, r);
  weights_by_lanes<T, 1>(P.norm == kRelu2, s, span, r);
}

// dS (and dC, where given) of a row's hidden pairs set to 0: those the flags hide and those
// from the causal edge `vis` to its span.
template <typename T>
void clear_hidden(int64_t vis, int64_t span, const uint8_t* flags, T* da, T* dgate) {
  for (int64_t j = 0; j < span; ++j) {
    if (j < vis && (flags == nullptr || !flags[j])) continue;
    da[j] = T(0);
    if (dgate != nullptr) dgate[j] = T(0);
  }
}

// One row of the tile after its logits: P, then A (over s), dS (over da) and the term gradients.
template <typename T>
void backward_row(const Problem<T>& P, const Gradients<T>& G, BackwardScratch<T>& W,
                  int64_t worker, int64_t b, int64_t h, int64_t i, int64_t j0, int64_t n,
                  int64_t vis, int64_t span, const uint8_t* flags, T* s, T* da, T r, T delta) {
  // A hidden pair has P = 0 and dP = 0, so dS = 0 (0 - delta) is 0 too, unless delta is inf or
  // NaN (an inf or NaN weight, or incoming gradient, in the row): then dS and dC of hidden pairs
  // are set to 0 after the loop, as the reference's masking gives them, and the term gradients
  // go through the buffers (rare: the usual row pays one test).
  const bool clear = !std::isfinite(delta);
  weights_row(P, s, span, r);
  const T* keep = nullptr;
  if (P.dropout.on) {
    P.dropout.row(P.counter(b, h, i, j0), span, P.kept, W.dropout.data());
    keep = W.dropout.data();
  }
  const T* c = nullptr;
  T* dgate = nullptr;
  if (P.gate.present()) {
    c = masked_gate_row(P.gate, b, h, i, j0, vis, span, flags, W.values.data());
    if (G.gate.present()) {
      dgate = clear ? nullptr : G.gate.row_target(worker, h, i, j0);
      if (dgate == nullptr) {  // not a Toeplitz table: gathered in a buffer, then added
        dgate = W.dgate.data();
        fill_row(dgate, T(0), span);
      }
    }
  }
  T* dbias = G.bias.present() && !clear ? G.bias.row_target(worker, h, i, j0) : nullptr;
  const T inv_n = P.norm == kRelu2 ? T(1) / r : T(1);
  with_norm(
      [&](auto norm) {
        with_flags(
            [&](auto gate, auto dropout, auto has_dgate, auto has_dbias, auto blocks) {
              gradient_loop<T, norm, gate, dropout, has_dgate, has_dbias, blocks ? kLanes : 1>(
                  vis, span, c, keep, s, da, dgate, dbias, delta, inv_n);
            },
            c != nullptr, keep != nullptr, dgate != nullptr, dbias != nullptr,
            whole_blocks(span));
      },
      P.norm);
  if (clear) clear_hidden(vis, span, flags, da, dgate);
  if (dgate == W.dgate.data()) G.gate.add(worker, b, h, i, j0, vis, dgate);
  if (G.bias.present() && dbias == nullptr) G.bias.add(worker, b, h, i, j0, vis, da);
  if (G.float_mask.present()) G.float_mask.add(worker, b, h, i, j0, vis, da);
  if (span < n) {  // the keys past the causal edge
    fill_row(da + span, T(0), n - span);
    fill_row(s + span, T(0), n - span);
  }
}

// Where a tile's products run query by query over the keys of its own document only (a run of
// keys), as the forward pass's `by_runs`: the rows of a group of kRunGroup queries
// (`for_query_groups`), whose short documents leave the group's tile mostly hidden pairs (one
// id per padded token: each query sees one key of the group's kRunGroup, and five BLAS calls
// on a 16 x 16 tile cost more than the few products they hold). `runs` holds each row's keys
// [lo, hi) in the tile (`Hiding::own_keys`); row r of S, dA, A and dS holds those keys from
// its start on (the row runs as a tile of its own keys), and the pairs its document hides add
// nothing to dQ, dK, dV.

// S (bq rows, ld apart) = scale Q K^T and dA = dO V^T by runs. q, dout: the block's first
// rows; k, v: the kv head's first rows (A: T, or bfloat16 bits).
template <typename T, typename A>
void scores_by_runs(const KeyRun* runs, int64_t bq, int64_t d, int64_t dv, T scale, const A* q,
                    int64_t ldq, const A* dout, int64_t ldo, const A* k, int64_t ldk, const A* v,
                    int64_t ldv, T* s, T* da, int64_t ld) {
  for (int64_t r = 0; r < bq; ++r) {
    const auto [lo, hi] = runs[r];
    T* s_row = s + r * ld - lo;
    T* da_row = da + r * ld - lo;
    for (int64_t j = lo; j < hi; ++j) {
      s_row[j] = scale * dot<T>(q + r * ldq, k + j * ldk, d);
      da_row[j] = dot<T>(dout + r * ldo, v + j * ldv, dv);
    }
  }
}

// dV += A^T dO, dQ (+)= scale dS K, dK += scale dS^T Q by runs, from A (in a) and dS (in ds);
// `rounded`: A and dS taken in bfloat16, as the products on bfloat16 operands take them. dq:
// the block's rows of dQ (overwritten where `first`); dk, dv_rows: the kv head's first rows.
template <typename T, typename A>
void gradients_by_runs(const KeyRun* runs, int64_t bq, int64_t d, int64_t dv, T scale,
                       bool rounded, const T* a, const T* ds, int64_t ld, const A* q, int64_t ldq,
                       const A* dout, int64_t ldo, const A* k, int64_t ldk, bool first, T* dq,
                       int64_t lddq, T* dk, int64_t lddk, T* dv_rows, int64_t lddv) {
  for (int64_t r = 0; r < bq; ++r) {
    const auto [lo, hi] = runs[r];
    T* dq_row = dq + r * lddq;
    if (first) std::fill(dq_row, dq_row + d, T(0));
    for (int64_t j = lo; j < hi; ++j) {
      T weight = a[r * ld + j - lo], grad = ds[r * ld + j - lo];
      if constexpr (std::is_same_v<T, float>) {
        if (rounded) {
          weight = bf16_value(bf16_bits(weight));
          grad = bf16_value(bf16_bits(grad));
        }
      }
      grad *= scale;
      add_scaled(dv_rows + j * lddv, weight, dout + r * ldo, dv);
      add_scaled(dk + j * lddk, grad, q + r * ldq, d);
      add_scaled(dq_row, grad, k + j * ldk, d);
    }
  }
}

// The tile's five products: S and dA before the rows, then with A (in s) and dS (in da)
// dV += A^T dO, dQ (+)= scale dS K, dK += scale dS^T Q. On T operands, or on the problem's
// bfloat16 ones with A and dS rounded to bfloat16 (as SDPA does; every sum stays float).
template <typename T>
struct TileProducts {
  const Problem<T>& P;
  const Gradients<T>& G;
  BackwardScratch<T>& W;
  // offsets of the block's first query row in q and dO, and of the kv head's first key in k
  // and v; rows lie the operands' row strides apart
  int64_t q0, o0, k0, v0, bq;

  // runs: each row's own keys where the products run by runs (`scores_by_runs`), else null
  void before(const KeyRun* runs, int64_t j0, int64_t n, T* s, T* da, int64_t ld) const {
    const int64_t d = P.dim, dv = P.vdim, ldq = P.q_rows.si, ldk = P.k_rows.si;
    const int64_t ldv = P.v_rows.si, ldo = G.grad_out_rows.si;
    if (runs != nullptr) {
      if constexpr (std::is_same_v<T, float>) {
        if (P.bf16()) {
          return scores_by_runs(runs, bq, d, dv, P.scale, P.q16 + q0, ldq, G.grad_out16 + o0,
                                ldo, P.k16 + k0, ldk, P.v16 + v0, ldv, s, da, ld);
        }
      }
      return scores_by_runs(runs, bq, d, dv, P.scale, P.q + q0, ldq, G.grad_out + o0, ldo,
                            P.k + k0, ldk, P.v + v0, ldv, s, da, ld);
    }
    if constexpr (std::is_same_v<T, float>) {
      if (P.bf16()) {
        gemm_nt(bq, n, d, P.scale, P.q16 + q0, ldq, P.k16 + k0 + j0 * ldk, ldk, 0.0f, s, ld);
        gemm_nt(bq, n, dv, 1.0f, G.grad_out16 + o0, ldo, P.v16 + v0 + j0 * ldv, ldv, 0.0f, da,
                ld);
        return;
      }
    }
    gemm_nt<T>(bq, n, d, P.scale, P.q + q0, ldq, P.k + k0 + j0 * ldk, ldk, T(0), s, ld);
    gemm_nt<T>(bq, n, dv, T(1), G.grad_out + o0, ldo, P.v + v0 + j0 * ldv, ldv, T(0), da, ld);
  }

  // dq: the block's rows of dQ; dk, dv_rows: the kv head's first rows of dK, dV
  void after(const KeyRun* runs, int64_t j0, int64_t n, const T* a, const T* ds, int64_t ld,
             bool first, T* dq, T* dk, T* dv_rows) const {
    const int64_t d = P.dim, dv = P.vdim, ldq = P.q_rows.si, ldk = P.k_rows.si;
    const int64_t ldo = G.grad_out_rows.si, lddq = G.dq_rows.si, lddk = G.dk_rows.si;
    const int64_t lddv = G.dv_rows.si;
    if (runs != nullptr) {
      if constexpr (std::is_same_v<T, float>) {
        if (P.bf16()) {
          return gradients_by_runs(runs, bq, d, dv, P.scale, true, a, ds, ld, P.q16 + q0, ldq,
                                   G.grad_out16 + o0, ldo, P.k16 + k0, ldk, first, dq, lddq, dk,
                                   lddk, dv_rows, lddv);
        }
      }
      return gradients_by_runs(runs, bq, d, dv, P.scale, false, a, ds, ld, P.q + q0, ldq,
                               G.grad_out + o0, ldo, P.k + k0, ldk, first, dq, lddq, dk, lddk,
                               dv_rows, lddv);
    }
    if constexpr (std::is_same_v<T, float>) {
      if (P.bf16()) {
        uint16_t* a16 = W.s16.data();
        uint16_t* ds16 = W.da16.data();
        to_bf16(a, a16, bq * ld);
        to_bf16(ds, ds16, bq * ld);
        gemm_tn(n, dv, bq, 1.0f, a16, ld, G.grad_out16 + o0, ldo, 1.0f, dv_rows + j0 * lddv,
                lddv);
        gemm_nn(bq, d, n, P.scale, ds16, ld, P.k16 + k0 + j0 * ldk, ldk, first ? 0.0f : 1.0f, dq,
                lddq);
        gemm_tn(n, d, bq, P.scale, ds16, ld, P.q16 + q0, ldq, 1.0f, dk + j0 * lddk, lddk);
        return;
      }
    }
    gemm_tn<T>(n, dv, bq, T(1), a, ld, G.grad_out + o0, ldo, T(1), dv_rows + j0 * lddv, lddv);
    gemm_nn<T>(bq, d, n, P.scale, ds, ld, P.k + k0 + j0 * ldk, ldk, first ? T(0) : T(1), dq,
               lddq);
    gemm_tn<T>(n, d, bq, P.scale, ds, ld, P.q + q0, ldq, T(1), dk + j0 * lddk, lddk);
  }
};

// delta_i = sum_e dO_ie O_ie of the block's rows into W.delta (here, while the rows are in
// cache, rather than as two passes over (B, H, Lq, Dv) before the call)
template <typename T>
void row_deltas(const Problem<T>& P, const Gradients<T>& G, BackwardScratch<T>& W, int64_t b,
                int64_t h, int64_t i0, int64_t bq) {
  const int64_t dv = P.vdim;
  for (int64_t r = 0; r < bq; ++r) {
    const T* out = G.out + G.out_rows.at(b, h, i0 + r);
    const int64_t at = G.grad_out_rows.at(b, h, i0 + r);
    T sum = T(0);
    if (G.grad_out16 != nullptr) {
      const uint16_t* grad = G.grad_out16 + at;
#pragma omp simd reduction(+ : sum)
      for (int64_t e = 0; e < dv; ++e) sum += static_cast<T>(bf16_value(grad[e])) * out[e];
    } else {
      const T* grad = G.grad_out + at;
#pragma omp simd reduction(+ : sum)
      for (int64_t e = 0; e < dv; ++e) sum += grad[e] * out[e];
    }
    W.delta[r] = sum;
  }
}

// r_i and delta_i of the block's rows into W.stat, W.delta. A softmax or l2 row whose
// normaliser was NaN (a NaN logit; the forward pass saved r = NaN) is taken as the reference
// takes it (normalization.py): its denominator replaced by 1 and its shift by 0, so that
// a_ij = exp(s_ij) with no gradient through the denominator: r = 0, delta = 0.
template <typename T>
void row_statistics(const Problem<T>& P, const Gradients<T>& G, BackwardScratch<T>& W,
                    int64_t b, int64_t h, int64_t i0, int64_t bq) {
  row_deltas(P, G, W, b, h, i0, bq);
  const T* stat = G.stat + (b * P.heads + h) * P.lq + i0;
  const bool running = P.power() != 0;
  for (int64_t r = 0; r < bq; ++r) {
    const bool nan_row = running && std::isnan(stat[r]);
    W.stat[r] = nan_row ? T(0) : stat[r];
    if (nan_row) W.delta[r] = T(0);
  }
}

// One query block of one query head against its visible keys; the keys' gradients go to the
// item's dK, dV copies that `zeroed` holds.
template <typename T>
void backward_block(const Problem<T>& P, const Gradients<T>& G, BackwardScratch<T>& W,
                    ZeroedKeys<T>& zeroed, int64_t worker, int64_t b, int64_t h, int64_t i0,
                    int64_t i1) {
  const int64_t bq = i1 - i0, d = P.dim, hk = h / P.groups;
  const TileProducts<T> products{P,
                                 G,
                                 W,
                                 P.q_rows.at(b, h, i0),
                                 G.grad_out_rows.at(b, h, i0),
                                 P.k_rows.at(b, hk, 0),
                                 P.v_rows.at(b, hk, 0),
                                 bq};
  T* dq = G.dq + G.dq_rows.at(b, h, i0);
  // only the keys of the queries' documents, where those are runs
  const auto [doc_begin, doc_end] = P.hiding.document_keys(b, i0, i1);
  const int64_t key_end = std::min(P.hiding.key_end(i1, P.lk), doc_end);
  const bool by_runs = bq <= kRunGroup && !P.hiding.run_begin.empty();
  KeyRun runs[kRunGroup];
  bool first = true;
  for (int64_t jb = doc_begin / P.block_k * P.block_k; jb < key_end; jb += P.block_k) {
    if (!P.hiding.shares(b, i0 / P.block_q, jb, P.block_k)) continue;  // no visible pair
    // with the block's first computed tile: a block that sees no key (a padded tail) never
    // reads its rows of O and dO
    if (first) row_statistics(P, G, W, b, h, i0, bq);
    const int64_t j0 = std::max(jb, doc_begin);
    const int64_t n = std::min(jb + P.block_k, key_end) - j0, ld = padded(n);
    T* s_tile = W.s.data();  // (bq, n) with rows ld apart, as da_tile
    T* da_tile = W.da.data();
    if (by_runs) {
      for (int64_t r = 0; r < bq; ++r) runs[r] = P.hiding.own_keys(b, i0 + r, j0, n);
      if (short_runs(runs, bq)) {  // each row start to end (short_runs.h)
        const ShortRowsGrads<T> grads{dq,     W.stat.data(), W.delta.data(),
                                      worker, first,         &zeroed,
                                      G.out + G.out_rows.at(b, h, i0 + bq),
                                      G.out_rows.si};
        const TileProducts<T>& at = products;
        if constexpr (std::is_same_v<T, float>) {
          if (P.bf16()) {
            backward_short_runs(P, G, b, h, i0, bq, runs, P.q16 + at.q0, G.grad_out16 + at.o0,
                                P.k16 + at.k0, P.v16 + at.v0, grads);
          }
        }
        if (!P.bf16()) {
          backward_short_runs(P, G, b, h, i0, bq, runs, P.q + at.q0, G.grad_out + at.o0,
                              P.k + at.k0, P.v + at.v0, grads);
        }
        first = false;
        continue;
      }
    }
    zeroed.up_to(key_end);  // (the block's tiles write keys [doc_begin, key_end) at most)
    const KeyRun* own = by_runs ? runs : nullptr;
    products.before(own, j0, n, s_tile, da_tile, ld);
    for (int64_t r = 0; r < bq; ++r) {
      const int64_t i = i0 + r;
      T* s = s_tile + r * ld;
      const RowKeys keys = row_keys(P.hiding, b, h, i, j0, n, by_runs ? runs + r : nullptr,
                                    W.flags.data());
      logits_row(P, W.values.data(), W.mask_values.data(), b, h, i, keys.j0, keys.vis, keys.span,
                 keys.flags, s);
      backward_row(P, G, W, worker, b, h, i, keys.j0, keys.n, keys.vis, keys.span, keys.flags, s,
                   da_tile + r * ld, W.stat[r], W.delta[r]);
    }
    products.after(own, j0, n, s_tile, da_tile, ld, first, dq, zeroed.dk, zeroed.dv);
    first = false;
  }
  if (first) {  // no key is visible to this block
    for (int64_t r = 0; r < bq; ++r) {
      T* row = dq + r * G.dq_rows.si;
      std::fill(row, row + d, T(0));
    }
  }
}

}  // namespace

template <typename T>
void backward_loop(const Problem<T>& P, const Gradients<T>& G) {
  const int64_t bq = P.block_q, blocks = (P.lq + bq - 1) / bq;
  const int64_t batch_items = G.serial_batch ? 1 : P.batch;
  const int64_t head_items = G.serial_heads ? 1 : P.kv_heads;
  const int64_t per_split = (blocks + G.splits - 1) / G.splits;
  const int64_t count = batch_items * head_items * G.splits;
  const int64_t workers = workers_for(count, P.work(), P.lq);
  std::vector<std::unique_ptr<BackwardScratch<T>>> scratch(workers);
  run_items(count, workers, [&](int64_t worker, int64_t index) {
    if (!scratch[worker]) {
      scratch[worker] =
          std::make_unique<BackwardScratch<T>>(P.tile_queries(), P.tile_keys(), P.bf16());
    }
    // the last split first: under causal masking its query blocks meet the most keys
    const int64_t split = G.splits - 1 - index % G.splits;
    const int64_t bh = index / G.splits;
    const int64_t b_item = bh / head_items, hk_item = bh % head_items;
    const int64_t b_begin = G.serial_batch ? 0 : b_item;
    const int64_t b_end = G.serial_batch ? P.batch : b_item + 1;
    const int64_t hk_begin = G.serial_heads ? 0 : hk_item;
    const int64_t hk_end = G.serial_heads ? P.kv_heads : hk_item + 1;
    const int64_t block_begin = split * per_split;
    const int64_t block_end = std::min(blocks, block_begin + per_split);
    for (int64_t b = b_begin; b < b_end; ++b) {
      for (int64_t hk = hk_begin; hk < hk_end; ++hk) {
        ZeroedKeys<T> zeroed(P, G, split, b, hk);
        for (int64_t h = hk * P.groups; h < (hk + 1) * P.groups; ++h) {
          for (int64_t block = block_begin; block < block_end; ++block) {
            const int64_t i0 = block * bq, i1 = std::min(P.lq, i0 + bq);
            for_query_groups(P.hiding, b, i0, i1, [&](int64_t g0, int64_t g1) {
              backward_block(P, G, *scratch[worker], zeroed, worker, b, h, g0, g1);
            });
          }
        }
        zeroed.rest();
      }
    }
  }, at::globalContext().deterministicAlgorithms(), chunk_for(count, workers, P.work()));
}

template void backward_loop<float>(const Problem<float>&, const Gradients<float>&);
template void backward_loop<double>(const Problem<double>&, const Gradients<double>&);

}  // namespace urpe_cpp
