// decode_attention on CPU: a decode step's attention, one new token per row, from the projections
// on, reading each row's keys and values in place in the continuous-batching cache (model/decode.py's
// SlotBatch):
//
//   q'[b, h] = qk_scale * rms_norm(rotate(q[b, h]))    k'[b, h] likewise, written with v[b, h] into the cache
//   out[b, h] = softmax(q'[b, h] . keys[rows[b], h / g, s:p+1] * scale) @ values[rows[b], h / g, s:p+1]
//
// with p = positions[b] (the new token's), g = H / Hkv query heads per key head (grouped-query
// attention) and s = max(0, p - window) (a sliding window's rows begin their entries later).
// rotate turns channel i with channel i + D/2 by the row's angle (the models' apply_rotary_emb);
// rms_norm is F.rms_norm over D with its default eps (float32's machine epsilon).
//
// Why one op: in PyTorch the rotary, the QK-norm and the cache writes are some forty small ops a
// layer (slices, products, a concatenation, pow/mean/rsqrt, index_put), each a few microseconds of
// dispatch on a few hundred floats: most of a one-row decode step's time, more than reading its
// weights. And why not SDPA for the attention: a step of B rows at different lengths needs a mask
// over the block of slots up to the longest row, and CPU SDPA (flash or math) then spent ~2x the time
// it takes just to read those keys and values. Here each (row, head) reads only its own valid
// entries, once: a pass of dot products for the scores, a pass over the values weighted by
// exp(score - max). The figures: benchmarks/bench_decode_step.py.
//
// Batch invariance: a row reads nothing of the other rows and sums in a fixed order (its entries in
// order; within a dot product, the vector lanes over the head dimension, then the lanes added in a
// fixed order), so its result is bitwise the same whoever shares the step. Math is fp32. Like
// packed_linear, the kernel is one template with a copy per target (vectors of its width, picked
// at load time: simd.h).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "decode_step.h"
#include "simd.h"

