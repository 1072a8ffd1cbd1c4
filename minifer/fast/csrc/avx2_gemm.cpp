// Matrix products on x86 CPUs with AVX2 and FMA, where minifer's AVX-512 kernels or MKL's fast
// code do not run: W8A8 and bf16 without AVX-512's int8 and bf16 instructions (AMD Zen 1-3,
// Intel before Ice Lake: oneDNN packs no bf16 there, and torch's int8 and bf16 products run
// generic code), and fp32 for a few rows on a CPU not Intel's (MKL runs generic code there).
//
// Each operator is the same computation as its readable reference in Python:
//   w8a8(x, w, scales, bias): `w8a8_reference` (minifer/quantization.py), bit for bit: each row
//     m of x is quantized to int8 with its own scale sx[m] = max|x[m]| / 127, and
//         y[m, n] = sx[m] * sw[n] * sum_k xq[m, k] * w[n, k]  (+ bias[n]).
//     vpmaddwd multiplies 16 pairs of int16 and adds neighbours into 8 int32 lanes: the int8
//     weights are widened as they are loaded (vpmovsxbw), x is widened once. Every sum is exact.
//   bf16(x, w, bias): `bf16_reference` (minifer/fast/bf16_gemv.py): float32 products and sums
//     of the bf16 numbers, one rounding to bf16 at the end (sums in another order: equal to
//     float32 rounding). A bf16 number is the top half of a float32: a load widens 8 of them
//     (vpmovzxwd) and shifts them up 16 bits.
//   f32(x, w, bias, wide): F.linear, float32 products and sums (in another order: equal to float32
//     rounding); with wide=True the same on AVX-512 (where the CPU has it), 16 floats a vector.
//
// All tile the same way: a tile is 4 weight rows x up to 2 rows of x (4 in wide f32), their
// vector sums in registers, so each weight load serves every row of x in the tile and each x
// load four weight rows; the next tile's rows are prefetched a line at a time (four streams at
// once outrun the hardware's prefetcher). The weight rows are split over torch's threads
// (at::parallel_for), and each tile of 4 weight rows meets every row of x while it is in the L1
// cache: at any batch the weights are read from memory once. A lone row of fp32 (one row, or the
// last of an odd batch) streams through the weight rows one at a time instead, each line asked
// for 4 KiB ahead. A row's sums never depend on the rows beside it: a row gets the same bits
// alone as in any batch.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

constexpr int64_t SLICE = 64;  // weight rows a thread takes at least

inline int32_t hsum(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// the line 4 KiB on in a lone row's stream through the weight rows, asked for at each load: the
// hardware prefetcher alone keeps too few lines in flight to read at the memory's speed
constexpr int64_t AHEAD = 4096;  // bytes
inline void prefetch_ahead(const void* p) {
  _mm_prefetch(static_cast<const char*>(p) + AHEAD, _MM_HINT_T0);
}

// the line at `p` in each of the 4 weight rows after this tile's (rows are contiguous): asked for
// early, as the tile reads four streams at once
template <typename W>
inline void prefetch_next_tile(const W* p, int64_t K) {
  for (int j = 4; j < 8; ++j) _mm_prefetch(reinterpret_cast<const char*>(p + j * K), _MM_HINT_T0);
}

// ---- W8A8 ---------------------------------------------------------------------------------

// 16 int8 weights widened to int16
inline __m256i load_i8(const int8_t* p) {
  return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// acc[r][j] = sum_k x[r][k] * w[n + j, k] for R rows of x (int16, K padded to 16 with zeros)
// and the 4 weight rows n..n+3 (K0 = K rounded down to 16; the rest added one by one)
template <int R>
void w8a8_tile(const int8_t* w, int64_t K, const int16_t* const* x, int32_t (&acc)[2][4]) {
  const int64_t K0 = K / 16 * 16;
  __m256i a[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) a[r][j] = _mm256_setzero_si256();
  for (int64_t k = 0; k < K0; k += 16) {
    if ((k & 63) == 0) prefetch_next_tile(w + k, K);
    const __m256i w0 = load_i8(w + k), w1 = load_i8(w + K + k), w2 = load_i8(w + 2 * K + k),
                  w3 = load_i8(w + 3 * K + k);
    for (int r = 0; r < R; ++r) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[r] + k));
      a[r][0] = _mm256_add_epi32(a[r][0], _mm256_madd_epi16(xv, w0));
      a[r][1] = _mm256_add_epi32(a[r][1], _mm256_madd_epi16(xv, w1));
      a[r][2] = _mm256_add_epi32(a[r][2], _mm256_madd_epi16(xv, w2));
      a[r][3] = _mm256_add_epi32(a[r][3], _mm256_madd_epi16(xv, w3));
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) {
      int32_t s = hsum(a[r][j]);
      for (int64_t k = K0; k < K; ++k) s += x[r][k] * w[j * K + k];
      acc[r][j] = s;
    }
}

