// W8A8 matrix-vector product for a decode step at batch 1, on AVX-512 VNNI.
//
// The same computation as minifer/int8_gemv.py's `w8a8_reference` (the readable version it is
// tested against): each row m of x is quantized to int8 with its own scale
// sx[m] = max|x[m]| / 127, and
//     y[m, n] = sx[m] * sw[n] * sum_k xq[m, k] * w[n, k]  (+ bias[n]).
// VNNI's vpdpbusd multiplies 64 unsigned by 64 signed bytes and adds each group of four
// products into an int32 lane: one instruction for 64 multiply-adds. Its first operand is
// unsigned, so x goes in as xq + 128 and 128 * sum_k w[n, k] (`rowsum`, computed once per
// layer) comes off the total. The weight rows are read one after another, a single stream, each
// line asked for 8 KiB before it is read (four rows at once, sharing each load of x, with
// prefetches into the next four rows, took 1.12x as long at two threads and 1.20x at one on an
// AMD EPYC, GPT-2's 49 matrices). The output rows are split over torch's threads
// (at::parallel_for).
//
// Several rows (`gemm`, batched decode): the same sums over a copy of w packed once (`pack`) in
// blocks of 16 output columns x 4 inputs, 64 bytes, the 4 bytes of each column side by side. One
// vpdpbusd then adds 4 inputs of one x row (broadcast) into 16 columns' sums at once, so no
// horizontal sums; a tile of up to 4 x rows x 64 columns keeps its 16 sums in registers, each
// weight load serving 4 rows and each x load 64 columns (2x torch._int_mm at 16 rows on an AMD
// EPYC without AMX).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

// each row m of x [M, K] to int8 with its own scale sx[m], stored plus 128 as unsigned bytes in
// rows of `stride` (K and past it: 128, the unsigned zero)
void quantize_rows(const float* xp, int64_t M, int64_t K, int64_t stride, uint8_t* xu, float* sx) {
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = xp + m * K;
    float peak = 0.f;
    for (int64_t k = 0; k < K; ++k) peak = std::max(peak, std::fabs(xr[k]));
    const float s = peak > 0.f ? peak / 127.f : 1.f;
    const float inv = 1.f / s;
    sx[m] = s;
    for (int64_t k = 0; k < stride; ++k)  // round half to even, as torch.round
      xu[m * stride + k] = k < K ? static_cast<uint8_t>(
          static_cast<int32_t>(std::nearbyint(xr[k] * inv)) + 128) : 128;
  }
}

// the line 8 KiB on in the weight stream is asked for at each load: the hardware prefetcher
// alone keeps too few lines in flight to read at the memory's speed
constexpr int64_t AHEAD = 8192;  // bytes

// acc[n] = sum_k xu[k] * w[n, k] for n in [n0, n1): xu unsigned (xq + 128), w signed; the rows
// one after another, a single stream through memory, read AHEAD bytes in advance
void dot_rows(const int8_t* w, const uint8_t* xu, int64_t K, int64_t n0, int64_t n1,
              int32_t* acc) {
  const int64_t full = K / 64 * 64;
  const __mmask64 tail = K == full ? 0 : (~0ULL >> (64 - (K - full)));
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* r = w + n * K;
    __m512i a = _mm512_setzero_si512();
    for (int64_t k = 0; k < full; k += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(r + k) + AHEAD, _MM_HINT_T0);
      a = _mm512_dpbusd_epi32(a, _mm512_loadu_si512(xu + k), _mm512_loadu_si512(r + k));
    }
    if (tail)  // masked loads read nothing past the row; the zero lanes add nothing
      a = _mm512_dpbusd_epi32(a, _mm512_maskz_loadu_epi8(tail, xu + full),
                              _mm512_maskz_loadu_epi8(tail, r + full));
    acc[n] = _mm512_reduce_add_epi32(a);
  }
}

