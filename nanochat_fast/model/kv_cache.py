"""
The GPT's key/value cache, what a forward pass writes each layer's keys and values into so that the
next token costs one position instead of the whole sequence.

SlotCache is the continuous-batching cache of batch_engine.py (every generation path goes through
the engine). Storage for `slots` sequences is preallocated once, [n_layer, 2, slots, n_kv_head,
max_len, head_dim]; each conversation holds one slot while it decodes and gives it back when it
ends. Two views write into it:
    SlotPrefill  prompts run into their slots, all from one position (get_pos() an int), so the
                 model's usual causal path runs them: one prompt, or several right-padded to the
                 longest (the prompts of requests that joined together, from position 0).
    SlotBatch    one decode step of rows at different lengths: row i feeds one token at its own
                 position in its own slot, and attends to its own valid entries only. A short
                 prompt may run in the same step as rows of its own, a token each, from position 0.
"""

import torch

from ..kernels.decode_step import decode_attention, decode_block


class SlotCache:
    """Preallocated keys and values for `slots` sequences of up to `max_len` positions each.

    The storage is made at the first keys written (SlotPrefill/SlotBatch.insert_kv), taking their
    heads, head_dim, dtype and device: so it is bf16 when the model computes under bf16 autocast.
    It is zero-filled rather than left empty: decode attention's reference backend reads whole
    blocks of it and masks the entries a row may not see, and a masked entry must still be a finite
    number (0 * NaN is NaN).
    Entries left by a slot's previous conversation are finite and masked the same way, so a slot
    is reused as is, without clearing.
    """

    def __init__(self, n_layer: int, slots: int, max_len: int):
        self.n_layer, self.slots, self.max_len = n_layer, slots, max_len
        self.kv = None
        self.embeddings = None  # each slot's last input embedding (the windowed GPT's smear reads it)

    @staticmethod
    def nbytes(n_layer: int, slots: int, n_kv_head: int, max_len: int, head_dim: int, dtype) -> int:
        return n_layer * 2 * slots * n_kv_head * max_len * head_dim * dtype.itemsize

    def storage(self, k: torch.Tensor) -> torch.Tensor:
        """The storage, allocated on the first call from the shape, dtype and device of k (B, H, T, D)."""
        if self.kv is None:
            self.allocate(k.size(1), k.size(3), k.dtype, k.device)
        return self.kv

    def allocate(self, n_kv_head: int, head_dim: int, dtype, device):
        """Make the storage now, where no keys will make it (a first step that runs its prompts as
        a slot batch's rows reads the cache before any layer's keys exist)."""
        self.kv = torch.zeros(
            self.n_layer, 2, self.slots, n_kv_head, self.max_len, head_dim, dtype=dtype, device=device
        )

    def copy_slot(self, src: int, dst: int, length: int):
        """Slot dst continues from slot src's first `length` positions (a prompt run once, sampled
        in several slots; `length` is all src holds, so its last embedding is position length-1's)."""
        if self.kv is not None:
            self.kv[:, :, dst, :, :length] = self.kv[:, :, src, :, :length]
        if self.embeddings is not None:
            self.embeddings[dst] = self.embeddings[src]

    def embedding_store(self, x: torch.Tensor) -> torch.Tensor:
        """(slots, C) float32: each slot's last input embedding (allocated at the first call, for x's C)."""
        if self.embeddings is None:
            self.embeddings = torch.zeros(self.slots, x.size(-1), dtype=torch.float32, device=x.device)
        return self.embeddings

    def previous_embedding(self, view, x: torch.Tensor) -> torch.Tensor:
        """(B, C): the input embedding of the position before each row's first prompt token in the
        SlotPrefill `view`, zero for rows starting at position 0. (A decode step's smear reads and
        keeps the embeddings in one op: kernels/smear.py.)"""
        prev = self.embedding_store(x)[view.slots]
        return prev if view.pos > 0 else torch.zeros_like(prev)

    def keep_embedding(self, view, x: torch.Tensor):
        """Store each row's last input embedding of x (B, T, C) (view.last) for its next step."""
        self.embeddings[view.slots] = view.last(x).float()


