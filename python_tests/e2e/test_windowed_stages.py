"""The windowed family (--arch=windowed) through every stage after base_train: mid_train, chat_sft,
chat_rl, base_eval, chat_eval, chat_cli, infer_bench and chat_web. The context (256) is longer than
the short window (128), so S layers see less than L layers wherever a sequence passes 129 tokens;
the replies are checked against a plain argmax over full forwards with no cache."""

import asyncio
import json
import math
from dataclasses import asdict

import pytest
import torch
from support.eval_home import write_eval_home
from support.recording_chat_eval import recording
from support.tiny_pipeline import FP32, home_env, home_with_base_run, train_rows

from nanochat_fast import checkpoints
from nanochat_fast.data.tokenizer import get_tokenizer
from nanochat_fast.evals import scoring, tasks
from nanochat_fast.model import generation, loading
from nanochat_fast.model.batch_engine import stop_tokens
from nanochat_fast.model.windowed_gpt import WindowedGPTConfig
from nanochat_fast.scripts import base_eval, chat_cli, chat_eval, chat_rl, chat_sft, infer_bench, mid_train

# depth 2 (n_embd 64, 2 heads of 32): layer 0 short (a window of 128 keys), layer 1 long (all 256)
WINDOWED = ["--arch=windowed", "--window-pattern=SL", "--depth=2", "--aspect-ratio=32", "--head-dim=32"]
WINDOWED += ["--max-seq-len=256"]
# the preset's 40 warm-up steps would leave a short run near its initial loss
BASE = WINDOWED + FP32 + ["--device-batch-size=2", "--total-batch-size=512", "--warmup-steps=0"]
BASE += ["--eval-tokens=1024", "--sample-every=-1", "--eval-every=20", "--num-iterations=20", "--run=b"]
MID = ["--base-run=b", "--run=m", "--device-batch-size=2", "--total-batch-size=512", "--num-iterations=4"]
MID += ["--eval-every=-1", "--eval-tokens=1024", *FP32]
SFT = ["--source-run=m", "--run=s", "--device-batch-size=4", "--target-examples-per-step=8", "--num-iterations=4"]
SFT += ["--eval-every=-1", "--eval-tokens=1024", "--chat-eval-examples=0", *FP32]
RL = ["--source-run=s", "--run=r", "--task=last-digit", "--examples-per-step=2", "--num-samples=4"]
RL += ["--max-new-tokens=8", "--num-iterations=2", "--eval-every=-1", "--eval-tokens=1024", *FP32]
STAGES = {"b": "base", "m": "mid", "s": "sft", "r": "rl"}


@pytest.fixture(scope="module")
def home(tiny_home, tmp_path_factory):
    """tiny_home + the evaluation data + the four windowed runs, one per training stage."""
    home = home_with_base_run(tiny_home, tmp_path_factory.mktemp("windowed") / "home", BASE)
    write_eval_home(home)
    with home_env(home):
        assert mid_train.main(MID) == 0
        assert chat_sft.main(SFT) == 0
        assert chat_rl.main(RL) == 0
    return home


@pytest.fixture(scope="module")
def chat_model(home):
    """(model, tokenizer) of the RL run, loaded as the chat commands load it."""
    tokenizer = get_tokenizer(home / "tokenizer")
    model, _, meta = loading.load_model(home / "runs" / "r", None, "cpu", tokenizer)
    assert meta["phase"] == "rl"
    return model, tokenizer


def long_question(model, tokenizer) -> tuple[list[dict], int]:
    """A user message whose prompt runs past the short window (so the reply's S layers see only
    part of it), and the reply's cap, together within the context. Of a few such questions, the
    first the model answers in 3 tokens or more (two decode steps past the window) without a tool
    call: the model is trained here, in this CPU's dtype, so which question gets such a reply
    depends on the machine."""
    for lead in ("", "tell me, ", "quick question: ", "please answer: ", "hello! ", "so, "):
        text = lead + " ".join(f"what is {i} plus {i + 1}?" for i in range(9))
        messages = [{"role": "user", "content": text}]
        ids = tokenizer.render_for_completion({"messages": messages})
        assert 140 < len(ids) < 200, len(ids)
        reply = argmax_tokens(model, ids, 24, stop_tokens(tokenizer))
        if len(reply) >= 3 and tokenizer.encode_special("<|python_start|>") not in reply:
            return messages, 24
    raise AssertionError("no question got a reply of 3 tokens or more without a tool call")


def test_the_long_question_is_past_the_short_window(chat_model):
    """The chat tests' prompt reaches beyond the S layer's window: the same weights with every
    window long give other logits at its end."""
    model, tokenizer = chat_model
    messages, _ = long_question(model, tokenizer)
    ids = torch.tensor([tokenizer.render_for_completion({"messages": messages})])
    config = WindowedGPTConfig(**{**asdict(model.config), "window_pattern": "L"})
    all_long = loading.new_model(config, "cpu", model.state_dict()).eval()
    with torch.no_grad():
        assert (model(ids)[0, -1] - all_long(ids)[0, -1]).abs().max() > 1e-3


