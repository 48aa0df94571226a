"""Whole training steps: tokens/s of full optimizer steps (data from the real loader, forward,
backward, optimizer) at depth 4 and depth 8, T=512, vocab 8192, 8 rows per micro-batch and 4096
tokens per step (one micro-batch): our defaults against every forced setting of the choices they
make (the grid) and against stock PyTorch at its best on this machine.

Variants: ours (defaults), built the way base_train builds it; the grid (--dtype x --ns-dtype x
--compile forced); stock PyTorch, eager or compiled, fp32 or bf16; stock eager fp32 with one of our
changes. What each variant is, and how the phases, memory, compile seconds and MFU are measured:
docs/measurements.md#benchmark-whole-training-steps.

    .venv/bin/python -m pytest benchmarks/bench_train_step.py -o python_files='bench_*.py' \\
        -p no:cacheprovider --benchmark-json=/tmp/step.json
"""

import contextlib
import ctypes
import gc
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

import bench_pack_rows
import pytest
import torch
import torch.nn.functional as F
from bench_muon import HP, torch_muon
from harness import compare
from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

from nanochat_fast import hardware
from nanochat_fast.data.dataloader import TokenRowLoader
from nanochat_fast.hardware import precision
from nanochat_fast.hardware.process_setup import ProcessSetup
from nanochat_fast.kernels.newton_schulz import QUINTIC
from nanochat_fast.kernels.registry import ENV_VAR as KERNELS_ENV
from nanochat_fast.kernels.softcap_cross_entropy import softcap_cross_entropy
from nanochat_fast.model import loading
from nanochat_fast.model.gpt import COMPILE_OPTIONS, GPT, LOGIT_SOFTCAP
from nanochat_fast.optim import step as optim_step
from nanochat_fast.scripts import base_train
from nanochat_fast.train import model_setup, training_loop
from nanochat_fast.train.env_vars import check_kernels
from nanochat_fast.train.model_setup import CompileWatch
from nanochat_fast.train.training_config import TrainingConfig

corpus = bench_pack_rows.corpus  # the fixture: the default corpus, else synthetic documents
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
T, B, TOTAL, VOCAB = 512, 8, 4096, 8192
ROUNDS = {4: 3, 8: 2}
DTYPES = ("fp32", "bf16")
# Whether the grid has the compile axis at this depth (else: compile as the defaults choose it).
# At depth 8 the four eager cells would add ~25 s a round (~70 s in all on a quiet 2-core CPU)
# to a `make bench` that must stay under 20 minutes, to show what depth 4 shows in the same run:
# the compile axis does not interact with the dtypes. Measured on a 2-core Zen 4 (AVX512-BF16),
# one thread, CPU time of forward+backward, compiled over eager: depth 4 1.09x (fp32) and 1.11x
# (bf16), depth 8 1.10x and 1.12x; compile_evidence.py measured 1.40x and 1.12x on a Zen 3.
GRID_COMPILE_AXIS = {4: True, 8: False}
MUON_IN_STEP_LIMIT_S = 2.0
MUON_BUDGET_S = 5.0
PHASES = ("data", "forward", "backward", "optimizer")
# stock eager fp32 + our optimizers is the step `main` ran before the hardware-aware defaults
MAIN_BEFORE = "stock + our optimizers (= main before: eager fp32, PyTorch CE on the full logits)"


def now() -> float:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def training_config(depth: int, *extra, seq_len: int = T) -> TrainingConfig:
    """base_train's configuration for this benchmark's shape (one micro-batch of B rows per step),
    every other flag at its default, built as run_stage builds it."""
    flags = [
        f"--depth={depth}",
        f"--max-seq-len={seq_len}",
        f"--device-batch-size={B}",
        f"--total-batch-size={B * seq_len}",
    ]
    args = base_train.build_parser().parse_args([*flags, *extra])
    return TrainingConfig.from_args(args, with_model=True)


def model_config(cfg: TrainingConfig):
    return cfg.model.gpt_config(VOCAB, cfg.data.max_seq_len)


# ---------------------------------------------------------------------------------------------
# variants: a model, its optimizers, a loader of its own; one full step per call