namespace nanochat_fast {
namespace {

struct Strides {  // element strides of keys / values [S, Hkv, L, D] (D contiguous)
  int64_t slot, head, pos;
};

// q . key for one key of D floats: W lanes of partial sums over D's full vectors, the lanes added,
// then the last D % W products. Every key's score is summed in this order.
template <int W>
NANOCHAT_FAST_INLINE float dot(const float* q, const float* key, int64_t D) {
  typename VecOf<W>::type acc{};
  int64_t d = 0;
  for (; d + W <= D; d += W) acc += load<W>(q + d) * load<W>(key + d);
  float sum = lane_sum<W>(acc);
  for (; d < D; ++d) sum += q[d] * key[d];
  return sum;
}

// out[d0 : d0 + CV * W] = sum over l of p[l] * values[l, d0 : ...], times inv: CV vectors of
// accumulators in registers while the values stream past, each output summed over l in order.
template <int W, int CV>
NANOCHAT_FAST_INLINE void weigh_values(const float* p, const float* v, int64_t pos_stride, int64_t length, int64_t d0,
                                       float inv, float* out) {
  typename VecOf<W>::type acc[CV] = {};
  for (int64_t l = 0; l < length; ++l) {
    const float* vl = v + l * pos_stride + d0;
    for (int i = 0; i < CV; ++i) acc[i] += p[l] * load<W>(vl + i * W);
  }
  for (int i = 0; i < CV; ++i) store<W>(out + d0 + i * W, acc[i] * inv);
}

// One (row, head): the scores of its `length` keys (into `scores`), their softmax, the output head
// into out[0:D]. Vectors of W floats: the scores four keys at a time (four independent chains of
// multiply-adds, one load of q for four keys), the exponentials vectorised (simd.h), the
// values' weighted sum with the output in registers. Why: one key at a time, with std::exp and the
// output read and written back for every key, a key cost ~60 cycles a head from cache
// (docs/measurements.md#packed-decode-linears).
template <int W>
NANOCHAT_FAST_INLINE void attend(const float* __restrict__ q, const float* __restrict__ k,
                                 const float* __restrict__ v, Strides st, int64_t length, int64_t D, float scale,
                                 float* __restrict__ scores, float* __restrict__ out) {
  typedef typename VecOf<W>::type Vec;
  int64_t l = 0;
  for (; l + 4 <= length; l += 4) {
    const float *k0 = k + l * st.pos, *k1 = k0 + st.pos, *k2 = k1 + st.pos, *k3 = k2 + st.pos;
    Vec a0{}, a1{}, a2{}, a3{};
    int64_t d = 0;
    for (; d + W <= D; d += W) {
      const Vec qd = load<W>(q + d);
      a0 += qd * load<W>(k0 + d), a1 += qd * load<W>(k1 + d), a2 += qd * load<W>(k2 + d), a3 += qd * load<W>(k3 + d);
    }
    float s[4] = {lane_sum<W>(a0), lane_sum<W>(a1), lane_sum<W>(a2), lane_sum<W>(a3)};
    for (; d < D; ++d) s[0] += q[d] * k0[d], s[1] += q[d] * k1[d], s[2] += q[d] * k2[d], s[3] += q[d] * k3[d];
    for (int j = 0; j < 4; ++j) scores[l + j] = s[j] * scale;
  }
  for (; l < length; ++l) scores[l] = dot<W>(q, k + l * st.pos, D) * scale;
  float top = -std::numeric_limits<float>::infinity(), total = 0.0f;
#pragma omp simd reduction(max : top)
  for (l = 0; l < length; ++l) top = std::max(top, scores[l]);
#pragma omp simd reduction(+ : total)
  for (l = 0; l < length; ++l) {
    scores[l] = exp_approx(scores[l] - top);
    total += scores[l];
  }
  const float inv = 1.0f / total;
  int64_t d0 = 0;
  for (; d0 + 4 * W <= D; d0 += 4 * W) weigh_values<W, 4>(scores, v, st.pos, length, d0, inv, out);
  for (; d0 + W <= D; d0 += W) weigh_values<W, 1>(scores, v, st.pos, length, d0, inv, out);
  for (; d0 < D; ++d0) {
    float sum = 0.0f;
    for (l = 0; l < length; ++l) sum += scores[l] * v[l * st.pos + d0];
    out[d0] = sum * inv;
  }
}

using Attend = void (*)(const float*, const float*, const float*, Strides, int64_t, int64_t, float, float*, float*);

void attend_baseline(const float* q, const float* k, const float* v, Strides st, int64_t length, int64_t D,
                     float scale, float* scores, float* out) {
  attend<4>(q, k, v, st, length, D, scale, scores, out);
}

#if NANOCHAT_FAST_HAS_CLONES
NANOCHAT_FAST_TARGET("arch=x86-64-v4")
void attend_avx512(const float* q, const float* k, const float* v, Strides st, int64_t length, int64_t D,
                   float scale, float* scores, float* out) {
  attend<16>(q, k, v, st, length, D, scale, scores, out);
}

NANOCHAT_FAST_TARGET("arch=x86-64-v3")
void attend_avx2(const float* q, const float* k, const float* v, Strides st, int64_t length, int64_t D, float scale,
                 float* scores, float* out) {
  attend<8>(q, k, v, st, length, D, scale, scores, out);
}
#endif

// The copy for this CPU, as target_clones' resolver would pick it.
Attend attend_for_this_cpu() {
#if NANOCHAT_FAST_HAS_CLONES
  __builtin_cpu_init();
  if (__builtin_cpu_supports("x86-64-v4")) return attend_avx512;
  if (__builtin_cpu_supports("x86-64-v3")) return attend_avx2;
#endif
  return attend_baseline;
}

const Attend attend_one = attend_for_this_cpu();

// One head: out = qk_scale * rms_norm(rotate(x)), D floats.
void rotate_and_norm(const float* x, const float* cos, const float* sin, int64_t D, float qk_scale, float* out) {
  const int64_t half = D / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = x[i], x2 = x[i + half];
    out[i] = x1 * cos[i] + x2 * sin[i];
    out[i + half] = x1 * -sin[i] + x2 * cos[i];
  }
  float squares = 0.0f;
  for (int64_t d = 0; d < D; ++d) squares += out[d] * out[d];
  const float inv_rms = 1.0f / std::sqrt(squares / static_cast<float>(D) + std::numeric_limits<float>::epsilon());
  for (int64_t d = 0; d < D; ++d) out[d] = out[d] * inv_rms * qk_scale;
}

// A [B, 1, heads, D] (or cos/sin [B, 1, 1, D/2]) float32 input, made contiguous.
at::Tensor rows_of(const at::Tensor& t, const char* name, int64_t B, int64_t heads, int64_t D) {
  TORCH_CHECK(t.dim() == 4 && t.scalar_type() == at::kFloat && t.size(0) == B && t.size(1) == 1 &&
                  (heads < 0 || t.size(2) == heads) && t.size(3) == D,
              "decode_attention: ", name, " must be float32 [", B, ", 1, ", heads < 0 ? "heads" : std::to_string(heads),
              ", ", D, "], got ", t.scalar_type(), " ", t.sizes());
  return t.contiguous();
}

}  // namespace

