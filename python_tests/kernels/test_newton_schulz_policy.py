"""The Newton-Schulz dtype policy (device x measurements -> dtype), the shape-gating table (device,
dtype, m, n -> path, and which backend `auto` runs), and every path in bf16 against float64.

bf16 is emulated on CPUs without AVX512-BF16/AMX (~1 GFLOP/s), so the bf16 shapes are small. The
bound is the issue's 2e-2 max abs on the normalised output, on Gaussian inputs (on low-rank inputs
even the plain bf16 iteration is off by 0.1-0.3: bf16 rounding of the small singular directions)."""

import importlib

import pytest
import torch
from support.newton_schulz_reference import float64_newton_schulz, force_path, make_input, published

from nanochat_fast.hardware import precision
from nanochat_fast.hardware.precision import Timing
from nanochat_fast.kernels import newton_schulz, registry
from nanochat_fast.optim import Muon

ns = importlib.import_module("nanochat_fast.kernels.newton_schulz")
F32, BF16 = torch.float32, torch.bfloat16


@pytest.fixture
def cpu_bf16(monkeypatch):
    """Pretend this CPU has (or has not) bf16 instructions: set(feature or None)."""

    def set_feature(feature):
        monkeypatch.setattr(precision, "cpu_bf16_support", lambda: feature)
        ns._auto_dtype.cache_clear()

    yield set_feature
    ns._auto_dtype.cache_clear()


# the machine's matmul probe (seconds per unit of work) on three kinds of CPU
PROBES = {"emulated": (1.0, 80.0), "bf16 slower": (1.0, 2.04), "bf16 faster": (1.0, 0.45)}


@pytest.mark.parametrize("cpu,expected", [("emulated", F32), ("bf16 slower", F32), ("bf16 faster", BF16)])
def test_auto_dtype_follows_the_measured_cpu(monkeypatch, cpu, expected):
    """A direct newton_schulz call with dtype=None takes the faster dtype of the machine's probe."""
    fp32, bf16 = PROBES[cpu]
    monkeypatch.setattr(precision, "probe_timing", lambda device: Timing({"fp32": fp32, "bf16": bf16}, "probe", 3))
    ns._auto_dtype.cache_clear()
    try:
        assert ns.compute_dtype("cpu") == expected
        assert ns.compute_dtype("cpu", "auto") == expected
        assert newton_schulz(make_input((8, 24))).dtype == F32  # returned in G's dtype either way
        # forced choices do not look at the CPU
        assert ns.compute_dtype("cpu", "fp32") == F32 and ns.compute_dtype("cpu", BF16) == BF16
    finally:
        ns._auto_dtype.cache_clear()


@pytest.mark.parametrize(
    "device,capability,timing,expected",
    [
        ("cuda", (9, 0), None, "bf16"),
        ("cuda", (8, 0), None, "bf16"),
        ("cuda", (7, 5), None, "fp32"),
        ("cpu", None, (1.0, 0.45), "bf16"),
        ("cpu", None, (1.0, 2.04), "fp32"),
        ("mps", None, None, "fp32"),
    ],
)
def test_ns_dtype_rule(device, capability, timing, expected):
    timing = timing and Timing({"fp32": timing[0], "bf16": timing[1]}, "Muon's matrices", 5)
    choice = precision.decide(device, "auto", timing=timing, cuda_capability=capability, what="--ns-dtype")
    assert choice.name == expected


def test_compute_dtype_rejects_other_dtypes():
    with pytest.raises(ValueError, match="dtype must be"):
        ns.compute_dtype("cpu", torch.float16)
    with pytest.raises(ValueError, match="dtype must be"):
        newton_schulz(make_input((8, 24)), dtype="fp16")
    with pytest.raises(ValueError, match="ns_dtype must be one of auto, fp32, bf16"):
        Muon([torch.nn.Parameter(torch.zeros(4, 4))], ns_dtype="half")


