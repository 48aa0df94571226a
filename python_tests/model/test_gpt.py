"""The GPT: shapes, masking, losses, KV-cached generation, FLOPs, the depth dial, init and
optimizer grouping; the forward pass against a float64 re-implementation written from the math."""

import math

import pytest
import torch
from support.tiny_gpt import TINY, generate_without_cache, random_model

from nanochat_fast.model.decode import SlotCache, SlotPrefill
from nanochat_fast.model.gpt import GPT, GPTConfig, compile_model, config_from_depth
from nanochat_fast.optim import AdamW, Muon


def reference_forward(model: GPT, idx: torch.Tensor) -> torch.Tensor:
    """Logits in float64 from the model's weights, written independently: explicit rotary angles,
    explicit causal mask, K/V heads repeated for GQA."""
    cfg = model.config
    W = {k: v.double() for k, v in model.state_dict().items()}
    B, T = idx.shape
    D = cfg.head_dim

    def rms(x):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + torch.finfo(torch.float32).eps)

    pos = torch.arange(T, dtype=torch.float64)
    inv_freq = 10000.0 ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    ang = pos[:, None] * inv_freq[None, :]  # (T, D/2)

    def rotate(x):  # (B, T, H, D): pairs (i, i + D/2) rotated by -angle
        a, b = x[..., : D // 2], x[..., D // 2 :]
        c, s = ang.cos()[None, :, None, :], ang.sin()[None, :, None, :]
        return torch.cat([a * c + b * s, -a * s + b * c], -1)

    x = rms(W["transformer.wte.weight"][idx])
    mask = torch.tril(torch.ones(T, T, dtype=torch.bool))
    for i in range(cfg.n_layer):
        p = f"transformer.h.{i}."
        h = rms(x)
        q = (h @ W[p + "attn.c_q.weight"].T).view(B, T, cfg.n_head, D)
        k = (h @ W[p + "attn.c_k.weight"].T).view(B, T, cfg.n_kv_head, D)
        v = (h @ W[p + "attn.c_v.weight"].T).view(B, T, cfg.n_kv_head, D)
        q, k = rms(rotate(q)), rms(rotate(k))
        rep = cfg.n_head // cfg.n_kv_head
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        att = torch.einsum("bthd,bshd->bhts", q, k) / math.sqrt(D)
        att = att.masked_fill(~mask, float("-inf")).softmax(-1)
        y = torch.einsum("bhts,bshd->bthd", att, v).reshape(B, T, -1)
        x = x + y @ W[p + "attn.c_proj.weight"].T
        h = rms(x)
        x = x + (torch.relu(h @ W[p + "mlp.c_fc.weight"].T) ** 2) @ W[p + "mlp.c_proj.weight"].T
    logits = rms(x) @ W["lm_head.weight"].T
    return 15.0 * torch.tanh(logits / 15.0)


def test_forward_matches_float64_reference():
    model = random_model()
    idx = torch.randint(0, TINY.vocab_size, (3, TINY.sequence_len))
    logits = model(idx)
    assert logits.shape == (3, TINY.sequence_len, TINY.vocab_size) and logits.dtype == torch.float32
    torch.testing.assert_close(logits.double(), reference_forward(model, idx), rtol=1e-4, atol=1e-4)
    assert logits.abs().max() < 15.0  # soft cap


def test_causal_masking():
    model = random_model()
    idx = torch.randint(0, TINY.vocab_size, (2, TINY.sequence_len))
    t = 9
    changed = idx.clone()
    changed[:, t:] = (changed[:, t:] + 1) % TINY.vocab_size
    a, b = model(idx), model(changed)
    torch.testing.assert_close(a[:, :t], b[:, :t], rtol=0, atol=1e-6)  # the past ignores the future
    assert (a[:, t:] - b[:, t:]).abs().max() > 1e-3


def test_loss_reductions_and_ignore_index():
    model = random_model()
    idx = torch.randint(0, TINY.vocab_size, (2, TINY.sequence_len))
    targets = torch.randint(0, TINY.vocab_size, (2, TINY.sequence_len))
    targets[0, :5] = -1
    targets[1, -3:] = -1
    logp = torch.log_softmax(model(idx).double(), -1)
    valid = targets != -1
    nll = -logp.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1) * valid
    torch.testing.assert_close(model(idx, targets).double(), nll.sum() / valid.sum(), rtol=1e-5, atol=0)
    torch.testing.assert_close(model(idx, targets, loss_reduction="sum").double(), nll.sum(), rtol=1e-5, atol=0)
    none = model(idx, targets, loss_reduction="none")
    assert none.shape == (2, TINY.sequence_len)
    torch.testing.assert_close(none.double(), nll, rtol=1e-5, atol=1e-6)
    assert (none[~valid] == 0).all()


