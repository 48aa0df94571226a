"""
A GPT set up for a training run: its optimizers, its compute dtypes and whether it is compiled.

    build_for_training(...)                 the model (model/loading.new_model) and its optimizers
    tune_for_training(model, ...)           the compute dtypes (model, Newton-Schulz) measured at the run's shapes
    shard_for_training(model, ...)          --sharding=fsdp: the model sharded by FSDP2, and its optimizers
    compile_for_training(model, ...)        the module the training step calls: compiled or not, and why
    tuning_works(depth, ...)                what `python -m nanochat_fast.hardware --tune --depth N` times
"""

from collections import Counter
from dataclasses import asdict, replace

import torch

from ..core.compiling import default_compile
from ..core.errors import UserError
from ..hardware import precision, tuning
from ..model import sharding
from ..model.gpt import GPT, GPTConfig, config_from_depth
from ..model.loading import config_from_fields, meta_model, new_model
from ..optim.muon import newton_schulz_work


def build_for_training(config: GPTConfig, device, optimizer_kwargs: dict, state: dict | None = None):
    """(the model, [adamw, muon]): the optimizers hold the plain module's parameters."""
    model = new_model(config, device, state)
    return model, model.setup_optimizers(**optimizer_kwargs)


def step_work(model: GPT, rows: int, seq_len: int, device, run_micro_steps: int | None = None) -> tuning.Work:
    """One micro-batch's forward and backward of `model` (rows x seq_len tokens) in fp32 and under
    bf16 autocast, for hardware/tuning.py to time. The actual model runs (a model on the meta
    device is materialised only if the timing fits its budget); its gradients are dropped after
    each call and its weights are not changed."""
    config, device = model.config, torch.device(device)

    def make():
        net = new_model(config, device) if next(model.parameters()).is_meta else model
        gen = torch.Generator().manual_seed(0)
        x, y = (torch.randint(config.vocab_size, (rows, seq_len), generator=gen).to(device) for _ in range(2))

        def call(dtype):
            def forward_backward():
                with precision.autocast(device, dtype):
                    loss = net(x, y)
                loss.backward()
                net.zero_grad(set_to_none=True)

            return forward_backward

        return {name: call(dtype) for name, dtype in precision.DTYPES.items()}

    tokens, d = rows * seq_len, config.n_embd
    return tuning.Work(
        "model",
        dict(config=asdict(config), rows=rows, seq_len=seq_len),
        what=f"this model's forward+backward ({rows}x{seq_len} tokens)",
        flops=model.estimate_flops() * tokens,
        make=make,
        run_calls=run_micro_steps,
        matmuls=[(tokens, d, config.vocab_size), (tokens, d, 4 * d), (tokens, 4 * d, d)],
    )


# a cached entry's model is of its own family (the windowed GPT's config has a window_pattern)
tuning.register(
    "model",
    lambda spec, device: step_work(
        meta_model(config_from_fields(spec["config"])), spec["rows"], spec["seq_len"], device
    ),
)


def muon_shapes(model: GPT) -> list[tuple[int, int, int]]:
    """(count, rows, cols) of the block matrices Muon stacks by shape, as one process holds them."""
    counts = Counter(tuple(p.shape) for p in model.transformer.h.parameters() if p.dim() == 2)
    return [(k, *shape) for shape, k in counts.items()]


def tuning_works(depth: int, vocab_size: int, seq_len: int, rows: int, device) -> list[tuning.Work]:
    """What `python -m nanochat_fast.hardware --tune --depth N` times: the depth-N model's training
    micro-step and its Muon matrices (the quintic recipe's Newton-Schulz)."""
    model = meta_model(config_from_depth(depth, vocab_size, seq_len))
    return [step_work(model, rows, seq_len, device), newton_schulz_work(muon_shapes(model), 5, "quintic", device)]


def tune_for_training(
    model: GPT,
    optimizers: list,
    dev,
    requested_dtype: str,
    rows: int,
    seq_len: int,
    grad_accum_steps: int,
    run_tokens: int | None,
):
    """(dev with the model's compute dtype, Newton-Schulz's precision) for this run. An explicit
    --dtype/--ns-dtype stands; on a CPU, auto is timed at the run's own shapes: one micro-batch of
    this model, and Muon on its own matrices (hardware/tuning.py), within a budget of a few percent
    of the run (run_tokens, all processes; None: unknown)."""
    per_micro_step = rows * seq_len * dev.world_size
    micro_steps = run_tokens // per_micro_step if run_tokens else None
    timing = None
    if dev.device.type == "cpu" and requested_dtype == "auto":
        timing = tuning.measure_everywhere(step_work(model, rows, seq_len, dev.device, micro_steps), dev.device)
    dev = replace(
        dev, precision=precision.choose(dev.device, requested_dtype, what="--dtype", warn=False, timing=timing)
    )
    muon = next(opt for opt in optimizers if opt.kind == "muon")
    ns = muon.resolve_ns_precision(micro_steps // grad_accum_steps if micro_steps else None, warn=False)
    return dev, ns


def check_sharding(mode: str, dev):
    """--sharding=fsdp shards over processes: refused, with what to do, on a single one."""
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
    """The optimizers of the run. --sharding=fsdp: `model` is sharded in place by FSDP2 (compute
    dtype: the run's, now measured) and gets optimizers for its shards, which keep the Muon
    precision already decided; zero2: `optimizers` as they are."""
    if optim_config.sharding != "fsdp":
        return optimizers
    sharding.shard(model, dev.precision.dtype)
    sharded = model.setup_optimizers(**optim_config.optimizer_kwargs())
    for old, new in zip(optimizers, sharded):
        if old.kind == "muon":
            new._ns_precision = old.ns_precision
    return sharded


def compile_for_training(
    model: GPT,
    requested: bool | None,
    device,
    run_tokens: int | None,
    peak_flops: float | None,
    varying_shapes: bool = False,
):
    """(the module the training step calls, why): torch.compile'd or `model` itself.
    --compile/--no-compile as given; by default core/compiling.default_compile's rule (CUDA and CPU
    unless the run's FLOPs, model.estimate_flops() x run_tokens, are too few at peak_flops: the
    peak of all processes), and eager where the rows' length varies from batch to batch (padded
    conversations), which would compile a new graph for every length."""
    if requested is not None:
        on, why = requested, f"{'compiled' if requested else 'eager'}: {'--compile' if requested else '--no-compile'}"
    elif varying_shapes:
        on, why = False, "eager: the rows' length varies from batch to batch (one compile per length)"
    else:
        run_flops = model.estimate_flops() * run_tokens if run_tokens else None
        on, why = default_compile(torch.device(device).type, run_flops, peak_flops)
    # dynamic=False: one training shape; evaluation and sampling use the plain module (core/compiling.py)
    return (torch.compile(model, dynamic=False) if on else model), why
