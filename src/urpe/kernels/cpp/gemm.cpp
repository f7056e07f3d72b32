// Matrix products on row-major blocks, and the worker count.
//
// A row-major (m x n) matrix is a column-major (n x m) one, so C = op(A) op(B) is the BLAS call
// C^T = op(B)^T op(A)^T with the operands swapped. The Fortran BLAS symbols are declared weak:
// where the torch build exports them (Linux wheels link MKL or OpenBLAS into libtorch_cpu),
// they are called directly, as ATen's own CPU flash attention does; elsewhere the weak symbol
// is null and the product goes through at::mm on tensors viewing the same memory (a few
// microseconds more per call).
#include <ATen/ATen.h>

#include "loops.h"
#include "rows_avx2.h"

#if __has_include(<ATen/native/CPUBlas.h>)
#include <ATen/native/CPUBlas.h>
#endif
#if defined(CPUBLAS_BRGEMM_BF16BF16F32)
#define URPE_BRGEMM 1
#else
#define URPE_BRGEMM 0
#endif

#if defined(__ELF__)
#define URPE_WEAK_BLAS 1
extern "C" {
void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k,
            const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
            const float* beta, float* c, const int* ldc) __attribute__((weak));
void dgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k,
            const double* alpha, const double* a, const int* lda, const double* b,
            const int* ldb, const double* beta, double* c, const int* ldc) __attribute__((weak));
void gemm_bf16bf16f32_(const char* transa, const char* transb, const int* m, const int* n,
                       const int* k, const float* alpha, const uint16_t* a, const int* lda,
                       const uint16_t* b, const int* ldb, const float* beta, float* c,
                       const int* ldc) __attribute__((weak));
int MKL_Set_Num_Threads_Local(int threads) __attribute__((weak));  // MKL's C name
}
#else
#define URPE_WEAK_BLAS 0
#endif

