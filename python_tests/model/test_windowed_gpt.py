"""The windowed GPT against nanochat's own code (its gpt.py and optim.py at 92d63d4), through a
fixture that code recorded (support/fixtures/make_nanochat_fixture.py): the same weights and tokens
give the same logits, and one step of the same optimizer groups the same weights."""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from nanochat_fast import optim
from nanochat_fast.model.loading import new_model
from nanochat_fast.model.windowed_gpt import WindowedGPTConfig
from nanochat_fast.optim import MuonRecipe

FIXTURE = Path(__file__).resolve().parents[1] / "support" / "fixtures" / "nanochat_windowed.pt"


@pytest.fixture(scope="module")
def fixture():
    return torch.load(FIXTURE, weights_only=False)


def ours(fix):
    config = WindowedGPTConfig(**fix["config"])
    V = config.vocab_size
    state = {k: v[:V] if v.dim() == 2 and v.size(0) > V else v for k, v in fix["weights"].items()}
    return new_model(config, torch.device("cpu"), state), V


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def test_the_fixture_exercises_short_and_long_windows(fixture):
    config = WindowedGPTConfig(**fixture["config"])
    short, long = min(config.window_sizes()), max(config.window_sizes())
    assert short < long and fixture["tokens"].size(1) - 1 > short + 1
    assert config.window_sizes()[-1] == long


def test_logits_equal_nanochats(fixture):
    model, V = ours(fixture)
    x = fixture["tokens"][:, :-1]
    with torch.no_grad():
        logits = model(x)
    stride = fixture["logit_stride"]
    assert relative_error(logits[:, ::stride], fixture["logits"]) < 1e-5
    # and a model attending to the full context everywhere is not the same function
    full, _ = ours({**fixture, "config": {**fixture["config"], "window_pattern": "L"}})
    with torch.no_grad():
        assert relative_error(full(x)[:, ::stride], fixture["logits"]) > 1e-3


def test_one_optimizer_step_equals_nanochats(fixture):
    model, V = ours(fixture)
    setup = fixture["setup"]
    recipe = MuonRecipe.preset("polar-normuon", ns_dtype="fp32", momentum=0.95, weight_decay=setup["weight_decay"])
    optimizers = model.setup_optimizers(
        unembedding_lr=setup["unembedding_lr"],
        embedding_lr=setup["embedding_lr"],
        matrix_lr=setup["matrix_lr"],
        scalar_lr=setup["scalar_lr"],
        muon_recipe=recipe,
    )
    x, y = fixture["tokens"][:, :-1], fixture["tokens"][:, 1:]
    loss = model(x, y)  # the fused lm_head + cross-entropy
    assert abs(loss.item() - fixture["loss"].item()) < 1e-5 * fixture["loss"].item()
    # the gradient through the logits, as nanochat takes it: the step is compared, not rounding
    # differences of the loss's backward (Adam's first step divides each element by its own size)
    F.cross_entropy(model(x).view(-1, V), y.reshape(-1)).backward()
    optim.step(optimizers, grad_clip=None)
    after = model.state_dict()
    for name, theirs in fixture["stepped"].items():
        before = fixture["weights"][name]
        theirs, before = (theirs[:V], before[:V]) if theirs.dim() == 2 and theirs.size(0) > V else (theirs, before)
        update = (theirs - before).norm()
        assert update > 0, name
        err = (after[name] - theirs).norm()
        assert err <= 1e-5 * update, f"{name}: off by {err:.3g} (L2), the update {update:.3g}"


def test_flops_count_each_layers_window_and_the_gates_not_the_lookups():
    """estimate_flops (what MFU divides by): 6 per matmul weight, the value-embedding and smear gates
    included, the embeddings and value embeddings (lookups) not; attention over min(window, T) keys."""
    from nanochat_fast.model.windowed_gpt import WindowedGPT

    config = WindowedGPTConfig(
        sequence_len=2048, vocab_size=1000, n_layer=4, n_head=4, n_kv_head=4, n_embd=256, window_pattern="SL"
    )
    with torch.device("meta"):
        model = WindowedGPT(config)
    d, h, hd = 256, 4, 64
    block = 4 * d * d + 8 * d * d  # q, k, v, proj + the MLP
    gates = 2 * 12 * 4 + 24  # two layers with value embeddings (1 and 3), then the smear gate
    matmul = 4 * block + gates + 1000 * d
    attention = 12 * h * hd * (512 + 2048 + 512 + 2048)  # S L S L: a quarter of 2048 is 512
    assert model.estimate_flops() == 6 * matmul + attention
    assert sorted(model.value_embeds) == ["1", "3"]


@pytest.mark.parametrize("heads, kv_heads, T, window", [(4, 2, 512, 128), (2, 2, 256, 128), (2, 1, 384, 64)])
def test_chunked_window_attention_equals_sdpa_under_the_whole_mask(heads, kv_heads, T, window):
    """Training's short layers on a GPU attend chunk by chunk (window_chunked_attention); in float64 that is
    the function SDPA computes under the whole sequence's window mask, gradients included."""
    from nanochat_fast.model.block_attention import window_mask
    from nanochat_fast.model.windowed_gpt import window_chunked_attention

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, heads, T, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, kv_heads, T, 16, generator=gen, dtype=torch.float64, requires_grad=True) for _ in "kv")
    gqa = heads != kv_heads
    pos = torch.arange(T)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=window_mask(pos, pos, window), enable_gqa=gqa)
    got = window_chunked_attention(q, k, v, window, gqa)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    grad = torch.randn(want.shape, generator=gen, dtype=torch.float64)
    for a, b in zip(torch.autograd.grad(got, (q, k, v), grad), torch.autograd.grad(want, (q, k, v), grad)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
