// bfloat16 keys and values packed once per forward call for the AMX kernel (loops.h), where the
// problem's products can use it: which calls pack, the packing itself, and each kv head's share.
#pragma once

#include <cstdint>
#include <memory>

#include "loops.h"

namespace urpe_cpp {

// A kv head's keys and values packed for the AMX kernel (loops.h), where they are.
struct PackedHead {
  const uint16_t* keys = nullptr;
  const uint16_t* values = nullptr;
};

// Query rows per kv head below which packing costs more than it saves (measured at Lk = 512
// to 2048, D = 64: the packed products win from about 256 rows on; a decoding step, one
// query, would take 2 to 4 times as long).
constexpr int64_t kPackedMinQueries = 256;

// Every kv head's keys, and its values, packed for the AMX kernel where the problem's bfloat16
// products can use it (key tiles of whole packed blocks) and enough queries read each key,
// else empty.
struct PackedOperands {
  std::unique_ptr<uint16_t[]> keys, values;  // left uninitialised: packing writes every entry
  int64_t keys_size = 0, values_size = 0;    // entries per kv head

  PackedHead head(int64_t kv) const {
    PackedHead packed;
    if (keys) packed.keys = keys.get() + kv * keys_size;
    if (values) packed.values = values.get() + kv * values_size;
    return packed;
  }
};

template <typename T>
PackedOperands pack_operands(const Problem<T>& P) {
  PackedOperands packed;
  if (!P.bf16() || P.block_k % kPackedKeys != 0 || P.lq * P.groups < kPackedMinQueries ||
      !packed_keys_available(P.dim)) {
    return packed;
  }
  const int64_t heads = P.batch * P.kv_heads;
  packed.keys_size = packed_keys_size(P.lk, P.dim);
  packed.keys.reset(new uint16_t[heads * packed.keys_size]);
  if (packed_values_available(P.vdim)) {
    packed.values_size = packed_values_size(P.lk, P.vdim);
    packed.values.reset(new uint16_t[heads * packed.values_size]);
  }
  const double work = static_cast<double>(heads) * P.lk * (P.dim + P.vdim);
  run_items(heads, workers_for(heads, work), [&](int64_t, int64_t kv) {
    const int64_t b = kv / P.kv_heads, hk = kv % P.kv_heads;
    pack_keys(P.k16 + P.k_rows.at(b, hk, 0), P.lk, P.dim, P.k_rows.si,
              packed.keys.get() + kv * packed.keys_size);
    if (packed.values) {
      pack_values(P.v16 + P.v_rows.at(b, hk, 0), P.lk, P.vdim, P.v_rows.si,
                  packed.values.get() + kv * packed.values_size);
    }
  });
  return packed;
}

}  // namespace urpe_cpp