// the bias, when there is one, checked to be `dtype` [N]: the tensor (else undefined)
at::Tensor checked_bias(const c10::optional<at::Tensor>& bias, int64_t N, at::ScalarType dtype,
                        const char* op) {
  if (!bias.has_value()) return at::Tensor();
  TORCH_CHECK(bias->scalar_type() == dtype && bias->numel() == N && bias->is_contiguous(), op,
              ": bias ", dtype, " [", N, "] expected");
  return *bias;
}

// calls tile(n, m, R) for every tile: groups of 4 weight rows over the threads (at least SLICE
// rows a thread), and for each group every RT rows of x (the last R = M % RT alone); weight rows
// past the last multiple of 4 are passed with n + 4 > N (the tile does fewer)
template <int RT = 2, typename Tile>
void for_each_tile(int64_t M, int64_t N, const Tile& tile) {
  at::parallel_for(0, (N + 3) / 4, SLICE / 4, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t m = 0; m < M; m += RT)
        tile(4 * g, m, static_cast<int>(std::min<int64_t>(RT, M - m)));
  });
}

// runs `tile` (the caller's, for its count of rows of x) at weight row n: over w itself, or, for
// the last weight rows (n + 4 > N), over a copy of them padded with zero rows
template <typename W, typename X, typename A, int RT>
void run_tile(void (*tile)(const W*, int64_t, const X* const*, A (&)[RT][4]), const W* w,
              int64_t n, int64_t N, int64_t K, const X* const* rows, A (&acc)[RT][4]) {
  const W* rows_w = w + n * K;
  std::vector<W> last;
  if (n + 4 > N) {
    last.assign(4 * K, W(0));
    std::copy(w + n * K, w + N * K, last.begin());
    rows_w = last.data();
  }
  tile(rows_w, K, rows, acc);
}

at::Tensor w8a8(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales,
                const c10::optional<at::Tensor>& bias) {
  // the loops read raw memory: every assumption is checked first
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1),
              "w8a8: x [M, K] and w [N, K] expected, got ", x.sizes(), " and ", w.sizes());
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kChar &&
                  scales.scalar_type() == at::kFloat && scales.numel() == N,
              "w8a8: x float32, w int8 and scales float32 [", N, "] expected");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && scales.is_contiguous(),
              "w8a8: contiguous tensors expected");
  const at::Tensor b = checked_bias(bias, N, at::kFloat, "w8a8");
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  // each row of x to int16 holding int8 values, with its own scale (as quantize_rows)
  const int64_t stride = (K + 15) / 16 * 16;
  std::vector<int16_t> xq(M * stride, 0);
  std::vector<float> sx(M);
  const float* xp = x.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = xp + m * K;
    float peak = 0.f;
    for (int64_t k = 0; k < K; ++k) peak = std::max(peak, std::fabs(xr[k]));
    sx[m] = peak > 0.f ? peak / 127.f : 1.f;
    const float inv = 1.f / sx[m];
    for (int64_t k = 0; k < K; ++k)  // round half to even, as torch.round
      xq[m * stride + k] = static_cast<int16_t>(std::nearbyint(xr[k] * inv));
  }
  at::Tensor out = at::empty({M, N}, x.options());
  const int8_t* wp = w.data_ptr<int8_t>();
  const float* sw = scales.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for_each_tile(M, N, [&](int64_t n, int64_t m, int R) {
    const int16_t* rows[2] = {xq.data() + m * stride, xq.data() + (m + R - 1) * stride};
    int32_t acc[2][4];
    run_tile(R == 2 ? w8a8_tile<2> : w8a8_tile<1>, wp, n, N, K, rows, acc);
    for (int r = 0; r < R; ++r)
      for (int64_t j = 0; j < std::min<int64_t>(4, N - n); ++j) {
        const float y = static_cast<float>(acc[r][j]) * sx[m + r] * sw[n + j];
        op[(m + r) * N + n + j] = bp ? y + bp[n + j] : y;
      }
  });
  return out;
}

