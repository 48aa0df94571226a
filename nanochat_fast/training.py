"""
The training loop shared by base_train and mid_train: the two loops of the seeds (an outer loop
of optimizer steps, an inner loop of gradient-accumulation micro-steps) plus what a long run on
rented machines needs: evaluation, sampling, atomic checkpoints, exact resume, preemption and the
NaN guard.

One step:
    fetch the grad_accum_steps micro-batches of this rank
    count the supervised targets of the whole step on all ranks (one all-reduce)
    for each micro-batch: loss_sum = model(x, y, "sum"); (loss_sum / count).backward()
    the logged loss is the global mean: all-reduced loss sums / count
    set lr and Muon momentum, then optim.step(): reduce-scatter, global grad norm, clip, update
Dividing by the global count of supervised tokens (not per-rank means) makes the gradient the
same on 1 and N processes, also for masked targets (mid-training).
"""
import math
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from . import checkpoint, optim
from .cli import EXIT_NONFINITE
from .common import all_reduce_sum, get_dist_info, print0
from .report import MetricsLog

# Peak dense bf16 FLOP/s per device, for MFU. CPUs have no meaningful peak here.
PEAK_FLOPS = {
    "H100": 989e12, "H200": 989e12, "GH200": 989e12, "B200": 2250e12, "A100": 312e12,
    "A10G": 125e12, "A10": 125e12, "L40S": 362e12, "L4": 121e12, "4090": 165e12, "3090": 71e12,
}


def peak_flops(device_type: str) -> float | None:
    if device_type != "cuda":
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_FLOPS.items() if k in name), None)


def lr_multiplier(progress: float, warmup_ratio: float, warmdown_ratio: float, final_lr_frac: float) -> float:
    """Linear warmup over the first warmup_ratio of training, flat, then linear warmdown to
    final_lr_frac over the last warmdown_ratio (progress in [0, 1])."""
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
    train_time: float = 0.0       # seconds spent in training steps (not eval/sampling/saving)
    tokens_seen: int = 0
    nonfinite_skipped: int = 0
    first_val_bpb: float | None = None
    last_val_bpb: float | None = None


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


def train_step(model, optimizers, micro_batches, grad_clip, autocast_ctx, inject_nan=False) -> StepResult:
    """One optimizer step over this rank's micro-batches (see the module docstring)."""
    counts = torch.stack([(y >= 0).sum() for _, y in micro_batches]).sum().double()
    n_sup = all_reduce_sum(counts)
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
        return StepResult(global_loss, float("nan"), int(n_sup.item()), False)
    grad_norm = optim.step(optimizers, grad_clip).item()
    model.zero_grad(set_to_none=True)
    return StepResult(global_loss, grad_norm, int(n_sup.item()), math.isfinite(grad_norm))


