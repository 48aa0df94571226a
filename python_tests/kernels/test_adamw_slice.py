"""adamw_slice_update: every backend against torch.optim.AdamW, plus the op's contracts."""

import os
import platform
import re
import subprocess
import sys

import pytest
import torch
from support.repo_paths import ROOT

from nanochat_fast.kernels import KernelUnavailableError, adamw_slice_update, registry
from nanochat_fast.kernels.adamw_slice import HPARAMS, SLOT, make_hparams

# Without a GPU the Triton kernel runs on CPU tensors in the interpreter. TRITON_INTERPRET must be
# set before the kernel is defined; its module is imported lazily on first use, so setting it here
# is enough. With a GPU the kernel is compiled and tested on CUDA tensors (test_cuda_backends).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

HAS_CPP = registry.extension() is not None
BACKENDS = [
    "reference",
    pytest.param("cpp", marks=pytest.mark.skipif(not HAS_CPP, reason="extension not built")),
    pytest.param("triton", marks=pytest.mark.skipif(torch.cuda.is_available(), reason="tested on CUDA instead")),
]
# odd sizes: a single element, a prime, one short of a power of two, more than one block, empty, 2-D
SHAPES = [(1,), (7,), (1023,), (9000,), (0,), (33, 65)]
LR_MULS = [1.0, 2.0, 1.0, 0.5, 1.0, 3.0]
WD_MULS = [1.0, 0.0, 2.0, 1.0, 1.0, 0.5]


def make_tensors(dtype, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(device=device, dtype=dtype) for s in SHAPES]


def grads_for(step, dtype, device="cpu"):
    return make_tensors(dtype, seed=1000 + step, device=device)


def run_ours(backend, dtype, steps=12, hparams_as_tensors=False, device="cpu"):
    params = make_tensors(dtype, device=device)
    exp_avgs = [torch.zeros(s, device=device) for s in SHAPES]
    exp_avg_sqs = [torch.zeros(s, device=device) for s in SHAPES]
    for step in range(1, steps + 1):
        lr = 1e-2 * (1 + 0.3 * step)  # a schedule: lr changes every step
        hp = dict(lr=lr, beta1=0.8, beta2=0.95, eps=1e-10, weight_decay=0.1)
        if hparams_as_tensors:
            hp = {k: torch.tensor(v, dtype=torch.float64, device=device) for k, v in hp.items()}
        adamw_slice_update(
            params,
            grads_for(step, dtype, device),
            exp_avgs,
            exp_avg_sqs,
            step,
            lr_muls=LR_MULS,
            wd_muls=WD_MULS,
            backend=backend,
            **hp,
        )
    return [p.cpu() for p in params]


def run_torch(dtype, steps=12):
    """torch.optim.AdamW on fp32 params, one group per tensor for the per-tensor multipliers.
    For bf16 params the parameters are rounded to bf16 after each step, which is exactly what a
    bf16-param, fp32-state optimizer does."""
    params = [p.float().requires_grad_() for p in make_tensors(dtype)]
    groups = [{"params": [p], "lr_mul": lm, "wd_mul": wm} for p, lm, wm in zip(params, LR_MULS, WD_MULS)]
    opt = torch.optim.AdamW(groups, betas=(0.8, 0.95), eps=1e-10)
    for step in range(1, steps + 1):
        lr = 1e-2 * (1 + 0.3 * step)
        for group, g in zip(opt.param_groups, grads_for(step, dtype)):
            group["lr"] = lr * group["lr_mul"]
            # torch decays by (group lr) * (group weight_decay) = lr*lr_mul * wd*wd_mul, as ours does
            group["weight_decay"] = 0.1 * group["wd_mul"]
            group["params"][0].grad = g.float()
        opt.step()
        if dtype == torch.bfloat16:
            with torch.no_grad():
                for p in params:
                    p.copy_(p.bfloat16().float())
    return [p.detach() for p in params]


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp32_matches_torch_adamw(backend):
    ours = run_ours(backend, torch.float32)
    ref = run_torch(torch.float32)
    for i, (a, b) in enumerate(zip(ours, ref)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"tensor {i} shape {SHAPES[i]}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_params_match_torch_adamw(backend):
    ours = run_ours(backend, torch.bfloat16)
    ref = run_torch(torch.bfloat16)
    for i, (a, b) in enumerate(zip(ours, ref)):
        assert a.dtype == torch.bfloat16
        # both round to bf16 after every step; a one-ulp difference in a rounding tie may propagate
        torch.testing.assert_close(a.float(), b, rtol=2**-7, atol=1e-3, msg=f"tensor {i}")


@pytest.mark.skipif(not HAS_CPP, reason="extension not built")
@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="AVX2 is an x86-64 feature")
def test_the_avx2_copy_matches_torch_adamw():
    """The C++ loop's AVX2 copy, which an AVX2 CPU runs, forced on a wider CPU by ATEN_CPU_CAPABILITY=avx2
    (the op reads it at load, as torch does for its own kernels): the two tests above in a fresh process,
    which also reports that torch went no wider than asked."""
    code = (
        "import torch, test_adamw_slice as t; t.test_fp32_matches_torch_adamw('cpp'); "
        "t.test_bf16_params_match_torch_adamw('cpp'); print(torch.backends.cpu.get_cpu_capability())"
    )
    path = os.pathsep.join(str(p) for p in (ROOT, ROOT / "python_tests", ROOT / "python_tests" / "kernels"))
    env = dict(os.environ, ATEN_CPU_CAPABILITY="avx2", PYTHONPATH=path)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[-1] in ("AVX2", "DEFAULT")