namespace urpe_cpp {
namespace {

// A product's sizes as the Fortran interface takes them (leading dimensions at least 1).
struct Fortran {
  int m, n, k, lda, ldb, ldc;
  Fortran(int64_t m_, int64_t n_, int64_t k_, int64_t lda_, int64_t ldb_, int64_t ldc_)
      : m(static_cast<int>(m_)), n(static_cast<int>(n_)), k(static_cast<int>(k_)),
        lda(static_cast<int>(std::max<int64_t>(lda_, 1))),
        ldb(static_cast<int>(std::max<int64_t>(ldb_, 1))),
        ldc(static_cast<int>(std::max<int64_t>(ldc_, 1))) {}
};

// The column-major BLAS routine for these operands, if the torch build exports it.
template <typename T>
bool blas_call(char ta, char tb, int64_t m, int64_t n, int64_t k, T alpha, const T* a,
               int64_t lda, const T* b, int64_t ldb, T beta, T* c, int64_t ldc) {
#if URPE_WEAK_BLAS
  const Fortran f(m, n, k, lda, ldb, ldc);
  if constexpr (std::is_same_v<T, float>) {
    if (sgemm_ == nullptr) return false;
    sgemm_(&ta, &tb, &f.m, &f.n, &f.k, &alpha, a, &f.lda, b, &f.ldb, &beta, c, &f.ldc);
    return true;
  } else {
    if (dgemm_ == nullptr) return false;
    dgemm_(&ta, &tb, &f.m, &f.n, &f.k, &alpha, a, &f.lda, b, &f.ldb, &beta, c, &f.ldc);
    return true;
  }
#else
  return false;
#endif
}

bool blas_call(char ta, char tb, int64_t m, int64_t n, int64_t k, float alpha, const uint16_t* a,
               int64_t lda, const uint16_t* b, int64_t ldb, float beta, float* c, int64_t ldc) {
#if URPE_WEAK_BLAS
  if (gemm_bf16bf16f32_ == nullptr) return false;
  const Fortran f(m, n, k, lda, ldb, ldc);
  gemm_bf16bf16f32_(&ta, &tb, &f.m, &f.n, &f.k, &alpha, a, &f.lda, b, &f.ldb, &beta, c, &f.ldc);
  return true;
#else
  return false;
#endif
}

template <typename T>
at::Tensor view(const T* data, int64_t rows, int64_t cols, int64_t ld) {
  return at::from_blob(const_cast<T*>(data), {rows, cols}, {ld, 1},
                       at::TensorOptions().dtype(c10::CppTypeToScalarType<T>::value));
}

// C (m x n, row-major) = alpha * op_a * op_b + beta * C, op_a and op_b given as tensors
template <typename T>
void aten_call(const at::Tensor& op_a, const at::Tensor& op_b, T alpha, T beta, T* c,
               int64_t m, int64_t n, int64_t ldc) {
  at::Tensor out = view(c, m, n, ldc);
  if (beta == T(0)) {
    at::mm_out(out, op_a, op_b);
    if (alpha != T(1)) out.mul_(alpha);
  } else {
    out.addmm_(op_a, op_b, beta, alpha);
  }
}

// C = beta * C: the product of an empty inner dimension (D = 0) is 0
template <typename T>
void scale_only(int64_t m, int64_t n, T beta, T* c, int64_t ldc) {
  for (int64_t r = 0; r < m; ++r) {
    T* row = c + r * ldc;
    for (int64_t e = 0; e < n; ++e) row[e] = beta == T(0) ? T(0) : beta * row[e];
  }
}

// The same product by loops, for T operands, or bfloat16 ones (A = uint16_t, T = float: each
// operand exact in float, sums in float, as BLAS's bf16 x bf16 -> f32 routine). Row-major:
// op(A) is (m x k), op(B) is (k x n). a_t: A is stored (k x m) (gemm_tn); b_t: B is stored (n x k) (gemm_nt). beta = 0 overwrites C
// without reading it, as BLAS does.
template <typename T, typename A = T>
void direct(bool a_t, bool b_t, int64_t m, int64_t n, int64_t k, T alpha, const A* a,
            int64_t lda, const A* b, int64_t ldb, T beta, T* c, int64_t ldc) {
#if URPE_AVX2_ROWS
  if constexpr (std::is_same_v<T, float> && std::is_same_v<A, float>) {
    for (int64_t r = 0; r < m; ++r) {
      if (b_t) {
        dots_avx2(n, k, alpha, a + r * lda, b, ldb, beta, c + r * ldc);
      } else {
        const auto weight = [&](int64_t e) { return alpha * (a_t ? a[e * lda + r] : a[r * lda + e]); };
        weighted_rows_avx2(n, k, weight, b, ldb, beta, c + r * ldc);
      }
    }
    return;
  }
#endif
  for (int64_t r = 0; r < m; ++r) {
    T* __restrict row = c + r * ldc;
    if (b_t) {  // C[r, j] = A[r, :] . B[j, :]
      const A* __restrict x = a + r * lda;
      auto put = [&](int64_t j, T sum) {
        row[j] = beta == T(0) ? alpha * sum : alpha * sum + beta * row[j];
      };
      int64_t j = 0;
      // four rows of B at a time: four independent sums, each entry of x loaded once
      for (; j + 4 <= n; j += 4) {
        const A* __restrict y0 = b + j * ldb;
        const A* __restrict y1 = y0 + ldb;
        const A* __restrict y2 = y1 + ldb;
        const A* __restrict y3 = y2 + ldb;
        T s0 = 0, s1 = 0, s2 = 0, s3 = 0;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
        for (int64_t e = 0; e < k; ++e) {
          s0 += value<T>(x[e]) * value<T>(y0[e]);
          s1 += value<T>(x[e]) * value<T>(y1[e]);
          s2 += value<T>(x[e]) * value<T>(y2[e]);
          s3 += value<T>(x[e]) * value<T>(y3[e]);
        }
        put(j, s0);
        put(j + 1, s1);
        put(j + 2, s2);
        put(j + 3, s3);
      }
      for (; j < n; ++j) {
        const A* __restrict y = b + j * ldb;
        T sum = 0;
#pragma omp simd reduction(+ : sum)
        for (int64_t e = 0; e < k; ++e) sum += value<T>(x[e]) * value<T>(y[e]);
        put(j, sum);
      }
      continue;
    }
    if (beta == T(0)) {
      std::fill(row, row + n, T(0));
    } else if (beta != T(1)) {
      for (int64_t j = 0; j < n; ++j) row[j] *= beta;
    }
    int64_t e = 0;
    // four rows of B at a time (one load and store of C's row per four): a decoding step's
    // output row against its cached values
    for (; !a_t && e + 4 <= k; e += 4) {
      const A* __restrict xs = a + r * lda + e;
      const T x0 = alpha * value<T>(xs[0]), x1 = alpha * value<T>(xs[1]);
      const T x2 = alpha * value<T>(xs[2]), x3 = alpha * value<T>(xs[3]);
      const A* __restrict y0 = b + e * ldb;
      const A* __restrict y1 = y0 + ldb;
      const A* __restrict y2 = y1 + ldb;
      const A* __restrict y3 = y2 + ldb;
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) {
        row[j] += (x0 * value<T>(y0[j]) + x1 * value<T>(y1[j])) +
                  (x2 * value<T>(y2[j]) + x3 * value<T>(y3[j]));
      }
    }
    for (; e < k; ++e) {  // C[r, :] += alpha op(A)[r, e] B[e, :]
      const T x = alpha * value<T>(a_t ? a[e * lda + r] : a[r * lda + e]);
      const A* __restrict y = b + e * ldb;
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) row[j] += x * value<T>(y[j]);
    }
  }
}

