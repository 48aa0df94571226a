"""
A GPT set up for a training run, in the order run_stage calls them: built with its optimizers, its
compute dtypes and Newton-Schulz's timed at the run's own shapes, sharded by FSDP2 under
--sharding=fsdp, and the module the training step calls compiled or not (the compile rule, and
CompileWatch: what a block compiled and what it cost; docs/measurements.md#compile-policy).
"""

import time
from collections import Counter
from dataclasses import asdict, replace
from functools import partial

import torch

from ..core.errors import UserError
from ..hardware import precision
from ..model import sharding
from ..model.gpt import GPT, GPTConfig, compile_model, config_from_depth
from ..model.loading import config_from_fields, meta_model, new_model
from ..optim.muon import newton_schulz_work
from .training_config import OptimConfig


def build_for_training(config: GPTConfig, device, optimizer_kwargs: dict, state: dict | None = None):
    """(the model, [adamw, muon]): the optimizers hold the plain module's parameters."""
    model = new_model(config, device, state)
    return model, model.setup_optimizers(**optimizer_kwargs)


def step_work(model: GPT, rows: int, seq_len: int, device, run_micro_steps: int | None = None) -> precision.Work:
    """One micro-batch's forward and backward of `model` (rows x seq_len tokens), what --dtype auto
    times: the model itself (one on the meta device is built only if the timing fits its budget),
    its gradients dropped after each call, its weights unchanged."""
    config, device = model.config, torch.device(device)

    def make():
        net = new_model(config, device) if next(model.parameters()).is_meta else model
        gen = torch.Generator().manual_seed(0)
        x, y = (torch.randint(config.vocab_size, (rows, seq_len), generator=gen).to(device) for _ in range(2))

        def forward_backward(dtype):
            with precision.autocast(device, dtype):
                loss = net(x, y)
            loss.backward()
            net.zero_grad(set_to_none=True)

        return {name: partial(forward_backward, dtype) for name, dtype in precision.DTYPES.items()}

    tokens, d = rows * seq_len, config.n_embd
    return precision.Work(
        "model",
        dict(config=asdict(config), rows=rows, seq_len=seq_len),
        what=f"this model's forward+backward ({rows}x{seq_len} tokens)",
        flops=model.estimate_flops() * tokens,
        make=make,
        run_calls=run_micro_steps,
        matmuls=[(tokens, d, config.vocab_size), (tokens, d, 4 * d), (tokens, 4 * d, d)],
    )


def cached_step_work(spec: dict, device) -> precision.Work:
    """The step_work of a cached entry: its model is of its own family (a windowed config has a window_pattern)."""
    return step_work(meta_model(config_from_fields(spec["config"])), spec["rows"], spec["seq_len"], device)


precision.register("model", cached_step_work)


def tuning_works(depth: int, vocab_size: int, seq_len: int, rows: int, device) -> list[precision.Work]:
    """What `python -m nanochat_fast.hardware --tune --depth N` times: the depth-N model's training
    micro-step and Newton-Schulz (base_train's default recipe's) on its Muon stacks, as one process holds them."""
    model = meta_model(config_from_depth(depth, vocab_size, seq_len))
    counts = Counter(tuple(p.shape) for p in model.transformer.h.parameters() if p.dim() == 2)
    muon_stacks = [(k, *shape) for shape, k in counts.items()]
    recipe = OptimConfig().recipe()
    ns_work = newton_schulz_work(muon_stacks, recipe.ns_steps, recipe.ns_coefficients, device)
    return [step_work(model, rows, seq_len, device), ns_work]


