"""import_nanochat and export_nanochat against nanochat's own file formats (written by
nanochat_files.py the way nanochat writes them), and the runs they make used by our commands.

The reference for the weights is the checkpoint's tensors themselves, run through a GPT built
here; for the tokenizer, the tiktoken encoding nanochat pickled; for the optimizer, the
AdamW/Muon state put into nanochat's files."""

import datetime
import json
import math
import pickle
import shutil

import pytest
import torch
from support.nanochat_files import gpt_shapes, optimizer_files, random_weights, write_checkpoint, write_tokenizer
from support.tiny_pipeline import TINY_LOOP, TINY_MODEL

from nanochat_fast.core import cli
from nanochat_fast.data.tokenizer import Tokenizer, get_tokenizer
from nanochat_fast.model import loading
from nanochat_fast.model.gpt import GPT, GPTConfig
from nanochat_fast.scripts import base_eval, base_train, chat_cli, export_nanochat, import_nanochat, mid_train

# our TINY_MODEL (depth 2, aspect 32, head_dim 32, 64-token rows) as nanochat's model_config
CFG = dict(sequence_len=64, vocab_size=320, n_layer=2, n_head=2, n_kv_head=2, n_embd=64)
SAMPLE = (
    "<|bos|>Hello, world! 2025.<|user_start|>Grüße aus Köln – café.<|user_end|><|assistant_start|>"
    "日本語と中文。 Русский. Ελληνικά. العربية. हिन्दी 🙂<|assistant_end|><|python_start|>1+1<|python_end|>"
    "<|output_start|>2<|output_end|>"
)
TINY_STEP = ["--device-batch-size=4", "--total-batch-size=512", "--eval-every=-1", "--no-compile"]


def run_main(module, argv, capsys):
    """main(argv) as `python -m` runs it: (exit code, stdout, stderr)."""
    with pytest.raises(SystemExit) as e:
        cli.run(module.main, argv)
    out = capsys.readouterr()
    return e.value.code, out.out, out.err


def reference_logits(weights: dict, cfg: dict, ids: torch.Tensor) -> torch.Tensor:
    """The nanochat checkpoint's tensors (as fp32, vocab padding cut) in a GPT built here, in float64."""
    model = GPT(GPTConfig(**cfg))
    V = cfg["vocab_size"]
    model.load_state_dict(
        {k: (v[:V] if k in ("transformer.wte.weight", "lm_head.weight") else v).float() for k, v in weights.items()}
    )
    return model.double().eval()(ids)


def imported_logits(run_dir, ids):
    model, _, _ = loading.load_model(run_dir, None, torch.device("cpu"), get_tokenizer())
    return model.double()(ids)


@pytest.fixture
def nano(home, tmp_path):
    """A nanochat base checkpoint (step 40, wte bf16, one-process optimizer state) of our tiny model,
    with the tokenizer of `home` pickled the nanochat way."""
    tok = get_tokenizer()
    enc = write_tokenizer(tmp_path / "nano" / "tokenizer", dict(tok.enc._mergeable_ranks), tok.pattern)
    weights = random_weights(CFG, CFG["vocab_size"])
    files, adam, muon = optimizer_files(weights, world_size=1)
    folder = tmp_path / "nano" / "base_checkpoints" / "d2"
    write_checkpoint(folder, 40, CFG, weights, val_bpb=1.25, optim=files)
    weights["transformer.wte.weight"] = weights["transformer.wte.weight"].bfloat16()  # what the file holds
    return dict(folder=folder, tok_dir=tmp_path / "nano" / "tokenizer", enc=enc, weights=weights, adam=adam, muon=muon)