// Row-major C (m x n) = alpha op(A) op(B) + beta C through the column-major routine, called
// as (ta, tb) with the operands swapped; `fallback` where BLAS is not there.
template <typename A, typename C, typename Fallback>
void product(char ta, char tb, int64_t m, int64_t n, int64_t k, C alpha, const A* a,
             int64_t lda, const A* b, int64_t ldb, C beta, C* c, int64_t ldc,
             const Fallback& fallback) {
  if (m == 0 || n == 0) return;
  if (k == 0) return scale_only(m, n, beta, c, ldc);
  if constexpr (std::is_same_v<A, C>) {
    if (product_by_loops(m, n, k)) {
      // (ta, tb) name the swapped column-major call: 'T' for ta means B is stored (n x k)
      return direct<C>(tb == 'T', ta == 'T', m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    }
  }
  if (blas_call(ta, tb, n, m, k, alpha, b, ldb, a, lda, beta, c, ldc)) return;
  fallback();
}

}  // namespace

template <typename T>
void gemm_nt(int64_t m, int64_t n, int64_t k, T alpha, const T* a, int64_t lda, const T* b,
             int64_t ldb, T beta, T* c, int64_t ldc) {
  product('T', 'N', m, n, k, alpha, a, lda, b, ldb, beta, c, ldc, [&] {
    aten_call<T>(view(a, m, k, lda), view(b, n, k, ldb).t(), alpha, beta, c, m, n, ldc);
  });
}

template <typename T>
void gemm_nn(int64_t m, int64_t n, int64_t k, T alpha, const T* a, int64_t lda, const T* b,
             int64_t ldb, T beta, T* c, int64_t ldc) {
  product('N', 'N', m, n, k, alpha, a, lda, b, ldb, beta, c, ldc, [&] {
    aten_call<T>(view(a, m, k, lda), view(b, k, n, ldb), alpha, beta, c, m, n, ldc);
  });
}

