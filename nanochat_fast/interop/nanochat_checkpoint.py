"""
nanochat's checkpoint folder (<phase>_checkpoints/d<n_layer>: model_NNNNNN.pt, meta_NNNNNN.json,
optim_NNNNNN_rankR.pt), read and written. Its GPTs and ours have the same parameter names, so
converting is a matter of files: torch.compile's "_orig_mod." prefix dropped, fp32 tensors, the
vocabulary padding of its later versions (to a multiple of 64) cut on import and added back as zeros
on export; its optimizer files become our optimizer state. Anything else that differs stops the import.
"""

import json
import math
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
from ..optim import FORMAT

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
    origin = {"nanochat_checkpoint": str(ckpt.folder), "step": ckpt.step, "optimizer": optimizer}
    return loop_state, {**origin, "user_config": ckpt.meta.get("user_config")}


def export_paths(base_dir: Path, phase: str, n_layer: int, step: int) -> tuple[Path, Path]:
    """(model file, meta file) where nanochat's loaders look for a model of `phase` and depth `n_layer`."""
    folder = Path(base_dir) / FOLDER_OF_PHASE[phase] / f"d{n_layer}"
    return folder / MODEL_FILE.format(step), folder / META_FILE.format(step)


def write_checkpoint(model_path: Path, meta_path: Path, state: dict, config: GPTConfig, meta: dict, ckpt: Path):
    """Our checkpoint `ckpt` (meta.json `meta`) as nanochat's model and meta files, each replaced atomically:
    fp32 tensors as from nanochat's CPU run; the windowed GPT's vocab rows zero-padded for its strict loader."""
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


# nanochat's per-rank optimizer files (an [AdamW, Muon] pair of state_dicts, or since its 92d63d4 one MuonAdamW
# state_dict) as our world-size independent optimizer state (optim/zero.py): DistAdamW's moments concatenated
# over the rank files, Muon's momentum from its owner rank. Layouts: docs/measurements.md#nanochat-optimizer-state

ADAMW_NAMES = ["lm_head.weight", "transformer.wte.weight"]  # the AdamW groups of the pair, in order
CARRIED = ("lr", "initial_lr", "betas", "eps")  # hyperparameters that mean the same in both
KINDS = ("adamw", "muon")


def _fail(what: str):
    raise UserError(f"nanochat optimizer state: {what}; import without it with --no-optimizer")


def _hparams(group: dict) -> dict:
    return {k: list(v) if isinstance(v, (tuple, list)) else float(v) for k, v in group.items() if k in CARRIED}


def _tensor(entry: dict, key: str, name: str) -> torch.Tensor:
    t = entry.get(key)
    if not isinstance(t, torch.Tensor):
        _fail(f"{name} has no tensor {key!r}")
    return t.float()


def _rows_fitted(t: torch.Tensor, shape, name):
    """A state tensor of a vocab-sized parameter may carry nanochat's padded rows: dropped."""
    if tuple(t.shape) != tuple(shape) and t.dim() == 2 and t.shape[1] == shape[1] and t.shape[0] > shape[0]:
        t = t[: shape[0]]
    if tuple(t.shape) != tuple(shape):
        _fail(f"state of {name} has shape {list(t.shape)}, the parameter {list(shape)}")
    return t


def _adamw_entry(entries: list, shape, name: str, split: bool = True) -> dict:
    """One AdamW parameter's moments: rank r's rows from rank r's entry (`split`), else whole in each."""
    entry = {"shape": list(shape), "offset": 0}
    for key in ("exp_avg", "exp_avg_sq"):
        pieces = [_tensor(e, key, name) for e in entries]
        entry[key] = _rows_fitted(torch.cat(pieces) if split else pieces[0], shape, name).reshape(-1).contiguous()
    entry["numel"] = entry["exp_avg"].numel()
    return entry


def _muon_entry(momentum: torch.Tensor, second: torch.Tensor | None, shape, name: str) -> dict:
    entry = {"shape": list(shape), "offset": 0, "momentum_buffer": _rows_fitted(momentum, shape, name)}
    entry["numel"] = entry["momentum_buffer"].numel()
    if second is not None:  # NorMuon's
        entry["normuon_second_moment"] = second.contiguous()
    return entry


