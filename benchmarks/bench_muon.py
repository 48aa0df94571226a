"""One Muon step over the matrices of a depth-8 GPT and of a depth-20 GPT (width 1280): ours as a
default base_train run has it (the minimax4 recipe: 4 tuned Newton-Schulz steps, ns_dtype auto), the
quintic recipe (nanochat's: 5 steps) at auto's dtype, forced fp32 and forced bf16, against
torch.optim.Muon, in the same interleaved rounds.

Every variant gets the same lr (0.02), momentum (0.95, Nesterov), 5 quintic steps (minimax4: its 4) and
update scale (max(1, rows/cols)^0.5), weight_decay=0 for torch's. Before timing, one step of ours (fp32) and of
torch's from the same state is checked to give the same update (to bf16 accuracy) on small
matrices of the same aspect ratios. Each test plans its variants from flop counts and this
machine's matmul rates (harness.plan_modes): a full step, a per-shape estimate, or not timed (the
table says why). The matrices, how auto is decided, and the time budget:
docs/measurements.md#benchmark-muon-step.
"""

import time

import torch
from harness import compare, matmul_gflops, plan_modes

from nanochat_fast.hardware import precision
from nanochat_fast.kernels.newton_schulz import QUINTIC, plan
from nanochat_fast.model.gpt import GPT, config_from_depth
from nanochat_fast.optim import Muon
from nanochat_fast.train.training_config import OptimConfig

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HP = dict(lr=0.02, momentum=0.95, nesterov=True)
# with bench_newton_schulz.py: ~6 minutes on a 2-core CPU; depth 20 leaves room for the minimax4 recipe per shape
BUDGET_S = {8: 140.0, 20: 80.0}


def gpt_matrices(depth):
    """Shapes of the Muon-optimized matrices of a GPT of `depth`, read from the model itself."""
    with torch.device("meta"):
        model = GPT(config_from_depth(depth, vocab_size=256, sequence_len=64))
    return [tuple(p.shape) for p in model.transformer.h.parameters()]


RUN_DEFAULT = OptimConfig().recipe()  # base_train's default recipe for the gpt family (minimax4)
DEFAULT_NS = dict(ns_steps=RUN_DEFAULT.ns_steps, ns_coefficients=RUN_DEFAULT.ns_coefficients)


def ns_flops(shape, steps=5):
    m, n = sorted(shape)
    return steps * (4 * m * m * n + 2 * m**3)


def make_params(shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, generator=g).mul_(0.02).to(DEVICE)) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(DEVICE)
    return params


def ours(shapes, ns_dtype, ns=None):
    params = make_params(shapes)
    ns = ns or dict(ns_steps=5, ns_coefficients="quintic")
    opt = Muon([(f"m{i}", p) for i, p in enumerate(params)], ns_dtype=ns_dtype, **ns, **HP)
    if ns_dtype == "auto":  # decided now (as base_train does before its first step), not in a timed round
        opt.resolve_ns_precision()
    return params, opt.step


def auto_choice(shapes):
    """The Precision the run's default Muon (ns_dtype="auto") decides over matrices of these shapes
    (its resolve_ns_precision), on parameters that are never written (torch.empty: no memory is
    touched, so deciding for a depth-20 set costs nothing)."""
    params = [torch.nn.Parameter(torch.empty(s, device=DEVICE)) for s in shapes]
    return Muon(
        [(f"m{i}", p) for i, p in enumerate(params)], ns_dtype="auto", **DEFAULT_NS, **HP
    ).resolve_ns_precision()


def torch_muon(shapes):
    params = make_params(shapes)
    return params, torch.optim.Muon(
        params, weight_decay=0.0, ns_coefficients=QUINTIC, ns_steps=5, eps=1e-7, adjust_lr_fn="original", **HP
    ).step


def per_shape(make, shapes):
    """A callable timing one matrix of each distinct shape and returning the seconds a full step
    stands for: sum over shapes of (matrices of that shape) x (time of one)."""
    counts = {s: shapes.count(s) for s in sorted(set(shapes))}
    steps = {s: make([s])[1] for s in counts}

    def run():
        total = 0.0
        for s, step in steps.items():
            if DEVICE == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            step()
            if DEVICE == "cuda":
                torch.cuda.synchronize()
            total += counts[s] * (time.perf_counter() - t0)
        return total

    return run


