"""
The published pretraining sets downloaded: ClimbMix-400B and FineWeb-Edu-100B parquet shards (a
"text" column each) into data/<dataset>/train/, the set's last shard into val/. A shard goes to
<name>.partial, is checked, then renamed: a file under its final name is complete. A .partial is
resumed with an HTTP Range request; connection errors, cut-off bodies and 5xx answers are retried
with a doubling wait; a 4xx answer or a full disk stops the run with one line, complete shards kept.
"""

import errno
import http.client
import shutil
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from ..core.errors import NetworkError, UserError
from ..core.progress import progress_bar
from .documents import shard_file


@dataclass(frozen=True)
class PublishedSet:
    base_url: str
    last_shard: int  # the validation shard; 0..last_shard-1 are the training shards


DATASETS = {
    "climbmix": PublishedSet("https://huggingface.co/datasets/karpathy/climbmix-400b-shuffle/resolve/main", 6542),
    "fineweb-edu": PublishedSet("https://huggingface.co/datasets/karpathy/fineweb-edu-100b-shuffle/resolve/main", 1822),
}
CHUNK = 1 << 20  # bytes read and written at a time
RETRY_STATUSES = {429} | set(range(500, 600))  # worth another try; other 4xx answers are the input's fault


@dataclass
class DownloadConfig:
    """What to fetch and how hard to try; checked when built (bad values: UserError, exit 2)."""

    dataset: str
    shards: int
    base_url: str = ""  # '': the dataset's own
    workers: int = 4
    retries: int = 5  # tries after the first, per shard
    retry_wait_s: float = 1.0  # the first wait; it doubles with each retry of a shard
    timeout_s: float = 30.0

    def __post_init__(self):
        if self.dataset not in DATASETS:
            raise UserError(f"--download: unknown dataset {self.dataset!r}; choose {' or '.join(DATASETS)}")
        published = DATASETS[self.dataset]
        if not isinstance(self.shards, int) or self.shards < 1:
            raise UserError(f"--shards must be at least 1 (training shards to download), got {self.shards}")
        if self.shards > published.last_shard:
            raise UserError(
                f"--shards={self.shards}: {self.dataset} has {published.last_shard} training shards "
                f"(and shard {published.last_shard} for validation); ask for at most {published.last_shard}"
            )
        self.base_url = (self.base_url or published.base_url).rstrip("/")
        if not self.base_url.lower().startswith(("http://", "https://")):
            raise UserError(f"--base-url must be an http:// or https:// address, got {self.base_url!r}")
        if self.workers < 1 or self.retries < 0 or self.retry_wait_s < 0 or self.timeout_s <= 0:
            raise UserError("download workers must be >= 1, retries and their wait >= 0, the timeout > 0")

    def jobs(self, root: Path) -> list[tuple[str, Path]]:
        """(url, destination) of every shard: the training shards, then the validation shard."""
        last = DATASETS[self.dataset].last_shard
        wanted = [("train", i) for i in range(self.shards)] + [("val", last)]
        return [(f"{self.base_url}/{shard_file(i)}", Path(root) / split / shard_file(i)) for split, i in wanted]


class _Retry(Exception):
    """This try failed in a way another try may fix (the message says how)."""


class _Counters:
    """What the worker threads report, under one lock: bytes, shards, retries, the bar."""

    def __init__(self, bar, total_shards):
        self.lock, self.bar, self.total_shards = threading.Lock(), bar, total_shards
        self.bytes = self.shards = self.retries = 0

    def add_bytes(self, n):
        with self.lock:
            self.bytes += n
            self.bar.update(n)

    def shard_done(self):
        with self.lock:
            self.shards += 1
            self.bar.set_postfix_str(f"{self.shards}/{self.total_shards} shards")

    def retried(self, url, why):
        with self.lock:
            self.retries += 1
            self.bar.write(f"retrying {url.rsplit('/', 1)[-1]}: {why}")


def partial_path(dest: Path) -> Path:
    return dest.with_name(dest.name + ".partial")


def verify_shard(path: Path) -> str | None:
    """None when `path` opens as parquet with a "text" column, else what is wrong."""
    import pyarrow.parquet as pq

    try:
        names = pq.ParquetFile(path).schema_arrow.names
    except Exception as e:  # a truncated or corrupt file: no footer, bad magic, bad metadata
        return f"not a readable parquet file ({type(e).__name__}: {e})"
    return None if "text" in names else f"no 'text' column (columns: {', '.join(names)})"


