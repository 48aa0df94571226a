"""
The windowed GPT: the model nanochat trains today (its gpt.py at 92d63d4), beside the seeds' GPT.
What it adds to the seeds' network:
- sliding-window attention: a pattern of S (short: a quarter of the context, rounded up to a
  multiple of 128) and L (the full context) tiled over the layers, the last layer always L
- value embeddings (ResFormer) on alternating layers, the last included, added to attention's
  values through a gate: 3 * sigmoid of a linear map of 12 input channels per kv head
- per-layer scalars: resid_lambdas scale the residual stream, x0_lambdas blend the input back in
- smear (the previous token's embedding mixed in through a gate of 24 channels) and backout (the
  residual after layer n_layer // 2, scaled and subtracted before the final norm)
- queries and keys scaled by 1.2 after QK-norm, rotary base 100,000, its own init and optimizer groups
Parameter names and shapes are nanochat's (interop/ reads and writes them, but for the vocabulary
padding). Attention runs through SDPA: a short window in training chunk by chunk, elsewhere under a
window mask; a batch engine's decode step through its kernel, each row from its window's start.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..core.distributed import is_distributed, print0
from ..kernels.decode_step import smear_decode
from . import packed_linears
from .gpt import GPT, MLP, GPTConfig, Linear, apply_rotary_emb, norm, project_qkv
from .kv_cache import SlotBatch

ARCH = "windowed"  # the family's name in --arch and meta.json
VE_GATE_CHANNELS = 12
SMEAR_CHANNELS = 24
QK_SCALE = 1.2  # on queries and keys after QK-norm (sharper attention, split between the two)
ROTARY_BASE = 100_000


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
        sizes = [
            short if self.window_pattern[i % len(self.window_pattern)] == "S" else long for i in range(self.n_layer)
        ]
        sizes[-1] = long
        return sizes


def has_value_embedding(layer_idx: int, n_layer: int) -> bool:
    """Alternating layers, the last one always."""
    return layer_idx % 2 == (n_layer - 1) % 2


def window_mask(positions_q: torch.Tensor, positions_k: torch.Tensor, window: int) -> torch.Tensor:
    """Boolean (Tq, Tk): key j is seen by query i when j <= i and i - j <= window."""
    diff = positions_q[:, None] - positions_k[None, :]
    return (diff >= 0) & (diff <= window)


def window_chunked_attention(q, k, v, window: int, gqa: bool):
    """Causal attention over the last `window` keys, for a sequence (B, H, T, D) of T a multiple of
    the window, through SDPA on chunks of `window` queries: the first chunk causal on itself, every
    other chunk against its own keys and the previous chunk's, under one shared mask. A mask over
    the whole sequence makes SDPA compute all T x T scores; this computes ~2 * window per query."""
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


class WindowedAttention(nn.Module):
    def __init__(self, config: WindowedGPTConfig, layer_idx: int, window: int):
        super().__init__()
        self.layer_idx, self.window = layer_idx, window
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.n_kv_head, config.head_dim
        self.c_q = Linear(config.n_embd, self.n_head * self.head_dim)
        self.c_k = Linear(config.n_embd, self.n_kv_head * self.head_dim)
        self.c_v = Linear(config.n_embd, self.n_kv_head * self.head_dim)
        self.c_proj = Linear(config.n_embd, config.n_embd)
        gated = has_value_embedding(layer_idx, config.n_layer)
        self.ve_gate = Linear(VE_GATE_CHANNELS, self.n_kv_head) if gated else None

    def forward(self, x, ve, cos_sin, kv_cache):
        B, T, _ = x.size()
        q, k, v = project_qkv(self, x)
        if ve is not None:  # the value embedding, gated per kv head in (0, 3)
            gate = 3 * torch.sigmoid(self.ve_gate(x[..., :VE_GATE_CHANNELS]))
            # in v's dtype: under bf16 autocast ve is fp32 (the residual's), and values promoted to
            # fp32 beside bf16 keys would not go into the cache the keys made bf16
            v = v + (gate.unsqueeze(-1) * ve.view(B, T, self.n_kv_head, self.head_dim)).to(v.dtype)
        gqa = self.n_head != self.n_kv_head
        if isinstance(kv_cache, SlotBatch):  # one token per row at its own position, one kernel
            y = kv_cache.attention(self.layer_idx, q, k, v, cos_sin, gqa, qk_scale=QK_SCALE, window=self.window)
            return self.c_proj(y)
        cos, sin = cos_sin
        q, k = apply_rotary_emb(q, cos, sin), apply_rotary_emb(k, cos, sin)
        q, k = norm(q) * QK_SCALE, norm(k) * QK_SCALE
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H, T, D)
        if kv_cache is not None:
            k, v = kv_cache.insert_kv(self.layer_idx, k, v)
        y = self._attend(q, k, v, gqa)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, -1))

    def _attend(self, q, k, v, gqa):
        Tq, Tk = q.size(2), k.size(2)
        if Tq == Tk and self.window >= Tq - 1:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        if Tq == Tk and Tq % self.window == 0:
            return window_chunked_attention(q, k, v, self.window, gqa)
        positions_k = torch.arange(Tk, device=q.device)
        mask = window_mask(positions_k[Tk - Tq :], positions_k, self.window)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


class WindowedBlock(nn.Module):
    decodes_as_one_op = True  # packed_linears.py packs its four products for kernels/decode_block.py

    def __init__(self, config: WindowedGPTConfig, layer_idx: int, window: int):
        super().__init__()
        self.attn = WindowedAttention(config, layer_idx, window)
        self.mlp = MLP(config)

    def forward(self, x, x0, scales, ve, cos_sin, kv_cache):
        """x blended with the block input x0 by the layer's scalars (resid, x0), then the block."""
        if isinstance(kv_cache, SlotBatch) and (packs := packed_linears.current(self)) is not None:
            # a decode step: the blend, the value embedding's gate and the block in one op
            attn, gate = self.attn, None if ve is None else self.attn.ve_gate.weight
            return kv_cache.block(
                attn.layer_idx, x, packs, cos_sin, attn.n_head, qk_scale=QK_SCALE, window=attn.window,
                x0=x0, scales=scales, ve=ve, ve_gate=gate,
            )  # fmt: skip
        x = scales[0] * x + scales[1] * x0
        x = x + self.attn(norm(x), ve, cos_sin, kv_cache)
        return x + self.mlp(norm(x))


