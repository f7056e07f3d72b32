// One row's products (a decoding step: one query against a head's cached keys and values) in
// AVX2 registers, for float. gemm.cpp's `direct` loops leave them to the compiler, which on
// AVX2 sums each dot product's lanes through the stack (about 90 instructions per 4 keys, as
// many as the products themselves) and loads and stores the output row once per 4 value rows;
// these take 8 keys' dot products at once and fold their lanes with 7 shuffled adds, and keep
// up to 64 output columns in registers over every value row (callgrind, one query, H = 8,
// Lk = 1024, D = 64: both products took 557k instructions by `direct`'s loops, issue 42).
// Every product is taken, as in `direct`: a NaN or inf in an operand reaches the result even
// through a zero factor.
#pragma once

#include <cstdint>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define URPE_AVX2_ROWS 1
#else
#define URPE_AVX2_ROWS 0
#endif

namespace urpe_cpp {

#if URPE_AVX2_ROWS

// the sum of x's 8 lanes
inline float lane_sum(__m256 x) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// lane r of the result: the sum of a_r's 8 lanes
inline __m256 lane_sums8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5,
                         __m256 a6, __m256 a7) {
  // each half of u0: the four-lane sums of a0..a3 (low half: lanes 0-3; high: lanes 4-7)
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// c[j] = alpha x . y_j (+ beta c[j] unless beta = 0: then c is not read) for the n rows y_j of
// k floats, ldy apart
inline void dots_avx2(int64_t n, int64_t k, float alpha, const float* x, const float* y,
                      int64_t ldy, float beta, float* c) {
  const int64_t k8 = k & ~int64_t{7};
  // the entries past the last whole 8 (D not a multiple of 8), added after the lanes
  auto tail = [&](const float* row) {
    float sum = 0.0f;
    for (int64_t e = k8; e < k; ++e) sum += x[e] * row[e];
    return sum;
  };
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const float* y0 = y + j * ldy;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0,
           a7 = a0;
    for (int64_t e = 0; e < k8; e += 8) {
      const __m256 xe = _mm256_loadu_ps(x + e);
      a0 = _mm256_fmadd_ps(xe, _mm256_loadu_ps(y0 + e), a0);
      a1 = _mm256_fmadd_ps(xe, _mm256_loadu_ps(y0 + ldy + e), a1);
      a2 = _mm256_fmadd_ps(xe, _mm256_loadu_ps(y0 + 2 * ldy + e), a2);
      a3 = _mm256_fmadd_ps(xe, _mm256_loadu_ps(y0 + 3 * ldy + e), a3);
      a4 = _mm256_fmadd_ps(xe, _mm256_loadu_ps(y0 + 4 * ldy + e), a4);
      a5 = _mm256_fmadd_ps(xe, _mm256_loadu_ps(y0 + 5 * ldy + e), a5);
      a6 = _mm256_fmadd_ps(xe, _mm256_loadu_ps(y0 + 6 * ldy + e), a6);
      a7 = _mm256_fmadd_ps(xe, _mm256_loadu_ps(y0 + 7 * ldy + e), a7);
    }
    __m256 sums = lane_sums8(a0, a1, a2, a3, a4, a5, a6, a7);
    if (k8 < k) {
      alignas(32) float rest[8];
      for (int64_t r = 0; r < 8; ++r) rest[r] = tail(y0 + r * ldy);
      sums = _mm256_add_ps(sums, _mm256_load_ps(rest));
    }
    sums = _mm256_mul_ps(sums, _mm256_set1_ps(alpha));
    if (beta != 0.0f) sums = _mm256_fmadd_ps(_mm256_set1_ps(beta), _mm256_loadu_ps(c + j), sums);
    _mm256_storeu_ps(c + j, sums);
  }
  for (; j < n; ++j) {
    const float* row = y + j * ldy;
    __m256 a = _mm256_setzero_ps();
    for (int64_t e = 0; e < k8; e += 8) {
      a = _mm256_fmadd_ps(_mm256_loadu_ps(x + e), _mm256_loadu_ps(row + e), a);
    }
    const float sum = alpha * (lane_sum(a) + tail(row));
    c[j] = beta == 0.0f ? sum : sum + beta * c[j];
  }
}

// c[0, 8 V) = beta c + sum_e w(e) y_e[0, 8 V) (beta = 0: c not read) over the k rows y_e, ldy
// apart; w(e): the weight of row e. The V vectors of c stay in registers over every row.
template <int V, typename Weight>
inline void columns_avx2(int64_t k, const Weight& w, const float* y, int64_t ldy, float beta,
                         float* c) {
  __m256 acc[V];
  for (int v = 0; v < V; ++v) {
    acc[v] = beta == 0.0f ? _mm256_setzero_ps()
                          : _mm256_mul_ps(_mm256_set1_ps(beta), _mm256_loadu_ps(c + 8 * v));
  }
  for (int64_t e = 0; e < k; ++e) {
    const __m256 we = _mm256_set1_ps(w(e));
    const float* row = y + e * ldy;
    for (int v = 0; v < V; ++v) acc[v] = _mm256_fmadd_ps(we, _mm256_loadu_ps(row + 8 * v), acc[v]);
  }
  for (int v = 0; v < V; ++v) _mm256_storeu_ps(c + 8 * v, acc[v]);
}

// c[0, n) = beta c + sum_e w(e) y_e[0, n) (beta = 0: c not read): 64 columns at a time, then
// what is left in eights, then one by one
template <typename Weight>
inline void weighted_rows_avx2(int64_t n, int64_t k, const Weight& w, const float* y,
                               int64_t ldy, float beta, float* c) {
  int64_t col = 0;
  for (; col + 64 <= n; col += 64) columns_avx2<8>(k, w, y + col, ldy, beta, c + col);
  switch ((n - col) / 8) {
    case 7: columns_avx2<7>(k, w, y + col, ldy, beta, c + col); break;
    case 6: columns_avx2<6>(k, w, y + col, ldy, beta, c + col); break;
    case 5: columns_avx2<5>(k, w, y + col, ldy, beta, c + col); break;
    case 4: columns_avx2<4>(k, w, y + col, ldy, beta, c + col); break;
    case 3: columns_avx2<3>(k, w, y + col, ldy, beta, c + col); break;
    case 2: columns_avx2<2>(k, w, y + col, ldy, beta, c + col); break;
    case 1: columns_avx2<1>(k, w, y + col, ldy, beta, c + col); break;
    default: break;
  }
  col += (n - col) / 8 * 8;
  for (; col < n; ++col) {
    float sum = 0.0f;
    for (int64_t e = 0; e < k; ++e) sum += w(e) * y[e * ldy + col];
    c[col] = beta == 0.0f ? sum : sum + beta * c[col];
  }
}

#endif

}  // namespace urpe_cpp
