"""
A run as the training loop sees it and as its checkpoints keep it (Run, LoopState, Horizon): save
hands its state dicts to the checkpoint home; restore puts a checkpoint's back for an exact resume,
from any number of processes.
"""

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from .. import checkpoints, hardware
from ..core.distributed import print0
from ..data.tokenizer import get_token_bytes
from ..hardware.process_setup import ProcessSetup
from ..model import sharding
from .stage_data import Data
from .training_config import LoopConfig, OptimConfig


@dataclass
class LoopState:
    """Everything about the loop (besides model, optimizer, data and RNG) a resume must restore."""

    step: int = 0
    smooth_loss: float = 0.0
    train_time: float = 0.0  # seconds spent in training steps (not eval/sampling/saving/compiling)
    compile_time: float = 0.0  # seconds torch.compile spent inside training steps (one-time)
    tokens_seen: int = 0
    nonfinite_skipped: int = 0
    first_val_bpb: float | None = None
    last_val_bpb: float | None = None
    last_evals: dict = field(default_factory=dict)  # the stage's own evaluations, latest values


@dataclass
class Horizon:
    """How long a stage trains: a number of steps, or until its data has done an epoch."""

    num_iterations: int | None  # None: until the loader's epoch is done
    describe: str  # for the run's summary
    tokens: int | None = None  # training tokens of the whole run, if known (the compile rule)
    loader: object = None  # an epoch-bound stage's training loader: the end of its epoch ends the run

    def progress(self, step: int) -> float:
        """The fraction of training done at `step`: the lr schedule's clock."""
        return step / self.num_iterations if self.num_iterations else self.loader.epoch_progress

    def epoch_done(self) -> bool:
        return self.loader is not None and self.loader.epochs_done >= 1


@dataclass
class Run:
    """Everything the loop needs; stage.run_stage builds one for every stage."""

    model: torch.nn.Module  # what runs forward/backward (possibly compiled)
    orig_model: torch.nn.Module  # the plain module (FSDP-sharded with --sharding=fsdp): state_dict keys
    optimizers: list
    data: Data  # .train (this rank's loader), .val_batches()
    run_dir: Path
    grad_accum_steps: int
    horizon: Horizon
    optim: OptimConfig  # grad_clip and the lr schedule
    loop: LoopConfig  # eval/sample/save cadence, NaN guard
    dev: ProcessSetup  # device, rank, world_size, precision
    peak: hardware.Peak | None  # the peak MFU is quoted against (None: n/a)
    meta: dict  # model config, settings... for meta.json
    sample: Callable[[torch.nn.Module], list[str]]  # a few generations of a plain model to print (rank 0 only)
    evals: tuple = ()  # (name, fn(model) -> {metric: value}) run with every val bpb eval
    state: LoopState = field(default_factory=LoopState)
    resume_command: str = ""
    last_checkpoint: Path | None = None
    finished: bool = False  # reached its horizon (not stopped by a signal or the NaN guard)

    def __post_init__(self):
        self.device, self.rank, self.world_size = self.dev.device, self.dev.rank, self.dev.world_size
        self.autocast_ctx = self.dev.autocast()
        self.token_bytes = get_token_bytes(device=self.device)
        self.flops_per_token = self.orig_model.estimate_flops()
        self.compiled = self.model is not self.orig_model  # the first step's compile is timed apart


def save(run: Run) -> Path:
    """Checkpoint the run at its step: the model, this rank's optimizer shards and RNG, and meta."""
    rng = {"cpu": torch.get_rng_state()}
    if run.device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(run.device)
    run.last_checkpoint = checkpoints.save_checkpoint(
        run.run_dir,
        run.state.step,
        model_state=sharding.model_state_dict(run.orig_model),  # DTensors with FSDP: DCP shards
        rank_state={"optimizers": [opt.shard_state_dict() for opt in run.optimizers], "rng": rng},
        meta={
            **run.meta,
            "world_size": run.world_size,
            "loader_state": run.data.train.state_dict(),
            "loop_state": asdict(run.state),
        },
        device=run.device,
        keep_last=run.loop.keep_last,
        previous=run.last_checkpoint,
    )
    return run.last_checkpoint


def restore(run: Run, ckpt: Path, meta: dict):
    """Load the optimizer shards (any saved world size), RNG, loader and loop state of `ckpt`.
    The model weights are loaded by the caller, before the optimizers are built."""
    saved_world = meta["world_size"]
    shards = checkpoints.load_rank_states(ckpt, saved_world, device=run.device)
    for i, opt in enumerate(run.optimizers):
        opt.load_shard_state_dicts([s["optimizers"][i] for s in shards])
    if saved_world == run.world_size:  # RNG streams are per rank: only meaningful on the same layout
        rng = shards[run.rank]["rng"]
        torch.set_rng_state(rng["cpu"].cpu())
        if run.device.type == "cuda" and "cuda" in rng:
            torch.cuda.set_rng_state(rng["cuda"].cpu(), run.device)
    if meta.get("loader_state") is not None:
        run.data.train.load_state_dict(meta["loader_state"])
    else:  # an imported checkpoint (scripts/import_nanochat): nanochat's data position does not carry over
        print0(f"{ckpt} has no data position (imported): the training data is read from its start")
    run.state = LoopState(**meta["loop_state"])
    run.last_checkpoint = ckpt
