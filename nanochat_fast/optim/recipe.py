"""
MuonRecipe: how Muon updates the matrices, one validated value, with presets a run names in one word
(and overrides any part of): quintic (the library's default: 5 quintic Newton-Schulz steps, momentum
warmed up 0.85 -> 0.95 over 300 steps, no weight decay), minimax4 (quintic with 4 tuned steps: the same
band, 4/5 of the products; base_train's for the gpt family) and polar-normuon (nanochat's today). Their former
names, seeds and current, work for one more release with a notice. ns_dtype follows the hardware.
"""

import dataclasses
import math
import sys
from dataclasses import dataclass

from ..core.distributed import print0
from ..hardware.precision import CHOICES
from ..kernels.newton_schulz import SCHEDULES, resolve_coefficients
from .zero import check_choice, check_hparam

PRESET_NAMES = ("quintic", "polar-normuon", "minimax4")
# the presets' names before they were named for what they are: accepted until the next release
RENAMED = {"seeds": "quintic", "current": "polar-normuon"}
WEIGHT_DECAY_SCHEDULES = ("constant", "cosine")
# the fields Muon takes as they are (normuon_beta only with normuon)
MUON_FIELDS = ("momentum", "ns_steps", "ns_coefficients", "ns_dtype", "weight_decay", "cautious_weight_decay")
MUON_FIELDS += ("equilibrate_rows", "renormalize", "ns_safety", "ns_eps")
_noticed = set()  # the former names this process has printed its notice for


def preset_name(name):
    """`name`, or the new name of a preset's former name (whose first use in a process prints one
    notice line to stderr on rank 0, so a run's log says it once)."""
    new = RENAMED.get(name) if isinstance(name, str) else None
    if new is None:
        return name
    if name not in _noticed:
        _noticed.add(name)
        print0(
            f"note: the muon recipe {name!r} is now called {new!r} (--muon-recipe={new}); "
            f"{name!r} will stop working in the next release",
            file=sys.stderr,
        )
    return new


