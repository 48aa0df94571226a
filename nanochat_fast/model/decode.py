"""
The batch engine's side of the model: SlotCache, the keys and values of its sequences; its views SlotPrefill
(prompts run into their slots by the model's own forward) and SlotBatch (one decode step, each row a token at
its own position in its own slot); decode_step, a SlotBatch's forward, through packed weights where they help.
"""

import weakref
from functools import partial

import torch

from ..kernels import decode_block, pack_linear, requested, rms_norm, smear_decode
from ..kernels.decode_step import MAX_ROWS


class SlotCache:
    """Keys and values for `slots` sequences of up to `max_len` positions, made in the first keys' dtype.
    Zero-filled: a masked entry must be finite (0 * NaN is NaN); a used slot is reused as it is."""

    def __init__(self, n_layer: int, slots: int, max_len: int):
        self.n_layer, self.slots, self.max_len = n_layer, slots, max_len
        self.kv = None
        self.embeddings = None  # each slot's last input embedding (the windowed GPT's smear reads it)

    def allocate(self, n_kv_head: int, head_dim: int, dtype, device):
        self.kv = torch.zeros(
            self.n_layer, 2, self.slots, n_kv_head, self.max_len, head_dim, dtype=dtype, device=device
        )

    def copy_slot(self, src: int, dst: int, length: int):
        if self.kv is not None:
            self.kv[:, :, dst, :, :length] = self.kv[:, :, src, :, :length]
        if self.embeddings is not None:
            self.embeddings[dst] = self.embeddings[src]

    def embedding_store(self, x: torch.Tensor) -> torch.Tensor:
        if self.embeddings is None:
            self.embeddings = torch.zeros(self.slots, x.size(-1), dtype=torch.float32, device=x.device)
        return self.embeddings


