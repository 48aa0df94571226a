#pragma once

// NANOCHAT_FAST_CLONES("avx2", "default"): compile a hot loop once per target, the dynamic loader
// picks the copy for the CPU at hand (GCC on x86-64 Linux, where ifuncs exist); elsewhere (clang,
// aarch64, macOS) one plain copy.
#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && !defined(__clang__)
#define NANOCHAT_FAST_CLONES(...) __attribute__((target_clones(__VA_ARGS__)))
#else
#define NANOCHAT_FAST_CLONES(...)
#endif

// A helper called from a cloned function must be inlined into it to be compiled for that clone's
// target: left out of line it is compiled once, for the default target (measured: packed_linear's
// vector helpers then ran as scalar code, 18x to 44x slower).
#define NANOCHAT_FAST_INLINE inline __attribute__((always_inline))
