"""The decode step's kernels, packed_linear and decode_attention: each against float64 PyTorch, the
batch invariance they promise (a row's result bitwise the same alone as in any batch), the op
contracts (opcheck, bad arguments), and the engine running its decode steps through them: packs
follow weight updates, and a model's decode logits for a row do not depend on the rows beside it."""

import pytest
import torch
import torch.nn.functional as F
from stub_models import byte_tokenizer, one_thread  # noqa: F401 (an autouse fixture)
from tiny_gpt import random_model

from nanochat_fast import optim
from nanochat_fast.kernels import registry
from nanochat_fast.kernels.decode_attention import decode_attention
from nanochat_fast.kernels.packed_linear import pack_linear
from nanochat_fast.model import packed_linears
from nanochat_fast.model.batch_engine import BatchEngine, Request
from nanochat_fast.model.gpt import GPTConfig
from nanochat_fast.model.kv_cache import SlotBatch, SlotCache, SlotPrefill

pytestmark = pytest.mark.skipif(registry.extension() is None, reason="extension not built")
ops = torch.ops.nanochat_fast


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# -- packed_linear ----------------------------------------------------------------------------------

# (rows, in_features, out_features): row counts around the 8-row tile, K around the 64-wide k
# block, N around the 32-column panel
SHAPES = [(1, 256, 1024), (3, 63, 33), (8, 64, 32), (9, 65, 100), (17, 1000, 31), (64, 256, 520), (0, 16, 8)]


@pytest.mark.parametrize("rows,k,n", SHAPES)
def test_packed_linear_matches_float64(rows, k, n):
    x, w = randn(rows, k, seed=1), randn(n, k, seed=2) / k**0.5
    y = pack_linear(w, backend="cpp")(x)
    ref = x.double() @ w.double().T
    assert y.dtype == torch.float32 and y.shape == (rows, n)
    # error of fp32 sums of k products of size ~1/sqrt(k): F.linear's own is the same order
    torch.testing.assert_close(y.double(), ref, rtol=0, atol=2e-6 * max(1, k / 64))
    assert torch.equal(pack_linear(w, backend="reference")(x), F.linear(x, w))


def test_packed_linear_rows_do_not_depend_on_the_batch():
    w = randn(100, 300, seed=3)
    packed = pack_linear(w, backend="cpp")
    x = randn(20, 300, seed=4)
    for rows in (1, 2, 7, 8, 9, 16, 20):
        batch = packed(x[:rows])
        for i in range(rows):
            assert torch.equal(batch[i], packed(x[i : i + 1])[0]), (rows, i)


def test_packed_linear_keeps_leading_dims_and_refuses_bad_input():
    w = randn(40, 16)
    packed = pack_linear(w, backend="cpp")
    x = randn(3, 1, 16)
    assert torch.equal(packed(x), packed(x.view(3, 16)).view(3, 1, 40))
    with pytest.raises(ValueError, match="float32"):
        pack_linear(w.bfloat16(), backend="cpp")
    assert pack_linear(w.bfloat16()).packed is None  # auto: the reference backend takes bf16
    with pytest.raises(ValueError, match="2-D"):
        pack_linear(randn(4))
    with pytest.raises(RuntimeError, match="packed must be"):
        ops.packed_linear(randn(2, 16), packed.packed, 65)
    with pytest.raises(RuntimeError, match="x must be float32"):
        ops.packed_linear(randn(2, 16).double(), packed.packed, 40)


def test_packed_linear_ops_pass_opcheck():
    w = randn(70, 24)
    torch.library.opcheck(ops.pack_linear_weight.default, (w,))
    torch.library.opcheck(ops.packed_linear.default, (randn(5, 24), ops.pack_linear_weight(w), 70))


# -- decode_attention -------------------------------------------------------------------------------


def attention_case(heads=4, kv_heads=2, slots=6, max_len=40, d=16, seed=0):
    """A cache of `slots` slots, the rows of a step in slots 1, 2 and 4 (a gap at 3) at lengths 1,
    40 and 17: block views as SlotBatch gives them (slots 1..4, up to the longest row)."""
    cache = randn(2, slots, kv_heads, max_len, d, seed=seed)
    rows_slots, lengths = torch.tensor([1, 2, 4]), torch.tensor([1, 40, 17])
    q = randn(len(rows_slots), heads, 1, d, seed=seed + 1)
    keys, values = cache[0, 1:5, :, :max_len], cache[1, 1:5, :, :max_len]
    return q, keys, values, rows_slots - 1, lengths


