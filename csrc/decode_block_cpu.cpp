// decode_block on CPU: one block of the seeds' GPT (model/gpt.py's Block) or of the windowed family
// (model/windowed_gpt.py's WindowedBlock) for a decode step's rows, one new token each, from the
// residual stream x [B, 1, C] to the next:
//
//   h = rms_norm(x);  q, k, v = h @ Wqkv^T;  v += v_extra (if given)
//   x = x + decode_attention(q, k, v, ...) @ Wo^T
//   h = rms_norm(x);  x = x + relu(h @ Wfc^T)^2 @ Wproj^T
//
// v_extra is the windowed family's gated value embedding, made by its caller (a few values a row).
//
// with the same kernels as the ops rms_norm, packed_linear and decode_attention (decode_step.h),
// chained on raw rows: bitwise what those ops give one after another. Why: at one row a block is a
// few hundred floats per op, and the ops one after another cost ~15 dispatches a layer from Python
// (module calls, wrappers, tensors made and viewed), more than the block's arithmetic outside its
// weights' read. The figures: docs/measurements.md#a-one-row-decode-step-dispatch-not-bytes.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

#include "decode_step.h"

namespace nanochat_fast {
namespace {

at::Tensor decode_block_cpu(const at::Tensor& x, const at::Tensor& qkv, const at::Tensor& proj, const at::Tensor& fc,
                            const at::Tensor& mlp_proj, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& cache,
                            const at::Tensor& rows, const at::Tensor& positions, int64_t n_head,
                            std::optional<int64_t> window, double qk_scale, double scale,
                            const std::optional<at::Tensor>& v_extra) {
  TORCH_CHECK(x.dim() == 3 && x.size(1) == 1 && x.scalar_type() == at::kFloat,
              "decode_block: x must be float32 [B, 1, C], got ", x.scalar_type(), " ", x.sizes());
  TORCH_CHECK(cache.dim() == 5, "decode_block: cache must be [2, S, Hkv, L, D], got ", cache.sizes());
  const int64_t B = x.size(0), C = x.size(2), H = n_head, Hkv = cache.size(2), D = cache.size(4);
  TORCH_CHECK(mlp_proj.dim() == 3, "decode_block: mlp_proj must be a packed weight [P, K, 32], got ", mlp_proj.sizes());
  const int64_t F = mlp_proj.size(1);  // the MLP's hidden width
  TORCH_CHECK(H > 0 && Hkv > 0 && H % Hkv == 0 && D % 2 == 0, "decode_block: ", Hkv, " key heads must divide n_head ",
              H, ", and the head dimension ", D, " be even");
  const int64_t Nqkv = (H + 2 * Hkv) * D;
  check_packed("decode_block", "qkv", qkv, C, Nqkv);
  check_packed("decode_block", "proj", proj, H * D, C);
  check_packed("decode_block", "fc", fc, C, F);
  check_packed("decode_block", "mlp_proj", mlp_proj, F, C);
  for (const at::Tensor* t : {&cos, &sin})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->numel() == B * D / 2 && t->size(0) == B,
                "decode_block: cos and sin must be float32 [", B, ", 1, 1, ", D / 2, "], got ", t->sizes());
  const at::Tensor xc = x.contiguous(), cc = cos.contiguous(), sc = sin.contiguous();
  const at::Tensor rc = rows.contiguous(), pc = positions.contiguous();
  at::Tensor extra;  // [B, Hkv * D] added to the values (the windowed family's value embeddings)
  if (v_extra.has_value()) {
    TORCH_CHECK(v_extra->scalar_type() == at::kFloat && v_extra->numel() == B * Hkv * D && v_extra->size(0) == B,
                "decode_block: v_extra must be float32 [", B, ", 1, ", Hkv * D, "], got ", v_extra->scalar_type(), " ",
                v_extra->sizes());
    extra = v_extra->contiguous();
  }
  DecodeAttention a = check_decode_rows("decode_block", cache, rc, pc, window, B, Hkv, D);
  at::Tensor out = xc.clone();
  float* xo = out.mutable_data_ptr<float>();
  const float eps = std::numeric_limits<float>::epsilon();  // F.rms_norm's default
  std::vector<float> h(B * C), q(B * Nqkv), y(B * H * D), f(B * F), delta(B * C);

  rms_norm_rows(xo, h.data(), B, C, eps);
  packed_linear_rows(h.data(), B, C, qkv.const_data_ptr<float>(), Nqkv, q.data());
  if (extra.defined()) {  // v = v + extra: a plain sum, as the ops' `v + ...`
    const float* e = extra.const_data_ptr<float>();
    for (int64_t b = 0; b < B; ++b)
      for (int64_t j = 0; j < Hkv * D; ++j) q[b * Nqkv + (H + Hkv) * D + j] += e[b * Hkv * D + j];
  }
  a.B = B, a.H = H, a.Hkv = Hkv, a.D = D;
  a.q = q.data(), a.k = q.data() + H * D, a.v = q.data() + (H + Hkv) * D;
  a.q_row = a.k_row = a.v_row = Nqkv;
  a.cos = cc.const_data_ptr<float>(), a.sin = sc.const_data_ptr<float>();
  a.qk_scale = static_cast<float>(qk_scale), a.scale = static_cast<float>(scale);
  a.out = y.data();
  decode_attention_rows(a);
  packed_linear_rows(y.data(), B, H * D, proj.const_data_ptr<float>(), C, delta.data());
  for (int64_t i = 0; i < B * C; ++i) xo[i] = xo[i] + delta[i];

  rms_norm_rows(xo, h.data(), B, C, eps);
  packed_linear_rows(h.data(), B, C, fc.const_data_ptr<float>(), F, f.data());
  for (float& v : f) v = v > 0.0f ? v * v : 0.0f;  // relu, then square (both exact, as F.relu(..).square())
  packed_linear_rows(f.data(), B, F, mlp_proj.const_data_ptr<float>(), C, delta.data());
  for (int64_t i = 0; i < B * C; ++i) xo[i] = xo[i] + delta[i];
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(nanochat_fast, CPU, m) { m.impl("decode_block", &decode_block_cpu); }

}  // namespace nanochat_fast
