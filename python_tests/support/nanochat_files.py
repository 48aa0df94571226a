"""nanochat's files for the interop tests, written the way nanochat writes them (its
checkpoint_manager.save_checkpoint, tokenizer.save and tok_train): a pickled tiktoken encoding,
token_bytes.pt, model_NNNNNN.pt (its GPT's state_dict; wte in bf16 as a CUDA run leaves it, the
vocabulary padded to a multiple of 64 as its later versions do), meta_NNNNNN.json and
optim_NNNNNN_rankR.pt ([AdamW, Muon] state_dicts: torch.optim.AdamW + Muon in one process, or
DistAdamW + DistMuon shards over several ranks)."""

import json
import pickle
from pathlib import Path

import tiktoken
import torch

NANO_SPECIALS = [
    "<|bos|>",
    "<|user_start|>",
    "<|user_end|>",
    "<|assistant_start|>",
    "<|assistant_end|>",
    "<|python_start|>",
    "<|python_end|>",
    "<|output_start|>",
    "<|output_end|>",
]


def write_tokenizer(folder: Path, ranks: dict, pattern: str) -> tiktoken.Encoding:
    folder.mkdir(parents=True, exist_ok=True)
    offset = len(ranks)
    enc = tiktoken.Encoding(
        name="rustbpe",
        pat_str=pattern,
        mergeable_ranks=ranks,
        special_tokens={name: offset + i for i, name in enumerate(NANO_SPECIALS)},
    )
    with open(folder / "tokenizer.pkl", "wb") as f:
        pickle.dump(enc, f)
    token_bytes = [0 if i >= offset else len(enc.decode_single_token_bytes(i)) for i in range(enc.n_vocab)]
    torch.save(torch.tensor(token_bytes, dtype=torch.int32), folder / "token_bytes.pt")
    return enc


def gpt_shapes(cfg: dict, padded_vocab: int) -> dict:
    """nanochat GPT's state_dict names and shapes (the same as ours)."""
    d, hd = cfg["n_embd"], cfg["n_embd"] // cfg["n_head"]
    shapes = {"transformer.wte.weight": (padded_vocab, d)}
    for i in range(cfg["n_layer"]):
        p = f"transformer.h.{i}."
        shapes.update(
            {
                p + "attn.c_q.weight": (cfg["n_head"] * hd, d),
                p + "attn.c_k.weight": (cfg["n_kv_head"] * hd, d),
                p + "attn.c_v.weight": (cfg["n_kv_head"] * hd, d),
                p + "attn.c_proj.weight": (d, d),
                p + "mlp.c_fc.weight": (4 * d, d),
                p + "mlp.c_proj.weight": (d, 4 * d),
            }
        )
    shapes["lm_head.weight"] = (padded_vocab, d)
    return shapes


def random_weights(cfg: dict, padded_vocab: int, seed=0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        k: torch.randn(s, generator=g) * (1.0 if "wte" in k else s[1] ** -0.5)
        for k, s in gpt_shapes(cfg, padded_vocab).items()
    }


def optimizer_files(weights: dict, world_size: int, seed=1) -> list:
    """[AdamW, Muon] state_dicts after some steps, per rank, in torch.optim's format."""
    g = torch.Generator().manual_seed(seed)
    rnd = lambda shape: torch.rand(shape, generator=g)  # noqa: E731
    adam = {
        n: {"step": 7, "exp_avg": rnd(weights[n].shape) - 0.5, "exp_avg_sq": rnd(weights[n].shape) * 1e-3}
        for n in ("lm_head.weight", "transformer.wte.weight")
    }
    mats = [n for n in weights if n not in adam]
    muon = {
        n: {
            "momentum_buffer": rnd(weights[n].shape) - 0.5,
            "second_momentum_buffer": rnd(
                (weights[n].shape[0], 1) if weights[n].shape[0] >= weights[n].shape[1] else (1, weights[n].shape[1])
            ),
        }
        for n in mats
    }
    adam_groups = [
        dict(lr=0.004 * 0.5, initial_lr=0.004 * 0.5, betas=(0.8, 0.95), eps=1e-10, weight_decay=0.0),
        dict(lr=0.2 * 0.5, initial_lr=0.2 * 0.5, betas=(0.8, 0.95), eps=1e-10, weight_decay=0.0),
    ]
    muon_hp = dict(lr=0.02, initial_lr=0.02, momentum=0.95, nesterov=True, ns_steps=5, beta2=0.95, weight_decay=0.0)
    if world_size == 1:  # torch.optim.AdamW + Muon (groups by numel, in set order, as nanochat builds them)
        sizes = list({weights[n].numel() for n in mats})
        muon_groups = [[n for n in mats if weights[n].numel() == s] for s in sizes]
    else:  # DistMuon: groups by sorted shape
        muon_groups = [[n for n in mats if weights[n].shape == s] for s in sorted({weights[n].shape for n in mats})]
    files = []
    for rank in range(world_size):
        a_state = {}
        for i, n in enumerate(("lm_head.weight", "transformer.wte.weight")):
            st = adam[n]
            if world_size == 1:
                a_state[i] = {
                    "step": torch.tensor(float(st["step"])),
                    "exp_avg": st["exp_avg"],
                    "exp_avg_sq": st["exp_avg_sq"],
                }
            else:  # DistAdamW: this rank's rows
                rows = st["exp_avg"].shape[0] // world_size
                sl = slice(rank * rows, (rank + 1) * rows)
                a_state[i] = {
                    "step": torch.tensor(st["step"], dtype=torch.int64),
                    "exp_avg": st["exp_avg"][sl].clone(),
                    "exp_avg_sq": st["exp_avg_sq"][sl].clone(),
                }
        adamw = {"state": a_state, "param_groups": [dict(h, params=[i]) for i, h in enumerate(adam_groups)]}
        m_state, m_groups, index = {}, [], 0
        for names in muon_groups:
            ids = list(range(index, index + len(names)))
            for j, (i, n) in enumerate(zip(ids, names)):
                if world_size == 1 or j % world_size == rank:  # DistMuon: owner = position mod world size
                    m_state[i] = {k: v.clone() for k, v in muon[n].items()}
            m_groups.append(dict(muon_hp, params=ids))
            index += len(names)
        files.append([adamw, {"state": m_state, "param_groups": m_groups}])
    return files, adam, muon


def write_checkpoint(
    folder: Path, step: int, cfg: dict, weights: dict, val_bpb=1.25, optim=None, bf16_wte=True, compiled_keys=False
):
    folder.mkdir(parents=True, exist_ok=True)
    state = dict(weights)
    if bf16_wte:
        state["transformer.wte.weight"] = state["transformer.wte.weight"].bfloat16()
    if compiled_keys:
        state = {"_orig_mod." + k: v for k, v in state.items()}
    torch.save(state, folder / f"model_{step:06d}.pt")
    meta = {
        "step": step,
        "val_bpb": val_bpb,
        "model_config": cfg,
        "user_config": {"run": "dummy", "depth": cfg["n_layer"]},
        "device_batch_size": 4,
        "loop_state": {"min_val_bpb": val_bpb, "smooth_train_loss": 2.5, "total_training_time": 12.0},
    }
    (folder / f"meta_{step:06d}.json").write_text(json.dumps(meta, indent=2))
    for rank, data in enumerate(optim or []):
        torch.save(data, folder / f"optim_{step:06d}_rank{rank}.pt")