def test_import_then_evaluate_chat_and_keep_training(home, nano, tmp_path, capsys):
    code, out, err = run_main(
        import_nanochat, [f"--from={nano['folder']}", f"--tokenizer={nano['tok_dir']}", "--run=imp"], capsys
    )
    assert code == 0, err
    assert "step 40" in out and "val bpb 1.2500" in out and "n_embd=64" in out and "AdamW after 7 updates" in out
    run_dir = home / "runs" / "imp"
    # weights: the checkpoint's logits through our GPT
    ids = torch.tensor([get_tokenizer().encode(SAMPLE)[:60]])
    assert torch.equal(imported_logits(run_dir, ids), reference_logits(nano["weights"], CFG, ids))
    # tokenizer: nanochat's ids, special tokens included
    assert get_tokenizer().enc.encode(SAMPLE, allowed_special="all") == nano["enc"].encode(
        SAMPLE, allowed_special="all"
    )
    # optimizer state: nanochat's moments and momentum under our parameter names
    shards = torch.load(run_dir / "checkpoints/step_000040/optim_rank0.pt", weights_only=True)["optimizers"]
    assert shards[0]["num_updates"] == 7
    for name, st in nano["adam"].items():
        assert torch.equal(shards[0]["state"][name]["exp_avg"], st["exp_avg"].reshape(-1))
        assert torch.equal(shards[0]["state"][name]["exp_avg_sq"], st["exp_avg_sq"].reshape(-1))
    for name, st in nano["muon"].items():
        assert torch.equal(shards[1]["state"][name]["momentum_buffer"], st["momentum_buffer"])
        assert torch.equal(shards[1]["state"][name]["normuon_second_moment"], st["second_momentum_buffer"])

    code, out, err = run_main(
        base_eval,
        ["--run=imp", "--max-examples=0", "--eval-tokens=512", "--samples=1", "--max-tokens=4", "--dtype=fp32"],
        capsys,
    )
    assert code == 0 and "val bpb" in out, err
    code, out, err = run_main(chat_cli, ["--run=imp", "--prompt=hello", "--max-tokens=4", "--dtype=fp32"], capsys)
    assert code == 0 and out.startswith("Assistant: "), err

    # pretraining goes on from step 40 with nanochat's optimizer state: AdamW counts 7 + 2 updates
    code, out, err = run_main(
        base_train, TINY_MODEL + TINY_LOOP + TINY_STEP + ["--run=imp", "--resume=auto", "--num-iterations=42"], capsys
    )
    assert code == 0, err
    assert "resumed from" in out and "(step 40" in out and "has no data position" in out
    shards = torch.load(run_dir / "checkpoints/step_000042/optim_rank0.pt", weights_only=True)["optimizers"]
    assert shards[0]["num_updates"] == 9
    code, out, err = run_main(
        mid_train, TINY_LOOP + TINY_STEP + ["--base-run=imp", "--num-iterations=1", "--run=mid_imp"], capsys
    )
    assert code == 0, err

    # export that run of ours: nanochat's layout and dtypes; importing it again gives the same tensors
    out_dir = tmp_path / "exported"
    code, out, err = run_main(export_nanochat, ["--run=imp", f"--out={out_dir}"], capsys)
    assert code == 0, err
    folder = out_dir / "base_checkpoints" / "d2"
    assert sorted(p.name for p in folder.iterdir()) == ["meta_000042.json", "model_000042.pt"]
    state = torch.load(folder / "model_000042.pt", weights_only=True)
    assert {k: tuple(v.shape) for k, v in state.items()} == gpt_shapes(CFG, CFG["vocab_size"])
    assert all(v.dtype == torch.float32 for v in state.values())
    meta = json.loads((folder / "meta_000042.json").read_text())
    assert meta["step"] == 42 and meta["model_config"] == CFG
    with open(out_dir / "tokenizer" / "tokenizer.pkl", "rb") as f:
        enc = pickle.load(f)  # our own file: what nanochat's RustBPETokenizer.from_directory does
    assert enc.encode(SAMPLE, allowed_special="all") == nano["enc"].encode(SAMPLE, allowed_special="all")
    token_bytes = torch.load(out_dir / "tokenizer" / "token_bytes.pt", weights_only=True)
    assert token_bytes.dtype == torch.int32 and torch.equal(token_bytes, torch.load(home / "tokenizer/token_bytes.pt"))
    code, out, err = run_main(
        import_nanochat, [f"--from={folder}", f"--tokenizer={out_dir / 'tokenizer'}", "--run=reimp"], capsys
    )
    assert code == 0 and "fresh optimizer state" in out, err
    ours = torch.load(run_dir / "checkpoints/step_000042/model.pt", weights_only=True)
    again = torch.load(home / "runs/reimp/checkpoints/step_000042/model.pt", weights_only=True)
    assert ours.keys() == again.keys() and all(torch.equal(ours[k], again[k]) for k in ours)
    # without optimizer files, training from it starts with fresh state and says so
    code, out, err = run_main(
        base_train, TINY_MODEL + TINY_LOOP + TINY_STEP + ["--run=reimp", "--resume=auto", "--num-iterations=43"], capsys
    )
    assert code == 0 and "imported without optimizer state: the optimizers start fresh" in out, err
    shards = torch.load(home / "runs/reimp/checkpoints/step_000043/optim_rank0.pt", weights_only=True)["optimizers"]
    assert shards[0]["num_updates"] == 1


