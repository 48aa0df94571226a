"""
nanochat's checkpoint folder (<phase>_checkpoints/d<n_layer>: model_NNNNNN.pt, meta_NNNNNN.json,
optim_NNNNNN_rankR.pt), read and written. Its GPTs and ours have the same parameter names, so
converting is a matter of files: torch.compile's "_orig_mod." prefix dropped, fp32 tensors, the
vocabulary padding of its later versions (to a multiple of 64) cut on import and added back as zeros
on export. Anything else that differs from the model_config stops the import with one line.
"""

import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .. import checkpoints
from ..core import paths
from ..core.errors import UserError
from ..model import loading
from ..model.gpt import GPTConfig
from ..model.windowed_gpt import WindowedGPTConfig

MODEL_FILE, META_FILE, OPTIM_FILE = "model_{:06d}.pt", "meta_{:06d}.json", "optim_{:06d}_rank{}.pt"
FOLDER_FILES = "model_*.pt, meta_*.json"  # what a checkpoint folder holds, for the import's --help
VOCAB_PAD = 64  # nanochat pads wte and lm_head rows to a multiple of this
# the checkpoint folders of nanochat's stages, and which of our phases each one is (RL'd models chat like SFT ones)
FOLDER_OF_PHASE = {"base": "base_checkpoints", "mid": "mid_checkpoints", "sft": "chatsft_checkpoints"}
PHASE_OF_FOLDER = {folder: phase for phase, folder in FOLDER_OF_PHASE.items()} | {"chatrl_checkpoints": "sft"}


@dataclass
class NanochatCheckpoint:
    folder: Path
    step: int
    meta: dict
    config: GPTConfig
    optim_files: list[Path]  # optim_NNNNNN_rank0.pt, rank1, ... (empty: none saved)
    phase: str  # ours, from the name of its stage's folder (default: base)


def load_pt(path: Path):
    try:
        return checkpoints.read_tensors(path)
    except Exception as e:
        raise UserError(
            f"{path} cannot be read as plain tensors ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
        ) from None


def open_checkpoint(folder, step: int | None) -> NanochatCheckpoint:
    """The checkpoint at `step` (None: the newest) of a nanochat folder, meta read and model_config checked."""
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        raise UserError(
            f"--from {folder}: no such folder (give nanochat's checkpoint folder, e.g. "
            "~/.cache/nanochat/base_checkpoints/d20)"
        )
    steps = sorted(int(m[1]) for p in folder.glob("meta_*.json") if (m := re.fullmatch(r"meta_(\d+)\.json", p.name)))
    if not steps:
        raise UserError(
            f"--from {folder}: no meta_*.json there; this is not a nanochat checkpoint folder "
            "(it holds model_NNNNNN.pt and meta_NNNNNN.json)"
        )
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise UserError(f"--step {step}: {folder} has no checkpoint at that step (steps: {', '.join(map(str, steps))})")
    meta_path = folder / META_FILE.format(step)
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{meta_path} is not readable JSON ({e})") from None
    if not (folder / MODEL_FILE.format(step)).is_file():
        raise UserError(f"{folder / MODEL_FILE.format(step)} is missing: the checkpoint at step {step} is incomplete")
    config = config_of(meta, meta_path)
    optim_files = []
    while (folder / OPTIM_FILE.format(step, len(optim_files))).is_file():
        optim_files.append(folder / OPTIM_FILE.format(step, len(optim_files)))
    return NanochatCheckpoint(folder, step, meta, config, optim_files, PHASE_OF_FOLDER.get(folder.parent.name, "base"))


def config_of(meta: dict, meta_path: Path) -> GPTConfig:
    """The model config of a meta's model_config: the windowed GPT's when its window_pattern has
    short windows; one of only long windows is the gpt family's until the weights say otherwise."""
    mc = meta.get("model_config") if isinstance(meta, dict) else None
    if not isinstance(mc, dict):
        raise UserError(f"{meta_path} has no model_config; it was not written by nanochat's training scripts")
    mc = dict(mc)
    window = mc.get("window_pattern", "L")
    if isinstance(window, str) and set(window) == {"L"}:
        mc.pop("window_pattern", None)
    cls = WindowedGPTConfig if "window_pattern" in mc else GPTConfig
    names = set(asdict(cls()))
    if set(mc) != names:
        extra, missing = sorted(set(mc) - names), sorted(names - set(mc))
        raise UserError(
            f"{meta_path}: model_config has keys {extra} our GPT lacks / lacks {missing}; this nanochat "
            "model is not one nanochat_fast runs"
        )
    try:
        return cls(**mc)
    except ValueError as e:
        raise UserError(f"{meta_path}: model_config is not a valid GPT ({e})") from None


def vocab_sized(name: str) -> bool:
    """The tensors with a row per token, which nanochat pads."""
    return name in ("transformer.wte.weight", "lm_head.weight") or name.startswith("value_embeds.")


