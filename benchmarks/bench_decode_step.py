"""A decode step on CPU: the packed linears and the decode attention against stock PyTorch.

The model is chat_web's benchmark model (depth 4: n_embd 256, 2 heads of 128, vocab 4096), random
weights, fp32, one thread (a chat_web replica's). A decode step feeds B rows one token each.

  test_linears    every linear of one decode step (4 x [q, k, v, o, fc, proj] + lm_head) on B rows:
                  packed_linear vs F.linear (MKL sgemm), MKL's packed sgemm (torch.ops.mkl._mkl_linear,
                  what inductor's freezing uses for fp32 linears on CPU) and F.linear in bf16
  test_attention  4 layers of one decode step's attention, 8 rows at lengths 100..170 in a cache of
                  8 slots x 512 positions: decode_attention (rotary, QK-norm, the cache writes and the
                  attention in one op) vs PyTorch's ops for those and SDPA with the per-row mask (flash,
                  the CPU default, and math). Here the cache sits in the CPU's caches between calls; in a
                  real step the weights pass between two layers' reads and the keys come from DRAM.
  test_engine     whole BatchEngine.step()s of B rows: the kernels above vs the same engine on stock
                  PyTorch (NANOCHAT_FAST_KERNELS=packed_linear=reference,decode_attention=reference,
                  rms_norm=reference,decode_block=reference,softcap=reference,smear_decode=reference),
                  fp32 and under bf16 autocast; for the gpt family and the windowed family (SSSL) of
                  the same size
"""

import sys
import time
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from harness import compare

from nanochat_fast.kernels import registry
from nanochat_fast.kernels.decode_step import decode_attention, pack_linear
from nanochat_fast.model import loading
from nanochat_fast.model.batch_engine import BatchEngine, Request
from nanochat_fast.model.gpt import config_from_depth

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python_tests"))  # the support package
from support.chat_web_support import random_model  # noqa: E402
from support.stub_models import one_thread  # noqa: E402, F401 (an autouse fixture: a chat_web replica's one thread)

pytestmark = pytest.mark.skipif(registry.extension() is None, reason="extension not built")
CONFIG = config_from_depth(4, 4096, 512)
FAMILY = {"gpt": "GPT", "windowed": "windowed GPT (SSSL)"}
STOCK = ",".join(
    f"{op}=reference"
    for op in ("packed_linear", "decode_attention", "rms_norm", "decode_block", "softcap", "smear_decode")
)


def model(arch="gpt"):
    return random_model(loading.family_config(CONFIG, arch, "SSSL")).eval()


@pytest.mark.parametrize("rows", [1, 8, 64])
def test_linears(benchmark, rows):
    weights = [mod.weight.detach() for mod in model().modules() if isinstance(mod, torch.nn.Linear)]
    x = {w.size(1): torch.randn(rows, w.size(1)) for w in weights}
    packed = [pack_linear(w, backend="cpp") for w in weights]
    mkl = [torch.ops.mkl._mkl_reorder_linear_weight(w, rows) for w in weights]
    bf16 = [w.bfloat16() for w in weights]
    xb = {k: v.bfloat16() for k, v in x.items()}
    compare(
        benchmark,
        op=f"decode-step linears, {rows} row(s)",
        baseline="F.linear fp32 (sgemm)",
        shape_set=f"depth-4 GPT: {len(weights)} fp32 matrices, {sum(w.numel() for w in weights) / 1e6:.1f}M values",
        variants={
            "packed_linear (ours)": lambda: [p(x[p.weight.size(1)]) for p in packed],
            "F.linear fp32 (sgemm)": lambda: [F.linear(x[w.size(1)], w) for w in weights],
            "MKL packed sgemm fp32": lambda: [
                torch.ops.mkl._mkl_linear(x[w.size(1)], m, w, None, rows) for w, m in zip(weights, mkl)
            ],
            "F.linear bf16": lambda: [F.linear(xb[w.size(1)], w) for w in bf16],
        },
        rounds=30,
        notes="one thread; ratio < 1 is faster than sgemm",
    )


def test_attention(benchmark):
    g = torch.Generator().manual_seed(0)
    D, H, Hkv = CONFIG.head_dim, CONFIG.n_head, CONFIG.n_kv_head
    positions = torch.arange(99, 179, 10)  # the new tokens' positions: rows at lengths 100..170
    L = int(positions.max()) + 1
    caches = [torch.randn(2, 8, Hkv, 512, D, generator=g)[:, :, :, :L] for _ in range(CONFIG.n_layer)]
    rows = torch.arange(8)
    q, k, v = (torch.randn(8, 1, h, D, generator=g) for h in (H, Hkv, Hkv))
    angles = torch.randn(8, 1, 1, D // 2, generator=g)
    cos, sin = angles.cos(), angles.sin()

    def layers(backend, sdpa=None):
        def run():
            with torch.nn.attention.sdpa_kernel(sdpa) if sdpa is not None else nullcontext():
                for cache in caches:
                    decode_attention(q, k, v, cos, sin, cache, rows, positions, backend=backend)

        return run

    compare(
        benchmark,
        op="decode-step attention, 8 rows",
        baseline="SDPA flash, masked",
        shape_set=f"4 layers x 8 rows x {H} heads of {D}, lengths 100..170",
        variants={
            "decode_attention (ours)": layers("cpp"),
            "SDPA flash, masked": layers("reference"),
            "SDPA math, masked": layers("reference", torch.nn.attention.SDPBackend.MATH),
        },
        rounds=30,
        notes="one thread; rotary, QK-norm and the cache writes included; the reference backend is PyTorch's "
        "ops for those and SDPA with the per-row mask",
    )


@pytest.mark.parametrize("arch", ["gpt", "windowed"])
@pytest.mark.parametrize("rows", [1, 8])
def test_engine(benchmark, rows, arch, monkeypatch):
    m = model(arch)

    class Tokens:  # no stop tokens in reach: every row decodes all its tokens
        def encode_special(self, s):
            return 4095

        def get_bos_token_id(self):
            return 4095

    def steps(kernels, autocast):
        def run():
            monkeypatch.setenv(registry.ENV_VAR, kernels)
            engine = BatchEngine(m, Tokens(), slots=8, max_len=512)
            for i in range(rows):
                engine.add(Request(list(range(10 + i, 34 + i)), 64, use_tools=False))
            with torch.autocast("cpu", dtype=torch.bfloat16) if autocast else nullcontext():
                engine.step()  # the prefills
                start = time.perf_counter()
                while engine.active:
                    engine.step()
            return (time.perf_counter() - start) / 63  # seconds per decode step

        return run

    compare(
        benchmark,
        op=f"BatchEngine decode step, {rows} row(s)",
        baseline="stock fp32",
        shape_set=f"depth-4 {FAMILY[arch]}, vocab 4096, 24-token prompts, 63 decode steps",
        variants={
            "ours (decode_block: packed_linear, decode_attention, rms_norm; softcap)": steps("auto", False),
            "stock fp32": steps(STOCK, False),
            "stock bf16 autocast": steps(STOCK, True),
        },
        rounds=7,
        notes="one thread; seconds per decode step",
    )
