// AdamW over a list of parameter slices on CPU, in one call: the tensors are cut into chunks and
// all chunks of all tensors go through a single at::parallel_for, so many small tensors cost no
// more thread launches than one big one. Math in fp32 (params fp32 or bf16, state fp32), the same
// sequence of operations as torch.optim.AdamW (decoupled decay, lerp for the first moment,
// bias corrections folded into the step size and the denominator).
// The divide by sqrt(bias_correction2) is a multiply by its reciprocal (a difference of at most
// one ulp): it removes one of the loop's two vector divides.
//
// The inner loop is plain scalar C++ written so that GCC vectorises it: __restrict__ pointers and
// -fno-math-errno (otherwise sqrtf must set errno and the loop stays scalar). It is compiled three
// times, for AVX-512 (x86-64-v4), AVX2+FMA (x86-64-v3) and the baseline, and the widest copy the CPU
// runs is picked once, at load, capped as torch caps its own kernels by ATEN_CPU_CAPABILITY
// ("avx2", "default"): that is how the AVX2 copy is tested on an AVX-512 CPU. On AVX-512 the
// 16-wide copy is what keeps the loop's sqrt and divide under the memory traffic
// (docs/measurements.md#adamw-on-a-cpu). GCC on x86-64 Linux; one plain copy elsewhere.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "adamw_slice.h"
#include "simd.h"