template <typename T>
void gemm_tn(int64_t m, int64_t n, int64_t k, T alpha, const T* a, int64_t lda, const T* b,
             int64_t ldb, T beta, T* c, int64_t ldc) {
  product('N', 'T', m, n, k, alpha, a, lda, b, ldb, beta, c, ldc, [&] {
    aten_call<T>(view(a, k, m, lda).t(), view(b, k, n, ldb), alpha, beta, c, m, n, ldc);
  });
}

template <typename T>
void rows_nt(int64_t m, int64_t n, int64_t k, T alpha, const T* a, int64_t lda, const T* b,
             int64_t ldb, T* c, int64_t ldc) {
  direct<T>(false, true, m, n, k, alpha, a, lda, b, ldb, T(0), c, ldc);
}

template <typename T>
void rows_nn(int64_t m, int64_t n, int64_t k, const T* a, int64_t lda, const T* b, int64_t ldb,
             T beta, T* c, int64_t ldc) {
  direct<T>(false, false, m, n, k, T(1), a, lda, b, ldb, beta, c, ldc);
}

#define URPE_GEMMS(T)                                                                         \
  template void gemm_nt<T>(int64_t, int64_t, int64_t, T, const T*, int64_t, const T*, int64_t, \
                           T, T*, int64_t);                                                    \
  template void gemm_nn<T>(int64_t, int64_t, int64_t, T, const T*, int64_t, const T*, int64_t, \
                           T, T*, int64_t);                                                    \
  template void gemm_tn<T>(int64_t, int64_t, int64_t, T, const T*, int64_t, const T*, int64_t, \
                           T, T*, int64_t);                                                    \
  template void rows_nt<T>(int64_t, int64_t, int64_t, T, const T*, int64_t, const T*, int64_t, \
                           T*, int64_t);                                                       \
  template void rows_nn<T>(int64_t, int64_t, int64_t, const T*, int64_t, const T*, int64_t, T, \
                           T*, int64_t);
URPE_GEMMS(float)
URPE_GEMMS(double)

void rows_nt(int64_t m, int64_t n, int64_t k, float alpha, const uint16_t* a, int64_t lda,
             const uint16_t* b, int64_t ldb, float* c, int64_t ldc) {
  direct<float, uint16_t>(false, true, m, n, k, alpha, a, lda, b, ldb, 0.0f, c, ldc);
}

void rows_nn(int64_t m, int64_t n, int64_t k, const uint16_t* a, int64_t lda, const uint16_t* b,
             int64_t ldb, float beta, float* c, int64_t ldc) {
  direct<float, uint16_t>(false, false, m, n, k, 1.0f, a, lda, b, ldb, beta, c, ldc);
}

bool bf16_products() {
#if URPE_WEAK_BLAS
  return gemm_bf16bf16f32_ != nullptr;
#else
  return false;
#endif
}

// bfloat16 operands: only BLAS's routine (the callers check `bf16_products()` first)
namespace {
const auto no_bf16_fallback = [] {
  TORCH_CHECK(false, "urpe_cpp: this torch build has no bf16 x bf16 -> f32 BLAS");
};
}  // namespace

void gemm_nt(int64_t m, int64_t n, int64_t k, float alpha, const uint16_t* a, int64_t lda,
             const uint16_t* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  product('T', 'N', m, n, k, alpha, a, lda, b, ldb, beta, c, ldc, no_bf16_fallback);
}

void gemm_nn(int64_t m, int64_t n, int64_t k, float alpha, const uint16_t* a, int64_t lda,
             const uint16_t* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  product('N', 'N', m, n, k, alpha, a, lda, b, ldb, beta, c, ldc, no_bf16_fallback);
}

void gemm_tn(int64_t m, int64_t n, int64_t k, float alpha, const uint16_t* a, int64_t lda,
             const uint16_t* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  product('N', 'T', m, n, k, alpha, a, lda, b, ldb, beta, c, ldc, no_bf16_fallback);
}

