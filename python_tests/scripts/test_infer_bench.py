"""infer_bench: a tiny sweep finishes, its last stdout line is JSON with every figure per batch size,
each row decodes the tokens asked for (even where the model wants to stop), and the bytes per step
behind MBU are the hand count; a run's checkpoint benchmarks the same way."""

import json
import math

import pytest
from support.chat_web_support import random_model, save_chat_checkpoint
from support.stub_models import StubModel, byte_tokenizer, one_thread  # noqa: F401 (an autouse fixture)

from nanochat_fast.core import cli
from nanochat_fast.model.batch_engine import Request
from nanochat_fast.model.gpt import GPTConfig
from nanochat_fast.scripts import infer_bench

TINY = ["--depth=1", "--vocab-size=512", "--max-seq-len=64", "--prompt-tokens=8", "--decode-tokens=5", "--dtype=fp32"]
FIELDS = [
    "prefill_tok_per_s",
    "decode_tok_per_s",
    "per_token_latency_s",
    "ttft_median_s",
    "prefill_s",
    "decode_s",
    "peak_memory_bytes",
    "kv_cache_bytes",
    "kv_read_bytes_per_step",
    "bytes_per_step",
    "steps_per_s",
    "mbu_percent",
    "mfu_percent",
]


def bench(argv, capsys) -> tuple[dict, list[str]]:
    """Run the script in-process: (its last stdout line as JSON, the lines before it)."""
    assert infer_bench.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    return json.loads(lines[-1]), lines[:-1]


def test_a_tiny_sweep_reports_every_figure_and_mbu_from_the_bytes_count(nanochat_home, capsys):
    out, text = bench(TINY + ["--batch-sizes=1,2"], capsys)
    assert [row["batch_size"] for row in out["sweep"]] == [1, 2]
    # depth 1 at vocab 512: n_embd 128, one head of 128; wte and lm_head 512x128, the block 12 x 128x128
    params = 2 * 512 * 128 + 12 * 128 * 128
    products = params - 512 * 128  # wte is looked up: one row of 128 per row and step
    assert out["params"] == params and out["weight_bytes_per_step"] == products * 4  # fp32
    assert out["product_weights"] == products and out["lookup_values_per_row"] == 128
    assert out["lookup_bytes_per_row"] == 128 * 4
    kv_per_position = 1 * 2 * 1 * 128 * 4  # layers x (k, v) x kv heads x head_dim x fp32
    assert out["kv_bytes_per_position"] == kv_per_position and out["kv_dtype"] == "float32"
    # decode steps feed tokens 1..4 at positions 8..11: each reads 9, 10, 11, 12 cached positions
    assert out["mean_context"] == sum(8 + i for i in range(1, 5)) / 4 == 10.5
    assert out["decode_flops_per_token"] == 2 * (params - 512 * 128) + 4 * 128 * 10.5
    bandwidth = out["bandwidth"]["bytes_per_s"]
    for row in out["sweep"]:
        b = row["batch_size"]
        for key in FIELDS:
            assert math.isfinite(row[key]) and row[key] > 0, (key, row[key])
        assert row["tokens_per_row"] == 5 and row["decode_steps"] == 4
        assert row["bytes_per_step"] == products * 4 + b * (128 * 4 + kv_per_position * 10.5)
        steps_per_s = 4 / row["decode_s"]
        assert row["steps_per_s"] == pytest.approx(steps_per_s)
        assert row["decode_tok_per_s"] == pytest.approx(b * steps_per_s)
        assert row["prefill_tok_per_s"] == pytest.approx(b * 8 / row["prefill_s"])
        assert row["per_token_latency_s"] == pytest.approx(row["decode_s"] / 4)
        assert row["mbu_percent"] == pytest.approx(100 * row["bytes_per_step"] * steps_per_s / bandwidth)
        assert row["kv_cache_bytes"] == b * 13 * kv_per_position  # slots x (prompt + decode) positions
        # CPU: computed; fp32 decode steps also hold a packed copy of every linear weight (all but
        # wte; their output sizes are multiples of the 32-column panel, so no padding)
        assert row["peak_memory_bytes"] == params * 4 + (params - 512 * 128) * 4 + row["kv_cache_bytes"]
        assert any(line.split()[:1] == [str(b)] for line in text)  # its row of the table
    assert out["model"]["depth"] == 1 and "stand-in" in out["model"]["tokenizer"]


def test_the_default_sweep_stops_at_what_fits_the_kv_memory(nanochat_home, capsys):
    per_row = 13 * 1024  # 13 positions of 1,024 bytes
    out, _ = bench(TINY + [f"--kv-memory={5 * per_row + 100}"], capsys)
    assert [row["batch_size"] for row in out["sweep"]] == [1, 2, 4]
    assert out["kv_memory_bytes"] == 5 * per_row + 100


