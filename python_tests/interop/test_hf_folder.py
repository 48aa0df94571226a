"""export_hf and import_hf against transformers itself (offline, nothing from the Hub).

The references are transformers' own code: NanoChatForCausalLM loading our export (the gpt family),
our modeling file loaded with trust_remote_code in a process where nanochat_fast cannot be imported
(the windowed family), the `tokenizers` library and transformers' tiktoken converter for the tokenizer,
and NanoChatForCausalLM(config).save_pretrained() for the import; against them our model's logits,
our chat_cli's greedy tokens and our chat format's tokens."""

import itertools
import json
import os
import shutil
import subprocess
import sys

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported: nothing comes from the Hub
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from support.repo_paths import ROOT  # noqa: E402
from support.tiny_pipeline import TINY_LOOP, TINY_MODEL, home_env  # noqa: E402

from nanochat_fast import checkpoints  # noqa: E402
from nanochat_fast.core import cli, paths  # noqa: E402
from nanochat_fast.data.documents import iter_texts  # noqa: E402
from nanochat_fast.data.tokenizer import Tokenizer, get_tokenizer  # noqa: E402
from nanochat_fast.interop import hf_tokenizer  # noqa: E402
from nanochat_fast.interop.nanochat_tokenizer import SAMPLE_TEXT  # noqa: E402
from nanochat_fast.model import loading  # noqa: E402
from nanochat_fast.model.generation import decode_reply, generate_batch  # noqa: E402
from nanochat_fast.scripts import base_train, chat_cli, export_hf, import_hf, mid_train  # noqa: E402

TRAIN = TINY_MODEL + TINY_LOOP + ["--device-batch-size=4", "--total-batch-size=256", "--eval-every=-1"]
TRAIN += ["--no-compile", "--num-iterations=10"]
CONVERSATION = [  # 3 turns, a system message folded into the first user one
    {"role": "system", "content": "You add numbers."},
    {"role": "user", "content": "what is 3 plus 4?"},
    {"role": "assistant", "content": "3 plus 4 is 7."},
    {"role": "user", "content": "what is 5 plus 6?"},
]
QUESTION = [{"role": "user", "content": "what is 2 plus 9?"}]


def run_main(module, argv, capsys):
    with pytest.raises(SystemExit) as e:
        cli.run(module.main, argv)
    out = capsys.readouterr()
    return e.value.code, out.out, out.err


@pytest.fixture(scope="module")
def exported(tiny_home, tmp_path_factory):
    """tiny_home with a 10-step run of each family (b: gpt, w: windowed with short and long windows),
    each exported by export_hf to <root>/hf_b and <root>/hf_w."""
    root = tmp_path_factory.mktemp("hf")
    home = root / "home"
    shutil.copytree(tiny_home, home)
    with home_env(home):
        assert base_train.main(TRAIN + ["--run=b"]) == 0
        assert base_train.main(TRAIN + ["--run=w", "--arch=windowed", "--window-pattern=SL"]) == 0
        for run in ("b", "w"):
            assert export_hf.main([f"--run={run}", f"--out={root / f'hf_{run}'}"]) == 0
    return root


@pytest.fixture
def hf_home(exported, monkeypatch):
    monkeypatch.setenv("NANOCHAT_FAST_HOME", str(exported / "home"))
    return exported / "home"


def prompts(tok: Tokenizer) -> list[list[int]]:
    """4 prompts: a chat turn, prose, prose over 300 tokens (past the model's 64-token context and the
    windows), every special token and non-Latin text."""
    bos = tok.get_bos_token_id()
    prose = " ".join(itertools.islice(iter_texts("base", "val"), 40))
    long = [bos] + tok.encode(prose)[:330]
    assert len(long) > 300
    sample = tok.enc.encode(SAMPLE_TEXT, allowed_special="all")
    return [tok.render_for_completion({"messages": QUESTION}), [bos] + tok.encode("the red cat"), long, sample]


def ours(run: str, tok: Tokenizer):
    model, _, _ = loading.load_model(checkpoints.run_dir_of(run, ("base",)), None, torch.device("cpu"), tok)
    return model