// Packed operands: bfloat16 pairs along the product's inner dimension side by side (the
// kernel's VNNI layout, (K/2, N, 2) for a K x N operand, as cpublas::pack writes it), so each
// 32-bit word holds two consecutive inner entries of one column.
bool packed_keys_available(int64_t d) {
#if URPE_BRGEMM
  static const bool amx = at::native::cpublas::could_pack(at::kBFloat16);
  return amx && d % 2 == 0 && d > 0;
#else
  return false;
#endif
}

int64_t packed_keys_size(int64_t lk, int64_t d) {
  return (lk + kPackedKeys - 1) / kPackedKeys * kPackedKeys * d;
}

// Keys: per block of kPackedKeys keys, K^T (d x kPackedKeys), word (e, j) = k[j, 2e .. 2e + 1]:
// a transpose of the block's 32-bit words.
void pack_keys(const uint16_t* k, int64_t lk, int64_t d, int64_t ldk, uint16_t* packed) {
  const int64_t words = d / 2;
  for (int64_t j0 = 0; j0 < lk; j0 += kPackedKeys) {
    const int64_t n = std::min(kPackedKeys, lk - j0);
    uint32_t* out = reinterpret_cast<uint32_t*>(packed + j0 * d);
    for (int64_t e = 0; e < words; ++e) {
      uint32_t* row = out + e * kPackedKeys;
      for (int64_t j = 0; j < n; ++j) std::memcpy(row + j, k + (j0 + j) * ldk + 2 * e, 4);
      std::fill(row + n, row + kPackedKeys, 0u);
    }
  }
}

bool packed_values_available(int64_t dv) {
  return packed_keys_available(2) && dv % 16 == 0 && dv > 0;
}

int64_t packed_values_size(int64_t lk, int64_t dv) { return packed_keys_size(lk, dv); }

// Values: column block `col0` (width w <= kPackedKeys) starts at col0 * width (keys rounded up
// to whole blocks); in it word (p, c) = (v[2p, col0 + c], v[2p + 1, col0 + c]).
void pack_values(const uint16_t* v, int64_t lk, int64_t dv, int64_t ldv, uint16_t* packed) {
  const int64_t width = (lk + kPackedKeys - 1) / kPackedKeys * kPackedKeys;
  for (int64_t col0 = 0; col0 < dv; col0 += kPackedKeys) {
    const int64_t w = std::min(kPackedKeys, dv - col0);
    uint16_t* block = packed + col0 * width;
    for (int64_t j = 0; j < width; j += 2) {
      uint16_t* __restrict out = block + j * w;
      if (j + 1 < lk) {
        const uint16_t* __restrict even = v + j * ldv + col0;
        const uint16_t* __restrict odd = even + ldv;
        for (int64_t c = 0; c < w; ++c) {
          out[2 * c] = even[c];
          out[2 * c + 1] = odd[c];
        }
        continue;
      }
      std::fill(out, out + 2 * w, uint16_t(0));  // past the last key
      if (j < lk) {
        for (int64_t c = 0; c < w; ++c) out[2 * c] = v[j * ldv + col0 + c];
      }
    }
  }
}

void gemm_nt_packed(int64_t m, int64_t n, int64_t d, const uint16_t* q, int64_t ldq,
                    const uint16_t* packed, float* s, int64_t ld) {
#if URPE_BRGEMM
  const auto* a = reinterpret_cast<const at::BFloat16*>(q);
  for (int64_t j0 = 0; j0 < n; j0 += kPackedKeys) {
    const auto* b = reinterpret_cast<const at::BFloat16*>(packed + j0 * d);
    at::native::cpublas::brgemm(m, kPackedKeys, d, ldq, kPackedKeys, ld, false, a, b, s + j0);
  }
#else
  TORCH_CHECK(false, "urpe_cpp: no packed bf16 kernel in this build");
#endif
}

