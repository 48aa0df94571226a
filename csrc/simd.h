#pragma once
// What the CPU kernels share to run vectorised: one copy of a hot loop per target (target_clones),
// float vectors of the target's register width, and exp and tanh as branch-free polynomials.
#include <cmath>
#include <cstdint>
#include <cstring>

// -- one copy per target ------------------------------------------------------------------------
// NANOCHAT_FAST_CLONES("avx2", "default"): compile a hot loop once per target, the dynamic loader
// picks the copy for the CPU at hand (GCC on x86-64 Linux, where ifuncs exist); elsewhere (clang,
// aarch64, macOS) one plain copy.
// NANOCHAT_FAST_TARGET("arch=x86-64-v3"): one function compiled for one target, for code that picks
// its copy itself (packed_linear: a vector type per target), only where NANOCHAT_FAST_HAS_CLONES.
#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && !defined(__clang__)
#define NANOCHAT_FAST_HAS_CLONES 1
#define NANOCHAT_FAST_CLONES(...) __attribute__((target_clones(__VA_ARGS__)))
#define NANOCHAT_FAST_TARGET(arch) __attribute__((target(arch)))
#else
#define NANOCHAT_FAST_HAS_CLONES 0
#define NANOCHAT_FAST_CLONES(...)
#endif

// A helper called from a cloned function must be inlined into it to be compiled for that clone's
// target: left out of line it is compiled once, for the default target, and runs as scalar code
// (docs/measurements.md#packed-decode-linears).
#define NANOCHAT_FAST_INLINE inline __attribute__((always_inline))

namespace nanochat_fast {

// -- float vectors --------------------------------------------------------------------------------
// Float vectors of the target's register width, written with GCC/Clang vector extensions, for the
// kernels that pick a copy per target at load time (packed_linear, decode_attention): 16 floats
// with AVX-512, 8 with AVX2, 4 elsewhere. A vector wider than the target's registers is not an
// error, but GCC lowers it through the stack (docs/measurements.md#packed-decode-linears): each copy
// uses its own target's width.
// A CPU runs only its own width; csrc/tests/test_vector_widths.cpp checks every width on any CPU.
template <int W>
struct VecOf {
  typedef float type __attribute__((vector_size(W * sizeof(float))));
};

template <int W>
NANOCHAT_FAST_INLINE typename VecOf<W>::type load(const float* p) {
  typename VecOf<W>::type v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

template <int W>
NANOCHAT_FAST_INLINE void store(float* p, typename VecOf<W>::type v) {
  std::memcpy(p, &v, sizeof v);
}

// The lanes of v added in a fixed order (halves, then quarters, ...), the same for every vector.
template <int W>
NANOCHAT_FAST_INLINE float lane_sum(typename VecOf<W>::type v) {
  float lanes[W];
  store<W>(lanes, v);
  for (int width = W / 2; width > 0; width /= 2)
    for (int i = 0; i < width; ++i) lanes[i] += lanes[i + width];
  return lanes[0];
}

// -- exp and tanh ---------------------------------------------------------------------------------
// exp and tanh as inline polynomial approximations (Cephes' expf and tanhf, relative error ~1e-7),
// written as plain arithmetic with no branch and no libm call, so that GCC vectorises the loops
// that call them (std::exp and std::tanh keep a loop scalar). Used by the softcapped
// cross-entropy, the inference softcap and the decode attention's softmax.
NANOCHAT_FAST_INLINE int32_t float_bits(float f) {
  int32_t i;
  std::memcpy(&i, &f, sizeof i);
  return i;
}

NANOCHAT_FAST_INLINE float bits_to_float(int32_t i) {
  float f;
  std::memcpy(&f, &i, sizeof f);
  return f;
}

// c ? a : b as bit operations. Written as a ?: on floats, GCC threads the constant of a clamp
// through the code after it and the loop keeps branches: a scalar loop.
NANOCHAT_FAST_INLINE float select(bool c, float a, float b) {
  const int32_t mask = -static_cast<int32_t>(c);
  return bits_to_float((float_bits(a) & mask) | (float_bits(b) & ~mask));
}

// e^x for x in [-87.3, 88] (clamped outside): x = n ln2 + r with |r| <= ln2/2, e^r by Cephes'
// degree-6 polynomial, 2^n put straight into the exponent bits. n is rounded by adding 1.5 * 2^23
// (the sum's low mantissa bits are then n): std::floor would keep GCC from vectorising the loop.
NANOCHAT_FAST_INLINE float exp_approx(float x) {
  constexpr float kRound = 12582912.0f;
  x = select(x < -87.3f, -87.3f, x);
  x = select(x > 88.0f, 88.0f, x);
  const float shifted = x * 1.44269504088896341f + kRound;
  const float n = shifted - kRound;
  const int32_t n_int = float_bits(shifted) - float_bits(kRound);
  float r = x - n * 0.693359375f;  // ln2 split in two so n * ln2 is exact enough
  r = r + n * 2.12194440e-4f;
  const float r2 = r * r;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r2 + r + 1.0f;
  return p * bits_to_float((n_int + 127) << 23);
}

// tanh: Cephes' odd polynomial below |x| = 0.625, 1 - 2 / (e^{2|x|} + 1) above (no cancellation
// there); both computed and one selected, so the loop has no branch. A NaN input stays NaN.
NANOCHAT_FAST_INLINE float tanh_approx(float x) {
  const float a = std::fabs(x);
  const float z = x * x;
  float small = -5.70498872745e-3f;
  small = small * z + 2.06390887954e-2f;
  small = small * z - 5.37397155531e-2f;
  small = small * z + 1.33314422036e-1f;
  small = small * z - 3.33332819422e-1f;
  small = small * z * x + x;
  const float big = 1.0f - 2.0f / (exp_approx(2.0f * select(a > 9.0f, 9.0f, a)) + 1.0f);  // tanh(9) = 1 in fp32
  return select(a < 0.625f, small, std::copysign(big, x));
}

}  // namespace nanochat_fast
