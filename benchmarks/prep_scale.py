"""
Preparation of a published-set-sized input, measured (`make bench-prepare`; not part of `make bench`):

1. >= --gb GB of text as parquet shards, generated from the built-in corpus (Shakespeare, the World
   English Bible) repeated with variation, registered as a downloaded set (data/gen/, used in place);
2. a tokenizer trained on a few MB of it;
3. per shard, interleaved in a rotating order: our streamed tokenization (threads, and a process pool
   for the threads-vs-processes choice), tiktoken's encode_ordinary_batch on the same text at the same
   thread count (the ceiling), and nanochat's on-the-fly tokenization (a row group at a time, 128
   documents per encode call, 4 threads);
4. the whole preparation (prepare_data --stage=tokens) in a child process: time and peak RSS against
   --max-memory-mb; then the same killed at ~50% of its shards and resumed: the resume's time and
   whether its token shards are byte-identical to the uninterrupted run's.

Writes --out (JSON) and prints the RESULTS.md section. Everything under build/prep-scale/.
"""

import argparse
import json
import os
import random
import resource
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from results_sections import put_section

from nanochat_fast.hardware import cpu_model

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / "build" / "prep-scale"
NAME = "gen"


def corpus_docs():
    from nanochat_fast.core import paths
    from nanochat_fast.data import corpus_sources

    docs = []
    for source in corpus_sources.PIP_SOURCES:
        if source.dataset == "base":
            archive = corpus_sources.download(source, paths.home() / "downloads")
            docs += list(source.read(archive, 4000))
    return docs