class AlwaysStops(StubModel):
    """Every position's likeliest token is <|assistant_end|>."""

    def next_token(self, idx, p):
        return byte_tokenizer().encode_special("<|assistant_end|>")


def test_rows_run_their_full_length_even_when_the_model_wants_to_stop():
    tok = byte_tokenizer()
    engine = infer_bench.engine_for(AlwaysStops(tok.get_vocab_size()), tok, slots=2, max_len=16)
    rows = [row for p in ([1, 2], [3]) for row in engine.add(Request(p, 6, use_tools=False))]
    while engine.active:
        engine.step()
    assert [len(row.tokens) for row in rows] == [6, 6] and {row.reason for row in rows} == {"max_tokens"}
    assert set(rows[0].tokens) == {tok.encode_special("<|assistant_end|>")}


def test_a_runs_checkpoint(home, capsys):
    """A saved chat checkpoint (random weights, GQA: 2 query heads share 1 kv head), loaded the way
    chat_cli loads it, with the home's tokenizer."""
    from nanochat_fast.data.tokenizer import get_tokenizer

    vocab = get_tokenizer(home / "tokenizer").get_vocab_size()
    config = GPTConfig(sequence_len=64, vocab_size=vocab, n_layer=2, n_head=2, n_kv_head=1, n_embd=32)
    save_chat_checkpoint(home, "tinychat", random_model(config), step=3)
    out, _ = bench(
        ["--run=tinychat", "--batch-sizes=2", "--prompt-tokens=6", "--decode-tokens=4", "--dtype=fp32"], capsys
    )
    assert out["model"]["step"] == 3 and out["model"]["checkpoint"].endswith("step_000003")
    assert out["model_config"]["n_kv_head"] == 1
    assert out["kv_bytes_per_position"] == 2 * 2 * 1 * 16 * 4  # layers x (k, v) x kv heads x head_dim x fp32
    [row] = out["sweep"]
    assert row["tokens_per_row"] == 4 and row["batch_size"] == 2 and row["mbu_percent"] > 0
    products = sum(p.numel() for name, p in random_model(config).named_parameters() if "wte" not in name)
    assert out["weight_bytes_per_step"] == products * 4
    with pytest.raises(SystemExit) as exit_info:  # beyond the checkpoint's 64 positions
        cli.run(infer_bench.main, ["--run=tinychat", "--prompt-tokens=60", "--decode-tokens=8"])
    assert exit_info.value.code == 2
    assert "beyond the model's context of 64 tokens" in capsys.readouterr().err


def test_a_windowed_depth_model_counts_the_keys_its_windows_read(nanochat_home, capsys):
    """--arch=windowed --depth: the windowed family's model (value embeddings, windows); past the short
    window (128 of 256) the S layer reads its window and its own entry, the L layer every entry."""
    from nanochat_fast.model import loading
    from nanochat_fast.model.windowed_gpt import WindowedGPTConfig

    argv = ["--depth=2", "--vocab-size=512", "--max-seq-len=256", "--prompt-tokens=150", "--decode-tokens=5"]
    out, _ = bench(argv + ["--arch=windowed", "--window-pattern=SL", "--batch-sizes=2", "--dtype=fp32"], capsys)
    assert out["model"]["arch"] == "windowed" and out["model_config"]["window_pattern"] == "SL"
    config = WindowedGPTConfig(**out["model_config"])
    assert config.window_sizes() == [128, 256]
    params = sum(p.numel() for p in loading.meta_model(config).parameters())
    assert out["params"] == params
    # decode steps 1..4 read 151..154 entries in the L layer (prompt + i), 129 in the S layer (its window + 1)
    keys = (129 + 152.5) / 2
    assert out["mean_keys_read"] == keys
    # wte and layer 1's value embedding (n_embd 128, one head of 128 at depth 2): lookups, not products
    assert (config.n_embd, config.n_head, config.n_kv_head, config.head_dim) == (128, 1, 1, 128)
    lookups = 2 * 512 * 128
    assert out["decode_flops_per_token"] == 2 * (params - lookups) + 4 * 2 * 1 * 128 * keys
    [row] = out["sweep"]
    assert row["tokens_per_row"] == 5 and row["kv_read_bytes_per_step"] == 2 * out["kv_bytes_per_position"] * keys
    with pytest.raises(SystemExit) as exit_info:
        cli.run(infer_bench.main, ["--run=x", "--arch=windowed"])
    assert exit_info.value.code == 2 and "a --run's checkpoint has its own" in capsys.readouterr().err
