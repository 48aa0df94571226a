"""
A training stage, described once (Stage: what differs between base_train, mid_train, chat_sft and
chat_rl), and run_stage, which runs any of them the same way, every flag and the environment checked
before any work: ARCHITECTURE.md, "A training stage".
"""

import time
from contextlib import closing
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable

from .. import checkpoints, hardware
from ..core import cli, nodes, paths, threads
from ..core.cli import flag_name, flag_values
from ..core.distributed import print0, torn_down
from ..core.errors import UserError
from ..data.tokenizer import Tokenizer, get_tokenizer
from ..hardware import allocator
from ..hardware.process_setup import ProcessSetup
from ..model import generation, loading
from ..model.gpt import GPT, GPTConfig
from ..optim.recipe import describe_schedule
from . import model_setup, next_steps, run_report, tracking, training_loop
from .env_vars import check_environment
from .run_report import MetricsLog
from .run_state import Horizon, Run, restore
from .stage_data import Data
from .training_config import OptimConfig, TrainingConfig


@dataclass(frozen=True)
class StartPoint:
    config: GPTConfig  # the model to build
    seq_len: int  # row length of this run (at most config.sequence_len)
    source: Path | None  # the checkpoint whose weights it starts from (None: fresh init)
    name: str  # what the default run name is made from
    describe: dict  # summary/report lines ("starting from": ...)


class NewModel:
    """Fresh weights: the model of the depth dial (--depth, --aspect-ratio, --head-dim)."""

    with_model_flags = True

    def resolve(self, args, cfg, tokenizer) -> StartPoint:
        try:
            config = cfg.model.gpt_config(tokenizer.get_vocab_size(), cfg.data.max_seq_len)
        except ValueError as e:
            raise UserError(f"the model flags give an invalid model: {e}") from None
        return StartPoint(config, cfg.data.max_seq_len, None, f"d{cfg.model.depth}", {})


class FromRun:
    """The weights of another run's checkpoint: flag `run_flag` names the run (default: the newest of
    the first of `phases` that has one), `step_flag` its step (default: the newest)."""

    with_model_flags = False

    def __init__(self, run_flag: str, step_flag: str, phases: tuple):
        self.run_flag, self.step_flag, self.phases = run_flag, step_flag, phases

    def add_flags(self, parser):
        g = parser.add_argument_group("starting point")
        newest = ", else ".join(f"the newest {phase} run" for phase in self.phases)
        g.add_argument(
            flag_name(self.run_flag),
            type=cli.run_ref,
            default="",
            help=f"{' or '.join(self.phases)} run (name or directory) to start from (default: {newest})",
        )
        g.add_argument(
            flag_name(self.step_flag),
            type=cli.non_negative_int,
            default=None,
            help=f"checkpoint step of the {self.run_flag.replace('_', ' ')} (default: newest)",
        )
        g.add_argument(
            "--arch",
            type=cli.choice("", *loading.FAMILIES),
            default="",
            help=f"model family ({', '.join(loading.FAMILIES)}): the checkpoint's must be this one (default: the "
            "checkpoint's)",
        )

    def resolve(self, args, cfg, tokenizer) -> StartPoint:
        run_dir = checkpoints.run_dir_of(getattr(args, self.run_flag), self.phases)
        ckpt, meta, config = loading.open_checkpoint(run_dir, getattr(args, self.step_flag), tokenizer)
        if meta.get("phase") not in self.phases:
            raise UserError(
                f"{flag_name(self.run_flag)} {run_dir}: {ckpt} is a {meta.get('phase')} checkpoint, "
                f"not a {' or '.join(self.phases)} one"
            )
        loading.check_arch(getattr(args, "arch", ""), config, ckpt)
        seq_len = cfg.data.max_seq_len or config.sequence_len
        if seq_len > config.sequence_len:
            raise UserError(
                f"--max-seq-len {seq_len} is above the {meta.get('phase')} model's sequence_len "
                f"{config.sequence_len}; use at most {config.sequence_len}"
            )
        return StartPoint(config, seq_len, ckpt, run_dir.name, {"starting from": str(ckpt)})