def any_rank(flag: bool, device) -> bool:
    """True on every rank if `flag` is True on any rank."""
    if not (dist.is_available() and dist.is_initialized()):
        return flag
    t = torch.tensor(int(flag), device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def format_eta(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}h{(seconds % 3600) // 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


def describe_step(state: LoopState, num_iterations: int | None, result: StepResult, lrm: float, dt: float,
                  smooth_loss: float, eta_seconds: float | None, tokens: int, flops_per_token: float,
                  peak: float | None, world_size: int, device_type: str):
    """The per-step log line, the progress-bar postfix and the metrics row."""
    tok_per_sec = tokens / dt
    mfu = 100 * flops_per_token * tok_per_sec / (peak * world_size) if peak else None
    mfu_text = f"mfu {mfu:.1f}%" if mfu is not None else (
        "mfu n/a (CPU)" if device_type == "cpu" else f"mfu n/a ({device_type}: no known peak)")
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
class Run:
    """Everything the loop needs; base_train and mid_train each build one."""
    model: torch.nn.Module              # what runs forward/backward (possibly compiled)
    orig_model: torch.nn.Module         # the plain module: state_dict keys, generate()
    optimizers: list
    train_loader: Iterator              # yields this rank's (x, y); has state_dict()/load_state_dict()
    val_batches: Callable[[], Iterator]  # a fresh pass over the validation batches
    token_bytes: torch.Tensor
    run_dir: Path
    grad_accum_steps: int
    tokens_per_step: int                # all ranks, one optimizer step
    flops_per_token: float
    num_iterations: int | None          # None: until the loader reports an epoch done
    progress: Callable[[int], float]    # step -> fraction of training done, for the lr schedule
    epoch_done: Callable[[], bool]      # the loader finished its epoch (mid_train); False otherwise
    meta: Callable[[], dict]            # model config, args... for meta.json
    sample: Callable[[], list[str]]     # a few generations to print (rank 0 only)
    autocast_ctx: object
    device: torch.device
    rank: int
    world_size: int
    args: object                        # the parsed arguments (eval_every, save_every, grad_clip, ...)
    state: LoopState = field(default_factory=LoopState)
    resume_command: str = ""
    last_checkpoint: Path | None = None


def all_ranks_ok(ok: bool, device) -> bool:
    return not any_rank(not ok, device)


def rank_state(run: Run) -> dict:
    """This rank's share of the training state: optimizer shards and RNG."""
    rng = {"cpu": torch.get_rng_state()}
    if run.device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(run.device)
    return {"optimizers": [opt.shard_state_dict() for opt in run.optimizers], "rng": rng}


def save(run: Run) -> Path:
    meta = {**run.meta(), "world_size": run.world_size, "loader_state": run.train_loader.state_dict(),
            "loop_state": asdict(run.state)}
    path = checkpoint.save_checkpoint(
        run.run_dir, run.state.step, model_state=run.orig_model.state_dict(), rank_state=rank_state(run),
        meta=meta, rank=run.rank, all_ranks_ok=lambda ok: all_ranks_ok(ok, run.device),
        keep_last=run.args.keep_last, previous=run.last_checkpoint)
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
    run.train_loader.load_state_dict(meta["loader_state"])
    run.state = LoopState(**meta["loop_state"])
    run.last_checkpoint = ckpt


def train(run: Run, metrics: MetricsLog | None) -> int:
    """The outer loop. Returns the process exit code (0, or 3 when the NaN guard stops the run)."""
    args, state = run.args, run.state
    master = run.rank == 0
    peak = peak_flops(run.device.type)
    preemption = Preemption()
    bar = Progress(run.num_iterations, state.step, enabled=master)
    start_step = state.step
    # eval/sample/save happen once per step value, even if a step is skipped; a resumed run did
    # them at its first step before it saved, so it does not repeat them
    events_done_at = start_step if run.last_checkpoint is not None else None
    injected = False
    dt_ema = None
    try:
        while True:
            step = state.step
            last_step = (run.num_iterations is not None and step >= run.num_iterations) or run.epoch_done()
            fresh = events_done_at != step
            events_done_at = step

            if fresh and args.eval_every > 0 and (step % args.eval_every == 0 or last_step):
                run.model.eval()
                bpb = evaluate_bpb(run.model, run.val_batches(), run.token_bytes, run.autocast_ctx)
                run.model.train()
                state.first_val_bpb = bpb if state.first_val_bpb is None else state.first_val_bpb
                state.last_val_bpb = bpb
                bar.write(f"step {step:05d} | val bpb {bpb:.4f}")
                if metrics:
                    metrics.log(kind="eval", step=step, val_bpb=bpb)

            if fresh and master and args.sample_every > 0 and (step % args.sample_every == 0 or last_step) and step > 0:
                run.orig_model.eval()
                for text in run.sample():
                    bar.write(f"  sample: {text!r}")
                run.orig_model.train()

            if args.test_preempt_at_step == step and step > start_step:
                preemption.signal_name = "--test-preempt-at-step"  # behaves exactly like a SIGTERM here
            preempted = any_rank(preemption.signal_name is not None, run.device)
            periodic = fresh and args.save_every > 0 and step > start_step and step % args.save_every == 0
            if (last_step or preempted or periodic) and (step > start_step or run.last_checkpoint is None):
                path = save(run)
                bar.write(f"step {step:05d} | saved checkpoint {path}")
            if preempted:
                name = preemption.signal_name or "a signal on another rank"
                print0(f"stopped by {name} at step {step}; checkpoint {run.last_checkpoint}. "
                       f"Resume with: {run.resume_command} --resume auto", flush=True)
                return 0
            if last_step:
                return 0

            t0 = time.perf_counter()
            micro_batches = [next(run.train_loader) for _ in range(run.grad_accum_steps)]
            lrm = lr_multiplier(run.progress(step), args.warmup_ratio, args.warmdown_ratio, args.final_lr_frac)
            set_schedule(run.optimizers, lrm, muon_momentum(run.optimizers, step, run.num_iterations))
            inject = args.test_inject_nan_at_step == step and not injected
            injected = injected or inject  # a one-off fault: a skipped step is retried cleanly
            result = train_step(run.model, run.optimizers, micro_batches, args.grad_clip, run.autocast_ctx, inject)
            if run.device.type == "cuda":
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0

            if not result.finite:
                what = "loss" if not math.isfinite(result.loss) else "gradient norm"
                if state.nonfinite_skipped < args.skip_nonfinite:
                    state.nonfinite_skipped += 1
                    bar.write(f"step {step:05d} | non-finite {what}: step skipped "
                              f"({state.nonfinite_skipped}/{args.skip_nonfinite} allowed by --skip-nonfinite)")
                    if metrics:
                        # logged under the step it attempted, as train rows are: a resume from
                        # checkpoint `step` drops it with the rest of that history
                        metrics.log(kind="skipped", step=step + 1, what=what)
                    continue
                return stop_nonfinite(nonfinite_message(what, step, run.last_checkpoint))

            state.step += 1
            state.train_time += dt
            state.tokens_seen += run.tokens_per_step
            beta = 0.9  # EMA of the loss, debiased as in nanochat
            state.smooth_loss = beta * state.smooth_loss + (1 - beta) * result.loss
            debiased = state.smooth_loss / (1 - beta ** state.step)
            dt_ema = dt if dt_ema is None else beta * dt_ema + (1 - beta) * dt  # recent speed, for the ETA
            if run.num_iterations:
                eta = (run.num_iterations - state.step) * dt_ema
            else:
                done = run.progress(state.step)
                eta = dt_ema * state.step / done * (1 - done) if done > 0 else None
            line, postfix, row = describe_step(state, run.num_iterations, result, lrm, dt, debiased, eta,
                                               run.tokens_per_step, run.flops_per_token, peak, run.world_size,
                                               run.device.type)
            bar.step(line, postfix)
            if metrics:
                metrics.log(**row)
    finally:
        bar.close()
        preemption.restore()