@pytest.mark.parametrize("backend", BACKENDS)
def test_tensor_hyperparameters_match_floats(backend):
    torch.testing.assert_close(
        run_ours(backend, torch.float32, steps=3, hparams_as_tensors=True),
        run_ours(backend, torch.float32, steps=3),
        rtol=0,
        atol=0,
    )


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "cpp", "reference"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_backends(backend, dtype):
    """On a GPU: the Triton kernel and the CUDA C++ kernel against torch.optim.AdamW, with lr and
    the other hyperparameters as CUDA 0-D tensors (no host sync)."""
    ours = run_ours(backend, dtype, hparams_as_tensors=True, device="cuda")
    for a, b in zip(ours, run_torch(dtype)):
        if dtype == torch.float32:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        else:
            torch.testing.assert_close(a.float(), b, rtol=2**-7, atol=1e-3)


@pytest.mark.skipif(not HAS_CPP or torch.cuda.is_available(), reason="extension not built / tested on CUDA")
def test_backends_round_bf16_the_same_way():
    """cpp and triton both round fp32 -> bf16 to nearest even. Their fp32 results may differ in the
    last bit (FMA contraction), which flips a rounding now and then, but only rarely and by one bf16
    ulp; a backend that truncated instead would differ on about half of the elements."""
    a = torch.cat([x.flatten() for x in run_ours("cpp", torch.bfloat16, steps=4)]).float()
    b = torch.cat([x.flatten() for x in run_ours("triton", torch.bfloat16, steps=4)]).float()
    differ = a != b
    assert differ.float().mean() < 0.01
    assert ((a - b).abs() <= a.abs() * 2**-7)[differ].all()


@pytest.mark.parametrize(
    "kwargs, arg",
    [
        (dict(lr=-1.0), "lr"),
        (dict(beta1=1.0), "beta1"),
        (dict(beta2=-0.1), "beta2"),
        (dict(eps=-1e-8), "eps"),
        (dict(weight_decay=-0.1), "weight_decay"),
        (dict(step=0), "step"),
    ],
)
def test_bad_hyperparameters_name_the_argument(kwargs, arg):
    p, g, m, v = torch.zeros(3), torch.zeros(3), torch.zeros(3), torch.zeros(3)
    hp = dict(step=1, lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0) | kwargs
    with pytest.raises(ValueError, match=rf"^{arg} "):
        adamw_slice_update([p], [g], [m], [v], **hp)


def _call(params, grads, exp_avgs, exp_avg_sqs, **kw):
    adamw_slice_update(params, grads, exp_avgs, exp_avg_sqs, 1, 1e-3, 0.9, 0.95, 1e-8, 0.0, **kw)


def test_bad_tensors_name_the_argument():
    def z(*s):
        return torch.zeros(*s)

    with pytest.raises(ValueError, match="^grads has 2 entries but params has 1"):
        _call([z(3)], [z(3), z(3)], [z(3)], [z(3)])
    with pytest.raises(ValueError, match="^lr_muls has 2 entries"):
        _call([z(3)], [z(3)], [z(3)], [z(3)], lr_muls=[1.0, 1.0])
    with pytest.raises(ValueError, match=r"^exp_avgs\[0\] has shape \(4,\)"):
        _call([z(3)], [z(3)], [z(4)], [z(3)])
    with pytest.raises(ValueError, match=r"^exp_avg_sqs\[0\] must be torch.float32"):
        _call([z(3)], [z(3)], [z(3)], [z(3).double()])
    with pytest.raises(ValueError, match=r"^grads\[0\] is on meta"):
        _call([z(3)], [torch.zeros(3, device="meta")], [z(3)], [z(3)])
    with pytest.raises(ValueError, match=r"^params\[0\] is not contiguous"):
        _call([z(4, 4).t()], [z(4, 4)], [z(4, 4)], [z(4, 4)])


@pytest.mark.skipif(not HAS_CPP, reason="extension not built")
def test_cpp_op_checks_its_own_arguments():
    """Called directly (bypassing the Python checks), the C++ op still refuses bad input."""
    op = torch.ops.nanochat_fast.adamw_slice_update
    hp = torch.zeros(7, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="not contiguous"):
        op([torch.zeros(4, 4).t()], [torch.zeros(4, 4)], [torch.zeros(4, 4)], [torch.zeros(4, 4)], hp, [1.0], [1.0])
    with pytest.raises(RuntimeError, match="same length"):
        op([torch.zeros(4)], [], [torch.zeros(4)], [torch.zeros(4)], hp, [1.0], [1.0])