def test_kv_cache_chunks_match_full_forward():
    """Prefill, a multi-token chunk after a cached prefix (the masked path), then single tokens;
    each sequence in its own slot of one cache."""
    model = random_model()
    idx = torch.randint(0, TINY.vocab_size, (2, 12))
    full = model(idx)
    cache = SlotCache(TINY.n_layer, 2, 12)
    with torch.no_grad():
        for row in (1, 0):
            view = SlotPrefill(cache, row)
            x = idx[row : row + 1]
            parts = [
                model(x[:, :5], kv_cache=view),
                model(x[:, 5:9], kv_cache=view),
                model(x[:, 9:10], kv_cache=view),
                model(x[:, 10:12], kv_cache=view),
            ]
            assert view.get_pos() == 12
            torch.testing.assert_close(torch.cat(parts, 1), full[row : row + 1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("temperature,top_k", [(0.0, None), (1.0, 5)])
def test_generate_matches_a_full_recompute(temperature, top_k):
    model = random_model()
    prompt = [3, 14, 15, 92, 65]
    cached = list(model.generate(prompt, 20, temperature=temperature, top_k=top_k, seed=7))
    uncached = generate_without_cache(model, prompt, 20, temperature=temperature, top_k=top_k, seed=7)
    assert len(cached) == 20 and all(isinstance(t, int) and 0 <= t < TINY.vocab_size for t in cached)
    assert cached == uncached
    if temperature == 0:
        # greedy: each token is the argmax of the full forward over everything before it
        ids = prompt + cached
        logits = model(torch.tensor([ids]))[0]
        assert cached == logits[len(prompt) - 1 : -1].argmax(-1).tolist()
        assert len(set(cached)) > 1


def test_generate_use_kv_cache_is_deprecated_and_ignored():
    model = random_model()
    with pytest.warns(DeprecationWarning, match="use_kv_cache"):
        tokens = list(model.generate([1, 2, 3], 8, temperature=0, use_kv_cache=False))
    assert tokens == list(model.generate([1, 2, 3], 8, temperature=0))


def test_generate_rejects_bad_input():
    model = random_model()
    with pytest.raises(ValueError, match="tokens"):
        next(model.generate([], 3))
    with pytest.raises(ValueError, match="positions"):
        next(model.generate([1], model.rotary_seq_len))


def test_estimate_flops_hand_count():
    model = GPT(TINY)
    # per layer: c_q 32x32, c_k 16x32, c_v 16x32, c_proj 32x32, c_fc 128x32, mlp.c_proj 32x128
    per_layer = 1024 + 512 + 512 + 1024 + 4096 + 4096
    lm_head = 101 * 32
    wte = 101 * 32
    assert model.num_scaling_params() == 2 * per_layer + lm_head + wte
    # 6 x non-embedding params + 12 * n_layer * n_head * head_dim * T
    assert model.estimate_flops() == 6 * (2 * per_layer + lm_head) + 12 * 2 * 4 * 8 * 16 == 166848


def test_depth_dial():
    cfg = config_from_depth(20, vocab_size=65536, sequence_len=2048)
    assert (cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.n_kv_head, cfg.head_dim) == (20, 1280, 10, 10, 128)
    cfg = config_from_depth(3, vocab_size=100, sequence_len=64)  # 192 rounds up to 256
    assert (cfg.n_embd, cfg.n_head) == (256, 2)
    cfg = config_from_depth(2, vocab_size=100, sequence_len=64, aspect_ratio=32, head_dim=16, n_kv_head=2)
    assert (cfg.n_embd, cfg.n_head, cfg.n_kv_head) == (64, 4, 2)
    with pytest.raises(ValueError, match="depth"):
        config_from_depth(0, vocab_size=100, sequence_len=64)
    with pytest.raises(ValueError, match="n_kv_head"):
        config_from_depth(4, vocab_size=100, sequence_len=64, n_kv_head=3)
    with pytest.raises(ValueError, match="head_dim"):
        GPTConfig(n_embd=30, n_head=2, n_kv_head=2)


def test_init_on_meta_device_and_state_dict_keys():
    with torch.device("meta"):
        model = GPT(TINY)
    model.to_empty(device="cpu")
    torch.manual_seed(1)
    model.init_weights()
    plain = GPT(TINY)
    torch.testing.assert_close(model.cos, plain.cos, rtol=0, atol=0)
    assert set(model.state_dict()) == set(plain.state_dict())
    assert not any(k in ("cos", "sin") for k in model.state_dict())
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert (model.lm_head.weight == 0).all()
    assert all((b.attn.c_proj.weight == 0).all() and (b.mlp.c_proj.weight == 0).all() for b in model.transformer.h)
    assert abs(model.transformer.wte.weight.std().item() - 1.0) < 0.1
    c_fc = model.transformer.h[0].mlp.c_fc.weight  # fan_in 32, fan_out 128: std 1/sqrt(32)
    assert abs(c_fc.std().item() * math.sqrt(32) - 1.0) < 0.1
    idx = torch.randint(0, TINY.vocab_size, (1, 8))
    logits = model(idx)
    assert torch.isfinite(logits).all()
    assert model.rotary_seq_len == 10 * TINY.sequence_len


def test_setup_optimizers_grouping_and_lr_scaling():
    model = GPT(TINY)
    model.init_weights()
    adamw, muon = model.setup_optimizers(unembedding_lr=0.004, embedding_lr=0.2, matrix_lr=0.02, weight_decay=0.1)
    assert type(adamw) is AdamW and type(muon) is Muon
    scale = (32 / 768) ** -0.5
    (head, emb) = adamw.param_groups
    assert head["param_names"] == ["lm_head.weight"] and emb["param_names"] == ["transformer.wte.weight"]
    assert head["lr"] == pytest.approx(0.004 * scale) and emb["lr"] == pytest.approx(0.2 * scale)
    assert head["betas"] == (0.8, 0.95) and head["eps"] == 1e-10 and head["weight_decay"] == 0.1
    muon_names = sorted(n for g in muon.param_groups for n in g["param_names"])
    assert muon_names == sorted(n for n, _ in model.transformer.h.named_parameters(prefix="transformer.h"))
    for group in muon.param_groups:
        assert len({tuple(p.shape) for p in group["params"]}) == 1  # one shape per group: one batched call
        assert group["lr"] == 0.02 and group["momentum"] == 0.95
    for opt in (adamw, muon):
        assert all(g["initial_lr"] == g["lr"] for g in opt.param_groups)


def test_compiled_model_matches_eager():
    """One graph (fullgraph: no breaks) for forward + backward; two layers: one compiled block region
    called twice, whose gradients inductor's buffer reuse once broke (small, to keep compile time down)."""
    config = GPTConfig(sequence_len=16, vocab_size=101, n_layer=2, n_head=4, n_kv_head=2, n_embd=32)
    model = random_model(config)
    compiled = compile_model(model, fullgraph=True)
    idx = torch.randint(0, config.vocab_size, (2, config.sequence_len))
    targets = torch.randint(0, config.vocab_size, (2, config.sequence_len))
    loss = compiled(idx, targets)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    eager = model(idx, targets)
    eager.backward()
    torch.testing.assert_close(loss, eager, rtol=1e-5, atol=1e-6)
    for n, p in model.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("arch", ["gpt", "windowed"])
def test_compiled_blocks_share_regions(arch):
    """torch.compile builds one region per kind of block, not per layer: the compile costs the kinds.
    4 layers of the gpt: one kind; of the windowed model with pattern SL: two (short without a value
    embedding, long with one)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    from nanochat_fast.model.windowed_gpt import WindowedGPT, WindowedGPTConfig

    forward_graphs = []

    def keep(gm, example_inputs):
        forward_graphs.append(gm)
        return make_boxed_func(gm.forward)

    fields = dict(sequence_len=32, vocab_size=64, n_layer=4, n_head=2, n_kv_head=2, n_embd=32)
    model = GPT(GPTConfig(**fields)) if arch == "gpt" else WindowedGPT(WindowedGPTConfig(**fields, window_pattern="SL"))
    model.init_weights()
    torch._dynamo.reset()
    backend = aot_autograd(fw_compiler=keep, bw_compiler=lambda gm, _: make_boxed_func(gm.forward))
    compiled = torch.compile(model, backend=backend, dynamic=False, fullgraph=True)
    idx = torch.randint(0, 64, (2, 32))
    compiled(idx, idx).backward()
    (graph,) = forward_graphs
    calls = [n.args[1] for n in graph.graph.nodes if "invoke_subgraph" in str(n.target)]
    assert len(calls) == 4
    assert len(set(calls)) == (1 if arch == "gpt" else 2)


@pytest.mark.gpu
def test_cuda_bf16_autocast_compiled_training():
    """On a GPU: bf16 autocast logits close to fp32, and a compiled model trains with the
    optimizers (fp32 master weights and state)."""
    device = torch.device("cuda")
    model = random_model().to(device)
    idx = torch.randint(0, TINY.vocab_size, (4, TINY.sequence_len), device=device)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        low = model(idx)
    assert low.dtype == torch.float32
    torch.testing.assert_close(low, model(idx), rtol=0, atol=0.25)
    compiled = compile_model(model)
    opts = model.setup_optimizers()
    from nanochat_fast import optim

    losses = []
    for _ in range(10):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = compiled(idx, idx)
        loss.backward()
        optim.step(opts, grad_clip=1.0)
        model.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert all(p.dtype == torch.float32 for p in model.parameters())
    cached = list(model.generate([1, 2, 3], 8, temperature=0))
    assert cached == generate_without_cache(model, [1, 2, 3], 8, temperature=0)


def test_evaluate_bpb_matches_a_hand_count():
    """Bits per byte = summed nats of the counted targets / (ln 2 * their UTF-8 bytes); targets that
    are masked (-1) or special (0 bytes) count neither nats nor bytes."""
    from contextlib import nullcontext

    from nanochat_fast.evals.task_runner import evaluate_bpb

    model = random_model()
    g = torch.Generator().manual_seed(1)
    token_bytes = torch.randint(1, 5, (TINY.vocab_size,), generator=g)
    token_bytes[:3] = 0  # special tokens
    batches = []
    for _ in range(2):
        x = torch.randint(0, TINY.vocab_size, (3, TINY.sequence_len), generator=g)
        y = torch.randint(0, TINY.vocab_size, (3, TINY.sequence_len), generator=g)
        y[0, :5] = -1
        y[1, 2] = 1
        batches.append((x, y))
    nats = nbytes = 0.0
    with torch.no_grad():
        for x, y in batches:
            logp = torch.log_softmax(model(x).double(), dim=-1)
            for b, t in zip(*torch.nonzero(y >= 0, as_tuple=True)):
                tok = int(y[b, t])
                if token_bytes[tok] > 0:
                    nats -= float(logp[b, t, tok])
                    nbytes += int(token_bytes[tok])
        bpb = evaluate_bpb(model, batches, token_bytes, nullcontext())
    assert bpb == pytest.approx(nats / (math.log(2) * nbytes), rel=1e-6)