def fixed_horizon(cfg, model, data) -> Horizon:
    """--num-iterations, else --target-flops, else --target-param-data-ratio (tokens per parameter)."""
    h, tokens_per_step = cfg.horizon, cfg.data.total_batch_size
    if h.num_iterations > 0:
        steps = h.num_iterations
    elif h.target_flops > 0:
        steps = max(1, round(h.target_flops / (model.estimate_flops() * tokens_per_step)))
    elif h.target_param_data_ratio > 0:
        steps = max(1, round(h.target_param_data_ratio * model.num_scaling_params() / tokens_per_step))
    else:
        raise UserError(
            "no training horizon: pass --num-iterations N (> 0), --target-flops F or --target-param-data-ratio R"
        )
    tokens = steps * tokens_per_step
    ratio = tokens / model.num_scaling_params()
    return Horizon(steps, f"{steps:,} steps = {tokens:,} tokens ({ratio:.2f} tokens/param)", tokens)


def one_epoch(cfg, model, data) -> Horizon:
    """--num-iterations if set, else until the training data has been read once."""
    steps = cfg.horizon.num_iterations
    if steps > 0:
        return Horizon(steps, f"{steps} steps", steps * cfg.data.total_batch_size, loader=data.train)
    tokens = getattr(data.train, "epoch_tokens", None)
    return Horizon(None, "one epoch of the training data", tokens, loader=data.train)


def complete_prompts(prompts, max_tokens=16):
    """Samples of a base model: each prompt and its greedy continuation."""
    return lambda model, tokenizer: [p + generation.complete(model, tokenizer, p, max_tokens) for p in prompts]


def answer_questions(questions, max_tokens=32):
    """Samples of a chat model: each question and the assistant's greedy reply."""
    return lambda model, tokenizer: [
        f"{q} -> {generation.assistant_reply(model, tokenizer, [{'role': 'user', 'content': q}], max_tokens)}"
        for q in questions
    ]


@dataclass(frozen=True)
class Stage:
    """What differs between base_train, mid_train and the stages after them."""

    phase: str  # "base", "mid", ...: written into every checkpoint; later stages find runs by it
    title: str  # the report's
    start: NewModel | FromRun  # where the weights come from
    data: object  # stage_data.py's: grad_accum_steps, open, varying_shapes (rollouts.Rollouts too)
    horizon: Callable  # (cfg, model, data) -> Horizon: fixed_horizon, one_epoch, ...
    sample: Callable  # (model, tokenizer) -> texts to print every --sample-every steps
    run_name: Callable  # (cfg, StartPoint) -> the default --run
    next_step: Callable | None = None  # run_dir -> the command to print once the run is done
    # more evaluations, with every val bpb eval: (name, fn(cfg, tokenizer, dev) -> fn(model) -> {metric: value})
    evals: tuple = ()


@dataclass(frozen=True)
class RunSetup:
    """What run_stage settles before it opens the stage's data."""

    cfg: TrainingConfig  # the flags' configs, max_seq_len set to the starting point's
    dev: ProcessSetup  # the process, before the dtypes are measured at the run's shapes
    tokenizer: Tokenizer
    point: StartPoint
    run_name: str
    run_dir: Path
    ckpt: Path | None  # the checkpoint to resume from (None: a fresh run)
    meta: dict | None  # its meta.json
    grad_accum_steps: int
    orig_model: GPT
    optimizers: list


def run_stage(args, stage: Stage) -> int:
    """Run `stage` with the parsed flags; the process exit code (0, or 3: the NaN guard)."""
    check_environment()
    cfg = TrainingConfig.from_args(args, with_model=stage.start.with_model_flags)
    with torn_down():  # every rank meets before the group goes; a failed rank leaves at once
        dev = cfg.device.init(seed=cfg.run.seed, deterministic=cfg.run.deterministic)
        model_setup.check_sharding(cfg.optim.sharding, dev)
        print0(dev.describe(precision=False))
        check_nodes(args, cfg)
        setup = set_up(args, stage, cfg, dev)
        with closing(stage.data.open(args, setup.cfg, setup.tokenizer, dev, setup.orig_model)) as data:
            run, sections = make_run(args, stage, setup, data)
            print0(run_report.summary(run, setup.point.config, sections["Stage"]))
            if setup.ckpt is not None:
                resume(run, setup.ckpt, setup.meta, setup.cfg)
            return train_and_report(run, stage, setup, sections)


