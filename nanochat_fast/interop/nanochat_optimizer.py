"""
nanochat's optimizer state (optim_NNNNNN_rankR.pt) in our world-size independent format (optim/zero.py).

Its seeds-era files hold [AdamW state_dict, Muon state_dict] per rank (torch.optim's format: state keyed by
an integer index in the order the groups were built, so a group's parameters are found by the size of the
state they hold and their count); its later versions (92d63d4) hold one combined MuonAdamW state_dict per
rank, groups marked "adamw" or "muon" (combined_layout), a Muon group's state stacked in chunks of which
rank r holds its share (combined_shards). DistAdamW's moments are concatenated over the rank files; Muon's
momentum comes from the rank that owned the matrix. The layouts, field by field:
docs/measurements.md#nanochat-optimizer-state.
"""

import math

import torch

from ..core.errors import UserError
from ..optim import FORMAT
from .nanochat_checkpoint import VOCAB_PAD, NanochatCheckpoint, load_pt, vocab_sized

ADAMW_NAMES = ["lm_head.weight", "transformer.wte.weight"]  # nanochat's AdamW groups, in order
CARRIED = ("lr", "initial_lr", "betas", "eps")  # hyperparameters that mean the same in both


def _fail(what: str):
    raise UserError(f"nanochat optimizer state: {what}; import without it with --no-optimizer")


def _pair(data, path):
    ok = (
        isinstance(data, (list, tuple))
        and len(data) == 2
        and all(
            isinstance(d, dict) and isinstance(d.get("state"), dict) and isinstance(d.get("param_groups"), list)
            for d in data
        )
    )
    if not ok:
        _fail(f"{path} is not nanochat's [AdamW, Muon] pair of optimizer state_dicts")
    return data


def _merged_state(files: list, which: int) -> dict:
    """{index: [entry from each rank file that has one]} for optimizer `which` (0 AdamW, 1 Muon)."""
    merged = {}
    for data in files:
        for index, entry in data[which]["state"].items():
            merged.setdefault(int(index), []).append(entry)
    return merged


def _hparams(group: dict) -> dict:
    out = {}
    for key in CARRIED:
        if key in group:
            value = group[key]
            out[key] = list(value) if isinstance(value, (tuple, list)) else float(value)
    return out


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


def adamw_shard(files: list, shapes: dict) -> dict:
    groups = files[0][0]["param_groups"]
    if [len(g.get("params", [])) for g in groups] != [1, 1]:
        _fail("its AdamW does not have nanochat's two groups (lm_head, wte)")
    merged = _merged_state(files, 0)
    state, steps = {}, set()
    for g, name in zip(groups, ADAMW_NAMES):
        entries = merged.get(int(g["params"][0]), [])
        if not entries:
            continue
        entry = {"shape": list(shapes[name]), "offset": 0, "numel": 0}
        for key in ("exp_avg", "exp_avg_sq"):
            # one piece per rank file (DistAdamW's row slices, in rank order) or one whole tensor
            t = torch.cat([_tensor(e, key, name) for e in entries], dim=0)
            entry[key] = _rows_fitted(t, shapes[name], name).reshape(-1).contiguous()
        entry["numel"] = entry["exp_avg"].numel()
        state[name] = entry
        steps |= {int(torch.as_tensor(e.get("step", 0)).item()) for e in entries}
    if len(steps) > 1:
        _fail(f"its AdamW parameters were updated different numbers of times ({sorted(steps)})")
    if state and len(state) != len(ADAMW_NAMES):
        _fail(f"AdamW state for only {sorted(state)} (load every optim_NNNNNN_rank*.pt of the checkpoint)")
    return {
        "format": FORMAT,
        "kind": "adamw",
        "world_size": 1,
        "rank": 0,
        "num_updates": steps.pop() if steps else 0,
        "param_groups": [{"param_names": [n], **_hparams(g)} for g, n in zip(groups, ADAMW_NAMES)],
        "state": state,
    }