def varied(docs, rng):
    """One more copy of the corpus: shuffled, each document's paragraphs rotated and a few words
    swapped for numbers, so no two copies hold the same text."""
    out = []
    for doc in rng.sample(docs, len(docs)):
        paras = doc.split("\n\n")
        k = rng.randrange(len(paras))
        words = "\n\n".join(paras[k:] + paras[:k]).split(" ")
        for _ in range(max(1, len(words) // 50)):
            words[rng.randrange(len(words))] = str(rng.randrange(10**6))
        out.append(" ".join(words))
    return out


def generate(gb: float, shard_chars: int):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from nanochat_fast.core import paths
    from nanochat_fast.data import documents

    root = paths.data_dir(NAME)
    if (root / "manifest.json").is_file() and json.loads((root / "manifest.json").read_text())["config"].get(
        "gb"
    ) == gb:
        return documents.read_dataset_manifest(NAME)
    shutil.rmtree(root, ignore_errors=True)
    docs, rng = corpus_docs(), random.Random(0)
    names, total, batch, chars = {"train": [], "val": []}, 0, [], 0

    def write(split, texts):
        name = f"shard_{len(names[split]):05d}.parquet"
        (root / split).mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table({"text": pa.array(texts, pa.string())}), root / split / name, row_group_size=1024)
        names[split].append(name)

    write("val", varied(docs, random.Random(-1))[:2000])
    while total < gb * 1e9:
        for text in varied(docs, rng):
            batch.append(text)
            chars += len(text)
            total += len(text.encode())
            if chars >= shard_chars:
                write("train", batch)
                batch, chars = [], 0
    if batch:
        write("train", batch)
    config = {"download": "generated", "gb": gb, "text_bytes": total}
    return documents.register_shards(NAME, names, config=config, sources=[])


def train_tokenizer(vocab_size: int):
    from nanochat_fast.core import paths
    from nanochat_fast.data import documents
    from nanochat_fast.data.tokenizer import Tokenizer, save_token_bytes

    texts, chars = [], 0
    for text in documents.iter_texts(NAME, "val"):
        texts.append(text)
        chars += len(text)
        if chars > 5_000_000:
            break
    tok = Tokenizer.train(texts, vocab_size)
    save_token_bytes(tok, tok.save(paths.tokenizer_dir()))
    return tok


# ---------------------------------------------------------------------------------------------
# one shard, four ways


def _thread_encode(enc, texts):
    return [enc.encode_to_numpy(t, allowed_special=set(), disallowed_special=()) for t in texts]


def per_shard(tok, source: Path, threads: int, batch_chars: int, pool, thread_pool) -> dict:
    """Seconds and tokens of each way of tokenizing `source`, in a rotating order."""
    import numpy as np
    import pyarrow.parquet as pq

    from nanochat_fast.data import token_shards

    def ours():  # what prepare_data runs: batches read here, encoded by the worker processes, written
        out = token_shards.tokenize_text_shard(
            source, tok, WORK / "scratch", "s", np.uint16, pool, threads, batch_chars
        )
        return out["n_tokens"]

    def threads_way():  # the alternative: the same batches encoded by threads (the GIL released in tiktoken)
        n = 0
        for texts in token_shards.text_batches(source, batch_chars):
            step = max(1, -(-len(texts) // (4 * threads)))
            parts = thread_pool.map(lambda i: _thread_encode(tok.enc, texts[i : i + step]), range(0, len(texts), step))
            n += sum(len(a) + 1 for part in parts for a in part)
        return n

    def ceiling():  # tiktoken's batch encoder alone: the text already in memory, only the encode timed
        n, spent = 0, 0.0
        for texts in token_shards.text_batches(source, batch_chars):
            t0 = time.perf_counter()
            n += sum(len(ids) + 1 for ids in tok.enc.encode_ordinary_batch(texts, num_threads=threads))
            spent += time.perf_counter() - t0
        return n, spent

    def nanochat():  # its loader: a row group read, then encode(128 documents, prepend=bos, 4 threads)
        n, pf = 0, pq.ParquetFile(source)
        for rg in range(pf.num_row_groups):
            texts = pf.read_row_group(rg).column("text").to_pylist()
            for i in range(0, len(texts), 128):
                n += sum(map(len, tok.encode(texts[i : i + 128], prepend=tok.bos_token_id, num_threads=4)))
        return n

    ways = {
        "ours (worker processes)": ours,
        "threads instead": threads_way,
        "tiktoken batch": ceiling,
        "nanochat": nanochat,
    }
    order = list(ways)
    shift = per_shard.calls = getattr(per_shard, "calls", -1) + 1
    result = {}
    for name in order[shift % len(order) :] + order[: shift % len(order)]:
        t0 = time.perf_counter()
        got = ways[name]()
        seconds = time.perf_counter() - t0
        if isinstance(got, tuple):
            got, seconds = got
        result[name] = {"tokens": got, "seconds": seconds}
    return result


# ---------------------------------------------------------------------------------------------
# the whole preparation, in a child process: time, peak RSS, a kill at 50% and the resume


# The child reports its own peak RSS (VmHWM): a child's ru_maxrss from wait4 keeps the parent's
# high-water mark across fork and exec, so it cannot show a child smaller than its parent.
CHILD = """
import sys
from nanochat_fast.scripts import prepare_data
code = prepare_data.main(sys.argv[2:])
hwm = [line for line in open("/proc/self/status") if line.startswith("VmHWM")][0].split()[1]
open(sys.argv[1], "w").write(hwm)
sys.exit(code)
"""


def prepare_cmd(threads, memory_mb):
    return [sys.executable, "-c", CHILD, str(WORK / "child_hwm_kb"), "--download=climbmix", f"--name={NAME}"] + [
        "--stage=tokens",
        f"--num-threads={threads}",
        f"--max-memory-mb={memory_mb}",
    ]


def tree_rss_mb(root: int) -> float:
    """Resident memory of `root` and all its descendants (the workers) now, from /proc."""
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        try:
            total += int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
            for task in Path(f"/proc/{pid}/task").iterdir():
                todo += [int(k) for k in (task / "children").read_text().split()]
        except (OSError, ValueError, IndexError):
            continue
    return total / 2**20


def run_child(cmd, kill_after_shards=None, n_shards=None):
    """(seconds, peak RSS MB, killed) of `cmd`; SIGKILL once kill_after_shards token shards are complete."""
    from nanochat_fast.core import paths

    done_dir = paths.tokens_dir(NAME) / "train"
    t0 = time.perf_counter()
    (WORK / "child_hwm_kb").unlink(missing_ok=True)
    log = open(WORK / "child.log", "a")
    child = subprocess.Popen(cmd, stdout=log, stderr=log)
    killed = False
    tree_peak = 0.0  # the process and its workers, summed, sampled (each one's own peak would not add up)
    while child.poll() is None:
        tree_peak = max(tree_peak, tree_rss_mb(child.pid))
        if not killed and kill_after_shards is not None and len(list(done_dir.glob("*.json"))) >= kill_after_shards:
            os.kill(child.pid, signal.SIGKILL)
            killed = True
        time.sleep(0.05)
    seconds = time.perf_counter() - t0
    log.close()
    hwm = WORK / "child_hwm_kb"
    return seconds, max(tree_peak, int(hwm.read_text()) / 1024 if hwm.is_file() else 0), killed


def whole_run(threads, memory_mb, n_shards):
    from nanochat_fast.core import paths

    tokens = paths.tokens_dir(NAME)
    shutil.rmtree(tokens, ignore_errors=True)
    full_s, peak_mb, _ = run_child(prepare_cmd(threads, memory_mb))
    reference = {p.relative_to(tokens): p.read_bytes() for p in tokens.rglob("*.npy")}
    shutil.rmtree(tokens)
    killed_s, _, killed = run_child(prepare_cmd(threads, memory_mb), kill_after_shards=n_shards // 2)
    resume_s, resume_peak, _ = run_child(prepare_cmd(threads, memory_mb))
    same = {p.relative_to(tokens): p.read_bytes() for p in tokens.rglob("*.npy")} == reference
    n_tokens = sum(json.loads(p.read_text())["n_tokens"] for p in tokens.rglob("shard_*.json"))
    low_memory = memory_mb // 2  # the same input within half the memory: the peak follows the setting
    shutil.rmtree(tokens)
    low_s, low_peak, _ = run_child(prepare_cmd(threads, low_memory))
    same_low = {p.relative_to(tokens): p.read_bytes() for p in tokens.rglob("*.npy")} == reference
    return {
        "seconds": full_s,
        "peak_rss_mb": peak_mb,
        "killed": killed,
        "killed_after_s": killed_s,
        "resume_seconds": resume_s,
        "resume_peak_rss_mb": resume_peak,
        "identical_after_resume": same,
        "tokens": n_tokens,
        "low_memory_mb": low_memory,
        "low_memory_seconds": low_s,
        "low_memory_peak_rss_mb": low_peak,
        "identical_at_low_memory": same_low,
    }


HEADING = "## Preparation at scale"


def section(r: dict) -> list[str]:
    """RESULTS.md's section from prep_scale.json."""
    base = r["compare"]["tiktoken batch"]
    rate = {k: v["tokens"] / v["seconds"] for k, v in r["compare"].items()}
    w = r["whole"]
    whole_rate = w["tokens"] / w["seconds"]
    lines = [
        HEADING,
        "",
        f"{r['gb_text']:.2f} GB of generated text, {r['shards']} shards, {r['threads']} threads, on "
        f"{r.get('cpu', 'an unrecorded CPU')}.",
        "",
        "`make bench-prepare` (benchmarks/prep_scale.py). Text generated from the built-in corpus, repeated with "
        "variation; a tokenizer of 8,192 tokens trained on it. The four ways run per shard in a rotating order on "
        f"the same text at the same thread count (ours and the threads alternative include reading the parquet; ours "
        "writes the token shard too; the ceiling times tiktoken's encoder alone, text already in memory; nanochat's "
        "loader: a row group read, then encode() on 128 documents with 4 threads). Shared machine: "
        f"load average {r['load_average'][0]:.1f} on {r['threads']} cores at the end, so absolute rates are low and "
        "noisy; the ratios are what was compared in the same rounds.",
        "",
        "| way | tokens | seconds | tokens/s | per core | vs tiktoken batch |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, v in r["compare"].items():
        lines.append(
            f"| {name} | {v['tokens']:,} | {v['seconds']:.1f} | {rate[name]:,.0f} | {rate[name] / r['threads']:,.0f} "
            f"| {v['seconds'] and base['seconds'] / v['seconds']:.2f}x |"
        )
    lines += [
        f"| whole preparation (prepare_data --stage=tokens, a process of its own) | {w['tokens']:,} | "
        f"{w['seconds']:.1f} | {whole_rate:,.0f} | {whole_rate / r['threads']:,.0f} | "
        f"{whole_rate / rate['tiktoken batch']:.2f}x |",
        "",
        f"- Peak RSS of the whole preparation: {w['peak_rss_mb']:.0f} MB with --max-memory-mb={r['memory_mb']} "
        f"(batches of {r['batch_chars']:,} characters; the process and its {r['threads']} workers summed, sampled "
        "every 50 ms); the resumed run: "
        f"{w['resume_peak_rss_mb']:.0f} MB; with --max-memory-mb={w['low_memory_mb']}: "
        f"{w['low_memory_peak_rss_mb']:.0f} MB in {w['low_memory_seconds']:.1f}s, token shards "
        f"{'identical' if w['identical_at_low_memory'] else 'NOT identical'} to the first run's.",
        f"- Killed (SIGKILL) once {r['shards'] // 2} of {r['shards']} shards were complete, {w['killed_after_s']:.1f}s "
        f"in; the resumed run took {w['resume_seconds']:.1f}s (the uninterrupted one {w['seconds']:.1f}s); its token "
        f"shards {'are' if w['identical_after_resume'] else 'are NOT'} byte-identical to the uninterrupted run's.",
        "",
    ]
    return lines


def section_from_file(path: Path) -> list[str]:
    return section(json.loads(Path(path).read_text())) if Path(path).exists() else []


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gb", type=float, default=1.0, help="text to generate, in GB (UTF-8)")
    p.add_argument("--shard-chars", type=int, default=64_000_000, help="characters per generated shard")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--memory-mb", type=int, default=1024)
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--compare-shards", type=int, default=0, help="shards timed four ways (0: all)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "prep_scale.json"))
    p.add_argument("--section-only", action="store_true", help="only write RESULTS.md's section from --out")
    args = p.parse_args()
    results_md = ROOT / "benchmarks" / "RESULTS.md"
    if args.section_only:
        return put_section(results_md, section_from_file(Path(args.out)))
    os.environ["NANOCHAT_FAST_HOME"] = str(WORK / "home")
    from nanochat_fast.core import paths
    from nanochat_fast.data import token_shards

    t0 = time.perf_counter()
    manifest = generate(args.gb, args.shard_chars)
    shards = [paths.data_dir(NAME) / "train" / s for s in manifest["shards"]["train"]]
    data_bytes = sum(s.stat().st_size for s in shards)
    print(f"{len(shards)} shards, {data_bytes / 1e9:.2f} GB of parquet ({time.perf_counter() - t0:.0f}s)", flush=True)
    tok = train_tokenizer(args.vocab_size)
    batch_chars = token_shards.batch_chars_within(args.memory_mb, args.threads)
    compare = {}
    with token_shards.encoder_pool(tok, args.threads) as pool, ThreadPoolExecutor(args.threads) as thread_pool:
        for source in shards[: args.compare_shards or len(shards)]:
            for name, r in per_shard(tok, source, args.threads, batch_chars, pool, thread_pool).items():
                c = compare.setdefault(name, {"tokens": 0, "seconds": 0.0})
                c["tokens"] += r["tokens"]
                c["seconds"] += r["seconds"]
            print(source.name, {k: round(v["tokens"] / v["seconds"]) for k, v in compare.items()}, flush=True)
    whole = whole_run(args.threads, args.memory_mb, len(shards))
    text_bytes = manifest["config"]["text_bytes"]
    result = {
        "gb_text": text_bytes / 1e9,
        "parquet_bytes": data_bytes,
        "shards": len(shards),
        "threads": args.threads,
        "cpu": cpu_model(),
        "memory_mb": args.memory_mb,
        "batch_chars": batch_chars,
        "load_average": os.getloadavg(),
        "compare": compare,
        "whole": whole,
        "self_peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    put_section(results_md, section(result))
    print("\n".join(section(result)))


if __name__ == "__main__":
    main()
