// Host entry point of the CUDA AdamW kernel: raw pointers and a stream only, so that the .cu file
// needs nothing but the CUDA toolkit (it compiles with plain `nvcc -c`). The torch binding lives in
// adamw_slice_cuda.cpp, which only the CUDA build of the extension compiles.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace nanochat_fast {

// Elements of one tensor handled by one thread block (the host cuts tensors into such blocks).
constexpr int64_t kAdamWCudaBlockElems = 4096;

// table:   int64[5, n_tensors]  param, grad, exp_avg, exp_avg_sq device pointers; numel
// muls:    float32[2, n_tensors] lr_mul, wd_mul
// blocks:  int64[2, n_blocks]   tensor index, first element of the block
// hparams: float64[7]           see ../adamw_slice_hparams.h (device memory: no host sync)
// All four arrays live in device memory. params/grads are bf16 when params_bf16, else fp32.
cudaError_t launch_adamw_slice_update(bool params_bf16, const int64_t* table, const float* muls,
                                      const int64_t* blocks, const double* hparams,
                                      int64_t n_tensors, int64_t n_blocks, cudaStream_t stream);

}  // namespace nanochat_fast
