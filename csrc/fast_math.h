#pragma once
// exp and tanh as inline polynomial approximations (Cephes' expf and tanhf, relative error ~1e-7),
// written as plain arithmetic with no branch and no libm call, so that GCC vectorises the loops
// that call them (std::exp and std::tanh keep a loop scalar). Used by the softcapped
// cross-entropy, the inference softcap and the decode attention's softmax.
#include <cmath>
#include <cstdint>
#include <cstring>

#include "target_clones.h"

namespace nanochat_fast {

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
// through the code after it and the loop keeps branches (measured: a scalar, 20x slower loop).
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
