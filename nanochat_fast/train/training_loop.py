"""
The training loop every stage shares (stage.py builds the Run): optimizer steps of grad_accum_steps
micro-steps, and what a long run on rented machines needs: evaluation, sampling, checkpoints, exact
resume, preemption and the NaN guard. A step's loss is the summed token losses of all ranks over the
global count of supervised targets, so its gradient is the same on 1 and N processes, masked targets
included; a micro-batch (x, y, row weights) weighs each row's token losses (chat_rl's advantages).
"""

import contextlib
import math
import signal
import sys
import time
from dataclasses import dataclass

import torch

from .. import hardware, optim
from ..core import rank_watch
from ..core.distributed import all_reduce_sum, any_rank, get_dist_info, print0
from ..core.errors import EXIT_NONFINITE
from ..evals.task_runner import evaluate_bpb
from ..model import sharding
from .model_setup import CompileWatch
from .run_report import MetricsLog, Progress, describe_step
from .run_state import Horizon, Run, save


@dataclass
class Boundary:
    """The loop between two steps: where it evaluates, samples, saves and may stop."""

    step: int
    last: bool  # the horizon is reached: no step follows
    fresh: bool  # the first time at this step (a skipped step comes back to it)


class Session:
    """What one call of train keeps between iterations (unlike run.state, it is not saved)."""

    def __init__(self, run: Run, metrics: MetricsLog | None):
        self.run, self.metrics = run, metrics
        self.preemption = Preemption()
        self.bar = Progress(run.horizon.num_iterations, run.state.step, enabled=run.rank == 0)
        self.start_step = run.state.step
        # eval/sample/save happen once per step value, even if a step is skipped; a resumed run did
        # them at its first step before it saved, so it does not repeat them
        self.events_done_at = self.start_step if run.last_checkpoint is not None else None
        self.dt_ema = None  # recent seconds per step, for the ETA

    def arrive(self) -> Boundary:
        step, horizon = self.run.state.step, self.run.horizon
        last = (horizon.num_iterations is not None and step >= horizon.num_iterations) or horizon.epoch_done()
        fresh, self.events_done_at = self.events_done_at != step, step
        return Boundary(step, last, fresh)

    def close(self):
        self.bar.close()
        self.preemption.restore()


def train(run: Run, metrics: MetricsLog | None) -> int:
    """The outer loop; the process exit code (0, or 3 when the NaN guard stops the run)."""
    s = Session(run, metrics)
    try:
        while True:
            at = s.arrive()
            if at.fresh:
                evaluate_and_sample(s, at)
            with rank_watch.phase("the step boundary", at.step):
                preempted = preemption_agreed(s)
            if checkpoint_due(s, at, preempted):
                with rank_watch.phase("the checkpoint save", at.step, generous=True, sync=True):
                    s.bar.write(f"step {at.step:05d} | saved checkpoint {save(run)}")
            if preempted:
                name = s.preemption.signal_name or "a signal on another rank"
                print0(
                    f"stopped by {name} at step {at.step}; checkpoint {run.last_checkpoint}. "
                    f"Resume with: {run.resume_command} --resume auto",
                    flush=True,
                )
                return 0
            if at.last:
                run.finished = True
                return 0

            t0 = time.perf_counter()
            lrm = set_schedule(run, at.step)
            with rank_watch.phase("the training step", at.step + 1):
                result, watch = optimizer_step(s)
            if at.step == s.start_step:
                rank_watch.settle()  # compiled, tuned and loaded: --collective-timeout from now on
            dt = without_compile_time(s, at.step, time.perf_counter() - t0, watch)
            if not result.finite:
                if skip_nonfinite(s, at.step, result):
                    continue  # the same step again, on the next batches
                return stop_nonfinite(run, at.step, result)
            with rank_watch.phase("the training step", at.step + 1):
                row, extra = count_step(s, result, lrm, dt)  # loop state, smoothed loss (RL: all-reduced)
            log_step(s, row, extra)
    finally:
        s.close()


