// Decode attention over the paged K/V pool, reading every cached key and value where it lies.
//
// The same computation as minifer/serve/paged_attention.py's `paged_decode_attention` (the
// readable reference it is tested against): for each row b and K/V head h, score the row's
// lengths[b] cached keys against the query heads that share h, softmax, and sum the values.
// A token t of row b sits in block block_table[b][t / block_size], slot t % block_size, so the
// loops follow the block table instead of first copying the row's K/V into one run (what the
// eager path must do). Rows are split over torch's threads (at::parallel_for).
//
// `rows` is the same computation over generate's dense cache, k and v (B, Hkv, S, D), row b
// over its own slots starts[b].. (a left-padded batch): minifer/hooks.py's `decode_attention`.
// One task per row and K/V head, whose arithmetic depends on nothing but that row's keys, so a
// row decodes bit for bit the same alone and in any batch, with any number of threads.
//
// Where head_dim is a multiple of 16 (64 in GPT-2 and the shipped models) a head's query,
// key and value rows are handled as 16-float vectors (GCC's vector extensions: AVX-512 where
// the build targets it, two AVX2 halves or four SSE quarters elsewhere) and the softmax takes
// its exponentials 16 at a time; other widths take the plain loops below (`Plain`).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kAhead = 4;  // tokens between a prefetch and its use

typedef float vf __attribute__((vector_size(64)));  // 16 floats
typedef float vf8 __attribute__((vector_size(32)));
typedef float vf4 __attribute__((vector_size(16)));
typedef int32_t vi __attribute__((vector_size(64)));
typedef uint16_t vh __attribute__((vector_size(32)));  // 16 bfloat16
typedef uint32_t vu __attribute__((vector_size(64)));

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);  // an unaligned vector load
  return v;
}
inline vf load(const at::BFloat16* p) {  // 16 bfloat16 widened: their bits, 16 places up
  vh h;
  std::memcpy(&h, p, sizeof h);
  const vu u = __builtin_convertvector(h, vu) << 16;
  vf v;
  std::memcpy(&v, &u, sizeof v);
  return v;
}
inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof v); }
inline vf splat(float x) { return vf{} + x; }

inline float hsum(vf v) {
  vf8 lo, hi;
  std::memcpy(&lo, &v, sizeof lo);
  std::memcpy(&hi, reinterpret_cast<const char*>(&v) + sizeof lo, sizeof hi);
  const vf8 a = lo + hi;
  vf4 l, h;
  std::memcpy(&l, &a, sizeof l);
  std::memcpy(&h, reinterpret_cast<const char*>(&a) + sizeof l, sizeof h);
  const vf4 b = l + h;
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// e^x for x <= 0 (a score minus the row's maximum), 16 at a time: x = n ln2 + r with
// |r| <= ln2 / 2, e^r from Cephes' expf polynomial (within about one ulp of std::exp), and 2^n
// written straight into the exponent bits. Below -87, where e^x is under 2^-125 and adds
// nothing next to the maximum's e^0 = 1, x is clamped (2^n stays a normal float).
inline vf exp_nonpositive(vf x) {
  x = x < splat(-87.f) ? splat(-87.f) : x;
  const vi n = __builtin_convertvector(x * 1.44269504f - 0.5f, vi);  // round(x / ln2), x <= 0
  const vf nf = __builtin_convertvector(n, vf);
  const vf r = (x - nf * 0.693359375f) + nf * 2.12194440e-4f;  // ln2 in two parts
  vf p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.f;
  const vi bits = (n + 127) << 23;
  vf two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return p * two_n;
}

// softmax of one head's scores in place
void softmax(float* sh, int64_t L) {
  const int64_t full = L / 16 * 16;
  float mx = -INFINITY;
  if (full) {
    vf m = load(sh);
    for (int64_t t = 16; t < full; t += 16) {
      const vf x = load(sh + t);
      m = m < x ? x : m;
    }
    for (int i = 0; i < 16; ++i) mx = std::max(mx, m[i]);
  }
  for (int64_t t = full; t < L; ++t) mx = std::max(mx, sh[t]);
  vf acc = splat(0.f);
  for (int64_t t = 0; t < full; t += 16) {
    const vf e = exp_nonpositive(load(sh + t) - mx);
    store(sh + t, e);
    acc += e;
  }
  float sum = hsum(acc);
  for (int64_t t = full; t < L; ++t) sum += (sh[t] = std::exp(sh[t] - mx));
  const float inv = 1.f / sum;
  for (int64_t t = 0; t < L; ++t) sh[t] *= inv;
}

// One head's vector operations: head_dim = 16 * ND, in registers.
template <int ND>
struct Vec {
  template <class T>
  float dot(const float* a, const T* b) const {
    vf s = load(a) * load(b);
    for (int i = 1; i < ND; ++i) s += load(a + 16 * i) * load(b + 16 * i);
    return hsum(s);
  }
  template <class T>
  void axpy(float w, const T* x, float* y) const {  // y += w * x
    const vf wv = splat(w);
    for (int i = 0; i < ND; ++i) store(y + 16 * i, load(y + 16 * i) + wv * load(x + 16 * i));
  }
};

// Any other head_dim: loops the compiler vectorizes as it can.
struct Plain {
  int64_t D;
  template <class T>
  float dot(const float* a, const T* b) const {
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int64_t d = 0; d < D; ++d) s += a[d] * static_cast<float>(b[d]);
    return s;
  }
  template <class T>
  void axpy(float w, const T* x, float* y) const {
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) y[d] += w * static_cast<float>(x[d]);
  }
};

