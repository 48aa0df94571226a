"""
The GPU check's measurements; gpu_check.py runs each as a step of its own, under its own time cap:

    python benchmarks/gpu_measure.py STEP --json OUT [--tiny]

    kernels        every Triton kernel at every config of its GPU table, and the CUDA AdamW kernel: max error
    adamw          the fused AdamW slice update against torch.optim.AdamW(fused=True) and (foreach=True)
    newton_schulz  m x m at m = 1024 ... 8192: the Triton symmetric kernels against plain bf16 cuBLAS products
    muon           a Muon step over a depth-12 and a depth-20 GPT's matrices, against torch.optim.Muon
    cross_entropy  softcapped cross-entropy forward+backward at a 65,536-token vocabulary, against stock

Each writes its figures to OUT (JSON) after every measurement, so a step stopped at its cap still leaves
what it measured. --tiny shrinks every shape so the rehearsal (gpu_check.py rehearse) runs the same code
on a CPU. What each step measures against what, and how it times: docs/measurements.md#gpu-measurements.
"""

import argparse
import importlib
import json
import os
import statistics
import sys
import time
import traceback
import unittest.mock
from pathlib import Path

import torch

if not torch.cuda.is_available():  # the rehearsal: Triton runs on CPU tensors only in its interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from triton_kernel_list import adamw_bytes_per_param  # noqa: E402

from nanochat_fast.hardware import peak as hw_peak  # noqa: E402
from nanochat_fast.hardware import precision
from nanochat_fast.kernels import adamw_slice_update, registry, softcap_cross_entropy  # noqa: E402
from nanochat_fast.kernels.newton_schulz import (  # noqa: E402
    QUINTIC,
    dtype_name,
    newton_schulz_reference,  # noqa: E402
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
SOFTCAP = 15.0
NS_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}  # max |error| of an orthogonalized matrix
CE_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2**-7}  # max error / max |expected|


class Figures:
    """The step's figures, written to `path` whenever one is added."""

    def __init__(self, path: Path, step: str, tiny: bool):
        self.path, self.data = path, dict(step=step, device=_device_name(), tiny=tiny, results={})

    def add(self, key: str, value):
        self.data["results"][key] = value
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text(json.dumps(self.data, indent=1))
        os.replace(tmp, self.path)
        print(f"{key}: {json.dumps(value)}", flush=True)


def _device_name() -> str:
    return torch.cuda.get_device_name() if DEVICE.type == "cuda" else "cpu"


def sync():
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def interleaved(variants: dict, rounds: int, warmup: int = 2) -> dict:
    """Median seconds per call of each variant (name -> callable), timed in interleaved rounds."""
    times = {name: [] for name in variants}
    for r in range(warmup + rounds):
        for name, fn in variants.items():
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            if r >= warmup:
                times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


def scaled_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    """max |got - expected| / max |expected|: the error on the scale of the largest entry."""
    expected = expected.double()
    return ((got.double() - expected).abs().max() / expected.abs().max().clamp_min(1e-30)).item()


def peak_extra_bytes(fn) -> int | None:
    """Memory one call of fn allocates beyond what is held before it (CUDA only)."""
    if DEVICE.type != "cuda":
        return None
    sync()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    sync()
    return torch.cuda.max_memory_allocated() - before


def _try(fig: Figures, key: str, measure):
    """One measurement; a failure is recorded under its key (the step goes on with the next)."""
    try:
        fig.add(key, measure())
    except Exception as e:  # a config that fails to compile or run is named, not fatal
        traceback.print_exc()
        fig.add(
            key,
            dict(
                ok=False, error=f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"
            ),
        )


# ---------------------------------------------------------------------------------------------
# kernels: every config of every GPU table


def float64_newton_schulz(G: torch.Tensor, steps: int = 5) -> torch.Tensor:
    return newton_schulz_reference(G.double(), (QUINTIC,) * steps, torch.float64)