class SlotPrefill:
    """Prompts run into their slots: row b of the batch into slot slots[b], every row from the same
    position, so the model's usual causal path runs them. Several rows are prompts into empty slots
    (from position 0), right-padded to the longest: row b's first lengths[b] positions are its own;
    the padding's keys and values land after them, where nothing reads them (a decode step attends
    to a row's own entries and writes its next token over the first of them). One row may also
    continue from where its previous chunk stopped."""

    def __init__(
        self, cache: SlotCache, slots: int | list[int], lengths: list[int] | None = None, last_logits: bool = False
    ):
        self.cache, self.pos = cache, 0
        self.slots = [slots] if isinstance(slots, int) else list(slots)
        self.lengths = lengths  # None: every position of every row is its own
        self.last_logits = last_logits  # the model's logits for each row's last position only

    def logit_positions(self, x: torch.Tensor) -> torch.Tensor:
        """The positions of the last hidden states x (B, T, C) the model makes logits of: all, or
        with last_logits each row's last (B, 1, C), which is all the engine samples from (the
        unembedding of every prompt position would cost a prefill about a quarter of its work)."""
        return self.last(x)[:, None] if self.last_logits else x

    def get_pos(self) -> int:
        return self.pos

    def last(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C): each row's last own position of x (B, T, C)."""
        if self.lengths is None:
            return x[:, -1]
        ends = torch.tensor(self.lengths, device=x.device) - 1
        return x[torch.arange(x.size(0), device=x.device), ends]

    def insert_kv(self, layer_idx, k, v):
        """Store k, v (B, H_kv, T, D) at the current position of each row's slot; return each
        slot's keys/values so far, (B, H_kv, position + T, D)."""
        t0, t1 = self.pos, self.pos + k.size(2)
        if t1 > self.cache.max_len:
            raise ValueError(f"a slot holds {self.cache.max_len} positions, asked to grow to {t1}")
        kv = self.cache.storage(k)
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
    """One decode step of B rows: row i feeds one token at position positions[i] of slot slots[i],
    after what the slot holds. Rows are in increasing (slot, position) order. A slot has one row
    when it continues its sequence, or several at consecutive positions from 0 when a prompt runs
    in the step as rows of its own (batch_engine.py): every row's key is written before any row
    attends, so each of them sees the ones before it, and a row at position 0 starts its slot
    afresh (no previous embedding for the windowed GPT's smear).

    Attention reads the cache in place, with no copy of any row's keys: the block of slots from the
    rows' lowest slot to their highest, up to the longest row's length, each row to its own entries
    0..positions[i] (kernels/decode_attention.py). The model makes logits of the rows `logits_of`
    (all when None), in that order. Everything built here is small index tensors.
    """

    def __init__(
        self, cache: SlotCache, slots: list[int], positions: list[int], device, logits_of: list[int] | None = None
    ):
        rows = list(zip(slots, positions))
        if len(slots) != len(positions) or not rows or any(a >= b for a, b in zip(rows, rows[1:])):
            raise ValueError("a slot batch takes rows in increasing (slot, position) order, one position each")
        if min(positions) < 0:
            raise ValueError(f"a slot batch's positions are >= 0, got {min(positions)}")
        self.cache = cache
        self.lo, self.hi = slots[0], slots[-1] + 1
        self.length = max(positions) + 1  # keys in the block per slot: the longest row's
        self.slots = torch.tensor(slots, dtype=torch.long, device=device)
        self.positions = torch.tensor(positions, dtype=torch.long, device=device)
        self.rows_in_block = self.slots - self.lo  # each row's slot within the block
        self.logits_of = None if logits_of is None else torch.tensor(logits_of, dtype=torch.long, device=device)
        self._block = None  # the cache's [n_layer, 2, slots lo..hi, H_kv, length, D], a view
        starting = [slot for slot, position in rows if position == 0]
        if starting and cache.embeddings is not None:
            cache.embeddings[starting] = 0.0

    def get_pos(self) -> torch.Tensor:
        """Each row's position, (B,) int64: where its token goes and which rotary angles it gets."""
        return self.positions

    def logit_positions(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, 1, C) -> the rows the model makes logits of."""
        return x if self.logits_of is None else x.index_select(0, self.logits_of)

    def block(self, layer_idx, x, packs, cos_sin, n_head: int, qk_scale=1.0, window=None, **windowed):
        """A whole block for the step's rows, x (B, 1, C) -> (B, 1, C), through its packs (qkv,
        attention proj, MLP fc and proj); qk_scale, window and the windowed family's parts (x0,
        scales, ve, ve_gate) as kernels/decode_block.py takes them."""
        cache = self._layer_block(layer_idx)
        return decode_block(
            x, *packs, *cos_sin, cache, self.rows_in_block, self.positions, n_head,
            qk_scale=qk_scale, window=window, **windowed,
        )  # fmt: skip

    def attention(self, layer_idx, q, k, v, cos_sin, enable_gqa: bool, qk_scale: float = 1.0, window=None):
        """The step's attention from the projections q (B, 1, H, D), k, v (B, 1, H_kv, D): rotary
        (cos_sin, the rows' angles) and QK-norm times qk_scale, each row's key and value stored at its
        position in its slot, each row's query over its own entries (with a window, the `window`
        before its position and its own) -> (B, 1, H * D). kernels/decode_attention.py."""
        cache = self._layer_block(layer_idx, k.transpose(1, 2))
        return decode_attention(
            q, k, v, *cos_sin, cache, self.rows_in_block, self.positions,
            qk_scale=qk_scale, window=window, enable_gqa=enable_gqa,
        )  # fmt: skip

    def _layer_block(self, layer_idx, k=None):
        """Layer layer_idx's keys and values of the block, [2, slots lo..hi, H_kv, length, D], a view
        of the cache; the block of every layer is made once a step, at its first layer. k (B, H_kv, 1,
        D): allocate the storage from it if no prefill did."""
        if self._block is None:
            kv = self.cache.kv if k is None else self.cache.storage(k)
            if kv is None:
                raise ValueError("the cache holds no keys yet: run the prompts first, or allocate() its storage")
            self._block = kv[:, :, self.lo : self.hi, :, : self.length]
        return self._block[layer_idx]
