"""
Decode steps through packed weights. A decode step multiplies a few rows (one per conversation) by
every weight of the model: the shape where CPU sgemm is slowest, and where kernels/packed_linear.py
is fast and gives each row the same result whatever rows share the step. While BatchEngine runs a
decode step (`with decoding(model, rows)`), every gpt.Linear of the model takes its packed weight
from here; outside one (training, prefill, evaluation of logits) nothing changes.

The packs are kept with the model, so that the engines that come and go (one per generate call)
share them, and remade when a weight's version counter moves: any in-place change of the parameter
(an optimizer step, torch.optim's or this package's; load_state_dict). A write through p.data
outside an optimizer leaves the counter alone and is not seen. They cost one more copy of the
linear weights.
"""

import contextlib
import contextvars
import weakref

import torch
import torch.nn as nn

from ..kernels import registry
from ..kernels.decode_step import MAX_ROWS, PackedLinear, pack_linear
from ..kernels.decode_step import PACKED_LINEAR as OP

# The packs of the decode step running in this thread (module -> PackedLinear), None outside one.
# A context variable: chat_web's replicas decode in threads of their own.
_active: contextvars.ContextVar = contextvars.ContextVar("packed_linears", default=None)
_by_model: "weakref.WeakKeyDictionary[nn.Module, PackedLinears]" = weakref.WeakKeyDictionary()


def current(module: nn.Module):
    """The packed weight of `module` in the decode step running in this thread, or None; for an
    attention module, its c_q, c_k and c_v stacked (one product gives q, k and v side by side); for a
    block that decodes as one op, its four packs (kernels/decode_block.py)."""
    packs = _active.get()
    return None if packs is None else packs.get(module)


def _qkv(module: nn.Module) -> tuple[nn.Module, ...] | None:
    """An attention module's query, key and value projections (c_q, c_k, c_v), or None."""
    parts = tuple(getattr(module, name, None) for name in ("c_q", "c_k", "c_v"))
    return parts if all(isinstance(p, nn.Linear) and p.bias is None for p in parts) else None


class PackedLinears:
    """Packed copies of a model's nn.Linear weights, kept up to date with the weights. An attention
    module's c_q, c_k and c_v are packed as one weight, their rows stacked: one product for the three
    (gpt.project_qkv), where three cost three calls' dispatch on a decode step's few rows."""

    def __init__(self, model: nn.Module):
        self.qkv = {m: parts for m in model.modules() if (parts := _qkv(m)) is not None}
        # blocks that decode as one op (gpt.Block): their packs (qkv, attention proj, MLP fc and proj)
        self.blocks = [m for m in model.modules() if getattr(m, "decodes_as_one_op", False) and m.attn in self.qkv]
        fused = {p for parts in self.qkv.values() for p in parts}
        linears = [m for m in model.modules() if isinstance(m, nn.Linear) and m.bias is None and m not in fused]
        # what is packed: a module's own weight, or an attention module's three stacked
        self.sources = {m: (m,) for m in linears} | self.qkv
        self.packs: dict[nn.Module, PackedLinear] = {}
        self._packed_at: dict[nn.Module, tuple] = {}  # what each module's weights were when packed
        self._seen = None  # what all the weights were at the last call
        self._linears = [p for parts in self.sources.values() for p in parts]

    def current(self) -> dict[nn.Module, PackedLinear]:
        """module -> its PackedLinear, repacking the weights that changed since they were packed
        (module docstring), or whose backend NANOCHAT_FAST_KERNELS changed. A new dtype or device
        is new storage: the data pointer says it. Called once a decode step: when nothing changed
        (one look at every weight) it returns at once."""
        weights = [p._parameters["weight"] for p in self._linears]  # (nn.Module's __getattr__ costs 2x)
        seen = (registry.requested(OP), *[(w.data_ptr(), w._version) for w in weights])
        if seen == self._seen:
            return self.packs
        for module, parts in self.sources.items():
            key = (seen[0], *((p.weight.data_ptr(), p.weight._version) for p in parts))
            if self._packed_at.get(module) != key:
                w = parts[0].weight if len(parts) == 1 else torch.cat([p.weight for p in parts])
                self.packs[module], self._packed_at[module] = pack_linear(w), key
        for block in self.blocks:
            parts = (block.attn, block.attn.c_proj, block.mlp.c_fc, block.mlp.c_proj)
            self.packs[block] = tuple(self.packs[m] for m in parts)
        self._seen = seen
        return self.packs


def nbytes(model: nn.Module) -> int:
    """Bytes of the packed copies held for `model` (0 before its first packed decode step)."""
    packs = _by_model.get(model)
    if packs is None:
        return 0
    return sum(p.packed.nbytes for p in packs.packs.values() if isinstance(p, PackedLinear) and p.packed is not None)


def usable(model: nn.Module, rows: int) -> bool:
    """Whether products of `rows` rows run through the packed weights: a CPU, no autocast (under
    bf16 autocast the stock bf16 matmuls run), no gradient wanted (the packed op has no backward)
    and at most MAX_ROWS rows, where they beat sgemm."""
    device = model.get_device()
    return (
        device.type == "cpu"
        and rows <= MAX_ROWS
        and not torch.is_grad_enabled()
        and not torch.is_autocast_enabled("cpu")
    )


@contextlib.contextmanager
def decoding(model: nn.Module, rows: int):
    """Run the model's linears through their packed weights inside the block, when that helps (usable)."""
    if not usable(model, rows):
        yield
        return
    packs = _by_model.get(model)
    if packs is None:
        packs = _by_model[model] = PackedLinears(model)
    token = _active.set(packs.current())
    try:
        yield
    finally:
        _active.reset(token)