class WindowedGPT(GPT):
    """The seeds' GPT's interface (forward, generate, the batch engine's cache) over nanochat's
    current network. GPT.__init__ is not run: the modules differ; the shared methods are reused."""

    arch = ARCH

    def __init__(self, config: WindowedGPTConfig):
        nn.Module.__init__(self)
        self.config = config
        self.window_sizes = config.window_sizes()
        V, d, n = config.vocab_size, config.n_embd, config.n_layer
        blocks = [WindowedBlock(config, i, w) for i, w in enumerate(self.window_sizes)]
        self.transformer = nn.ModuleDict({"wte": nn.Embedding(V, d), "h": nn.ModuleList(blocks)})
        self.lm_head = Linear(d, V)
        self.resid_lambdas = nn.Parameter(torch.ones(n))
        self.x0_lambdas = nn.Parameter(torch.zeros(n))
        self.smear_gate = Linear(SMEAR_CHANNELS, 1)
        self.smear_lambda = nn.Parameter(torch.zeros(1))
        self.backout_lambda = nn.Parameter(torch.zeros(1))
        kv_dim = config.n_kv_head * config.head_dim
        self.value_embeds = nn.ModuleDict(
            {str(i): nn.Embedding(V, kv_dim) for i in range(n) if has_value_embedding(i, n)}
        )
        self.rotary_seq_len = config.sequence_len * 10
        cos, sin = self._precompute_rotary_embeddings(self.rotary_seq_len, config.head_dim)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def _precompute_rotary_embeddings(self, seq_len, head_dim, base=ROTARY_BASE):
        return super()._precompute_rotary_embeddings(seq_len, head_dim, base)

    @torch.no_grad()
    def init_weights(self):
        """nanochat's init of this model: uniform block matrices of std 1/sqrt(n_embd) (c_fc at
        0.4x), zero output projections, embedding std 0.8, lm_head std 0.001, small positive gates,
        residual scalars decaying with depth; and the rotary tables."""
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
        self.cos, self.sin = self._precompute_rotary_embeddings(self.rotary_seq_len, self.config.head_dim)

    def num_scaling_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def estimate_flops(self) -> int:
        """Training FLOPs per token: 6 per matmul weight (every Linear, the value-embedding gates
        and the smear gate included; embeddings and value embeddings are lookups) plus attention,
        12 * n_head * head_dim * the keys each layer's window lets a query see."""
        matmul = sum(m.weight.numel() for m in self.modules() if isinstance(m, Linear))
        cfg = self.config
        attn = sum(12 * cfg.n_head * cfg.head_dim * min(w, cfg.sequence_len) for w in self.window_sizes)
        return 6 * matmul + attn

    def optimizer_groups(self, unembedding_lr, embedding_lr, scalar_lr, weight_decay=None):
        """nanochat's AdamW groups: (name, [(param name, param)], lr, betas, weight decay); the
        AdamW lrs scaled by 1/sqrt(n_embd/768). `weight_decay` is not used: each group has its own."""
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
        """[AdamW over nanochat's six groups, Muon over every matrix in the blocks (the value
        embedding gates included)], as GPT.setup_optimizers builds them (ZeRO-2, FSDP or one
        process). adam_betas and weight_decay are not used: the groups carry their own."""
        import dataclasses

        from ..optim import AdamW, DistAdamW, DistMuon, FsdpAdamW, FsdpMuon, Muon, MuonRecipe

        recipe = MuonRecipe.of(muon_recipe)
        if ns_coefficients is not None:
            recipe = dataclasses.replace(recipe, ns_coefficients=ns_coefficients)
        print0(f"Scaling the LR for the AdamW parameters ∝1/√({self.config.n_embd}/768)")
        groups = self.optimizer_groups(unembedding_lr, embedding_lr, scalar_lr)
        adam_groups = [dict(params=params, lr=lr, betas=betas, weight_decay=wd) for _, params, lr, betas, wd in groups]
        matrix_params = list(self.transformer.h.named_parameters(prefix="transformer.h"))
        assert sum(len(g["params"]) for g in adam_groups) + len(matrix_params) == len(list(self.parameters()))
        sharded = hasattr(self.lm_head.weight, "placements")
        adamw_cls, muon_cls = (
            (FsdpAdamW, FsdpMuon) if sharded else (DistAdamW, DistMuon) if is_distributed() else (AdamW, Muon)
        )
        optimizers = [
            adamw_cls(adam_groups, eps=1e-10),
            muon_cls(matrix_params, lr=matrix_lr, **recipe.muon_kwargs()),
        ]
        optimizers[1].recipe = recipe
        for opt in optimizers:
            for group in opt.param_groups:
                group["initial_lr"] = group["lr"]
        return optimizers

    def _smear(self, x, kv_cache):
        """Each position plus gate * the previous position's embedding; the first position of a
        chunk after cached ones takes the previous embedding the cache kept."""
        if isinstance(kv_cache, SlotBatch):  # a decode step: one op (kernels/smear.py)
            previous = kv_cache.cache.embedding_store(x)
            return smear_decode(x, previous, kv_cache.slots, self.smear_gate.weight, self.smear_lambda)
        gate = self.smear_lambda.to(x.dtype) * torch.sigmoid(self.smear_gate(x[..., :SMEAR_CHANNELS]))
        prev = x[:, :-1]
        if kv_cache is None:
            return torch.cat([x[:, :1], x[:, 1:] + gate[:, 1:] * prev], dim=1)
        before = kv_cache.cache.previous_embedding(kv_cache, x)[:, None].to(x.dtype)
        kv_cache.cache.keep_embedding(kv_cache, x)
        return x + gate * torch.cat([before, prev], dim=1)

    def forward(self, idx, targets=None, kv_cache=None, loss_reduction="mean"):
        cos_sin = self._rotary(idx.size(1), kv_cache)
        x = norm(self.transformer.wte(idx))
        x = self._smear(x, kv_cache)
        x0, backout_at, x_backout = x, self.config.n_layer // 2, None
        # a decode step's scalars as floats, read once (its blocks take them so); elsewhere tensors
        scales = (self.resid_lambdas, self.x0_lambdas)
        if isinstance(kv_cache, SlotBatch):
            scales = (self.resid_lambdas.tolist(), self.x0_lambdas.tolist())
        for i, block in enumerate(self.transformer.h):
            ve = self.value_embeds[str(i)](idx).to(x.dtype) if str(i) in self.value_embeds else None
            x = block(x, x0, (scales[0][i], scales[1][i]), ve, cos_sin, kv_cache)
            if i == backout_at:
                x_backout = x
        x = x - self.backout_lambda.to(x.dtype) * x_backout
        if kv_cache is not None:
            x = kv_cache.logit_positions(x)
        return self._head(norm(x), targets, loss_reduction)
