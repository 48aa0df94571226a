"""
The training loop every stage shares (stage.py builds a Run and calls train): the two loops of
the seeds (an outer loop of optimizer steps, an inner loop of gradient-accumulation micro-steps)
plus what a long run on rented machines needs: evaluation, sampling, atomic checkpoints, exact
resume, preemption and the NaN guard.

One step:
    fetch the grad_accum_steps micro-batches of this rank
    count the supervised targets of the whole step on all ranks (one all-reduce)
    for each micro-batch: loss_sum = model(x, y, "sum"); (loss_sum / count).backward()
    the logged loss is the global mean: all-reduced loss sums / count
    set lr and Muon momentum, then optim.step(): reduce-scatter, global grad norm, clip, update
Dividing by the global count of supervised tokens (not per-rank means) makes the gradient the
same on 1 and N processes, also for masked targets (mid-training).
"""
import contextlib
import math
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from .. import hardware, optim
from ..core import checkpoint
from ..core.compiling import CompileWatch
from ..core.distributed import all_ranks_ok, all_reduce_sum, any_rank, get_dist_info, print0
from ..core.errors import EXIT_NONFINITE
from .run_report import MetricsLog

def lr_multiplier(progress: float, warmup_ratio: float, warmdown_ratio: float, final_lr_frac: float) -> float:
    """Linear warmup over the first warmup_ratio of training, flat, then linear warmdown to
    final_lr_frac over the last warmdown_ratio. Progress past 1 (an epoch-bound stage whose last
    step reads past the end of its epoch) counts as 1: the lr never goes below the final one."""
    progress = min(max(progress, 0.0), 1.0)
    if warmup_ratio > 0 and progress < warmup_ratio:
        return (progress + 1e-8) / warmup_ratio
    if warmdown_ratio > 0 and progress > 1 - warmdown_ratio:
        frac = (1 - progress) / warmdown_ratio
        return frac + (1 - frac) * final_lr_frac
    return 1.0


def muon_momentum(optimizers, step: int, num_iterations: int | None) -> float:
    """Muon momentum at this step from the Muon optimizer's recipe (MuonRecipe.momentum_at; the
    seeds: 0.85 -> 0.95 over the first 300 steps), which also sets its scheduled weight decay."""
    return next(opt for opt in optimizers if isinstance(opt, optim.Muon)).schedule(step, num_iterations)


@dataclass
class LoopState:
    """Everything about the loop (besides model, optimizer, data and RNG) a resume must restore."""
    step: int = 0
    smooth_loss: float = 0.0
    train_time: float = 0.0       # seconds spent in training steps (not eval/sampling/saving/compiling)
    compile_time: float = 0.0     # seconds torch.compile spent inside training steps (one-time)
    tokens_seen: int = 0
    nonfinite_skipped: int = 0
    first_val_bpb: float | None = None
    last_val_bpb: float | None = None
    last_evals: dict = field(default_factory=dict)  # the stage's own evaluations, latest values


class Preemption:
    """SIGTERM or SIGINT asks the run to stop after the current step and save; a second SIGINT
    aborts at once. Ranks agree through an all-reduce each step, so any rank's signal stops all."""

    def __init__(self):
        self.signal_name = None
        self._previous = {}
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        if self.signal_name is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # second Ctrl-C: stop now, no checkpoint
        self.signal_name = signal.Signals(signum).name
        print(f"\nreceived {self.signal_name}: finishing this step, then saving a checkpoint "
              "(press Ctrl-C again to abort without saving)", file=sys.stderr, flush=True)

    def restore(self):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


