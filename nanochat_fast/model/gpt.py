"""
The GPT of nanochat (the `gpt` family): rotary position embeddings and QK-norm, untied token embedding
and lm_head, no biases, parameter-free RMSNorm, ReLU² MLP, grouped-query attention (n_kv_head), logits
soft-capped at 15. One dial, `depth`, sets the width and the heads (config_from_depth). Master weights
are fp32; the matmuls run in the caller's autocast (hardware/precision.py). The batch engine's decode
steps run in decode.py; its prefills here, writing each layer's keys and values into the slot cache.
"""

import dataclasses
import math
import threading
import warnings
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..core.distributed import is_distributed, print0
from ..kernels import rms_norm, softcap, softcap_cross_entropy
from ..kernels.decode_step import apply_rotary_emb
from .batch_engine import MIN_TEMPERATURE, Request, check_positive_ints
from .decode import SlotBatch, decode_step
from .generation import generate_steps

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
        check_positive_ints(**{f.name: getattr(self, f.name) for f in dataclasses.fields(GPTConfig)})
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


def config_from_depth(depth, vocab_size, sequence_len, aspect_ratio=64, head_dim=128, n_kv_head=None) -> GPTConfig:
    """The depth dial: n_embd = ceil(aspect_ratio*depth / head_dim) * head_dim, n_head = n_embd / head_dim."""
    check_positive_ints(depth=depth, aspect_ratio=aspect_ratio, head_dim=head_dim)
    n_embd = math.ceil(aspect_ratio * depth / head_dim) * head_dim
    n_head = n_embd // head_dim
    n_kv_head = n_head if n_kv_head is None else n_kv_head
    return GPTConfig(sequence_len, vocab_size, n_layer=depth, n_head=n_head, n_kv_head=n_kv_head, n_embd=n_embd)


def norm(x):
    """Parameter-free RMSNorm; without autograd one kernel (kernels.rms_norm) where F.rms_norm runs a dozen ops."""
    if x.requires_grad or torch.compiler.is_compiling():
        return F.rms_norm(x, (x.size(-1),))
    return rms_norm(x)


def linear(in_features: int, out_features: int) -> nn.Linear:
    return nn.Linear(in_features, out_features, bias=False)


class CausalSelfAttention(nn.Module):
    qk_scale = None  # the windowed family scales queries and keys after QK-norm

    def __init__(self, config: GPTConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.n_kv_head, config.head_dim
        self.c_q = linear(config.n_embd, self.n_head * self.head_dim)
        self.c_k = linear(config.n_embd, self.n_kv_head * self.head_dim)
        self.c_v = linear(config.n_embd, self.n_kv_head * self.head_dim)
        self.c_proj = linear(config.n_embd, config.n_embd)

    def forward(self, x, cos_sin, kv_cache, ve=None):
        B, T, _ = x.size()
        q = self.c_q(x).view(B, T, self.n_head, self.head_dim)
        k = self.c_k(x).view(B, T, self.n_kv_head, self.head_dim)
        v = self.c_v(x).view(B, T, self.n_kv_head, self.head_dim)
        if ve is not None:  # the windowed family's value embedding, gated (WindowedAttention.value_gate)
            # in v's dtype: under bf16 autocast ve is fp32 (the residual's), and values promoted to
            # fp32 beside bf16 keys would not go into the cache the keys made bf16
            v = v + (self.value_gate(x).unsqueeze(-1) * ve.view(B, T, self.n_kv_head, self.head_dim)).to(v.dtype)
        cos, sin = cos_sin
        q, k = norm(apply_rotary_emb(q, cos, sin)), norm(apply_rotary_emb(k, cos, sin))  # QK-norm
        if self.qk_scale is not None:
            q, k = q * self.qk_scale, k * self.qk_scale
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H, T, D)
        if kv_cache is not None:
            k, v = kv_cache.insert_kv(self.layer_idx, k, v)
        y = self._attend(q, k, v, gqa=self.n_head != self.n_kv_head)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, -1))

    def _attend(self, q, k, v, gqa: bool):
        """SDPA of q (B, H, Tq, D) over k, v (B, Hkv, Tk, D) whose first Tk - Tq positions are cached ones."""
        Tq, Tk = q.size(2), k.size(2)
        if Tq == Tk:  # training, or a prompt into an empty cache
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        # a chunk after a cached prefix: all of the prefix, causal within the chunk
        mask = torch.ones(Tq, Tk, dtype=torch.bool, device=q.device).tril(diagonal=Tk - Tq)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = linear(config.n_embd, 4 * config.n_embd)
        self.c_proj = linear(4 * config.n_embd, config.n_embd)

    def forward(self, x):
        return self.c_proj(F.relu(self.c_fc(x)).square())