def _muon_members(count: int, entries: dict, indices: list, matrices: list) -> list[str]:
    """The names of a Muon group's parameters: the matrices of its state's shape (DistMuon) or
    numel (Muon), whichever gives the group's count, in model order."""
    shape = next(
        (
            tuple(_tensor(e[0], "momentum_buffer", "a Muon parameter").shape)
            for i in indices
            if (e := entries.get(int(i)))
        ),
        None,
    )
    if shape is None:
        _fail("a Muon group holds no state")
    numel = shape[0] * shape[1] if len(shape) == 2 else -1
    by_shape = [n for n, s in matrices if tuple(s) == shape]
    by_numel = [n for n, s in matrices if s[0] * s[1] == numel]
    for names in (by_shape, by_numel):
        if len(names) == count:
            return names
    _fail(f"a Muon group of {count} matrices of shape {list(shape)} matches none of the model's")


def muon_shard(files: list, shapes: dict, num_updates: int) -> dict:
    matrices = [(n, s) for n, s in shapes.items() if n not in ADAMW_NAMES]
    merged = _merged_state(files, 1)
    state, groups = {}, []
    for g in files[0][1]["param_groups"]:
        indices = list(g.get("params", []))
        names = _muon_members(len(indices), merged, indices, matrices)
        groups.append({"param_names": names, **_hparams(g)})
        for index, name in zip(indices, names):
            entries = merged.get(int(index), [])
            if not entries:
                continue
            e = entries[0]  # DistMuon: only the owner's file has it
            entry = {
                "shape": list(shapes[name]),
                "offset": 0,
                "numel": 0,
                "momentum_buffer": _rows_fitted(_tensor(e, "momentum_buffer", name), shapes[name], name),
            }
            entry["numel"] = entry["momentum_buffer"].numel()
            if "second_momentum_buffer" in e:
                entry["normuon_second_moment"] = _tensor(e, "second_momentum_buffer", name)
            state[name] = entry
    missing = sorted(n for n, _ in matrices if n not in state)
    if state and missing:
        _fail(f"no Muon state for {missing[:3]} (load every optim_NNNNNN_rank*.pt of the checkpoint)")
    return {
        "format": FORMAT,
        "kind": "muon",
        "world_size": 1,
        "rank": 0,
        "num_updates": num_updates if state else 0,
        "param_groups": groups,
        "state": state,
    }


def convert(files: list, shapes: dict, paths: list) -> list[dict]:
    """nanochat's per-rank optimizer files (loaded, rank order) -> our [AdamW, Muon] shards.
    `shapes`: our GPT's {parameter name: shape}."""
    files = [_pair(d, p) for d, p in zip(files, paths)]
    adamw = adamw_shard(files, shapes)
    return [adamw, muon_shard(files, shapes, adamw["num_updates"])]


def empty_shards(shapes: dict, config=None) -> list[dict]:
    """Fresh optimizer state (no update yet) in our format: what a checkpoint without optim files gets."""
    if config is not None and hasattr(config, "window_pattern"):
        layout = combined_layout(config)
        return [
            {
                "format": FORMAT,
                "kind": kind,
                "world_size": 1,
                "rank": 0,
                "num_updates": 0,
                "param_groups": [{"param_names": names} for k, names in layout if k == kind],
                "state": {},
            }
            for kind in ("adamw", "muon")
        ]
    matrices = [n for n in shapes if n not in ADAMW_NAMES]
    return [
        {
            "format": FORMAT,
            "kind": kind,
            "world_size": 1,
            "rank": 0,
            "num_updates": 0,
            "param_groups": [{"param_names": names}],
            "state": {},
        }
        for kind, names in (("adamw", ADAMW_NAMES), ("muon", matrices))
    ]


def combined_layout(config) -> list[tuple[str, list[str]]]:
    """(kind, parameter names) of each group of nanochat's MuonAdamW, in its setup_optimizer's order:
    the AdamW groups, then the block matrices grouped by shape (sorted), each in model order."""
    from ..model import loading

    with torch.device("meta"):
        model = loading.model_class(config)(config)
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


