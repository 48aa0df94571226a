"""
A Hugging Face transformers model folder, written from a run and read back: config.json, model.safetensors
and generation_config.json, beside the tokenizer files of hf_tokenizer.py. The gpt family is transformers'
own NanoChatForCausalLM (model_type "nanochat"); the windowed family, which that class cannot hold, ships
its modeling file (hf_windowed_modeling.py, torch and transformers only) through config.json's auto_map.
"""

import json
import os
import re
import shutil
from pathlib import Path

import safetensors
import safetensors.torch
import torch

from ..core.errors import UserError
from ..model import loading
from ..model.gpt import GPT, LOGIT_SOFTCAP, GPTConfig
from ..model.windowed_gpt import QK_SCALE, SMEAR_CHANNELS, VE_GATE_CHANNELS, WindowedGPT, WindowedGPTConfig
from . import hf_tokenizer

CONFIG_FILE, WEIGHTS_FILE, GENERATION_FILE = "config.json", "model.safetensors", "generation_config.json"
WEIGHTS_INDEX = "model.safetensors.index.json"  # save_pretrained's shards of a large model
MODELING_FILE = "modeling_nanochat_windowed.py"  # the windowed family's code, as the folder holds it
MODELING_SOURCE = Path(__file__).with_name("hf_windowed_modeling.py")
MODEL_TYPES = {"nanochat": "gpt", "nanochat_windowed": "windowed"}
NORM_EPS = torch.finfo(torch.float32).eps  # F.rms_norm's eps for fp32 (ours has no eps setting)
OURS_KEY = "nanochat_fast"  # config.json's record of the run: phase and step

# our parameter names -> transformers' (NanoChatForCausalLM's; the windowed family's extra ones beside them)
TOP_NAMES = {
    "transformer.wte.weight": "model.embed_tokens.weight",
    "lm_head.weight": "lm_head.weight",
    "resid_lambdas": "model.resid_lambdas",
    "x0_lambdas": "model.x0_lambdas",
    "smear_gate.weight": "model.smear_gate.weight",
    "smear_lambda": "model.smear_lambda",
    "backout_lambda": "model.backout_lambda",
}
LAYER_NAMES = {
    "attn.c_q": "self_attn.q_proj",
    "attn.c_k": "self_attn.k_proj",
    "attn.c_v": "self_attn.v_proj",
    "attn.c_proj": "self_attn.o_proj",
    "attn.ve_gate": "self_attn.ve_gate",
    "mlp.c_fc": "mlp.fc1",
    "mlp.c_proj": "mlp.fc2",
}


def hf_name(name: str) -> str:
    """transformers' name of our parameter `name`."""
    if name in TOP_NAMES:
        return TOP_NAMES[name]
    if m := re.fullmatch(r"transformer\.h\.(\d+)\.(\w+\.\w+)\.weight", name):
        return f"model.layers.{m[1]}.{LAYER_NAMES[m[2]]}.weight"
    if m := re.fullmatch(r"value_embeds\.(\d+)\.weight", name):
        return f"model.value_embeds.{m[1]}.weight"
    raise KeyError(name)


def config_json(config: GPTConfig, tokenizer, record: dict) -> dict:
    """config.json of a model of `config`: NanoChatConfig's keys, and the windowed family's own beside them."""
    ids = hf_tokenizer.special_ids(tokenizer)
    windowed = isinstance(config, WindowedGPTConfig)
    out = {
        "architectures": ["NanoChatWindowedForCausalLM" if windowed else "NanoChatForCausalLM"],
        "model_type": "nanochat_windowed" if windowed else "nanochat",
        "vocab_size": config.vocab_size,
        "hidden_size": config.n_embd,
        "intermediate_size": 4 * config.n_embd,
        "num_hidden_layers": config.n_layer,
        "num_attention_heads": config.n_head,
        "num_key_value_heads": config.n_kv_head,
        "head_dim": config.head_dim,
        "max_position_embeddings": config.sequence_len,
        "hidden_act": "relu2",
        "attention_dropout": 0.0,
        "rms_norm_eps": NORM_EPS,
        "initializer_range": 0.02,
        "rope_parameters": {"rope_type": "default", "rope_theta": float(GPT.rotary_base)},
        "final_logit_softcapping": LOGIT_SOFTCAP,
        "attention_bias": False,
        "bos_token_id": ids["bos"],
        "eos_token_id": ids["eos"],
        "pad_token_id": None,  # an Embedding's padding row gets no gradient: no token is one
        "tie_word_embeddings": False,
        "use_cache": True,
        "dtype": "float32",
        OURS_KEY: record,
    }
    if windowed:
        n = config.n_layer
        out |= {
            "auto_map": {
                "AutoConfig": f"{MODELING_FILE[:-3]}.NanoChatWindowedConfig",
                "AutoModelForCausalLM": f"{MODELING_FILE[:-3]}.NanoChatWindowedForCausalLM",
            },
            "rope_parameters": {"rope_type": "default", "rope_theta": float(WindowedGPT.rotary_base)},
            "window_pattern": config.window_pattern,
            "window_sizes": config.window_sizes(),
            "value_embed_layers": sorted(int(k) for k in loading.meta_model(config).value_embeds),
            "qk_scale": QK_SCALE,
            "ve_gate_channels": VE_GATE_CHANNELS,
            "smear_channels": SMEAR_CHANNELS,
            "backout_layer": n // 2,
        }
    return out