class Block(nn.Module):
    def __init__(self, config: GPTConfig, attn: CausalSelfAttention):
        super().__init__()
        self.attn = attn
        self.mlp = MLP(config)

    # Under torch.compile, blocks with the same graph share one compiled region: the compile costs the
    # block kinds (a window size, a value embedding or not), not the depth (eager: no effect). Compile
    # with compile_model: the region needs its options.
    @torch.compiler.nested_compile_region
    def forward(self, x, cos_sin, kv_cache, ve=None):
        x = x + self.attn(norm(x), cos_sin, kv_cache, ve)
        return x + self.mlp(norm(x))


# Inductor (torch 2.11 and 2.13 on a CPU) let a buffer of one call of a shared block region be reused while
# the region's backward for another block still read it: wrong gradients, the loss unchanged. Without buffer
# reuse they are right (test_gpt.py::test_compiled_model_matches_eager; docs/measurements.md#compile-policy).
COMPILE_OPTIONS = {"allow_buffer_reuse": False}


def compile_model(model: nn.Module, fullgraph: bool = False):
    """torch.compile for one training shape, with the options the shared block regions need."""
    if next(model.parameters()).device.type == "cpu":
        start_vec_isa_probe()
    return torch.compile(model, dynamic=False, fullgraph=fullgraph, options=COMPILE_OPTIONS)


def start_vec_isa_probe():
    """Inductor picks a CPU's vector ISA when it generates its first kernel, by building and loading a test
    library per candidate ISA, one after the other (~11 s on a cold cache on the 2-core Zen 4). Started in
    a thread when the model is wrapped, those builds run on the other core while Dynamo and AOTAutograd
    trace the first graph, instead of after them (docs/measurements.md#compile-policy). Call it after any
    timing: the builds take a core."""
    try:
        from torch._inductor.cpu_vec_isa import pick_vec_isa  # private: a torch without it just skips this
    except ImportError:
        return
    threading.Thread(target=pick_vec_isa, name="inductor-vec-isa", daemon=True).start()