@dataclass
class Variant:
    name: str
    model: torch.nn.Module  # the plain module
    optimizers: list
    loader: TokenRowLoader
    accum: int
    compiled: bool
    dtype: str = "fp32"  # the model's compute dtype ("fp32" | "bf16")
    ns_dtype: str = ""  # ours: the dtype Newton-Schulz computes in
    compile_why: str = ""  # ours: compile_for_training's reason
    choices: str = ""  # ours: the dtypes and compile, each with why (the run log's words)
    extra_held: int = 0  # bytes held between steps that no tensor here shows (Muon apart)
    muon_apart_s: float = 0.0  # added to every step's optimizer phase
    phases: list = field(default_factory=list)
    measure_memory: bool = False  # the next step also measures the memory rise (step_peak_rise)
    rise: int | None = None  # bytes, from that step (None: not measurable here)

    def __call__(self):
        if self.measure_memory:
            self.measure_memory = False
            self.rise = step_peak_rise(self.step)
        else:
            self.step()

    def step(self):
        t0 = now()
        micro_batches = [next(self.loader) for _ in range(self.accum)]
        phases = {"data": now() - t0, **self.train(micro_batches)}
        phases["optimizer"] += self.muon_apart_s
        self.phases.append(phases)

    def median(self, phase=None) -> float:
        return statistics.median(sum(p.values()) if phase is None else p[phase] for p in self.phases)

    def held_bytes(self) -> int:
        """Parameters and optimizer state: what stays allocated between steps."""
        tensors = list(self.model.parameters()) + [
            t for opt in self.optimizers for s in opt.state.values() for t in s.values() if torch.is_tensor(t)
        ]
        return sum(t.numel() * t.element_size() for t in tensors) + self.extra_held


class ObservedModel:
    """What train_step is handed as the model: times each forward; post-accumulate-grad hooks on
    the parameters mark when backward is done (on CUDA the hook of the parameter whose gradient
    came last in the previous step waits for the device first)."""

    def __init__(self, model, step_model):
        self.model, self.step_model, self.marks, self.last_param = model, step_model, {}, None
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(self._grad_ready)

    def _grad_ready(self, p):
        if p is self.last_param and DEVICE.type == "cuda":
            torch.cuda.synchronize()
        self.marks.update(grad=time.perf_counter(), last=p)

    def __call__(self, *args, **kwargs):
        t0 = now()
        if "fwd_end" in self.marks:  # the previous micro-batch's backward ended at its last gradient
            self.marks["backward"] += self.marks["grad"] - self.marks["fwd_end"]
        out = self.step_model(*args, **kwargs)
        self.marks["fwd_end"] = now()
        self.marks["forward"] += self.marks["fwd_end"] - t0
        return out

    def __getattr__(self, name):  # zero_grad() and whatever else train_step asks of the model
        return getattr(self.model, name)


class LoopVariant(Variant):
    """Stepped by the training loop's train_step, observed from outside (ObservedModel)."""

    def start(self, step_model, grad_clip, autocast_ctx):
        self.observed, self.grad_clip, self.autocast_ctx = (
            ObservedModel(self.model, step_model),
            grad_clip,
            autocast_ctx,
        )
        return self

    def train(self, micro_batches) -> dict:
        marks = self.observed.marks
        marks.clear()
        marks.update(forward=0.0, backward=0.0)
        training_loop.train_step(self.observed, self.optimizers, micro_batches, self.grad_clip, self.autocast_ctx)
        end = now()
        self.observed.last_param = marks["last"]
        backward = marks["backward"] + marks["grad"] - marks["fwd_end"]
        return {"forward": marks["forward"], "backward": backward, "optimizer": end - marks["grad"]}


class StockVariant(Variant):
    """Stock PyTorch's step, or stock with one of our changes (loss_fn / our optimizers)."""

    def start(self, loss_fn, autocast_ctx, kernels, ours_optim, grad_clip):
        self.loss_fn, self.autocast_ctx, self.kernels = loss_fn, autocast_ctx, kernels
        self.ours_optim, self.grad_clip = ours_optim, grad_clip
        return self

    def train(self, micro_batches) -> dict:
        fwd = bwd = 0.0
        with mock.patch.dict(os.environ, {KERNELS_ENV: self.kernels} if self.kernels else {}):
            for x, y in micro_batches:
                t0 = now()
                with self.autocast_ctx:
                    loss = self.loss_fn(x, y) / self.accum
                t1 = now()
                loss.backward()
                t2 = now()
                fwd, bwd = fwd + t1 - t0, bwd + t2 - t1
            if self.ours_optim:
                optim_step(self.optimizers, self.grad_clip)
            else:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
                for opt in self.optimizers:
                    opt.step()
            self.model.zero_grad(set_to_none=True)
            return {"forward": fwd, "backward": bwd, "optimizer": now() - t2}


