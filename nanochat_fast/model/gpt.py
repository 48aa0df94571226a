"""
The GPT of nanochat:
- rotary position embeddings (no learned positions), QK-norm
- untied token embedding and lm_head, no biases anywhere
- parameter-free RMSNorm (after the embedding, before attention/MLP, before the lm_head)
- ReLU² MLP
- grouped-query attention (GQA/MQA) via n_kv_head
- logits soft-capped at 15 by tanh

One dial, `depth`, sets the width and the heads (config_from_depth). Master weights are fp32 on
every device; the matmuls run in the compute dtype of hardware/precision.py, applied by the caller's
autocast: bf16 on CUDA sm80+, fp32 on MPS, and on a CPU whichever of fp32 and bf16 measured faster.
"""

import dataclasses
import math
import warnings
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..core.distributed import is_distributed, print0
from ..kernels import softcap_cross_entropy
from ..kernels.decode_step import apply_rotary_emb, rms_norm, softcap
from . import packed_linears
from .generation import generate_tokens
from .kv_cache import SlotBatch
from .sampling import MIN_TEMPERATURE

LOGIT_SOFTCAP = 15.0


@dataclass
class GPTConfig:
    sequence_len: int = 1024
    vocab_size: int = 50304
    n_layer: int = 12
    n_head: int = 6  # query heads
    n_kv_head: int = 6  # key/value heads (GQA when fewer than n_head)
    n_embd: int = 768

    def __post_init__(self):
        for name in ("sequence_len", "vocab_size", "n_layer", "n_head", "n_kv_head", "n_embd"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be a multiple of n_head ({self.n_head})")
        if (self.n_embd // self.n_head) % 2:
            raise ValueError(
                f"head_dim = n_embd/n_head = {self.n_embd // self.n_head} must be even (rotary pairs channels)"
            )
        if self.n_kv_head > self.n_head or self.n_head % self.n_kv_head:
            raise ValueError(f"n_kv_head ({self.n_kv_head}) must divide n_head ({self.n_head})")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


def config_from_depth(
    depth: int,
    vocab_size: int,
    sequence_len: int,
    aspect_ratio: int = 64,
    head_dim: int = 128,
    n_kv_head: int | None = None,
) -> GPTConfig:
    """The depth dial: n_embd = ceil(aspect_ratio*depth / head_dim) * head_dim, n_head = n_embd / head_dim."""
    for name, value in (("depth", depth), ("aspect_ratio", aspect_ratio), ("head_dim", head_dim)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    n_embd = math.ceil(aspect_ratio * depth / head_dim) * head_dim
    n_head = n_embd // head_dim
    return GPTConfig(
        sequence_len=sequence_len,
        vocab_size=vocab_size,
        n_layer=depth,
        n_head=n_head,
        n_kv_head=n_head if n_kv_head is None else n_kv_head,
        n_embd=n_embd,
    )


def norm(x):
    """Parameter-free RMSNorm over the last dimension; without autograd through kernels/rms_norm.py
    (one op where F.rms_norm runs a dozen: a decode step's norms are that many dispatches of one row)."""
    if x.requires_grad or torch.compiler.is_compiling():
        return F.rms_norm(x, (x.size(-1),))
    return rms_norm(x)


class Linear(nn.Linear):
    """nn.Linear without bias, whose product runs through a packed copy of the weight during a
    decode step (packed_linears.py: a few rows, where CPU sgemm is slowest)."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features, bias=False)

    def forward(self, x):
        if not torch.compiler.is_compiling() and (packed := packed_linears.current(self)) is not None:
            return packed(x)
        return F.linear(x, self.weight)


def project_qkv(attn: nn.Module, x):
    """An attention module's queries (B, T, H, D), keys and values (B, T, Hkv, D) of x (B, T, C): in
    a decode step or a short prefill one product through c_q, c_k and c_v packed as one weight
    (packed_linears.py), else the three linears."""
    B, T, _ = x.size()
    H, Hkv, D = attn.n_head, attn.n_kv_head, attn.head_dim
    packed = None if torch.compiler.is_compiling() else packed_linears.current(attn)
    if packed is not None:
        q, k, v = packed(x).split((H * D, Hkv * D, Hkv * D), dim=-1)
    else:
        q, k, v = attn.c_q(x), attn.c_k(x), attn.c_v(x)
    return q.view(B, T, H, D), k.view(B, T, Hkv, D), v.view(B, T, Hkv, D)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_head = config.n_head
        self.n_kv_head = config.n_kv_head
        self.head_dim = config.head_dim
        self.c_q = Linear(config.n_embd, self.n_head * self.head_dim)
        self.c_k = Linear(config.n_embd, self.n_kv_head * self.head_dim)
        self.c_v = Linear(config.n_embd, self.n_kv_head * self.head_dim)
        self.c_proj = Linear(config.n_embd, config.n_embd)

    def forward(self, x, cos_sin, kv_cache):
        B, T, _ = x.size()
        q, k, v = project_qkv(self, x)
        gqa = self.n_head != self.n_kv_head
        if isinstance(kv_cache, SlotBatch):
            # rows at different lengths, one token each: rotary, QK-norm, the cache write and every
            # row over its own cached entries, one kernel
            return self.c_proj(kv_cache.attention(self.layer_idx, q, k, v, cos_sin, enable_gqa=gqa))
        cos, sin = cos_sin
        q, k = apply_rotary_emb(q, cos, sin), apply_rotary_emb(k, cos, sin)
        q, k = norm(q), norm(k)  # QK-norm
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H, T, D)
        if kv_cache is not None:
            k, v = kv_cache.insert_kv(self.layer_idx, k, v)
        Tq, Tk = q.size(2), k.size(2)
        if Tq == Tk:
            # training, or the first chunk into an empty cache: plain causal attention
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        elif Tq == 1:
            # one new token attends to everything cached
            y = F.scaled_dot_product_attention(q, k, v, is_causal=False, enable_gqa=gqa)
        else:
            # a chunk after a cached prefix: all of the prefix, causal within the chunk
            prefix = Tk - Tq
            mask = torch.ones(Tq, Tk, dtype=torch.bool, device=q.device).tril(diagonal=prefix)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        y = y.transpose(1, 2).contiguous().view(B, T, -1)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = Linear(config.n_embd, 4 * config.n_embd)
        self.c_proj = Linear(4 * config.n_embd, config.n_embd)

    def forward(self, x):
        return self.c_proj(F.relu(self.c_fc(x)).square())


class Block(nn.Module):
    decodes_as_one_op = True  # a decode step's block through its packs in one call (packed_linears.py)

    def __init__(self, config: GPTConfig, layer_idx: int):
        super().__init__()
        self.attn = CausalSelfAttention(config, layer_idx)
        self.mlp = MLP(config)

    def forward(self, x, cos_sin, kv_cache):
        if isinstance(kv_cache, SlotBatch) and (packs := packed_linears.current(self)) is not None:
            return kv_cache.block(self.attn.layer_idx, x, packs, cos_sin, self.attn.n_head)
        x = x + self.attn(norm(x), cos_sin, kv_cache)
        x = x + self.mlp(norm(x))
        return x


class GPT(nn.Module):
    # a SlotBatch's rows may be a prompt's tokens from position 0 (kv_cache.py): the batch engine
    # runs short prompts in its decode steps
    prompts_as_decode_rows = True

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(config.vocab_size, config.n_embd),
                "h": nn.ModuleList([Block(config, i) for i in range(config.n_layer)]),
            }
        )
        self.lm_head = Linear(config.n_embd, config.vocab_size)
        # Rotary tables for 10x the training length, so generation can run past it. Not persistent:
        # they are recomputed (init_weights) rather than stored in checkpoints.
        self.rotary_seq_len = config.sequence_len * 10
        cos, sin = self._precompute_rotary_embeddings(self.rotary_seq_len, config.head_dim)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    @torch.no_grad()
    def init_weights(self):
        """nanochat's init. Also recomputes the rotary tables, so a model built on the meta device
        and materialised with `to_empty(device=...)` is complete after this call."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                # std 1/sqrt(fan_in), shrunk for wide-to-narrow maps (arXiv:2310.17813)
                fan_out, fan_in = module.weight.shape
                std = 1.0 / math.sqrt(fan_in) * min(1.0, math.sqrt(fan_out / fan_in))
                nn.init.normal_(module.weight, mean=0.0, std=std)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=1.0)
        # zero the output projections: every block starts as the identity, the model as uniform logits
        nn.init.zeros_(self.lm_head.weight)
        for block in self.transformer.h:
            nn.init.zeros_(block.mlp.c_proj.weight)
            nn.init.zeros_(block.attn.c_proj.weight)
        cos, sin = self._precompute_rotary_embeddings(self.rotary_seq_len, self.config.head_dim)
        self.cos, self.sin = cos, sin

    def _precompute_rotary_embeddings(self, seq_len, head_dim, base=10000):
        device = self.transformer.wte.weight.device
        channel_range = torch.arange(0, head_dim, 2, dtype=torch.float32, device=device)
        inv_freq = 1.0 / (base ** (channel_range / head_dim))
        t = torch.arange(seq_len, dtype=torch.float32, device=device)
        freqs = torch.outer(t, inv_freq)
        # fp32 tables (B=1, T, H=1, D/2); cast to the activations' dtype when applied
        return freqs.cos()[None, :, None, :], freqs.sin()[None, :, None, :]

    def get_device(self):
        return self.transformer.wte.weight.device

    def num_scaling_params(self) -> int:
        """Every parameter, embeddings included (Chinchilla's count): what
        `target_param_data_ratio` multiplies."""
        return sum(p.numel() for p in self.parameters())

    def estimate_flops(self) -> int:
        """Training FLOPs per token: 6 per non-embedding weight (forward + backward matmuls) plus
        attention scores and values, 12 * n_layer * n_head * head_dim * sequence_len."""
        nparams = sum(p.numel() for p in self.parameters())
        nparams_embedding = self.transformer.wte.weight.numel()
        cfg = self.config
        return 6 * (nparams - nparams_embedding) + 12 * cfg.n_layer * cfg.n_head * cfg.head_dim * cfg.sequence_len

    def setup_optimizers(
        self,
        unembedding_lr=0.004,
        embedding_lr=0.2,
        matrix_lr=0.02,
        weight_decay=0.0,
        adam_betas=(0.8, 0.95),
        ns_coefficients=None,
        muon_recipe="quintic",
        scalar_lr=None,
    ):
        """[AdamW for lm_head and wte, Muon for every matrix in the blocks]; the distributed ZeRO-2
        versions when torch.distributed runs more than one process, the FSDP ones (optim/fsdp.py) once
        the model is sharded by fully_shard (its parameters are DTensors). `weight_decay` is AdamW's; Muon
        follows `muon_recipe` (a MuonRecipe or a preset name, see optim/recipe.py; ns_coefficients,
        if given, overrides the recipe's) and keeps it as `.recipe` for the momentum schedule.
        scalar_lr is the windowed GPT's (this model has no scalars).
        Every group records `initial_lr` for the LR schedule."""
        from ..optim import AdamW, DistAdamW, DistMuon, FsdpAdamW, FsdpMuon, Muon, MuonRecipe

        recipe = MuonRecipe.of(muon_recipe)
        if ns_coefficients is not None:
            recipe = dataclasses.replace(recipe, ns_coefficients=ns_coefficients)
        model_dim = self.config.n_embd
        distributed = is_distributed()
        matrix_params = list(self.transformer.h.named_parameters(prefix="transformer.h"))
        embedding_params = list(self.transformer.wte.named_parameters(prefix="transformer.wte"))
        lm_head_params = list(self.lm_head.named_parameters(prefix="lm_head"))
        assert len(list(self.parameters())) == len(matrix_params) + len(embedding_params) + len(lm_head_params)
        # AdamW LRs were tuned at width 768; scale them by 1/sqrt(width/768)
        dmodel_lr_scale = (model_dim / 768) ** -0.5
        print0(f"Scaling the LR for the AdamW parameters ∝1/√({model_dim}/768) = {dmodel_lr_scale:.6f}")
        adam_groups = [
            dict(params=lm_head_params, lr=unembedding_lr * dmodel_lr_scale),
            dict(params=embedding_params, lr=embedding_lr * dmodel_lr_scale),
        ]
        adamw_kwargs = dict(betas=tuple(adam_betas), eps=1e-10, weight_decay=weight_decay)
        sharded = hasattr(self.lm_head.weight, "placements")  # a DTensor: fully_shard'ed
        adamw_cls, muon_cls = (
            (FsdpAdamW, FsdpMuon) if sharded else (DistAdamW, DistMuon) if distributed else (AdamW, Muon)
        )
        adamw_optimizer = adamw_cls(adam_groups, **adamw_kwargs)
        muon_optimizer = muon_cls(matrix_params, lr=matrix_lr, **recipe.muon_kwargs())
        muon_optimizer.recipe = recipe
        optimizers = [adamw_optimizer, muon_optimizer]
        for opt in optimizers:
            for group in opt.param_groups:
                group["initial_lr"] = group["lr"]
        return optimizers

    def _rotary(self, T, kv_cache):
        """cos, sin of the T new positions: (1, T, 1, D/2) from the cache's position on, or in a
        SlotBatch decode step (one token per row, each row at its own position) (B, 1, 1, D/2)."""
        if isinstance(kv_cache, SlotBatch):
            if T != 1:
                raise ValueError(f"a slot-batch decode step feeds one token per row, got {T}")
            # positions < the engine's max_len, which it checked against the table's length
            pos = kv_cache.get_pos()
            return self.cos[0, pos].unsqueeze(1), self.sin[0, pos].unsqueeze(1)
        T0 = 0 if kv_cache is None else kv_cache.get_pos()
        if T0 + T > self.cos.size(1):
            raise ValueError(f"sequence of {T0 + T} tokens is longer than the rotary table ({self.cos.size(1)})")
        return self.cos[:, T0 : T0 + T], self.sin[:, T0 : T0 + T]

    def forward(self, idx, targets=None, kv_cache=None, loss_reduction="mean"):
        """idx (B, T) token ids -> logits (B, T, vocab) in fp32; with targets (B, T) the
        cross-entropy instead (targets -1 are ignored): a scalar for "mean"/"sum", (B, T) for "none".
        kv_cache: None (training, scoring) or a slot cache view of kv_cache.py (the batch engine's)."""
        cos_sin = self._rotary(idx.size(1), kv_cache)
        x = self.transformer.wte(idx)
        x = norm(x)
        for block in self.transformer.h:
            x = block(x, cos_sin, kv_cache)
        if kv_cache is not None:
            x = kv_cache.logit_positions(x)
        return self._head(norm(x), targets, loss_reduction)

    def _head(self, x, targets, loss_reduction):
        """The last hidden states (B, T, C) to fp32 softcapped logits; with targets, the loss through
        the fused lm_head + softcap + cross-entropy (row chunks, never all B*T x vocab logits)."""
        if targets is None:
            logits = self.lm_head(x).float()
            if logits.requires_grad or torch.compiler.is_compiling():
                return LOGIT_SOFTCAP * torch.tanh(logits / LOGIT_SOFTCAP)
            return softcap(logits, LOGIT_SOFTCAP)  # kernels/softcap.py: one pass where no gradient is wanted
        B, T = targets.shape
        w, rows = self.lm_head.weight, x.reshape(B * T, -1)
        loss = softcap_cross_entropy(
            rows, w, targets.reshape(-1), LOGIT_SOFTCAP, ignore_index=-1, reduction=loss_reduction
        )
        return loss.view(B, T) if loss_reduction == "none" else loss

    def generate(self, tokens, max_tokens, temperature=1.0, top_k=None, seed=42, use_kv_cache=None):
        """Yield `max_tokens` sampled token ids continuing `tokens` (a list of ints); no token ends
        it early. temperature 0 (or below sampling.MIN_TEMPERATURE) is greedy; top_k keeps the k
        most likely tokens. It runs as one row of the batch engine, the path chat, evaluation and
        serving take (generation.generate_tokens)."""
        if use_kv_cache is not None:
            warnings.warn(
                "GPT.generate(use_kv_cache=...) is deprecated and ignored (generation always uses the "
                "batch engine's cache); drop the argument",
                DeprecationWarning,
                stacklevel=2,
            )
        if not isinstance(tokens, list) or not tokens:
            raise ValueError("tokens must be a non-empty list of token ids")
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        if len(tokens) + max_tokens > self.rotary_seq_len:
            raise ValueError(
                f"prompt ({len(tokens)}) + max_tokens ({max_tokens}) exceeds the model's "
                f"{self.rotary_seq_len} positions"
            )
        # sample_next is greedy below MIN_TEMPERATURE, negative values included; the engine refuses those
        temperature = temperature if temperature >= MIN_TEMPERATURE else 0.0
        yield from generate_tokens(self, tokens, max_tokens, temperature, top_k, seed)
