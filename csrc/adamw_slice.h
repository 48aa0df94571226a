// Argument checks shared by the CPU and CUDA implementations of adamw_slice_update.
#pragma once
#include <ATen/ATen.h>

#include "adamw_slice_hparams.h"

namespace nanochat_fast {

inline void check_adamw_slice_args(at::TensorList params, at::TensorList grads,
                                   at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                                   const at::Tensor& hparams, at::ArrayRef<double> lr_muls,
                                   at::ArrayRef<double> wd_muls, c10::DeviceType device_type) {
  const size_t n = params.size();
  TORCH_CHECK(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n &&
                  lr_muls.size() == n && wd_muls.size() == n,
              "adamw_slice_update: params, grads, exp_avgs, exp_avg_sqs, lr_muls and wd_muls must "
              "have the same length");
  TORCH_CHECK(hparams.scalar_type() == at::kDouble && hparams.numel() == kNumAdamWHParams,
              "adamw_slice_update: hparams must be float64[", int(kNumAdamWHParams), "]");
  if (n == 0) return;
  // one device for all: the CUDA launch runs on params[0]'s device
  const c10::Device device = params[0].device();
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& p = params[i];
    TORCH_CHECK(device.type() == device_type && p.device() == device && grads[i].device() == device &&
                    exp_avgs[i].device() == device && exp_avg_sqs[i].device() == device,
                "adamw_slice_update: the tensors of slice ", i, " are not all on ", device,
                " (every tensor must be on the same ", c10::DeviceTypeName(device_type), " device)");
    TORCH_CHECK(p.scalar_type() == at::kFloat || p.scalar_type() == at::kBFloat16,
                "adamw_slice_update: params[", i, "] must be float32 or bfloat16");
    TORCH_CHECK(grads[i].scalar_type() == p.scalar_type(),
                "adamw_slice_update: grads[", i, "] must have the dtype of params[", i, "]");
    TORCH_CHECK(exp_avgs[i].scalar_type() == at::kFloat && exp_avg_sqs[i].scalar_type() == at::kFloat,
                "adamw_slice_update: optimizer state must be float32 (tensor ", i, ")");
    TORCH_CHECK(grads[i].sizes() == p.sizes() && exp_avgs[i].sizes() == p.sizes() &&
                    exp_avg_sqs[i].sizes() == p.sizes(),
                "adamw_slice_update: shapes of tensor ", i, " differ");
    TORCH_CHECK(p.is_contiguous() && grads[i].is_contiguous() && exp_avgs[i].is_contiguous() &&
                    exp_avg_sqs[i].is_contiguous(),
                "adamw_slice_update: tensor ", i, " is not contiguous");
  }
}

}  // namespace nanochat_fast
