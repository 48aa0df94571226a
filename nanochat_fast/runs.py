"""
Setting up, resuming and reporting a training run: what base_train and mid_train share around
the loop in training.py (flags, run directory, resume checks, model + optimizers, report).
"""
import argparse
import os
import shlex
import shutil
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict
from pathlib import Path

import torch

from . import checkpoint, cli, paths, training
from .cli import UserError
from .common import print0
from .kernels import registry
from .report import MetricsLog, plot, write_report

# ---------------------------------------------------------------------------------------------
# flags


def add_optim_args(p):
    g = p.add_argument_group("optimization")
    g.add_argument("--embedding-lr", type=cli.non_negative_float, default=0.2, help="AdamW lr of the token embedding")
    g.add_argument("--unembedding-lr", type=cli.non_negative_float, default=0.004, help="AdamW lr of lm_head")
    g.add_argument("--matrix-lr", type=cli.non_negative_float, default=0.02, help="Muon lr of the block matrices")
    g.add_argument("--weight-decay", type=cli.non_negative_float, default=0.0, help="AdamW weight decay")
    g.add_argument("--grad-clip", type=cli.non_negative_float, default=1.0, help="clip the global grad norm to this (0: off)")
    g.add_argument("--warmup-ratio", type=cli.fraction, default=0.0, help="fraction of steps of linear lr warmup")
    g.add_argument("--warmdown-ratio", type=cli.fraction, default=0.2, help="fraction of steps of linear lr warmdown")
    g.add_argument("--final-lr-frac", type=cli.fraction, default=0.0, help="lr at the end, as a fraction of the peak")
    g.add_argument("--ns-coefficients", choices=["quintic", "polar_express"], default="quintic",
                   help="Newton-Schulz coefficients of Muon")


def add_loop_args(p, eval_every, sample_every):
    g = p.add_argument_group("evaluation and checkpoints")
    g.add_argument("--eval-every", type=int, default=eval_every, help="steps between val bits-per-byte evals, also run at the start and the end (<=0: never)")
    g.add_argument("--eval-tokens", type=cli.positive_int, default=20 * 524288, help="validation tokens per eval")
    g.add_argument("--sample-every", type=int, default=sample_every, help="steps between printed samples (<=0: never)")
    g.add_argument("--save-every", type=int, default=-1, help="steps between checkpoints (<=0: only at the end and when stopped)")
    g.add_argument("--keep-last", type=cli.non_negative_int, default=0, help="keep only the newest K complete checkpoints (0: all)")
    g.add_argument("--skip-nonfinite", type=cli.non_negative_int, default=0,
                   help="skip up to N steps whose loss or grad norm is not finite instead of stopping")
    # test hooks, hidden from --help: a NaN loss at a given step; a stop as if SIGTERM arrived
    g.add_argument("--test-inject-nan-at-step", type=int, default=None, help=argparse.SUPPRESS)
    g.add_argument("--test-preempt-at-step", type=int, default=None, help=argparse.SUPPRESS)


def add_run_args(p):
    g = p.add_argument_group("run")
    g.add_argument("--run", default="", help="run name (directory under NANOCHAT_FAST_HOME/runs)")
    g.add_argument("--out-dir", default="", help="run directory (default: NANOCHAT_FAST_HOME/runs/<run>)")
    g.add_argument("--resume", default="", metavar="auto|PATH",
                   help="auto: continue from the newest complete checkpoint of the run (start fresh if none); "
                        "PATH: from that checkpoint directory")
    g.add_argument("--overwrite", action="store_true", help="delete an existing run directory and start over")
    g.add_argument("--device-type", default="", choices=["", "cpu", "cuda", "mps"], help="'' = autodetect")
    g.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile the model (default: on for CUDA, off elsewhere)")
    g.add_argument("--seed", type=int, default=42, help="random seed")
    g.add_argument("--deterministic", action="store_true", help="bitwise reproducible CPU runs (slower)")


# ---------------------------------------------------------------------------------------------
# checks and setup


def grad_accum_steps(args, world_size: int) -> int:
    per_micro_step = args.device_batch_size * args.max_seq_len * world_size
    if args.total_batch_size % per_micro_step:
        below = args.total_batch_size // per_micro_step * per_micro_step
        options = [v for v in (below, below + per_micro_step) if v > 0]
        raise UserError(
            f"--total-batch-size {args.total_batch_size} is not a multiple of device_batch_size x max_seq_len x "
            f"world_size = {args.device_batch_size} x {args.max_seq_len} x {world_size} = {per_micro_step}; "
            f"nearest valid values: {' or '.join(str(v) for v in options)}")
    return args.total_batch_size // per_micro_step