// ---- bf16 ---------------------------------------------------------------------------------

// A bf16 number is the top half of a float32, so 16 bf16 weights in one 256-bit load are two
// vectors of 8 floats with no conversion: each 32-bit lane holds weights 2i (low half: shifted
// up) and 2i + 1 (high half: the low half masked off). x is stored to match, in blocks of 16:
// its 8 even elements, then its 8 odd ones (`split_even_odd`).
inline float as_float(uint16_t v) { return c10::BFloat16(v, c10::BFloat16::from_bits()); }

// 16 weights at p as two vectors of 8 floats, in the order x is stored in: float32 as they are;
// bf16 from one load, its even elements (shifted up) and its odd ones (the low half masked off)
inline void load16(const float* p, __m256& lo, __m256& hi) {
  lo = _mm256_loadu_ps(p);
  hi = _mm256_loadu_ps(p + 8);
}
inline void load16(const uint16_t* p, __m256& lo, __m256& hi) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  lo = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  const __m256i high = _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  hi = _mm256_castsi256_ps(_mm256_and_si256(v, high));
}
inline float as_float(float v) { return v; }

// acc[r][j] = sum_k x[r][k] * w[n + j, k] in float32, for R rows of x (float32, stored to match
// `load16`, K padded to 16 with zeros) and the 4 weight rows n..n+3 of float32 or bf16 weights
// (K0 = K rounded down to 16; the rest one by one)
template <int R, typename W>
void float_tile(const W* w, int64_t K, const float* const* x, float (&acc)[2][4]) {
  const int64_t K0 = K / 16 * 16;
  constexpr int64_t LINE = 64 / sizeof(W);  // weights in a cache line
  __m256 a[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) a[r][j] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K0; k += 16) {
    if (k % LINE == 0) prefetch_next_tile(w + k, K);
    for (int j = 0; j < 4; ++j) {
      __m256 lo, hi;
      load16(w + j * K + k, lo, hi);
      for (int r = 0; r < R; ++r) {
        a[r][j] = _mm256_fmadd_ps(_mm256_loadu_ps(x[r] + k), lo, a[r][j]);
        a[r][j] = _mm256_fmadd_ps(_mm256_loadu_ps(x[r] + k + 8), hi, a[r][j]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) {
      float s = hsum(a[r][j]);
      for (int64_t k = K0; k < K; ++k) s += x[r][k] * as_float(w[j * K + k]);
      acc[r][j] = s;
    }
}

// one row of x against the 4 weight rows one after another: a single stream through memory,
// which the hardware prefetcher follows better than a tile's four; each sum as a float_tile's
// (the same products added in the same order), so a row gets the same bits here as in a batch
void float_stream(const float* w, int64_t K, const float* const* x, float (&acc)[2][4]) {
  const int64_t K0 = K / 16 * 16;
  for (int j = 0; j < 4; ++j) {
    __m256 a = _mm256_setzero_ps(), lo, hi;
    for (int64_t k = 0; k < K0; k += 16) {
      prefetch_ahead(w + j * K + k);
      load16(w + j * K + k, lo, hi);
      a = _mm256_fmadd_ps(_mm256_loadu_ps(x[0] + k), lo, a);
      a = _mm256_fmadd_ps(_mm256_loadu_ps(x[0] + k + 8), hi, a);
    }
    float s = hsum(a);
    for (int64_t k = K0; k < K; ++k) s += x[0][k] * w[j * K + k];
    acc[0][j] = s;
  }
}

// x [M, K] bf16 as float32 in rows of `stride`, each block of 16 as its even then its odd
// elements (the elements past the last full block, and zeros, as they are)
at::Tensor split_even_odd(const at::Tensor& x, int64_t stride) {
  const int64_t M = x.size(0), K = x.size(1), K0 = K / 16 * 16;
  at::Tensor xf = at::zeros({M, stride}, x.options().dtype(at::kFloat));
  const at::Tensor src = x.contiguous();
  const at::BFloat16* xp = src.data_ptr<at::BFloat16>();
  float* out = xf.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) {
    const at::BFloat16* row = xp + m * K;
    float* dst = out + m * stride;
    for (int64_t k = 0; k < K0; k += 16)
      for (int i = 0; i < 8; ++i) {
        dst[k + i] = row[k + 2 * i];
        dst[k + 8 + i] = row[k + 2 * i + 1];
      }
    for (int64_t k = K0; k < K; ++k) dst[k] = row[k];
  }
  return xf;
}

at::Tensor bf16(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1),
              "bf16: x [M, K] and w [N, K] expected, got ", x.sizes(), " and ", w.sizes());
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16,
              "bf16: x and w bfloat16 expected, got ", x.scalar_type(), " and ", w.scalar_type());
  TORCH_CHECK(w.is_contiguous(), "bf16: a contiguous weight expected");
  const at::Tensor b = checked_bias(bias, N, at::kBFloat16, "bf16");
  const at::BFloat16* bp = b.defined() ? b.data_ptr<at::BFloat16>() : nullptr;
  const int64_t stride = (K + 15) / 16 * 16;
  const at::Tensor xf = split_even_odd(x, stride);
  at::Tensor out = at::empty({M, N}, x.options());
  const float* xp = xf.data_ptr<float>();
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  for_each_tile(M, N, [&](int64_t n, int64_t m, int R) {
    const float* rows[2] = {xp + m * stride, xp + (m + R - 1) * stride};
    float acc[2][4];
    run_tile(R == 2 ? float_tile<2, uint16_t> : float_tile<1, uint16_t>, wp, n, N, K, rows, acc);
    for (int r = 0; r < R; ++r)
      for (int64_t j = 0; j < std::min<int64_t>(4, N - n); ++j) {
        const float y = bp ? acc[r][j] + static_cast<float>(bp[n + j]) : acc[r][j];
        op[(m + r) * N + n + j] = at::BFloat16(y);  // round to nearest even, as torch
      }
  });
  return out;
}

