// softcap_cross_entropy on CPU: the loss (and, when asked, its gradients) from hidden [N, d] and
// weight [V, d] in chunks of rows, never holding more than one chunk of logits:
//
//   z = hidden[chunk] @ weight^T                          at::mm_out (MKL / oneDNN)
//   one pass per row of z (at::parallel_for over rows):   softcap, logsumexp, target pick -> loss,
//       and dz = g (softmax - onehot) (1 - tanh^2) written over z
//   dhidden[chunk] = dz @ weight;  dweight += dz^T @ hidden[chunk]
//
// Stock PyTorch spends more time on the elementwise work around the lm_head than on its matmuls:
// tanh, log_softmax and their backwards are separate memory-bound passes over N x V fp32 tensors.
// Here each logit is read once and its gradient written once: per row, one loop computes tanh, exp
// and their sum into two row-sized scratch buffers (they stay in L1/L2), a second writes dz from them.
//
// tanh and exp are inline polynomial approximations (simd.h) that GCC vectorises (libm's calls
// would keep the loops scalar); target_clones adds an AVX2+FMA copy picked at load time
// (see simd.h).
// Math is fp32 for fp32 and bf16 inputs; bf16 logits and gradients are rounded to nearest even.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "simd.h"

namespace nanochat_fast {
namespace {

NANOCHAT_FAST_INLINE float to_float(float x) { return x; }
NANOCHAT_FAST_INLINE float to_float(c10::BFloat16 x) { return static_cast<float>(x); }

NANOCHAT_FAST_INLINE void store(float* p, float v) { *p = v; }

// fp32 -> bf16 rounded to nearest even (NaN -> the quiet NaN), as c10::BFloat16 does, but without
// its NaN branch, so the loop storing it vectorises.
NANOCHAT_FAST_INLINE void store(c10::BFloat16* p, float v) {
  const int32_t b = float_bits(v);
  const int32_t rounded = static_cast<int32_t>((static_cast<uint32_t>(b) + 0x7FFFu + ((b >> 16) & 1)) >> 16);
  const int32_t nan = -static_cast<int32_t>(v != v);
  p->x = static_cast<uint16_t>((rounded & ~nan) | (0x7FC0 & nan));
}

// The logsumexp shift, in units of softcap (y = softcap * t with t = tanh(z / softcap) in (-1, 1)).
// 1 bounds every t: with it, e = exp(softcap * (t - 1)) needs no max pass and never overflows, and
// the largest term is >= exp(-2 softcap), a normal float while 2 softcap < 87 (exp_approx's clamp).
// A larger softcap takes the row's own maximum (an extra, unvectorised pass: max of floats is not a
// reduction GCC vectorises without -ffast-math).
constexpr float kMaxFixedShiftSoftcap = 43.0f;

template <typename scalar_t>
float row_shift(const scalar_t* __restrict__ z, int64_t n, float softcap) {
  if (softcap <= kMaxFixedShiftSoftcap) return 1.0f;
  float z_max = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < n; ++j) z_max = std::max(z_max, to_float(z[j]));
  return tanh_approx(z_max / softcap);
}

// t[j] = tanh(z[j] / softcap), e[j] = exp(softcap * (t[j] - shift)); returns the sum of e.
template <typename scalar_t>
NANOCHAT_FAST_CLONES("arch=x86-64-v3", "default") float softcap_exp_row(
    const scalar_t* __restrict__ z, float* __restrict__ t, float* __restrict__ e, int64_t n, float softcap,
    float shift) {
  const float inv_cap = 1.0f / softcap;
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < n; ++j) {
    t[j] = tanh_approx(to_float(z[j]) * inv_cap);
    e[j] = exp_approx(softcap * (t[j] - shift));
    sum += e[j];
  }
  return sum;
}

// dz[j] = coef * e[j] * (1 - t[j]^2), with coef = g / sum: the softmax part of the gradient. The
// target's -g (1 - t^2) is added by the caller.
template <typename scalar_t>
NANOCHAT_FAST_CLONES("arch=x86-64-v3", "default") void dlogits_row(
    scalar_t* __restrict__ dz, const float* __restrict__ t, const float* __restrict__ e, int64_t n, float coef) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) store(dz + j, coef * e[j] * (1.0f - t[j] * t[j]));
}

// Losses of rows [lo, hi) of a chunk z [rows, V] (and dz over z when scale != nullptr).
template <typename scalar_t>
void chunk_rows_pass(scalar_t* z, int64_t lo, int64_t hi, int64_t V, const int64_t* targets,
                     const float* scale, int64_t scale_stride, float* losses, float softcap,
                     int64_t ignore_index) {
  std::vector<float> t(V), e(V);  // row scratch, reused for every row of this thread's range
  for (int64_t r = lo; r < hi; ++r) {
    scalar_t* row = z + r * V;
    const int64_t target = targets[r];
    const bool valid = target != ignore_index;
    const float shift = row_shift(row, V, softcap);
    const float sum = softcap_exp_row(row, t.data(), e.data(), V, softcap, shift);
    // -log softmax[target] = log(sum) - softcap (t[target] - shift): t - shift is exact when close to
    // 0, so a confident prediction's small loss keeps its precision
    losses[r] = valid ? std::log(sum) - softcap * (t[target] - shift) : 0.0f;
    if (scale == nullptr) continue;
    const float g = valid ? scale[r * scale_stride] : 0.0f;
    dlogits_row(row, t.data(), e.data(), V, g / sum);
    if (valid) store(row + target, g * (e[target] / sum - 1.0f) * (1.0f - t[target] * t[target]));
  }
}

