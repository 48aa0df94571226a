// Every op of nanochat_fast, declared in one place. Device implementations register themselves
// with TORCH_LIBRARY_IMPL in their own files (adamw_slice_cpu.cpp, cuda/adamw_slice_cuda.cpp, ...),
// and the Python wrappers in nanochat_fast/kernels/ register the fake (meta) kernels.
#include <torch/library.h>

TORCH_LIBRARY(nanochat_fast, m) {
  // AdamW over the parameter slices a rank owns, all tensors in one call, updated in place.
  // hparams: float64[7] = [lr, beta1, beta2, eps, weight_decay, bias_correction1, bias_correction2_sqrt]
  // (a tensor, not floats, so that a changing schedule neither recompiles nor syncs the host).
  m.def(
      "adamw_slice_update(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, "
      "Tensor(c!)[] exp_avg_sqs, Tensor hparams, float[] lr_muls, float[] wd_muls) -> ()");

  // Best-fit packing of BOS-started documents tokens[offsets[d]:offsets[d+1]] into the rows of
  // out (int64 [B, T+1], CPU, may be pinned). Returns (used: bool[D], tokens placed, tokens cropped).
  m.def("pack_rows(Tensor tokens, Tensor offsets, Tensor(a!) out, int bos_id) -> (Tensor, SymInt, SymInt)");

  // Cross-entropy of softcap * tanh(hidden @ weight^T / softcap) against targets (ignore_index rows
  // count 0), in chunks of chunk_rows rows. Returns (losses: float32 [N], total = sum_i s_i losses_i,
  // dhidden, dweight) with s = grad_scale (1 or N elements; 1 when None). With grad_scale given the
  // last two are the gradient of total (else empty); the autograd formula is registered in Python.
  m.def(
      "softcap_cross_entropy(Tensor hidden, Tensor weight, Tensor targets, float softcap, int ignore_index, "
      "Tensor? grad_scale, int chunk_rows) -> (Tensor, Tensor, Tensor, Tensor)");

  // y = x @ weight^T for a few rows of x [..., K] (decode steps), from weight [N, K] packed once by
  // pack_linear_weight into column panels [ceil(N / 32), K, 32]; float32. Every output is summed in
  // the same order whatever the number of rows: a row's result does not depend on the others.
  m.def("pack_linear_weight(Tensor weight) -> Tensor");
  m.def("packed_linear(Tensor x, Tensor packed, int out_features) -> Tensor");

  // A decode step's attention, one new token per row, from the projections on: q [B, 1, H, D] and
  // k [B, 1, Hkv, D] rotated by the row's angles cos, sin [B, 1, 1, D/2] (channel i with i + D/2),
  // RMS-normed over D (F.rms_norm's eps) and scaled by qk_scale; the key so made and v [B, 1, Hkv, D]
  // written into cache [2 (keys, values), S, Hkv, L, D] (a view of the slot cache: any strides but
  // the last) at slot rows[b], position positions[b]; then out[b, h] = softmax(q'[b, h] . keys[rows[b],
  // h / g, s:p+1] * scale) @ values[rows[b], h / g, s:p+1] with p = positions[b], g = H / Hkv and
  // s = max(0, p - window) (0 without window). Returns [B, 1, H * D] float32 (heads side by side,
  // what the output projection takes). A row reads nothing of the others: its result does not
  // depend on them. Several rows may share a slot at different positions (a prompt's tokens): every
  // row's key and value are written before any row attends, so each sees those before it.
  m.def(
      "decode_attention(Tensor q, Tensor k, Tensor v, Tensor cos, Tensor sin, float qk_scale, Tensor(a!) cache, "
      "Tensor rows, Tensor positions, int? window, float scale) -> Tensor");

  // x / sqrt(mean(x^2 over the last dim) + eps), float32, no autograd (the models' parameter-free
  // RMSNorm where no gradient is wanted).
  m.def("rms_norm(Tensor x, float eps) -> Tensor");

  // cap * tanh(x / cap), float32, no autograd (the models' logit softcap where no gradient is wanted).
  m.def("softcap(Tensor x, float cap) -> Tensor");

  // The windowed family's smear for a decode step's rows (one new token each), x [B, 1, C]: returns
  // x + gate_lambda * sigmoid(x[..., :G] @ gate_weight^T) * previous[rows] and writes x into
  // previous[rows] (previous [S, C]: each slot's last input embedding), G = gate_weight [1, G]'s
  // width. float32, no autograd; a row reads and writes its own slot alone, the rows one after
  // another (a slot's several rows, a prompt's positions in order, each mix in the one before).
  m.def("smear_decode(Tensor x, Tensor(a!) previous, Tensor rows, Tensor gate_weight, Tensor gate_lambda) -> Tensor");

  // One block of the gpt or the windowed family for a decode step's rows (one new token each),
  // from the residual stream x [B, 1, C] to the next: x = resid_lambda * x + x0_lambda * x0 if x0
  // [B, 1, C] is given; h = rms_norm(x); q, k, v = h @ qkv^T split, v += 3 * sigmoid(h[:, :G] @
  // ve_gate^T) * ve per key head if ve [B, 1, Hkv * D] and ve_gate [Hkv, G] are given (the windowed
  // family's per-layer scalars and gated value embedding); x += decode_attention(q, k, v; cos, sin,
  // qk_scale, cache, rows, positions, window, scale) @ proj^T; h = rms_norm(x); x += relu(h @
  // fc^T)^2 @ mlp_proj^T. The four weights packed by pack_linear_weight (qkv: the query, key and
  // value weights stacked); n_head query heads, the cache's key heads and head dimension. Bitwise
  // those ops one after another, but for the gate's sigmoid.
  m.def(
      "decode_block(Tensor x, Tensor qkv, Tensor proj, Tensor fc, Tensor mlp_proj, Tensor cos, Tensor sin, "
      "Tensor(a!) cache, Tensor rows, Tensor positions, int n_head, int? window, float qk_scale, float scale, "
      "Tensor? x0=None, float resid_lambda=1.0, float x0_lambda=0.0, Tensor? ve=None, Tensor? ve_gate=None) "
      "-> Tensor");
}