def _check_writable(run_dir: Path):
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".write_test{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise UserError(f"cannot write to run directory {run_dir} ({e.strerror or e}); "
                        "choose a writable --out-dir or set NANOCHAT_FAST_HOME") from None


def open_run_dir(args, run_name: str, rank: int, phase: str, device):
    """Decide the run directory and the checkpoint to resume from: (run_dir, ckpt or None, meta or None).
    Every rank reads the directory before rank 0 changes it (clears it for --overwrite, removes
    incomplete checkpoints), so all ranks take the same decision."""
    resume = args.resume
    if resume not in ("", "auto") and not (args.run or args.out_dir):
        run_dir = Path(resume).resolve().parent.parent  # runs/<run>/checkpoints/step_N -> runs/<run>
    else:
        run_dir = Path(args.out_dir).expanduser() if args.out_dir else paths.runs_dir() / run_name
    ckpt = None
    if resume == "auto":
        found = checkpoint.complete_checkpoints(run_dir)
        ckpt = found[-1] if found else None
        if ckpt is None:
            print0(f"--resume auto: {run_dir} has no complete checkpoint, starting from scratch")
    elif resume:
        ckpt = Path(resume).expanduser()
        if not (ckpt / checkpoint.COMPLETE).exists():
            raise UserError(f"--resume {resume}: not a complete checkpoint directory (expected "
                            "runs/<run>/checkpoints/step_NNNNNN containing COMPLETE)")
    start_over = ckpt is None and resume != "auto" and run_dir.exists() and any(run_dir.iterdir())
    if start_over and not args.overwrite:
        raise UserError(f"run directory {run_dir} already exists: pass --resume auto to continue it, "
                        "--overwrite to start over, or pick another --run")
    training.all_ranks_ok(True, device)  # a barrier: every rank has read run_dir
    error = None
    if rank == 0:
        try:
            if start_over:
                shutil.rmtree(run_dir)
            _check_writable(run_dir)
            checkpoint.remove_incomplete(run_dir)
        except UserError as e:
            error = e
    if not training.all_ranks_ok(error is None, device):  # and no rank goes on before rank 0 is done
        raise error or UserError(f"rank 0 could not prepare the run directory {run_dir} (its message says why)")
    meta = checkpoint.load_meta(ckpt) if ckpt else None
    if meta is not None and meta.get("phase") != phase:
        raise UserError(f"{ckpt} is a {meta.get('phase')} checkpoint; this script continues {phase} runs")
    return run_dir, ckpt, meta


def check_compatible(meta: dict, ckpt: Path, config, tokenizer):
    """The checkpoint must be of the same model config and tokenizer as this run."""
    saved, wanted = meta["model_config"], asdict(config)
    diff = [f"{k}={saved.get(k)} (this run: {v})" for k, v in wanted.items() if saved.get(k) != v]
    if diff:
        raise UserError(f"checkpoint {ckpt} is of another model config: {', '.join(diff)}; pass the flags it was "
                        "trained with (see its meta.json) or start a new --run")
    check_tokenizer(meta, ckpt, tokenizer)


def check_tokenizer(meta: dict, ckpt: Path, tokenizer):
    saved = meta.get("tokenizer", {})
    if saved.get("vocab_size") != tokenizer.get_vocab_size() or (
            saved.get("fingerprint") and saved.get("fingerprint") != tokenizer.fingerprint):
        raise UserError(f"the tokenizer in {paths.tokenizer_dir()} (vocab {tokenizer.get_vocab_size()}) is not the one "
                        f"checkpoint {ckpt} was trained with (vocab {saved.get('vocab_size')}); restore that tokenizer "
                        "or train a new model")


def check_shards(loader, tokenizer):
    """The token shards must have been made with the tokenizer this run encodes prompts with."""
    if loader.shards.fingerprint != tokenizer.fingerprint:
        raise UserError(f"the token shards in {loader.shards.directory} were made with another tokenizer than the "
                        f"one in {paths.tokenizer_dir()}; re-tokenize with "
                        "`python -m nanochat_fast.scripts.prepare_data --stage=tokens`")


def new_model(GPT, config, device, state=None):
    """GPT(config) built on the meta device and materialised on `device` with nanochat's init
    (which also fills the rotary buffers, not saved in checkpoints), then loaded with `state`."""
    with torch.device("meta"):
        model = GPT(config)
    model.to_empty(device=device)
    model.init_weights()
    if state is not None:
        model.load_state_dict(state)
    return model