def _append(f, data: bytes):
    """Write one chunk (its own function: a test injects a full disk)."""
    f.write(data)


class _Redirects(urllib.request.HTTPRedirectHandler):
    """urllib's redirects keep the Range header (a resume survives the host's redirect to its CDN)
    but turn a HEAD into a GET: this keeps the HEAD a HEAD."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        if new is not None and req.get_method() == "HEAD":
            new.method = "HEAD"
        return new


_OPENER = urllib.request.build_opener(_Redirects)


def _open(url: str, cfg: DownloadConfig, method="GET", offset=0):
    headers = {"User-Agent": "nanochat_fast", "Accept-Encoding": "identity"}
    if offset:
        headers["Range"] = f"bytes={offset}-"
    return _OPENER.open(urllib.request.Request(url, headers=headers, method=method), timeout=cfg.timeout_s)


def _http_failure(e: urllib.error.HTTPError, url: str) -> Exception:
    if e.code in RETRY_STATUSES:
        return _Retry(f"HTTP {e.code} {e.reason}")
    return UserError(
        f"{url} answered HTTP {e.code} {e.reason}: check --base-url and --shards (the server has no such shard?)"
    )


def _with_retries(attempt, url: str, cfg: DownloadConfig, retried, failed: str, advice: str):
    """attempt() until it returns: _Retry and connection errors are tried again after a doubling wait
    (retried(url, why) tells), the last raises NetworkError("<failed> after N tries (<why>); <advice>")."""
    for n in range(cfg.retries + 1):
        try:
            return attempt()
        except _Retry as e:
            why = str(e)
        except (urllib.error.URLError, http.client.HTTPException, OSError) as e:
            why = f"{type(e).__name__}: {getattr(e, 'reason', e)}"
        if n == cfg.retries:
            raise NetworkError(f"{failed} after {cfg.retries + 1} tries ({why}); {advice}")
        retried(url, why)
        time.sleep(cfg.retry_wait_s * 2**n)


def head_size(url: str, cfg: DownloadConfig, retried) -> int | None:
    """The shard's size from a HEAD request (None when the server does not say), retried like a GET."""

    def attempt():
        try:
            with _open(url, cfg, method="HEAD") as resp:
                length = resp.headers.get("Content-Length")
                return int(length) if length and length.isdigit() else None
        except urllib.error.HTTPError as e:
            raise _http_failure(e, url) from None

    def head_retried(url, why):
        retried(url, f"HEAD: {why}")

    return _with_retries(attempt, url, cfg, head_retried, f"no answer to HEAD {url}", "check the network and re-run")


def _try_shard(url: str, dest: Path, cfg: DownloadConfig, counters: _Counters):
    """One try: a GET into dest's .partial (resuming what it holds), checked, then renamed to dest.
    Raises _Retry when another try may help, a UserError when the disk is full."""
    tmp = partial_path(dest)
    offset = tmp.stat().st_size if tmp.is_file() else 0
    try:
        resp = _open(url, cfg, offset=offset)
    except urllib.error.HTTPError as e:
        if e.code == 416:  # the partial file is not a prefix of this shard (or is all of it): start over
            tmp.unlink(missing_ok=True)
            raise _Retry("HTTP 416 for the resumed range; starting the shard over") from None
        raise _http_failure(e, url) from None
    with resp:
        if offset and resp.status != 206:  # the server ignored the Range header: the body is the whole file
            counters.add_bytes(-offset)
            offset = 0
        elif offset and not (resp.headers.get("Content-Range") or "").startswith(f"bytes {offset}-"):
            counters.add_bytes(-offset)
            tmp.unlink()
            raise _Retry(f"asked for bytes {offset}- and got {resp.headers.get('Content-Range')}; starting over")
        length = resp.headers.get("Content-Length")
        expected = offset + int(length) if length and length.isdigit() else None
        got = offset
        with open(tmp, "ab" if offset else "wb") as f:
            while True:
                try:
                    data = resp.read(CHUNK)
                except (http.client.IncompleteRead, OSError) as e:
                    raise _Retry(f"connection lost after {got:,} bytes ({type(e).__name__})") from None
                if not data:
                    break
                try:
                    _append(f, data)
                except OSError as e:
                    tmp.unlink(missing_ok=True)
                    what = "the disk is full" if e.errno == errno.ENOSPC else f"cannot write ({e})"
                    raise UserError(
                        f"{what} while writing {dest}: its partial file was removed, the complete shards are kept; "
                        "free some space (or ask for fewer --shards) and re-run"
                    ) from None
                got += len(data)
                counters.add_bytes(len(data))
    if expected is not None and got < expected:
        raise _Retry(f"connection lost after {got:,} of {expected:,} bytes")
    problem = verify_shard(tmp)
    if problem is not None:  # complete by its length, yet not a shard: a truncated body, fetched again whole
        counters.add_bytes(-tmp.stat().st_size)
        tmp.unlink()
        raise _Retry(f"the file received is {problem}")
    tmp.replace(dest)
    counters.shard_done()