def evaluate_and_sample(s: Session, at: Boundary):
    """Val bits per byte and the stage's own evaluations, logged; samples printed (rank 0)."""
    run, loop = s.run, s.run.loop
    evaluating = loop.eval_every > 0 and (at.step % loop.eval_every == 0 or at.last)
    sampling = loop.sample_every > 0 and (at.step % loop.sample_every == 0 or at.last) and at.step > 0
    if not (evaluating or sampling):
        return
    # through the plain module (a sharded model's weights gathered into one): the compiled training
    # graph is neither reused nor recompiled for evaluation's grad mode, loss reduction and shapes;
    # rank 0 samples alone, so every rank leaves the phase together
    with (
        rank_watch.phase("evaluation", at.step, generous=True, sync=True),
        sharding.whole_weights(run.orig_model) as model,
    ):
        model.eval()
        if evaluating:
            state = run.state
            bpb = evaluate_bpb(model, run.data.val_batches(), run.token_bytes, run.autocast_ctx)
            state.first_val_bpb = bpb if state.first_val_bpb is None else state.first_val_bpb
            state.last_val_bpb = bpb
            results = {"val_bpb": bpb}
            with run.autocast_ctx:
                for _, fn in run.evals:
                    results.update(fn(model))
            state.last_evals = {k: v for k, v in results.items() if k != "val_bpb"}
            s.bar.write(
                f"step {at.step:05d} | " + " | ".join(f"{k.replace('_', ' ')} {v:.4f}" for k, v in results.items())
            )
            if s.metrics:
                s.metrics.log(kind="eval", step=at.step, **results)
        if sampling and run.rank == 0:
            with run.autocast_ctx:
                for text in run.sample(model):
                    s.bar.write(f"  sample: {text!r}")
        model.train()


def preemption_agreed(s: Session) -> bool:
    """Whether any rank was asked to stop: all ranks agree (one all-reduce) and stop together."""
    return any_rank(s.preemption.signal_name is not None, s.run.device)


def checkpoint_due(s: Session, at: Boundary, preempted: bool) -> bool:
    """At the end, when stopped, and every --save-every steps; never the step a run resumed from."""
    loop = s.run.loop
    periodic = at.fresh and loop.save_every > 0 and at.step > s.start_step and at.step % loop.save_every == 0
    return (at.last or preempted or periodic) and (at.step > s.start_step or s.run.last_checkpoint is None)


def set_schedule(run: Run, step: int) -> float:
    """Set `step`'s learning rates and Muon momentum from its progress at its start; the lr multiplier."""
    lrm = lr_multiplier(
        run.horizon.progress(step), run.optim.warmup_ratio, run.optim.warmdown_ratio, run.optim.final_lr_frac
    )
    if step < run.optim.warmup_steps:  # a warmup counted in steps (nanochat's: the first step at 1/N)
        lrm = (step + 1) / run.optim.warmup_steps
    momentum = muon_momentum(run.optimizers, step, run.horizon.num_iterations)
    for opt in run.optimizers:
        for group in opt.param_groups:
            group["lr"] = group["initial_lr"] * lrm
            if "momentum" in group:
                group["momentum"] = momentum
    return lrm


def lr_multiplier(progress: float, warmup_ratio: float, warmdown_ratio: float, final_lr_frac: float) -> float:
    """Linear warmup over the first warmup_ratio of training, flat, then linear warmdown to
    final_lr_frac; progress past 1 (an epoch-bound stage's last step) counts as 1."""
    progress = min(max(progress, 0.0), 1.0)
    if warmup_ratio > 0 and progress < warmup_ratio:
        return (progress + 1e-8) / warmup_ratio
    if warmdown_ratio > 0 and progress > 1 - warmdown_ratio:
        frac = (1 - progress) / warmdown_ratio
        return frac + (1 - frac) * final_lr_frac
    return 1.0