def _updates(entries: list) -> int:
    """AdamW's number of updates, from its state `entries`: nanochat counts per parameter, we per optimizer."""
    steps = {int(torch.as_tensor(e.get("step", 0)).item()) for e in entries}
    if len(steps) > 1:
        _fail(f"its AdamW parameters were updated different numbers of times ({sorted(steps)})")
    return steps.pop() if steps else 0


def _shards(groups: dict, state: dict, updates: int) -> list[dict]:
    """Our [AdamW, Muon] shards, as one process' whole state, from each kind's groups and state."""
    whole = {"format": FORMAT, "world_size": 1, "rank": 0}
    return [
        {**whole, "kind": k, "num_updates": updates if state[k] else 0, "param_groups": groups[k], "state": state[k]}
        for k in KINDS
    ]


def _muon_members(count: int, entries: dict, indices: list, matrices: list) -> list[str]:
    """The names of a Muon group's parameters: the matrices of its state's shape (DistMuon) or
    numel (Muon), whichever gives the group's count, in model order."""
    first = next((e[0] for i in indices if (e := entries.get(int(i)))), None)
    if first is None:
        _fail("a Muon group holds no state")
    shape = tuple(_tensor(first, "momentum_buffer", "a Muon parameter").shape)
    numel = shape[0] * shape[1] if len(shape) == 2 else -1
    for names in ([n for n, s in matrices if tuple(s) == shape], [n for n, s in matrices if s[0] * s[1] == numel]):
        if len(names) == count:
            return names
    _fail(f"a Muon group of {count} matrices of shape {list(shape)} matches none of the model's")


def pair_shards(files: list, optim_files: list, shapes: dict) -> list[dict]:
    """nanochat's [AdamW, Muon] pairs (rank order) -> our shards; `shapes`: our GPT's {name: shape}."""
    for data, path in zip(files, optim_files):
        if not (isinstance(data, (list, tuple)) and len(data) == 2 and all(_is_state_dict(d) for d in data)):
            _fail(f"{path} is not nanochat's [AdamW, Muon] pair of optimizer state_dicts")
    merged = ({}, {})  # per optimizer: {index: [entry from each rank file that has one]}
    for data in files:
        for which in (0, 1):
            for index, entry in data[which]["state"].items():
                merged[which].setdefault(int(index), []).append(entry)
    groups, state, counted = {kind: [] for kind in KINDS}, {kind: {} for kind in KINDS}, []
    adamw_groups = files[0][0]["param_groups"]
    if [len(g.get("params", [])) for g in adamw_groups] != [1, 1]:
        _fail("its AdamW does not have nanochat's two groups (lm_head, wte)")
    for g, name in zip(adamw_groups, ADAMW_NAMES):
        groups["adamw"].append({"param_names": [name], **_hparams(g)})
        if entries := merged[0].get(int(g["params"][0])):  # DistAdamW's row slices, in rank order
            state["adamw"][name] = _adamw_entry(entries, shapes[name], name)
            counted += entries
    updates = _updates(counted)
    if state["adamw"] and len(state["adamw"]) != len(ADAMW_NAMES):
        _fail(f"AdamW state for only {sorted(state['adamw'])} (load every optim_NNNNNN_rank*.pt of the checkpoint)")
    matrices = [(n, s) for n, s in shapes.items() if n not in ADAMW_NAMES]
    for g in files[0][1]["param_groups"]:
        indices = list(g.get("params", []))
        names = _muon_members(len(indices), merged[1], indices, matrices)
        groups["muon"].append({"param_names": names, **_hparams(g)})
        for index, name in zip(indices, names):
            if entries := merged[1].get(int(index)):
                e = entries[0]  # DistMuon: only the owner's file has it
                momentum = _tensor(e, "momentum_buffer", name)
                second = _tensor(e, "second_momentum_buffer", name) if "second_momentum_buffer" in e else None
                state["muon"][name] = _muon_entry(momentum, second, shapes[name], name)
    missing = sorted(n for n, _ in matrices if n not in state["muon"])
    if state["muon"] and missing:
        _fail(f"no Muon state for {missing[:3]} (load every optim_NNNNNN_rank*.pt of the checkpoint)")
    return _shards(groups, state, updates)


def _is_state_dict(d) -> bool:
    return isinstance(d, dict) and isinstance(d.get("state"), dict) and isinstance(d.get("param_groups"), list)


