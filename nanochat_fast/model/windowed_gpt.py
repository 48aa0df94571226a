"""
The windowed GPT (`--arch=windowed`): the model nanochat trains today (its gpt.py at 92d63d4) on the GPT's
interface. To the gpt family's network it adds sliding-window attention (S and L layers, the last L), gated
value embeddings on alternating layers, per-layer residual scalars, smear and backout, queries and keys
scaled by 1.2 after QK-norm, rotary base 100,000, its own init and optimizer groups. Parameter names and
shapes are nanochat's. Decode steps run in decode.py, each row from its window's start.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..core.distributed import print0
from .block_attention import block_attention, use_blocks, window_mask
from .gpt import GPT, CausalSelfAttention, GPTConfig, linear, norm

VE_GATE_CHANNELS = 12
SMEAR_CHANNELS = 24
QK_SCALE = 1.2  # on queries and keys after QK-norm (sharper attention, split between the two)


def check_window_pattern(pattern) -> str:
    """The pattern upper-cased; ValueError unless it is a non-empty string of S and L."""
    if not isinstance(pattern, str) or not pattern or set(pattern.upper()) - set("SL"):
        raise ValueError(f"window_pattern must be letters S (short) and L (long), e.g. SSSL; got {pattern!r}")
    return pattern.upper()


@dataclass
class WindowedGPTConfig(GPTConfig):
    window_pattern: str = "SSSL"

    def __post_init__(self):
        super().__post_init__()
        self.window_pattern = check_window_pattern(self.window_pattern)

    def window_sizes(self) -> list[int]:
        """Keys before the query each layer attends to (the query's own position not counted)."""
        long = self.sequence_len
        short = -(-long // 4 // 128) * 128  # a quarter, rounded up to a multiple of 128
        pattern = self.window_pattern
        sizes = [short if pattern[i % len(pattern)] == "S" else long for i in range(self.n_layer)]
        sizes[-1] = long
        return sizes


def has_value_embedding(layer_idx: int, n_layer: int) -> bool:
    """Alternating layers, the last one always."""
    return layer_idx % 2 == (n_layer - 1) % 2


def window_chunked_attention(q, k, v, window: int, gqa: bool):
    """Causal attention over the last `window` keys for (B, H, T, D), T a multiple of the window, by chunks of
    `window` queries, each against its own keys and the previous chunk's under one shared mask: ~2 * window
    scores per query, where a mask over the whole sequence makes SDPA compute all T x T."""
    B, H, T, D = q.shape
    first = F.scaled_dot_product_attention(
        q[:, :, :window], k[:, :, :window], v[:, :, :window], is_causal=True, enable_gqa=gqa
    )
    n = T // window - 1  # chunks after the first, each with the window before it
    if n == 0:
        return first

    def chunks(t, size, start):  # (B, h, T, D) -> (B * n, h, size, D): chunk c spans start + c*window
        windows = t[:, :, start:].unfold(2, size, window)  # (B, h, n, D, size)
        return windows.permute(0, 2, 1, 4, 3).reshape(B * n, t.size(1), size, D)

    qc, kc, vc = chunks(q, window, window), chunks(k, 2 * window, 0), chunks(v, 2 * window, 0)
    keys = torch.arange(2 * window, device=q.device)  # a chunk's queries sit at the last `window` of its keys
    mask = window_mask(keys[window:], keys, window)
    rest = F.scaled_dot_product_attention(qc, kc, vc, attn_mask=mask, enable_gqa=gqa)
    rest = rest.view(B, n, H, window, D).permute(0, 2, 1, 3, 4).reshape(B, H, n * window, D)
    return torch.cat([first, rest], dim=2)


class WindowedAttention(CausalSelfAttention):
    qk_scale = QK_SCALE

    def __init__(self, config: WindowedGPTConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.window = config.window_sizes()[layer_idx]
        gated = has_value_embedding(layer_idx, config.n_layer)
        self.ve_gate = linear(VE_GATE_CHANNELS, self.n_kv_head) if gated else None

    def value_gate(self, x):
        """The value embedding's gate per kv head, in (0, 3)."""
        return 3 * torch.sigmoid(self.ve_gate(x[..., :VE_GATE_CHANNELS]))

    def _attend(self, q, k, v, gqa):
        if use_blocks(q, k, self.window):  # on a CPU, faster than its flash kernel (block_attention.py)
            return block_attention(q, k, v, self.window)
        Tq, Tk = q.size(2), k.size(2)
        if Tq == Tk and self.window >= Tq - 1:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        if Tq == Tk and Tq % self.window == 0:
            return window_chunked_attention(q, k, v, self.window, gqa)
        positions_k = torch.arange(Tk, device=q.device)
        mask = window_mask(positions_k[Tk - Tq :], positions_k, self.window)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


class WindowedGPT(GPT):
    arch = "windowed"
    attention_class = WindowedAttention
    rotary_base = 100_000

    def __init__(self, config: WindowedGPTConfig):
        super().__init__(config)
        self.window_sizes = config.window_sizes()
        V, n, kv_dim = config.vocab_size, config.n_layer, config.n_kv_head * config.head_dim
        self.resid_lambdas = nn.Parameter(torch.ones(n))
        self.x0_lambdas = nn.Parameter(torch.zeros(n))
        self.smear_gate = linear(SMEAR_CHANNELS, 1)
        self.smear_lambda = nn.Parameter(torch.zeros(1))
        self.backout_lambda = nn.Parameter(torch.zeros(1))
        self.value_embeds = nn.ModuleDict(
            {str(i): nn.Embedding(V, kv_dim) for i in range(n) if has_value_embedding(i, n)}
        )

    @torch.no_grad()
    def init_weights(self):
        """nanochat's init of this model (residual scalars decaying with depth), and the rotary tables."""
        n, d = self.config.n_layer, self.config.n_embd
        s = math.sqrt(3) / math.sqrt(d)  # a uniform of this bound has std 1/sqrt(d)
        nn.init.normal_(self.transformer.wte.weight, std=0.8)
        nn.init.normal_(self.lm_head.weight, std=0.001)
        for block in self.transformer.h:
            for lin in (block.attn.c_q, block.attn.c_k, block.attn.c_v):
                nn.init.uniform_(lin.weight, -s, s)
            nn.init.uniform_(block.mlp.c_fc.weight, -0.4 * s, 0.4 * s)
            nn.init.zeros_(block.attn.c_proj.weight)
            nn.init.zeros_(block.mlp.c_proj.weight)
            if block.attn.ve_gate is not None:
                nn.init.uniform_(block.attn.ve_gate.weight, 0.0, 0.02)
        depth = torch.arange(n, dtype=torch.float32) / max(n - 1, 1)
        self.resid_lambdas.copy_(1.15 - 0.10 * depth)
        self.x0_lambdas.copy_(0.20 - 0.15 * depth)
        nn.init.zeros_(self.smear_lambda)
        nn.init.constant_(self.backout_lambda, 0.2)
        nn.init.uniform_(self.smear_gate.weight, 0.0, 0.02)
        for ve in self.value_embeds.values():
            nn.init.uniform_(ve.weight, -s, s)
        self._rotary_buffers()

    def estimate_flops(self) -> int:
        """Training FLOPs per token: 6 per Linear weight plus attention over each layer's window."""
        matmul = sum(m.weight.numel() for m in self.modules() if isinstance(m, nn.Linear))
        cfg = self.config
        attn = sum(12 * cfg.n_head * cfg.head_dim * min(w, cfg.sequence_len) for w in self.window_sizes)
        return 6 * matmul + attn

    def optimizer_groups(self, unembedding_lr, embedding_lr, scalar_lr):
        """nanochat's AdamW groups: (name, [(param name, param)], lr, betas, weight decay)."""
        scale = (self.config.n_embd / 768) ** -0.5
        named = dict(self.named_parameters())

        def prefixed(prefix):
            return [(k, p) for k, p in named.items() if k == prefix or k.startswith(prefix + ".")]

        smear = [(k, named[k]) for k in ("smear_gate.weight", "smear_lambda", "backout_lambda")]
        return [
            ("lm_head", prefixed("lm_head"), unembedding_lr * scale, (0.8, 0.96), 0.01),
            ("wte", prefixed("transformer.wte"), embedding_lr * scale, (0.8, 0.995), 0.001),
            ("value_embeds", prefixed("value_embeds"), embedding_lr * scale * 0.5, (0.8, 0.995), 0.01),
            ("resid_lambdas", prefixed("resid_lambdas"), scalar_lr * 0.01, (0.8, 0.95), 0.05),
            ("x0_lambdas", prefixed("x0_lambdas"), scalar_lr, (0.96, 0.95), 0.0),
            ("smear", smear, 0.2, (0.8, 0.95), 0.0),
        ]

    def setup_optimizers(
        self,
        unembedding_lr=0.008,
        embedding_lr=0.3,
        matrix_lr=0.02,
        weight_decay=0.0,
        adam_betas=None,
        ns_coefficients=None,
        muon_recipe="polar-normuon",
        scalar_lr=0.5,
    ):
        """[AdamW over nanochat's six groups (each its own betas and decay), Muon over the blocks' matrices]."""
        print0(f"Scaling the LR for the AdamW parameters ∝1/√({self.config.n_embd}/768)")
        groups = self.optimizer_groups(unembedding_lr, embedding_lr, scalar_lr)
        adam_groups = [dict(params=params, lr=lr, betas=betas, weight_decay=wd) for _, params, lr, betas, wd in groups]
        return self._optimizers(adam_groups, dict(eps=1e-10), matrix_lr, muon_recipe, ns_coefficients)

    def _smear(self, x, kv_cache):
        """Each position plus gate * the previous position's embedding; the first position of a chunk
        after cached ones takes the previous embedding the cache kept."""
        gate = self.smear_lambda.to(x.dtype) * torch.sigmoid(self.smear_gate(x[..., :SMEAR_CHANNELS]))
        prev = x[:, :-1]
        if kv_cache is None:
            return torch.cat([x[:, :1], x[:, 1:] + gate[:, 1:] * prev], dim=1)
        before = kv_cache.previous_embedding(x)[:, None].to(x.dtype)
        kv_cache.keep_embedding(x)
        return x + gate * torch.cat([before, prev], dim=1)

    def _trunk(self, idx, cos_sin, kv_cache):
        x = self._smear(norm(self.transformer.wte(idx)), kv_cache)
        x0, x_backout = x, None
        for i, block in enumerate(self.transformer.h):
            ve = self.value_embeds[str(i)](idx).to(x.dtype) if str(i) in self.value_embeds else None
            x = self.resid_lambdas[i] * x + self.x0_lambdas[i] * x0  # the block input blended with x0
            x = block(x, cos_sin, kv_cache, ve)
            if i == self.config.n_layer // 2:
                x_backout = x
        return x - self.backout_lambda.to(x.dtype) * x_backout