DecodeAttention check_decode_rows(const char* op, at::Tensor& cache, const at::Tensor& rows,
                                  const at::Tensor& positions, std::optional<int64_t> window, int64_t B, int64_t Hkv,
                                  int64_t D) {
  TORCH_CHECK(cache.dim() == 5 && cache.scalar_type() == at::kFloat && cache.size(0) == 2 && cache.size(2) == Hkv &&
                  cache.size(4) == D && cache.stride(4) == 1,
              op, ": cache must be float32 [2, S, ", Hkv, ", L, ", D, "] with a contiguous last dim, got ",
              cache.scalar_type(), " ", cache.sizes());
  const int64_t S = cache.size(1), L = cache.size(3);
  TORCH_CHECK(rows.scalar_type() == at::kLong && positions.scalar_type() == at::kLong && rows.dim() == 1 &&
                  positions.dim() == 1 && rows.size(0) == B && positions.size(0) == B && rows.is_contiguous() &&
                  positions.is_contiguous(),
              op, ": rows and positions must be contiguous int64 [B] with B = ", B);
  TORCH_CHECK(!window.has_value() || *window >= 0, op, ": window must be >= 0, got ", *window);
  const int64_t* row = rows.const_data_ptr<int64_t>();
  const int64_t* pos = positions.const_data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(0 <= row[b] && row[b] < S, op, ": rows[", b, "] = ", row[b], " is outside [0, ", S, ")");
    TORCH_CHECK(0 <= pos[b] && pos[b] < L, op, ": positions[", b, "] = ", pos[b], " is outside [0, ", L, ")");
    for (int64_t a = 0; a < b; ++a)
      TORCH_CHECK(row[a] != row[b] || pos[a] != pos[b], op, ": rows[", a, "] and rows[", b, "] both write position ",
                  pos[b], " of slot ", row[b]);
  }
  DecodeAttention a{};
  a.cache = cache.mutable_data_ptr<float>();
  a.value_offset = cache.stride(0);
  a.slot_stride = cache.stride(1), a.head_stride = cache.stride(2), a.pos_stride = cache.stride(3);
  a.rows = row, a.positions = pos, a.window = window;
  return a;
}