// the bias, when there is one, checked to be float32 [N]: its data (else nullptr)
const float* bias_data(const c10::optional<at::Tensor>& bias, int64_t N, const char* op) {
  if (!bias.has_value()) return nullptr;
  TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == N && bias->is_contiguous(),
              op, ": bias float32 [", N, "] expected");
  return bias->data_ptr<float>();
}

at::Tensor w8a8_gemv(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales,
                     const at::Tensor& rowsum, const c10::optional<at::Tensor>& bias) {
  // the loops read raw memory: every assumption is checked first
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1),
              "int8 gemv: x [M, K] and w [N, K] expected, got ", x.sizes(), " and ", w.sizes());
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kChar &&
                  scales.scalar_type() == at::kFloat && rowsum.scalar_type() == at::kInt,
              "int8 gemv: x float32, w int8, scales float32 and rowsum int32 expected");
  TORCH_CHECK(scales.numel() == N && rowsum.numel() == N, "int8 gemv: ", N,
              " scales and row sums expected, got ", scales.numel(), " and ", rowsum.numel());
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && scales.is_contiguous() &&
                  rowsum.is_contiguous(), "int8 gemv: contiguous tensors expected");
  const float* bp = bias_data(bias, N, "int8 gemv");
  at::Tensor out = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const int8_t* wp = w.data_ptr<int8_t>();
  const float* sw = scales.data_ptr<float>();
  const int32_t* rs = rowsum.data_ptr<int32_t>();
  float* op = out.data_ptr<float>();
  std::vector<uint8_t> xu(M * K);
  std::vector<float> sx(M);
  quantize_rows(xp, M, K, K, xu.data(), sx.data());
  std::vector<int32_t> acc(M * N);
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    for (int64_t m = 0; m < M; ++m) {
      int32_t* a = acc.data() + m * N;
      dot_rows(wp, xu.data() + m * K, K, n0, n1, a);
      for (int64_t n = n0; n < n1; ++n) {
        const float y = static_cast<float>(a[n] - 128 * rs[n]) * sx[m] * sw[n];
        op[m * N + n] = bp ? y + bp[n] : y;
      }
    }
  });
  return out;
}

constexpr int64_t COLS = 16, TILE = 4 * COLS;  // a block's columns (one vector), a tile's

// w [N, K] int8 -> [N / 64, K / 4, 16 x 4 bytes] per block of 16 columns, N rounded up to 64 and
// K to 4 with zeros: block b, group g holds w[16b + j, 4g + t] at byte 4j + t
at::Tensor pack(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kChar && w.is_contiguous(),
              "int8 pack: a contiguous int8 w [N, K] expected, got ", w.sizes());
  const int64_t N = w.size(0), K = w.size(1), G = (K + 3) / 4, B = (N + TILE - 1) / TILE * 4;
  at::Tensor out = at::zeros({B, G, 4 * COLS}, w.options());
  const int8_t* wp = w.data_ptr<int8_t>();
  int8_t* op = out.data_ptr<int8_t>();
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k)
      op[((n / COLS) * G + k / 4) * 4 * COLS + (n % COLS) * 4 + k % 4] = wp[n * K + k];
  return out;
}

// R rows of xu (unsigned, rows of 4G bytes) by the 4 blocks from `blocks` on: 16R int32 sums
template <int R>
void tile_sums(const uint8_t* xu, int64_t G, const int8_t* blocks, __m512i (&acc)[4][4]) {
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_si512();
  for (int64_t g = 0; g < G; ++g) {
    __m512i wv[4];
    for (int c = 0; c < 4; ++c) wv[c] = _mm512_loadu_si512(blocks + (c * G + g) * 4 * COLS);
    for (int r = 0; r < R; ++r) {
      int32_t four;  // x[r, 4g .. 4g + 3], in every lane
      std::memcpy(&four, xu + r * 4 * G + 4 * g, 4);
      const __m512i xb = _mm512_set1_epi32(four);
      for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_dpbusd_epi32(acc[r][c], xb, wv[c]);
    }
  }
}