def _adamw_entry(entries: list, shape, name: str, world_size: int) -> dict:
    """One AdamW parameter's moments from every rank's entry: whole (one process, or a parameter
    of under 1024 elements, which every rank updates whole), else rank r's rows, concatenated."""
    rows = -(-shape[0] // VOCAB_PAD) * VOCAB_PAD if vocab_sized(name) else shape[0]
    split = world_size > 1 and rows * math.prod(shape[1:]) >= 1024
    entry = {"shape": list(shape), "offset": 0}
    for key in ("exp_avg", "exp_avg_sq"):
        pieces = [_tensor(e, key, name) for e in entries]
        t = torch.cat(pieces, dim=0) if split else pieces[0]
        entry[key] = _rows_fitted(t, shape, name).reshape(-1).contiguous()
    entry["numel"] = entry["exp_avg"].numel()
    return entry


def combined_shards(files: list, shapes: dict, config) -> list[dict]:
    """nanochat's per-rank MuonAdamW state_dicts (rank order) -> our [AdamW, Muon] shards."""
    layout, W = combined_layout(config), len(files)
    for data in files:
        got = [(g["kind"], len(g.get("params", []))) for g in data["param_groups"]]
        if got != [(kind, len(names)) for kind, names in layout]:
            _fail(f"its MuonAdamW groups {got} are not the ones this model's setup_optimizer builds")
    out = {kind: dict(groups=[], state={}) for kind in ("adamw", "muon")}
    steps = set()
    for g, (kind, names) in enumerate(layout):
        group = files[0]["param_groups"][g]
        out[kind]["groups"].append({"param_names": names, **_hparams(group)})
        if kind == "adamw":
            for index, name in zip(group["params"], names):
                entries = [e for data in files if (e := data["state"].get(int(index), data["state"].get(index)))]
                if entries:
                    out[kind]["state"][name] = _adamw_entry(entries, shapes[name], name, W)
                    steps |= {int(torch.as_tensor(e.get("step", 0)).item()) for e in entries}
            continue
        first = group["params"][0]
        stacks = [data["state"].get(int(first), data["state"].get(first)) for data in files]
        if not all(stacks):
            continue
        momentum = torch.cat([_tensor(e, "momentum_buffer", names[0]) for e in stacks])
        second = torch.cat([_tensor(e, "second_momentum_buffer", names[0]) for e in stacks])
        for i, name in enumerate(names):
            out[kind]["state"][name] = {
                "shape": list(shapes[name]),
                "offset": 0,
                "numel": momentum[i].numel(),
                "momentum_buffer": _rows_fitted(momentum[i], shapes[name], name),
                "normuon_second_moment": second[i].contiguous(),
            }
    if len(steps) > 1:
        _fail(f"its AdamW parameters were updated different numbers of times ({sorted(steps)})")
    updates = steps.pop() if steps else 0
    return [
        {
            "format": FORMAT,
            "kind": kind,
            "world_size": 1,
            "rank": 0,
            "num_updates": updates if out[kind]["state"] else 0,
            "param_groups": out[kind]["groups"],
            "state": out[kind]["state"],
        }
        for kind in ("adamw", "muon")
    ]


def optimizer_shards(ckpt: NanochatCheckpoint, shapes: dict, skip: bool) -> tuple[list, str]:
    """Our optimizer shards for a nanochat checkpoint (its optimizer files converted, else fresh
    state), and the line saying what became of nanochat's optimizer state."""
    if ckpt.optim_files and not skip:
        files = [load_pt(p) for p in ckpt.optim_files]
        if all(_is_combined(d) for d in files):
            shards = combined_shards(files, shapes, ckpt.config)
        else:
            shards = convert(files, shapes, ckpt.optim_files)
        return shards, (
            f"optimizer state: imported from {len(ckpt.optim_files)} file(s) (AdamW after "
            f"{shards[0]['num_updates']} updates, Muon momentum of {len(shards[1]['state'])} matrices)"
        )
    why = "--no-optimizer" if skip else f"no optim_{ckpt.step:06d}_rank*.pt in {ckpt.folder}"
    return empty_shards(
        shapes, ckpt.config
    ), f"optimizer state: none ({why}); training from this run starts with fresh optimizer state"