def test_import_into_a_fresh_home_padded_vocab_and_sharded_optimizer(nanochat_home, tmp_path, capsys):
    """A 300-token tokenizer written into an empty home, nanochat's vocab padding (320 rows),
    torch.compile's key prefix, and DistAdamW/DistMuon state over 2 rank files."""
    tok = Tokenizer.train(["the quick brown fox jumps over the lazy dog; Grüße 日本 " * 30], vocab_size=300)
    enc = write_tokenizer(tmp_path / "tok", dict(tok.enc._mergeable_ranks), tok.pattern)
    cfg = dict(CFG, vocab_size=tok.get_vocab_size())
    weights = random_weights(cfg, 320)
    two, adam, muon = optimizer_files(weights, world_size=2)
    one, _, _ = optimizer_files(weights, world_size=1)
    write_checkpoint(tmp_path / "a", 5, cfg, weights, optim=two, compiled_keys=True, bf16_wte=False)
    write_checkpoint(tmp_path / "b", 5, cfg, weights, optim=one)
    code, out, err = run_main(
        import_nanochat,
        [f"--from={tmp_path / 'a'}", f"--tokenizer={tmp_path / 'tok'}", "--run=two", "--phase=sft"],
        capsys,
    )
    assert code == 0, err
    assert (nanochat_home / "tokenizer" / "tokenizer.tiktoken").is_file()
    assert get_tokenizer().enc.encode(SAMPLE, allowed_special="all") == enc.encode(SAMPLE, allowed_special="all")
    ids = torch.tensor([get_tokenizer().encode(SAMPLE)[:60]])
    assert torch.equal(imported_logits(nanochat_home / "runs/two", ids), reference_logits(weights, cfg, ids))
    code, out, err = run_main(
        import_nanochat, [f"--from={tmp_path / 'b'}", f"--tokenizer={tmp_path / 'tok'}", "--run=one"], capsys
    )
    assert code == 0 and "already in" in out, err
    a, b = (
        torch.load(nanochat_home / f"runs/{r}/checkpoints/step_000005/optim_rank0.pt", weights_only=True)
        for r in ("two", "one")
    )
    for i in range(2):  # the rank shards of DistAdamW/DistMuon are the one-process state, rows cut to 300
        assert a["optimizers"][i]["state"].keys() == b["optimizers"][i]["state"].keys()
        for name, entry in a["optimizers"][i]["state"].items():
            for key, value in entry.items():
                other = b["optimizers"][i]["state"][name][key]
                assert torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other
    assert a["optimizers"][0]["state"]["lm_head.weight"]["numel"] == 300 * 64
    assert torch.equal(
        a["optimizers"][0]["state"]["lm_head.weight"]["exp_avg"], adam["lm_head.weight"]["exp_avg"][:300].reshape(-1)
    )