def check_nodes(args, cfg: TrainingConfig):
    """On several processes, before any work: the folder the run's checkpoints go to is one folder
    that every rank sees (every rank writes its part of a checkpoint there, and a resume reads them
    all), every node has the tokenizer, the same one, and every node was started with the same flags.
    Each failure is one line naming the node, on every rank. The data may be each node's own copy."""
    runs = Path(cfg.run.out_dir).expanduser().resolve().parent if cfg.run.out_dir else paths.runs_dir()
    where = "--out-dir's folder" if cfg.run.out_dir else "runs folder (NANOCHAT_FAST_HOME/runs)"
    nodes.check_shared(runs, where, "put NANOCHAT_FAST_HOME, or --out-dir, on a filesystem every node mounts")
    tokenizer = nodes.each_rank_ok(get_tokenizer, "cannot start")
    flags = {flag_name(k): v for k, v in flag_values(args).items()}
    nodes.check_same_flags({**flags, "the tokenizer's fingerprint": tokenizer.fingerprint})


def set_up(args, stage: Stage, cfg: TrainingConfig, dev: ProcessSetup) -> RunSetup:
    """The starting point, the run directory (and the checkpoint to resume), then the model and its
    optimizers: the weights of that checkpoint, else of the starting point, else fresh."""
    tokenizer = get_tokenizer()
    point = nodes.each_rank_ok(lambda: stage.start.resolve(args, cfg, tokenizer), "cannot find the starting point")
    cfg = replace(cfg, data=replace(cfg.data, max_seq_len=point.seq_len))
    grad_accum_steps = stage.data.grad_accum_steps(cfg.data, dev.world_size)
    run_name = cfg.run.run or stage.run_name(cfg, point)
    run_dir = Path(cfg.run.out_dir).expanduser() if cfg.run.out_dir else paths.runs_dir() / run_name
    run_dir, ckpt, meta = checkpoints.open_run_dir(cfg.run, run_dir, dev.rank, stage.phase, dev.device)
    if ckpt is not None:
        loading.check_compatible(meta, ckpt, point.config, tokenizer)
    weights = ckpt or point.source
    state = checkpoints.load_model_state(weights, dev.device) if weights else None
    orig_model, optimizers = model_setup.build_for_training(
        point.config, dev.device, cfg.optim.optimizer_kwargs(), state
    )
    return RunSetup(cfg, dev, tokenizer, point, run_name, run_dir, ckpt, meta, grad_accum_steps, orig_model, optimizers)


def make_run(args, stage: Stage, setup: RunSetup, data: Data) -> tuple[Run, dict]:
    """The horizon, the dtypes measured at this model's shapes, the peak and the compile choice
    (which needs the horizon): the Run, and the stage's sections of the report."""
    cfg, orig_model, tokenizer = setup.cfg, setup.orig_model, setup.tokenizer
    horizon = stage.horizon(cfg, orig_model, data)
    dev, ns = model_setup.tune_for_training(
        orig_model, setup.optimizers, setup.dev, cfg.device.dtype, cfg.data, setup.grad_accum_steps, horizon.tokens
    )
    print0(f"precision: {dev.precision.describe()}")
    optimizers = model_setup.shard_for_training(orig_model, setup.optimizers, cfg.optim, dev)
    peak = hardware.peak_flops(dev.device)
    model, compile_why = model_setup.compile_for_training(
        orig_model, cfg.run.compile, dev.device, horizon.tokens, peak.flops * dev.world_size, stage.data.varying_shapes
    )
    settings = {**flag_values(args), **cfg.as_dict(), "dataset": data.dataset}
    point = setup.point
    meta = {  # what every checkpoint's meta.json says of the run (the loop adds its own state)
        "phase": stage.phase,
        "arch": loading.arch_of(point.config),
        "model_config": asdict(point.config),
        "tokenizer": {"vocab_size": tokenizer.get_vocab_size(), "fingerprint": tokenizer.fingerprint},
        "args": settings,
        "device": run_report.device_summary(dev),
        **({"base_checkpoint": str(point.source)} if point.source else {}),
    }
    run = Run(
        model=model,
        orig_model=orig_model,
        optimizers=optimizers,
        data=data,
        run_dir=setup.run_dir,
        grad_accum_steps=setup.grad_accum_steps,
        horizon=horizon,
        optim=cfg.optim,
        loop=cfg.loop,
        dev=dev,
        peak=peak,
        meta=meta,
        sample=lambda model: stage.sample(model, tokenizer),
        evals=tuple((name, make(cfg, tokenizer, dev)) for name, make in stage.evals),
        resume_command=next_steps.resume_command(getattr(args, "_argv", None), setup.run_dir),
    )
    lines = {
        "horizon": horizon.describe,
        **setup.point.describe,
        "data": data.describe.removeprefix("data: "),
        "compile": compile_why,
        "sharding": model_setup.describe_sharding(cfg.optim.sharding, dev.world_size),
        "muon": cfg.optim.recipe().describe().removeprefix("muon recipe "),
        "newton-schulz precision": ns.describe(),
        "threads per process": threads.thread_choice().describe(),
        **({"memory": allocator.keep_freed_memory()} if dev.device.type == "cpu" else {}),
        "mfu against": peak.describe(),
    }
    return run, {"Stage": lines, "Settings": settings}


