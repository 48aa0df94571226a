"""
The windowed nanochat model (sliding windows, value embeddings, per-layer scalars, smear, backout) for
transformers, loaded through config.json's auto_map with trust_remote_code=True. Written from
nanochat_fast's model/windowed_gpt.py, it imports only torch and transformers, so a model folder runs
where nanochat_fast is not installed. Generation keeps every key in transformers' DynamicCache and masks
each layer's window; smear reads the token before each new one (prepare_inputs_for_generation passes it).
"""

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import GenerationMixin, PreTrainedConfig, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast


class NanoChatWindowedConfig(PreTrainedConfig):
    model_type = "nanochat_windowed"

    def __init__(
        self,
        vocab_size=50304,
        hidden_size=768,
        num_hidden_layers=12,
        num_attention_heads=6,
        num_key_value_heads=None,
        head_dim=None,
        max_position_embeddings=2048,
        window_pattern="SSSL",
        window_sizes=None,
        value_embed_layers=None,
        rope_parameters=None,
        rms_norm_eps=1.1920928955078125e-07,
        final_logit_softcapping=15.0,
        qk_scale=1.2,
        ve_gate_channels=12,
        smear_channels=24,
        backout_layer=None,
        **kwargs,
    ):
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.num_hidden_layers, self.num_attention_heads = num_hidden_layers, num_attention_heads
        self.num_key_value_heads = num_key_value_heads or num_attention_heads
        self.head_dim = head_dim or hidden_size // num_attention_heads
        self.max_position_embeddings, self.window_pattern = max_position_embeddings, window_pattern
        self.window_sizes = window_sizes or [max_position_embeddings] * num_hidden_layers
        last = num_hidden_layers - 1
        self.value_embed_layers = value_embed_layers or [i for i in range(num_hidden_layers) if i % 2 == last % 2]
        self.rope_parameters = rope_parameters or {"rope_type": "default", "rope_theta": 100000.0}
        self.rms_norm_eps, self.final_logit_softcapping = rms_norm_eps, final_logit_softcapping
        self.qk_scale, self.ve_gate_channels, self.smear_channels = qk_scale, ve_gate_channels, smear_channels
        self.backout_layer = num_hidden_layers // 2 if backout_layer is None else backout_layer
        super().__init__(**kwargs)


def rms_norm(x, eps):
    """Parameter-free RMSNorm."""
    return F.rms_norm(x, (x.size(-1),), eps=eps)


def rotary(x, cos, sin):
    """Rotate channel pairs (i, i + d/2) of x (B, T, H, D) by the positions' angles (cos, sin: (1, T, 1, D/2))."""
    d = x.shape[-1] // 2
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)  # fp32 angles; bf16 activations when loaded in bf16
    x1, x2 = x[..., :d], x[..., d:]
    return torch.cat([x1 * cos + x2 * sin, x1 * (-sin) + x2 * cos], dim=-1)


class WindowedAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx, self.config = layer_idx, config
        self.n_head, self.n_kv_head, self.head_dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        )
        self.window = config.window_sizes[layer_idx]
        d = config.hidden_size
        self.q_proj = nn.Linear(d, self.n_head * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d, self.n_kv_head * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d, self.n_kv_head * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_head * self.head_dim, d, bias=False)
        gated = layer_idx in config.value_embed_layers
        self.ve_gate = nn.Linear(config.ve_gate_channels, self.n_kv_head, bias=False) if gated else None

    def forward(self, x, cos_sin, ve, cache, positions, key_mask):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_head, self.head_dim)
        k = self.k_proj(x).view(B, T, self.n_kv_head, self.head_dim)
        v = self.v_proj(x).view(B, T, self.n_kv_head, self.head_dim)
        if ve is not None:  # the value embedding, gated per kv head in (0, 3)
            gate = 3 * torch.sigmoid(self.ve_gate(x[..., : self.config.ve_gate_channels]))
            v = v + gate.unsqueeze(-1) * ve.view(B, T, self.n_kv_head, self.head_dim)
        eps, scale = self.config.rms_norm_eps, self.config.qk_scale
        q = rms_norm(rotary(q, *cos_sin), eps) * scale  # QK-norm after the rotation, then the scale
        k = rms_norm(rotary(k, *cos_sin), eps) * scale
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        # key j is seen by query i when j <= i and i - j <= window (the query's own position not counted)
        diff = positions[:, None] - torch.arange(k.size(2), device=x.device)[None, :]
        mask = ((diff >= 0) & (diff <= self.window))[None, None]
        if key_mask is not None:
            mask = mask & (key_mask[:, None, None, :] | (diff == 0)[None, None])
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.n_head != self.n_kv_head)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, 4 * config.hidden_size, bias=False)
        self.fc2 = nn.Linear(4 * config.hidden_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)).square())


class DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn, self.mlp, self.eps = WindowedAttention(config, layer_idx), MLP(config), config.rms_norm_eps

    def forward(self, x, cos_sin, ve, cache, positions, key_mask):
        x = x + self.self_attn(rms_norm(x, self.eps), cos_sin, ve, cache, positions, key_mask)
        return x + self.mlp(rms_norm(x, self.eps))


class NanoChatWindowedPreTrainedModel(PreTrainedModel):
    config_class = NanoChatWindowedConfig
    base_model_prefix = "model"
    _no_split_modules = ["DecoderLayer"]

    def _init_weights(self, module):
        pass  # weights come from the folder; a fresh model is trained by nanochat_fast, with its own init


class NanoChatWindowedModel(NanoChatWindowedPreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        V, d, n = config.vocab_size, config.hidden_size, config.num_hidden_layers
        kv_dim = config.num_key_value_heads * config.head_dim
        self.embed_tokens = nn.Embedding(V, d)
        self.layers = nn.ModuleList([DecoderLayer(config, i) for i in range(n)])
        self.value_embeds = nn.ModuleDict({str(i): nn.Embedding(V, kv_dim) for i in config.value_embed_layers})
        self.resid_lambdas = nn.Parameter(torch.ones(n))
        self.x0_lambdas = nn.Parameter(torch.zeros(n))
        self.smear_gate = nn.Linear(config.smear_channels, 1, bias=False)
        self.smear_lambda = nn.Parameter(torch.zeros(1))
        self.backout_lambda = nn.Parameter(torch.zeros(1))
        self.post_init()

    def _rotary(self, positions, device):
        """(cos, sin) of shape (1, T, 1, head_dim/2) in fp32 for absolute `positions`."""
        dim, base = self.config.head_dim, self.config.rope_parameters["rope_theta"]
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))
        freqs = torch.outer(positions.float(), inv_freq)
        return freqs.cos()[None, :, None, :], freqs.sin()[None, :, None, :]

    def _embed(self, ids):
        return rms_norm(self.embed_tokens(ids), self.config.rms_norm_eps)

    def forward(self, input_ids, cache=None, attention_mask=None, previous_token_ids=None):
        B, T = input_ids.shape
        past = cache.get_seq_length() if cache is not None else 0
        if past and previous_token_ids is None:
            raise ValueError("a forward after cached tokens needs previous_token_ids (B, 1): the token before these")
        positions = torch.arange(past, past + T, device=input_ids.device)
        cos_sin = self._rotary(positions, input_ids.device)
        x = self._embed(input_ids)
        # a padded batch (attention_mask 0 on padding): no query sees a padding key but its own (a row
        # with no key at all would be NaN), and smear adds no padding embedding
        key_mask = attention_mask.bool() if attention_mask is not None and not attention_mask.all() else None
        # smear: each position plus a gate times the previous position's embedding
        gate = self.smear_lambda * torch.sigmoid(self.smear_gate(x[..., : self.config.smear_channels]))
        prev = x[:, :-1] if not past else torch.cat([self._embed(previous_token_ids), x[:, :-1]], dim=1)
        if key_mask is not None:
            prev = prev * key_mask[:, past + T - prev.size(1) - 1 : past + T - 1, None]
        x = torch.cat([x[:, :1], x[:, 1:] + gate[:, 1:] * prev], dim=1) if not past else x + gate * prev
        x0, backout = x, None
        for i, layer in enumerate(self.layers):
            ve = self.value_embeds[str(i)](input_ids) if str(i) in self.value_embeds else None
            x = self.resid_lambdas[i] * x + self.x0_lambdas[i] * x0
            x = layer(x, cos_sin, ve, cache, positions, key_mask)
            if i == self.config.backout_layer:
                backout = x
        return rms_norm(x - self.backout_lambda * backout, self.config.rms_norm_eps)


class NanoChatWindowedForCausalLM(NanoChatWindowedPreTrainedModel, GenerationMixin):
    def __init__(self, config):
        super().__init__(config)
        self.model = NanoChatWindowedModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        cache: Cache | None = None,
        use_cache=None,
        labels=None,
        previous_token_ids=None,
        logits_to_keep=0,
        **kwargs,
    ):
        if use_cache and cache is None:
            cache = DynamicCache()
        x = self.model(input_ids, cache, attention_mask, previous_token_ids)
        if logits_to_keep:
            x = x[:, -logits_to_keep:]
        cap = self.config.final_logit_softcapping
        logits = cap * torch.tanh(self.lm_head(x).float() / cap)
        loss = None
        if labels is not None:  # labels are the inputs; position t predicts token t + 1
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=cache)

    def prepare_inputs_for_generation(self, input_ids, *args, **kwargs):
        """transformers' inputs, and the token before the new ones once the cache holds earlier ones (smear's)."""
        inputs = super().prepare_inputs_for_generation(input_ids, *args, **kwargs)
        new = inputs["input_ids"].shape[1]
        if input_ids.shape[1] > new:
            inputs["previous_token_ids"] = input_ids[:, -new - 1 : -new]
        inputs.pop("position_ids", None)
        return inputs
