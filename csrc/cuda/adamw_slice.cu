// CUDA AdamW over many tensors in one launch (multi-tensor apply): thread block b updates block b
// of the table built by the host. fp32 math; bf16 params are read, updated in fp32 and rounded to
// nearest even on store; optimizer state is fp32. Includes CUDA headers only (see the .h).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "../adamw_slice_hparams.h"
#include "adamw_slice_launch.h"

namespace nanochat_fast {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ void store(float* p, float x) { *p = x; }
__device__ __forceinline__ void store(__nv_bfloat16* p, float x) { *p = __float2bfloat16_rn(x); }

template <typename param_t>
__global__ void __launch_bounds__(kThreads)
adamw_slice_kernel(const int64_t* __restrict__ table, const float* __restrict__ muls,
                   const int64_t* __restrict__ blocks, const double* __restrict__ hparams,
                   int64_t n_tensors, int64_t n_blocks) {
  const int64_t b = blockIdx.x;
  const int64_t t = blocks[b];
  const int64_t start = blocks[n_blocks + b];
  param_t* __restrict__ p = reinterpret_cast<param_t*>(table[t]);
  const param_t* __restrict__ g = reinterpret_cast<const param_t*>(table[n_tensors + t]);
  float* __restrict__ m = reinterpret_cast<float*>(table[2 * n_tensors + t]);
  float* __restrict__ v = reinterpret_cast<float*>(table[3 * n_tensors + t]);
  const int64_t numel = table[4 * n_tensors + t];
  const int64_t end = start + kAdamWCudaBlockElems < numel ? start + kAdamWCudaBlockElems : numel;

  // Per-tensor scalars in double, as torch computes them on the host, then fp32 for the loop (the
  // lr/wd multipliers arrive rounded to fp32; the model's are all 1.0).
  const double lr = hparams[kLr] * static_cast<double>(muls[t]);
  const double wd = hparams[kWeightDecay] * static_cast<double>(muls[n_tensors + t]);
  const float decay = static_cast<float>(1.0 - lr * wd);
  const float step_size = static_cast<float>(lr / hparams[kBiasCorrection1]);
  const float inv_bc2_sqrt = static_cast<float>(1.0 / hparams[kBiasCorrection2Sqrt]);
  const float beta1 = static_cast<float>(hparams[kBeta1]);
  const float beta2 = static_cast<float>(hparams[kBeta2]);
  const float eps = static_cast<float>(hparams[kEps]);

  for (int64_t i = start + threadIdx.x; i < end; i += kThreads) {  // coalesced: consecutive threads
    const float gi = to_float(g[i]);
    const float mi = m[i] + (1.0f - beta1) * (gi - m[i]);
    const float vi = beta2 * v[i] + (1.0f - beta2) * gi * gi;
    m[i] = mi;
    v[i] = vi;
    const float denom = sqrtf(vi) * inv_bc2_sqrt + eps;
    store(p + i, to_float(p[i]) * decay - step_size * (mi / denom));
  }
}

}  // namespace

cudaError_t launch_adamw_slice_update(bool params_bf16, const int64_t* table, const float* muls,
                                      const int64_t* blocks, const double* hparams,
                                      int64_t n_tensors, int64_t n_blocks, cudaStream_t stream) {
  if (n_blocks == 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned int>(n_blocks));
  if (params_bf16)
    adamw_slice_kernel<__nv_bfloat16><<<grid, kThreads, 0, stream>>>(table, muls, blocks, hparams, n_tensors, n_blocks);
  else
    adamw_slice_kernel<float><<<grid, kThreads, 0, stream>>>(table, muls, blocks, hparams, n_tensors, n_blocks);
  return cudaGetLastError();
}

}  // namespace nanochat_fast