def build_model(GPT, config, device, args, model_state=None):
    """The model on `device` (weights initialised, or loaded), its optimizers, and the compiled
    version used for training. The optimizers hold the uncompiled module's parameters."""
    orig_model = new_model(GPT, config, device, model_state)
    optimizers = orig_model.setup_optimizers(unembedding_lr=args.unembedding_lr, embedding_lr=args.embedding_lr,
                                             matrix_lr=args.matrix_lr, weight_decay=args.weight_decay,
                                             ns_coefficients=args.ns_coefficients)
    use_compile = args.compile if args.compile is not None else device.type == "cuda"
    model = torch.compile(orig_model, dynamic=False) if use_compile else orig_model
    return model, orig_model, optimizers


def val_batches(Loader, *, dataset, eval_tokens, device_batch_size, seq_len, rank, world_size, device, **kwargs):
    """Up to eval_tokens (all ranks together) of the val split, from its start, at most one pass."""
    steps = max(1, eval_tokens // (device_batch_size * seq_len * world_size))
    with Loader(dataset=dataset, split="val", device_batch_size=device_batch_size, seq_len=seq_len, rank=rank,
                world_size=world_size, device=device, **kwargs) as val:
        for _ in range(steps):
            if val.epochs_done:
                break
            yield next(val)


def autocast_context(device):
    if device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0):
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return nullcontext()  # fp32 on CPU and MPS (no native bf16 there)


def resume_command(argv, run_dir: Path) -> str:
    """The command line that, with --resume auto appended, resumes this run: this one's flags
    without --resume/--overwrite, plus --out-dir when only a --resume PATH named the run."""
    args = list(sys.argv[1:] if argv is None else argv)
    kept, skip = [], False
    for a in args:
        if skip:
            skip = False
            continue
        name = a.split("=")[0].replace("_", "-")
        if name in ("--resume", "--overwrite"):
            skip = name == "--resume" and "=" not in a
            continue
        kept.append(a)
    if not any(a.split("=")[0].replace("_", "-") in ("--run", "--out-dir") for a in kept):
        kept.append(f"--out-dir={run_dir}")
    main_spec = getattr(sys.modules["__main__"], "__spec__", None)
    module = main_spec.name if main_spec else f"nanochat_fast.scripts.{Path(sys.argv[0]).stem}"
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:  # `--` keeps torchrun from reading --run as an abbreviation of its --run-path
        return " ".join([f"torchrun --nproc_per_node={world} -m", module, "--", *map(shlex.quote, kept)])
    return " ".join(["python -m", module, *map(shlex.quote, kept)])


def make_run(args, *, model, orig_model, optimizers, loader, val_batches, token_bytes, run_dir, grad_accum_steps,
             tokens_per_step, num_iterations, progress, epoch_done, sample, config, tokenizer, phase, device, rank,
             world_size, argv, extra_meta=None) -> training.Run:
    def meta():
        return {"phase": phase, "model_config": asdict(config),
                "tokenizer": {"vocab_size": tokenizer.get_vocab_size(), "fingerprint": tokenizer.fingerprint},
                "args": {k: v for k, v in vars(args).items()}, **(extra_meta or {})}

    return training.Run(
        model=model, orig_model=orig_model, optimizers=optimizers, train_loader=loader, val_batches=val_batches,
        token_bytes=token_bytes, run_dir=run_dir, grad_accum_steps=grad_accum_steps, tokens_per_step=tokens_per_step,
        flops_per_token=orig_model.estimate_flops(), num_iterations=num_iterations, progress=progress,
        epoch_done=epoch_done, meta=meta, sample=sample, autocast_ctx=autocast_context(device), device=device,
        rank=rank, world_size=world_size, args=args, resume_command=resume_command(argv, run_dir))


def backends_in_use(device) -> dict:
    out = {}
    for op in registry.ops():
        try:
            out[op] = registry.select(op, device.type).name
        except registry.KernelUnavailableError as e:
            out[op] = f"unavailable: {e}"
    return out


def summary(run: training.Run, config, model, extra: dict) -> str:
    per_rank = run.args.device_batch_size * run.args.max_seq_len
    lines = [f"run dir: {run.run_dir}",
             f"model: n_layer={config.n_layer} n_embd={config.n_embd} n_head={config.n_head} "
             f"n_kv_head={config.n_kv_head} vocab={config.vocab_size} seq_len={config.sequence_len}",
             f"parameters: {sum(p.numel() for p in model.parameters()):,} | FLOPs per token: {run.flops_per_token:.3e}",
             f"device: {run.device} x {run.world_size} process(es) | kernels: "
             + ", ".join(f"{k}={v}" for k, v in backends_in_use(run.device).items()),
             f"tokens per micro-batch per rank: {run.args.device_batch_size} x {run.args.max_seq_len} = {per_rank:,} | "
             f"total batch {run.tokens_per_step:,} tokens => {run.grad_accum_steps} gradient accumulation step(s)"]
    lines += [f"{k}: {v}" for k, v in extra.items()]
    return "\n".join(lines)