namespace nanochat_fast {
namespace {

constexpr int64_t kChunk = 1 << 16;  // elements per work item: big enough to amortise scheduling

struct Coeffs {
  float decay;         // 1 - lr * lr_mul * wd * wd_mul
  float beta1, beta2;
  float step_size;     // lr * lr_mul / bias_correction1
  float inv_bc2_sqrt;  // 1 / sqrt(1 - beta2^step): a multiply, not a second divide, per element
  float eps;
};

// bf16 <-> fp32 as c10::BFloat16 converts (round to nearest even, a NaN to 0x7FC0), written as integer
// ops on the bits: through c10's conversions GCC left the bf16 loop scalar in every copy.
NANOCHAT_FAST_INLINE float load_param(float x) { return x; }
NANOCHAT_FAST_INLINE float load_param(c10::BFloat16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
NANOCHAT_FAST_INLINE void store_param(float* p, float x) { *p = x; }
NANOCHAT_FAST_INLINE void store_param(c10::BFloat16* p, float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  const uint32_t nan = -static_cast<uint32_t>(x != x);
  p->x = static_cast<uint16_t>((0x7FC0u & nan) | (rounded & ~nan));
}

// One pass over a chunk: reads p, g, m, v and writes p, m, v (28 bytes an element for fp32 params,
// 24 for bf16), the least a step can move with fp32 state.
template <typename param_t>
NANOCHAT_FAST_INLINE void adamw_chunk(param_t* __restrict__ p, const param_t* __restrict__ g, float* __restrict__ m,
                                      float* __restrict__ v, int64_t n, Coeffs c) {
  const float one_minus_beta1 = 1.0f - c.beta1;
  const float one_minus_beta2 = 1.0f - c.beta2;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float gi = load_param(g[i]);
    const float mi = m[i] + one_minus_beta1 * (gi - m[i]);  // exp_avg.lerp_(grad, 1 - beta1)
    const float vi = c.beta2 * v[i] + one_minus_beta2 * gi * gi;
    m[i] = mi;
    v[i] = vi;
    const float denom = std::sqrt(vi) * c.inv_bc2_sqrt + c.eps;
    const float pi = load_param(p[i]) * c.decay;
    store_param(p + i, pi - c.step_size * (mi / denom));
  }
}

template <typename param_t>
using ChunkFn = void (*)(param_t*, const param_t*, float*, float*, int64_t, Coeffs);

template <typename param_t>
void chunk_baseline(param_t* p, const param_t* g, float* m, float* v, int64_t n, Coeffs c) {
  adamw_chunk(p, g, m, v, n, c);
}

#if NANOCHAT_FAST_HAS_CLONES
template <typename param_t>
NANOCHAT_FAST_TARGET("arch=x86-64-v3")
void chunk_avx2(param_t* p, const param_t* g, float* m, float* v, int64_t n, Coeffs c) {
  adamw_chunk(p, g, m, v, n, c);
}

template <typename param_t>
NANOCHAT_FAST_TARGET("arch=x86-64-v4")
void chunk_avx512(param_t* p, const param_t* g, float* m, float* v, int64_t n, Coeffs c) {
  adamw_chunk(p, g, m, v, n, c);
}
#endif

// The widest copy this CPU runs, no wider than ATEN_CPU_CAPABILITY allows (unset or "avx512": any).
template <typename param_t>
ChunkFn<param_t> chunk_for_this_cpu() {
#if NANOCHAT_FAST_HAS_CLONES
  const char* cap = std::getenv("ATEN_CPU_CAPABILITY");
  const bool upto_avx2 = cap != nullptr && std::strcmp(cap, "avx2") == 0;
  const bool baseline = cap != nullptr && std::strcmp(cap, "default") == 0;
  __builtin_cpu_init();
  if (!baseline && !upto_avx2 && __builtin_cpu_supports("x86-64-v4")) return chunk_avx512<param_t>;
  if (!baseline && __builtin_cpu_supports("x86-64-v3")) return chunk_avx2<param_t>;
#endif
  return chunk_baseline<param_t>;
}

const ChunkFn<float> chunk_f32 = chunk_for_this_cpu<float>();
const ChunkFn<c10::BFloat16> chunk_bf16 = chunk_for_this_cpu<c10::BFloat16>();

// A contiguous run of one tensor, with raw pointers resolved up front so the parallel region
// touches no Tensor objects.
struct WorkItem {
  void* p;
  const void* g;
  float* m;
  float* v;
  int64_t len;
  Coeffs c;
  bool bf16;
};

void adamw_slice_update_cpu(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                            at::TensorList exp_avg_sqs, const at::Tensor& hparams,
                            at::ArrayRef<double> lr_muls, at::ArrayRef<double> wd_muls) {
  check_adamw_slice_args(params, grads, exp_avgs, exp_avg_sqs, hparams, lr_muls, wd_muls,
                         c10::DeviceType::CPU);
  const at::Tensor hp = hparams.cpu();
  const double* h = hp.data_ptr<double>();

  std::vector<WorkItem> items;
  for (size_t t = 0; t < params.size(); ++t) {
    const double lr = h[kLr] * lr_muls[t];
    const double wd = h[kWeightDecay] * wd_muls[t];
    const Coeffs c{static_cast<float>(1.0 - lr * wd), static_cast<float>(h[kBeta1]),
                   static_cast<float>(h[kBeta2]), static_cast<float>(lr / h[kBiasCorrection1]),
                   static_cast<float>(1.0 / h[kBiasCorrection2Sqrt]), static_cast<float>(h[kEps])};
    const bool bf16 = params[t].scalar_type() == at::kBFloat16;
    const int64_t elem = params[t].element_size();
    char* p = static_cast<char*>(params[t].data_ptr());
    const char* g = static_cast<const char*>(grads[t].data_ptr());
    float* m = exp_avgs[t].data_ptr<float>();
    float* v = exp_avg_sqs[t].data_ptr<float>();
    const int64_t numel = params[t].numel();
    for (int64_t b = 0; b < numel; b += kChunk)
      items.push_back({p + b * elem, g + b * elem, m + b, v + b, std::min(kChunk, numel - b), c, bf16});
  }

  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t lo, int64_t hi) {
    for (int64_t k = lo; k < hi; ++k) {
      const WorkItem& w = items[k];
      if (w.bf16)
        chunk_bf16(static_cast<c10::BFloat16*>(w.p), static_cast<const c10::BFloat16*>(w.g), w.m, w.v, w.len, w.c);
      else
        chunk_f32(static_cast<float*>(w.p), static_cast<const float*>(w.g), w.m, w.v, w.len, w.c);
    }
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(nanochat_fast, CPU, m) {
  m.impl("adamw_slice_update", &adamw_slice_update_cpu);
}

}  // namespace nanochat_fast