def float64_attention(q, keys, values, rows, lengths):
    """Each row alone, by SDPA in float64 over exactly its own entries."""
    out = []
    for b, (r, n) in enumerate(zip(rows.tolist(), lengths.tolist())):
        k, v = keys[r : r + 1, :, :n].double(), values[r : r + 1, :, :n].double()
        out.append(F.scaled_dot_product_attention(q[b : b + 1].double(), k, v, enable_gqa=True))
    return torch.cat(out)


@pytest.mark.parametrize("backend", ["cpp", "reference"])
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (2, 2), (3, 1)])
def test_decode_attention_matches_float64(backend, heads, kv_heads):
    q, keys, values, rows, lengths = attention_case(heads, kv_heads)
    y = decode_attention(q, keys, values, rows, lengths, enable_gqa=heads != kv_heads, backend=backend)
    assert y.shape == q.shape
    assert (y.double() - float64_attention(q, keys, values, rows, lengths)).abs().max() < 1e-6


@pytest.mark.parametrize("backend", ["cpp", "reference"])
def test_decode_attention_from_each_rows_start(backend):
    """A sliding window's rows: row b reads entries starts[b]..lengths[b]-1 only (row 0 from its
    first, the others from 30 and 9), as float64 SDPA over exactly those entries; rows in the
    block's gaps see nothing of it."""
    q, keys, values, rows, lengths = attention_case()
    starts = torch.tensor([0, 30, 9])
    y = decode_attention(q, keys, values, rows, lengths, enable_gqa=True, starts=starts, backend=backend)
    expected = torch.cat(
        [
            float64_attention(q[b : b + 1], keys[:, :, s:], values[:, :, s:], rows[b : b + 1], lengths[b : b + 1] - s)
            for b, s in enumerate(starts.tolist())
        ]
    )
    assert (y.double() - expected).abs().max() < 1e-6
    whole = decode_attention(q, keys, values, rows, lengths, enable_gqa=True, backend=backend)
    assert torch.equal(y[0], whole[0]) and not torch.allclose(y[1:], whole[1:])  # the starts count


def test_decode_attention_rows_do_not_depend_on_the_batch():
    q, keys, values, rows, lengths = attention_case()
    together = decode_attention(q, keys, values, rows, lengths, enable_gqa=True, backend="cpp")
    for b in range(len(rows)):
        alone = decode_attention(
            q[b : b + 1], keys, values, rows[b : b + 1], lengths[b : b + 1], enable_gqa=True, backend="cpp"
        )
        assert torch.equal(together[b], alone[0]), b


def test_decode_attention_refuses_bad_input():
    q, keys, values, rows, lengths = attention_case()
    with pytest.raises(RuntimeError, match=r"lengths\[1\] = 41 is outside \[1, 40\]"):
        ops.decode_attention(q.squeeze(2), keys, values, rows, torch.tensor([1, 41, 2]), 0.25)
    with pytest.raises(RuntimeError, match=r"rows\[0\] = 4 is outside \[0, 4\)"):
        ops.decode_attention(q.squeeze(2), keys, values, torch.tensor([4, 1, 2]), lengths, 0.25)
    with pytest.raises(RuntimeError, match=r"starts\[2\] = 17 is outside \[0, lengths\[2\] = 17\)"):
        ops.decode_attention(q.squeeze(2), keys, values, rows, lengths, 0.25, torch.tensor([0, 0, 17]))
    with pytest.raises(ValueError, match="enable_gqa"):
        decode_attention(q, keys, values, rows, lengths)
    with pytest.raises(ValueError, match="float32"):
        decode_attention(q.bfloat16(), keys.bfloat16(), values.bfloat16(), rows, lengths, True, backend="cpp")