def new_loader(data, seq_len=T):
    root, dataset, _ = data
    return TokenRowLoader(
        dataset=dataset, split="train", device_batch_size=B, seq_len=seq_len, device=DEVICE, tokens_root=root
    )


def one_process_device(cfg: TrainingConfig) -> ProcessSetup:
    """What cfg.device.init() gives one process, without its process set-up (threads and seeds
    stay the benchmark's own): the device, --dtype chosen before the model exists (a CPU's auto:
    the machine's matmul probe, replaced by tune_for_training's timing), the kernels."""
    chosen = precision.choose(DEVICE, cfg.device.dtype, what="--dtype", warn=False)
    return ProcessSetup(False, 0, 0, 1, DEVICE, chosen, check_kernels(DEVICE.type))


def grid_name(dtype: str, ns_dtype: str, compiled: bool) -> str:
    return f"ours, --dtype={dtype} --ns-dtype={ns_dtype} --{'' if compiled else 'no-'}compile"


def build_ours(depth, data, *extra_flags, seq_len=T, compile_kwargs=None, name=None) -> LoopVariant:
    """Our defaults (with extra_flags), built as stage.run_stage builds base_train's model and
    decides its dtypes and compile; compile_kwargs: compile the plain model with these instead of
    the default rule (compile_evidence.py)."""
    stage = base_train.BASE
    cfg = training_config(depth, *extra_flags, seq_len=seq_len)
    dev = one_process_device(cfg)
    model, optimizers = model_setup.build_for_training(model_config(cfg), DEVICE, cfg.optim.optimizer_kwargs())
    horizon = stage.horizon(cfg, model, None)  # base_train's default horizon decides the defaults
    accum = stage.data.grad_accum_steps(cfg.data, dev.world_size)
    dev, ns = model_setup.tune_for_training(model, optimizers, dev, cfg.device.dtype, cfg.data, accum, horizon.tokens)
    if compile_kwargs is None:
        step_model, why = model_setup.compile_for_training(
            model,
            cfg.run.compile,
            DEVICE,
            horizon.tokens,
            hardware.peak_flops(DEVICE).flops * dev.world_size,
            stage.data.varying_shapes,
        )
    else:  # a mode as its options, beside the ones the shared block regions need (gpt.COMPILE_OPTIONS)
        kwargs = dict(compile_kwargs)
        mode = kwargs.pop("mode", None)
        options = {**(torch._inductor.list_mode_options(mode) if mode else {}), **COMPILE_OPTIONS}
        step_model, why = torch.compile(model, options=options, **kwargs), f"compiled: torch.compile({compile_kwargs})"
    name = name or (f"ours, {' '.join(extra_flags)}" if extra_flags else "ours (defaults)")
    choices = f"model {dev.precision.describe()}; Newton-Schulz {ns.describe()}; {why}"
    return LoopVariant(
        name,
        model,
        optimizers,
        new_loader(data, seq_len),
        accum,
        compiled=step_model is not model,
        dtype=dev.precision.name,
        ns_dtype=ns.name,
        compile_why=why,
        choices=choices,
    ).start(step_model, cfg.optim.grad_clip, dev.autocast())


def build_grid_cell(depth, data, dtype: str, ns_dtype: str, compiled: bool) -> LoopVariant:
    flags = (f"--dtype={dtype}", f"--ns-dtype={ns_dtype}", "--compile" if compiled else "--no-compile")
    return build_ours(depth, data, *flags, name=grid_name(dtype, ns_dtype, compiled))


def stock_loss(model):
    def loss(x, y):
        logits = model(x)  # softcapped, fp32
        return F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1), ignore_index=-1)

    return loss