def muon_momentum(optimizers, step: int, num_iterations: int | None) -> float:
    """Muon's momentum at this step, from its recipe (which also schedules its weight decay)."""
    return next(opt for opt in optimizers if isinstance(opt, optim.Muon)).schedule(step, num_iterations)


def optimizer_step(s: Session) -> tuple["StepResult", CompileWatch | None]:
    """train_step on this rank's next micro-batches; a compiled model's is watched for compiles."""
    run = s.run
    micro_batches = [next(run.data.train) for _ in range(run.grad_accum_steps)]
    with CompileWatch() if run.compiled else contextlib.nullcontext() as watch:
        result = train_step(run.model, run.optimizers, micro_batches, run.optim.grad_clip, run.autocast_ctx)
        if run.device.type == "cuda":
            torch.cuda.synchronize()
    return result, watch


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    n_supervised: int
    finite: bool
    n_tokens: int  # input tokens of the step on all ranks (for tokens/s)

    @property
    def what_failed(self) -> str:
        return "loss" if not math.isfinite(self.loss) else "gradient norm"


def train_step(model, optimizers, micro_batches, grad_clip, autocast_ctx) -> StepResult:
    """One optimizer step over this rank's micro-batches (the module docstring)."""
    counts = [torch.stack([(y >= 0).sum(), torch.tensor(x.numel(), device=x.device)]) for x, y, *_ in micro_batches]
    n_sup, n_tokens = all_reduce_sum(torch.stack(counts).sum(0).double()).unbind()  # one collective for both
    # The optimizers average gradients over ranks (sum / world_size), so each rank scales its part
    # by world_size: the averaged gradient is then d(global loss sum)/d(params) / n_sup.
    world_size = get_dist_info()[3]
    loss_sum = torch.zeros((), dtype=torch.float64, device=n_sup.device)
    for batch in micro_batches:
        with autocast_ctx:
            loss = micro_batch_loss(model, batch)
        (loss * world_size / n_sup.clamp(min=1)).backward()
        loss_sum += loss.detach().double()
    global_loss = (all_reduce_sum(loss_sum) / n_sup.clamp(min=1)).item()
    # a non-finite loss applies no update (nor does optim.step on a non-finite gradient norm)
    grad_norm = optim.step(optimizers, grad_clip).item() if math.isfinite(global_loss) else float("nan")
    model.zero_grad(set_to_none=True)
    return StepResult(global_loss, grad_norm, int(n_sup.item()), math.isfinite(grad_norm), int(n_tokens.item()))


def micro_batch_loss(model, batch):
    """The summed loss of (x, y): the cross-entropy; of (x, y, row_weights): each row's token
    cross-entropies (0 where the target is -1) times its weight, with chat_rl's advantages -sum A * log p."""
    x, y, *weights = batch
    if not weights:
        return model(x, y, loss_reduction="sum")
    return (model(x, y, loss_reduction="none").float() * weights[0].unsqueeze(1)).sum()


def without_compile_time(s: Session, step: int, dt: float, watch: CompileWatch | None) -> float:
    """A compile inside the step is a one-time cost: logged, and kept out of the step's time."""
    if watch is None or not watch.graphs:
        return dt
    s.run.state.compile_time += watch.seconds
    s.bar.write(f"step {step:05d} | torch.compile: {watch.describe()} (not counted in the step's time)")
    return max(dt - watch.seconds, 1e-9)


def skip_nonfinite(s: Session, step: int, result: StepResult) -> bool:
    """Count and log the step as skipped if --skip-nonfinite allows one more; False: stop."""
    state, allowed = s.run.state, s.run.loop.skip_nonfinite
    if state.nonfinite_skipped >= allowed:
        return False
    state.nonfinite_skipped += 1
    s.bar.write(
        f"step {step:05d} | non-finite {result.what_failed}: step skipped "
        f"({state.nonfinite_skipped}/{allowed} allowed by --skip-nonfinite)"
    )
    if s.metrics:
        # logged under the step it attempted, as train rows are: a resume from checkpoint `step`
        # drops it with the rest of that history
        s.metrics.log(kind="skipped", step=step + 1, what=result.what_failed)
    return True


