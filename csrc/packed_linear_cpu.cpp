// packed_linear on CPU: y = x @ weight^T for a few rows of x (a decode step: one row per
// conversation), from a copy of the weight packed once into column panels.
//
// Why not BLAS: MKL's sgemm runs these shapes (M = 1..16 rows, K and N in the hundreds or
// thousands) far below the core's FMA rate, and a step of 8 rows cost up to 4x one row's, where the
// weights are read once for all rows and the arithmetic is still small. Here each panel of 32 output
// columns is stored k-major ([K, 32] contiguous), so one k reads the panel's 32 floats as a few
// vectors and every row of the tile adds x[m, k] times them to its own accumulators (an outer
// product: no horizontal sums, no transposes).
//
// Per target (panels_for_this_cpu picks the copy at load time): vectors of the target's own width, 16
// floats with AVX-512, 8 with AVX2, 4 elsewhere (GCC lowers a vector wider than the registers through
// the stack), and tiles as tall as the registers allow: 8 rows x 2 vectors of accumulators in
// AVX-512's 32 registers, 3 rows x 4 vectors in AVX2's 16 (taller tiles spill):
// docs/measurements.md#packed-decode-linears; the step: benchmarks/bench_decode_step.py.
//
// Batch invariance: every output is summed in the same order whatever the number of rows and
// wherever its row sits in a tile: over k in blocks of kBlock (a sequential fused multiply-add
// chain from 0 inside a block), the blocks' sums added in order. So a row's result in a batch of
// 8 is bitwise its result alone: a conversation decodes the same tokens whoever shares its step.
// The blocks also bound the error growth of a sequential sum (~kBlock + K/kBlock roundings).
// The vector width and the tile height change nothing of that order.
//
// Written with GCC/Clang vector extensions (see simd.h for where per-target copies exist).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "decode_step.h"
#include "simd.h"

namespace nanochat_fast {
namespace {

constexpr int64_t kBlock = 64;  // k per partial sum

// out[m, 0:ncols] = x[m, :] . panel columns, for MR rows of x (row stride K) and one panel. With
// `ahead` (the next panel), the tile also prefetches that panel's rows k with k % every == phase:
// the panel's `every` tiles fetch it all between them (see panels_of).
template <int W, int MR>
NANOCHAT_FAST_INLINE void tile(const float* x, int64_t K, const float* panel, float* out, int64_t ldo,
                               int64_t ncols, const float* ahead, int64_t phase, int64_t every) {
  typedef typename VecOf<W>::type Vec;
  constexpr int NV = kPanel / W;  // vectors per panel row
  Vec sum[MR][NV];
  for (int64_t k0 = 0; k0 < K; k0 += kBlock) {
    const int64_t k1 = std::min(K, k0 + kBlock);
    Vec acc[MR][NV];
    for (int m = 0; m < MR; ++m)
      for (int j = 0; j < NV; ++j) acc[m][j] = Vec{};
    for (int64_t k = k0; k < k1; ++k) {
      if (ahead != nullptr && k % every == phase) {  // a panel row is 128 bytes: two cache lines
        __builtin_prefetch(ahead + k * kPanel, 0, 3);
        __builtin_prefetch(ahead + k * kPanel + 16, 0, 3);
      }
      for (int j = 0; j < NV; ++j) {
        const Vec w = load<W>(panel + k * kPanel + j * W);
        for (int m = 0; m < MR; ++m) acc[m][j] += x[m * K + k] * w;
      }
    }
    for (int m = 0; m < MR; ++m)
      for (int j = 0; j < NV; ++j) sum[m][j] = k0 == 0 ? acc[m][j] : sum[m][j] + acc[m][j];
  }
  for (int m = 0; m < MR; ++m) {
    float row[kPanel];
    for (int j = 0; j < NV; ++j) store<W>(row + j * W, sum[m][j]);
    std::memcpy(out + m * ldo, row, ncols * sizeof(float));
  }
}

template <int W, int MR>
NANOCHAT_FAST_INLINE void tiles(const float* x, int64_t M, int64_t K, const float* panel, float* out, int64_t N,
                                int64_t ncols, const float* ahead, int64_t phase, int64_t every) {
  int64_t m = 0;
  for (; m + MR <= M; m += MR, ++phase) tile<W, MR>(x + m * K, K, panel, out + m * N, N, ncols, ahead, phase, every);
  if constexpr (MR > 1) {  // the last M % MR rows: one tile of exactly that many
    if (m < M) tiles<W, MR - 1>(x + m * K, M - m, K, panel, out + m * N, N, ncols, ahead, phase, every);
  }
}

// Panels p0..p1 of the output: vectors of W floats, tiles of up to MR rows. Each panel's tiles
// prefetch the next panel, spread evenly over them. Why: with weights that come from DRAM (a decode
// step reads them all once, more than the caches keep), the first tile of a panel otherwise waits
// on memory while the others compute from cache; spread over all tiles the fetch overlaps the
// arithmetic. Not at one row, where the hardware prefetcher alone streams the panels faster.
// Measured: docs/measurements.md#packed-decode-linears.
template <int W, int MR>
NANOCHAT_FAST_INLINE void panels_of(const float* __restrict__ x, int64_t M, int64_t K,
                                    const float* __restrict__ packed, int64_t N, float* __restrict__ out,
                                    int64_t p0, int64_t p1) {
  for (int64_t p = p0; p < p1; ++p) {
    const int64_t ncols = std::min(kPanel, N - p * kPanel);
    const float* ahead = M > 1 && p + 1 < p1 ? packed + (p + 1) * K * kPanel : nullptr;
    tiles<W, MR>(x, M, K, packed + p * K * kPanel, out + p * kPanel, N, ncols, ahead, 0, (M + MR - 1) / MR);
  }
}

using Panels = void (*)(const float*, int64_t, int64_t, const float*, int64_t, float*, int64_t, int64_t);

void panels_baseline(const float* x, int64_t M, int64_t K, const float* packed, int64_t N, float* out, int64_t p0,
                     int64_t p1) {
  panels_of<4, 3>(x, M, K, packed, N, out, p0, p1);
}

#if NANOCHAT_FAST_HAS_CLONES
NANOCHAT_FAST_TARGET("arch=x86-64-v4")
void panels_avx512(const float* x, int64_t M, int64_t K, const float* packed, int64_t N, float* out, int64_t p0,
                   int64_t p1) {
  panels_of<16, 8>(x, M, K, packed, N, out, p0, p1);
}

NANOCHAT_FAST_TARGET("arch=x86-64-v3")
void panels_avx2(const float* x, int64_t M, int64_t K, const float* packed, int64_t N, float* out, int64_t p0,
                 int64_t p1) {
  panels_of<8, 3>(x, M, K, packed, N, out, p0, p1);
}
#endif

// The copy for this CPU, as target_clones' resolver would pick it.
Panels panels_for_this_cpu() {
#if NANOCHAT_FAST_HAS_CLONES
  __builtin_cpu_init();
  if (__builtin_cpu_supports("x86-64-v4")) return panels_avx512;
  if (__builtin_cpu_supports("x86-64-v3")) return panels_avx2;
#endif
  return panels_baseline;
}

const Panels panels = panels_for_this_cpu();

void check_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2, "packed_linear: weight must be 2-D [out_features, in_features], got ",
              weight.dim(), "-D");
  TORCH_CHECK(weight.scalar_type() == at::kFloat, "packed_linear: weight must be float32, got ",
              weight.scalar_type());
}