// ---- fp32 ---------------------------------------------------------------------------------

// the sums of 4 vectors of 16 floats at once: each folded to 8, then pairwise (vhaddps)
__attribute__((target("avx512f"))) inline __m128 hsum4(const __m512 (&v)[4]) {
  __m256 h[4];
  for (int j = 0; j < 4; ++j)
    h[j] = _mm256_add_ps(_mm512_castps512_ps256(v[j]),
                         _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v[j]), 1)));
  const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(h[0], h[1]), _mm256_hadd_ps(h[2], h[3]));
  return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

// the same on AVX-512 (CPUs that have it): 4 weight rows x up to 4 rows of x, 16 floats a step
template <int R>
__attribute__((target("avx512f"))) void f32_tile16(const float* w, int64_t K, const float* const* x,
                                                   float (&acc)[4][4]) {
  const int64_t K0 = K / 16 * 16;
  __m512 a[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) a[r][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K0; k += 16) {
    prefetch_next_tile(w + k, K);
    __m512 xv[R];
    for (int r = 0; r < R; ++r) xv[r] = _mm512_loadu_ps(x[r] + k);
    for (int j = 0; j < 4; ++j) {
      const __m512 wv = _mm512_loadu_ps(w + j * K + k);
      for (int r = 0; r < R; ++r) a[r][j] = _mm512_fmadd_ps(xv[r], wv, a[r][j]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm_storeu_ps(acc[r], hsum4(a[r]));
    for (int j = 0; j < 4; ++j)
      for (int64_t k = K0; k < K; ++k) acc[r][j] += x[r][k] * w[j * K + k];
  }
}

// the same on AVX-512, each sum as an f32_tile16's
__attribute__((target("avx512f"))) void f32_stream16(const float* w, int64_t K,
                                                     const float* const* x, float (&acc)[4][4]) {
  const int64_t K0 = K / 16 * 16;
  __m512 a[4];
  for (int j = 0; j < 4; ++j) {
    a[j] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K0; k += 16) {
      prefetch_ahead(w + j * K + k);
      a[j] = _mm512_fmadd_ps(_mm512_loadu_ps(x[0] + k), _mm512_loadu_ps(w + j * K + k), a[j]);
    }
  }
  _mm_storeu_ps(acc[0], hsum4(a));
  for (int j = 0; j < 4; ++j)
    for (int64_t k = K0; k < K; ++k) acc[0][j] += x[0][k] * w[j * K + k];
}

// y[m, n] = bias[n] + the tile's sum, for the R rows of x at m and the 4 weight rows at n
template <int RT>
void store_f32(float* op, const float* bp, int64_t m, int64_t n, int64_t N, int R,
               const float (&acc)[RT][4]) {
  for (int r = 0; r < R; ++r)
    for (int64_t j = 0; j < std::min<int64_t>(4, N - n); ++j)
      op[(m + r) * N + n + j] = bp ? acc[r][j] + bp[n + j] : acc[r][j];
}

// wide: the AVX-512 tiles (16 floats a vector, 4 rows of x a tile)
at::Tensor f32(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
               bool wide) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1),
              "f32: x [M, K] and w [N, K] expected, got ", x.sizes(), " and ", w.sizes());
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat,
              "f32: x and w float32 expected, got ", x.scalar_type(), " and ", w.scalar_type());
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "f32: contiguous x and w expected");
  TORCH_CHECK(!wide || __builtin_cpu_supports("avx512f"), "f32: wide=True needs AVX-512F");
  const at::Tensor b = checked_bias(bias, N, at::kFloat, "f32");
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  at::Tensor out = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  if (wide) {
    void (*tiles[4])(const float*, int64_t, const float* const*, float (&)[4][4]) = {
        f32_stream16, f32_tile16<2>, f32_tile16<3>, f32_tile16<4>};
    for_each_tile<4>(M, N, [&](int64_t n, int64_t m, int R) {
      const float* rows[4];
      for (int r = 0; r < 4; ++r) rows[r] = xp + (m + std::min(r, R - 1)) * K;
      float acc[4][4];
      run_tile(tiles[R - 1], wp, n, N, K, rows, acc);
      store_f32(op, bp, m, n, N, R, acc);
    });
  } else {
    for_each_tile(M, N, [&](int64_t n, int64_t m, int R) {
      const float* rows[2] = {xp + m * K, xp + (m + R - 1) * K};
      float acc[2][4];
      run_tile(R == 2 ? float_tile<2, float> : float_stream, wp, n, N, K, rows, acc);
      store_f32(op, bp, m, n, N, R, acc);
    });
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(minifer_avx2, m) {
  m.def("w8a8(Tensor x, Tensor w, Tensor scales, Tensor? bias) -> Tensor");
  m.def("bf16(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def("f32(Tensor x, Tensor w, Tensor? bias, bool wide) -> Tensor");
  m.impl("w8a8", c10::DispatchKey::CPU, &w8a8);
  m.impl("bf16", c10::DispatchKey::CPU, &bf16);
  m.impl("f32", c10::DispatchKey::CPU, &f32);
}
