"""Scoring: categorical accuracy from the answer letters' logits (a stub that favours one letter
scores 100% or 0%; batching with padding changes nothing), CORE likelihood scoring against a float64
recomputation, generative scoring with a scripted model, centring, the Wilson interval, shards."""

import math

import pytest
import torch
from support.stub_models import FavouriteTokenModel, ScriptedModel, byte_tokenizer, one_thread  # noqa: F401 (an autouse fixture)
from support.tiny_gpt import random_model

from nanochat_fast.evals import scoring, tasks
from nanochat_fast.evals.tasks import MULTIPLE_CHOICE, SCHEMA, CoreTask
from nanochat_fast.model.gpt import GPTConfig

tok = byte_tokenizer()
ARC = tasks.get("ARC-Easy")


def mc_examples(answers, seed=0):
    """Multiple-choice examples of different lengths (so batches need padding)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, answer in enumerate(answers):
        words = int(torch.randint(1, 12, (1,), generator=g))
        out.append(
            {
                "id": str(i),
                "question": "why " * words + f"number {i}?",
                "choices": ["red", "green", "blue", "gold"],
                "answer": answer,
            }
        )
    return out


def tiny_gpt(seed=0, sequence_len=512):
    cfg = GPTConfig(
        sequence_len=sequence_len, vocab_size=tok.get_vocab_size(), n_layer=2, n_head=4, n_kv_head=2, n_embd=32
    )
    return random_model(cfg, seed=seed).eval()


def test_categorical_stub_favouring_a_letter_scores_all_or_nothing():
    model = FavouriteTokenModel(tok.get_vocab_size(), favourite=tok.encode("B")[0])
    right = scoring.categorical_counts(model, tok, ARC, mc_examples([1] * 7), batch_size=3)
    wrong = scoring.categorical_counts(model, tok, ARC, mc_examples([0, 2, 3, 0, 2]), batch_size=3)
    assert (right.correct, right.total, right.accuracy) == (7, 7, 1.0)
    assert (wrong.correct, wrong.total, wrong.accuracy) == (0, 5, 0.0)
    assert {r["prediction"] for r in right.records + wrong.records} == {"B"}


def test_categorical_batches_with_padding_match_one_prompt_at_a_time():
    model = tiny_gpt()
    examples = mc_examples([0, 1, 2, 3, 1, 2, 0, 3, 2], seed=1)
    batched = scoring.categorical_counts(model, tok, ARC, examples, batch_size=4)
    letter_ids = [i for [i] in tok.encode(list("ABCD"))]
    with torch.no_grad():  # reference: each prompt alone, no padding
        expected = []
        for ex in examples:
            ids = tok.render_for_completion(ARC.conversation(ex))
            expected.append(model(torch.tensor([ids]))[0, -1, letter_ids])
    for record, logits in zip(batched.records, expected):
        assert record["letter_logits"] == pytest.approx(logits.tolist(), abs=2e-4)
        assert record["prediction"] == "ABCD"[int(logits.argmax())]
    assert len({tuple(r["letter_logits"]) for r in batched.records}) == len(examples)
    assert batched.correct == sum(r["prediction"] == r["answer"] for r in batched.records)


def reference_choice_losses(model, prompts, scored_chars, max_len):
    """Mean loss of the last scored_chars[i] tokens of each prompt (byte tokens = characters),
    from one unbatched float64 log-softmax per prompt, the prompt cut to its last max_len tokens."""
    out = []
    with torch.no_grad():
        for prompt, n in zip(prompts, scored_chars):
            ids = tok.encode(prompt, prepend="<|bos|>")[-max_len:]
            logp = torch.log_softmax(model(torch.tensor([ids]))[0].double(), -1)
            nll = [-logp[t - 1, ids[t]].item() for t in range(len(ids) - n, len(ids))]
            out.append(sum(nll) / len(nll))
    return out


@pytest.mark.parametrize("task_type,max_len", [(MULTIPLE_CHOICE, 512), (MULTIPLE_CHOICE, 40), (SCHEMA, 512)])
def test_core_scoring_matches_a_float64_recomputation(task_type, max_len):
    model = tiny_gpt(seed=4)
    if task_type == MULTIPLE_CHOICE:
        items = [
            {"query": f"Question: what is item {i}?", "choices": ["apple", "kiwi", "banana"], "gold": i % 3}
            for i in range(7)
        ]
        task = CoreTask("test_mc", "unused", "validation", 2, "\nAnswer: ", MULTIPLE_CHOICE, 1 / 3, None)
    else:
        items = [
            {
                "context_options": [f"Tom told Ann {i} so Tom", f"Tom told Ann {i} so Ann"],
                "continuation": "went home.",
                "gold": i % 2,
            }
            for i in range(6)
        ]
        task = CoreTask("test_schema", "unused", "validation", 1, " ", SCHEMA, 0.5, None)
    counts = scoring.core_counts(model, tok, task, items, batch_size=5, max_seq_len=max_len)
    assert counts.total == len(items)
    for index, record in enumerate(counts.records):
        item = items[index]
        prompts = task.prompts(item, task.fewshot(items, index))
        if task_type == MULTIPLE_CHOICE:  # the scored tokens: the choice (the prompts share all before it)
            scored = [len(c) for c in item["choices"]]
        else:  # the shared continuation (the options end in different letters)
            scored = [len(" " + item["continuation"])] * 2
        losses = reference_choice_losses(model, prompts, scored, max_len)
        assert record["losses"] == pytest.approx(losses, abs=2e-4)
        assert record["prediction"] == min(range(len(losses)), key=losses.__getitem__)
        assert record["correct"] == (record["prediction"] == item["gold"])
    # shards add up to the whole
    halves = [
        scoring.core_counts(model, tok, task, items, indices=scoring.shard(len(items), r, 2), max_seq_len=max_len)
        for r in range(2)
    ]
    assert halves[0].correct + halves[1].correct == counts.correct
    assert halves[0].total + halves[1].total == counts.total


def test_generative_scoring_with_a_scripted_model():
    gsm8k = tasks.get("GSM8K")
    model = ScriptedModel(tok, tok.encode("So it is 42.\n#### 42") + [tok.encode_special("<|assistant_end|>")])
    examples = [
        {"id": "a", "question": "6 x 7?", "answer": "6*7 = <<6*7=42>>42\n#### 42"},
        {"id": "b", "question": "6 x 7 - 1?", "answer": "#### 41"},
    ]
    counts = scoring.generative_counts(model, tok, gsm8k, examples, num_samples=2, max_new_tokens=40)
    assert (counts.correct, counts.total) == (1, 2)
    assert [r["correct"] for r in counts.records] == [True, False]
    assert counts.records[0]["prediction"] == "So it is 42.\n#### 42" and counts.records[0]["samples_right"] == 2


def test_centring_and_core_summary():
    assert scoring.centered(0.25, 0.25) == 0.0
    assert scoring.centered(1.0, 0.25) == 1.0
    assert scoring.centered(0.625, 0.25) == pytest.approx(0.5)
    assert scoring.centered(0.5, 0.62) == pytest.approx(-0.12 / 0.38)
    summary = scoring.core_summary(
        {"copa": 0.75, "hellaswag": 0.25, "boolq": 0.81}, {"copa": 0.5, "hellaswag": 0.25, "boolq": 0.62}
    )
    assert summary["centered"] == pytest.approx({"copa": 0.5, "hellaswag": 0.0, "boolq": 0.5})
    assert summary["core_subset"] == pytest.approx(1 / 3)
    assert summary["name"] == "CORE subset (3/22 tasks)"


def test_wilson_interval_against_hand_computation():
    # 8 right of 10, z = 1.96: centre (0.8 + 1.96^2/20) / (1 + 1.96^2/10) = 0.71672,
    # half-width 1.96 * sqrt(0.8*0.2/10 + 1.96^2/400) / (1 + 1.96^2/10) = 0.22658
    lo, hi = scoring.wilson_interval(8, 10)
    assert (lo, hi) == pytest.approx((0.49016, 0.94330), abs=5e-5)
    # at the edges it stays in [0, 1] and is not empty: 0/10 -> [0, z^2/(n+z^2)]
    assert scoring.wilson_interval(0, 10) == pytest.approx((0.0, 3.8415 / 13.8415), abs=5e-5)
    assert scoring.wilson_interval(10, 10) == pytest.approx((10 / 13.8415, 1.0), abs=5e-5)
    assert all(math.isnan(x) for x in scoring.wilson_interval(0, 0))


def test_counts_add_up():
    a, b = scoring.Counts(), scoring.Counts()
    a.add(True, id="1")
    b.add(False, id="2")
    total = a + b
    assert (total.correct, total.total, [r["id"] for r in total.records]) == (1, 2, ["1", "2"])
    assert list(scoring.shard(7, 1, 3)) == [1, 4]


def test_prompts_longer_than_the_context_are_cut_to_their_end_and_counted():
    """A model of 48 positions (rotary table 480): categorical prompts of up to ~700 tokens, a
    generative one and CORE rows far past it. Nothing fails; each path counts the prompts it cut,
    and a cut categorical prompt scores exactly as its last 47 tokens after <|bos|> do alone."""
    model = tiny_gpt(seed=5, sequence_len=48)
    examples = mc_examples([0, 1, 2, 3])
    examples[1]["question"] = "why " * 170 + "number 1?"  # ~700 tokens: past the rotary table too
    counts = scoring.categorical_counts(model, tok, ARC, examples, batch_size=2)
    prompts = [tok.render_for_completion(ARC.conversation(ex)) for ex in examples]
    assert len(prompts[1]) > 10 * 48
    assert counts.truncated == sum(len(p) > 48 for p in prompts) > 0 and counts.total == 4
    letter_ids = [i for [i] in tok.encode(list("ABCD"))]
    with torch.no_grad():
        alone = model(torch.tensor([[tok.get_bos_token_id()] + prompts[1][-47:]]))[0, -1, letter_ids]
    assert counts.records[1]["letter_logits"] == pytest.approx(alone.tolist(), abs=2e-4)

    gsm8k = tasks.get("GSM8K")
    scripted = ScriptedModel(tok, tok.encode("#### 4") + [tok.encode_special("<|assistant_end|>")])
    scripted.config.sequence_len = 48
    long_question = [
        {"id": "a", "question": "2 + 2? " * 100, "answer": "#### 4"},
        {"id": "b", "question": "2+2", "answer": "#### 4"},
    ]
    generated = scoring.generative_counts(scripted, tok, gsm8k, long_question, max_new_tokens=8)
    assert (generated.correct, generated.truncated) == (2, 1)

    task = CoreTask("test_mc", "unused", "validation", 2, "\nAnswer: ", MULTIPLE_CHOICE, 1 / 3, None)
    items = [
        {"query": "Question: what is item 0? " * (40 if i == 2 else 1), "choices": ["apple", "kiwi"], "gold": 0}
        for i in range(4)
    ]
    core = scoring.core_counts(model, tok, task, items, batch_size=4)
    assert core.total == 4 and core.truncated == 4  # two few-shot examples put every item past 48 tokens