// [N, K] -> [P, K, 32]: panel p holds rows 32p..32p+31 of the weight, transposed, zero past N. One
// panel at a time (its 32 rows are 32 x K floats, in cache), panels split across threads.
at::Tensor pack_linear_weight_cpu(const at::Tensor& weight) {
  check_weight(weight);
  const at::Tensor w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1), P = (N + kPanel - 1) / kPanel;
  at::Tensor packed = at::empty({P, K, kPanel}, w.options());
  const float* src = w.const_data_ptr<float>();
  float* dst = packed.mutable_data_ptr<float>();
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      float* panel = dst + p * K * kPanel;
      for (int64_t j = 0; j < kPanel; ++j) {
        const int64_t n = p * kPanel + j;
        if (n < N) {
          const float* row = src + n * K;
          for (int64_t k = 0; k < K; ++k) panel[k * kPanel + j] = row[k];
        } else {
          for (int64_t k = 0; k < K; ++k) panel[k * kPanel + j] = 0.0f;
        }
      }
    }
  });
  return packed;
}

at::Tensor packed_linear_cpu(const at::Tensor& x, const at::Tensor& packed, int64_t out_features) {
  TORCH_CHECK(x.dim() >= 1 && x.scalar_type() == at::kFloat,
              "packed_linear: x must be float32 [..., in_features], got ", x.scalar_type(), " of ", x.dim(), " dims");
  const int64_t K = x.size(-1), M = K == 0 ? 0 : x.numel() / K, N = out_features;
  check_packed("packed_linear", "packed", packed, K, N);
  const at::Tensor xc = x.contiguous();
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = N;
  at::Tensor out = at::empty(out_shape, x.options());
  if (M == 0 || N == 0) return out;
  packed_linear_rows(xc.const_data_ptr<float>(), M, K, packed.const_data_ptr<float>(), N, out.mutable_data_ptr<float>());
  return out;
}

}  // namespace

void check_packed(const char* op, const char* name, const at::Tensor& packed, int64_t K, int64_t N) {
  const int64_t P = (N + kPanel - 1) / kPanel;
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kFloat && packed.size(0) == P &&
                  packed.size(1) == K && packed.size(2) == kPanel && packed.is_contiguous(),
              op, ": ", name, " must be pack_linear_weight's [", P, ", ", K, ", ", kPanel, "] float32 for in_features ",
              K, " and out_features ", N, ", got ", packed.scalar_type(), " ", packed.sizes());
}

void packed_linear_rows(const float* x, int64_t M, int64_t K, const float* packed, int64_t N, float* out) {
  // Panels split across threads: each output's sum is computed by one thread, in the same order.
  // A work item of >= ~64K multiply-adds is worth a thread.
  const int64_t P = (N + kPanel - 1) / kPanel;
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(1, M * K * kPanel));
  at::parallel_for(0, P, grain, [&](int64_t p0, int64_t p1) { panels(x, M, K, packed, N, out, p0, p1); });
}

TORCH_LIBRARY_IMPL(nanochat_fast, CPU, m) {
  m.impl("pack_linear_weight", &pack_linear_weight_cpu);
  m.impl("packed_linear", &packed_linear_cpu);
}

}  // namespace nanochat_fast