def kernels(fig: Figures, tiny: bool):
    from nanochat_fast.kernels import adamw_slice as adamw_slice_triton
    from nanochat_fast.kernels import newton_schulz_triton as nst

    sce = importlib.import_module("nanochat_fast.kernels.softcap_cross_entropy")

    g = torch.Generator(device=DEVICE).manual_seed(0)
    # Newton-Schulz: the three kernels together, a stack of MLP-shaped matrices (not a multiple of the
    # 128 tile in the short side, so the edge tiles' masks are exercised)
    G = torch.randn((2, 96, 160) if tiny else (4, 704, 2816), device=DEVICE, generator=g)
    expected = float64_newton_schulz(G)
    # the yardstick: stock bf16 products' own error (the tolerances are the tests', absolute)
    stock_bf16 = (newton_schulz_reference(G, (QUINTIC,) * 5, torch.bfloat16).double() - expected).abs().max().item()
    for cfg_name, cfg in nst.GPU_CONFIGS.items():
        for dtype in (torch.bfloat16, torch.float32):

            def run(cfg=cfg, dtype=dtype):
                if INTERPRETED and dtype == torch.bfloat16 and not cfg.get("DOT_FP32"):
                    return dict(ok=None, skipped="the interpreter's bf16 tl.dot is not a GPU's (checked on a GPU only)")
                out = nst.newton_schulz_triton(G, (QUINTIC,) * 5, dtype, config=cfg)
                err = (out.double() - expected).abs().max().item()
                return dict(
                    ok=err <= NS_TOLERANCE[dtype],
                    max_error=err,
                    tolerance=NS_TOLERANCE[dtype],
                    stock_bf16_error=stock_bf16,
                    shape=list(G.shape),
                    against="float64",
                )

            _try(fig, f"newton_schulz_triton/{cfg_name}/{dtype_name(dtype)}", run)

    # softcapped cross-entropy row pass: loss and dz against float64 PyTorch
    rows, vocab = (8, 1000) if tiny else (256, 65536)
    z = torch.randn(rows, vocab, device=DEVICE, generator=g) * 8
    targets = torch.randint(0, vocab, (rows,), device=DEVICE, generator=g)
    targets[::5] = -1
    for cfg_name, cfg in sce.GPU_CONFIGS.items():
        for dtype in (torch.bfloat16, torch.float32):

            def run(cfg=cfg, dtype=dtype):
                zz = z.to(dtype, copy=True)  # the kernel writes dz over it
                # the reference computed from the logits as the kernel sees them (bf16-rounded)
                ref = zz.double().requires_grad_()
                losses = torch.empty(rows, device=DEVICE)
                scale = torch.ones(rows, device=DEVICE) if cfg["COMPUTE_GRAD"] else None
                sce.triton_row_pass(zz, targets, scale, losses, SOFTCAP, -1, config=cfg)
                ref_loss = F.cross_entropy(
                    SOFTCAP * torch.tanh(ref / SOFTCAP), targets, ignore_index=-1, reduction="none"
                )
                ref_loss.sum().backward()
                err = dict(loss=scaled_error(losses, ref_loss.detach()))
                if cfg["COMPUTE_GRAD"]:
                    err["dz"] = scaled_error(zz, ref.grad)
                worst = max(err.values())
                tol = CE_TOLERANCE[dtype] if cfg["COMPUTE_GRAD"] else 1e-5  # dz is stored in the logits' dtype
                return dict(ok=worst <= tol, max_error=err, tolerance=tol, shape=[rows, vocab], against="float64")

            _try(fig, f"softcap_ce_triton/{cfg_name}/{dtype_name(dtype)}", run)

    # AdamW: the Triton multi-tensor kernel at each config, and the CUDA C++ kernel, against the reference backend
    shapes = [(300, 70), (5000,), (129, 257)] if tiny else [(8192, 768), (768, 3072), (3072, 768), (1000, 999)]
    for backend, configs in (("triton", adamw_slice_triton.GPU_CONFIGS), ("cpp", {"default": None})):
        for cfg_name, cfg in configs.items():
            for dtype in (torch.float32, torch.bfloat16):

                def run(backend=backend, cfg=cfg, dtype=dtype):
                    why = registry.backends("adamw_slice_update")[backend].why_not(DEVICE.type)
                    if why:  # the environment step fails for an extension without CUDA; here it is named
                        return dict(ok=None, skipped=why)
                    patch = (
                        unittest.mock.patch.dict(adamw_slice_triton.CONFIGS, {DEVICE.type: cfg}) if cfg else _nothing()
                    )
                    with patch:
                        err = _adamw_error(shapes, dtype, backend)
                    tol = 1e-5 if dtype == torch.float32 else 2**-7
                    return dict(
                        ok=err <= tol,
                        max_error=err,
                        tolerance=tol,
                        tensors=len(shapes),
                        against="reference backend",
                        kernel="CUDA C++" if backend == "cpp" and DEVICE.type == "cuda" else backend,
                    )

                _try(fig, f"adamw_{backend}/{cfg_name}/{dtype_name(dtype)}", run)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _adamw_error(shapes, dtype, backend, steps=3) -> float:
    """Max relative error of `backend`'s params and moments after `steps` updates, against the reference."""
    g = torch.Generator(device=DEVICE).manual_seed(1)
    start = [torch.randn(s, device=DEVICE, generator=g).to(dtype) for s in shapes]
    grads = [[torch.randn(s, device=DEVICE, generator=g).to(dtype) for s in shapes] for _ in range(steps)]
    results = []
    for name in (backend, "reference"):
        params = [p.clone() for p in start]
        m = [torch.zeros(s, device=DEVICE) for s in shapes]
        v = [torch.zeros(s, device=DEVICE) for s in shapes]
        for step in range(1, steps + 1):
            adamw_slice_update(
                params,
                grads[step - 1],
                m,
                v,
                step,
                1e-3,
                0.8,
                0.95,
                1e-10,
                0.1,
                [1.0, 0.5, 2.0, 1.0][: len(shapes)],
                [1.0, 0.0, 1.0, 0.5][: len(shapes)],
                backend=name,
            )
        results.append(params + m + v)
    return max(scaled_error(a, b) for a, b in zip(*results))