struct Shapes {
  int64_t H, Hkv, D, block_size, M;
};

// Attention of rows [begin, end): scores by `op.dot`, softmax, values summed by `op.axpy`.
template <class Op>
void attend_rows(const Op& op, const Shapes& sh, const float* qp, const float* kp,
                 const float* vp, const int64_t* table, const int64_t* len, float s,
                 float* op_out, int64_t begin, int64_t end) {
  const int64_t H = sh.H, D = sh.D, block_size = sh.block_size;
  const int64_t G = H / sh.Hkv;  // query heads per K/V head (grouped-query attention)
  const int64_t run = sh.Hkv * D;  // one token's keys (or values), every head: one run
  std::vector<float> scores, acc(H * D);
  for (int64_t b = begin; b < end; ++b) {
    const int64_t L = len[b];
    const float* qb = qp + b * H * D;
    // token t = j * block_size + r sits in slot r of block table[b * M + j]
    const int64_t* blocks = table + b * sh.M;
    auto at = [&](int64_t t) { return (blocks[t / block_size] * block_size + t % block_size) * run; };
    // The pool comes from memory, not cache (a step reads every layer's pool and the weights
    // in between), and a row's blocks lie anywhere: the hardware prefetcher, which follows
    // one run and stops at page ends, leaves each new block's first reads waiting. So the
    // key pass asks for the keys and values kAhead tokens on, the value pass for the values.
    scores.resize(H * L);  // scores[head * L + t]
    for (int64_t t = 0; t < L; ++t) {
      if (t + kAhead < L) {
        const int64_t ahead = at(t + kAhead);
        for (int64_t i = 0; i < run; i += 16) {  // a cache line
          __builtin_prefetch(kp + ahead + i);
          __builtin_prefetch(vp + ahead + i, 0, 2);
        }
      }
      const float* k = kp + at(t);
      for (int64_t hq = 0; hq < H; ++hq) scores[hq * L + t] = op.dot(qb + hq * D, k + hq / G * D) * s;
    }
    for (int64_t hq = 0; hq < H; ++hq) softmax(scores.data() + hq * L, L);
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t t = 0; t < L; ++t) {
      if (t + kAhead < L) {
        const int64_t ahead = at(t + kAhead);
        for (int64_t i = 0; i < run; i += 16) __builtin_prefetch(vp + ahead + i);
      }
      const float* v = vp + at(t);
      for (int64_t hq = 0; hq < H; ++hq) op.axpy(scores[hq * L + t], v + hq / G * D, acc.data() + hq * D);
    }
    std::copy(acc.begin(), acc.end(), op_out + b * H * D);
  }
}

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                        const at::Tensor& block_table, const at::Tensor& lengths, double scale) {
  // shapes, dtypes and contiguity are checked by the Python caller (PagedDecodeKernel)
  const int64_t B = q.size(0);
  const Shapes sh{q.size(1), k_pool.size(2), q.size(2), k_pool.size(1), block_table.size(1)};
  at::Tensor out = at::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = k_pool.data_ptr<float>();
  const float* vp = v_pool.data_ptr<float>();
  const int64_t* table = block_table.data_ptr<int64_t>();
  const int64_t* len = lengths.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float s = static_cast<float>(scale);
  const int64_t room = sh.M * sh.block_size;
  for (int64_t b = 0; b < B; ++b)  // the loops below read raw memory: indices checked first
    TORCH_CHECK(len[b] >= 1 && len[b] <= room, "paged decode: row ", b, " length ", len[b],
                " outside [1, ", room, "]");
  for (int64_t j = 0; j < B * sh.M; ++j)
    TORCH_CHECK(table[j] >= 0 && table[j] < k_pool.size(0), "paged decode: block id ", table[j],
                " outside [0, ", k_pool.size(0), ")");

  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {  // one row per task
    auto rows = [&](const auto& dot) {
      attend_rows(dot, sh, qp, kp, vp, table, len, s, op, begin, end);
    };
    switch (sh.D % 16 ? 0 : sh.D / 16) {
      case 1: rows(Vec<1>{}); break;
      case 2: rows(Vec<2>{}); break;
      case 4: rows(Vec<4>{}); break;
      case 8: rows(Vec<8>{}); break;
      default: rows(Plain{sh.D});
    }
  });
  return out;
}

