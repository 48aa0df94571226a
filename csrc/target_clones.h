#pragma once

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
// target: left out of line it is compiled once, for the default target (measured: packed_linear's
// vector helpers then ran as scalar code, 18x to 44x slower).
#define NANOCHAT_FAST_INLINE inline __attribute__((always_inline))
