// decode_block on CPU: one block of the gpt family (model/gpt.py's Block) or of the windowed family
// (model/windowed_gpt.py's WindowedBlock) for a decode step's rows, one new token each, from the
// residual stream x [B, 1, C] to the next:
//
//   x = resid_lambda * x + x0_lambda * x0 (if x0 is given)
//   h = rms_norm(x);  q, k, v = h @ Wqkv^T;  v += 3 * sigmoid(h[:, :G] @ ve_gate^T) * ve (if ve is given)
//   x = x + decode_attention(q, k, v, ...) @ Wo^T
//   h = rms_norm(x);  x = x + relu(h @ Wfc^T)^2 @ Wproj^T
//
// x0 and the lambdas are the windowed family's per-layer scalars, ve and ve_gate its value
// embedding and gate (G input channels, one output per key head).
//
// with the same kernels as the ops rms_norm, packed_linear and decode_attention (decode_step.h),
// chained on raw rows: bitwise what those ops give one after another, but for the gate's sigmoid
// (std::exp here, torch's own exp there). Why: at one row a block is a few hundred floats per op,
// and the ops one after another cost ~15 dispatches a layer from Python (module calls, wrappers,
// tensors made and viewed), ~25 with the windowed family's scalars and gate, more than the block's
// arithmetic outside its weights' read. The figures: docs/measurements.md#a-one-row-decode-step-dispatch-not-bytes.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

#include "decode_step.h"
#include "simd.h"

namespace nanochat_fast {
namespace {

// An optional float32 input of B rows of n floats, contiguous; undefined when not given.
at::Tensor float_rows(const char* name, const std::optional<at::Tensor>& t, int64_t B, int64_t n) {
  if (!t.has_value()) return {};
  TORCH_CHECK(t->scalar_type() == at::kFloat && t->numel() == B * n && t->size(0) == B, "decode_block: ", name,
              " must be float32 [", B, ", 1, ", n, "], got ", t->scalar_type(), " ", t->sizes());
  return t->contiguous();
}

// v += 3 * sigmoid(h[:, :G] @ gate^T) * ve, per key head: the windowed family's value embedding,
// gated by the block's normed input. v: row b's values at v + b * v_row, Hkv heads of D floats.
void add_gated_value_embedding(const float* h, int64_t B, int64_t C, const at::Tensor& gate, const at::Tensor& ve,
                               float* v, int64_t v_row, int64_t D) {
  const int64_t Hkv = gate.size(0), G = gate.size(1);
  const float *w = gate.const_data_ptr<float>(), *e = ve.const_data_ptr<float>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t j = 0; j < Hkv; ++j) {
      float s = 0.0f;
      for (int64_t c = 0; c < G; ++c) s += h[b * C + c] * w[j * G + c];
      const float g = 3.0f * (1.0f / (1.0f + std::exp(-s)));
      for (int64_t d = 0; d < D; ++d) v[b * v_row + j * D + d] += g * e[(b * Hkv + j) * D + d];
    }
}

at::Tensor decode_block_cpu(const at::Tensor& x, const at::Tensor& qkv, const at::Tensor& proj, const at::Tensor& fc,
                            const at::Tensor& mlp_proj, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& cache,
                            const at::Tensor& rows, const at::Tensor& positions, int64_t n_head,
                            std::optional<int64_t> window, double qk_scale, double scale,
                            const std::optional<at::Tensor>& x0, double resid_lambda, double x0_lambda,
                            const std::optional<at::Tensor>& ve, const std::optional<at::Tensor>& ve_gate) {
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
  const at::Tensor x0c = float_rows("x0", x0, B, C);  // undefined when not given
  const at::Tensor vec = float_rows("ve", ve, B, Hkv * D);
  TORCH_CHECK(ve.has_value() == ve_gate.has_value(), "decode_block: ve and ve_gate come together");
  at::Tensor gate_w;  // [Hkv, G]
  if (ve_gate.has_value()) {
    TORCH_CHECK(ve_gate->scalar_type() == at::kFloat && ve_gate->dim() == 2 && ve_gate->size(0) == Hkv &&
                    ve_gate->size(1) <= C,
                "decode_block: ve_gate must be float32 [", Hkv, ", G <= ", C, "], got ", ve_gate->scalar_type(), " ",
                ve_gate->sizes());
    gate_w = ve_gate->contiguous();
  }
  DecodeAttention a = check_decode_rows("decode_block", cache, rc, pc, window, B, Hkv, D);
  at::Tensor out = xc.clone();
  float* xo = out.mutable_data_ptr<float>();
  if (x0c.defined()) {  // two products and a sum, each rounded, as the ops' r * x + l * x0 (no FMA: baseline code)
    const float r = static_cast<float>(resid_lambda), l = static_cast<float>(x0_lambda);
    const float* x0p = x0c.const_data_ptr<float>();
    for (int64_t i = 0; i < B * C; ++i) xo[i] = r * xo[i] + l * x0p[i];
  }
  const float eps = std::numeric_limits<float>::epsilon();  // F.rms_norm's default
  std::vector<float> h(B * C), q(B * Nqkv), y(B * H * D), f(B * F), delta(B * C);

  rms_norm_rows(xo, h.data(), B, C, eps);
  packed_linear_rows(h.data(), B, C, qkv.const_data_ptr<float>(), Nqkv, q.data());
  if (vec.defined()) add_gated_value_embedding(h.data(), B, C, gate_w, vec, q.data() + (H + Hkv) * D, Nqkv, D);
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
  // relu, then square, both exact as F.relu(..).square() (a NaN stays NaN). As a bit select: written
  // as ?: the loop kept a branch on each sign, mispredicted half the time (docs/measurements.md)
  for (float& v : f) {
    const float r = select(v < 0.0f, 0.0f, v);
    v = r * r;
  }
  packed_linear_rows(f.data(), B, F, mlp_proj.const_data_ptr<float>(), C, delta.data());
  for (int64_t i = 0; i < B * C; ++i) xo[i] = xo[i] + delta[i];
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(nanochat_fast, CPU, m) { m.impl("decode_block", &decode_block_cpu); }

}  // namespace nanochat_fast
