// softcap on CPU: y = cap * tanh(x / cap), float32, no autograd: the models' logit softcap where no
// gradient is wanted (decode steps, prefill, logits for evaluation and sampling).
//
// Why an op: torch.tanh on a CPU computes a libm-accurate tanh, and the division and product around
// it are two more passes (docs/measurements.md#a-one-row-decode-step-dispatch-not-bytes). Here one
// vectorised pass with simd.h's tanh (relative error ~1e-7), the same tanh of the same x / cap
// as the fused cross-entropy the model trains with. Each element alone: a row's result does not
// depend on the other rows.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>

#include "simd.h"

namespace nanochat_fast {
namespace {

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

TORCH_LIBRARY_IMPL(nanochat_fast, CPU, m) { m.impl("softcap", &softcap_cpu); }

}  // namespace nanochat_fast
