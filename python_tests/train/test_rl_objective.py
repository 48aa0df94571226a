"""chat_rl's pieces against hand-computed values: the advantages, the token-level policy-gradient
loss with tool-forced tokens masked, the samples the batch engine gives (forced tokens marked),
pass@k, the synthetic task and the examples-per-step rule."""

import contextlib
import math
from types import SimpleNamespace

import pytest
import torch
from support.stub_models import ScriptedModel, byte_tokenizer, one_thread  # noqa: F401 (fixture)
from support.tiny_gpt import random_model

from nanochat_fast.core.errors import UserError
from nanochat_fast.evals import scoring, task_runner, tasks
from nanochat_fast.train.rollouts import Rollouts, Sampling, advantages, rollout_batch, sample_rows
from nanochat_fast.train.training_loop import micro_batch_loss, train_step

PAD = 99


def hand_example():
    """Prompt [1, 2]; sample 0 = [5, 6, 7] with 6 forced by the tool, reward 1; sample 1 = [5, 8],
    reward 0. Advantages 1 - 0.5 and 0 - 0.5."""
    prompt = [1, 2]
    samples = [([5, 6, 7], [False, True, False]), ([5, 8], [False, False])]
    return prompt, samples, torch.tensor([1.0, 0.0])


def test_advantage_and_token_level_loss_by_hand():
    prompt, samples, rewards = hand_example()
    adv = advantages(rewards)
    assert adv.tolist() == [0.5, -0.5]
    assert advantages(torch.tensor([[1.0, 1, 0, 0], [0, 0, 0, 0]])).tolist() == [
        [0.5, 0.5, -0.5, -0.5],
        [0, 0, 0, 0],
    ]
    x, y, a = rollout_batch(prompt, samples, adv, PAD, "cpu")
    assert x.tolist() == [[1, 2, 5, 6], [1, 2, 5, 8]]
    # targets: the prompt's, the forced 6 and the padding are -1; the sampled 5, 7 and 5, 8 are kept
    assert y.tolist() == [[-1, 5, -1, 7], [-1, 5, 8, -1]]

    model = random_model(seed=1)
    with torch.no_grad():
        logp = torch.log_softmax(model(x).double(), dim=-1)
    # -sum A * log p over the 4 sampled tokens, divided by 4 (token-level normalisation)
    by_hand = -(0.5 * (logp[0, 1, 5] + logp[0, 3, 7]) - 0.5 * (logp[1, 1, 5] + logp[1, 2, 8])) / 4
    with torch.no_grad():
        ours = micro_batch_loss(model, (x, y, a)) / (y >= 0).sum()
    assert ours.item() == pytest.approx(by_hand.item(), rel=1e-5)


def test_train_step_normalises_by_the_sampled_tokens_of_the_whole_step(monkeypatch):
    """Two questions as two micro-batches: the step's loss and gradient are those of one sum over
    all their sampled tokens divided by the count of all of them (not a mean of per-question means)."""
    prompt, samples, rewards = hand_example()
    first = rollout_batch(prompt, samples, advantages(rewards), PAD, "cpu")
    second = rollout_batch(
        [3],
        [([4, 4, 4, 4], [False] * 4), ([9], [False])],
        advantages(torch.tensor([0.0, 1.0])),
        PAD,
        "cpu",
    )
    model = random_model(seed=2)
    reference = random_model(seed=2)
    total = sum(micro_batch_loss(reference, b) for b in (first, second)) / 9  # 4 + 5 sampled tokens
    total.backward()

    import nanochat_fast.optim as optim

    grads = []  # what the optimizers would step with

    def record(optimizers, clip):
        grads.extend(p.grad.clone() for p in model.parameters())
        return torch.tensor(1.0)

    monkeypatch.setattr(optim, "step", record)
    result = train_step(model, [], [first, second], 0.0, contextlib.nullcontext())
    assert result.n_supervised == 9
    assert result.loss == pytest.approx(total.item(), rel=1e-5)
    for ours, ref in zip(grads, (p.grad for p in reference.parameters())):
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-7)


