"""
nanochat's per-rank optimizer files as our world-size independent optimizer state (optim/zero.py):
its [AdamW, Muon] pair of torch.optim state_dicts, or (since its 92d63d4) one combined MuonAdamW
state_dict. DistAdamW's moments are concatenated over the rank files; Muon's momentum comes from
the rank that owned the matrix. The layouts: docs/measurements.md#nanochat-optimizer-state
"""

import math

import torch

from ..core.errors import UserError
from ..model import loading
from ..optim import FORMAT
from .nanochat_checkpoint import NanochatCheckpoint, load_pt, padded_vocab, vocab_sized

ADAMW_NAMES = ["lm_head.weight", "transformer.wte.weight"]  # the AdamW groups of the pair, in order
CARRIED = ("lr", "initial_lr", "betas", "eps")  # hyperparameters that mean the same in both
KINDS = ("adamw", "muon")


def _fail(what: str):
    raise UserError(f"nanochat optimizer state: {what}; import without it with --no-optimizer")


def _hparams(group: dict) -> dict:
    return {
        k: list(group[k]) if isinstance(group[k], (tuple, list)) else float(group[k]) for k in CARRIED if k in group
    }


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
    return [
        {
            "format": FORMAT,
            "kind": kind,
            "world_size": 1,
            "rank": 0,
            "num_updates": updates if state[kind] else 0,
            "param_groups": groups[kind],
            "state": state[kind],
        }
        for kind in KINDS
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
    layout = combined_layout(ckpt.config)  # fresh state: no update yet, every parameter in a group
    groups = {kind: [{"param_names": names} for k, names in layout if k == kind] for kind in KINDS}
    empty = _shards(groups, {kind: {} for kind in KINDS}, 0)
    return empty, f"optimizer state: none ({why}); training from this run starts with fresh optimizer state"
