"""
How a process gets its memory from the C library. A training step allocates and frees the same large blocks
every step (activations, gradients, the optimizer's stacks). glibc's malloc serves a block above its mmap
threshold (32 MB at most) with fresh pages from the kernel and gives them back when it is freed, and it trims
freed memory at the top of its heap: each step then faults its memory in again, page by page, in the kernel.
`keep_freed_memory` tells malloc to take every block from its heap and keep what is freed for the next
request: docs/measurements.md#freed-memory-kept.
"""

import ctypes
import ctypes.util
import sys
from functools import cache

M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # mallopt's parameter numbers (malloc.h)
TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int: freed memory up to 2 GiB at the heap's top stays


@cache
def keep_freed_memory() -> str:
    """Set glibc's malloc (Linux) to serve every block from its heap and keep freed memory; once per process,
    before the big allocations. Returns what it did, for the log: elsewhere (macOS, musl) nothing."""
    if not sys.platform.startswith("linux"):
        return "the C library's defaults"
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # glibc only: mallopt's numbers are glibc's
    except (OSError, AttributeError):
        return "the C library's defaults (not glibc)"
    # no mmap'd blocks (each would be new pages on every allocation), and no trimming of what is freed
    if libc.mallopt(M_MMAP_MAX, 0) != 1 or libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) != 1:
        return "the C library's defaults (mallopt refused)"
    return "glibc malloc keeps freed memory (no mmap'd blocks, no trimming)"
