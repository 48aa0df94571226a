// torch binding of the CUDA AdamW kernel (compiled only in the CUDA build of the extension).
// Builds the pointer and block tables on the host in one pinned buffer, copies it to the device
// without a sync, and launches one kernel per param dtype on the current stream.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <vector>

#include "../adamw_slice.h"
#include "adamw_slice_launch.h"

namespace nanochat_fast {
namespace {

void launch_group(const std::vector<int64_t>& idx, at::TensorList params, at::TensorList grads,
                  at::TensorList exp_avgs, at::TensorList exp_avg_sqs, const at::Tensor& hparams,
                  at::ArrayRef<double> lr_muls, at::ArrayRef<double> wd_muls) {
  const int64_t n = static_cast<int64_t>(idx.size());
  std::vector<int64_t> block_tensor, block_start;
  for (int64_t j = 0; j < n; ++j)
    for (int64_t s = 0; s < params[idx[j]].numel(); s += kAdamWCudaBlockElems) {
      block_tensor.push_back(j);
      block_start.push_back(s);
    }
  const int64_t n_blocks = static_cast<int64_t>(block_tensor.size());
  if (n_blocks == 0) return;

  // One int64 buffer: table[5, n] | blocks[2, n_blocks] | muls as float32[2, n] (packed in n int64s)
  const int64_t len = 5 * n + 2 * n_blocks + n;
  at::Tensor host = at::empty({len}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  int64_t* h = host.data_ptr<int64_t>();
  for (int64_t j = 0; j < n; ++j) {
    const int64_t i = idx[j];
    h[j] = reinterpret_cast<int64_t>(params[i].data_ptr());
    h[n + j] = reinterpret_cast<int64_t>(grads[i].data_ptr());
    h[2 * n + j] = reinterpret_cast<int64_t>(exp_avgs[i].data_ptr());
    h[3 * n + j] = reinterpret_cast<int64_t>(exp_avg_sqs[i].data_ptr());
    h[4 * n + j] = params[i].numel();
  }
  std::copy(block_tensor.begin(), block_tensor.end(), h + 5 * n);
  std::copy(block_start.begin(), block_start.end(), h + 5 * n + n_blocks);
  float* muls = reinterpret_cast<float*>(h + 5 * n + 2 * n_blocks);
  for (int64_t j = 0; j < n; ++j) {
    muls[j] = static_cast<float>(lr_muls[idx[j]]);
    muls[n + j] = static_cast<float>(wd_muls[idx[j]]);
  }
  const at::Tensor dev = host.to(params[0].device(), /*non_blocking=*/true);
  const int64_t* d = dev.data_ptr<int64_t>();
  const at::Tensor hp = hparams.to(params[0].device(), /*non_blocking=*/true);

  C10_CUDA_CHECK(launch_adamw_slice_update(
      params[idx[0]].scalar_type() == at::kBFloat16, d, reinterpret_cast<const float*>(d + 5 * n + 2 * n_blocks),
      d + 5 * n, hp.data_ptr<double>(), n, n_blocks, c10::cuda::getCurrentCUDAStream()));
}

void adamw_slice_update_cuda(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                             at::TensorList exp_avg_sqs, const at::Tensor& hparams,
                             at::ArrayRef<double> lr_muls, at::ArrayRef<double> wd_muls) {
  check_adamw_slice_args(params, grads, exp_avgs, exp_avg_sqs, hparams, lr_muls, wd_muls,
                         c10::DeviceType::CUDA);
  if (params.empty()) return;
  const c10::cuda::CUDAGuard guard(params[0].device());
  std::vector<int64_t> fp32, bf16;
  for (int64_t i = 0; i < static_cast<int64_t>(params.size()); ++i)
    (params[i].scalar_type() == at::kBFloat16 ? bf16 : fp32).push_back(i);
  for (const auto* group : {&fp32, &bf16})
    if (!group->empty())
      launch_group(*group, params, grads, exp_avgs, exp_avg_sqs, hparams, lr_muls, wd_muls);
}

}  // namespace

TORCH_LIBRARY_IMPL(nanochat_fast, CUDA, m) {
  m.impl("adamw_slice_update", &adamw_slice_update_cuda);
}

}  // namespace nanochat_fast
