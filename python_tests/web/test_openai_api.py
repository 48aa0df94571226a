"""chat_web's OpenAI API through the official `openai` client, against a real chat_web process serving
the tiny chat model: chat replies streamed and not, word for word our own endpoint's at temperature 0,
with usage and finish reasons; models.list(); completion logprobs with echo equal to the model's own
log-softmax, computed here in fp32; refusals as openai.BadRequestError carrying our one line; 8
concurrent streaming clients each getting their whole reply; and lm-eval's local-completions over it,
whose per-item choices and accuracy equal our own scoring of the same 20 items."""

import asyncio
import json

import pytest
import torch

pytest.importorskip("fastapi", reason="chat_web needs the web extra: pip install -e '.[web]'")
openai = pytest.importorskip("openai", reason="the OpenAI API tests need the test extra: pip install -e '.[test]'")
import httpx  # noqa: E402
from support.chat_web_support import chat_home, chat_web_process, load_chat_model, sse_events  # noqa: E402
from support.repo_paths import ROOT  # noqa: E402

from nanochat_fast.model import generation  # noqa: E402

MAX_TOKENS = 64
QUESTION = [{"role": "user", "content": "what is 2 plus 3?"}]
LM_EVAL_TASKS = ROOT / "docs" / "lm_eval"


@pytest.fixture(scope="module")
def web_home(tiny_home):
    return chat_home(tiny_home)


@pytest.fixture(scope="module")
def model_and_tokenizer(web_home):
    return load_chat_model(web_home)


@pytest.fixture(scope="module")
def server(web_home):
    args = ["--run=chat", "--dtype=fp32", "--temperature=0", "--top-k=0", f"--max-new-tokens={MAX_TOKENS}"]
    with chat_web_process(web_home, args + ["--queue-size=16"]) as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def greedy_reply(model_and_tokenizer, messages) -> tuple[str, int, int, bool]:
    """(text, prompt tokens, reply tokens with its end token, ended by it) of the greedy reply, by the model."""
    model, tokenizer = model_and_tokenizer
    prompt = tokenizer.render_for_completion({"messages": messages})
    [sample] = generation.generate_batch(model, tokenizer, prompt, 1, MAX_TOKENS, temperature=0.0)
    return sample.text, len(prompt), len(sample.ids) + sample.finished, sample.finished


def own_endpoint(server, messages) -> str:
    with httpx.stream("POST", server.url + "/chat/completions", json={"messages": messages}, timeout=60) as r:
        events = sse_events(list(r.iter_text()))
    assert events[-1] == {"done": True}
    return "".join(e["token"] for e in events[:-1])


def test_chat_completion_is_our_endpoints_reply(server, client, model_and_tokenizer):
    text, prompt_tokens, reply_tokens, finished = greedy_reply(model_and_tokenizer, QUESTION)
    assert len(text) >= 4 and own_endpoint(server, QUESTION) == text
    r = client.chat.completions.create(model="chat", messages=QUESTION, temperature=0, seed=3, user="u1")
    assert r.object == "chat.completion" and r.model == "chat" and len(r.choices) == 1
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == text
    assert r.choices[0].finish_reason == ("stop" if finished else "length")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (prompt_tokens, reply_tokens)
    assert r.usage.total_tokens == prompt_tokens + reply_tokens


