"""The lm_head's softcapped cross-entropy, forward + backward: ours vs stock PyTorch at its best.

Shapes: the lm_head of a depth-4 and a depth-8 GPT step at T=512, device batch 8: N = 4096 rows,
d = 256 / 512, V = 8192. Variants, all in the precision policy's dtype for the device (precision.choose
with no timing of a model: bf16 autocast on CUDA sm80+; on a CPU the faster dtype of the matmul probe):
    ours            softcap_cross_entropy, auto backend (cpp on CPU, triton on CUDA)
    stock eager     F.linear -> 15 tanh(z / 15) in fp32 -> F.cross_entropy, as GPT.forward had it
    stock compiled  the same function under torch.compile (inductor fuses the elementwise part)
Peak memory: what one forward+backward adds on top of its inputs, measured in a fresh process per
variant after a warm-up call; on a CPU from the resident-set high-water mark, with glibc made to hand
freed memory back at once (how: docs/measurements.md#benchmark-cross-entropy-memory).

`python benchmarks/bench_softcap_cross_entropy.py --peak VARIANT D` prints one such peak in MiB.
"""

import argparse
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from harness import compare

from nanochat_fast.hardware import precision
from nanochat_fast.kernels import registry, softcap_cross_entropy

SOFTCAP = 15.0
N, V = 8 * 512, 8192
DEPTH_WIDTH = {4: 256, 8: 512}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PRECISION = precision.choose(torch.device(DEVICE), warn=False)
CHUNKS = (256, 512, 1024, 2048, 4096)
BUDGET_S = 60  # per test: rounds are cut to it (at least harness.MIN_ROUNDS) on a slow or busy machine


def stock_loss(hidden, weight, targets):
    logits = F.linear(hidden, weight).float()
    logits = SOFTCAP * torch.tanh(logits / SOFTCAP)
    return F.cross_entropy(logits, targets, ignore_index=-1)


def make_inputs(d, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, d, generator=g)  # RMS-normed final hidden states
    weight = torch.randn(V, d, generator=g) * d**-0.5
    targets = torch.randint(0, V, (N,), generator=g)
    return hidden.to(DEVICE).requires_grad_(), weight.to(DEVICE).requires_grad_(), targets.to(DEVICE)


def step_fn(variant, hidden, weight, targets, chunk_rows=None):
    """One forward+backward of `variant`, under the device's autocast, gradients set anew."""
    if variant == "ours":

        def loss_fn(h, w, t):
            return softcap_cross_entropy(h, w, t, SOFTCAP, chunk_rows=chunk_rows)
    elif variant == "stock eager":
        loss_fn = stock_loss
    elif variant == "stock compiled":
        loss_fn = torch.compile(stock_loss)
    else:
        raise ValueError(f"unknown variant {variant!r}")

    def step():
        hidden.grad = weight.grad = None
        with precision.autocast(torch.device(DEVICE), PRECISION):
            loss = loss_fn(hidden, weight, targets)
        loss.backward()

    return step


def _status_kib(key: str) -> int:
    return int(re.search(rf"^{key}:\s+(\d+) kB", open("/proc/self/status").read(), re.M).group(1))


def peak_mib_here(variant, d) -> float:
    """Peak extra memory of one step of `variant`, in this process (see the module docstring)."""
    hidden, weight, targets = make_inputs(d)
    step = step_fn(variant, hidden, weight, targets)
    step()  # warm-up: compiles, allocates the gradients once
    hidden.grad = weight.grad = None
    if DEVICE == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - before) / 2**20
    before = _status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident set
    step()
    return (_status_kib("VmHWM") - before) / 1024


def peak_mib(variant, d) -> float:
    """peak_mib_here in a fresh process, so no earlier allocation is reused or counted."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    out = subprocess.run(
        [sys.executable, __file__, "--peak", variant, str(d)], env=env, check=True, capture_output=True, text=True
    ).stdout
    return float(out.strip().splitlines()[-1])


@pytest.mark.parametrize("depth", sorted(DEPTH_WIDTH))
def test_softcap_cross_entropy(benchmark, depth):
    d = DEPTH_WIDTH[depth]
    hidden, weight, targets = make_inputs(d)
    names = ("ours", "stock eager", "stock compiled")
    variants = {name: step_fn(name, hidden, weight, targets) for name in names}
    for step in variants.values():
        step()  # compile outside the timed rounds
    memory = {name: peak_mib(name, d) for name in names}
    notes = (
        f"ours: the {registry.select('softcap_cross_entropy', DEVICE).name} backend; peak extra memory of "
        "one forward+backward (fresh process): "
        + ", ".join(f"{name} {mib:.0f} MiB" for name, mib in memory.items())
        + f"; the full fp32 logits alone are {N * V * 4 / 2**20:.0f} MiB"
    )
    compare(
        benchmark,
        op=f"softcapped cross-entropy, forward+backward ({DEVICE}, {PRECISION.name})",
        shape_set=f"depth {depth}: N={N}, d={d}, V={V}",
        variants=variants,
        baseline="stock eager",
        rounds=11,
        budget_s=BUDGET_S,
        notes=notes,
    )


def test_chunk_rows(benchmark):
    """Rows per chunk of our op at the depth-4 shape: the measurement behind CHUNK_ROWS."""
    hidden, weight, targets = make_inputs(DEPTH_WIDTH[4])
    variants = {
        f"{c} rows ({c * V * 4 / 2**20:.0f} MiB of logits)": step_fn("ours", hidden, weight, targets, c) for c in CHUNKS
    }
    variants["auto"] = step_fn("ours", hidden, weight, targets)
    compare(
        benchmark,
        op=f"softcapped cross-entropy, rows per chunk ({DEVICE}, {PRECISION.name})",
        shape_set=f"depth 4: N={N}, d={DEPTH_WIDTH[4]}, V={V}",
        variants=variants,
        baseline="auto",
        rounds=9,
        budget_s=BUDGET_S,
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peak", nargs=2, metavar=("VARIANT", "D"), required=True)
    args = parser.parse_args()
    print(f"{peak_mib_here(args.peak[0], int(args.peak[1])):.1f}")
