"""
A training run's configuration: one small frozen object per component (model, data, horizon,
optimization, loop, device, run). A field is declared once, with its default, check and help:
add_flags makes it a flag whose argparse type is the check, and __post_init__ runs the check again
on a config built in code. A bad value is a UserError in argparse's words, exit code 2.
"""

import argparse
import math
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from ..core import cli, rank_watch
from ..core.errors import UserError
from ..hardware import allocator, precision
from ..hardware.process_setup import ProcessSetup
from ..kernels.newton_schulz import SCHEDULES
from ..optim.recipe import PRESET_NAMES, MuonRecipe, preset_name


def flag(default, check, help, **argparse_kwargs):
    """A config field that is also a command-line flag (--field-name)."""
    return field(default=default, metadata=dict(check=check, help=help, **argparse_kwargs))


class Config:
    """Base of the component configs: their flags, built from parsed flags, validated."""

    GROUP = ""  # the --help section of its flags

    def __post_init__(self):
        for f in fields(self):
            if "check" in f.metadata:
                object.__setattr__(self, f.name, cli.check_value(f.name, f.metadata["check"], getattr(self, f.name)))
        self.validate()

    def validate(self):
        """Rules across fields (UserError); each field's own check has run already."""

    @classmethod
    def add_flags(cls, parser, only=None, **defaults):
        """The flags of `cls` (or of the fields in `only`) with this script's `defaults`; their group."""
        group = parser.add_argument_group(cls.GROUP)
        for f in fields(cls):
            if only is not None and f.name not in only:
                continue
            meta = dict(f.metadata)
            check, default = meta.pop("check"), defaults.pop(f.name, f.default)
            if check is cli.boolean:
                meta["action"] = "store_true"
            elif meta.pop("optional_bool", False):
                meta["action"] = argparse.BooleanOptionalAction
            else:
                meta["type"] = check
            group.add_argument(cli.flag_name(f.name), default=default, **meta)
        if defaults:
            raise TypeError(f"{cls.__name__} has no fields {sorted(defaults)}")
        return group

    @classmethod
    def from_args(cls, args):
        """The config of the parsed flags; fields without a flag in this script keep their default."""
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})


def muon_recipe_name(value) -> str:
    """--muon-recipe's check: a preset's name (a former name becomes the new one, with a notice)."""
    return cli.choice(*PRESET_NAMES)(preset_name(value))