def generation_config_json(tokenizer) -> dict:
    """Greedy by default, stopping where our chat replies stop (<|assistant_end|>, or <|bos|>)."""
    ids = hf_tokenizer.special_ids(tokenizer)
    return {"bos_token_id": ids["bos"], "eos_token_id": ids["stop"], "pad_token_id": ids["bos"], "do_sample": False}


def check_out(out: Path, overwrite: bool):
    """An export's --out: absent, an empty folder, or (with --overwrite) a folder to replace."""
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise UserError(f"--out {out} is not empty; pass --overwrite to replace it, or give another folder")


def write_folder(out: Path, state: dict, config: GPTConfig, tokenizer, record: dict):
    """The whole folder built under a temporary name beside `out`, then renamed into place (replacing it)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.partial{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        tensors = {hf_name(k): v.detach().float().cpu().contiguous() for k, v in state.items()}
        safetensors.torch.save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        (tmp / CONFIG_FILE).write_text(json.dumps(config_json(config, tokenizer, record), indent=2) + "\n")
        (tmp / GENERATION_FILE).write_text(json.dumps(generation_config_json(tokenizer), indent=2) + "\n")
        hf_tokenizer.write_files(tokenizer, tmp, config.sequence_len)
        if isinstance(config, WindowedGPTConfig):
            shutil.copyfile(MODELING_SOURCE, tmp / MODELING_FILE)
        old = out.with_name(f".{out.name}.old{os.getpid()}")  # the folder replaced, kept until the new one is in
        if out.exists():
            out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def read_config(folder: Path) -> dict:
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise UserError(f"--from {folder}: no {CONFIG_FILE} there; give a transformers model folder")
    try:
        cfg = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{path} is not readable JSON ({e})") from None
    if not isinstance(cfg, dict) or cfg.get("model_type") not in MODEL_TYPES:
        kind = cfg.get("model_type") if isinstance(cfg, dict) else None
        raise UserError(
            f"{path}: model_type {kind!r} is not a nanochat model (nanochat_fast imports "
            f"{' and '.join(MODEL_TYPES)}); this architecture cannot run here"
        )
    return cfg


def _need(cfg: dict, key: str, path: Path):
    if key not in cfg:
        raise UserError(f"{path} has no {key!r}; it was not written by save_pretrained of a nanochat model")
    return cfg[key]


def our_config(cfg: dict, folder: Path, accept_norm_eps: bool = False) -> GPTConfig:
    """Our model config of a config.json, or one line saying what our model cannot compute the way it says."""
    path = folder / CONFIG_FILE
    windowed = MODEL_TYPES[cfg["model_type"]] == "windowed"
    n_embd, n_head = _need(cfg, "hidden_size", path), _need(cfg, "num_attention_heads", path)
    rope = cfg.get("rope_parameters") or {"rope_type": "default", "rope_theta": cfg.get("rope_theta", 10_000.0)}
    theta = float((WindowedGPT if windowed else GPT).rotary_base)
    head_dim = cfg.get("head_dim") or (n_embd // n_head if isinstance(n_embd, int) and isinstance(n_head, int) else 0)
    held = {  # what our model computes, each key's value in config.json must be it
        "hidden_act": ("relu2",),
        "final_logit_softcapping": (LOGIT_SOFTCAP,),
        "attention_bias": (False,),
        "tie_word_embeddings": (False,),
        "intermediate_size": (4 * n_embd,),
        "rms_norm_eps": (NORM_EPS,),
    }
    for key, allowed in held.items():
        value = cfg.get(key, False) if key == "tie_word_embeddings" else _need(cfg, key, path)  # False: the default
        if value in allowed or (key == "rms_norm_eps" and accept_norm_eps):
            continue
        hint = " (pass --accept-norm-eps to import it with our norm's eps anyway)" if key == "rms_norm_eps" else ""
        raise UserError(
            f"{path}: {key}={value!r}, but nanochat_fast's model computes {key}={allowed[0]!r}; importing it "
            f"would compute other logits{hint}"
        )
    if rope.get("rope_type", "default") != "default" or float(rope.get("rope_theta", 0)) != theta:
        raise UserError(f"{path}: rope_parameters {rope} are not the rotary embedding ours computes (default, {theta})")
    if head_dim * n_head != n_embd:
        raise UserError(f"{path}: head_dim {head_dim} x {n_head} heads is not hidden_size {n_embd}")
    fields = dict(
        sequence_len=_need(cfg, "max_position_embeddings", path),
        vocab_size=_need(cfg, "vocab_size", path),
        n_layer=_need(cfg, "num_hidden_layers", path),
        n_head=n_head,
        n_kv_head=cfg.get("num_key_value_heads") or n_head,
        n_embd=n_embd,
    )
    try:
        if not windowed:
            return GPTConfig(**fields)
        config = WindowedGPTConfig(**fields, window_pattern=_need(cfg, "window_pattern", path))
    except (TypeError, ValueError) as e:
        raise UserError(f"{path}: not a model nanochat_fast can build ({e})") from None
    constants = dict(
        window_sizes=config.window_sizes(),
        qk_scale=QK_SCALE,
        ve_gate_channels=VE_GATE_CHANNELS,
        smear_channels=SMEAR_CHANNELS,
        backout_layer=config.n_layer // 2,
    )
    for key, value in constants.items():
        if _need(cfg, key, path) != value:
            raise UserError(f"{path}: {key}={cfg[key]!r}, but a windowed model of this config has {value!r}")
    return config


def _weight_files(folder: Path) -> list[Path]:
    if (folder / WEIGHTS_FILE).is_file():
        return [folder / WEIGHTS_FILE]
    index = folder / WEIGHTS_INDEX
    if not index.is_file():
        raise UserError(f"--from {folder}: neither {WEIGHTS_FILE} nor {WEIGHTS_INDEX} is there (the weights)")
    try:
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (OSError, ValueError, KeyError, AttributeError) as e:
        raise UserError(f"{index} is not a safetensors index ({type(e).__name__}: {e})") from None
    missing = [n for n in names if not (folder / n).is_file()]
    if missing:
        raise UserError(f"--from {folder}: {WEIGHTS_INDEX} names {missing[0]}, which is missing")
    return [folder / n for n in names]


def read_weights(folder: Path, config: GPTConfig) -> dict[str, torch.Tensor]:
    """Our fp32 state_dict of the folder's safetensors, every tensor's name and shape checked against `config`."""
    raw = {}
    for path in _weight_files(folder):
        try:
            raw |= safetensors.torch.load_file(str(path))
        except (OSError, safetensors.SafetensorError) as e:
            raise UserError(f"{path} cannot be read as safetensors ({e})") from None
    want = {hf_name(k): (k, tuple(v.shape)) for k, v in loading.meta_model(config).state_dict().items()}
    missing, extra = sorted(set(want) - set(raw)), sorted(set(raw) - set(want))
    if missing or extra:
        raise UserError(
            f"--from {folder}: the weights do not match {CONFIG_FILE}: missing {missing[:3]}, unexpected {extra[:3]}"
        )
    state = {}
    for name, (ours, shape) in want.items():
        t = raw[name]
        if tuple(t.shape) != shape or not t.is_floating_point():
            raise UserError(
                f"--from {folder}: {name} is {t.dtype} of shape {list(t.shape)}, but {CONFIG_FILE} gives "
                f"shape {list(shape)}; the config does not describe these weights"
            )
        state[ours] = t.float().contiguous()
    return state


def read_folder(folder: Path, accept_norm_eps: bool = False):
    """(our config, our fp32 state_dict, our Tokenizer, config.json's record of the run or {}) of a folder."""
    cfg = read_config(folder)
    config = our_config(cfg, folder, accept_norm_eps)
    if not (folder / hf_tokenizer.TOKENIZER_FILE).is_file():
        raise UserError(
            f"--from {folder}: {hf_tokenizer.TOKENIZER_FILE} is missing (the tokenizer); give a whole folder"
        )
    state = read_weights(folder, config)
    tokenizer = hf_tokenizer.read_tokenizer(folder, config.vocab_size)
    record = cfg.get(OURS_KEY) if isinstance(cfg.get(OURS_KEY), dict) else {}
    return config, state, tokenizer, record