def assert_close(ours_logits, theirs_logits):
    rel = (ours_logits - theirs_logits).abs().max() / ours_logits.abs().max()
    assert rel < 1e-4, rel


def test_gpt_family_loads_in_transformers_as_nanochat(hf_home, exported, capsys):
    folder, tok = exported / "hf_b", get_tokenizer()
    names = {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"}
    assert names | {"tokenizer_config.json", "chat_template.jinja"} == {p.name for p in folder.iterdir()}
    model = ours("b", tok)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert type(hf).__name__ == "NanoChatForCausalLM"  # transformers' own class, no remote code
    with torch.no_grad():
        for ids in prompts(tok):
            assert_close(model(torch.tensor([ids])), hf(torch.tensor([ids])).logits)
    # greedy: transformers' generate against our chat_cli at temperature 0 (same tokens, same stop)
    prompt = tok.render_for_completion({"messages": QUESTION})
    [sample] = generate_batch(model, tok, prompt, 1, 32, temperature=0.0)
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=32)[0, len(prompt) :].tolist()
    stops = set(hf_tokenizer.special_ids(tok)["stop"])
    assert out == sample.ids + ([out[-1]] if sample.finished else []) and (out[-1] in stops) == sample.finished
    code, text, err = run_main(
        chat_cli, ["--run=b", f"--prompt={QUESTION[0]['content']}", "--temperature=0", "--dtype=fp32"], capsys
    )
    assert code == 0 and text == f"Assistant: {decode_reply(tok, sample.ids)}\n", err
    assert len(sample.ids) == 32 or sample.finished