def tune_for_training(model: GPT, optimizers: list, dev, dtype: str, data, grad_accum_steps: int, run_tokens):
    """(dev with the model's compute dtype, Newton-Schulz's precision): a CPU's auto times one micro-batch
    (`data`: a DataConfig) and Muon on its matrices, within a few percent of the run (run_tokens, all
    processes; None: unknown). An explicit flag stands."""
    rows, seq_len = data.device_batch_size, data.max_seq_len
    micro_steps = run_tokens // (rows * seq_len * dev.world_size) if run_tokens else None
    work = step_work(model, rows, seq_len, dev.device, micro_steps)
    dev = replace(dev, precision=precision.choose(dev.device, dtype, warn=False, work=work))
    muon = next(opt for opt in optimizers if opt.kind == "muon")
    return dev, muon.resolve_ns_precision(micro_steps // grad_accum_steps if micro_steps else None, warn=False)


def check_sharding(mode: str, dev):
    if mode == "fsdp" and dev.world_size < 2:
        raise UserError(
            "--sharding=fsdp shards the model over processes but this run has one: launch with "
            "torchrun --nproc_per_node=N (N >= 2), or drop the flag (zero2, the default)"
        )


def describe_sharding(mode: str, world_size: int) -> str:
    if world_size < 2:
        return "none (one process)"
    if mode == "fsdp":
        return f"fsdp over {world_size} processes: parameters, gradients and optimizer state sharded (FSDP2)"
    return f"zero2 over {world_size} processes: optimizer state sharded, whole model and gradient on each"


def shard_for_training(model: GPT, optimizers: list, optim_config, dev) -> list:
    """The run's optimizers: zero2's as they are; fsdp's made anew for `model`, sharded in place at
    the measured compute dtype, keeping Muon's decided precision."""
    if optim_config.sharding != "fsdp":
        return optimizers
    sharding.shard(model, dev.precision.dtype)
    sharded = model.setup_optimizers(**optim_config.optimizer_kwargs())
    for old, new in zip(optimizers, sharded):
        if old.kind == "muon":
            new.ns_precision = old.ns_precision
    return sharded


def compile_for_training(model: GPT, requested: bool | None, device, run_tokens, peak_flops, varying_shapes=False):
    """(the module the training step calls, why): --compile/--no-compile as given, else eager where the
    rows' length varies (a graph per length), else default_compile's rule on the run's
    FLOPs (estimate_flops() x run_tokens) at peak_flops (of all processes)."""
    if requested is not None:
        on, why = requested, f"{'compiled' if requested else 'eager'}: {'--compile' if requested else '--no-compile'}"
    elif varying_shapes:
        on, why = False, "eager: the rows' length varies from batch to batch (one compile per length)"
    else:
        run_flops = model.estimate_flops() * run_tokens if run_tokens else None
        on, why = default_compile(torch.device(device).type, run_flops, peak_flops)
    # dynamic=False: one training shape; evaluation and sampling use the plain module
    return (compile_model(model) if on else model), why


# about where the per-step saving pays back a cold compile: docs/measurements.md#compile-policy
MIN_RUN_SECONDS_AT_PEAK = 100.0


def default_compile(
    device_type: str, run_flops: float | None = None, peak_flops: float | None = None
) -> tuple[bool, str]:
    """--compile's default and its reason. run_flops: the run's training FLOPs (None: the horizon is
    unknown); peak_flops: the peak of all processes."""
    if device_type not in ("cuda", "cpu"):
        return False, f"eager on {device_type} (compiling was not measured faster there)"
    if run_flops is not None and peak_flops:
        at_peak = run_flops / peak_flops
        if at_peak < MIN_RUN_SECONDS_AT_PEAK:
            return False, (
                f"eager: a short run (~{at_peak:.0f} s of compute at peak) would not win back a "
                "one-time compile of ~45 s"
            )
    return True, f"compiled on {device_type}: measured faster per step; the one-time compile is timed apart"


def _dynamo_compile_seconds() -> float | None:
    """Seconds dynamo has spent compiling in this process, if its timer is there."""
    try:
        from torch._dynamo.utils import calculate_time_spent

        return calculate_time_spent().get("total_wall_time")
    except (ImportError, AttributeError):
        return None


class CompileWatch:
    """The graphs torch.compile builds inside the block (a recompile is one more) and the seconds:
    dynamo's own timer, else the block's wall time."""

    def __enter__(self):
        from torch._dynamo.utils import counters

        self._counters = counters
        self._graphs0 = counters["stats"]["unique_graphs"]
        self._compile0 = _dynamo_compile_seconds()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.wall_seconds = time.perf_counter() - self._t0
        self.graphs = self._counters["stats"]["unique_graphs"] - self._graphs0
        end = _dynamo_compile_seconds()
        self.compile_seconds = end - self._compile0 if end is not None and self._compile0 is not None else None
        return False

    @property
    def seconds(self) -> float:
        return self.compile_seconds if self.compile_seconds is not None else self.wall_seconds

    def describe(self) -> str:
        return f"{self.graphs} graph(s) compiled in {self.seconds:.1f} s" if self.graphs else "nothing compiled"
