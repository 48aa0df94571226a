#pragma once
// Float vectors of the target's register width, written with GCC/Clang vector extensions, for the
// kernels that pick a copy per target at load time (packed_linear, decode_attention): 16 floats
// with AVX-512, 8 with AVX2, 4 elsewhere. A vector wider than the target's registers is not an
// error, but GCC lowers it through the stack (20x slower): each copy uses its own target's width.
// A CPU runs only its own width; csrc/tests/test_vector_widths.cpp checks every width on any CPU.
#include <cstdint>
#include <cstring>

#include "target_clones.h"

namespace nanochat_fast {

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

}  // namespace nanochat_fast