def argmax_tokens(model, ids: list[int], max_tokens: int, stop: set[int]) -> list[int]:
    """Greedy tokens after `ids` by full forwards over the whole sequence: no cache, no engine; the
    stop token ends them and is not kept."""
    out = []
    with torch.no_grad():
        for _ in range(max_tokens):
            nxt = int(model(torch.tensor([ids + out]))[0, -1].argmax())
            if nxt in stop:
                break
            out.append(nxt)
    return out


def argmax_reply(model, tokenizer, messages, max_tokens) -> str:
    """The greedy reply (argmax_tokens) to `messages`, its prompt fit as the chat commands fit it."""
    ids, max_tokens, _ = generation.reply_prompt(model, tokenizer, messages, max_tokens)
    out = argmax_tokens(model, ids, max_tokens, stop_tokens(tokenizer))
    # a tool call would make the engine force tokens that this loop does not
    assert tokenizer.encode_special("<|python_start|>") not in out
    assert len(out) >= 3, out  # a reply long enough to compare (long_question)
    return generation.decode_reply(tokenizer, out)


def test_every_stage_trains_and_saves_the_windowed_family(home):
    rows = train_rows(home / "runs" / "b")
    assert len(rows) == 20 and rows[-1]["loss"] < 0.7 * rows[0]["loss"], (rows[0], rows[-1])
    for run, phase in STAGES.items():
        rows = train_rows(home / "runs" / run)
        assert rows and all(math.isfinite(r["loss"]) for r in rows), run
        ckpt = checkpoints.complete_checkpoints(home / "runs" / run)[-1]
        meta = checkpoints.load_meta(ckpt)
        assert (meta["arch"], meta["phase"]) == ("windowed", phase), run
        assert meta["model_config"]["window_pattern"] == "SL" and meta["model_config"]["sequence_len"] == 256
        state = checkpoints.load_model_state(ckpt)
        assert "value_embeds.1.weight" in state and "resid_lambdas" in state, run
    config = loading.config_of(meta, ckpt)
    assert config.window_sizes() == [128, 256]


def test_base_eval_scores_and_completes_as_the_model_does(home, monkeypatch, capsys):
    """base_eval's val bpb of the base run is the training loop's own evaluation at its last step (the
    same rows, another reader of the checkpoint), and its sample the argmax of full forwards."""
    monkeypatch.setenv("NANOCHAT_FAST_HOME", str(home))
    # fp32 as the run was trained (FP32); bf16 decode steps are test_windowed_engine.py's
    argv = ["--run=b", "--eval-tokens=1024", "--device-batch-size=2", "--samples=1", "--max-tokens=8", "--dtype=fp32"]
    assert base_eval.main(argv + ["--max-examples=0"]) == 0
    out = capsys.readouterr().out
    bpb = float(out.split("val bpb")[1].split(":")[1].split()[0])
    rows = [json.loads(line) for line in (home / "runs" / "b" / "metrics.jsonl").read_text().splitlines()]
    last_eval = [r for r in rows if r["kind"] == "eval"][-1]
    assert last_eval["step"] == 20 and bpb == pytest.approx(last_eval["val_bpb"], abs=1e-4)
    tokenizer = get_tokenizer(home / "tokenizer")
    model, _, _ = loading.load_model(home / "runs" / "b", None, "cpu", tokenizer)
    prompt = base_eval.DEFAULT_PROMPTS[0]
    ids = tokenizer.encode(prompt, prepend=tokenizer.get_bos_token_id())
    expected = tokenizer.decode(argmax_tokens(model, ids, 8, {tokenizer.get_bos_token_id()}))
    assert f"  {prompt!r} -> {expected!r}" in out


def test_chat_eval_scores_and_answers_each_example_as_full_forwards(home, chat_model, monkeypatch, capsys):
    """chat_eval on the RL run. ARC-Easy: each example's letter logits (batched, projected at the last
    position only) are those of the example's prompt run alone. GSM8K: each greedy answer (the batch
    engine) is the argmax of full forwards."""
    monkeypatch.setenv("NANOCHAT_FAST_HOME", str(home))
    letters_seen, answers = [], []
    monkeypatch.setattr(scoring, "categorical_counts", recording(scoring.categorical_counts, letters_seen.append))
    monkeypatch.setattr(scoring, "generative_counts", recording(scoring.generative_counts, answers.append))
    argv = ["--run=r", "--task=arc-easy,gsm8k", "--batch-size=4", "--max-new-tokens=16", "--dtype=fp32"]
    assert chat_eval.main(argv) == 0
    out = capsys.readouterr().out
    assert "ARC-Easy: " in out and "GSM8K: " in out
    model, tokenizer = chat_model
    arc = tasks.get("arc-easy")
    examples = {ex["id"]: ex for ex in arc.load("test")}
    assert len(letters_seen) == len(examples) == 6
    for rec in letters_seen:
        ex = examples[rec["id"]]
        ids = tokenizer.render_for_completion(arc.conversation(ex))
        letters = [tokenizer.encode(letter)[0] for letter in arc.letters(ex)]
        with torch.no_grad():
            expected = model(torch.tensor([ids]))[0, -1, letters]
        assert rec["letter_logits"] == pytest.approx(expected.tolist(), abs=2e-4), rec
    gsm8k = tasks.get("gsm8k")
    examples = {ex["id"]: ex for ex in gsm8k.load("test")}
    assert len(answers) == len(examples) == 6
    for rec in answers:
        ids = tokenizer.render_for_completion(gsm8k.conversation(examples[rec["id"]]))
        expected = argmax_tokens(model, ids, 16, stop_tokens(tokenizer))
        assert tokenizer.encode_special("<|python_start|>") not in expected  # no tool forcing tokens
        assert rec["prediction"] == generation.decode_reply(tokenizer, expected), rec