def train_and_report(run: training.Run, ckpt, meta, title: str) -> int:
    if ckpt is not None:
        training.restore(run, ckpt, meta)
        print0(f"resumed from {ckpt} (step {run.state.step}, saved with {meta['world_size']} process(es))")
    metrics = MetricsLog(run.run_dir / "metrics.jsonl", resume_step=run.state.step if ckpt else None) \
        if run.rank == 0 else None
    wall = time.time()
    code = training.train(run, metrics)
    if run.rank == 0:
        finish_report(run, metrics, title, wall)
    return code


def finish_report(run: training.Run, metrics: MetricsLog, title: str, wall_start: float):
    rows = metrics.rows()
    train_rows = [r for r in rows if r.get("kind") == "train"]
    speeds = sorted(r["tok_per_sec"] for r in train_rows)
    state = run.state
    results = {"steps": state.step, "tokens seen": f"{state.tokens_seen:,}",
               "final train loss (smoothed)": f"{train_rows[-1]['smooth_loss']:.4f}" if train_rows else "n/a",
               "val bpb at start": f"{state.first_val_bpb:.4f}" if state.first_val_bpb is not None else "n/a",
               "val bpb at end": f"{state.last_val_bpb:.4f}" if state.last_val_bpb is not None else "n/a",
               "median tokens/s": f"{speeds[len(speeds) // 2]:,.0f}" if speeds else "n/a",
               "skipped non-finite steps": state.nonfinite_skipped,
               "last checkpoint": str(run.last_checkpoint)}
    mfus = [r["mfu"] for r in train_rows if r.get("mfu") is not None]
    results["median MFU"] = f"{sorted(mfus)[len(mfus) // 2]:.1f}%" if mfus else f"n/a on {run.device.type}"
    timing = {"training time (steps only)": f"{state.train_time:.1f} s",
              "wall time of this invocation": f"{time.time() - wall_start:.1f} s"}
    plot(rows, run.run_dir / "loss.png", title)
    write_report(run.run_dir / "report.md", title=title, args=vars(run.args), model_config=run.meta()["model_config"],
                 backends=backends_in_use(run.device), results=results, timing=timing, world_size=run.world_size)
    print(f"val bpb: {results['val bpb at start']} at start -> {results['val bpb at end']} at step {state.step}; "
          f"median {results['median tokens/s']} tokens/s", flush=True)
    print(f"report: {run.run_dir / 'report.md'}", flush=True)


# ---------------------------------------------------------------------------------------------
# finding and loading trained models


def newest_run(phase: str) -> Path:
    """The run directory of `phase` ("base" or "mid") whose newest complete checkpoint is newest."""
    candidates = []
    for run_dir in paths.runs_dir().glob("*") if paths.runs_dir().is_dir() else []:
        found = checkpoint.complete_checkpoints(run_dir)
        if found:
            try:
                if checkpoint.load_meta(found[-1]).get("phase") == phase:
                    candidates.append(((found[-1] / checkpoint.COMPLETE).stat().st_mtime, run_dir))
            except UserError:
                continue
    if not candidates:
        command = "base_train" if phase == "base" else "mid_train"
        raise UserError(f"no {phase} run with a complete checkpoint in {paths.runs_dir()}; train one with "
                        f"`python -m nanochat_fast.scripts.{command}` (or pass --run)")
    return max(candidates)[1]


def run_dir_of(name: str, phase: str | None) -> Path:
    if not name:
        return newest_run(phase)
    path = Path(name).expanduser()
    run_dir = path if path.is_dir() and (path / "checkpoints").is_dir() else paths.runs_dir() / name
    if not (run_dir / "checkpoints").is_dir():
        raise UserError(f"no run named {name!r} (looked for {run_dir}/checkpoints)")
    return run_dir


def open_checkpoint(run_dir: Path, step: int | None, tokenizer):
    """(checkpoint path, meta, GPTConfig) of run_dir's checkpoint at `step` (None: the newest
    complete one), made with `tokenizer`."""
    from .gpt import GPTConfig
    ckpt = checkpoint.resolve_checkpoint(run_dir, step)
    meta = checkpoint.load_meta(ckpt)
    check_tokenizer(meta, ckpt, tokenizer)
    return ckpt, meta, GPTConfig(**meta["model_config"])


def load_model(run_dir: Path, step: int | None, device, tokenizer, GPT):
    """(model in eval mode, checkpoint path, meta) for inference."""
    ckpt, meta, config = open_checkpoint(run_dir, step, tokenizer)
    model = new_model(GPT, config, device, checkpoint.load_model_state(ckpt, device))
    model.eval()
    return model, ckpt, meta