def combined_layout(config) -> list[tuple[str, list[str]]]:
    """(kind, parameter names) of each group of nanochat's MuonAdamW, in its setup_optimizer's order:
    the AdamW groups, then the block matrices grouped by shape (sorted), each in model order."""
    model = loading.meta_model(config)
    if hasattr(model, "optimizer_groups"):
        adam = [[name for name, _ in params] for _, params, *_ in model.optimizer_groups(1.0, 1.0, 1.0)]
    else:
        adam = [[name] for name in ADAMW_NAMES]
    matrices = list(model.transformer.h.named_parameters(prefix="transformer.h"))
    muon = [[n for n, p in matrices if p.shape == shape] for shape in sorted({p.shape for _, p in matrices})]
    return [("adamw", names) for names in adam] + [("muon", names) for names in muon]


def _is_combined(data) -> bool:
    groups = data.get("param_groups") if isinstance(data, dict) else None
    return isinstance(groups, list) and bool(groups) and all(isinstance(g, dict) and "kind" in g for g in groups)


def combined_shards(files: list, shapes: dict, config) -> list[dict]:
    """nanochat's per-rank MuonAdamW state_dicts (rank order) -> our shards. An AdamW parameter of
    1024 elements or more is split by rows over the ranks; a Muon group's state is (chunk, *shape)
    stacks under its first parameter, rank r's the matrices [r*chunk, (r+1)*chunk)."""
    layout = combined_layout(config)
    for data in files:
        got = [(g["kind"], len(g.get("params", []))) for g in data["param_groups"]]
        if got != [(kind, len(names)) for kind, names in layout]:
            _fail(f"its MuonAdamW groups {got} are not the ones this model's setup_optimizer builds")
    groups, state, counted = {kind: [] for kind in KINDS}, {kind: {} for kind in KINDS}, []
    for g, (kind, names) in enumerate(layout):
        group = files[0]["param_groups"][g]
        groups[kind].append({"param_names": names, **_hparams(group)})
        entries_of = [[data["state"].get(int(i), data["state"].get(i)) for data in files] for i in group["params"]]
        if kind == "adamw":
            for entries, name in zip(entries_of, names):
                if entries := [e for e in entries if e]:
                    shape = shapes[name]
                    rows = padded_vocab(shape[0]) if vocab_sized(name) else shape[0]
                    split = len(files) > 1 and rows * math.prod(shape[1:]) >= 1024
                    state[kind][name] = _adamw_entry(entries, shape, name, split)
                    counted += entries
        elif all(stacks := entries_of[0]):
            momentum = torch.cat([_tensor(e, "momentum_buffer", names[0]) for e in stacks])
            second = torch.cat([_tensor(e, "second_momentum_buffer", names[0]) for e in stacks])
            for i, name in enumerate(names):
                state[kind][name] = _muon_entry(momentum[i], second[i], shapes[name], name)
    return _shards(groups, state, _updates(counted))


def optimizer_shards(ckpt: NanochatCheckpoint, shapes: dict, skip: bool) -> tuple[list, str]:
    """Our shards for a nanochat checkpoint (its files converted, else fresh state) and the line saying which."""
    if ckpt.optim_files and not skip:
        files = [load_pt(p) for p in ckpt.optim_files]
        if all(_is_combined(d) for d in files):
            shards = combined_shards(files, shapes, ckpt.config)
        else:
            shards = pair_shards(files, ckpt.optim_files, shapes)
        return shards, (
            f"optimizer state: imported from {len(ckpt.optim_files)} file(s) (AdamW after "
            f"{shards[0]['num_updates']} updates, Muon momentum of {len(shards[1]['state'])} matrices)"
        )
    why = "--no-optimizer" if skip else f"no optim_{ckpt.step:06d}_rank*.pt in {ckpt.folder}"
    return fresh_optimizer_shards(ckpt.config), (
        f"optimizer state: none ({why}); training from this run starts with fresh optimizer state"
    )


def fresh_optimizer_shards(config: GPTConfig) -> list:
    """Our optimizer state before any update, every parameter in its group: a run without saved state."""
    layout = combined_layout(config)
    groups = {kind: [{"param_names": names} for k, names in layout if k == kind] for kind in KINDS}
    return _shards(groups, {kind: {} for kind in KINDS}, 0)