def test_tool_forced_tokens_are_marked_and_carry_no_loss():
    """Samples drawn by the batch engine: the calculator's output (<|output_start|>5<|output_end|>)
    is forced into each sample and gets target -1; everything the model wrote is a target."""
    tok = byte_tokenizer()
    sp = tok.encode_special
    script = [
        sp("<|python_start|>"),
        ord("2"),
        ord("+"),
        ord("3"),
        sp("<|python_end|>"),
        0,
        0,
        0,
        *map(ord, "#### 5"),
        sp("<|assistant_end|>"),
    ]
    model = ScriptedModel(tok, script)
    prompt = tok.render_for_completion({"messages": [{"role": "user", "content": "2+3?"}]})
    dev = SimpleNamespace(autocast=contextlib.nullcontext, device=torch.device("cpu"))
    [rows] = sample_rows(model, tok, [(prompt, 30)], Sampling(2, 30, 1.0, None, 2), [7], dev)
    forced_output = [sp("<|output_start|>"), ord("5"), sp("<|output_end|>")]
    for ids, forced in rows:
        assert ids == script[:5] + forced_output + script[8:]
        assert forced == [False] * 5 + [True] * 3 + [False] * 7
    x, y, _ = rollout_batch(prompt, rows, torch.zeros(2), sp("<|assistant_end|>"), "cpu")
    n = len(prompt)
    assert y[0, : n - 1].eq(-1).all()
    assert y[0, n - 1 :].tolist() == script[:5] + [-1, -1, -1] + script[8:]


def test_pass_at_k_of_known_outcomes():
    assert [scoring.pass_at_k(4, 1, k) for k in (1, 2, 3, 4)] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert scoring.pass_at_k(5, 2, 2) == pytest.approx(1 - math.comb(3, 2) / math.comb(5, 2))  # 0.7
    assert scoring.pass_at_k(3, 0, 3) == 0.0 and scoring.pass_at_k(3, 3, 1) == 1.0
    with pytest.raises(ValueError):
        scoring.pass_at_k(2, 3, 1)

    # a model that always answers "#### 2": right on the questions whose last digit is 2, so every
    # pass@k is the share of those questions
    tok = byte_tokenizer()
    model = ScriptedModel(tok, [*map(ord, "#### 2"), tok.encode_special("<|assistant_end|>")])
    task = tasks.get("last-digit")
    examples = task.load(max_examples=30)
    share = sum(ex["answer"] == 2 for ex in examples) / len(examples)
    assert 0 < share < 1
    result = task_runner.evaluate_pass_at_k(
        model, tok, task, examples, num_samples=3, max_new_tokens=10, temperature=1.0
    )
    assert result == pytest.approx({"pass@1": share, "pass@2": share, "pass@3": share})


def test_the_synthetic_task():
    task = tasks.get("LAST-DIGIT")
    train, test = task.load("train"), task.load("test")
    assert len(test) == 200 and len(train) == 800
    assert not {ex["question"] for ex in train} & {ex["question"] for ex in test}  # held out
    ex = test[0]
    assert ex["question"].endswith(f"{ex['answer']}. Which comes last?")
    assert task.check(ex, f"it is\n#### {ex['answer']}") and not task.check(ex, f"#### {(ex['answer'] + 1) % 10}")
    assert task.conversation(ex)["messages"][1]["content"] == f"#### {ex['answer']}"


def test_examples_per_step_must_divide_among_the_processes():
    rollouts = Rollouts(tasks.get("last-digit"), 3, Sampling(2, 8, 1.0, None, 4), 10)
    assert rollouts.grad_accum_steps(None, 1) == 3 and rollouts.grad_accum_steps(None, 3) == 1
    with pytest.raises(UserError, match="--examples-per-step 3 is not a multiple of the 2 processes.*2 or 4"):
        rollouts.grad_accum_steps(None, 2)