def test_hf_tokenizer_gives_our_ids_and_our_chat_format(hf_home, exported):
    tok = get_tokenizer()
    hf = transformers.AutoTokenizer.from_pretrained(exported / "hf_b")
    docs = list(itertools.islice(itertools.chain(iter_texts("base", "val"), iter_texts("chat", "val")), 200))
    assert len(docs) >= 40
    assert [hf(d)["input_ids"] for d in docs] == tok.encode(docs)
    rendered = hf.apply_chat_template(CONVERSATION[:3], tokenize=True, return_dict=False)
    assert rendered == tok.render_conversation({"messages": CONVERSATION[:3]})[0]
    prompt = hf.apply_chat_template(CONVERSATION, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert prompt == tok.render_for_completion({"messages": CONVERSATION})
    assert prompt[-1] == tok.encode_special("<|assistant_start|>")  # where our assistant reply begins
    assert hf.decode(prompt, skip_special_tokens=True) == "You add numbers.\n\nwhat is 3 plus 4?3 plus 4 is 7." + (
        "what is 5 plus 6?"
    )


def test_a_larger_vocabulary_converts_to_the_same_ids_as_transformers_own_converter(tmp_path):
    """1024 tokens trained on this repository's docs and code: every merge order case the tiny tokenizer
    lacks; our tokenizer.json equals the one transformers' tiktoken converter writes, and gives our ids."""
    from transformers.convert_slow_tokenizer import TikTokenConverter

    texts = [p.read_text() for p in sorted(ROOT.glob("docs/*.md")) + sorted(ROOT.glob("nanochat_fast/*/*.py"))]
    tok = Tokenizer.train(texts, vocab_size=1024)
    tok.save(tmp_path)
    reference = TikTokenConverter(
        vocab_file=str(tmp_path / "tokenizer.tiktoken"), pattern=tok.pattern, extra_special_tokens=tok.special_tokens
    ).converted()
    ours_json = json.loads(hf_tokenizer.build(tok).to_str())
    assert ours_json["model"]["merges"] == json.loads(reference.to_str())["model"]["merges"]
    # special-token strings in a text are special tokens to transformers' tokenizers (the chat template
    # relies on it) and text to our encode, as to nanochat's: the same ids as ours with them allowed
    texts.append(SAMPLE_TEXT)
    hf_ids = [e.ids for e in hf_tokenizer.build(tok).encode_batch(texts)]
    assert hf_ids == [tok.enc.encode(t, allowed_special="all") for t in texts]
    plain = [i for i, t in enumerate(texts) if not any(name in t for name in tok.special_tokens)]
    assert len(plain) > 50 and [hf_ids[i] for i in plain] == tok.encode([texts[i] for i in plain])
    (tmp_path / "hf").mkdir()
    reference.save(str(tmp_path / "hf" / "tokenizer.json"))
    assert hf_tokenizer.read_tokenizer(tmp_path / "hf", 1024).fingerprint == tok.fingerprint


# the windowed folder in a process that cannot import nanochat_fast: its logits, greedy tokens and chat tokens
ISOLATED = """
import importlib.abc, json, sys, torch
class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "nanochat_fast":
            raise ImportError("nanochat_fast is not importable here")
sys.meta_path.insert(0, Refuse())
try:
    import nanochat_fast
    sys.exit("nanochat_fast was importable")
except ImportError:
    pass
from transformers import AutoModelForCausalLM, AutoTokenizer
folder, spec, out = sys.argv[1:]
spec = json.load(open(spec))
model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32).eval()
tok = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
chat = tok.apply_chat_template(spec["messages"], add_generation_prompt=True, tokenize=True, return_dict=False)
with torch.no_grad():
    logits = [model(torch.tensor([ids])).logits[0] for ids in spec["prompts"]]
generated = model.generate(torch.tensor([chat]), max_new_tokens=32)[0, len(chat):].tolist()
# a left-padded batch computes and generates what each prompt does alone
pair, tok.padding_side = [chat, spec["prompts"][1]], "left"
batch = tok.pad({"input_ids": pair}, return_tensors="pt")
with torch.no_grad():
    both, each = model(**batch).logits, [model(torch.tensor([p])).logits[0] for p in pair]
padded_ok = all(bool((both[i, -len(p):] - e).abs().max() < 1e-4 * e.abs().max()) for i, (p, e) in
                enumerate(zip(pair, each)))
rows = model.generate(**batch, max_new_tokens=8)[:, batch["input_ids"].shape[1]:].tolist()
alone = [model.generate(torch.tensor([p]), max_new_tokens=8)[0, len(p):].tolist() for p in pair]
padded_ok = padded_ok and all(row[: len(a)] == a for row, a in zip(rows, alone))
long = torch.tensor([spec["prompts"][2]])
half = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.bfloat16).eval()
with torch.no_grad():  # loaded in bf16 it runs in bf16, near the fp32 logits
    bf16_ok = bool((half(long).logits - logits[2]).abs().max() < 0.05 * logits[2].abs().max())
result = {"logits": logits, "chat": chat, "generated": generated, "padded_ok": padded_ok, "bf16_ok": bf16_ok}
result["loss"] = model(long, labels=long).loss.item()  # position t predicts token t + 1
torch.save({**result, "class": type(model).__name__}, out)
"""


def test_windowed_family_runs_through_remote_code_without_nanochat_fast(hf_home, exported, tmp_path):
    tok = get_tokenizer()
    folder = tmp_path / "elsewhere" / "w"  # a copy away from the repository, as a user downloads it
    shutil.copytree(exported / "hf_w", folder)
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "nanochat_windowed" and "AutoModelForCausalLM" in config["auto_map"]
    assert config["window_sizes"] == [128, 64]  # the short window (a quarter, rounded up to 128) and the long
    cases = prompts(tok)
    (tmp_path / "spec.json").write_text(json.dumps({"prompts": cases, "messages": QUESTION}))
    (tmp_path / "isolated.py").write_text(ISOLATED)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "NANOCHAT_FAST_HOME")}
    env |= {"HF_HOME": str(tmp_path / "hf_home"), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    cmd = [sys.executable, "-I", str(tmp_path / "isolated.py"), str(folder), str(tmp_path / "spec.json")]
    proc = subprocess.run([*cmd, str(tmp_path / "out.pt")], env=env, cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = torch.load(tmp_path / "out.pt", weights_only=True)
    assert got["class"] == "NanoChatWindowedForCausalLM" and got["padded_ok"] and got["bf16_ok"]
    model = ours("w", tok)
    assert model.smear_lambda.abs().item() > 0 and model.backout_lambda.abs().item() > 0  # every feature counts
    with torch.no_grad():
        for ids, theirs in zip(cases, got["logits"]):
            assert_close(model(torch.tensor([ids]))[0], theirs)
        long = torch.tensor([cases[2]])
        assert model(long[:, :-1], targets=long[:, 1:]).item() == pytest.approx(got["loss"], rel=1e-5)
    assert got["chat"] == cases[0] == tok.render_for_completion({"messages": QUESTION})
    [sample] = generate_batch(model, tok, cases[0], 1, 32, temperature=0.0)
    assert got["generated"] == sample.ids + ([got["generated"][-1]] if sample.finished else [])


@pytest.mark.parametrize("run", ["b", "w"])
def test_export_then_import_gives_identical_tensors(run, exported, tmp_path, monkeypatch, capsys):
    home = tmp_path / "home"
    shutil.copytree(exported / "home", home)
    monkeypatch.setenv("NANOCHAT_FAST_HOME", str(home))
    code, out, err = run_main(import_hf, [f"--from={exported / f'hf_{run}'}", "--run=back"], capsys)
    assert code == 0 and "tokenizer already in" in out, err
    before = checkpoints.load_model_state(checkpoints.complete_checkpoints(home / "runs" / run)[-1])
    after = checkpoints.load_model_state(checkpoints.complete_checkpoints(home / "runs" / "back")[-1])
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    meta = checkpoints.load_meta(checkpoints.complete_checkpoints(home / "runs" / "back")[-1])
    assert meta["phase"] == "base" and meta["step"] == 10 and meta["arch"] == ("gpt" if run == "b" else "windowed")
    if run == "b":  # the imported run trains on like any other
        argv = TINY_LOOP + ["--device-batch-size=4", "--total-batch-size=512", "--eval-every=-1", "--no-compile"]
        code, _, err = run_main(mid_train, argv + ["--base-run=back", "--run=m", "--num-iterations=1"], capsys)
        assert code == 0, err


def transformers_own_folder(folder, tok, eps=torch.finfo(torch.float32).eps):
    """NanoChatForCausalLM(config).save_pretrained() with random weights (GQA: 2 query heads, 1 kv head) in
    shards, and our tokenizer written by transformers' own tiktoken converter, as its nanochat converter does."""
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ids = hf_tokenizer.special_ids(tok)
    config = transformers.NanoChatConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        rms_norm_eps=eps,
        bos_token_id=ids["bos"],
        eos_token_id=ids["eos"],
        pad_token_id=None,
    )
    torch.manual_seed(0)
    model = transformers.NanoChatForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    model.save_pretrained(folder, max_shard_size="100KB")  # shards and their index, as a large model's
    TikTokenConverter(
        vocab_file=str(paths.tokenizer_dir() / "tokenizer.tiktoken"),
        pattern=tok.pattern,
        extra_special_tokens=tok.special_tokens,
    ).converted().save(str(folder / "tokenizer.json"))
    return model


def test_import_of_transformers_own_save_pretrained(exported, tmp_path, monkeypatch, capsys):
    home = tmp_path / "home"
    shutil.copytree(exported / "home", home, ignore=shutil.ignore_patterns("runs"))
    monkeypatch.setenv("NANOCHAT_FAST_HOME", str(home))
    tok = get_tokenizer()
    theirs = transformers_own_folder(tmp_path / "theirs", tok)
    assert (tmp_path / "theirs" / "model.safetensors.index.json").is_file()
    code, out, err = run_main(import_hf, [f"--from={tmp_path / 'theirs'}", "--run=t", "--phase=sft"], capsys)
    assert code == 0 and "chat_cli --run=t" in out, err
    model = ours("t", tok)
    ids = torch.tensor([prompts(tok)[2]])
    with torch.no_grad():
        assert_close(model(ids), theirs(ids).logits)
    code, text, err = run_main(
        chat_cli, ["--run=t", "--prompt=hello", "--max-tokens=4", "--temperature=0", "--dtype=fp32"], capsys
    )
    assert code == 0 and text.startswith("Assistant: "), err


def one_line(module, argv, capsys) -> str:
    code, _, err = run_main(module, argv, capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err


def edit_json(path, **changes):
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def broken_folder(exported, tmp_path, case):
    folder = tmp_path / "bad"
    shutil.copytree(exported / "hf_b", folder)
    if case == "model-type":
        edit_json(folder / "config.json", model_type="llama")
    elif case == "no-weights":
        (folder / "model.safetensors").unlink()
    elif case == "no-tokenizer":
        (folder / "tokenizer.json").unlink()
    elif case == "shapes":
        edit_json(folder / "config.json", num_key_value_heads=1)
    elif case == "specials":
        spec = json.loads((folder / "tokenizer.json").read_text())
        spec["added_tokens"][1]["content"] = "<|im_start|>"
        (folder / "tokenizer.json").write_text(json.dumps(spec))
    elif case == "softcap":
        edit_json(folder / "config.json", final_logit_softcapping=30.0)
    elif case == "eps":
        edit_json(folder / "config.json", rms_norm_eps=1e-6)
    return folder


BAD_IMPORTS = [
    ("model-type", "model_type 'llama' is not a nanochat model"),
    ("no-weights", "neither model.safetensors nor model.safetensors.index.json"),
    ("no-tokenizer", "tokenizer.json is missing"),
    ("shapes", "the config does not describe these weights"),
    ("specials", "but nanochat_fast chats with exactly"),
    ("softcap", "final_logit_softcapping=30.0, but nanochat_fast's model computes final_logit_softcapping=15.0"),
    ("eps", "pass --accept-norm-eps"),
]


@pytest.mark.parametrize("case, expected", BAD_IMPORTS, ids=[c for c, _ in BAD_IMPORTS])
def test_a_bad_folder_is_one_line_exit_2_and_writes_no_run(case, expected, hf_home, exported, tmp_path, capsys):
    folder = broken_folder(exported, tmp_path, case)
    assert expected in one_line(import_hf, [f"--from={folder}", "--run=bad"], capsys)
    assert not [p for p in (hf_home / "runs").iterdir() if "bad" in p.name]  # nothing, not even a partial run


def test_a_norm_eps_import_is_allowed_when_asked(hf_home, exported, tmp_path, capsys, monkeypatch):
    home = tmp_path / "home"
    shutil.copytree(exported / "home", home, ignore=shutil.ignore_patterns("runs"))
    monkeypatch.setenv("NANOCHAT_FAST_HOME", str(home))
    folder = broken_folder(exported, tmp_path, "eps")
    code, _, err = run_main(import_hf, [f"--from={folder}", "--run=e", "--accept-norm-eps"], capsys)
    assert code == 0, err


def test_export_into_a_non_empty_folder_needs_overwrite(hf_home, exported, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert "is not empty; pass --overwrite" in one_line(export_hf, ["--run=b", f"--out={out}"], capsys)
    assert [p.name for p in out.iterdir()] == ["notes.txt"] and not list(tmp_path.glob(".out.partial*"))
    code, _, err = run_main(export_hf, ["--run=b", f"--out={out}", "--overwrite"], capsys)
    assert code == 0 and not (out / "notes.txt").exists() and (out / "model.safetensors").is_file(), err


def test_without_the_hf_extra_the_scripts_say_what_to_install(hf_home, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "safetensors", None)  # as if not installed
    monkeypatch.delitem(sys.modules, "nanochat_fast.interop.hf_folder")
    monkeypatch.delattr(sys.modules["nanochat_fast.interop"], "hf_folder")
    line = one_line(export_hf, ["--run=b", f"--out={tmp_path / 'out'}"], capsys)
    assert "export_hf needs safetensors, which is not installed: pip install 'nanochat_fast[hf]'" in line
    assert not (tmp_path / "out").exists()
