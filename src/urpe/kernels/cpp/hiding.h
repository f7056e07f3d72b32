// Which pairs of a tile are hidden: causal masking, key padding, documents and a boolean
// attn_mask, and which tiles and keys a query block can skip (a packed row's padded tail).
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

namespace urpe_cpp {

// Causal masking hides a contiguous tail of each row segment; key padding, documents and a
// boolean attn_mask hide pairs entry by entry (flags).

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

}  // namespace urpe_cpp
