"""AdamW step on a CUDA GPU: our fused multi-tensor kernels (Triton, CUDA C++) vs
torch.optim.AdamW(fused=True), each with the share of the GPU's measured memory bandwidth it reaches.
Skipped without CUDA (bench_adamw_slice.py is the CPU comparison).

The parameters of bench_adamw_slice.py (a depth-8 GPT, 58.7M fp32 values in 50 tensors). AdamW is memory
bound (14 flops per 28 bytes; benchmarks/RESULTS.md, "Compiled, not run"), so the yardstick is
bandwidth: 28 B per fp32 parameter per step over the median step time, against a device-to-device
copy of 1 GiB timed the same way (2 GiB moved).
"""

import pytest
import torch
from bench_adamw_slice import SHAPES, ours, torch_adamw
from harness import compare
from triton_kernel_list import adamw_bytes_per_param

from nanochat_fast.kernels import registry

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (make gpu-check)", allow_module_level=True)

DEVICE = "cuda"


def copy_bandwidth(nbytes=2**30, rounds=20) -> float:
    """Bytes per second of a device-to-device copy (read + write), median of `rounds`."""
    src = torch.empty(nbytes // 4, device=DEVICE)
    dst = torch.empty_like(src)
    times = []
    for i in range(rounds + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        if i >= 3:  # warmup
            times.append(start.elapsed_time(end) / 1e3)
    return 2 * nbytes / sorted(times)[len(times) // 2]


def test_adamw_cuda_depth8_gpt(benchmark):
    n = sum(torch.Size(s).numel() for s in SHAPES)
    variants = {"triton (ours)": ours("triton", DEVICE)}
    if registry.backends("adamw_slice_update")["cpp"].why_not("cuda") is None:  # the extension has CUDA
        variants["cuda C++ (ours)"] = ours("cpp", DEVICE)
    variants |= {"torch fused": torch_adamw(DEVICE, fused=True), "torch foreach": torch_adamw(DEVICE, foreach=True)}
    bandwidth = copy_bandwidth()
    per_param = adamw_bytes_per_param(torch.float32)
    moved = n * per_param
    medians = compare(
        benchmark,
        op="AdamW step (cuda)",
        baseline="torch fused",
        rounds=30,
        warmup_rounds=5,
        shape_set=f"depth-8 GPT: {n / 1e6:.1f}M fp32 values in {len(SHAPES)} tensors",
        variants=variants,
        notes="",
    )
    share = "; ".join(
        f"{name}: {moved / t / 1e9:,.0f} GB/s = {100 * moved / t / bandwidth:.0f}%" for name, t in medians.items()
    )
    benchmark.extra_info["notes"] = (
        f"{per_param} B per parameter; measured copy bandwidth {bandwidth / 1e9:,.0f} GB/s; share of it: {share}"
    )