def test_decode_attention_op_passes_opcheck():
    q, keys, values, rows, lengths = attention_case()
    torch.library.opcheck(ops.decode_attention.default, (q.squeeze(2), keys, values, rows, lengths, 0.25))
    starts = torch.tensor([0, 30, 9])
    torch.library.opcheck(ops.decode_attention.default, (q.squeeze(2), keys, values, rows, lengths, 0.25, starts))


# -- the engine's decode steps ----------------------------------------------------------------------

tok = byte_tokenizer()
CONFIG = GPTConfig(sequence_len=96, vocab_size=tok.get_vocab_size(), n_layer=2, n_head=4, n_kv_head=2, n_embd=64)


@pytest.fixture
def model():
    return random_model(CONFIG, seed=5).eval()


def packs_seen(model, run) -> list[bool]:
    """Per lm_head call inside run(): whether it ran through a packed weight."""
    seen = []
    hook = model.lm_head.register_forward_pre_hook(
        lambda module, args: seen.append(packed_linears.current(module) is not None)
    )
    try:
        run()
    finally:
        hook.remove()
    return seen


def generate(model, prompt, n=6) -> list[int]:
    engine = BatchEngine(model, tok, slots=2)
    [row] = engine.add(Request(prompt, n, use_tools=False))
    while engine.active:
        engine.step()
    return row.tokens


def greedy_by_full_forwards(model, prompt, n=6) -> list[int]:
    """Greedy tokens from forwards over the whole sequence: no cache, no packs."""
    tokens = []
    with torch.no_grad():
        for _ in range(n):
            tokens.append(int(model(torch.tensor([prompt + tokens]))[0, -1].argmax()))
    return tokens


def test_decode_steps_run_packed_and_follow_weight_updates(model):
    prompt = tok.encode("hello there", prepend="<|bos|>")
    seen = packs_seen(model, lambda: generate(model, prompt))
    assert seen == [True] * 6  # every decode step packed, and the prefill of a prompt of a few tokens
    # in-place ops on the parameters themselves: the next decode must see them
    with torch.no_grad():
        model.lm_head.weight.mul_(-1.0)
        model.transformer.h[0].mlp.c_fc.weight.add_(0.5)
    assert generate(model, prompt) == greedy_by_full_forwards(model, prompt)
    # our optimizers write through p.data and mark the parameters updated: their steps must be
    # seen too, driven as the training loop drives them (optim.step: clipping) or one by one
    optimizers = model.setup_optimizers(unembedding_lr=0.5, matrix_lr=0.5)
    drivers = [lambda: optim.step(optimizers, grad_clip=1.0), lambda: [opt.step() for opt in optimizers]]
    for drive in drivers:
        before = generate(model, prompt)
        ids = torch.tensor([prompt + before])
        model(ids[:, :-1], targets=ids[:, 1:]).backward()
        drive()
        model.zero_grad(set_to_none=True)
        after = generate(model, prompt)
        assert after == greedy_by_full_forwards(model, prompt) and after != before
    # under bf16 autocast (a CPU whose bf16 is fast) the stock bf16 matmuls run instead
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert packs_seen(model, lambda: generate(model, prompt)) == [False] * 6


def test_a_rows_decode_logits_do_not_depend_on_the_rows_beside_it(model):
    """Three prompts of different lengths prefilled into slots 0, 2, 5; one decode step of all three
    and one of each alone give bitwise the same logits for every row."""
    prompts = {
        0: tok.encode("a", prepend="<|bos|>"),
        2: tok.encode("a longer prompt here", prepend="<|bos|>"),
        5: tok.encode("medium one", prepend="<|bos|>"),
    }
    cache = SlotCache(CONFIG.n_layer, slots=6, max_len=CONFIG.sequence_len)
    with torch.inference_mode():
        for slot, ids in prompts.items():
            model(torch.tensor([ids]), kv_cache=SlotPrefill(cache, slot))

        def step(slots):
            batch = SlotBatch(cache, slots, [len(prompts[s]) for s in slots], model.get_device())
            with packed_linears.decoding(model, len(slots)):
                return model(torch.tensor([[7] for _ in slots]), kv_cache=batch)[:, -1]

        together = step([0, 2, 5])
        for i, slot in enumerate([0, 2, 5]):
            assert torch.equal(together[i], step([slot])[0]), slot
