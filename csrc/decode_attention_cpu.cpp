// decode_attention on CPU: one query token per row attending to its own cached keys and values,
// read in place from the continuous-batching cache (model/kv_cache.py's SlotBatch).
//
//   out[b, h] = softmax(q[b, h] . keys[rows[b], h / g, s:lengths[b]] * scale) @ values[rows[b], h / g, s:lengths[b]]
//
// with g = H / Hkv query heads per key head (grouped-query attention) and s = starts[b] (0 without
// starts: a sliding window's rows begin their entries later). Why not SDPA: a decode step
// of B rows at different lengths needs a mask over the block of slots up to the longest row, and
// CPU SDPA (flash or math) then spent ~2x the time it takes just to read those keys and values;
// the cache does not fit in the caches next to the weights, so the read is the cost. Here each
// (row, head) reads only its own valid entries, once: a pass of dot products for the scores, a
// pass over the values weighted by exp(score - max). The figures: benchmarks/bench_decode_step.py.
//
// Batch invariance: a (row, head) reads nothing of the other rows and sums in a fixed order (its
// entries in order; within a dot product, `omp simd`'s fixed lane split of the head dimension), so
// its result is bitwise the same whoever shares the step. Math is fp32.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

#include "target_clones.h"

namespace nanochat_fast {
namespace {

struct Strides {  // element strides of keys / values [S, Hkv, L, D] (D contiguous)
  int64_t slot, head, pos;
};

// One (row, head): scores into `scores` (lengths entries), the output head into out[0:D].
NANOCHAT_FAST_CLONES("arch=x86-64-v4", "arch=x86-64-v3", "default")
void attend_one(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
                Strides ks, Strides vs, int64_t length, int64_t D, float scale, float* __restrict__ scores,
                float* __restrict__ out) {
  float top = -std::numeric_limits<float>::infinity();
  for (int64_t l = 0; l < length; ++l) {
    const float* kl = k + l * ks.pos;
    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
    for (int64_t d = 0; d < D; ++d) dot += q[d] * kl[d];
    scores[l] = dot * scale;
    top = std::max(top, scores[l]);
  }
  float total = 0.0f;
  for (int64_t l = 0; l < length; ++l) {
    scores[l] = std::exp(scores[l] - top);
    total += scores[l];
  }
  for (int64_t d = 0; d < D; ++d) out[d] = 0.0f;
  for (int64_t l = 0; l < length; ++l) {
    const float* vl = v + l * vs.pos;
    const float p = scores[l];
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) out[d] += p * vl[d];
  }
  const float inv = 1.0f / total;
  for (int64_t d = 0; d < D; ++d) out[d] *= inv;
}

at::Tensor decode_attention_cpu(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                                const at::Tensor& rows, const at::Tensor& lengths, double scale,
                                const std::optional<at::Tensor>& starts) {
  TORCH_CHECK(q.dim() == 3 && keys.dim() == 4 && values.dim() == 4,
              "decode_attention: q must be [B, H, D] and keys, values [S, Hkv, L, D]");
  TORCH_CHECK(q.scalar_type() == at::kFloat && keys.scalar_type() == at::kFloat && values.scalar_type() == at::kFloat,
              "decode_attention: q, keys and values must be float32");
  TORCH_CHECK(keys.sizes() == values.sizes(), "decode_attention: keys ", keys.sizes(), " and values ",
              values.sizes(), " differ in shape");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t S = keys.size(0), Hkv = keys.size(1), L = keys.size(2);
  TORCH_CHECK(keys.size(3) == D && Hkv > 0 && H % Hkv == 0, "decode_attention: keys [S, Hkv, L, D] with D = ", D,
              " and Hkv dividing H = ", H, ", got ", keys.sizes());
  TORCH_CHECK(keys.stride(3) == 1 && values.stride(3) == 1, "decode_attention: keys and values need a contiguous last dim");
  TORCH_CHECK(rows.scalar_type() == at::kLong && lengths.scalar_type() == at::kLong && rows.dim() == 1 &&
                  lengths.dim() == 1 && rows.size(0) == B && lengths.size(0) == B,
              "decode_attention: rows and lengths must be int64 [B] with B = ", B);
  TORCH_CHECK(!starts.has_value() || (starts->scalar_type() == at::kLong && starts->dim() == 1 && starts->size(0) == B),
              "decode_attention: starts must be int64 [B] with B = ", B);
  const at::Tensor qc = q.contiguous(), rc = rows.contiguous(), lc = lengths.contiguous();
  const at::Tensor sc = starts.has_value() ? starts->contiguous() : at::zeros({B}, rows.options());
  const int64_t* row = rc.const_data_ptr<int64_t>();
  const int64_t* len = lc.const_data_ptr<int64_t>();
  const int64_t* start = sc.const_data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(0 <= row[b] && row[b] < S, "decode_attention: rows[", b, "] = ", row[b], " is outside [0, ", S, ")");
    TORCH_CHECK(1 <= len[b] && len[b] <= L, "decode_attention: lengths[", b, "] = ", len[b], " is outside [1, ", L, "]");
    TORCH_CHECK(0 <= start[b] && start[b] < len[b], "decode_attention: starts[", b, "] = ", start[b],
                " is outside [0, lengths[", b, "] = ", len[b], ")");
  }
  at::Tensor out = at::empty({B, H, D}, q.options());
  const Strides ks{keys.stride(0), keys.stride(1), keys.stride(2)};
  const Strides vs{values.stride(0), values.stride(1), values.stride(2)};
  const float* qp = qc.const_data_ptr<float>();
  const float* kp = keys.const_data_ptr<float>();
  const float* vp = values.const_data_ptr<float>();
  float* op = out.mutable_data_ptr<float>();
  const int64_t group = H / Hkv;
  at::parallel_for(0, B * H, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> scores(L);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / H, h = i % H, kvh = h / group;
      const int64_t s = start[b];
      attend_one(qp + i * D, kp + row[b] * ks.slot + kvh * ks.head + s * ks.pos,
                 vp + row[b] * vs.slot + kvh * vs.head + s * vs.pos, ks, vs, len[b] - s, D, static_cast<float>(scale),
                 scores.data(), op + i * D);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(nanochat_fast, CPU, m) { m.impl("decode_attention", &decode_attention_cpu); }

}  // namespace nanochat_fast
