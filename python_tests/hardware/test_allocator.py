"""hardware/allocator.py: after keep_freed_memory, a block freed by one step is served again to the next
without the kernel faulting its pages in again (glibc on Linux); with the C library's defaults it is not."""

import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")

# a step's big block three times, from the C library's malloc: allocated, written, freed; the page faults of
# the third step are counted. (torch asks for its blocks aligned, which pads them: in a real step the blocks
# freed together merge, and the next step's are cut from them; the model's steps: measurements.md.)
THREE_STEPS = """
import ctypes, resource, sys
from nanochat_fast.hardware import allocator
if sys.argv[1] == "keep":
    print(allocator.keep_freed_memory(), file=sys.stderr)
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
SIZE = 64 << 20  # above glibc's largest mmap threshold (32 MiB)

def step():
    block = libc.malloc(SIZE)
    ctypes.memset(block, 1, SIZE)
    libc.free(block)

step()
step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def third_step(mode: str) -> tuple[int, str]:
    """(page faults of the third step, what keep_freed_memory said) in a process of its own."""
    done = subprocess.run([sys.executable, "-c", THREE_STEPS, mode], capture_output=True, text=True, check=True)
    return int(done.stdout), done.stderr.strip()


def test_a_freed_block_is_reused_without_page_faults():
    pages = (64 << 20) >> 12
    (default, _), (kept, said) = third_step("default"), third_step("keep")
    assert said.startswith("glibc malloc keeps freed memory"), said
    assert default >= pages, default  # mmap'd afresh and faulted in again, page by page
    assert kept < pages // 100, (kept, default)