def window_pattern(value) -> str:
    """--window-pattern's check: letters S and L only."""
    from ..model.windowed_gpt import check_window_pattern

    try:
        return check_window_pattern(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


ARCHES = ("gpt", "windowed")  # model/loading.FAMILIES' names (checked equal by the model tests)
# The windowed family's recipe (nanochat's base_train at 92d63d4): the defaults --arch=windowed
# gives the flags not set on the command line. One change: Newton-Schulz in minimax4's 4 steps, not Polar
# Express's 5 (the same val bpb in 300 steps: docs/measurements.md#newton-schulz-in-4-steps).
ARCH_PRESETS = {
    "windowed": dict(
        muon_recipe="polar-normuon",
        ns_coefficients="minimax4",
        embedding_lr=0.3,
        unembedding_lr=0.008,
        scalar_lr=0.5,
        warmup_steps=40,
        warmdown_ratio=0.65,
        final_lr_frac=0.05,
        grad_clip=0.0,
    )
}


@dataclass(frozen=True)
class ModelConfig(Config):
    GROUP = "model"
    arch: str = flag(
        "gpt",
        cli.choice(*ARCHES),
        "model family: gpt or windowed (nanochat's today: sliding windows, value embeddings, per-layer scalars, "
        "smear and backout; also sets its recipe's defaults)",
        choices=list(ARCHES),
    )
    depth: int = flag(20, cli.positive_int, "transformer layers; sets width and heads")
    aspect_ratio: int = flag(64, cli.positive_int, "n_embd ~= aspect_ratio * depth")
    head_dim: int = flag(128, cli.positive_int, "attention head dimension")
    window_pattern: str = flag(
        "SSSL", window_pattern, "windowed: S (a quarter of the context) and L (all of it) tiled over the layers"
    )

    def validate(self):
        if self.head_dim % 2:
            raise UserError(
                f"argument --head-dim: must be even (rotary embeddings turn pairs of channels), got {self.head_dim}"
            )

    def gpt_config(self, vocab_size: int, sequence_len: int):
        from ..model.gpt import config_from_depth
        from ..model.loading import family_config

        config = config_from_depth(
            self.depth, vocab_size, sequence_len, aspect_ratio=self.aspect_ratio, head_dim=self.head_dim
        )
        return family_config(config, self.arch, self.window_pattern)


@dataclass(frozen=True)
class DataConfig(Config):
    GROUP = "data and batch"
    dataset: str = flag("", cli.plain_name, "dataset name under NANOCHAT_FAST_HOME/tokens/ ('': the stage's own)")
    max_seq_len: int | None = flag(2048, cli.optional(cli.positive_int), "context length (tokens per row)")
    device_batch_size: int = flag(32, cli.positive_int, "rows per micro-step per process")
    total_batch_size: int = flag(524288, cli.positive_int, "tokens per optimizer step, all processes")

    def grad_accum_steps(self, world_size: int) -> int:
        factors = (self.device_batch_size, self.max_seq_len, world_size)
        what = f"device_batch_size x max_seq_len x world_size = {' x '.join(map(str, factors))} = {math.prod(factors)}"
        return micro_steps("--total-batch-size", self.total_batch_size, math.prod(factors), what)


def micro_steps(flag: str, total: int, per_micro_step: int, what: str) -> int:
    """total / per_micro_step, an optimizer step's micro-steps; else a UserError naming the nearest valid totals."""
    if total % per_micro_step:
        below = total // per_micro_step * per_micro_step
        options = " or ".join(str(v) for v in (below, below + per_micro_step) if v > 0)
        raise UserError(f"{flag} {total} is not a multiple of {what}; nearest valid values: {options}")
    return total // per_micro_step


@dataclass(frozen=True)
class HorizonConfig(Config):
    GROUP = "horizon (first one set wins)"
    num_iterations: int = flag(-1, cli.positive_or_unset_int, "optimizer steps (-1: use the next option)")
    target_flops: float = flag(-1.0, cli.positive_or_unset_float, "training FLOPs budget (-1: use the next option)")
    target_param_data_ratio: float = flag(-1.0, cli.positive_or_unset_float, "tokens per parameter (Chinchilla ~20)")


@dataclass(frozen=True)
class OptimConfig(Config):
    GROUP = "optimization"
    embedding_lr: float = flag(0.2, cli.non_negative_float, "AdamW lr of the token embedding")
    unembedding_lr: float = flag(0.004, cli.non_negative_float, "AdamW lr of lm_head")
    matrix_lr: float = flag(0.02, cli.non_negative_float, "Muon lr of the block matrices")
    weight_decay: float = flag(0.0, cli.non_negative_float, "AdamW weight decay (windowed: its groups have their own)")
    scalar_lr: float = flag(0.5, cli.non_negative_float, "windowed: AdamW lr of the per-layer scalars")
    grad_clip: float = flag(1.0, cli.non_negative_float, "clip the global grad norm to this (0: off)")
    warmup_ratio: float = flag(0.0, cli.fraction, "fraction of steps of linear lr warmup")
    warmup_steps: int = flag(0, cli.non_negative_int, "steps of linear lr warmup (instead of --warmup-ratio when > 0)")
    warmdown_ratio: float = flag(0.2, cli.fraction, "fraction of steps of linear lr warmdown")
    final_lr_frac: float = flag(0.0, cli.fraction, "lr at the end, as a fraction of the peak")
    # minimax4, not nanochat's quintic: it reached quintic's val bpb within 0.5% in 300 steps with 4/5 of
    # the Newton-Schulz work (docs/measurements.md, "Newton-Schulz in 4 steps"); --arch=windowed's is its own
    muon_recipe: str = flag(
        "minimax4",
        muon_recipe_name,
        "Muon's recipe (optim/recipe.py): minimax4 (the default for --arch=gpt: quintic with 4 tuned "
        "Newton-Schulz steps instead of 5, for the same singular-value band), quintic (nanochat's classic GPT's: "
        "5 quintic Newton-Schulz steps, momentum warmup) or polar-normuon (--arch=windowed's default, nanochat's "
        "today: Polar Express, MuonEq, Muon+, NorMuon, cautious weight decay, momentum warmdown); the flags "
        "below override parts of it. The former names seeds and current still work, with a notice",
        choices=list(PRESET_NAMES),
    )
    ns_dtype: str = flag(
        "auto",
        cli.choice(*precision.CHOICES),
        "dtype Newton-Schulz computes in (auto: bf16 on CUDA sm80+; on a CPU the faster one, timed at Muon's "
        "matrices and cached)",
        choices=list(precision.CHOICES),
    )
    ns_coefficients: str | None = flag(
        None,
        cli.optional(cli.choice(*SCHEDULES)),
        "Newton-Schulz coefficients and their steps (default: the recipe's; minimax4 for --arch=windowed): "
        "quintic and polar_express 5 steps, minimax4 4",
        choices=list(SCHEDULES),
    )
    normuon: bool | None = flag(
        None,
        cli.optional(cli.boolean),
        "NorMuon's per-row normalisation of the update (default: the recipe's)",
        optional_bool=True,
    )
    muon_weight_decay: float | None = flag(
        None,
        cli.optional(cli.non_negative_float),
        "Muon's weight decay (default: the recipe's: 0 for minimax4 and quintic, 0.28 cautious and "
        "cosine-scheduled for polar-normuon)",
    )
    sharding: str = flag(
        "zero2",
        cli.choice("zero2", "fsdp"),
        "how several processes share the model: zero2 (each holds the whole model and gradient, the optimizer "
        "state is sharded) or fsdp (parameters, gradients and optimizer state all sharded by FSDP2; for models "
        "that do not fit one device; needs >= 2 processes)",
        choices=["zero2", "fsdp"],
    )

    # The learning-rate flags and the parameters (by name prefix) whose optimizer groups they set:
    # on resume, a flag given on the command line replaces the checkpoint's value (stage.py).
    LR_FLAGS = (("embedding_lr", "transformer.wte"), ("unembedding_lr", "lm_head"), ("matrix_lr", "transformer.h"))

    @classmethod
    def scaled_lrs(cls, fraction: float) -> dict:
        """The learning-rate flags' defaults at `fraction` of pretraining's (fine-tuning starts lower)."""
        defaults = {f.name: f.default for f in fields(cls)}
        return {name: defaults[name] * fraction for name, _ in cls.LR_FLAGS}

    def validate(self):
        if self.warmup_ratio + self.warmdown_ratio > 1:
            raise UserError(
                f"--warmup-ratio {self.warmup_ratio} + --warmdown-ratio {self.warmdown_ratio} is above 1: "
                "the warmup and the warmdown would overlap; lower one of them"
            )

    def recipe(self) -> MuonRecipe:
        """The --muon-recipe preset with the flags given on top (polar-normuon's momentum warmdown: the lr's)."""
        given = dict(ns_coefficients=self.ns_coefficients, normuon=self.normuon, weight_decay=self.muon_weight_decay)
        overrides = dict(ns_dtype=self.ns_dtype, **{name: value for name, value in given.items() if value is not None})
        if self.muon_recipe == "polar-normuon":
            overrides["momentum_warmdown_ratio"] = self.warmdown_ratio
        if self.ns_coefficients is not None:
            overrides["ns_steps"] = SCHEDULES[self.ns_coefficients]
        return MuonRecipe.preset(self.muon_recipe, **overrides)

    def optimizer_kwargs(self) -> dict:
        """The keyword arguments of GPT.setup_optimizers."""
        names = ("unembedding_lr", "embedding_lr", "matrix_lr", "weight_decay", "scalar_lr")
        return {name: getattr(self, name) for name in names} | {"muon_recipe": self.recipe()}


@dataclass(frozen=True)
class LoopConfig(Config):
    GROUP = "evaluation and checkpoints"
    eval_every: int = flag(
        250, cli.integer, "steps between val bits-per-byte evals, also run at the start and the end (<=0: never)"
    )
    eval_tokens: int = flag(20 * 524288, cli.positive_int, "validation tokens per eval")
    sample_every: int = flag(2000, cli.integer, "steps between printed samples (<=0: never)")
    save_every: int = flag(-1, cli.integer, "steps between checkpoints (<=0: only at the end and when stopped)")
    keep_last: int = flag(0, cli.non_negative_int, "keep only the newest K complete checkpoints (0: all)")
    skip_nonfinite: int = flag(
        0, cli.non_negative_int, "skip up to N steps whose loss or grad norm is not finite instead of stopping"
    )


@dataclass(frozen=True)
class DeviceConfig(Config):
    GROUP = "device"
    device_type: str = flag(
        "", cli.choice("", "cpu", "cuda", "mps"), "'' = autodetect", choices=["", "cpu", "cuda", "mps"]
    )
    dtype: str = flag(
        "auto",
        cli.choice(*precision.CHOICES),
        "compute dtype of the model's matmuls (auto: bf16 on CUDA sm80+; on a CPU the faster one, timed at the "
        "run's shapes and cached; fp32 on MPS)",
        choices=list(precision.CHOICES),
    )
    collective_timeout: float = flag(
        rank_watch.DEFAULT_TIMEOUT_S,
        cli.positive_float,
        "seconds a collective waits for the other ranks after the first step (which, like saves and "
        f"evaluations, gets at least {rank_watch.GENEROUS_S:g} s); a stuck rank is then named in one line "
        "and the run exits non-zero, for torchrun --max-restarts and --resume auto",
    )

    def init(self, seed: int = 42, deterministic: bool = False) -> ProcessSetup:
        """This process set up (compute_init; its threads too), its compute dtype (a CPU's auto: the
        machine's matmul probe, rank 0's for every rank) and the kernels, checked against the device."""
        from ..core.distributed import compute_init, rank0_decides
        from .env_vars import check_kernels

        ddp, rank, local_rank, world_size, device = compute_init(
            self.device_type, seed=seed, deterministic=deterministic, collective_timeout=self.collective_timeout
        )
        if device.type == "cpu":  # before the model's memory: a CPU step's big blocks reused, not faulted in again
            allocator.keep_freed_memory()
        chosen = rank0_decides(lambda: precision.choose(device, self.dtype, what="--dtype"))
        return ProcessSetup(ddp, rank, local_rank, world_size, device, chosen, check_kernels(device.type))


@contextmanager
def evaluation_process(args):
    """For a command that evaluates a checkpoint (base_eval, chat_eval): the environment checked,
    the ProcessSetup of the device flags (described on rank 0), the process group torn down at the end."""
    from ..core.distributed import print0, torn_down
    from .env_vars import check_environment

    check_environment()
    with torn_down():
        dev = DeviceConfig.from_args(args).init()
        print0(dev.describe())
        yield dev


@dataclass(frozen=True)
class RunConfig(Config):
    GROUP = "run"
    run: str = flag("", cli.run_name, "run name: a folder under NANOCHAT_FAST_HOME/runs ('': the stage's default)")
    out_dir: str = flag("", str, "run directory anywhere (default: NANOCHAT_FAST_HOME/runs/<run>)")
    resume: str = flag(
        "",
        str,
        "auto: continue from the newest complete checkpoint of the run (start fresh if none); PATH: from that "
        "checkpoint directory",
        metavar="auto|PATH",
    )
    overwrite: bool = flag(False, cli.boolean, "delete an existing run directory and start over")
    compile: bool | None = flag(
        None,
        cli.optional(cli.boolean),
        "torch.compile the training step (default: on for CUDA and CPU unless the run is too short to win back "
        "the one-time compile, or its row lengths vary; off on MPS; the log says which and why)",
        optional_bool=True,
    )
    seed: int = flag(42, cli.random_seed, "random seed")
    deterministic: bool = flag(False, cli.boolean, "bitwise reproducible CPU runs (slower)")
    wandb: str = flag(
        "",
        cli.plain_name,
        'log to wandb under this project, with nanochat\'s metric names (needs pip install "nanochat_fast[wandb]"; '
        "WANDB_MODE=offline keeps it local)",
        metavar="PROJECT",
    )
    tensorboard: bool = flag(
        False,
        cli.boolean,
        "also write TensorBoard event files into the run folder's tensorboard/ "
        '(needs pip install "nanochat_fast[tensorboard]")',
    )

    def validate(self):
        from .tracking import require

        for what in ("wandb", "tensorboard"):
            if getattr(self, what):
                require(what)
        out_dir = Path(self.out_dir).expanduser()
        if self.out_dir and out_dir.exists() and not out_dir.is_dir():
            raise UserError(f"argument --out-dir: {self.out_dir} exists and is not a directory; give a directory")
        if self.resume and self.overwrite:
            raise UserError(
                "--resume and --overwrite contradict each other: --resume continues the run, "
                "--overwrite deletes it; pass one"
            )


@dataclass(frozen=True)
class TrainingConfig:
    """Every component of a training run, built from the parsed flags in one place."""

    model: ModelConfig | None  # None: the stage takes the model of the checkpoint it starts from
    data: DataConfig
    horizon: HorizonConfig
    optim: OptimConfig
    loop: LoopConfig
    device: DeviceConfig
    run: RunConfig
    explicit: frozenset  # the flags given on the command line (not defaulted)

    @classmethod
    def from_args(cls, args, with_model: bool):
        explicit = cli.explicit_flags(args)
        for name, value in ARCH_PRESETS.get(getattr(args, "arch", ""), {}).items():
            if hasattr(args, name) and name not in explicit:
                setattr(args, name, value)
        parts = (DataConfig, HorizonConfig, OptimConfig, LoopConfig, DeviceConfig, RunConfig)  # in field order
        model = ModelConfig.from_args(args) if with_model else None
        return cls(model, *(part.from_args(args) for part in parts), explicit)

    def as_dict(self) -> dict:
        """Every setting, flat (meta.json's "args" and the report's table)."""
        parts = (self.model, self.data, self.horizon, self.optim, self.loop, self.device, self.run)
        return {k: v for part in parts if part is not None for k, v in asdict(part).items()}


def add_training_flags(parser, **defaults):
    """The flags every training stage shares, with this script's `defaults` by name (eval_every=150, ...)."""
    for cls in (OptimConfig, LoopConfig, DeviceConfig, RunConfig):
        mine = {k: defaults.pop(k) for k in list(defaults) if k in {f.name for f in fields(cls)}}
        cls.add_flags(parser, **mine)
    if defaults:
        raise TypeError(f"no training flags named {sorted(defaults)}")