def bad_pickle(tmp_path, nano):
    with open(nano["tok_dir"] / "tokenizer.pkl", "wb") as f:
        pickle.dump(datetime.date(2025, 1, 1), f)  # harmless, but not a tiktoken encoding


def shapes_off(tmp_path, nano):
    meta_path = nano["folder"] / "meta_000040.json"
    meta = json.loads(meta_path.read_text())
    meta["model_config"]["n_embd"] = 128
    meta_path.write_text(json.dumps(meta))


def other_vocab(tmp_path, nano):
    tok = Tokenizer.train(["some other text to train a smaller tokenizer " * 20], vocab_size=290)
    write_tokenizer(nano["tok_dir"], dict(tok.enc._mergeable_ranks), tok.pattern)


BAD = [  # (id, change to the nanochat files, extra argv, expected text)
    ("no-meta", lambda t, n: [p.unlink() for p in n["folder"].glob("meta_*.json")], [], "no meta_*.json there"),
    ("no-such-step", None, ["--step=41"], "--step 41: "),
    ("shapes-differ", shapes_off, [], "has shape [320, 64] but model_config"),
    ("foreign-pickle", bad_pickle, [], "refers to datetime.date: only a tiktoken encoding is read"),
    ("vocab-differs", other_vocab, [], "tokens but the model's vocab_size is 320"),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_nanochat_files_are_one_line_and_write_nothing(case, nano, tmp_path, capsys, monkeypatch):
    _, change, extra, expected = case
    fresh = tmp_path / "fresh_home"
    monkeypatch.setenv("NANOCHAT_FAST_HOME", str(fresh))
    if change:
        change(tmp_path, nano)
    code, out, err = run_main(
        import_nanochat, [f"--from={nano['folder']}", f"--tokenizer={nano['tok_dir']}", "--run=bad", *extra], capsys
    )
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and expected in lines[0], err
    assert not fresh.exists() or not any(fresh.rglob("*")), sorted(fresh.rglob("*"))


def test_import_refuses_a_home_with_another_tokenizer(home, nano, tmp_path, capsys):
    ranks = dict(get_tokenizer().enc._mergeable_ranks)  # the same ranks with another split pattern
    write_tokenizer(nano["tok_dir"], ranks, r"""\p{L}+|\p{N}+|\s+|[^\s\p{L}\p{N}]+""")
    before = (home / "tokenizer" / "tokenizer.tiktoken").read_bytes()
    code, _, err = run_main(
        import_nanochat, [f"--from={nano['folder']}", f"--tokenizer={nano['tok_dir']}", "--run=x"], capsys
    )
    assert code == 2 and "holds another tokenizer" in err
    assert (home / "tokenizer" / "tokenizer.tiktoken").read_bytes() == before and not (home / "runs" / "x").exists()
    shutil.rmtree(nano["tok_dir"])


class Shell:
    """A pickle that would run a command when unpickled by pickle.load (never run here)."""

    def __reduce__(self):
        return (__import__("os").system, ("touch SHOULD_NOT_EXIST",))


@pytest.mark.parametrize("payload, named", [(Shell(), "posix.system"), ({"pat_str": "x"}, "holds a dict")])
def test_the_restricted_unpickler_runs_nothing(payload, named, tmp_path, monkeypatch):
    from nanochat_fast.core.errors import UserError
    from nanochat_fast.interop import nanochat_tokenizer

    monkeypatch.chdir(tmp_path)
    path = tmp_path / "tokenizer.pkl"
    path.write_bytes(pickle.dumps(payload))
    with pytest.raises(UserError, match=named):
        nanochat_tokenizer.read_encoding_state(path)
    assert not (tmp_path / "SHOULD_NOT_EXIST").exists()


def test_a_token_bytes_file_computed_the_old_way_imports_with_true_byte_lengths(home, nano, tmp_path, capsys):
    """nanochat's tok_train before 2026-07-03 counted each token's bytes through str: a byte that is not
    UTF-8 on its own became U+FFFD, 3 bytes. Such a file imports with one notice line; base_eval gives
    the true bpb (the same as for a correct file) and, beside it, the figure nanochat's file gives."""
    enc, offset = nano["enc"], len(get_tokenizer().enc._mergeable_ranks)
    old = [0 if i >= offset else len(enc.decode([i]).encode("utf-8")) for i in range(enc.n_vocab)]
    true = [0 if i >= offset else len(enc.decode_single_token_bytes(i)) for i in range(enc.n_vocab)]
    differ = sum(a != b for a, b in zip(old, true))
    assert differ >= 128  # at least every single byte >= 0x80
    old_dir = tmp_path / "old_tok"
    shutil.copytree(nano["tok_dir"], old_dir)
    torch.save(torch.tensor(old, dtype=torch.int32), old_dir / "token_bytes.pt")
    evals = ["--max-examples=0", "--eval-tokens=512", "--samples=0", "--dtype=fp32"]
    bpb = {}
    for run, tok_dir in (("new", nano["tok_dir"]), ("old", old_dir)):
        code, out, err = run_main(
            import_nanochat, [f"--from={nano['folder']}", f"--tokenizer={tok_dir}", f"--run={run}"], capsys
        )
        assert code == 0, err
        notices = [line for line in out.splitlines() if "computed the old way" in line]
        assert len(notices) == (run == "old")
        if notices:
            assert f"{differ:,} of {enc.n_vocab:,} tokens differ" in notices[0]
        code, out, err = run_main(base_eval, [f"--run={run}", *evals], capsys)
        assert code == 0, err
        bpb[run] = [float(line.rsplit(" ", 1)[1]) for line in out.splitlines() if line.startswith("val bpb")]
    assert len(bpb["new"]) == 1 and len(bpb["old"]) == 2
    assert bpb["old"][0] == bpb["new"][0]  # the true byte lengths
    assert bpb["old"][1] <= bpb["old"][0]  # nanochat's file counts as many or more bytes for the same nats


def test_both_bits_per_byte_figures_from_one_pass():
    """evaluate_bpb_each: one pass, one figure per byte-length table, each summed nats over summed bytes."""
    from contextlib import nullcontext

    from nanochat_fast.evals.task_runner import evaluate_bpb_each

    losses = torch.tensor([[0.5, 1.0, 2.0, 4.0]])
    y = torch.tensor([[3, 200, 5, -1]])  # token 200: one byte >= 0x80, 3 bytes the old way
    true, old = torch.ones(256, dtype=torch.int32), torch.ones(256, dtype=torch.int32)
    old[200], true[5] = 3, 0  # token 5 a special token in both tables
    old[5] = 0

    def model(x, targets, loss_reduction):
        return losses

    got = evaluate_bpb_each(model, [(y, y)], [true, old], nullcontext())
    assert got == pytest.approx([1.5 / (math.log(2) * 2), 1.5 / (math.log(2) * 4)], rel=1e-12)


def test_a_token_bytes_file_wrong_in_another_way_is_refused(home, nano, tmp_path, capsys):
    tb = torch.load(nano["tok_dir"] / "token_bytes.pt", weights_only=True)
    tb[5] += 1
    torch.save(tb, nano["tok_dir"] / "token_bytes.pt")
    code, _, err = run_main(
        import_nanochat, [f"--from={nano['folder']}", f"--tokenizer={nano['tok_dir']}", "--run=x"], capsys
    )
    assert code == 2 and "does not match tokenizer.pkl's tokens" in err