def test_streamed_chat_completion_with_usage(client, model_and_tokenizer):
    system = [{"role": "system", "content": "be brief"}]
    folded = [{"role": "user", "content": "be brief\n\n" + QUESTION[0]["content"]}]  # nanochat's SFT folding
    text, prompt_tokens, reply_tokens, _ = greedy_reply(model_and_tokenizer, folded)
    stream = client.chat.completions.create(
        model="chat", messages=system + QUESTION, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert all(c.object == "chat.completion.chunk" for c in chunks) and len(chunks) >= 4
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == reply_tokens
    assert chunks[-1].usage.prompt_tokens == prompt_tokens and all(c.usage is None for c in chunks[:-1])


def test_a_stop_string_ends_the_reply_before_it(client, model_and_tokenizer):
    text = greedy_reply(model_and_tokenizer, QUESTION)[0]
    stop = text[2:5]
    r = client.chat.completions.create(model="chat", messages=QUESTION, temperature=0, stop=[stop, "never seen"])
    assert r.choices[0].message.content == text[: text.index(stop)] and r.choices[0].finish_reason == "stop"
    pieces = client.chat.completions.create(model="chat", messages=QUESTION, temperature=0, stop=stop, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in pieces if c.choices) == text[: text.index(stop)]
    short = client.chat.completions.create(model="chat", messages=QUESTION, temperature=0, max_completion_tokens=2)
    assert short.choices[0].finish_reason == "length" and short.usage.completion_tokens == 2


def test_models_list(client):
    assert [m.id for m in client.models.list()] == ["chat"]


def test_completion_logprobs_with_echo_are_the_models_log_softmax(client, model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    prompt = "what is 7 plus"
    r = client.completions.create(model="chat", prompt=prompt, max_tokens=3, temperature=0, logprobs=2, echo=True)
    [choice] = r.choices
    ids = [tokenizer.get_bos_token_id()] + tokenizer.encode(prompt)
    generated = r.usage.completion_tokens
    assert r.usage.prompt_tokens == len(ids) and 1 <= generated <= 3
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) + generated and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.tokens[: len(ids)] == ["<|bos|>"] + [tokenizer.decode([t]) for t in ids[1:]]
    assert choice.text.startswith(prompt) and lp.text_offset[: len(ids)] == [0, 0] + [
        len(tokenizer.decode(ids[1:k])) for k in range(2, len(ids))
    ]
    every, stops = list(ids), {tokenizer.get_bos_token_id(), tokenizer.encode_special("<|assistant_end|>")}
    with torch.no_grad():
        while len(every) < len(ids) + 3 and (len(every) == len(ids) or every[-1] not in stops):  # greedy
            every.append(model(torch.tensor([every]))[0, -1].argmax().item())
        reference = torch.log_softmax(model(torch.tensor([every])).float()[0, :-1], dim=-1)  # fp32, here
    assert generated == len(every) - len(ids) and lp.tokens[len(ids) :] == [
        tokenizer.token_piece(t).decode() for t in every[len(ids) :]
    ]
    want = reference.gather(1, torch.tensor(every[1:])[:, None])[:, 0]
    assert torch.allclose(torch.tensor(lp.token_logprobs[1:]), want, rtol=0, atol=1e-4)
    for position, top in enumerate(lp.top_logprobs[1:]):
        best, best_ids = reference[position].topk(2)
        assert list(top) == [tokenizer.decode([t]) for t in best_ids.tolist()]
        assert torch.allclose(torch.tensor(list(top.values())), best, rtol=0, atol=1e-4)
    # without echo only the generated tokens are listed
    plain = client.completions.create(model="chat", prompt=prompt, max_tokens=3, temperature=0, logprobs=1)
    assert plain.choices[0].logprobs.token_logprobs == lp.token_logprobs[len(ids) :]
    assert choice.text == prompt + plain.choices[0].text and plain.choices[0].logprobs.text_offset[0] == 0


@pytest.mark.parametrize(
    "kwargs, message, param",
    [
        ({"n": 2}, "n: 2 is not supported by this server (only 1)", "n"),
        ({"logit_bias": {"5": 10}}, 'logit_bias: {"5": 10} is not supported', "logit_bias"),
        ({"response_format": {"type": "json_object"}}, "response_format: {", "response_format"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools: [{", "tools"),
        ({"logprobs": True}, "logprobs: true is not supported", "logprobs"),
        ({"temperature": 3}, "temperature: Input should be less than or equal to 2", "temperature"),
        ({"extra_body": {"mirostat": 1}}, "mirostat: Extra inputs are not permitted", "mirostat"),
        ({"max_tokens": 10_000}, "max_tokens: at most 64 on this server (its --max-new-tokens), got 10000", None),
    ],
)
def test_refusals_are_400s_naming_the_parameter(client, kwargs, message, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="chat", messages=QUESTION, **kwargs)
    error = e.value.body
    assert message in error["message"] and "\n" not in error["message"] and error["param"] == param
    assert error["type"] == "invalid_request_error" and e.value.status_code == 400


def test_malformed_bodies_and_other_models_in_openais_shape(server, client):
    for body, message in [(b"{", "the body is not valid JSON"), (b"[]", "the body must be a JSON object")]:
        r = httpx.post(server.url + "/v1/chat/completions", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400 and message in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": QUESTION})
    assert r.status_code == 400 and r.json()["error"] == {
        "message": "model: Field required",
        "type": "invalid_request_error",
        "param": "model",
        "code": None,
    }
    with pytest.raises(openai.NotFoundError, match="this server serves 'chat'"):
        client.chat.completions.create(model="gpt-4o", messages=QUESTION)
    assert httpx.get(server.url + "/v1/nothing").json()["error"]["message"] == "not found"
    # a completion's body may hold 16 prompts of the whole context (160 KiB + 16 x 256 tokens x 16 bytes)
    r = httpx.post(server.url + "/v1/completions", json={"model": "chat", "prompt": "x" * 230_000})
    assert r.status_code == 413 and r.json()["error"]["message"] == "request body larger than 229376 bytes"
    with pytest.raises(openai.BadRequestError, match="exceed the model's context of 256 tokens"):
        client.completions.create(model="chat", prompt=[1] * 250, max_tokens=10)
    with pytest.raises(openai.BadRequestError, match="stop: not supported together with logprobs"):
        client.completions.create(model="chat", prompt="a", stop="b", logprobs=1)


def test_eight_streaming_clients_lose_nothing(server, model_and_tokenizer):
    questions = [[{"role": "user", "content": f"what is {a} plus {a + 3}?"}] for a in range(8)]
    references = [greedy_reply(model_and_tokenizer, q)[0] for q in questions]
    aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)

    async def one(messages):
        stream = await aclient.chat.completions.create(model="chat", messages=messages, temperature=0, stream=True)
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    async def all_at_once():
        return await asyncio.gather(*(one(q) for q in questions))

    assert asyncio.run(all_at_once()) == references
    stats = httpx.get(server.url + "/stats").json()
    assert stats["slots"]["in_use"] == 0 and stats["requests"]["failed"] == 0


def own_choices(model, tokenizer, items) -> list[tuple[int, list[float]]]:
    """Per item, the choice whose continuation the model finds likeliest after the question, as lm-eval
    defines it (no <|bos|>; the continuation's tokens are those the whole text adds to the question's),
    every choice of every item in one right-padded forward (causal: the padding changes nothing before it)."""
    pairs = []
    for item in items:
        context = f"Question: {item['question']}\nAnswer:"
        pairs += [(len(tokenizer.encode(context)), tokenizer.encode(context + " " + c)) for c in item["choices"]]
    width = max(len(whole) for _, whole in pairs)
    with torch.no_grad():
        logits = model(torch.tensor([whole + [0] * (width - len(whole)) for _, whole in pairs]))
    logprobs = torch.log_softmax(logits.double(), dim=-1)
    scores = [
        sum(logprobs[r, k - 1, whole[k]].item() for k in range(n, len(whole))) for r, (n, whole) in enumerate(pairs)
    ]
    out = []
    for item in items:
        mine, scores = scores[: len(item["choices"])], scores[len(item["choices"]) :]
        out.append((max(range(len(mine)), key=mine.__getitem__), mine))
    return out


def test_lm_eval_over_the_server_agrees_with_our_own_scoring(server, model_and_tokenizer, tmp_path, monkeypatch):
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    monkeypatch.chdir(ROOT)  # the task's data_files path is the repository's
    items = [json.loads(line) for line in (LM_EVAL_TASKS / "arithmetic_choice.jsonl").read_text().splitlines()]
    assert len(items) == 20
    model_args = f"base_url={server.url}/v1/completions,model=chat,tokenizer_backend=remote,max_retries=1,batch_size=16"
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=model_args,
        tasks=["nanochat_arithmetic_choice"],
        task_manager=TaskManager(include_path=str(LM_EVAL_TASKS), include_defaults=False),  # ours alone: quick
        log_samples=True,
    )
    samples = sorted(results["samples"]["nanochat_arithmetic_choice"], key=lambda s: s["doc_id"])
    ours = own_choices(*model_and_tokenizer, items)
    for sample, (choice, scores) in zip(samples, ours, strict=True):
        theirs = [loglikelihood for loglikelihood, _ in sample["filtered_resps"]]
        assert max(range(len(theirs)), key=theirs.__getitem__) == choice, (sample["doc_id"], theirs, scores)
        assert theirs == pytest.approx(scores, abs=1e-4)
    accuracy = sum(choice == item["answer"] for (choice, _), item in zip(ours, items)) / len(items)
    assert results["results"]["nanochat_arithmetic_choice"]["acc,none"] == pytest.approx(accuracy)
