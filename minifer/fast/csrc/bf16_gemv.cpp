// bf16 matrix-vector product for a decode step at batch 1, on AVX-512 BF16.
//
// The same computation as minifer/bf16_gemv.py's `bf16_reference` (the readable version it is
// tested against): y[m, n] = bf16(sum_k x[m, k] * w[n, k] + bias[n]), products and sums in
// float32, one rounding to bfloat16 at the end. AVX512-BF16's vdpbf16ps multiplies 32 pairs of
// bf16 and adds each two neighbouring products into a float32 lane: 32 multiply-adds per
// instruction, straight from the 2-byte weights. It reads the weight rows in memory order, each
// line asked for 8 KiB ahead, and the output rows are split over torch's threads
// (at::parallel_for). More rows of x re-read each slice of 256 weight rows from L2: correct, but
// a matrix kernel (oneDNN's) is faster there, so minifer calls this one at one row.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>

namespace {

inline __m512bh as_bh(__m512i v) { return reinterpret_cast<__m512bh>(v); }

// the line 8 KiB on in the weight stream is asked for at each load: the hardware prefetcher
// alone keeps too few lines in flight to read at the memory's speed
constexpr int64_t AHEAD = 8192;  // bytes

// acc[n - n0] = sum_k x[k] * w[n, k] for n in [n0, n1), in float32: the rows one after another,
// a single stream through memory, read AHEAD bytes in advance (four rows at once, each load of x
// shared, with prefetches into the next four rows, ran 1.08-1.11x slower on an AMD EPYC)
void dot_rows(const uint16_t* w, const uint16_t* x, int64_t K, int64_t n0, int64_t n1,
              float* acc) {
  const int64_t full = K / 32 * 32;
  const __mmask32 tail = K == full ? 0 : (~0U >> (32 - (K - full)));
  for (int64_t n = n0; n < n1; ++n) {
    const uint16_t* r = w + n * K;
    __m512 a = _mm512_setzero_ps();
    for (int64_t k = 0; k < full; k += 32) {
      _mm_prefetch(reinterpret_cast<const char*>(r + k) + AHEAD, _MM_HINT_T0);
      a = _mm512_dpbf16_ps(a, as_bh(_mm512_loadu_si512(x + k)), as_bh(_mm512_loadu_si512(r + k)));
    }
    if (tail)  // masked loads read nothing past the row; the zero lanes add nothing
      a = _mm512_dpbf16_ps(a, as_bh(_mm512_maskz_loadu_epi16(tail, x + full)),
                           as_bh(_mm512_maskz_loadu_epi16(tail, r + full)));
    acc[n - n0] = _mm512_reduce_add_ps(a);
  }
}

at::Tensor bf16_gemv(const at::Tensor& x, const at::Tensor& w,
                     const c10::optional<at::Tensor>& bias) {
  // the loops read raw memory: every assumption is checked first
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1),
              "bf16 gemv: x [M, K] and w [N, K] expected, got ", x.sizes(), " and ", w.sizes());
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16,
              "bf16 gemv: x and w bfloat16 expected, got ", x.scalar_type(), " and ",
              w.scalar_type());
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "bf16 gemv: contiguous tensors expected");
  const at::BFloat16* bp = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->numel() == N &&
                    bias->is_contiguous(), "bf16 gemv: bias bfloat16 [", N, "] expected");
    bp = bias->data_ptr<at::BFloat16>();
  }
  at::Tensor out = at::empty({M, N}, x.options());
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    float acc[256];
    for (int64_t c0 = n0; c0 < n1; c0 += 256) {  // a bounded slice of rows at a time
      const int64_t c1 = std::min(n1, c0 + int64_t{256});
      for (int64_t m = 0; m < M; ++m) {
        dot_rows(wp, xp + m * K, K, c0, c1, acc);
        for (int64_t n = c0; n < c1; ++n) {
          const float y = bp ? acc[n - c0] + static_cast<float>(bp[n]) : acc[n - c0];
          op[m * N + n] = at::BFloat16(y);  // round to nearest even, as torch
        }
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(minifer_bf16, m) {
  m.def("gemv(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.impl("gemv", c10::DispatchKey::CPU, &bf16_gemv);
}