at::Tensor w8a8_gemm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                     const at::Tensor& rowsum, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 3 && x.scalar_type() == at::kFloat &&
                  packed.scalar_type() == at::kChar && scales.scalar_type() == at::kFloat &&
                  rowsum.scalar_type() == at::kInt,
              "int8 gemm: x float32 [M, K], packed int8 (from pack), scales float32 and rowsum "
              "int32 expected");
  const int64_t M = x.size(0), K = x.size(1), N = scales.numel(), G = (K + 3) / 4;
  TORCH_CHECK(packed.size(0) == (N + TILE - 1) / TILE * 4 && packed.size(1) == G &&
                  packed.size(2) == 4 * COLS && rowsum.numel() == N,
              "int8 gemm: packed ", packed.sizes(), " is not pack(w) of a w [", N, ", ", K, "]");
  TORCH_CHECK(x.is_contiguous() && packed.is_contiguous() && scales.is_contiguous() &&
                  rowsum.is_contiguous(), "int8 gemm: contiguous tensors expected");
  const float* bp = bias_data(bias, N, "int8 gemm");
  at::Tensor out = at::empty({M, N}, x.options());
  std::vector<uint8_t> xu(M * 4 * G);
  std::vector<float> sx(M);
  quantize_rows(x.data_ptr<float>(), M, K, 4 * G, xu.data(), sx.data());
  const int8_t* wp = packed.data_ptr<int8_t>();
  const float* sw = scales.data_ptr<float>();
  const int32_t* rs = rowsum.data_ptr<int32_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, packed.size(0) / 4, 1, [&](int64_t t0, int64_t t1) {
    __m512i acc[4][4];
    for (int64_t t = t0; t < t1; ++t)  // a tile of 64 columns, all M rows four at a time
      for (int64_t m = 0; m < M; m += 4) {
        const int64_t R = std::min<int64_t>(4, M - m);
        const uint8_t* xr = xu.data() + m * 4 * G;
        const int8_t* blocks = wp + t * 4 * G * 4 * COLS;
        if (R == 4) tile_sums<4>(xr, G, blocks, acc);
        else if (R == 3) tile_sums<3>(xr, G, blocks, acc);
        else if (R == 2) tile_sums<2>(xr, G, blocks, acc);
        else tile_sums<1>(xr, G, blocks, acc);
        for (int64_t r = 0; r < R; ++r)
          for (int c = 0; c < 4; ++c) {  // as gemv: float(sum - 128 rowsum) * sx * sw (+ bias)
            const int64_t n0 = t * TILE + c * COLS;
            if (n0 >= N) break;
            const __mmask16 live = N - n0 >= COLS ? 0xFFFF : (1u << (N - n0)) - 1;
            const __m512i sums = _mm512_sub_epi32(
                acc[r][c], _mm512_mullo_epi32(_mm512_set1_epi32(128),
                                              _mm512_maskz_loadu_epi32(live, rs + n0)));
            __m512 y = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(sums),
                                                   _mm512_set1_ps(sx[m + r])),
                                     _mm512_maskz_loadu_ps(live, sw + n0));
            if (bp) y = _mm512_add_ps(y, _mm512_maskz_loadu_ps(live, bp + n0));
            _mm512_mask_storeu_ps(op + (m + r) * N + n0, live, y);
          }
      }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(minifer_int8, m) {
  m.def("gemv(Tensor x, Tensor w, Tensor scales, Tensor rowsum, Tensor? bias) -> Tensor");
  m.def("pack(Tensor w) -> Tensor");
  m.def("gemm(Tensor x, Tensor packed, Tensor scales, Tensor rowsum, Tensor? bias) -> Tensor");
  m.impl("gemv", c10::DispatchKey::CPU, &w8a8_gemv);
  m.impl("pack", c10::DispatchKey::CPU, &pack);
  m.impl("gemm", c10::DispatchKey::CPU, &w8a8_gemm);
}
