"""train/model_setup.py: the compile watch counts real dynamo graphs, and evaluation through the plain
module leaves a compiled training model's graphs alone (dynamo with the eager backend: the
tracing and guards of torch.compile without inductor's code generation, so it is quick)."""

import pytest
import torch

from nanochat_fast.model.gpt import GPT, GPTConfig
from nanochat_fast.train.model_setup import MIN_RUN_SECONDS_AT_PEAK, CompileWatch, default_compile


def fail_on_recompile():
    """A context in which any recompile raises (torch.compiler.set_stance): evaluation and sampling
    must leave the training graph alone."""
    return torch.compiler.set_stance("fail_on_recompile")


def test_watch_counts_graphs_and_recompiles():
    torch._dynamo.reset()
    f = torch.compile(lambda x: (x * 2).sum(), backend="eager", dynamic=False)
    with CompileWatch() as first:
        f(torch.ones(3))
    with CompileWatch() as again:
        f(torch.ones(3))
    with CompileWatch() as new_shape:
        f(torch.ones(5))
    assert (first.graphs, again.graphs, new_shape.graphs) == (1, 0, 1)
    assert again.describe() == "nothing compiled"
    assert first.describe().startswith("1 graph(s) compiled in ")
    with fail_on_recompile(), pytest.raises(Exception, match="(?i)recompil"):
        f(torch.ones(7))


@pytest.fixture
def compiled_gpt():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = GPT(GPTConfig(sequence_len=16, vocab_size=64, n_layer=1, n_head=2, n_kv_head=2, n_embd=32))
    model.init_weights()
    x, y = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
    compiled = torch.compile(model, backend="eager", dynamic=False)
    compiled(x, y, loss_reduction="sum").backward()
    return model, compiled, x, y


def test_evaluation_through_the_compiled_model_compiles_a_second_graph(compiled_gpt):
    model, compiled, x, y = compiled_gpt
    with CompileWatch() as watch, torch.no_grad():
        compiled.eval()
        compiled(x, y, loss_reduction="none")
        compiled.train()
    assert watch.graphs == 1
    with fail_on_recompile():  # the training graph is still there
        compiled(x, y, loss_reduction="sum").backward()


def test_evaluation_and_sampling_through_the_plain_module_compile_nothing(compiled_gpt):
    model, compiled, x, y = compiled_gpt
    with fail_on_recompile(), CompileWatch() as watch:
        with torch.no_grad():
            model.eval()
            model(x, y, loss_reduction="none")
            model.train()
        tokens = list(model.generate([1, 2, 3], max_tokens=5, temperature=0))
        compiled(x, y, loss_reduction="sum").backward()
    assert watch.graphs == 0 and len(tokens) == 5


def test_default_compile_by_device_and_run_size():
    assert default_compile("cuda")[0] and default_compile("cpu")[0]  # horizon unknown: compile
    compile_mps, why = default_compile("mps")
    assert not compile_mps and "mps" in why
    peak = 100e9
    short, why = default_compile("cpu", run_flops=peak * (MIN_RUN_SECONDS_AT_PEAK - 1), peak_flops=peak)
    assert not short and "short run (~99 s of compute at peak)" in why
    assert default_compile("cpu", run_flops=peak * MIN_RUN_SECONDS_AT_PEAK, peak_flops=peak)[0]