def padded_vocab(vocab_size: int) -> int:
    return -(-vocab_size // VOCAB_PAD) * VOCAB_PAD


def model_state(ckpt: NanochatCheckpoint) -> dict[str, torch.Tensor]:
    """The checkpoint's weights as our GPT's fp32 state_dict, each checked against the model_config."""
    path = ckpt.folder / MODEL_FILE.format(ckpt.step)
    raw = load_pt(path)
    if not isinstance(raw, dict):
        raise UserError(f"{path} holds a {type(raw).__name__}, not a state_dict")
    raw = {str(k).removeprefix("_orig_mod."): v for k, v in raw.items()}
    if type(ckpt.config) is GPTConfig and "resid_lambdas" in raw:  # the windowed GPT, all windows long
        ckpt.config = WindowedGPTConfig(**asdict(ckpt.config), window_pattern="L")
    want = {k: tuple(v.shape) for k, v in loading.meta_model(ckpt.config).state_dict().items()}
    missing, extra = sorted(set(want) - set(raw)), sorted(set(raw) - set(want))
    if missing or extra:
        raise UserError(
            f"{path} does not hold the GPT of its model_config: missing {missing[:3]}, unexpected "
            f"{extra[:3]} (a nanochat model with other parameters cannot run here)"
        )
    state = {}
    for name, shape in want.items():
        t = raw[name]
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise UserError(f"{path}: {name} is not a floating-point tensor")
        got = tuple(t.shape)
        if got != shape and vocab_sized(name) and got[1:] == shape[1:] and got[0] == padded_vocab(shape[0]):
            t = t[: shape[0]]  # nanochat's vocab padding
        elif got != shape:
            raise UserError(
                f"{path}: {name} has shape {list(got)} but model_config {asdict(ckpt.config)} gives "
                f"{list(shape)}; the meta does not describe these weights"
            )
        state[name] = t.float().contiguous()
    return state


def meta_summary(ckpt: NanochatCheckpoint) -> str:
    """What the import shows: step, config and val bpb."""
    bpb = ckpt.meta.get("val_bpb")
    bpb_text = f"{bpb:.4f}" if isinstance(bpb, (int, float)) else "n/a (not in the meta)"
    cfg = ", ".join(f"{k}={v}" for k, v in asdict(ckpt.config).items())
    return f"nanochat checkpoint {ckpt.folder} step {ckpt.step}: {cfg}; val bpb {bpb_text}"


def carried_meta(ckpt: NanochatCheckpoint, optimizer: bool) -> tuple[dict, dict]:
    """What nanochat's meta says of the loop, as fields of our LoopState (train/run_state.py), and
    where the run came from (our meta.json's "imported_from")."""
    loop = ckpt.meta.get("loop_state") if isinstance(ckpt.meta.get("loop_state"), dict) else {}
    bpb = ckpt.meta.get("val_bpb")
    bpb = float(bpb) if isinstance(bpb, (int, float)) else None
    loop_state = {
        "step": ckpt.step,
        "smooth_loss": float(loop.get("smooth_train_loss", 0.0) or 0.0),
        "train_time": float(loop.get("total_training_time", 0.0) or 0.0),
        "first_val_bpb": bpb,
        "last_val_bpb": bpb,
    }
    origin = {
        "nanochat_checkpoint": str(ckpt.folder),
        "step": ckpt.step,
        "optimizer": optimizer,
        "user_config": ckpt.meta.get("user_config"),
    }
    return loop_state, origin


def export_paths(base_dir: Path, phase: str, n_layer: int, step: int) -> tuple[Path, Path]:
    """(model file, meta file) where nanochat's loaders look for a model of `phase` and depth `n_layer`."""
    folder = Path(base_dir) / FOLDER_OF_PHASE[phase] / f"d{n_layer}"
    return folder / MODEL_FILE.format(step), folder / META_FILE.format(step)


def write_checkpoint(model_path: Path, meta_path: Path, state: dict, config: GPTConfig, meta: dict, ckpt: Path):
    """Our checkpoint `ckpt` (meta.json `meta`) as nanochat's model and meta files, each replaced
    atomically: the same names, fp32 tensors (what nanochat writes from a CPU run); the windowed
    GPT's vocabulary rows padded with zeros as its strict loader expects, the gpt family's not."""
    out = {k: v.detach().float().cpu().contiguous() for k, v in state.items()}
    if isinstance(config, WindowedGPTConfig):
        for k in [k for k in out if vocab_sized(k)]:
            pad = out[k].new_zeros(padded_vocab(config.vocab_size) - out[k].size(0), out[k].size(1))
            out[k] = torch.cat([out[k], pad])
    loop = meta.get("loop_state", {})
    model_path.parent.mkdir(parents=True, exist_ok=True)
    checkpoints.write_tensors(model_path, out)
    paths.write_json(
        meta_path,
        {
            "step": meta["step"],
            "val_bpb": loop.get("last_val_bpb"),
            "model_config": asdict(config),
            "user_config": {**meta.get("args", {}), "exported_from": str(ckpt)},
            "loop_state": {
                "min_val_bpb": loop.get("last_val_bpb"),
                "smooth_train_loss": loop.get("smooth_loss"),
                "total_training_time": loop.get("train_time"),
            },
        },
    )