# ---------------------------------------------------------------------------------------------
# speed against the best stock setup


def adamw(fig: Figures, tiny: bool):
    import bench_adamw_slice as ba

    shapes = [(64, 32)] * 4 if tiny else ba.SHAPES
    n = sum(torch.Size(s).numel() for s in shapes)
    variants = {}
    with unittest.mock.patch.object(ba, "SHAPES", shapes):
        for name, backend in (("triton (ours)", "triton"), ("CUDA C++ (ours)", "cpp")):
            if registry.backends("adamw_slice_update")[backend].why_not(DEVICE.type) is None:
                variants[name] = ba.ours(backend, DEVICE)
        variants["torch fused"] = ba.torch_adamw(DEVICE, fused=True)
        variants["torch foreach"] = ba.torch_adamw(DEVICE, foreach=True)
    medians = interleaved(variants, rounds=5 if tiny else 30, warmup=2 if tiny else 5)
    moved = n * adamw_bytes_per_param(torch.float32)
    peak = hw_peak.datasheet_bandwidth(_device_name()) if DEVICE.type == "cuda" else None
    fig.add(
        "adamw",
        dict(
            params=n,
            tensors=len(shapes),
            bytes_per_param=adamw_bytes_per_param(torch.float32),
            datasheet_bandwidth=peak,
            baseline="torch fused",
            variants={
                name: dict(
                    ms=t * 1e3,
                    GB_per_s=moved / t / 1e9,
                    pct_of_datasheet=100 * moved / t / peak if peak else None,
                    speedup=medians["torch fused"] / t,
                )
                for name, t in medians.items()
            },
        ),
    )


def newton_schulz(fig: Figures, tiny: bool):
    from nanochat_fast.kernels import newton_schulz as ns_op

    sizes = (64, 128) if tiny else (1024, 2048, 4096, 8192)
    for m in sizes:
        G = torch.randn(m, m, device=DEVICE)
        variants = {
            "triton symmetric (ours)": lambda G=G: ns_op(G, backend="triton", dtype=torch.bfloat16),
            "torch bf16 matmuls (cuBLAS)": lambda G=G: ns_op(G, backend="reference", dtype=torch.bfloat16),
        }

        def run(m=m, G=G, variants=variants):
            medians = interleaved(variants, rounds=3 if tiny else 10, warmup=1 if tiny else 3)
            plain_flops = 5 * (4 * m**3 + 2 * m**3)
            err = scaled_error(variants["triton symmetric (ours)"](), variants["torch bf16 matmuls (cuBLAS)"]())
            return dict(
                shape=[m, m],
                steps=5,
                baseline="torch bf16 matmuls (cuBLAS)",
                difference=err,
                variants={
                    name: dict(
                        ms=t * 1e3,
                        plain_tflops=plain_flops / t / 1e12,
                        speedup=medians["torch bf16 matmuls (cuBLAS)"] / t,
                    )
                    for name, t in medians.items()
                },
            )

        _try(fig, f"newton_schulz/{m}", run)
        del G