@pytest.mark.parametrize("backend", BACKENDS[1:])
def test_opcheck(backend):
    """torch.library.opcheck of the cpp and triton ops: schema (mutation annotations), fake kernel,
    autograd registration."""
    g = torch.Generator().manual_seed(0)
    args = (
        [torch.randn(5, generator=g), torch.randn(2, 3, generator=g).bfloat16()],
        [torch.randn(5, generator=g), torch.randn(2, 3, generator=g).bfloat16()],
        [torch.zeros(5), torch.zeros(2, 3)],
        [torch.zeros(5), torch.zeros(2, 3)],
        torch.tensor([1e-3, 0.9, 0.95, 1e-8, 0.1, 0.1, 0.05**0.5], dtype=torch.float64),
        [1.0, 2.0],
        [1.0, 0.0],
    )
    name = "adamw_slice_update" if backend == "cpp" else "adamw_slice_update_triton"
    torch.library.opcheck(getattr(torch.ops.nanochat_fast, name).default, args)


@pytest.mark.skipif(not HAS_CPP, reason="extension not built")
def test_compiles_fullgraph():
    """torch.compile traces through the op (fake kernel) with no graph break, and a changing lr
    passed as a 0-D tensor does not recompile."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    params, grads = make_tensors(torch.float32), grads_for(1, torch.float32)
    exp_avgs, exp_avg_sqs = [torch.zeros(s) for s in SHAPES], [torch.zeros(s) for s in SHAPES]
    ref = [p.clone() for p in params]
    ref_m, ref_v = [m.clone() for m in exp_avgs], [v.clone() for v in exp_avg_sqs]

    @torch.compile(fullgraph=True, backend="aot_eager")
    def compiled_step(step, lr):
        adamw_slice_update(params, grads, exp_avgs, exp_avg_sqs, step, lr, 0.9, 0.95, 1e-8, 0.1, backend="cpp")

    for step in (1, 2):
        lr = torch.tensor(1e-2 * step)
        compiled_step(torch.tensor(step), lr)
        adamw_slice_update(ref, grads, ref_m, ref_v, step, 1e-2 * step, 0.9, 0.95, 1e-8, 0.1, backend="cpp")
    torch.testing.assert_close(params, ref, rtol=0, atol=0)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


def test_forcing_an_unavailable_backend_is_one_line(monkeypatch):
    monkeypatch.setenv("NANOCHAT_FAST_KERNELS", "adamw_slice_update=triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(KernelUnavailableError, match="TRITON_INTERPRET=1") as e:
        _call([torch.zeros(3)], [torch.zeros(3)], [torch.zeros(3)], [torch.zeros(3)])
    assert "\n" not in str(e.value)
    monkeypatch.setenv("NANOCHAT_FAST_KERNELS", "fastest")
    with pytest.raises(KernelUnavailableError, match="unknown backend 'fastest'"):
        _call([torch.zeros(3)], [torch.zeros(3)], [torch.zeros(3)], [torch.zeros(3)])


def test_env_selects_per_op(monkeypatch):
    monkeypatch.setenv("NANOCHAT_FAST_KERNELS", "newton_schulz=reference,adamw_slice_update=reference")
    assert registry.select("adamw_slice_update", "cpu").name == "reference"
    monkeypatch.setenv("NANOCHAT_FAST_KERNELS", "auto")
    assert registry.select("adamw_slice_update", "cpu").name == ("cpp" if HAS_CPP else "reference")
    assert registry.select("adamw_slice_update", "mps").name == "reference"


def camel_to_snake(name: str) -> str:
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).lower()


def test_hparam_layout_is_the_one_of_the_cpp_header():
    """The slots named once in Python (adamw_slice.HPARAMS) are the C++ enum of
    csrc/adamw_slice_hparams.h (kLr = 0, ..., kNumAdamWHParams), in the same order."""
    header = (ROOT / "csrc" / "adamw_slice_hparams.h").read_text()
    enum = {name: int(value) for name, value in re.findall(r"\bk(\w+)\s*=\s*(\d+)", header)}
    count = enum.pop("NumAdamWHParams")
    assert sorted(enum.values()) == list(range(count))
    assert [camel_to_snake(name) for name in sorted(enum, key=enum.get)] == list(HPARAMS)
    assert camel_to_snake("BiasCorrection2Sqrt") == "bias_correction2_sqrt"  # the rule the comparison uses


@pytest.mark.parametrize("as_tensors", [False, True])
def test_make_hparams_puts_each_value_in_its_named_slot(as_tensors):
    values = dict(lr=0.125, beta1=0.75, beta2=0.875, eps=1e-6, weight_decay=0.25)
    given = {k: torch.tensor(v, dtype=torch.float64) for k, v in values.items()} if as_tensors else values
    hp = make_hparams(3, device="cpu", **given)
    expected = dict(values, bias_correction1=1 - 0.75**3, bias_correction2_sqrt=(1 - 0.875**3) ** 0.5)
    assert hp.dtype == torch.float64 and hp.shape == (len(HPARAMS),)
    for name, value in expected.items():
        assert hp[SLOT[name]].item() == pytest.approx(value, rel=1e-15), name