def stock_optimizers(model, optim_cfg, muon_apart: bool):
    """torch.optim.AdamW(fused) with base_train's lrs (scaled by width as ours) and
    torch.optim.Muon (left out when it runs apart)."""
    scale = (model.config.n_embd / 768) ** -0.5
    adamw = torch.optim.AdamW(
        [
            dict(params=[model.lm_head.weight], lr=optim_cfg.unembedding_lr * scale),
            dict(params=[model.transformer.wte.weight], lr=optim_cfg.embedding_lr * scale),
        ],
        betas=(0.8, 0.95),
        eps=1e-10,
        weight_decay=optim_cfg.weight_decay,
        fused=True,
    )
    if muon_apart:
        return [adamw]
    muon = torch.optim.Muon(
        list(model.transformer.h.parameters()),
        weight_decay=0.0,
        ns_coefficients=QUINTIC,
        ns_steps=5,
        eps=1e-7,
        adjust_lr_fn="original",
        **{**HP, "lr": optim_cfg.matrix_lr},
    )
    return [adamw, muon]


def build_stock(
    depth, data, name, *, compile=False, dtype="fp32", loss="stock", optim="stock", muon_apart_s=None
) -> StockVariant:
    """Stock PyTorch (loss="stock", optim="stock"), or it with our loss ("model") or optimizers."""
    cfg = training_config(depth)
    if optim == "ours":
        model, optimizers = model_setup.build_for_training(model_config(cfg), DEVICE, cfg.optim.optimizer_kwargs())
    else:
        model = loading.new_model(model_config(cfg), DEVICE)
        optimizers = stock_optimizers(model, cfg.optim, muon_apart_s is not None)
    fn = stock_loss(model) if loss == "stock" else model
    if compile:
        fn = torch.compile(fn, dynamic=False)
    matrices = sum(p.numel() for p in model.transformer.h.parameters())
    apart = muon_apart_s is not None and optim == "stock"
    variant = StockVariant(
        name + (" (Muon apart)" if apart else ""),
        model,
        optimizers,
        new_loader(data),
        cfg.data.grad_accum_steps(1),
        compiled=compile,
        dtype=dtype,
        extra_held=4 * matrices if apart else 0,
        muon_apart_s=muon_apart_s if apart else 0.0,
    )
    autocast_ctx = precision.autocast(DEVICE, precision.DTYPES[dtype])
    kernels = "reference" if loss == "stock" and optim == "stock" else None
    return variant.start(lambda x, y: fn(x, y), autocast_ctx, kernels, optim == "ours", cfg.optim.grad_clip)


# ---------------------------------------------------------------------------------------------
# torch.optim.Muon apart, memory


def time_torch_muon(model_config_) -> tuple[float, str]:
    """Seconds of one torch.optim.Muon step over every matrix of the model, from one matrix per
    shape timed in rounds (as many as fit MUON_BUDGET_S, at least one) scaled by the count of
    matrices of that shape; and a sentence saying so."""
    with torch.device("meta"):
        shapes = [tuple(p.shape) for p in GPT(model_config_).transformer.h.parameters()]
    counts = {s: shapes.count(s) for s in dict.fromkeys(shapes)}
    steps = {s: torch_muon([s])[1] for s in counts}
    times = {s: [] for s in counts}
    deadline = time.perf_counter() + MUON_BUDGET_S
    for _ in range(5):
        for s, step in steps.items():
            t0 = now()
            step()
            times[s].append(now() - t0)
        total = sum(counts[s] * statistics.median(ts) for s, ts in times.items())
        if time.perf_counter() + total / sum(counts.values()) * len(counts) > deadline:
            break
    per_shape = ", ".join(f"{counts[s]}x {s[0]}x{s[1]} at {statistics.median(times[s]) * 1e3:.0f} ms" for s in counts)
    return total, (
        f"torch.optim.Muon timed apart, one matrix per shape over {len(times[shapes[0]])} round(s), "
        f"scaled by count: {per_shape} = {total:.1f} s per step"
    )


_LIBC = ctypes.CDLL("libc.so.6") if Path("/proc/self/clear_refs").exists() else None