def muon(fig: Figures, tiny: bool):
    import bench_muon as bm

    with unittest.mock.patch.object(bm, "DEVICE", DEVICE.type):
        for depth in (1, 2) if tiny else (12, 20):
            shapes = bm.gpt_matrices(depth)

            def run(shapes=shapes, depth=depth):
                ours, stock = bm.ours(shapes, "auto")[1], bm.torch_muon(shapes)[1]
                medians = interleaved(
                    {"ours (Muon, defaults)": ours, "torch.optim.Muon": stock},
                    rounds=3 if tiny else 10,
                    warmup=1 if tiny else 3,
                )
                return dict(
                    depth=depth,
                    matrices=len(shapes),
                    params=sum(r * c for r, c in shapes),
                    baseline="torch.optim.Muon",
                    variants={
                        name: dict(ms=t * 1e3, speedup=medians["torch.optim.Muon"] / t) for name, t in medians.items()
                    },
                )

            _try(fig, f"muon/depth{depth}", run)


def cross_entropy(fig: Figures, tiny: bool):
    rows, d, vocab = (64, 32, 1000) if tiny else (16384, 768, 65536)
    g = torch.Generator(device=DEVICE).manual_seed(0)
    hidden = torch.randn(rows, d, device=DEVICE, generator=g).requires_grad_()
    weight = (torch.randn(vocab, d, device=DEVICE, generator=g) * d**-0.5).requires_grad_()
    targets = torch.randint(0, vocab, (rows,), device=DEVICE, generator=g)
    choice = precision.choose(DEVICE, warn=False)

    def stock(h, w, t):
        logits = F.linear(h, w).float()
        return F.cross_entropy(SOFTCAP * torch.tanh(logits / SOFTCAP), t, ignore_index=-1)

    compiled = torch.compile(stock)
    losses = {
        "ours (fused, chunked)": lambda h, w, t: softcap_cross_entropy(h, w, t, SOFTCAP),
        "stock eager": stock,
        "stock compiled": compiled,
    }

    def step(loss_fn):
        def run():
            hidden.grad = weight.grad = None
            with precision.autocast(DEVICE, choice):
                loss = loss_fn(hidden, weight, targets)
            loss.backward()
            return loss

        return run

    variants = {name: step(fn) for name, fn in losses.items()}
    results = {}
    for name, fn in variants.items():
        try:
            loss = fn()  # compiles, and the figure for agreement
            results[name] = dict(
                loss=loss.item(), peak_extra_MiB=(lambda b: b / 2**20 if b is not None else None)(peak_extra_bytes(fn))
            )
        except Exception as e:
            results[name] = dict(ok=False, error=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
    runnable = {name: fn for name, fn in variants.items() if "error" not in results[name]}
    medians = interleaved(runnable, rounds=3 if tiny else 10, warmup=1 if tiny else 2)
    base = medians.get("stock compiled") or medians.get("stock eager")
    for name, t in medians.items():
        results[name].update(
            ms=t * 1e3, speedup_vs_best_stock=min(medians.get("stock compiled", t), medians.get("stock eager", t)) / t
        )
    fig.add(
        "cross_entropy",
        dict(
            rows=rows,
            n_embd=d,
            vocab=vocab,
            dtype=dtype_name(choice.dtype),
            baseline="stock compiled" if "stock compiled" in medians else "stock eager",
            baseline_ms=base * 1e3 if base else None,
            variants=results,
        ),
    )


STEPS = dict(kernels=kernels, adamw=adamw, newton_schulz=newton_schulz, muon=muon, cross_entropy=cross_entropy)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="benchmarks/gpu_measure.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("step", choices=sorted(STEPS))
    p.add_argument("--json", type=Path, required=True, help="where the figures go (rewritten after each)")
    p.add_argument("--tiny", action="store_true", help="small shapes: the rehearsal on a CPU")
    args = p.parse_args(argv)
    fig = Figures(args.json, args.step, args.tiny)
    fig.add("started", time.strftime("%H:%M:%S"))
    STEPS[args.step](fig, args.tiny)
    results = fig.data["results"]
    failed = [k for k, v in results.items() if isinstance(v, dict) and v.get("ok") is False]
    print(f"{len(results) - 1} measured" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