def fetch_shard(url: str, dest: Path, cfg: DownloadConfig, counters: _Counters):
    """Download one shard to dest (via its .partial), retrying; raises UserError/NetworkError."""
    kept = "the complete shards are kept and a re-run resumes"
    _with_retries(
        lambda: _try_shard(url, dest, cfg, counters), url, cfg, counters.retried, f"{url}: still failing", kept
    )


def download(cfg: DownloadConfig, root: Path) -> dict:
    """Fetch the shards of `cfg` under root/{train,val}/, skipping complete ones; prints one summary
    line and returns {"shards", "bytes", "seconds", "retries", "skipped", "train", "val"}."""
    root = Path(root)
    jobs = cfg.jobs(root)
    for split in ("train", "val"):
        (root / split).mkdir(parents=True, exist_ok=True)
    todo = [(url, dest) for url, dest in jobs if not dest.is_file()]
    result = {split: [d.name for _, d in jobs if d.parent.name == split] for split in ("train", "val")}
    result["skipped"] = len(jobs) - len(todo)
    if not todo:
        total = sum(d.stat().st_size for _, d in jobs)
        print(f"{cfg.dataset}: all {len(jobs)} shards already present ({total / 1e9:.2f} GB): nothing to download")
        return dict(result, shards=0, bytes=0, seconds=0.0, retries=0)
    t0 = time.perf_counter()
    head_retries = []
    with ThreadPoolExecutor(cfg.workers) as pool:
        sizes = list(pool.map(lambda job: head_size(job[0], cfg, lambda *why: head_retries.append(why)), todo))
    held = [partial_path(d).stat().st_size if partial_path(d).is_file() else 0 for _, d in todo]
    need, free = sum(s - h for s, h in zip(sizes, held) if s is not None), shutil.disk_usage(root).free
    if need > free:  # said before any shard is fetched; what the .partial files hold already counts
        raise UserError(
            f"{len(todo)} shards need {need / 1e9:.2f} GB but {root} has {free / 1e9:.2f} GB free "
            f"({(need - free) / 1e9:.2f} GB short): free some space or ask for fewer --shards"
        )
    resumed, total = sum(held), (sum(sizes) if None not in sizes else None)
    with progress_bar(desc=f"downloading {cfg.dataset}", unit="B", unit_scale=True, total=total) as bar:
        counters = _Counters(bar, len(todo))
        for url, why in head_retries:
            counters.retried(url, f"HEAD: {why}")
        counters.add_bytes(resumed)
        bar.set_postfix_str(f"0/{len(todo)} shards")
        with ThreadPoolExecutor(cfg.workers) as pool:
            futures = [pool.submit(fetch_shard, url, dest, cfg, counters) for url, dest in todo]
            try:
                for future in futures:
                    future.result()
            except BaseException:  # the first failure stops the run: shards not started are not started
                pool.shutdown(cancel_futures=True)
                raise
    seconds = time.perf_counter() - t0
    fetched = counters.bytes - resumed
    print(
        f"{cfg.dataset}: {len(todo)} shards downloaded ({result['skipped']} already present), "
        f"{fetched / 1e9:.2f} GB in {seconds:.1f}s ({fetched / 1e6 / max(seconds, 1e-9):.1f} MB/s), "
        f"{counters.retries} retries"
    )
    return dict(result, shards=len(todo), bytes=fetched, seconds=seconds, retries=counters.retries)
