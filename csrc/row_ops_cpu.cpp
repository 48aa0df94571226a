// The models' row-wise ops where no gradient is wanted, float32, one pass each instead of a chain of
// ATen ops on a few hundred floats (docs/measurements.md#a-one-row-decode-step-dispatch-not-bytes):
//
// rms_norm (decode steps, prefill, evaluation): y = x / sqrt(mean(x^2 over the last dim) + eps), the
// parameter-free RMSNorm. One pass to sum the squares, one to scale; rows split across threads when
// there are enough of them. The sum of squares runs in `omp simd`'s fixed lane split: a row's result
// does not depend on the other rows or the number of threads.
//
// softcap (decode steps, sampling, evaluation): y = cap * tanh(x / cap), the logit softcap, with
// simd.h's tanh (relative error ~1e-7): the same tanh of the same x / cap as the fused cross-entropy
// the model trains with. Each element alone.
//
// smear_decode: the windowed family's smear for a decode step's rows, one new token each:
// y[b] = x[b] + lambda * sigmoid(x[b, :G] . gate_weight) * previous[rows[b]], then previous[rows[b]] =
// x[b] (the embedding the row's next step mixes in). Each row reads and writes its own slot alone; the
// rows go one after another, so a slot's several rows (a prompt's positions, in order) each mix in
// the embedding of the row before. The gate's sigmoid uses std::exp, as decode_block's value-embedding
// gate does.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "decode_step.h"
#include "simd.h"

namespace nanochat_fast {
namespace {

NANOCHAT_FAST_CLONES("arch=x86-64-v4", "arch=x86-64-v3", "default")
void norm_rows(const float* __restrict__ x, float* __restrict__ y, int64_t rows, int64_t C, float eps) {
  for (int64_t r = 0; r < rows; ++r, x += C, y += C) {
    float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
    for (int64_t c = 0; c < C; ++c) squares += x[c] * x[c];
    const float inv_rms = 1.0f / std::sqrt(squares / static_cast<float>(C) + eps);
#pragma omp simd
    for (int64_t c = 0; c < C; ++c) y[c] = x[c] * inv_rms;
  }
}

at::Tensor rms_norm_cpu(const at::Tensor& x, double eps) {
  TORCH_CHECK(x.dim() >= 1 && x.scalar_type() == at::kFloat, "rms_norm: x must be float32 of at least 1 dim, got ",
              x.scalar_type(), " of ", x.dim());
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty_like(xc);
  const int64_t C = x.size(-1), rows = C == 0 ? 0 : xc.numel() / C;
  if (rows == 0) return y;
  rms_norm_rows(xc.const_data_ptr<float>(), y.mutable_data_ptr<float>(), rows, C, static_cast<float>(eps));
  return y;
}

NANOCHAT_FAST_CLONES("arch=x86-64-v4", "arch=x86-64-v3", "default")
void softcap_range(const float* __restrict__ x, float* __restrict__ y, int64_t n, float cap) {
  const float inv_cap = 1.0f / cap;  // x / cap as the fused cross-entropy makes it: a product (a division: +15%)
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] = cap * tanh_approx(x[i] * inv_cap);
}

at::Tensor softcap_cpu(const at::Tensor& x, double cap) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "softcap: x must be float32, got ", x.scalar_type());
  TORCH_CHECK(cap > 0, "softcap: cap must be > 0, got ", cap);
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty_like(xc);
  const float* src = xc.const_data_ptr<float>();
  float* dst = y.mutable_data_ptr<float>();
  at::parallel_for(0, xc.numel(), 1 << 16, [&](int64_t i0, int64_t i1) {
    softcap_range(src + i0, dst + i0, i1 - i0, static_cast<float>(cap));
  });
  return y;
}

at::Tensor smear_decode_cpu(const at::Tensor& x, at::Tensor& previous, const at::Tensor& rows,
                            const at::Tensor& gate_weight, const at::Tensor& gate_lambda) {
  TORCH_CHECK(x.dim() == 3 && x.size(1) == 1 && x.scalar_type() == at::kFloat,
              "smear_decode: x must be float32 [B, 1, C], got ", x.scalar_type(), " ", x.sizes());
  const int64_t B = x.size(0), C = x.size(2);
  TORCH_CHECK(previous.dim() == 2 && previous.size(1) == C && previous.scalar_type() == at::kFloat &&
                  previous.is_contiguous(),
              "smear_decode: previous must be contiguous float32 [slots, ", C, "], got ", previous.scalar_type(), " ",
              previous.sizes());
  TORCH_CHECK(rows.dim() == 1 && rows.size(0) == B && rows.scalar_type() == at::kLong,
              "smear_decode: rows must be int64 [", B, "], got ", rows.scalar_type(), " ", rows.sizes());
  TORCH_CHECK(gate_weight.dim() == 2 && gate_weight.size(0) == 1 && gate_weight.size(1) <= C &&
                  gate_weight.scalar_type() == at::kFloat,
              "smear_decode: gate_weight must be float32 [1, G <= ", C, "], got ", gate_weight.scalar_type(), " ",
              gate_weight.sizes());
  TORCH_CHECK(gate_lambda.numel() == 1 && gate_lambda.scalar_type() == at::kFloat,
              "smear_decode: gate_lambda must be one float32, got ", gate_lambda.scalar_type(), " ",
              gate_lambda.sizes());
  const at::Tensor xc = x.contiguous(), wc = gate_weight.contiguous(), rc = rows.contiguous();
  at::Tensor y = at::empty_like(xc);
  const float *src = xc.const_data_ptr<float>(), *w = wc.const_data_ptr<float>();
  const int64_t* slot = rc.const_data_ptr<int64_t>();
  const int64_t G = wc.size(1), S = previous.size(0);
  const float lambda = *gate_lambda.contiguous().const_data_ptr<float>();
  float *prev = previous.mutable_data_ptr<float>(), *dst = y.mutable_data_ptr<float>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(0 <= slot[b] && slot[b] < S, "smear_decode: rows[", b, "] = ", slot[b], " is not a slot in [0, ", S, ")");
    const float* xb = src + b * C;
    float* pb = prev + slot[b] * C;
    float s = 0.0f;
    for (int64_t c = 0; c < G; ++c) s += xb[c] * w[c];
    const float g = lambda * (1.0f / (1.0f + std::exp(-s)));
    for (int64_t c = 0; c < C; ++c) {
      dst[b * C + c] = xb[c] + g * pb[c];
      pb[c] = xb[c];
    }
  }
  return y;
}

}  // namespace

void rms_norm_rows(const float* x, float* y, int64_t rows, int64_t C, float eps) {
  const int64_t grain = std::max<int64_t>(1, (1 << 15) / C);  // ~32K floats a thread at least
  at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) { norm_rows(x + r0 * C, y + r0 * C, r1 - r0, C, eps); });
}

TORCH_LIBRARY_IMPL(nanochat_fast, CPU, m) {
  m.impl("rms_norm", &rms_norm_cpu);
  m.impl("softcap", &softcap_cpu);
  m.impl("smear_decode", &smear_decode_cpu);
}

}  // namespace nanochat_fast