@pytest.mark.parametrize(
    "device,dtype,m,n,path",
    [
        ("cpu", F32, 64, 64, "plain"),
        ("cpu", F32, 255, 255, "plain"),
        ("cpu", F32, 256, 256, "symmetric"),
        ("cpu", F32, 512, 768, "symmetric"),
        ("cpu", F32, 512, 1024, "gram"),
        ("cpu", F32, 2048, 512, "gram"),
        ("cpu", F32, 128, 512, "plain"),  # the Gram form does not pay below m = 256
        ("cpu", BF16, 512, 2048, "gram"),
        ("cpu", BF16, 512, 768, "plain"),
        ("cpu", BF16, 1280, 1280, "symmetric"),
        ("cpu", BF16, 128, 512, "plain"),  # no Gram in bf16 below m = 256: its error can pass the bound there
        ("cuda", BF16, 1280, 5120, "plain"),
        ("cuda", BF16, 2048, 2048, "symmetric"),
        ("cuda", BF16, 8192, 2048, "symmetric"),
        ("cuda", F32, 512, 2048, "gram"),
        ("cuda", F32, 4096, 4096, "symmetric"),
        ("mps", F32, 4096, 4096, "plain"),
        ("mps", BF16, 4096, 4096, "plain"),
    ],
)
def test_path_table(device, dtype, m, n, path):
    assert ns.choose_path(device, dtype, m, n) == path
    assert ns.choose_path(device, dtype, n, m) == path  # tall and wide alike


def test_auto_runs_triton_only_for_the_symmetric_path(monkeypatch):
    """On CUDA (planned, not run) the Triton kernels serve large m; cuBLAS products below."""
    monkeypatch.delenv("NANOCHAT_FAST_KERNELS", raising=False)
    if registry.triton_why_not("cuda") is not None:
        pytest.skip(registry.triton_why_not("cuda"))
    assert ns.plan((1280, 5120), "cuda", BF16)[0].name == "torch"
    assert ns.plan((4, 2048, 8192), "cuda", BF16)[0].name == "triton"
    assert ns.plan((1280, 5120), "cuda", BF16, backend="triton")[0].name == "triton"  # forced: the kernels
    assert ns.plan((512, 512), "cpu", F32)[0].name == "torch"
    monkeypatch.setenv("NANOCHAT_FAST_KERNELS", "newton_schulz=triton")
    assert ns.plan((1280, 5120), "cuda", BF16)[0].name == "triton"


def bf16_error(G, coefficients="quintic", **kw):
    coeffs = published(coefficients)
    out = newton_schulz(G, coefficients=coefficients, dtype=BF16, **kw)
    assert out.dtype == G.dtype
    return (out.double() - float64_newton_schulz(G, coeffs)).abs().max().item()


# The Gram form in bf16 runs over 2e-2 on some small inputs (2.2e-2 measured on the 3x40x100 stack):
# why the table picks it in bf16 only from m = 256 (test_gram_form_in_bf16_only_where_it_stays_in_bound).
BF16_BOUND = {"plain": 2e-2, "symmetric": 2e-2, "gram": 3e-2}


@pytest.mark.parametrize("path", ["plain", "symmetric", "gram"])
@pytest.mark.parametrize("shape", [(96, 192), (3, 40, 100), (130, 64)])
def test_torch_paths_in_bf16(monkeypatch, path, shape):
    monkeypatch.setattr(ns, "SYM_BLOCK_ROWS", 32)  # several block rows on these small matrices
    force_path(monkeypatch, path)
    assert bf16_error(make_input(shape), backend="torch") <= BF16_BOUND[path]  # plain/symmetric: 5e-3 .. 1.4e-2


@pytest.mark.parametrize("coefficients", ["quintic", "polar_express"])
def test_reference_and_symmetric_in_bf16(monkeypatch, coefficients):
    G = make_input((64, 160))
    if coefficients == "quintic":  # the plain bf16 iteration reaches 2.2e-2 with Polar Express
        assert bf16_error(G, coefficients, backend="reference") <= 2e-2
    monkeypatch.setattr(ns, "SYM_BLOCK_ROWS", 32)
    force_path(monkeypatch, "symmetric")
    assert bf16_error(G, coefficients, backend="torch") <= 1e-2  # one rounding per fused product


