"""softcap_cross_entropy: every backend against float64 PyTorch cross_entropy of the softcapped
logits (loss and both gradients), the op contracts (opcheck, torch.compile, bad arguments), the
gradients-in-the-forward design, autocast, and GPT.forward on top of it."""

import os

import pytest
import torch
import torch.nn.functional as F

from nanochat_fast.kernels import KernelUnavailableError, registry, softcap_cross_entropy

# Without a GPU the Triton kernel runs on CPU tensors in the interpreter (its module is imported on
# first use, after this line). With a GPU it is tested on CUDA tensors (test_cuda_matches_float64).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

HAS_CPP = registry._C is not None
CPP = pytest.param("cpp", marks=pytest.mark.skipif(not HAS_CPP, reason="extension not built"))
TRITON = pytest.param("triton", marks=pytest.mark.skipif(torch.cuda.is_available(), reason="tested on CUDA instead"))
BACKENDS = ["reference", "torch", CPP, TRITON]
CHUNKED = ["torch", CPP, TRITON]
CAP = 15.0
# N = 45 rows in chunks of 16 (a partial last chunk); V = 300 is not a multiple of the C++ vector
# width (8) nor of the interpreter's Triton block (256: two blocks, the second partial).
N, D, V, CHUNK = 45, 24, 300, 16


def make_inputs(n=N, d=D, v=V, seed=0, dtype=torch.float32, scale=1.0):
    """Logits with a spread of ~15: some saturate the softcap, some sit in tanh's linear part."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=g) * scale
    weight = torch.randn(v, d, generator=g) * (3.0 / d**0.5)
    targets = torch.randint(0, v, (n,), generator=g)
    targets[::7] = -1  # ignored rows
    return hidden.to(dtype), weight.to(dtype), targets


def float64_reference(hidden, weight, targets, reduction, grad_out, softcap=CAP):
    """Loss and gradients (of sum(grad_out * loss)) by PyTorch's cross_entropy in float64."""
    h = hidden.detach().double().requires_grad_()
    w = weight.detach().double().requires_grad_()
    loss = F.cross_entropy(softcap * torch.tanh(h @ w.T / softcap), targets, ignore_index=-1, reduction=reduction)
    (loss * grad_out.double()).sum().backward()
    return loss.detach(), h.grad, w.grad


def run(backend, hidden, weight, targets, reduction, grad_out, softcap=CAP, chunk_rows=CHUNK):
    h = hidden.detach().clone().requires_grad_()
    w = weight.detach().clone().requires_grad_()
    loss = softcap_cross_entropy(h, w, targets, softcap, reduction=reduction, backend=backend, chunk_rows=chunk_rows)
    (loss * grad_out).sum().backward()
    return loss.detach(), h.grad, w.grad


def grad_output(reduction, n=N, seed=1):
    """A random upstream gradient: for "none" a different weight per row (the recompute path)."""
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n if reduction == "none" else (), generator=g) + 0.5


def assert_close_scaled(got, expected, tol, what):
    """max |got - expected| <= tol * max |expected| (errors on the scale of the largest entry)."""
    err = (got.double() - expected).abs().max().item()
    assert err <= tol * expected.abs().max().item(), f"{what}: error {err:.3g}, scale {expected.abs().max().item():.3g}"


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_fp32_matches_float64(backend, reduction):
    hidden, weight, targets = make_inputs()
    g = grad_output(reduction)
    loss, dh, dw = run(backend, hidden, weight, targets, reduction, g)
    ref_loss, ref_dh, ref_dw = float64_reference(hidden, weight, targets, reduction, g)
    assert loss.dtype == torch.float32 and loss.shape == ref_loss.shape
    assert dh.dtype == dw.dtype == torch.float32
    # fp32 logits from a 24-term dot product and fp32 exp/tanh (the C++ ones polynomial, ~1e-7):
    # measured errors are 1e-7 .. 1e-6 of the scale
    assert_close_scaled(loss, ref_loss, 1e-5, "loss")
    assert_close_scaled(dh, ref_dh, 1e-5, "dhidden")
    assert_close_scaled(dw, ref_dw, 1e-5, "dweight")
    if reduction == "none":
        assert (loss[targets == -1] == 0).all()