def train_and_report(run: Run, stage: Stage, setup: RunSetup, sections: dict) -> int:
    """The loop, then (rank 0) the report and the command to run next."""
    metrics = None
    if run.rank == 0:  # only rank 0 logs, to metrics.jsonl and the trackers asked for (--wandb, --tensorboard)
        trackers = tracking.open_trackers(setup.cfg.run, setup.run_name, setup.run_dir, sections["Settings"])
        metrics = MetricsLog(setup.run_dir / "metrics.jsonl", run.state.step if setup.ckpt else None, trackers)
    wall = time.time()
    try:
        code = training_loop.train(run, metrics)
    finally:
        if metrics is not None:
            metrics.close()
    if run.rank == 0:
        run_report.finish_report(run, metrics, f"{stage.title}: {setup.run_name}", wall, sections)
        if run.finished and stage.next_step is not None:
            next_steps.show(stage.next_step(setup.run_dir))
    return code


def resume(run: Run, ckpt: Path, meta: dict, cfg: TrainingConfig):
    """Restore the training state of `ckpt`; then the learning-rate rule (ARCHITECTURE.md, "Resume rule")."""

    def groups_of(prefix):
        return [g for opt in run.optimizers for g in opt.param_groups if g["param_names"][0].startswith(prefix)]

    from_flags = {flag: [g["initial_lr"] for g in groups_of(prefix)] for flag, prefix in OptimConfig.LR_FLAGS}
    restore(run, ckpt, meta)
    print0(f"resumed from {ckpt} (step {run.state.step}, saved with {meta['world_size']} process(es))")
    if meta.get("imported_from", {}).get("optimizer") is False:
        print0(f"{ckpt} was imported without optimizer state: the optimizers start fresh (no momentum)")
    for flag, prefix in OptimConfig.LR_FLAGS:
        groups = groups_of(prefix)
        saved = [g["initial_lr"] for g in groups]
        if saved == from_flags[flag]:
            continue
        value = getattr(cfg.optim, flag)
        if flag in cfg.explicit:
            for g, lr in zip(groups, from_flags[flag]):
                g["initial_lr"] = lr
            print0(
                f"{flag_name(flag)}={value:g} given: it replaces the checkpoint's learning rate of {prefix} "
                f"(initial lr {saved[0]:g} -> {from_flags[flag][0]:g})"
            )
        else:
            print0(
                f"{prefix} keeps the checkpoint's initial lr {saved[0]:g} (the default {flag_name(flag)}={value:g} "
                f"would give {from_flags[flag][0]:g}; pass {flag_name(flag)} to change it)"
            )
    resume_newton_schulz(run, cfg)


def resume_newton_schulz(run: Run, cfg: TrainingConfig):
    """Muon's Newton-Schulz schedule by the resume rule: --ns-coefficients given replaces the checkpoint's,
    else the checkpoint's stays (a default that changed since, or another recipe's, would switch it)."""
    muon = next((opt for opt in run.optimizers if opt.kind == "muon"), None)
    if muon is None:
        return
    recipe = cfg.optim.recipe()
    wanted = {"ns_coefficients": recipe.ns_coefficients, "ns_steps": recipe.ns_steps}
    saved = {key: muon.param_groups[0][key] for key in wanted}
    if saved == wanted:
        return
    saved_name, wanted_name = describe_schedule(*saved.values()), describe_schedule(*wanted.values())
    if "ns_coefficients" in cfg.explicit:
        for group in muon.param_groups:
            group.update(wanted)
        print0(f"--ns-coefficients={recipe.ns_coefficients} given: it replaces the checkpoint's {saved_name}")
    else:
        print0(
            f"muon keeps the checkpoint's Newton-Schulz, {saved_name} (the default would give "
            f"{wanted_name}; pass --ns-coefficients to change it)"
        )