void gemm_nn_packed(int64_t m, int64_t n, int64_t dv, const uint16_t* a, int64_t ld,
                    const uint16_t* packed, int64_t lk, int64_t j0, bool add, float* acc,
                    int64_t ldc) {
#if URPE_BRGEMM
  const int64_t width = (lk + kPackedKeys - 1) / kPackedKeys * kPackedKeys;
  const int64_t k = (n + 1) / 2 * 2;  // pairs of keys
  const auto* weights = reinterpret_cast<const at::BFloat16*>(a);
  for (int64_t col0 = 0; col0 < dv; col0 += kPackedKeys) {
    const int64_t w = std::min(kPackedKeys, dv - col0);
    const auto* b = reinterpret_cast<const at::BFloat16*>(packed + col0 * width + j0 * w);
    at::native::cpublas::brgemm(m, w, k, ld, w, ldc, add, weights, b, acc + col0);
  }
#else
  TORCH_CHECK(false, "urpe_cpp: no packed bf16 kernel in this build");
#endif
}

void release_packed() {
#if URPE_BRGEMM
  at::native::cpublas::brgemm_release();
#endif
}

const char* gemm_route() {
#if URPE_WEAK_BLAS
  if (sgemm_ != nullptr && dgemm_ != nullptr) return "blas";
#endif
  return "aten";
}

BlasThreadsGuard::BlasThreadsGuard() {
#if URPE_WEAK_BLAS
  if (MKL_Set_Num_Threads_Local != nullptr) previous_ = MKL_Set_Num_Threads_Local(1);
#endif
}

BlasThreadsGuard::~BlasThreadsGuard() {
#if URPE_WEAK_BLAS
  if (MKL_Set_Num_Threads_Local != nullptr && previous_ >= 0) {
    MKL_Set_Num_Threads_Local(previous_);
  }
#endif
}

// Up to this many multiply-adds (about 20 us on one core) a second thread's wake-up and the
// shared counter cost more than they save, and make the time jump with the scheduler.
constexpr double kSerialWork = 1 << 18;
// A call of at most kFewRows query rows per head (a decoding step) streams its keys and values
// once per row: a second thread saves a third of the time at best (measured: 2 threads took
// 0.6-0.7x of one at Lk = 1024-4096, B = 1, H = 8, D = 32), and waits for a busy core's
// time slice when another process runs there (15x slower). Such calls stay on one thread up to
// kSerialFewRowsWork, about 0.15 ms on one core (Lk = 1024 at that shape, 512 at D = 64):
// SDPA splits longer ones over every thread, and so must this loop to keep up with it on an
// idle machine (issue 42: Lk = 1k-32k at D = 64 within 1.2x of SDPA).
constexpr int64_t kFewRows = 16;
constexpr double kSerialFewRowsWork = 1 << 19;

bool few_query_rows(int64_t query_rows) { return query_rows <= kFewRows; }

int64_t workers_for(int64_t count, double work, int64_t query_rows) {
  const double serial = few_query_rows(query_rows) ? kSerialFewRowsWork : kSerialWork;
  if (count <= 1 || work <= serial || at::in_parallel_region()) return 1;
  return std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), count));
}

// Short items taken one at a time spend much of their time on the shared counter, whose cache
// line then moves between cores with every item, and on rows next to those another core
// writes: at B = 64, L = 24, H = 4, D = 16 (256 items of 3 us) on 2 threads, chunks of 16 took
// 0.83x (forward) and 0.73x (backward) the time of single items. A chunk holds at most
// kChunkWork multiply-adds (about 50 us on one core) and an eighth of a worker's share, so a
// worker slowed by another process still leaves little for the others to wait on at the end.
constexpr double kChunkWork = 1 << 19;

int64_t chunk_for(int64_t count, int64_t workers, double work) {
  if (count <= 0 || workers <= 1) return 1;
  const double per_item = work / static_cast<double>(count);
  const int64_t by_work = per_item > 0 ? static_cast<int64_t>(kChunkWork / per_item) : count;
  return std::max<int64_t>(1, std::min(by_work, count / (workers * 8)));
}

}  // namespace urpe_cpp