class Progress:
    """A tqdm bar when attached to a terminal, plain lines otherwise (logs, CI, torchrun)."""

    def __init__(self, total: int | None, initial: int, enabled: bool):
        self.bar = None
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm
            self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True)
        self.enabled = enabled

    def step(self, line: str, postfix: str):
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.set_postfix_str(postfix, refresh=False)
            self.bar.update(1)
        else:
            print(line, flush=True)

    def write(self, line: str):
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(line)
        else:
            print(line, flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.close()


@torch.no_grad()
def evaluate_bpb(model, batches, token_bytes: torch.Tensor, autocast_ctx) -> float:
    """Bits per byte over (x, y) batches: summed next-token loss in nats over the summed UTF-8
    bytes of the target tokens, special tokens (0 bytes) and masked targets (-1) excluded. All
    ranks' sums are added, so the figure is the same for any number of processes."""
    total_nats = torch.zeros((), dtype=torch.float64, device=token_bytes.device)
    total_bytes = torch.zeros((), dtype=torch.float64, device=token_bytes.device)
    for x, y in batches:
        with autocast_ctx:
            loss = model(x, y, loss_reduction="none").view(-1).double()
        y = y.view(-1)
        valid = y >= 0
        nbytes = torch.where(valid, token_bytes[y.clamp(min=0)], 0)
        counted = nbytes > 0
        total_nats += (loss * counted).sum()
        total_bytes += nbytes.sum()
    both = all_reduce_sum(torch.stack([total_nats, total_bytes]))
    return (both[0] / (math.log(2) * both[1])).item() if both[1] > 0 else float("nan")


def set_schedule(optimizers, lrm: float, momentum: float):
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] = group["initial_lr"] * lrm
            if "momentum" in group:
                group["momentum"] = momentum


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    n_supervised: int
    finite: bool
    n_tokens: int = 0  # input tokens of the step on all ranks (for tokens/s)


def train_step(model, optimizers, micro_batches, grad_clip, autocast_ctx, inject_nan=False) -> StepResult:
    """One optimizer step over this rank's micro-batches (see the module docstring)."""
    local = torch.stack([torch.stack([(y >= 0).sum(), torch.tensor(x.numel(), device=x.device)])
                         for x, y in micro_batches]).sum(0).double()
    n_sup, n_tokens = all_reduce_sum(local).unbind()  # one collective for both counts
    # The optimizers average gradients over ranks (sum / world_size), so each rank scales its part
    # by world_size: the averaged gradient is then d(global loss sum)/d(params) / n_sup.
    world_size = get_dist_info()[3]
    loss_sum = torch.zeros((), dtype=torch.float64, device=n_sup.device)
    for x, y in micro_batches:
        with autocast_ctx:
            loss = model(x, y, loss_reduction="sum")
        if inject_nan:
            loss = loss * float("nan")
        (loss * world_size / n_sup.clamp(min=1)).backward()
        loss_sum += loss.detach().double()
    global_loss = (all_reduce_sum(loss_sum) / n_sup.clamp(min=1)).item()
    if not math.isfinite(global_loss):
        model.zero_grad(set_to_none=True)
        return StepResult(global_loss, float("nan"), int(n_sup.item()), False, int(n_tokens.item()))
    grad_norm = optim.step(optimizers, grad_clip).item()
    model.zero_grad(set_to_none=True)
    return StepResult(global_loss, grad_norm, int(n_sup.item()), math.isfinite(grad_norm), int(n_tokens.item()))