def stop_nonfinite(run: Run, step: int, result: StepResult) -> int:
    where = (
        f"the last good checkpoint is {run.last_checkpoint}" if run.last_checkpoint else "no checkpoint was saved yet"
    )
    print0(
        f"error: non-finite {result.what_failed} at step {step} (on at least one rank); no update was applied "
        f"and no checkpoint with it was written; {where}. Resume with --resume auto, perhaps with a lower "
        "learning rate (or pass --skip-nonfinite N to skip up to N such steps)",
        file=sys.stderr,
    )
    return EXIT_NONFINITE


def count_step(s: Session, result: StepResult, lrm: float, dt: float) -> tuple[dict, dict]:
    """Add a finished step to the loop state; its metrics row and the loader's figures (chat_rl: reward, ...)."""
    state = s.run.state
    state.step += 1
    state.train_time += dt
    state.tokens_seen += result.n_tokens
    beta = 0.9  # EMA of the loss, debiased as in nanochat (and of dt: the recent speed, for the ETA)
    state.smooth_loss = beta * state.smooth_loss + (1 - beta) * result.loss
    s.dt_ema = dt if s.dt_ema is None else beta * s.dt_ema + (1 - beta) * dt
    row = dict(
        kind="train",
        step=state.step,
        loss=result.loss,
        smooth_loss=state.smooth_loss / (1 - beta**state.step),
        lrm=lrm,
        grad_norm=result.grad_norm,
        dt=dt,
        tok_per_sec=result.n_tokens / dt,
        mfu=None,  # set by describe_step
        tokens_seen=state.tokens_seen,
    )
    step_metrics = getattr(s.run.data.train, "step_metrics", None)  # on every rank: it may all-reduce
    return row, step_metrics() if step_metrics else {}


def eta_seconds(horizon: Horizon, step: int, dt_ema: float) -> float | None:
    """The steps left at the recent speed; for an epoch-bound stage, the time so far scaled by the
    fraction of the epoch left (None before any progress)."""
    if horizon.num_iterations:
        return (horizon.num_iterations - step) * dt_ema
    done = min(horizon.progress(step), 1.0)
    return dt_ema * step / done * (1 - done) if done > 0 else None


def log_step(s: Session, row: dict, extra: dict):
    """The step's line and metrics row; rank 0 measures again a peak a step ran above (probed under load)."""
    run = s.run
    if run.rank == 0:
        peak = hardware.revise_peak(run.peak, run.flops_per_token * row["tok_per_sec"] / run.world_size, run.device)
        if peak is not run.peak:
            s.bar.write(
                f"step {row['step']:05d} ran above the {run.peak.describe()}: measured again, {peak.describe()}"
            )
            run.peak = peak
    line, postfix = describe_step(row, extra, run, eta_seconds(run.horizon, row["step"], s.dt_ema))
    s.bar.step(line, postfix)
    if s.metrics:
        s.metrics.log(**row, **extra)


class Preemption:
    """SIGTERM or SIGINT asks the run to stop after the current step and save; a second SIGINT
    aborts at once. Ranks agree each step (preemption_agreed), so any rank's signal stops all."""

    def __init__(self):
        self.signal_name = None
        self._previous = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGTERM, signal.SIGINT)}

    def _handle(self, signum, frame):
        if self.signal_name is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # second Ctrl-C: stop now, no checkpoint
        self.signal_name = signal.Signals(signum).name
        print(
            f"\nreceived {self.signal_name}: finishing this step, then saving a checkpoint "
            "(press Ctrl-C again to abort without saving)",
            file=sys.stderr,
            flush=True,
        )

    def restore(self):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