@dataclass(frozen=True)
class MuonRecipe:
    name: str = "quintic"  # the preset it started from (logs and reports)
    ns_coefficients: object = "quintic"  # "quintic" | "polar_express" | "minimax4" | ((a, b, c), ...) per step
    ns_steps: int = 5
    ns_dtype: str = "auto"  # "auto" | "fp32" | "bf16"
    ns_safety: float = 1.0  # Newton-Schulz's input divided by this times its norm, plus ns_eps
    ns_eps: float = 1e-7
    normuon: bool = False
    normuon_beta: float = 0.9
    cautious_weight_decay: bool = False
    weight_decay: float = 0.0
    weight_decay_schedule: str = "constant"  # "constant" | "cosine" (to zero at the last step)
    equilibrate_rows: bool = False  # MuonEq
    renormalize: bool = False  # Muon+
    momentum_start: float = 0.85
    momentum: float = 0.95  # after the warmup
    momentum_warmup_steps: int = 300
    momentum_end: float = 0.95  # at the end of the warmdown
    momentum_warmdown_ratio: float = 0.0  # fraction of the run over which it goes momentum -> momentum_end

    def __post_init__(self):
        object.__setattr__(self, "name", preset_name(self.name))
        check_choice("name", self.name, PRESET_NAMES)
        _check_int("ns_steps", self.ns_steps, 1)
        _check_int("momentum_warmup_steps", self.momentum_warmup_steps, 0)
        try:
            resolve_coefficients(self.ns_coefficients, self.ns_steps)
        except ValueError as e:
            raise ValueError(f"ns_coefficients: {e}") from None
        if not isinstance(self.ns_coefficients, str):  # hashable and JSON-friendly
            object.__setattr__(self, "ns_coefficients", tuple(tuple(map(float, abc)) for abc in self.ns_coefficients))
        check_choice("ns_dtype", self.ns_dtype, CHOICES)
        check_choice("weight_decay_schedule", self.weight_decay_schedule, WEIGHT_DECAY_SCHEDULES)
        for field in ("normuon", "cautious_weight_decay", "equilibrate_rows", "renormalize"):
            if not isinstance(getattr(self, field), bool):
                raise ValueError(f"{field} must be True or False, got {getattr(self, field)!r}")
        check_hparam("weight_decay", self.weight_decay)
        check_hparam("ns_safety", self.ns_safety, 1.0)
        check_hparam("ns_eps", self.ns_eps)
        for field in ("normuon_beta", "momentum_start", "momentum", "momentum_end"):
            check_hparam(field, getattr(self, field), 0.0, 1.0)
        check_hparam("momentum_warmdown_ratio", self.momentum_warmdown_ratio, 0.0, 1.0, high_inclusive=True)

    @classmethod
    def preset(cls, name: str, **overrides) -> "MuonRecipe":
        """The preset `name` ("quintic" | "polar-normuon" | "minimax4") with some fields replaced."""
        name = preset_name(name)
        check_choice("muon recipe", name, PRESET_NAMES)
        unknown = set(overrides) - {f.name for f in dataclasses.fields(cls) if f.name != "name"}
        if unknown:
            raise ValueError(f"{sorted(unknown)[0]} is not a MuonRecipe field that can be overridden")
        return dataclasses.replace(PRESETS[name], **overrides)

    @classmethod
    def of(cls, recipe) -> "MuonRecipe":
        """A MuonRecipe from a recipe or a preset name."""
        return recipe if isinstance(recipe, cls) else cls.preset(recipe)

    def momentum_at(self, step: int, num_iterations: int | None = None) -> float:
        """Muon momentum at `step` (0-based) of a run of `num_iterations` steps (None: no warmdown)."""
        if step < self.momentum_warmup_steps:
            frac = step / self.momentum_warmup_steps
            return (1 - frac) * self.momentum_start + frac * self.momentum
        warmdown = round(self.momentum_warmdown_ratio * num_iterations) if num_iterations else 0
        if warmdown > 0 and step >= num_iterations - warmdown:
            progress = min((step - (num_iterations - warmdown)) / warmdown, 1.0)
            return (1 - progress) * self.momentum + progress * self.momentum_end
        return self.momentum

    def weight_decay_at(self, step: int, num_iterations: int | None = None) -> float:
        """Muon weight decay at `step`: constant, or cosine from weight_decay to 0 at num_iterations."""
        if self.weight_decay_schedule == "constant" or not num_iterations:
            return self.weight_decay
        return self.weight_decay * 0.5 * (1 + math.cos(math.pi * min(step / num_iterations, 1.0)))

    def scaled_weight_decay(
        self, total_batch_size: int, tokens: int, reference_tokens: int, reference_batch_size: int = 2**19
    ) -> "MuonRecipe":
        """nanochat's scaling of the weight decay (tuned at d12, D_ref = reference_tokens) to another batch
        size and horizon: B / (lr * wd * D) kept constant with lr ~ sqrt(B), so wd * sqrt(B / B_ref) * D_ref / D."""
        check_hparam("total_batch_size", total_batch_size, 1.0)
        check_hparam("tokens", tokens, 1.0)
        check_hparam("reference_tokens", reference_tokens, 1.0)
        check_hparam("reference_batch_size", reference_batch_size, 1.0)
        wd = self.weight_decay * math.sqrt(total_batch_size / reference_batch_size) * (reference_tokens / tokens)
        return dataclasses.replace(self, weight_decay=wd)

    def muon_kwargs(self) -> dict:
        """Muon's keyword arguments but lr (the momentum: the post-warmup one until Muon.schedule sets it)."""
        kwargs = {name: getattr(self, name) for name in MUON_FIELDS}
        return dict(kwargs, nesterov=True, normuon_beta=self.normuon_beta if self.normuon else None)

    def describe(self) -> str:
        parts = [describe_schedule(self.ns_coefficients, self.ns_steps), f"ns-dtype {self.ns_dtype}"]
        if self.equilibrate_rows:
            parts.append("MuonEq")
        if self.renormalize:
            parts.append("Muon+")
        if self.normuon:
            parts.append(f"NorMuon beta {self.normuon_beta:g}")
        if self.weight_decay > 0:
            kind = "cautious " if self.cautious_weight_decay else ""
            parts.append(f"{kind}wd {self.weight_decay:g} ({self.weight_decay_schedule})")
        momentum = f"momentum {self.momentum_start:g}->{self.momentum:g} over {self.momentum_warmup_steps} steps"
        if self.momentum_warmdown_ratio > 0:
            momentum += f", ->{self.momentum_end:g} over the last {self.momentum_warmdown_ratio:.0%}"
        return f"muon recipe {self.name}: " + ", ".join(parts + [momentum])


def describe_schedule(coefficients, steps: int) -> str:
    """A Newton-Schulz schedule as the logs name it: "minimax4 x4", "custom x3"."""
    return f"{coefficients if isinstance(coefficients, str) else 'custom'} x{steps}"


def _check_int(field, value, low):
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{field} must be an int >= {low}, got {value!r}")


# The presets. polar-normuon is the recipe nanochat trains with (its optim.py and base_train.py; each part
# is defined in muon.py; NorMuon: arXiv:2510.05491): its weight decay is scaled with batch size and horizon
# by scaled_weight_decay, its momentum warmdown spans nanochat's LR warmdown (0.65 of the run).
PRESETS = {"quintic": MuonRecipe()}
PRESETS["minimax4"] = MuonRecipe(name="minimax4", ns_coefficients="minimax4", ns_steps=SCHEDULES["minimax4"])
PRESETS["polar-normuon"] = MuonRecipe(
    name="polar-normuon",
    ns_coefficients="polar_express",
    ns_safety=1.01,
    ns_eps=1e-6,
    normuon=True,
    normuon_beta=0.9,
    cautious_weight_decay=True,
    weight_decay=0.28,
    weight_decay_schedule="cosine",
    equilibrate_rows=True,
    renormalize=True,
    momentum_start=0.85,
    momentum=0.97,
    momentum_warmup_steps=400,
    momentum_end=0.90,
    momentum_warmdown_ratio=0.65,
)
