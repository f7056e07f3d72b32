// The forward pass's two row loops (logits, weights) in AVX-512 registers for float, where the
// build targets AVX-512 (URPE_AVX512): forward.cpp's logits_loop and weights_loop otherwise.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define URPE_AVX512 1
#else
#define URPE_AVX512 0
#endif

#include "tile.h"

#if URPE_AVX512
namespace urpe_cpp {

// The weights loop in AVX-512 registers, 16 keys at a time. The compiler's vectorised
// exp_value costs about 50 instructions per 16 keys (clamps, 2^n as two factors, the final
// selects; 256-bit halves); exp16 takes 14 for exp_value's formula (the same rounding,
// reduction and polynomial, 2^n by scalef, exact: the same values) and special values: 0 below
// lo (-inf too), inf above hi, NaN kept. No clamp from below: whatever n and p are there, the
// mask writes 0.
inline __m512 exp16(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-87.33654475f);
  // past hi scalef overflows to inf; the clamp keeps x = inf from giving inf - inf = NaN.
  // min returns its second operand where either is NaN: a NaN x stays NaN.
  const __m512 xc = _mm512_min_ps(_mm512_set1_ps(100.0f), x);
  const __m512 magic = _mm512_set1_ps(12582912.0f);
  const __m512 n =
      _mm512_sub_ps(_mm512_fmadd_ps(xc, _mm512_set1_ps(1.44269504088896341f), magic), magic);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), xc);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  // kept: x >= lo, or NaN (unordered)
  return _mm512_maskz_scalef_ps(_mm512_cmp_ps_mask(x, lo, _CMP_NLT_UQ), p, n);
}

// 16 floats rounded to nearest even bfloat16, stored at dst
inline void store_bf16(uint16_t* dst, __m512 x) {
#if defined(__AVX512BF16__)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), (__m256i)_mm512_cvtneps_pbh(x));
#else
  __m512i bits = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  bits = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst),
                      _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16)));
#endif
}

// logits_loop (tile.h) for float: s = scale s + B + M, hidden pairs and those past `vis` at
// `hidden`; returns the row's max (NaN logits left out of it, as there)
template <bool SCALE, bool BIAS, bool MASK, bool FLAGS>
float logits_avx512(float* __restrict s, int64_t vis, int64_t span, float scale,
                    const float* __restrict bias, const float* __restrict mask,
                    const uint8_t* __restrict flags, float hidden) {
  const __m512 scale16 = _mm512_set1_ps(scale), hidden16 = _mm512_set1_ps(hidden);
  __m512 top = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < span; j += kLanes) {
    __m512 x = _mm512_loadu_ps(s + j);
    if constexpr (SCALE && BIAS) {
      x = _mm512_fmadd_ps(x, scale16, _mm512_loadu_ps(bias + j));
    } else if constexpr (SCALE) {
      x = _mm512_mul_ps(x, scale16);
    } else if constexpr (BIAS) {
      x = _mm512_add_ps(x, _mm512_loadu_ps(bias + j));
    }
    if constexpr (MASK) x = _mm512_add_ps(x, _mm512_loadu_ps(mask + j));
    const int64_t seen = std::min<int64_t>(vis - j, kLanes);
    __mmask16 shown = static_cast<__mmask16>((uint32_t{1} << seen) - 1);
    if constexpr (FLAGS) {
      const __m128i hides = _mm_loadu_si128(reinterpret_cast<const __m128i*>(flags + j));
      shown &= static_cast<__mmask16>(~_mm_test_epi8_mask(hides, hides));
    }
    x = _mm512_mask_blend_ps(shown, hidden16, x);
    _mm512_storeu_ps(s + j, x);
    top = _mm512_max_ps(x, top);  // x > top ? x : top: a NaN x leaves top
  }
  return _mm512_reduce_max_ps(top);
}

// weights_loop (forward.cpp) for float and an exp-based normalisation
template <int64_t NORM, bool GATE, bool DROPOUT, bool BF16>
float weights_avx512(float* __restrict s, uint16_t* __restrict s16, int64_t vis, int64_t span,
                     float shift, const float* __restrict c, const float* __restrict keep) {
  const __m512 shift16 = _mm512_set1_ps(shift);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < span; j += kLanes) {
    __m512 p = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + j), shift16));
    if constexpr (NORM == kSoftmax) sum = _mm512_add_ps(sum, p);
    if constexpr (NORM == kL2) sum = _mm512_fmadd_ps(p, p, sum);
    if constexpr (GATE) {  // the gate past the edge (0 < vis - j < 16) is not read
      const int64_t seen = std::min<int64_t>(vis - j, kLanes);
      const __mmask16 valid = static_cast<__mmask16>((uint32_t{1} << seen) - 1);
      p = _mm512_mul_ps(p, _mm512_maskz_loadu_ps(valid, c + j));
    }
    if constexpr (DROPOUT) p = _mm512_mul_ps(p, _mm512_loadu_ps(keep + j));
    if constexpr (BF16) {
      store_bf16(s16 + j, p);
    } else {
      _mm512_storeu_ps(s + j, p);
    }
  }
  return _mm512_reduce_add_ps(sum);
}

}  // namespace urpe_cpp
#endif
