// The models' two row-wise functions where no gradient is wanted (decode steps, prefill, evaluation,
// sampling), float32, one pass each instead of a chain of ATen ops
// (docs/measurements.md#a-one-row-decode-step-dispatch-not-bytes):
//
// rms_norm: y = x / sqrt(mean(x^2 over the last dim) + eps), the parameter-free RMSNorm. One pass to
// sum the squares, one to scale; rows split across threads when there are enough of them. The sum of
// squares runs in `omp simd`'s fixed lane split: a row's result does not depend on the other rows or
// the number of threads.
//
// softcap: y = cap * tanh(x / cap), the logit softcap, with simd.h's tanh (relative error ~1e-7): the
// same tanh of the same x / cap as the fused cross-entropy the model trains with. Each element alone.
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

}  // namespace

void rms_norm_rows(const float* x, float* y, int64_t rows, int64_t C, float eps) {
  const int64_t grain = std::max<int64_t>(1, (1 << 15) / C);  // ~32K floats a thread at least
  at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) { norm_rows(x + r0 * C, y + r0 * C, r1 - r0, C, eps); });
}

TORCH_LIBRARY_IMPL(nanochat_fast, CPU, m) {
  m.impl("rms_norm", &rms_norm_cpu);
  m.impl("softcap", &softcap_cpu);
}

}  // namespace nanochat_fast