void decode_attention_rows(const DecodeAttention& a) {
  const int64_t B = a.B, H = a.H, Hkv = a.Hkv, D = a.D, L_max = [&] {
    int64_t m = 0;
    for (int64_t b = 0; b < B; ++b) m = std::max(m, a.positions[b] + 1);
    return m;
  }();
  const Strides st{a.slot_stride, a.head_stride, a.pos_stride};
  float* kp = a.cache;
  float* vp = a.cache + a.value_offset;
  // The new tokens first: a few hundred floats a row, on this thread. The rotated queries go to
  // `rotated` (each row's heads side by side), where the attention reads them head by head. Every
  // key and value is in the cache before any row attends: so a slot's several rows (a prompt's
  // positions) see each other's entries, each its own and those before it.
  std::vector<float> rotated(B * H * D);
  for (int64_t b = 0; b < B; ++b) {
    const float* c = a.cos + b * (D / 2);
    const float* s = a.sin + b * (D / 2);
    for (int64_t h = 0; h < H; ++h) rotate_and_norm(a.q + b * a.q_row + h * D, c, s, D, a.qk_scale, &rotated[(b * H + h) * D]);
    for (int64_t h = 0; h < Hkv; ++h) {
      const int64_t at_entry = a.rows[b] * st.slot + h * st.head + a.positions[b] * st.pos;
      rotate_and_norm(a.k + b * a.k_row + h * D, c, s, D, a.qk_scale, kp + at_entry);
      const float* value = a.v + b * a.v_row + h * D;
      std::copy(value, value + D, vp + at_entry);
    }
  }
  const int64_t group = H / Hkv;
  at::parallel_for(0, B * H, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> scores(L_max);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / H, h = i % H, kvh = h / group, pos = a.positions[b];
      const int64_t start = a.window.has_value() ? std::max<int64_t>(0, pos - *a.window) : 0;
      const int64_t first = a.rows[b] * st.slot + kvh * st.head + start * st.pos;
      attend_one(&rotated[i * D], kp + first, vp + first, st, pos + 1 - start, D, a.scale, scores.data(),
                 a.out + i * D);
    }
  });
}

namespace {

at::Tensor decode_attention_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                                const at::Tensor& sin, double qk_scale, at::Tensor& cache, const at::Tensor& rows,
                                const at::Tensor& positions, std::optional<int64_t> window, double scale) {
  TORCH_CHECK(q.dim() == 4, "decode_attention: q must be [B, 1, H, D], got ", q.sizes());
  const int64_t B = q.size(0), H = q.size(2), D = q.size(3);
  TORCH_CHECK(D % 2 == 0, "decode_attention: the head dimension must be even (rotary pairs channels), got ", D);
  const at::Tensor qc = rows_of(q, "q", B, H, D), kc = rows_of(k, "k", B, -1, D);
  const int64_t Hkv = kc.size(2);
  const at::Tensor vc = rows_of(v, "v", B, Hkv, D);
  const at::Tensor cc = rows_of(cos, "cos", B, 1, D / 2), sc = rows_of(sin, "sin", B, 1, D / 2);
  TORCH_CHECK(Hkv > 0 && H % Hkv == 0, "decode_attention: ", Hkv, " key heads must divide ", H, " query heads");
  const at::Tensor rc = rows.contiguous(), pc = positions.contiguous();
  DecodeAttention a = check_decode_rows("decode_attention", cache, rc, pc, window, B, Hkv, D);
  at::Tensor out = at::empty({B, 1, H * D}, q.options());
  a.B = B, a.H = H, a.Hkv = Hkv, a.D = D;
  a.q = qc.const_data_ptr<float>(), a.k = kc.const_data_ptr<float>(), a.v = vc.const_data_ptr<float>();
  a.q_row = H * D, a.k_row = Hkv * D, a.v_row = Hkv * D;
  a.cos = cc.const_data_ptr<float>(), a.sin = sc.const_data_ptr<float>();
  a.qk_scale = static_cast<float>(qk_scale), a.scale = static_cast<float>(scale);
  a.out = out.mutable_data_ptr<float>();
  decode_attention_rows(a);
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(nanochat_fast, CPU, m) { m.impl("decode_attention", &decode_attention_cpu); }

}  // namespace nanochat_fast