class GPT(nn.Module):
    arch = "gpt"  # the family's name in --arch and meta.json
    prompts_as_decode_rows = True  # decode_step takes a prompt's tokens as a SlotBatch's rows from position 0
    rotary_base = 10_000
    attention_class = CausalSelfAttention

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        blocks = nn.ModuleList([Block(config, self.attention_class(config, i)) for i in range(config.n_layer)])
        self.transformer = nn.ModuleDict({"wte": nn.Embedding(config.vocab_size, config.n_embd), "h": blocks})
        self.lm_head = linear(config.n_embd, config.vocab_size)
        self._rotary_buffers()

    def _rotary_buffers(self):
        """fp32 (1, T, 1, D/2) tables for 10x the training length (generation can run past it); not persistent."""
        self.rotary_seq_len = self.config.sequence_len * 10
        head_dim, device, base = self.config.head_dim, self.transformer.wte.weight.device, self.rotary_base
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
        freqs = torch.outer(torch.arange(self.rotary_seq_len, dtype=torch.float32, device=device), inv_freq)
        self.register_buffer("cos", freqs.cos()[None, :, None, :], persistent=False)
        self.register_buffer("sin", freqs.sin()[None, :, None, :], persistent=False)

    @torch.no_grad()
    def init_weights(self):
        """nanochat's init, and the rotary tables: a meta-device model after `to_empty` is complete after it."""
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
        self._rotary_buffers()

    def get_device(self):
        return self.transformer.wte.weight.device

    def num_scaling_params(self) -> int:
        """Every parameter, embeddings included (Chinchilla's count): what `target_param_data_ratio` multiplies."""
        return sum(p.numel() for p in self.parameters())

    def estimate_flops(self) -> int:
        """Training FLOPs per token: 6 per non-embedding weight plus attention's scores and values."""
        nparams = sum(p.numel() for p in self.parameters()) - self.transformer.wte.weight.numel()
        cfg = self.config
        return 6 * nparams + 12 * cfg.n_layer * cfg.n_head * cfg.head_dim * cfg.sequence_len

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
        """[AdamW for lm_head and wte, Muon for the blocks' matrices]; scalar_lr: the windowed GPT's."""
        model_dim = self.config.n_embd
        # AdamW LRs were tuned at width 768; scale them by 1/sqrt(width/768)
        scale = (model_dim / 768) ** -0.5
        print0(f"Scaling the LR for the AdamW parameters ∝1/√({model_dim}/768) = {scale:.6f}")
        head = list(self.lm_head.named_parameters(prefix="lm_head"))
        wte = list(self.transformer.wte.named_parameters(prefix="transformer.wte"))
        adam_groups = [dict(params=head, lr=unembedding_lr * scale), dict(params=wte, lr=embedding_lr * scale)]
        adamw_kwargs = dict(betas=tuple(adam_betas), eps=1e-10, weight_decay=weight_decay)
        return self._optimizers(adam_groups, adamw_kwargs, matrix_lr, muon_recipe, ns_coefficients)

    def _optimizers(self, adam_groups, adamw_kwargs, matrix_lr, muon_recipe, ns_coefficients):
        """ZeRO-2's under several processes, FSDP's once fully_shard made the parameters DTensors."""
        from ..optim import AdamW, DistAdamW, DistMuon, FsdpAdamW, FsdpMuon, Muon, MuonRecipe

        recipe = MuonRecipe.of(muon_recipe)
        if ns_coefficients is not None:
            recipe = dataclasses.replace(recipe, ns_coefficients=ns_coefficients)
        matrix_params = list(self.transformer.h.named_parameters(prefix="transformer.h"))
        assert sum(len(g["params"]) for g in adam_groups) + len(matrix_params) == len(list(self.parameters()))
        sharded = hasattr(self.lm_head.weight, "placements")  # a DTensor: fully_shard'ed
        adamw_cls, muon_cls = (
            (FsdpAdamW, FsdpMuon) if sharded else (DistAdamW, DistMuon) if is_distributed() else (AdamW, Muon)
        )
        adamw = adamw_cls(adam_groups, **adamw_kwargs)
        muon = muon_cls(matrix_params, lr=matrix_lr, **recipe.muon_kwargs())
        muon.recipe = recipe
        for group in adamw.param_groups + muon.param_groups:  # what the schedules scale
            group["initial_lr"] = group["lr"]
        return [adamw, muon]

    def forward(self, idx, targets=None, kv_cache=None, loss_reduction="mean"):
        """idx (B, T) -> fp32 logits (B, T, vocab); with targets (B, T; -1 ignored) the cross-entropy: a scalar
        for "mean"/"sum", (B, T) for "none". kv_cache: the batch engine's view (decode.py) or None."""
        if isinstance(kv_cache, SlotBatch):
            return self._softcap(decode_step(self, idx, kv_cache))
        T0 = 0 if kv_cache is None else kv_cache.get_pos()
        T1 = T0 + idx.size(1)
        if T1 > self.cos.size(1):
            raise ValueError(f"sequence of {T1} tokens is longer than the rotary table ({self.cos.size(1)})")
        x = self._trunk(idx, (self.cos[:, T0:T1], self.sin[:, T0:T1]), kv_cache)
        if kv_cache is not None:
            x = kv_cache.logit_positions(x)
        x = norm(x)
        if targets is None:
            return self._softcap(self.lm_head(x).float())
        # the fused lm_head + softcap + cross-entropy, in row chunks: never all B*T x vocab logits
        B, T = targets.shape
        rows, w = x.reshape(B * T, -1), self.lm_head.weight
        loss = softcap_cross_entropy(
            rows, w, targets.reshape(-1), LOGIT_SOFTCAP, ignore_index=-1, reduction=loss_reduction
        )
        return loss.view(B, T) if loss_reduction == "none" else loss

    def _trunk(self, idx, cos_sin, kv_cache):
        x = norm(self.transformer.wte(idx))
        for block in self.transformer.h:
            x = block(x, cos_sin, kv_cache)
        return x

    @staticmethod
    def _softcap(logits):
        if logits.requires_grad or torch.compiler.is_compiling():
            return LOGIT_SOFTCAP * torch.tanh(logits / LOGIT_SOFTCAP)
        return softcap(logits, LOGIT_SOFTCAP)  # one pass where no gradient is wanted

    def generate(self, tokens, max_tokens, temperature=1.0, top_k=None, seed=42, use_kv_cache=None):
        """Yield `max_tokens` ids continuing `tokens` (no stop token), greedy below MIN_TEMPERATURE: an engine row."""
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
        request = Request(tokens, max_tokens, temperature, top_k, seed, use_tools=False)
        for column in generate_steps(self, None, request):  # one row, no tokenizer: no stop token, no tool
            yield column[0][0]
