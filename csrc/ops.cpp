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

  // y = x @ weight^T for a few rows of x (decode steps), from weight [N, K] packed once by
  // pack_linear_weight into column panels [ceil(N / 32), K, 32]; float32. Every output is summed in
  // the same order whatever the number of rows: a row's result does not depend on the others.
  m.def("pack_linear_weight(Tensor weight) -> Tensor");
  m.def("packed_linear(Tensor x, Tensor packed, int out_features) -> Tensor");

  // One query token per row over its own cached entries: out[b, h] = softmax(q[b, h] .
  // keys[rows[b], h / g, s:lengths[b]] * scale) @ values[rows[b], h / g, s:lengths[b]], g = H / Hkv,
  // s = starts[b] (0 when starts is None; a sliding window's rows start later).
  // q float32 [B, H, D]; keys, values [S, Hkv, L, D] (views of a cache: any strides but the last);
  // rows, lengths, starts int64 [B]. A row reads nothing of the others: its result does not depend on them.
  m.def(
      "decode_attention(Tensor q, Tensor keys, Tensor values, Tensor rows, Tensor lengths, float scale, "
      "Tensor? starts=None) -> Tensor");
}