void check_args(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets, double softcap,
                int64_t ignore_index, const std::optional<at::Tensor>& grad_scale, int64_t chunk_rows) {
  TORCH_CHECK(hidden.dim() == 2 && weight.dim() == 2 && weight.size(1) == hidden.size(1),
              "softcap_cross_entropy: hidden must be [N, d] and weight [V, d], got ", hidden.sizes(), " and ",
              weight.sizes());
  TORCH_CHECK(hidden.scalar_type() == weight.scalar_type() &&
                  (hidden.scalar_type() == at::kFloat || hidden.scalar_type() == at::kBFloat16),
              "softcap_cross_entropy: hidden and weight must both be float32 or both bfloat16, got ",
              hidden.scalar_type(), " and ", weight.scalar_type());
  TORCH_CHECK(targets.dim() == 1 && targets.size(0) == hidden.size(0) && targets.scalar_type() == at::kLong,
              "softcap_cross_entropy: targets must be int64 [N] with N = ", hidden.size(0));
  for (const at::Tensor* t : {&hidden, &weight, &targets}) {
    TORCH_CHECK(t->device().is_cpu(), "softcap_cross_entropy: the CPU op got a tensor on ", t->device());
    TORCH_CHECK(t->is_contiguous(), "softcap_cross_entropy: hidden, weight and targets must be contiguous");
  }
  TORCH_CHECK(softcap > 0 && std::isfinite(softcap), "softcap_cross_entropy: softcap must be finite and > 0, got ",
              softcap);
  TORCH_CHECK(chunk_rows >= 1, "softcap_cross_entropy: chunk_rows must be >= 1, got ", chunk_rows);
  if (grad_scale.has_value()) {
    const at::Tensor& g = *grad_scale;
    TORCH_CHECK(g.scalar_type() == at::kFloat && g.device().is_cpu() && (g.numel() == 1 || g.dim() == 1) &&
                    (g.numel() == 1 || g.size(0) == hidden.size(0)),
                "softcap_cross_entropy: grad_scale must be a float32 CPU tensor of 1 or N elements");
  }
  const int64_t V = weight.size(0);
  const int64_t* tg = targets.data_ptr<int64_t>();
  for (int64_t i = 0; i < targets.numel(); ++i)
    TORCH_CHECK(tg[i] == ignore_index || (tg[i] >= 0 && tg[i] < V), "softcap_cross_entropy: targets[", i,
                "] = ", tg[i], " is outside [0, ", V, ") and is not ignore_index = ", ignore_index);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> softcap_cross_entropy_cpu(
    const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets, double softcap,
    int64_t ignore_index, const std::optional<at::Tensor>& grad_scale, int64_t chunk_rows) {
  check_args(hidden, weight, targets, softcap, ignore_index, grad_scale, chunk_rows);
  // The matmuls below run in the inputs' dtype whatever the caller's autocast state (the Python
  // wrapper casts for autocast before calling): dz in fp32 must not be cast down by an mm.
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  const int64_t N = hidden.size(0), V = weight.size(0);
  const bool bf16 = hidden.scalar_type() == at::kBFloat16;
  at::Tensor losses = at::empty({N}, hidden.options().dtype(at::kFloat));
  at::Tensor buf = at::empty({std::min(chunk_rows, N), V}, hidden.options());
  at::Tensor scale, dhidden, dweight;
  const float* scale_ptr = nullptr;
  int64_t scale_stride = 0;
  if (grad_scale.has_value()) {
    scale = grad_scale->contiguous();
    scale_ptr = scale.data_ptr<float>();
    scale_stride = scale.numel() == 1 ? 0 : 1;
    dhidden = at::empty_like(hidden);
    dweight = at::zeros(weight.sizes(), weight.options().dtype(at::kFloat));
  } else {
    dhidden = at::empty({0}, hidden.options());
    dweight = at::empty({0}, weight.options());
  }
  const at::Tensor weight_t = weight.t();
  const int64_t* tg = targets.data_ptr<int64_t>();
  float* loss_ptr = losses.data_ptr<float>();
  const float cap = static_cast<float>(softcap);
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(V, 1));  // >= ~16K elements per task

  for (int64_t r0 = 0; r0 < N; r0 += chunk_rows) {
    const int64_t rows = std::min(chunk_rows, N - r0);
    const at::Tensor h = hidden.narrow(0, r0, rows);
    at::Tensor z = buf.narrow(0, 0, rows);
    at::mm_out(z, h, weight_t);
    const float* sc = scale_ptr == nullptr ? nullptr : scale_ptr + r0 * scale_stride;
    at::parallel_for(0, rows, grain, [&](int64_t lo, int64_t hi) {
      if (bf16)
        chunk_rows_pass(z.data_ptr<c10::BFloat16>(), lo, hi, V, tg + r0, sc, scale_stride, loss_ptr + r0, cap,
                        ignore_index);
      else
        chunk_rows_pass(z.data_ptr<float>(), lo, hi, V, tg + r0, sc, scale_stride, loss_ptr + r0, cap,
                        ignore_index);
    });
    if (scale_ptr == nullptr) continue;
    at::Tensor dh = dhidden.narrow(0, r0, rows);
    at::mm_out(dh, z, weight);
    if (bf16)
      dweight.add_(at::mm(z.t(), h));  // bf16 matmul, summed over chunks in fp32
    else
      dweight.addmm_(z.t(), h);
  }
  at::Tensor total = scale_ptr == nullptr ? losses.sum() : (losses * scale).sum();
  if (bf16 && scale_ptr != nullptr) dweight = dweight.to(at::kBFloat16);
  return {losses, total, dhidden, dweight};
}

}  // namespace

TORCH_LIBRARY_IMPL(nanochat_fast, CPU, m) {
  m.impl("softcap_cross_entropy", &softcap_cross_entropy_cpu);
}

}  // namespace nanochat_fast