def test_chat_cli_replies_past_the_short_window_as_full_forwards(home, chat_model, monkeypatch, capsys):
    monkeypatch.setenv("NANOCHAT_FAST_HOME", str(home))
    model, tokenizer = chat_model
    messages, max_tokens = long_question(model, tokenizer)
    prompt = messages[0]["content"]
    argv = ["--run=r", f"--prompt={prompt}", f"--max-tokens={max_tokens}", "--temperature=0", "--dtype=fp32"]
    assert chat_cli.main(argv) == 0
    out = capsys.readouterr().out
    assert out == f"Assistant: {argmax_reply(model, tokenizer, messages, max_tokens)}\n"


def test_infer_bench_runs_the_windowed_checkpoint(home, monkeypatch, capsys):
    """infer_bench --run loads the checkpoint's family; prompts of 150 tokens decode past the window."""
    monkeypatch.setenv("NANOCHAT_FAST_HOME", str(home))
    argv = ["--run=r", "--batch-sizes=1,2", "--prompt-tokens=150", "--decode-tokens=6", "--dtype=fp32"]
    assert infer_bench.main(argv) == 0
    out = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert out["model"]["phase"] == "rl" and out["model_config"]["window_pattern"] == "SL"
    assert [row["batch_size"] for row in out["sweep"]] == [1, 2]
    # decode steps 1..5 read 151..155 entries in the L layer (prompt + i), 129 in the S layer (window + 1);
    # products: every weight but the embedding and the value embedding (lookups)
    assert out["mean_keys_read"] == (129 + 153) / 2 and out["mean_context"] == 153
    params = out["params"]
    lookups = 2 * 320 * 64  # wte and the one value embedding (layer 1), vocabulary 320 x 64
    assert out["decode_flops_per_token"] == 2 * (params - lookups) + 4 * 2 * 2 * 32 * 141
    for row in out["sweep"]:
        assert row["tokens_per_row"] == 6 and row["decode_tok_per_s"] > 0
        assert row["kv_read_bytes_per_step"] == row["batch_size"] * out["kv_bytes_per_position"] * 141


@pytest.mark.parametrize("where", ["--replica-process", "--no-replica-process"])
def test_chat_web_streams_the_full_forwards_reply(home, chat_model, monkeypatch, where):
    """chat_web's app over a replica loaded by chat_web itself, in a process of its own (the CPU's
    default) or in this one: one streamed greedy reply to a question past the short window, equal to
    the reply of full forwards."""
    pytest.importorskip("fastapi", reason="chat_web needs the web extra: pip install -e '.[web]'")
    import httpx
    from support.chat_web_support import sse_events

    from nanochat_fast.scripts import chat_web
    from nanochat_fast.web.app import Limits, Settings, create_app
    from nanochat_fast.web.pool import ReplicaPool
    from nanochat_fast.web.replica_process import ProcessEngine

    monkeypatch.setenv("NANOCHAT_FAST_HOME", str(home))
    model, tokenizer = chat_model
    messages, max_tokens = long_question(model, tokenizer)
    args = chat_web.build_parser().parse_args(["--run=r", "--dtype=fp32", "--slots=2", "--max-new-tokens=64", where])
    loaded = chat_web.load_replicas(args, [torch.device("cpu")], tokenizer)
    assert loaded.name.startswith("r step 2 (rl)")
    assert isinstance(loaded.replicas[0].engine, ProcessEngine) == (where == "--replica-process")
    pool = ReplicaPool(loaded.replicas, queue_limit=2)
    settings = Settings(
        model_name=loaded.name, temperature=0.0, top_k=0, request_timeout=60.0, body_timeout=10.0, limits=Limits(64)
    )
    app = create_app(pool, settings)

    async def ask():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as c:
            body = {"messages": messages, "temperature": 0, "max_tokens": max_tokens}
            async with c.stream("POST", "/chat/completions", json=body) as r:
                return r.status_code, [chunk async for chunk in r.aiter_text()]

    try:
        status, chunks = asyncio.run(ask())
    finally:
        pool.close()
        loaded.close()
    assert status == 200
    events = sse_events(chunks)
    assert events[-1] == {"done": True}
    assert "".join(e["token"] for e in events[:-1]) == argmax_reply(model, tokenizer, messages, max_tokens)
