// smear_decode on CPU: the windowed family's smear for a decode step's rows, one new token each:
// y[b] = x[b] + lambda * sigmoid(x[b, :G] . gate_weight) * previous[rows[b]], then previous[rows[b]] =
// x[b] (the embedding the row's next step mixes in). float32, no autograd.
//
// Why an op: in torch this is ~10 dispatches on a few hundred floats (a slice, a 24-wide product, a
// sigmoid, the scalar's cast, the previous embeddings gathered and cast, the new ones scattered, a
// product and a sum): docs/measurements.md#a-one-row-decode-step-dispatch-not-bytes. Each row
// reads and writes its own slot alone: its result does not depend on the other rows. The rows go
// one after another, so a slot's several rows (a prompt's positions, in order) each mix in the
// embedding of the row before. The gate's
// sigmoid uses std::exp, as decode_block's value-embedding gate does.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>

namespace nanochat_fast {
namespace {

at::Tensor smear_decode_cpu(const at::Tensor& x, at::Tensor& previous, const at::Tensor& rows,
                            const at::Tensor& gate_weight, const at::Tensor& gate_lambda) {
  TORCH_CHECK(x.dim() == 3 && x.size(1) == 1 && x.scalar_type() == at::kFloat,
              "smear_decode: x must be float32 [B, 1, C], got ", x.scalar_type(), " ", x.sizes());
  const int64_t B = x.size(0), C = x.size(2);
  TORCH_CHECK(previous.dim() == 2 && previous.size(1) == C && previous.scalar_type() == at::kFloat &&
                  previous.is_contiguous(),
              "smear_decode: previous must be contiguous float32 [slots, ", C, "], got ", previous.scalar_type(), " ",
              previous.sizes());
  TORCH_CHECK(rows.dim() == 1 && rows.size(0) == B && rows.scalar_type() == at::kLong,
              "smear_decode: rows must be int64 [", B, "], got ", rows.scalar_type(), " ", rows.sizes());
  TORCH_CHECK(gate_weight.dim() == 2 && gate_weight.size(0) == 1 && gate_weight.size(1) <= C &&
                  gate_weight.scalar_type() == at::kFloat,
              "smear_decode: gate_weight must be float32 [1, G <= ", C, "], got ", gate_weight.scalar_type(), " ",
              gate_weight.sizes());
  TORCH_CHECK(gate_lambda.numel() == 1 && gate_lambda.scalar_type() == at::kFloat,
              "smear_decode: gate_lambda must be one float32, got ", gate_lambda.scalar_type(), " ",
              gate_lambda.sizes());
  const at::Tensor xc = x.contiguous(), wc = gate_weight.contiguous(), rc = rows.contiguous();
  at::Tensor y = at::empty_like(xc);
  const float *src = xc.const_data_ptr<float>(), *w = wc.const_data_ptr<float>();
  const int64_t* slot = rc.const_data_ptr<int64_t>();
  const int64_t G = wc.size(1), S = previous.size(0);
  const float lambda = *gate_lambda.contiguous().const_data_ptr<float>();
  float *prev = previous.mutable_data_ptr<float>(), *dst = y.mutable_data_ptr<float>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(0 <= slot[b] && slot[b] < S, "smear_decode: rows[", b, "] = ", slot[b], " is not a slot in [0, ", S, ")");
    const float* xb = src + b * C;
    float* pb = prev + slot[b] * C;
    float s = 0.0f;
    for (int64_t c = 0; c < G; ++c) s += xb[c] * w[c];
    const float g = lambda * (1.0f / (1.0f + std::exp(-s)));
    for (int64_t c = 0; c < C; ++c) {
      dst[b * C + c] = xb[c] + g * pb[c];
      pb[c] = xb[c];
    }
  }
  return y;
}

}  // namespace

TORCH_LIBRARY_IMPL(nanochat_fast, CPU, m) { m.impl("smear_decode", &smear_decode_cpu); }

}  // namespace nanochat_fast