class SlotPrefill:
    """Prompts run into their slots by the model's causal forward, row b into slots[b]: several into empty
    slots, right-padded (row b's own positions: lengths[b]; nothing reads the padding's keys), or a next chunk."""

    def __init__(self, cache: SlotCache, slots: int | list[int], lengths: list | None = None, last_logits=False):
        self.cache, self.pos = cache, 0
        self.slots = [slots] if isinstance(slots, int) else list(slots)
        self.lengths = lengths  # None: every position of every row is its own
        self.last_logits = last_logits  # logits of each row's last position only: all the engine samples

    def get_pos(self) -> int:
        return self.pos

    def last(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C): each row's last own position."""
        if self.lengths is None:
            return x[:, -1]
        ends = torch.tensor(self.lengths, device=x.device) - 1
        return x[torch.arange(x.size(0), device=x.device), ends]

    def logit_positions(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(x)[:, None] if self.last_logits else x

    def previous_embedding(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C): the input embedding before each row's first token here, zero from position 0."""
        prev = self.cache.embedding_store(x)[self.slots]
        return prev if self.pos > 0 else torch.zeros_like(prev)

    def keep_embedding(self, x: torch.Tensor):
        self.cache.embeddings[self.slots] = self.last(x).float()

    def insert_kv(self, layer_idx, k, v):
        """Store k, v (B, H_kv, T, D) in the rows' slots; return each slot's keys and values so far."""
        t0, t1 = self.pos, self.pos + k.size(2)
        if t1 > self.cache.max_len:
            raise ValueError(f"a slot holds {self.cache.max_len} positions, asked to grow to {t1}")
        if self.cache.kv is None:
            self.cache.allocate(k.size(1), k.size(3), k.dtype, k.device)
        kv = self.cache.kv
        if len(self.slots) == 1:
            slot = self.slots[0]
            kv[layer_idx, 0, slot, :, t0:t1] = k[0]
            kv[layer_idx, 1, slot, :, t0:t1] = v[0]
            out = kv[layer_idx, 0, slot : slot + 1, :, :t1], kv[layer_idx, 1, slot : slot + 1, :, :t1]
        else:
            if t0 != 0:
                raise ValueError("several prompts are prefilled together only into empty slots (from position 0)")
            kv[layer_idx, 0, self.slots, :, :t1] = k
            kv[layer_idx, 1, self.slots, :, :t1] = v
            out = k, v  # what the slots now hold, as written
        if layer_idx == self.cache.n_layer - 1:
            self.pos = t1
        return out


class SlotBatch:
    """One decode step, row i feeding a token at positions[i] of slot slots[i], in (slot, position) order: a
    slot's one row continuing it, or a prompt's rows from position 0. Logits of the rows `logits_of` (None: all)."""

    def __init__(self, cache: SlotCache, slots: list[int], positions: list[int], device, logits_of: list | None = None):
        rows = list(zip(slots, positions))
        if len(slots) != len(positions) or not rows or any(a >= b for a, b in zip(rows, rows[1:])):
            raise ValueError("a slot batch takes rows in increasing (slot, position) order, one position each")
        if min(positions) < 0:
            raise ValueError(f"a slot batch's positions are >= 0, got {min(positions)}")
        self.cache = cache
        self.lo, self.hi = slots[0], slots[-1] + 1
        self.length = max(positions) + 1  # the block attention reads in place: slots lo..hi, the longest row
        self.slots = torch.tensor(slots, dtype=torch.long, device=device)
        self.positions = torch.tensor(positions, dtype=torch.long, device=device)
        self.rows_in_block = self.slots - self.lo
        self.logits_of = None if logits_of is None else torch.tensor(logits_of, dtype=torch.long, device=device)
        self._block = None
        starting = [slot for slot, position in rows if position == 0]
        if starting and cache.embeddings is not None:
            cache.embeddings[starting] = 0.0

    def get_pos(self) -> torch.Tensor:
        return self.positions

    def logit_positions(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.logits_of is None else x.index_select(0, self.logits_of)

    def layer(self, layer_idx: int) -> torch.Tensor:
        """Layer layer_idx's keys and values of the block, [2, slots lo..hi, H_kv, length, D], a view."""
        if self._block is None:
            if self.cache.kv is None:
                raise ValueError("the cache holds no keys yet: run the prompts first, or allocate() its storage")
            self._block = self.cache.kv[:, :, self.lo : self.hi, :, : self.length]
        return self._block[layer_idx]


def linears_of(model) -> dict:
    """A decode step's products, module -> the linears it multiplies by (weights' rows stacked: q, k, v)."""
    out = {model.lm_head: (model.lm_head,)}
    for block in model.transformer.h:
        attn, mlp = block.attn, block.mlp
        out[attn] = (attn.c_q, attn.c_k, attn.c_v)
        out |= {m: (m,) for m in (attn.c_proj, mlp.c_fc, mlp.c_proj)}
    return out


class PackedLinears:
    """A model's decode-step products packed (kernels.pack_linear), kept with it for the engines that come
    and go, remade when a weight's storage or version moves (any in-place change but a write to p.data)."""

    def __init__(self, model):
        self.sources = linears_of(model)
        self.weights = [m._parameters["weight"] for parts in self.sources.values() for m in parts]
        self.packs, self.packed_at, self.seen = {}, {}, None

    def current(self) -> dict:
        """module -> its pack, repacking what changed (or whose backend NANOCHAT_FAST_KERNELS changed)."""
        seen = (requested("packed_linear"), *[(w.data_ptr(), w._version) for w in self.weights])
        if seen != self.seen:
            for module, parts in self.sources.items():
                key = (seen[0], *((p.weight.data_ptr(), p.weight._version) for p in parts))
                if self.packed_at.get(module) != key:
                    w = parts[0].weight if len(parts) == 1 else torch.cat([p.weight for p in parts])
                    self.packs[module], self.packed_at[module] = pack_linear(w), key
            self.seen = seen
        return self.packs


_packs_of: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def usable(model, rows: int) -> bool:
    """Whether a step of `rows` rows runs through packed weights: a CPU, no autocast (under bf16 the stock
    bf16 matmuls run), no gradient (the packed op has none), at most MAX_ROWS rows, where they beat sgemm."""
    fp32_cpu = model.get_device().type == "cpu" and not torch.is_autocast_enabled("cpu")
    return fp32_cpu and rows <= MAX_ROWS and not torch.is_grad_enabled()


def packed_linears(model, rows: int) -> dict | None:
    if not usable(model, rows):
        return None
    if model not in _packs_of:
        _packs_of[model] = PackedLinears(model)
    return _packs_of[model].current()


def nbytes(model) -> int:
    """Bytes of the packed copies held for `model`."""
    packs = _packs_of.get(model)
    return 0 if packs is None else sum(p.packed.nbytes for p in packs.packs.values() if p.packed is not None)


def _stacked(parts, h):
    return torch.cat([p(h) for p in parts], dim=-1)


def decode_step(model, idx: torch.Tensor, batch: SlotBatch) -> torch.Tensor:
    """A decode step of either family: idx (B, 1) -> the lm_head's fp32 products (before the softcap) of
    the rows batch.logits_of; where no pack helps, through decode_block's reference backend."""
    rows = idx.size(0) if batch.logits_of is None else batch.logits_of.numel()  # prompt rows ride along
    packs = products = packed_linears(model, rows)
    if packs is None:
        products = {m: p[0] if len(p) == 1 else partial(_stacked, p) for m, p in linears_of(model).items()}
    pos = batch.positions
    cos, sin = model.cos[0, pos].unsqueeze(1), model.sin[0, pos].unsqueeze(1)
    x = rms_norm(model.transformer.wte(idx))
    windowed = model.arch == "windowed"
    if windowed:  # its smear; the layers' scalars as floats, read once
        x = smear_decode(x, batch.cache.embedding_store(x), batch.slots, model.smear_gate.weight, model.smear_lambda)
        x0, resid, x0_lambdas = x, model.resid_lambdas.tolist(), model.x0_lambdas.tolist()
    for i, block in enumerate(model.transformer.h):
        attn, mlp, extra = block.attn, block.mlp, {}
        if windowed:
            ve = model.value_embeds[str(i)](idx).to(x.dtype) if str(i) in model.value_embeds else None
            extra = dict(window=attn.window, qk_scale=attn.qk_scale, x0=x0, scales=(resid[i], x0_lambdas[i]), ve=ve)
            extra["ve_gate"] = None if ve is None else attn.ve_gate.weight
        x = decode_block(
            x, products[attn], products[attn.c_proj], products[mlp.c_fc], products[mlp.c_proj], cos, sin,
            batch.layer(i), batch.rows_in_block, pos, attn.n_head, backend=None if packs else "reference", **extra,
        )  # fmt: skip
        if windowed and i == model.config.n_layer // 2:
            x_backout = x
    if windowed:
        x = x - model.backout_lambda.to(x.dtype) * x_backout
    return products[model.lm_head](rms_norm(batch.logit_positions(x))).float()