def format_eta(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}h{(seconds % 3600) // 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


def describe_step(state: LoopState, num_iterations: int | None, result: StepResult, lrm: float, dt: float,
                  smooth_loss: float, eta_seconds: float | None, tokens: int, flops_per_token: float,
                  peak, world_size: int):
    """The per-step log line, the progress-bar postfix and the metrics row. `peak`: one process's
    hardware.Peak (None: MFU n/a)."""
    tok_per_sec = tokens / dt
    mfu = hardware.mfu(flops_per_token, tok_per_sec, peak, world_size) if peak else None
    mfu_text = f"mfu {mfu:.1f}%" if mfu is not None else "mfu n/a"
    total = f"/{num_iterations}" if num_iterations else ""
    eta = f" | eta {format_eta(eta_seconds)}" if eta_seconds is not None else ""
    line = (f"step {state.step:05d}{total} | loss {result.loss:.4f} | lrm {lrm:.3f} | dt {dt * 1000:.0f}ms | "
            f"tok/s {tok_per_sec:,.0f} | {mfu_text}{eta}")
    postfix = f"loss {result.loss:.3f} tok/s {tok_per_sec:,.0f}"
    row = dict(kind="train", step=state.step, loss=result.loss, smooth_loss=smooth_loss, lrm=lrm,
               grad_norm=result.grad_norm, dt=dt, tok_per_sec=tok_per_sec, mfu=mfu, tokens_seen=state.tokens_seen)
    return line, postfix, row


def nonfinite_message(what: str, step: int, last_checkpoint) -> str:
    where = f"the last good checkpoint is {last_checkpoint}" if last_checkpoint else "no checkpoint was saved yet"
    return (f"non-finite {what} at step {step} (on at least one rank); no update was applied and no checkpoint "
            f"with it was written; {where}. Resume with --resume auto, perhaps with a lower learning rate "
            "(or pass --skip-nonfinite N to skip up to N such steps)")


def stop_nonfinite(message: str):
    print0(f"error: {message}", file=sys.stderr)
    return EXIT_NONFINITE


@dataclass
class Horizon:
    """How long a stage trains: a number of steps, or until its data has done an epoch."""
    num_iterations: int | None          # None: until epoch_done()
    progress: Callable[[int], float]    # step -> fraction of training done: the lr schedule's clock
    epoch_done: Callable[[], bool]      # the training loader finished its epoch (False: never stops on it)
    describe: str                       # for the run's summary
    tokens: int | None = None           # training tokens of the whole run, if known (the compile rule)


@dataclass
class Run:
    """Everything the loop needs; stage.run_stage builds one for every stage."""
    model: torch.nn.Module              # what runs forward/backward (possibly compiled)
    orig_model: torch.nn.Module         # the plain module: state_dict keys, generate()
    optimizers: list
    data: object                        # training_data.Data: .train (this rank's loader), .val_batches()
    token_bytes: torch.Tensor
    run_dir: Path
    grad_accum_steps: int
    flops_per_token: float
    horizon: Horizon
    optim: object                       # config.OptimConfig: grad_clip and the lr schedule
    loop: object                        # config.LoopConfig: eval/sample/save cadence, NaN guard
    dev: object                         # config.Device: device, rank, world_size, precision
    peak: object                        # hardware.Peak MFU is quoted against (None: n/a)
    compiled: bool                      # model is torch.compile'd: the first step's compile is timed apart
    meta: Callable[[], dict]            # model config, settings... for meta.json
    sample: Callable[[], list[str]]     # a few generations to print (rank 0 only)
    evals: tuple = ()                   # (name, fn(model) -> {metric: value}) run with every val bpb eval
    state: LoopState = field(default_factory=LoopState)
    resume_command: str = ""
    last_checkpoint: Path | None = None
    finished: bool = False              # reached its horizon (not stopped by a signal or the NaN guard)

    def __post_init__(self):
        self.device, self.rank, self.world_size = self.dev.device, self.dev.rank, self.dev.world_size
        self.autocast_ctx = self.dev.autocast()


def rank_state(run: Run) -> dict:
    """This rank's share of the training state: optimizer shards and RNG."""
    rng = {"cpu": torch.get_rng_state()}
    if run.device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(run.device)
    return {"optimizers": [opt.shard_state_dict() for opt in run.optimizers], "rng": rng}


def save(run: Run) -> Path:
    meta = {**run.meta(), "world_size": run.world_size, "loader_state": run.data.train.state_dict(),
            "loop_state": asdict(run.state)}
    path = checkpoint.save_checkpoint(
        run.run_dir, run.state.step, model_state=run.orig_model.state_dict(), rank_state=rank_state(run),
        meta=meta, rank=run.rank, all_ranks_ok=lambda ok: all_ranks_ok(ok, run.device),
        keep_last=run.loop.keep_last, previous=run.last_checkpoint)
    run.last_checkpoint = path
    return path


def restore(run: Run, ckpt: Path, meta: dict):
    """Load the optimizer shards (any saved world size), RNG, loader and loop state of `ckpt`.
    The model weights are loaded by the caller, before the optimizers are built."""
    saved_world = meta["world_size"]
    shards = checkpoint.load_rank_states(ckpt, saved_world, device=run.device)
    for i, opt in enumerate(run.optimizers):
        opt.load_shard_state_dicts([s["optimizers"][i] for s in shards])
    if saved_world == run.world_size:  # RNG streams are per rank: only meaningful on the same layout
        rng = shards[run.rank]["rng"]
        torch.set_rng_state(rng["cpu"].cpu())
        if run.device.type == "cuda" and "cuda" in rng:
            torch.cuda.set_rng_state(rng["cuda"].cpu(), run.device)
    run.data.train.load_state_dict(meta["loader_state"])
    run.state = LoopState(**meta["loop_state"])
    run.last_checkpoint = ckpt


def evaluate(run: Run, step: int, bar: Progress, metrics: MetricsLog | None):
    """Val bits per byte, then the stage's own evaluations, logged at `step`."""
    state = run.state
    # through the plain module: the compiled training graph is neither reused nor recompiled for
    # evaluation's other grad mode, loss reduction and shapes (compiling.py)
    run.orig_model.eval()
    bpb = evaluate_bpb(run.orig_model, run.data.val_batches(), run.token_bytes, run.autocast_ctx)
    state.first_val_bpb = bpb if state.first_val_bpb is None else state.first_val_bpb
    state.last_val_bpb = bpb
    results = {"val_bpb": bpb}
    with run.autocast_ctx:
        for _, fn in run.evals:
            results.update(fn(run.orig_model))
    run.orig_model.train()
    state.last_evals = {k: v for k, v in results.items() if k != "val_bpb"}
    bar.write(f"step {step:05d} | " + " | ".join(f"{k.replace('_', ' ')} {v:.4f}" for k, v in results.items()))
    if metrics:
        metrics.log(kind="eval", step=step, **results)


def print_samples(run: Run, bar: Progress):
    run.orig_model.eval()
    with run.autocast_ctx:
        for text in run.sample():
            bar.write(f"  sample: {text!r}")
    run.orig_model.train()


def train(run: Run, metrics: MetricsLog | None) -> int:
    """The outer loop. Returns the process exit code (0, or 3 when the NaN guard stops the run)."""
    loop, state, horizon = run.loop, run.state, run.horizon
    master = run.rank == 0
    preemption = Preemption()
    bar = Progress(horizon.num_iterations, state.step, enabled=master)
    start_step = state.step
    # eval/sample/save happen once per step value, even if a step is skipped; a resumed run did
    # them at its first step before it saved, so it does not repeat them
    events_done_at = start_step if run.last_checkpoint is not None else None
    injected = False
    dt_ema = None
    try:
        while True:
            step = state.step
            last_step = (horizon.num_iterations is not None and step >= horizon.num_iterations) or horizon.epoch_done()
            fresh = events_done_at != step
            events_done_at = step

            if fresh and loop.eval_every > 0 and (step % loop.eval_every == 0 or last_step):
                evaluate(run, step, bar, metrics)
            if fresh and master and loop.sample_every > 0 and (step % loop.sample_every == 0 or last_step) and step > 0:
                print_samples(run, bar)

            if loop.test_preempt_at_step == step and step > start_step:
                preemption.signal_name = "--test-preempt-at-step"  # behaves exactly like a SIGTERM here
            preempted = any_rank(preemption.signal_name is not None, run.device)
            periodic = fresh and loop.save_every > 0 and step > start_step and step % loop.save_every == 0
            if (last_step or preempted or periodic) and (step > start_step or run.last_checkpoint is None):
                path = save(run)
                bar.write(f"step {step:05d} | saved checkpoint {path}")
            if preempted:
                name = preemption.signal_name or "a signal on another rank"
                print0(f"stopped by {name} at step {step}; checkpoint {run.last_checkpoint}. "
                       f"Resume with: {run.resume_command} --resume auto", flush=True)
                return 0
            if last_step:
                run.finished = True
                return 0

            t0 = time.perf_counter()
            # the schedule's clock is the progress at the start of the step, before its batches are read
            lrm = lr_multiplier(horizon.progress(step), run.optim.warmup_ratio, run.optim.warmdown_ratio,
                                run.optim.final_lr_frac)
            micro_batches = [next(run.data.train) for _ in range(run.grad_accum_steps)]
            set_schedule(run.optimizers, lrm, muon_momentum(run.optimizers, step, horizon.num_iterations))
            inject = loop.test_inject_nan_at_step == step and not injected
            injected = injected or inject  # a one-off fault: a skipped step is retried cleanly
            with CompileWatch() if run.compiled else contextlib.nullcontext() as watch:
                result = train_step(run.model, run.optimizers, micro_batches, run.optim.grad_clip, run.autocast_ctx,
                                    inject)
                if run.device.type == "cuda":
                    torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            if watch is not None and watch.graphs:  # a one-time cost: logged and kept out of the step's time
                dt = max(dt - watch.seconds, 1e-9)
                state.compile_time += watch.seconds
                bar.write(f"step {step:05d} | torch.compile: {watch.describe()} (not counted in the step's time)")

            if not result.finite:
                what = "loss" if not math.isfinite(result.loss) else "gradient norm"
                if state.nonfinite_skipped < loop.skip_nonfinite:
                    state.nonfinite_skipped += 1
                    bar.write(f"step {step:05d} | non-finite {what}: step skipped "
                              f"({state.nonfinite_skipped}/{loop.skip_nonfinite} allowed by --skip-nonfinite)")
                    if metrics:
                        # logged under the step it attempted, as train rows are: a resume from
                        # checkpoint `step` drops it with the rest of that history
                        metrics.log(kind="skipped", step=step + 1, what=what)
                    continue
                return stop_nonfinite(nonfinite_message(what, step, run.last_checkpoint))

            state.step += 1
            state.train_time += dt
            state.tokens_seen += result.n_tokens
            beta = 0.9  # EMA of the loss, debiased as in nanochat
            state.smooth_loss = beta * state.smooth_loss + (1 - beta) * result.loss
            debiased = state.smooth_loss / (1 - beta ** state.step)
            dt_ema = dt if dt_ema is None else beta * dt_ema + (1 - beta) * dt  # recent speed, for the ETA
            if horizon.num_iterations:
                eta = (horizon.num_iterations - state.step) * dt_ema
            else:
                done = min(horizon.progress(state.step), 1.0)
                eta = dt_ema * state.step / done * (1 - done) if done > 0 else None
            if run.rank == 0:  # a run faster than its peak shows the peak was probed under load
                peak = hardware.revise_peak(run.peak, run.flops_per_token * result.n_tokens / dt / run.world_size,
                                            run.device)
                if peak is not run.peak:
                    bar.write(f"step {step + 1:05d} ran above the {run.peak.describe()}: measured again, {peak.describe()}")
                    run.peak = peak
            line, postfix, row = describe_step(state, horizon.num_iterations, result, lrm, dt, debiased, eta,
                                               result.n_tokens, run.flops_per_token, run.peak, run.world_size)
            bar.step(line, postfix)
            if metrics:
                metrics.log(**row)
    finally:
        bar.close()
        preemption.restore()