def test_gram_form_in_bf16_only_where_it_stays_in_bound(monkeypatch):
    """The Gram form rounds more than plain in bf16. Below m = 256 that can pass the 2e-2 bound
    (measured 2.3e-2 vs 1.8e-2, 2.8e-2 vs 2.2e-2 here) and the table keeps it out; at m = 256 and
    n = 4m, where the table picks it, it stays well within (measured 4.5e-3 and 6.1e-3)."""
    for shape in [(64, 256), (4, 64, 128)]:
        G = make_input(shape)
        plain = bf16_error(G, "polar_express", backend="reference")
        force_path(monkeypatch, "gram")
        gram = bf16_error(G, "polar_express", backend="torch")
        monkeypatch.undo()
        assert gram > plain, (shape, gram, plain)
        assert ns.choose_path("cpu", BF16, *shape[-2:]) != "gram"
    G = make_input((256, 1024))
    assert ns.choose_path("cpu", BF16, 256, 1024) == "gram"
    for coefficients in ("quintic", "polar_express"):
        assert bf16_error(G, coefficients, backend="torch") <= 1e-2, coefficients


def test_muon_in_bf16_keeps_fp32_state(monkeypatch, capsys, cpu_bf16):
    """ns_dtype="bf16": the iteration in bf16, the momentum fp32, the update in the params' dtype;
    asking for bf16 where it is emulated says so in one line."""
    cpu_bf16(None)
    shapes = [(24, 40), (24, 40), (40, 24)]
    gen = torch.Generator().manual_seed(0)
    start = [torch.randn(s, generator=gen) for s in shapes]
    grads = [torch.randn(s, generator=gen) for s in shapes]
    results = {}
    for dtype in ("fp32", "bf16"):
        params = [torch.nn.Parameter(t.clone()) for t in start]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt = Muon(params, lr=0.02, momentum=0.9, ns_dtype=dtype)
        assert opt.ns_precision.name == dtype
        opt.step()
        assert all(s["momentum_buffer"].dtype == F32 for s in opt.state.values())
        results[dtype] = [p.detach().clone() for p in params]
    assert "warning: --ns-dtype bf16 on cpu" in capsys.readouterr().err
    for a, b, s in zip(results["bf16"], results["fp32"], start):
        assert a.dtype == F32
        # the update is 0.02 * NS(g): bf16's 2e-2 on NS(g) is 4e-4 on the parameters
        assert 0 < (a - b).abs().max() <= 0.02 * 2e-2
        assert (b - s).abs().max() > 0.005  # and they moved (~0.009)


@pytest.mark.parametrize("feature,expected", [("AMX", "cpu-amx"), ("AVX512-BF16", "cpu"), (None, "cpu")])
def test_bf16_on_amx_tiles_has_its_own_rows(monkeypatch, feature, expected):
    """On AMX a product split in block rows loses 2-4x (measured on a 2-core AMX Xeon: 512x512 stacks
    3.3 s split vs 0.8 s whole, 1280x1280 12.8 vs 7.3 s): bf16 there takes no symmetric row and the Gram
    form unsplit; fp32, and bf16 on other CPUs, keep the CPU rows."""
    monkeypatch.setattr(ns, "cpu_bf16_support", lambda: feature)
    assert ns.table_device("cpu", BF16) == expected
    assert ns.table_device("cpu", F32) == "cpu" and ns.table_device("cuda", BF16) == "cuda"
    assert ns.plan((1280, 1280), "cpu", BF16)[2] == ("plain" if feature == "AMX" else "symmetric")
    assert ns.plan((512, 2048), "cpu", BF16)[2] == "gram"
    assert ns.plan((1280, 1280), "cpu", F32)[2] == "symmetric"
    assert ns.symmetric_pays(ns.table_device("cpu", BF16), BF16, 1280) == (feature != "AMX")