@pytest.mark.parametrize("backend", CHUNKED)
def test_large_softcap_and_extreme_logits(backend):
    """softcap 60 (the C++ op then shifts by each row's maximum instead of by softcap) and logits
    from -600 to 600 (tanh fully saturated): still float64's loss and gradients."""
    hidden, weight, targets = make_inputs(scale=40.0, seed=3)
    g = grad_output("sum")
    for softcap in (60.0, 2.0):
        loss, dh, dw = run(backend, hidden, weight, targets, "sum", g, softcap=softcap)
        ref_loss, ref_dh, ref_dw = float64_reference(hidden, weight, targets, "sum", g, softcap=softcap)
        assert_close_scaled(loss, ref_loss, 1e-5, f"loss, softcap {softcap}")
        assert_close_scaled(dh, ref_dh, 1e-5, f"dhidden, softcap {softcap}")
        assert_close_scaled(dw, ref_dw, 1e-5, f"dweight, softcap {softcap}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_inputs_as_accurate_as_stock(backend):
    """bf16 hidden and weight: the matmuls run in bf16 (fp32 accumulation), the logits they produce
    and the dlogits fed back are bf16, gradients come back in bf16. Rounding a logit z to bf16
    moves it by up to 2^-9 |z| (~0.03 here), so neither stock PyTorch nor we can match float64
    better than ~1e-2 of the scale; the test holds us to that bound and to within 2x of the stock
    bf16 computation's own error (the reference backend: F.linear in bf16, then fp32)."""
    hidden, weight, targets = make_inputs(dtype=torch.bfloat16)
    g = grad_output("sum")
    ref = float64_reference(hidden, weight, targets, "sum", g)  # of the bf16 values, in float64
    ours = run(backend, hidden, weight, targets, "sum", g)
    stock = run("reference", hidden, weight, targets, "sum", g)
    assert ours[1].dtype == ours[2].dtype == torch.bfloat16
    for name, o, s, r in zip(("loss", "dhidden", "dweight"), ours, stock, ref):
        err, stock_err = ((x.double() - r).abs().max().item() for x in (o, s))
        scale = r.abs().max().item()
        assert err <= 1e-2 * scale, f"{name}: error {err:.3g} of scale {scale:.3g}"
        assert err <= 2 * stock_err + 1e-3 * scale, f"{name}: error {err:.3g}, stock bf16's {stock_err:.3g}"


@pytest.mark.parametrize("backend", [CPP, "torch"])
def test_autocast_behaves_like_linear(backend):
    """Under bf16 autocast fp32 master tensors get fp32 gradients, and the result is that of
    computing on bf16 copies (what nn.Linear does), not of fp32 inputs."""
    hidden, weight, targets = make_inputs(n=20, v=64)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = softcap_cross_entropy(h, w, targets, CAP, backend=backend)
    loss.backward()
    assert loss.dtype == torch.float32 and h.grad.dtype == w.grad.dtype == torch.float32
    h16, w16 = hidden.bfloat16().requires_grad_(), weight.bfloat16().requires_grad_()
    expected = softcap_cross_entropy(h16, w16, targets, CAP, backend=backend)
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=0, atol=0)
    torch.testing.assert_close(h.grad, h16.grad.float(), rtol=0, atol=0)
    torch.testing.assert_close(w.grad, w16.grad.float(), rtol=0, atol=0)