def _status_bytes(key: str) -> int:
    return int(re.search(rf"^{key}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M).group(1)) * 1024


def step_peak_rise(step) -> int | None:
    """Bytes by which memory in use rises during one call of `step` (None where not measurable)."""
    gc.collect()
    if DEVICE.type == "cuda":
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        return torch.cuda.max_memory_allocated() - base
    if _LIBC is None:
        step()
        return None
    _LIBC.malloc_trim(0)  # freed heap pages leave the resident set, so reusing them shows as a rise
    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark restarts from the current RSS
    base = _status_bytes("VmRSS")
    step()
    return _status_bytes("VmHWM") - base


# ---------------------------------------------------------------------------------------------
# the benchmark


def bf16_left_out() -> str | None:
    """Why bf16 variants are not run on this device (None: they are): where bf16 is emulated
    (a CPU without AVX512-BF16/AMX) a step takes minutes."""
    bf16 = precision.choose(DEVICE, "bf16", warn=False)
    return None if bf16.native else f"not run: {bf16.reason.removeprefix('asked for; ')} (~100x slower than fp32)"


def build_variants(
    depth, data, muon_apart_s, with_changes_alone: bool, compile_axis: bool = True
) -> tuple[list[Variant], dict[str, str]]:
    """(variants, {variant left out: why}). Ours (defaults) first, then the grid (compile_axis:
    compiled and eager, else compile as the defaults chose it), stock PyTorch, then
    (with_changes_alone) stock with one of our changes."""
    ours = build_ours(depth, data)
    variants, skipped = [ours], {}
    no_bf16 = bf16_left_out()
    for dtype in DTYPES:
        for ns_dtype in DTYPES:
            for compiled in (True, False) if compile_axis else (ours.compiled,):
                if no_bf16 and "bf16" in (dtype, ns_dtype):
                    skipped[grid_name(dtype, ns_dtype, compiled)] = no_bf16
                else:
                    variants.append(build_grid_cell(depth, data, dtype, ns_dtype, compiled))
    for compile in (False, True):
        for dtype in DTYPES:
            alone = {(True, "fp32"): " (= only compile)", (False, "bf16"): " (= only the dtype)"}.get(
                (compile, dtype), ""
            )
            name = f"stock {'compiled' if compile else 'eager'} {dtype}{alone}"
            if no_bf16 and dtype == "bf16":
                skipped[name] = no_bf16
            else:
                variants.append(build_stock(depth, data, name, compile=compile, dtype=dtype, muon_apart_s=muon_apart_s))
    if with_changes_alone:
        variants += [
            build_stock(
                depth, data, "stock + the model's own loss (fused CE)", loss="model", muon_apart_s=muon_apart_s
            ),
            build_stock(depth, data, MAIN_BEFORE, optim="ours"),
        ]
    return variants, skipped


def machine_line() -> str:
    if DEVICE.type == "cpu":
        bf16 = hardware.cpu_bf16_support()
        native = f"native bf16 ({bf16})" if bf16 else "no native bf16 (bf16 emulated: fp32 runs only)"
        return f"{hardware.device_name(DEVICE)}, {native}, {torch.get_num_threads()} threads"
    return hardware.device_name(DEVICE)


def is_grid(v: Variant) -> bool:
    return v.name.startswith("ours, --dtype=")


def grid_lines(ours: Variant, grid: list[Variant], skipped: dict, best: Variant | None) -> list[str]:
    """The grid at a glance: tokens/s per (--dtype, --ns-dtype) and compile setting."""
    by_name = {v.name: v for v in grid}
    columns = sorted(
        {v.compiled for v in grid} | {"--compile" in n for n in skipped if n.startswith("ours, ")}, reverse=True
    )
    lines = [
        "| the grid, tokens/s: --dtype / --ns-dtype | "
        + " | ".join("--compile" if c else "--no-compile" for c in columns)
        + " |",
        "|---" + "|---:" * len(columns) + "|",
    ]
    for dtype in DTYPES:
        for ns_dtype in DTYPES:
            cells = []
            for compiled in columns:
                name = grid_name(dtype, ns_dtype, compiled)
                v = by_name.get(name)
                if v is None:
                    cells.append("not run" if name in skipped else "-")
                    continue
                marks = [m for m, on in (("best", v is best), ("the defaults' choice", twin_of(ours, v))) if on]
                text = f"{TOTAL / v.median():,.0f}"
                cells.append(f"**{text}** ({', '.join(marks)})" if marks else text)
            lines.append(f"| {dtype} / {ns_dtype} | " + " | ".join(cells) + " |")
    return lines


def twin_of(ours: Variant, v: Variant) -> bool:
    """v is the grid cell that forces what the defaults chose."""
    return (v.dtype, v.ns_dtype, v.compiled) == (ours.dtype, ours.ns_dtype, ours.compiled)


def loss_gradient_s(config, autocast_ctx, rounds=5) -> float:
    """Seconds our forward spends on the loss's gradient: the fused cross-entropy computes dhidden and
    dweight (two products the size of the lm_head's) in the forward pass, where stock's backward
    does. Timed apart on this depth's step (TOTAL rows into the vocabulary) in our dtype: with
    gradients minus without, medians of interleaved rounds."""
    g = torch.Generator(device=DEVICE).manual_seed(0)
    hidden = torch.randn(TOTAL, config.n_embd, generator=g, device=DEVICE).requires_grad_()
    weight = (
        torch.randn(config.vocab_size, config.n_embd, generator=g, device=DEVICE) / config.n_embd**0.5
    ).requires_grad_()
    targets = torch.randint(0, config.vocab_size, (TOTAL,), generator=g, device=DEVICE)
    times = {True: [], False: []}
    for _ in range(rounds + 1):  # the first round untimed
        for grad in times:
            t0 = now()
            with torch.set_grad_enabled(grad), autocast_ctx:
                softcap_cross_entropy(hidden, weight, targets, LOGIT_SOFTCAP, ignore_index=-1)
            times[grad].append(now() - t0)
    return statistics.median(times[True][1:]) - statistics.median(times[False][1:])


def like_for_like(ours: Variant, stock: list[Variant], gradient_s: float) -> str:
    """Our forward against the stock forwards of our dtype with the loss's gradient counted where
    stock computes it (in the backward)."""
    same = [v for v in stock if v.dtype == ours.dtype]
    if not same:
        return ""
    best = min(same, key=lambda v: v.median("forward"))
    forward = ours.median("forward") - gradient_s
    return (
        f"**Forward, like for like:** {ours.name}'s forward computes the loss's gradient inside the fused "
        f"cross-entropy ({gradient_s * 1e3:.0f} ms of it, timed apart on this step's shapes: with gradients minus "
        f"without), where stock's backward computes it. Counted in the backward as stock counts it, our forward "
        f"takes {forward * 1e3:.0f} ms against {best.name}'s {best.median('forward') * 1e3:.0f} ms "
        f"({forward / best.median('forward'):.2f}x its time), our backward "
        f"{(ours.median('backward') + gradient_s) * 1e3:.0f} ms against {best.median('backward') * 1e3:.0f} ms."
    )


def step_table(depth, config, variants, compile_s, muon_note, wall_s, skipped=None, gradient_s=None) -> list[str]:
    skipped = skipped or {}
    stock = [v for v in variants if v.name.startswith("stock ") and " + " not in v.name]
    best = min(stock, key=lambda v: v.median())
    ours = variants[0]
    grid = [v for v in variants if is_grid(v)]
    best_grid = min(grid, key=lambda v: v.median()) if grid else None
    ratios = []
    if best_grid is not None:
        ratios.append(f"{ours.name} vs best of the grid ({best_grid.name}): {best_grid.median() / ours.median():.2f}x")
    ratios.append(f"{ours.name} vs stock best ({best.name}): {best.median() / ours.median():.2f}x")
    before = next((v for v in variants if v.name == MAIN_BEFORE), None)
    if before is not None:
        ratios.append(f"{ours.name} vs main before: {before.median() / ours.median():.2f}x")
    model_s = {v.name: v.median("forward") + v.median("backward") for v in variants}
    best_model = min(stock, key=lambda v: model_s[v.name])
    peak = hardware.peak_flops(DEVICE)
    with torch.device("meta"):
        flops_per_token = GPT(config).estimate_flops()
        n_params = sum(p.numel() for p in GPT(config).parameters())
    lines = [
        f"**Whole step, depth {depth}** ({n_params / 1e6:.1f}M parameters, {flops_per_token / 1e6:.0f} MFLOP "
        f"per token), T={T}, {B} rows x {TOTAL // (B * T)} micro-batch = {TOTAL} tokens per step, vocab {VOCAB}; "
        f"{machine_line()}; medians of {len(variants[0].phases)} interleaved rounds (one untimed step first). "
        f"Speed-up = stock best's time / the variant's: full step vs {best.name}, forward+backward vs "
        f"{best_model.name}. {muon_note}.",
        "",
        "| variant | tokens/s | speed-up (step) | speed-up (fwd+bwd) | data ms | forward ms | backward ms | "
        "optimizer ms | MFU | held MB | step rise MB | peak MB | compile s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for v in variants:
        step_s = v.median()
        held, up = v.held_bytes() / 2**20, v.rise
        mem = (
            [f"{held:.0f}", "n/a", "n/a"]
            if up is None
            else [f"{held:.0f}", f"{up / 2**20:.0f}", f"{held + up / 2**20:.0f}"]
        )
        lines.append(
            f"| {v.name} | {TOTAL / step_s:,.0f} | {best.median() / step_s:.2f} | "
            f"{model_s[best_model.name] / model_s[v.name]:.2f} | "
            + " | ".join(f"{v.median(k) * 1e3:.0f}" for k in PHASES)
            + f" | {hardware.mfu(flops_per_token, TOTAL / step_s, peak):.1f}% | "
            + " | ".join(mem)
            + (f" | {compile_s[v.name]:.0f} |" if compile_s[v.name] is not None else " | - |")
        )
    for name, why in skipped.items():
        lines.append(f"| {name} | {why} |" + " |" * 11)
    lines += [""]
    if grid:
        twin = next((v for v in grid if twin_of(ours, v)), None)
        compile_as = f"{'compiled' if ours.compiled else 'eager'} as the defaults chose (GRID_COMPILE_AXIS)"
        axes = (
            "--dtype x --ns-dtype x --compile/--no-compile"
            if len({v.compiled for v in grid}) > 1
            else f"--dtype x --ns-dtype, {compile_as}"
        )
        noise = (
            f"; {ours.name} ran at {twin.median() / ours.median():.2f}x the tokens/s of its twin ({twin.name}), "
            "the same step (the difference is noise)"
            if twin
            else ""
        )
        lines += grid_lines(ours, grid, skipped, best_grid) + [
            "",
            f"The grid: {axes}, each forced by its flag, timed in the same rounds{noise}.",
            "",
        ]
    lines += [
        f"**{'; '.join(ratios)}** (full steps, tokens/s). {ours.name} chose: {ours.choices}.",
        "",
    ]
    if gradient_s is not None and (line := like_for_like(ours, stock, gradient_s)):
        lines += [line, ""]
    lines += [
        f"MFU against the {peak.describe()}. Memory: "
        + (
            "torch.cuda.max_memory_allocated over a step"
            if DEVICE.type == "cuda"
            else "held = parameters + optimizer state (counted from the tensors); step rise = growth of the resident "
            "set during the first timed step (malloc_trim and the high-water mark reset first)"
        )
        + ". "
        f"This depth took {wall_s:.0f} s of wall time, compiles, the defaults' dtype timings and "
        "torch.optim.Muon apart included.",
        "",
    ]
    return lines


@contextlib.contextmanager
def cold_compiles(cache_dir: str | None = None):
    """Compiles inside start from nothing: dynamo's graphs dropped (compiled GPTs also share
    GPT.forward's recompile limit of 8 graphs per process) and inductor writing to an empty cache
    directory of its own, removed afterwards, so compile seconds are what a first run pays and
    nothing is left in the tree. cache_dir: inductor's cache goes there instead (and stays)."""
    torch._dynamo.reset()
    with contextlib.ExitStack() as stack:
        cache = cache_dir or stack.enter_context(tempfile.TemporaryDirectory(prefix="inductor-"))
        stack.enter_context(temporary_cache_dir(cache))
        yield
    torch._dynamo.reset()


@pytest.mark.parametrize("depth", [4, 8])
def test_train_step(benchmark, corpus, depth):
    start = time.perf_counter()
    config = model_config(training_config(depth))
    muon_s, muon_note = time_torch_muon(config)
    muon_apart_s = muon_s if muon_s > MUON_IN_STEP_LIMIT_S else None
    if muon_apart_s is None:
        muon_note = f"torch.optim.Muon runs inside the stock steps (one step of it measured {muon_s:.2f} s)"
    with cold_compiles(), contextlib.ExitStack() as stack:
        variants, skipped = build_variants(
            depth, corpus, muon_apart_s, with_changes_alone=depth == 4, compile_axis=GRID_COMPILE_AXIS[depth]
        )
        for v in variants:
            stack.callback(v.loader.close)
        compile_s = {}
        for v in variants:  # the first step compiles (or warms up), untimed; the next measures memory too
            with CompileWatch() as watch:
                v()
            compile_s[v.name] = watch.seconds if watch.graphs else None
            v.phases.clear()
            v.measure_memory = True
        baseline = next(v.name for v in variants if v.name.startswith("stock eager fp32"))
        compare(
            benchmark,
            op=f"Training step ({DEVICE.type})",
            baseline=baseline,
            rounds=ROUNDS[depth],
            warmup_rounds=0,
            shape_set=f"depth {depth}, T={T}, {TOTAL} tokens per step",
            variants={v.name: v for v in variants},
            skipped=skipped,
            notes=f"one full step per call; {muon_note}"
            + (
                "; the harness medians of the (Muon apart) variants exclude it, the step table below includes it"
                if muon_apart_s
                else ""
            ),
        )
        gradient_s = loss_gradient_s(config, variants[0].autocast_ctx)
        benchmark.extra_info["table"] = step_table(
            depth, config, variants, compile_s, muon_note, time.perf_counter() - start, skipped, gradient_s
        )


# ---------------------------------------------------------------------------------------------
# two processes on gloo: --sharding=zero2 against --sharding=fsdp (train_step_worker.py)

DIST_DEPTH, DIST_ROUNDS, DIST_REPEATS = 4, 3, 2


def run_dist_worker(mode: str, out: Path) -> dict:
    """One torchrun launch of train_step_worker.py (2 processes, one thread each); its figures."""
    here = Path(__file__).resolve().parent
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(here.parent), os.environ.get("PYTHONPATH", "")]),
    }
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(here / "train_step_worker.py"),
        f"--mode={mode}",
        f"--depth={DIST_DEPTH}",
        f"--rounds={DIST_ROUNDS}",
        f"--out={out}",
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.skipif(DEVICE.type != "cpu", reason="the 2-process rows are gloo on a CPU")
def test_train_step_two_processes(benchmark, tmp_path):
    """zero2 and fsdp launched alternately DIST_REPEATS times each; per mode the faster launch's
    medians (a launch that shared the machine with a neighbour's burst counts less)."""
    figures = {"zero2": [], "fsdp": []}

    def one_round():
        for mode in figures:
            figures[mode].append(run_dist_worker(mode, tmp_path / f"{mode}{len(figures[mode])}.json"))

    benchmark.pedantic(one_round, rounds=DIST_REPEATS, warmup_rounds=0, iterations=1)
    best = {mode: min(runs, key=lambda f: f["step_s"]) for mode, runs in figures.items()}
    rows = []
    for mode, f in best.items():
        backward = f["step_s"] - f["forward_s"] - f["optimizer_s"]
        rows.append(
            [
                f"--sharding={mode}",
                f"{f['tokens_per_step'] / f['step_s']:,.0f}",
                f"{f['step_s'] * 1e3:.0f}",
                f"{f['forward_s'] * 1e3:.0f}",
                f"{backward * 1e3:.0f}",
                f"{f['optimizer_s'] * 1e3:.0f}",
                f"{max(f['held_bytes']) / 2**20:.1f}",
            ]
        )
    ratio = best["fsdp"]["step_s"] / best["zero2"]["step_s"]
    benchmark.extra_info["table"] = {
        "title": f"Training step on 2 processes (gloo, CPU): zero2 vs fsdp, depth {DIST_DEPTH}",
        "columns": [
            "sharding",
            "tokens/s",
            "step ms",
            "forward ms",
            "backward ms (+ its reduce-scatters)",
            "optimizer ms",
            "held MB per rank",
        ],
        "rows": rows,
        "notes": (
            f"2 processes x 1 thread, T={T}, {B} rows per rank, vocab {VOCAB}, fp32, eager (the same arithmetic "
            f"in both modes); base_train's model, optimizers and train_step on random tokens; medians of "
            f"{DIST_ROUNDS} steps after one untimed, the faster of {DIST_REPEATS} alternating launches per mode. "
            "held = parameters + gradients + optimizer state, counted from the tensors of each rank. "
            "fsdp gathers each block's weights for its forward and again for its backward and "
            "reduce-scatters its gradient (gloo: on the CPU, not overlapped with compute); zero2 "
            "reduce-scatters and all-gathers once, in the optimizer."
        ),
        "targets": [["fsdp step time / zero2 step time", f"{ratio:.2f}x", "<= 1.3x", "yes" if ratio <= 1.3 else "no"]],
    }
    print("\n".join(" | ".join(row) for row in rows), f"\nfsdp / zero2 step time: {ratio:.2f}x")
