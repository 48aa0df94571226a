#pragma once
// The decode step's kernels on raw float32 rows, for decode_block_cpu.cpp to chain them without a
// tensor (and a dispatch) between each: the ops packed_linear, rms_norm and decode_attention are
// these same functions behind their argument checks.
#include <ATen/ATen.h>

#include <cstdint>
#include <optional>

namespace nanochat_fast {

// packed_linear_cpu.cpp: out[M, N] = x[M, K] @ weight^T, weight packed by pack_linear_weight into
// [ceil(N / kPanel), K, kPanel] panels; threads over panels. check_packed: TORCH_CHECK that `packed`
// is such a weight for in_features K and out_features N (the message names `op` and `name`).
constexpr int64_t kPanel = 32;  // output columns per panel
void check_packed(const char* op, const char* name, const at::Tensor& packed, int64_t K, int64_t N);
void packed_linear_rows(const float* x, int64_t M, int64_t K, const float* packed, int64_t N, float* out);

// row_ops_cpu.cpp: y = x / sqrt(mean(x^2) + eps) for `rows` rows of C floats; threads over rows.
void rms_norm_rows(const float* x, float* y, int64_t rows, int64_t C, float eps);

// decode_attention_cpu.cpp: one layer's decode-step attention for B rows of one new token each.
struct DecodeAttention {
  int64_t B, H, Hkv, D;
  const float *q, *k, *v;          // row b's heads at q + b * q_row (H x D), k + b * k_row, v + b * v_row (Hkv x D)
  int64_t q_row, k_row, v_row;
  const float *cos, *sin;          // [B, D/2]
  float* cache;                    // keys [S, Hkv, L, D] at cache, values at cache + value_offset
  int64_t value_offset, slot_stride, head_stride, pos_stride;
  const int64_t *rows, *positions;  // [B]: each row's slot and its new token's position
  std::optional<int64_t> window;
  float qk_scale, scale;
  float* out;                      // [B, H * D]
};
// The cache [2, S, Hkv, L, D] and rows, positions, window checked against each other (TORCH_CHECK,
// naming `op`); the DecodeAttention fields they give (cache, strides, rows, positions, window).
DecodeAttention check_decode_rows(const char* op, at::Tensor& cache, const at::Tensor& rows,
                                  const at::Tensor& positions, std::optional<int64_t> window, int64_t B, int64_t Hkv,
                                  int64_t D);
void decode_attention_rows(const DecodeAttention& a);

}  // namespace nanochat_fast