def count_matmuls(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return sum(e.count for e in prof.key_averages() if e.key in ("aten::mm", "aten::addmm_"))


@pytest.mark.parametrize("backend", CHUNKED[:2])
def test_gradients_computed_in_forward_and_skipped_without_grad(backend):
    """Per chunk: one matmul for the logits, two more for the gradients. mean/sum compute the
    gradients in the forward pass (backward does no matmul); without grad (eval) none are
    computed; "none" with grad recomputes in backward (per-row upstream gradients)."""
    hidden, weight, targets = make_inputs()
    chunks = -(-N // CHUNK)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()

    def call(reduction):
        return softcap_cross_entropy(h, w, targets, CAP, reduction=reduction, backend=backend, chunk_rows=CHUNK)

    with torch.no_grad():
        assert count_matmuls(lambda: call("mean")) == chunks
    out = {}
    assert count_matmuls(lambda: out.update(loss=call("mean"))) == 3 * chunks
    assert count_matmuls(lambda: out["loss"].backward()) == 0
    assert count_matmuls(lambda: out.update(loss=call("none"))) == chunks
    assert count_matmuls(lambda: out["loss"].sum().backward()) == 3 * chunks


def test_ops_pass_opcheck():
    """Schema, fake kernel and autograd registration of the chunked ops (they share the fake and
    the autograd formula), with and without gradients in the forward pass."""
    hidden, weight, targets = make_inputs(n=9, d=8, v=40)
    h, w = hidden.requires_grad_(), weight.requires_grad_()
    cases = [("softcap_cross_entropy_torch", torch.rand(9)), ("softcap_cross_entropy_triton", torch.tensor(0.5))]
    if HAS_CPP:
        cases += [("softcap_cross_entropy", None), ("softcap_cross_entropy", torch.rand(9))]
    for name, grad_scale in cases:
        op = getattr(torch.ops.nanochat_fast, name).default
        torch.library.opcheck(op, (h, w, targets, CAP, -1, grad_scale, 4))


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_compiles_fullgraph(reduction):
    """torch.compile(fullgraph=True) traces through the op and its autograd formula: the same
    loss and gradients as eager, and for mean no op call left in the backward graph."""
    from torch._dynamo.testing import AotEagerAndRecordGraphs

    backend = "cpp" if HAS_CPP else "torch"
    hidden, weight, targets = make_inputs()
    g = grad_output(reduction)
    torch._dynamo.reset()
    graphs = AotEagerAndRecordGraphs()
    compiled = torch.compile(
        lambda h, w: (softcap_cross_entropy(h, w, targets, CAP, reduction=reduction, backend=backend) * g).sum(),
        fullgraph=True,
        backend=graphs,
    )
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = compiled(h, w)
    loss.backward()
    eager_loss, eager_dh, eager_dw = run(backend, hidden, weight, targets, reduction, g, chunk_rows=None)
    torch.testing.assert_close(loss, eager_loss.mul(g).sum(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(h.grad, eager_dh, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(w.grad, eager_dw, rtol=1e-6, atol=1e-7)
    in_backward = sum(
        n.op == "call_function" and "nanochat_fast" in str(n.target) for gm in graphs.bw_graphs for n in gm.graph.nodes
    )
    assert in_backward == (0 if reduction == "mean" else 1)


@pytest.mark.parametrize(
    "kwargs, arg",
    [
        (dict(hidden=torch.zeros(2, 3, 4)), "hidden"),
        (dict(hidden=torch.zeros(4, 8, dtype=torch.float16), weight=torch.zeros(10, 8, dtype=torch.float16)), "hidden"),
        (dict(weight=torch.zeros(10, 7)), "weight"),
        (dict(targets=torch.zeros(4, dtype=torch.int32)), "targets"),
        (dict(targets=torch.zeros(5, dtype=torch.int64)), "targets"),
        (dict(softcap=0.0), "softcap"),
        (dict(softcap=float("inf")), "softcap"),
        (dict(softcap="15"), "softcap"),
        (dict(ignore_index=-1.0), "ignore_index"),
        (dict(reduction="avg"), "reduction"),
        (dict(chunk_rows=0), "chunk_rows"),
        (dict(weight=torch.zeros(10, 8, device="meta")), "weight"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, arg):
    args = (
        dict(
            hidden=torch.zeros(4, 8), weight=torch.zeros(10, 8), targets=torch.zeros(4, dtype=torch.int64), softcap=CAP
        )
        | kwargs
    )
    with pytest.raises(ValueError, match=rf"^{arg} "):
        softcap_cross_entropy(**args)


@pytest.mark.skipif(not HAS_CPP, reason="extension not built")
def test_cpp_op_refuses_out_of_range_targets():
    hidden, weight, targets = make_inputs(n=4, v=10)
    targets[2] = 10
    with pytest.raises(RuntimeError, match=r"targets\[2\] = 10 is outside \[0, 10\)"):
        softcap_cross_entropy(hidden, weight, targets, CAP, backend="cpp")


def test_auto_backend_order(monkeypatch):
    monkeypatch.delenv("NANOCHAT_FAST_KERNELS", raising=False)
    assert registry.select("softcap_cross_entropy", "cpu").name == ("cpp" if HAS_CPP else "torch")
    assert registry.select("softcap_cross_entropy", "mps").name == "torch"
    assert registry.select("softcap_cross_entropy", "cuda").name == "triton"
    monkeypatch.setenv("NANOCHAT_FAST_KERNELS", "softcap_cross_entropy=reference")
    assert registry.select("softcap_cross_entropy", "cpu").name == "reference"
    monkeypatch.setenv("NANOCHAT_FAST_KERNELS", "softcap_cross_entropy=triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(KernelUnavailableError, match="TRITON_INTERPRET=1"):
        softcap_cross_entropy(*make_inputs(n=4, v=10), CAP)


def test_gpt_forward_uses_the_fused_loss(monkeypatch):
    """GPT.forward with targets: the fused op (auto) gives the reference backend's loss and
    gradients for every reduction; the logits path is untouched."""
    from nanochat_fast.model.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(sequence_len=16, vocab_size=97, n_layer=1, n_head=2, n_kv_head=1, n_embd=32))
    model.init_weights()
    with torch.no_grad():
        model.lm_head.weight.normal_(0, 0.5)
    idx = torch.randint(0, 97, (2, 16))
    targets = torch.randint(0, 97, (2, 16))
    targets[0, :4] = -1
    results = {}
    for kernels in ("auto", "softcap_cross_entropy=reference"):
        monkeypatch.setenv("NANOCHAT_FAST_KERNELS", kernels)
        for reduction in ("mean", "sum", "none"):
            model.zero_grad()
            loss = model(idx, targets, loss_reduction=reduction)
            loss.sum().backward()
            results[kernels, reduction] = (
                loss.detach(),
                model.lm_head.weight.grad.clone(),
                model.transformer.wte.weight.grad.clone(),
            )
    for reduction in ("mean", "sum", "none"):
        for got, expected in zip(results["auto", reduction], results["softcap_cross_entropy=reference", reduction]):
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert results["auto", "none"][0].shape == (2, 16)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_matches_float64(dtype):
    """On a GPU: the Triton backend at an lm_head-sized shape, several chunks, against float64."""
    hidden, weight, targets = make_inputs(n=3000, d=256, v=8191, dtype=dtype)
    hidden, weight, targets = hidden.cuda(), weight.cuda(), targets.cuda()
    g = grad_output("mean").cuda()
    ref = float64_reference(hidden, weight, targets, "mean", g)
    ours = run("triton", hidden, weight, targets, "mean", g, chunk_rows=1024)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for name, o, r in zip(("loss", "dhidden", "dweight"), ours, ref):
        assert_close_scaled(o, r, tol, name)
