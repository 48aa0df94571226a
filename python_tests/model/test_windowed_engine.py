"""The windowed GPT in the batch engine (fp32, temperature 0): past the short window's length, each
conversation gets the same tokens decoded beside others as alone, and alone the argmax of full
forwards without any cache (sliding windows, value embeddings and smear through the slot cache)."""

import pytest
import torch
from support.stub_models import byte_tokenizer, one_thread  # noqa: F401 (an autouse fixture)

from nanochat_fast.kernels import registry
from nanochat_fast.model.batch_engine import BatchEngine, Request
from nanochat_fast.model.windowed_gpt import QK_SCALE, WindowedGPT, WindowedGPTConfig, has_value_embedding

tok = byte_tokenizer()
CONFIG = WindowedGPTConfig(
    sequence_len=256, vocab_size=tok.get_vocab_size(), n_layer=3, n_head=4, n_kv_head=2, n_embd=32, window_pattern="SL"
)
SHORT = min(CONFIG.window_sizes())


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    model = WindowedGPT(CONFIG)
    model.init_weights()
    with torch.no_grad():  # every parameter random: zero projections or a zero smear would test nothing
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape) * (p.shape[-1] ** -0.5 if p.dim() == 2 else 0.3) + (p.dim() == 1) * 0.5)
        model.lm_head.weight[256:] = 0  # special tokens at logit 0, below the best byte: no row stops early
    return model.eval()


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [tok.get_bos_token_id(), *torch.randint(40, 120, (n - 1,), generator=g).tolist()]


REQUESTS = {  # name -> (request, step it joins at)
    "long prompt": (Request(prompt(SHORT + 20, 1), max_tokens=30, use_tools=False), 0),  # prefill past the window
    "long decode": (Request(prompt(40, 2), max_tokens=SHORT, use_tools=False), 0),  # decodes past the window
    "late": (Request(prompt(10, 3), max_tokens=25, use_tools=False), 5),
    "used slot": (Request(prompt(12, 4), max_tokens=10, use_tools=False), 40),  # slot 0, after "long prompt"
}


def decode_alone(model, request):
    engine = BatchEngine(model, tok, slots=1)
    [row] = engine.add(request)
    while engine.active:
        engine.step()
    return row.tokens


def test_beside_others_as_alone_past_the_short_window(model):
    engine = BatchEngine(model, tok, slots=3)
    rows, step = {}, 0
    while step == 0 or engine.active or any(at >= step for _, at in REQUESTS.values()):
        for name, (request, at) in REQUESTS.items():
            if at == step:
                [rows[name]] = engine.add(request)
        engine.step()
        if step == 40:
            assert rows["used slot"].slot == rows["long prompt"].slot and rows["long prompt"].done
        step += 1
    assert len(REQUESTS["long decode"][0].prompt) + len(rows["long decode"].tokens) > SHORT + 1
    for name, (request, _) in REQUESTS.items():
        assert rows[name].tokens == decode_alone(model, request), name


def test_a_used_slot_starts_its_prompt_afresh(model):
    """A prompt in the slot of a conversation that ended gets bitwise the first logits it gets in a
    fresh engine: its first position mixes in no previous embedding (the smear's), the ended
    conversation's last one least of all."""

    def first_logits(engine, request):
        logits = []
        hook = model.register_forward_hook(lambda module, args, out: logits.append(out.clone()))
        try:
            engine.add(request)
            engine.step()
        finally:
            hook.remove()
        return logits[0]

    used = BatchEngine(model, tok, slots=1)
    used.add(REQUESTS["late"][0])
    while used.active:
        used.step()
    request = REQUESTS["used slot"][0]
    assert torch.equal(first_logits(used, request), first_logits(BatchEngine(model, tok, slots=1), request))


def test_alone_is_the_argmax_of_full_forwards(model):
    for name, (request, _) in REQUESTS.items():
        ids = list(request.prompt)
        expected = []
        with torch.no_grad():
            for _ in range(request.max_tokens):
                nxt = int(model(torch.tensor([ids]))[0, -1].argmax())
                expected.append(nxt)
                ids.append(nxt)
        got = decode_alone(model, request)
        assert got == expected[: len(got)] and len(got) > 0, name