// One row's K/V head, L keys from `k`, `v` (float or bfloat16, a head's tokens D values apart):
// its G query heads `q` score the keys, softmax, and sum the values into `out` (G * D floats).
template <class Op, class T>
void attend_head(const Op& op, int64_t G, int64_t D, int64_t L, const float* q, const T* k,
                 const T* v, float s, float* out, std::vector<float>& scores) {
  scores.resize(G * L);  // scores[g * L + t]
  for (int64_t t = 0; t < L; ++t)
    for (int64_t g = 0; g < G; ++g) scores[g * L + t] = op.dot(q + g * D, k + t * D) * s;
  for (int64_t g = 0; g < G; ++g) softmax(scores.data() + g * L, L);
  std::fill(out, out + G * D, 0.f);
  for (int64_t t = 0; t < L; ++t)
    for (int64_t g = 0; g < G; ++g) op.axpy(scores[g * L + t], v + t * D, out + g * D);
}

template <class T>
void rows_typed(const at::Tensor& q, const T* kp, const T* vp, const at::Tensor& k,
                at::IntArrayRef starts, double scale, at::Tensor& out) {
  const int64_t B = q.size(0), Hkv = q.size(1), G = q.size(2), D = q.size(3), S = k.size(2);
  const int64_t row = k.stride(0), head = k.stride(1);  // v's strides are k's (checked)
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float s = static_cast<float>(scale);
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {  // one (row, head) per task
    std::vector<float> scores;
    auto heads = [&](const auto& dot) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t b = i / Hkv, h = i % Hkv, first = starts[b];
        const int64_t at = b * row + h * head + first * D;
        attend_head(dot, G, D, S - first, qp + i * G * D, kp + at, vp + at, s, op + i * G * D,
                    scores);
      }
    };
    switch (D % 16 ? 0 : D / 16) {
      case 1: heads(Vec<1>{}); break;
      case 2: heads(Vec<2>{}); break;
      case 4: heads(Vec<4>{}); break;
      case 8: heads(Vec<8>{}); break;
      default: heads(Plain{D});
    }
  });
}

at::Tensor rows_decode(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       at::IntArrayRef starts, double scale) {
  // q (B, Hkv, G, D) float contiguous; k, v (B, Hkv, S, D) float or bfloat16, each head's
  // tokens contiguous: checked by the Python caller (`paged_attention.decode_attention`), the
  // starts here. The result is float.
  const int64_t B = q.size(0), Hkv = q.size(1), G = q.size(2), D = q.size(3), S = k.size(2);
  TORCH_CHECK(static_cast<int64_t>(starts.size()) == B, "decode rows: ", starts.size(),
              " starts for ", B, " rows");
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(starts[b] >= 0 && starts[b] < S, "decode rows: row ", b, " starts at slot ",
                starts[b], ", outside [0, ", S, ")");
  at::Tensor out = at::empty_like(q);
  if (k.scalar_type() == at::kBFloat16)
    rows_typed(q, k.data_ptr<at::BFloat16>(), v.data_ptr<at::BFloat16>(), k, starts, scale, out);
  else
    rows_typed(q, k.data_ptr<float>(), v.data_ptr<float>(), k, starts, scale, out);
  return out;
}

}  // namespace

TORCH_LIBRARY(minifer_paged, m) {
  m.def("decode(Tensor q, Tensor k_pool, Tensor v_pool, Tensor block_table, Tensor lengths, "
        "float scale) -> Tensor");
  m.def("rows(Tensor q, Tensor k, Tensor v, int[] starts, float scale) -> Tensor");
  m.impl("decode", c10::DispatchKey::CPU, &paged_decode);
  m.impl("rows", c10::DispatchKey::CPU, &rows_decode);
}
