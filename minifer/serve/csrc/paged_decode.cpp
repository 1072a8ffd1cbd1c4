// Decode attention over the paged K/V pool, reading every cached key and value where it lies.
//
// The same computation as minifer/serve/paged_attention.py's `paged_decode_attention` (the
// readable reference it is tested against): for each row b and K/V head h, score the row's
// lengths[b] cached keys against the query heads that share h, softmax, and sum the values.
// A token t of row b sits in block block_table[b][t / block_size], slot t % block_size, so the
// loops follow the block table instead of first copying the row's K/V into one run (what the
// eager path must do). Rows are split over torch's threads (at::parallel_for).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

constexpr int64_t kAhead = 4;  // tokens between a prefetch and its use

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                        const at::Tensor& block_table, const at::Tensor& lengths, double scale) {
  // shapes, dtypes and contiguity are checked by the Python caller (PagedDecodeKernel)
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t block_size = k_pool.size(1), Hkv = k_pool.size(2), M = block_table.size(1);
  const int64_t G = H / Hkv;  // query heads per K/V head (grouped-query attention)
  at::Tensor out = at::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = k_pool.data_ptr<float>();
  const float* vp = v_pool.data_ptr<float>();
  const int64_t* table = block_table.data_ptr<int64_t>();
  const int64_t* len = lengths.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float s = static_cast<float>(scale);
  for (int64_t b = 0; b < B; ++b)  // the loops below read raw memory: indices checked first
    TORCH_CHECK(len[b] >= 1 && len[b] <= M * block_size, "paged decode: row ", b, " length ",
                len[b], " outside [1, ", M * block_size, "]");
  for (int64_t j = 0; j < B * M; ++j)
    TORCH_CHECK(table[j] >= 0 && table[j] < k_pool.size(0), "paged decode: block id ", table[j],
                " outside [0, ", k_pool.size(0), ")");

  // one row per task: a token's keys (or values) for every head are one contiguous run of
  // n_kv_head * head_dim numbers, read in one pass
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc(H * D);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t L = len[b];
      const float* qb = qp + b * H * D;
      // token t = j * block_size + r sits in slot r of block table[b * M + j]: walk the table
      // block by block
      const int64_t* blocks = table + b * M;
      const int64_t run = Hkv * D;  // one token's keys (or values), every head
      // The pool comes from memory, not cache (a step reads every layer's pool and the weights
      // in between), and a row's blocks lie anywhere: the hardware prefetcher, which follows
      // one run and stops at page ends, leaves each new block's first reads waiting. So the
      // key pass asks for the keys and values kAhead tokens on, the value pass for the values.
      auto for_each_token = [&](const float* pool, auto&& visit) {
        for (int64_t j = 0, t = 0; t < L; ++j) {
          const float* base = pool + blocks[j] * block_size * run;
          for (int64_t r = 0; r < block_size && t < L; ++r, ++t) {
            const int64_t ahead = t + kAhead;
            if (ahead < L) {
              const int64_t at =
                  (blocks[ahead / block_size] * block_size + ahead % block_size) * run;
              for (int64_t i = 0; i < run; i += 16) __builtin_prefetch(pool + at + i);  // a line
              if (pool == kp)
                for (int64_t i = 0; i < run; i += 16) __builtin_prefetch(vp + at + i, 0, 2);
            }
            visit(t, base + r * run);
          }
        }
      };
      scores.resize(H * L);  // scores[head * L + t]
      for_each_token(kp, [&](int64_t t, const float* k) {
        for (int64_t hq = 0; hq < H; ++hq) {
          const float* qh = qb + hq * D;
          const float* kh = k + (hq / G) * D;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < D; ++d) dot += qh[d] * kh[d];
          scores[hq * L + t] = dot * s;
        }
      });
      for (int64_t hq = 0; hq < H; ++hq) {  // softmax over the row's tokens
        float* sh = scores.data() + hq * L;
        const float mx = *std::max_element(sh, sh + L);
        float sum = 0.f;
        for (int64_t t = 0; t < L; ++t) sum += (sh[t] = std::exp(sh[t] - mx));
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < L; ++t) sh[t] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for_each_token(vp, [&](int64_t t, const float* v) {
        for (int64_t hq = 0; hq < H; ++hq) {
          const float w = scores[hq * L + t];
          const float* vh = v + (hq / G) * D;
          float* a = acc.data() + hq * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) a[d] += w * vh[d];
        }
      });
      std::copy(acc.begin(), acc.end(), op + b * H * D);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(minifer_paged, m) {
  m.def("decode(Tensor q, Tensor k_pool, Tensor v_pool, Tensor block_table, Tensor lengths, "
        "float scale) -> Tensor");
  m.impl("decode", c10::DispatchKey::CPU, &paged_decode);
}