def test_decode_steps_under_bf16_autocast(model):
    """Under bf16 autocast (what `--dtype auto` picks on CPUs with native bf16) the gated value
    embedding keeps the values in the keys' dtype, so decode steps write into the bf16 cache; each
    step's logits are those of a full forward under the same autocast, within bf16 rounding."""
    from nanochat_fast.model.decode import SlotBatch, SlotCache, SlotPrefill

    ids = prompt(SHORT + 20, 4)  # past the short window: the S layer's decode steps mask
    cache = SlotCache(CONFIG.n_layer, slots=2, max_len=len(ids) + 4)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.tensor([ids[:-3]]), kv_cache=SlotPrefill(cache, 1))
        assert cache.kv.dtype == torch.bfloat16
        for n in range(len(ids) - 3, len(ids)):
            step = model(torch.tensor([[ids[n]]]), kv_cache=SlotBatch(cache, [1], [n], "cpu"))[0, -1]
            full = model(torch.tensor([ids[: n + 1]]))[0, -1]
            assert (step - full).abs().max() < 0.05 * full.abs().max(), n


def test_short_windows_decode_through_the_kernel_from_their_start(model, monkeypatch):
    """Every decode step's block goes through kernels/decode_step.py's decode_block, the prompt's step (its
    tokens as rows from position 0) first, its attention reading the cache in place: the S layer
    (1 of the 3) with each row's first entry inside its window, once past it; QK_SCALE and the
    per-layer scalars on every layer, the gated value embedding on the layers that have one."""
    from nanochat_fast.model import decode

    calls, real = [], decode.decode_block

    def record(*args, **kw):  # the layer's window, the row's position, whether values were added
        calls.append((kw["window"], int(args[9][0]), kw["ve"] is not None, kw["qk_scale"]))
        assert kw["x0"].shape == args[0].shape and all(isinstance(s, float) for s in kw["scales"])
        return real(*args, **kw)

    monkeypatch.setattr(decode, "decode_block", record)
    request = REQUESTS["long prompt"][0]  # its first decode step is already past the short window
    tokens = decode_alone(model, request)
    prompt_step, calls = calls[: CONFIG.n_layer], calls[CONFIG.n_layer :]
    assert [p for _, p, *_ in prompt_step] == [0] * CONFIG.n_layer
    steps = len(tokens) - 1
    assert len(calls) == CONFIG.n_layer * steps
    assert [w for w, *_ in calls] == model.window_sizes * steps
    gated = [has_value_embedding(i, CONFIG.n_layer) for i in range(CONFIG.n_layer)]
    assert [e for _, _, e, _ in calls] == gated * steps and any(gated) and not all(gated)
    assert {s for *_, s in calls} == {QK_SCALE}
    starts = [p - w for w, p, *_ in calls if w == SHORT]  # where each short-window row's entries begin
    assert starts == [len(request.prompt) + i - SHORT for i in range(steps)]


def test_decode_steps_through_whole_blocks_are_the_ops_one_after_another(model, monkeypatch):
    """The windowed blocks decode as one op each (decode_block, with the per-layer scalars and the
    gated value embedding): every step's logits those of the block's ops one after another, within
    float32 rounding (the gate's sigmoid differs by an ulp), and the same tokens."""

    def run(kernels):
        monkeypatch.setenv(registry.ENV_VAR, kernels)
        logits = []
        hook = model.register_forward_hook(lambda module, args, out: logits.append(out.clone()))
        try:
            engine = BatchEngine(model, tok, slots=2)
            rows = [engine.add(REQUESTS[name][0])[0] for name in ("long decode", "late")]
            while engine.active:
                engine.step()
        finally:
            hook.remove()
        return logits, [row.tokens for row in rows]

    (fused, fused_tokens), (one_by_one, tokens) = run("auto"), run("decode_block=reference")
    assert len(fused) == len(one_by_one) > 20 and fused_tokens == tokens
    for a, b in zip(fused, one_by_one):
        assert (a - b).abs().max() < 1e-4 * b.abs().max()