def check_same_update(shapes):
    """One step from identical params, grads and (zero) momentum: the updates agree. On matrices
    with the shapes' aspect ratios scaled to 64 rows or columns (cheap in emulated bf16 too)."""
    small = sorted({(64 * r // min(r, c), 64 * c // min(r, c)) for r, c in shapes})
    (p_ours, step_ours), (p_torch, step_torch) = ours(small, "fp32"), torch_muon(small)
    start = [p.detach().clone() for p in p_ours]
    step_ours()
    step_torch()
    for s, a, b in zip(start, p_ours, p_torch):
        da, db = (a.detach() - s).double(), (b.detach() - s).double()
        assert (da - db).abs().max() <= 0.05 * da.abs().max(), "torch.optim.Muon computes a different update"


def bf16_capability() -> str:
    choice = precision.choose(torch.device(DEVICE), "bf16", what="--ns-dtype", warn=False)
    return choice.reason.removeprefix("asked for; ")


def muon_benchmark(benchmark, depth):
    shapes = gpt_matrices(depth)
    check_same_update(shapes)
    auto = auto_choice(shapes)  # the defaults' choice for this set; cached for the auto optimizer below
    ours_auto = f"ours, run default: {RUN_DEFAULT.name} recipe (auto: {auto.name})"
    ours_quintic = f"ours, quintic recipe ({auto.name} as auto)"
    dtypes = {
        "torch.optim.Muon (bf16)": "bf16",
        ours_auto: auto.name,
        ours_quintic: auto.name,
        "ours, quintic, forced fp32": "fp32",
        "ours, quintic, forced bf16": "bf16",
    }
    # ours (auto) is the default optimizer on the full set; per shape (one matrix each) it would
    # decide for that one matrix, so there it runs the whole set's choice
    makers = {
        "torch.optim.Muon (bf16)": torch_muon,
        ours_auto: lambda s: ours(s, "auto" if s == shapes else auto.name, DEFAULT_NS),
        ours_quintic: lambda s: ours(s, auto.name),
        "ours, quintic, forced fp32": lambda s: ours(s, "fp32"),
        "ours, quintic, forced bf16": lambda s: ours(s, "bf16"),
    }
    full = sum(ns_flops(s) for s in shapes)
    one_each = sum(ns_flops(s) for s in set(shapes))
    rate = {d: matmul_gflops(precision.DTYPES[d], DEVICE) * 1e9 for d in ("fp32", "bf16")}
    costs = {name: {"full step": full / rate[d], "per shape": one_each / rate[d]} for name, d in dtypes.items()}
    costs[ours_auto] = {mode: seconds * RUN_DEFAULT.ns_steps / 5 for mode, seconds in costs[ours_auto].items()}
    modes, skipped = plan_modes(costs, BUDGET_S[depth], required=ours_auto)
    for name in skipped:
        skipped[name] += (
            f"; flop-count estimate {full / rate[dtypes[name]]:.1f} s/step "
            f"({full / 1e9:.0f} GFLOP at the measured {dtypes[name]} matmul rate)"
        )
    variants = {}
    for name, mode in modes.items():
        label = f"{name} [{mode}]"
        variants[label] = makers[name](shapes)[1] if mode == "full step" else per_shape(makers[name], shapes)
    baseline = next((v for v in variants if v.startswith("torch")), next(iter(variants)))
    kinds = sorted(set(shapes))
    plans = {k: plan(k, DEVICE, auto.dtype) for k in kinds}  # the path and backend ours (auto) runs
    choice = ", ".join(f"{r}x{c} -> {plans[r, c][2]} ({plans[r, c][0].name})" for r, c in kinds)
    shape_set = (
        f"depth-{depth} GPT: {len(shapes)} matrices, {sum(r * c for r, c in shapes) / 1e6:.1f}M fp32 "
        f"({', '.join(f'{shapes.count(k)}x {k[0]}x{k[1]}' for k in kinds)}); bf16 here: {bf16_capability()}"
    )
    medians = compare(
        benchmark,
        op=f"Muon step ({DEVICE})",
        baseline=baseline,
        rounds=9,
        warmup_rounds=1,
        budget_s=BUDGET_S[depth],
        skipped=skipped,
        shape_set=shape_set,
        variants=variants,
        notes=f"ns-dtype auto = {auto.describe()}; ours (auto) per shape: {choice}; matmul rates "
        f"measured here: fp32 {rate['fp32'] / 1e9:.0f}, bf16 {rate['bf16'] / 1e9:.1f} GFLOP/s; "
        "same lr, momentum, Nesterov, 5 quintic steps (minimax4: its 4 tuned steps) and update scale",
    )
    auto_label = next(v for v in variants if v.startswith(ours_auto))
    others = [v for v in variants if v != auto_label]
    speedups = ", ".join(f"{v}: {medians[v] / medians[auto_label]:.2f}x" for v in others)
    quintic = next((v for v in variants if v.startswith(ours_quintic)), None)
    against_torch = (
        f"; {quintic} vs {baseline}: {medians[baseline] / medians[quintic]:.2f}x"
        if quintic and baseline.startswith("torch")
        else ""
    )
    benchmark.extra_info["notes"] = (
        f"{auto_label} vs {speedups} (their time / ours: above 1, ours is faster){against_torch}; "
        + benchmark.extra_info["notes"]
    )


def test_muon_step_depth8_gpt(benchmark):
    muon_benchmark(benchmark, 8)


def test_muon_step_depth20_gpt(benchmark):
    muon_benchmark(benchmark, 20)
