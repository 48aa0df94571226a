// Layout of the float64 `hparams` tensor of nanochat_fast::adamw_slice_update. Plain C++ with no
// torch includes, so the CUDA kernel (csrc/cuda/adamw_slice.cu) can share it.
#pragma once

namespace nanochat_fast {
enum AdamWHParam : int {
  kLr = 0,
  kBeta1 = 1,
  kBeta2 = 2,
  kEps = 3,
  kWeightDecay = 4,
  kBiasCorrection1 = 5,      // 1 - beta1^step
  kBiasCorrection2Sqrt = 6,  // sqrt(1 - beta2^step)
  kNumAdamWHParams = 7,
};
}  // namespace nanochat_fast
