"""
Sample from a trained model; the text streams to stdout as it is generated.

    python sample.py --out_dir=out-shakespeare-char --start="ROMEO:" --num_samples=3 \\
        --max_new_tokens=500 --temperature=0.8 --top_k=200 --seed=1337
    python sample.py --out_dir=out-shakespeare-char --start=FILE:prompt.txt
    python sample.py --out_dir=out-bert-char --start="To be, or not to be: [MASK][MASK][MASK][MASK] is the question"

A decoder continues the prompt. An encoder (masked LM) fills each [MASK] with one token; an
encoder-decoder (span corruption) fills each [MASK] with a span of any length.
"""

import codecs
import os
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, fields

import torch

from model import ModelConfig, Transformer, sample
from prepare import PrepareError, Tokenizer
from train import UsageError, load_checkpoint, parse_settings, pick_device, pick_dtype

MASK = "[MASK]"


@dataclass
class SampleConfig:
    out_dir: str = "out"
    ckpt: str = "best"  # "best" (lowest val loss, best.pt) or "latest" (ckpt.pt)
    start: str = "\n"  # the prompt, or FILE:path to read it from a file
    num_samples: int = 1
    max_new_tokens: int = 500
    temperature: float = 0.8  # 0 = greedy; higher = more random
    top_k: int | None = 200  # sample only from the k most likely tokens
    top_p: float | None = None  # ...or from the most likely tokens that cover this probability
    seed: int = 1337
    device: str = "auto"
    dtype: str = "auto"


def check(cfg):
    if cfg.max_new_tokens < 0:
        raise UsageError(f"max_new_tokens={cfg.max_new_tokens} is negative: ask for 0 or more tokens")
    if cfg.temperature < 0:
        raise UsageError(f"temperature={cfg.temperature} is negative: use 0 (greedy) or more")
    if cfg.top_p is not None and not 0 < cfg.top_p <= 1:
        raise UsageError(f"top_p={cfg.top_p} must lie in (0, 1]: 0.9 keeps the tokens covering 90%")
    if cfg.top_k is not None and cfg.top_k < 1:
        raise UsageError(f"top_k={cfg.top_k} must be at least 1 (or None for no limit)")
    if cfg.ckpt not in ("best", "latest"):
        raise UsageError(f"ckpt={cfg.ckpt!r} is not known: use 'best' or 'latest'")


def load(cfg, device):
    """The model, its tokenizer and its special tokens from out_dir."""
    path = os.path.join(cfg.out_dir, "best.pt" if cfg.ckpt == "best" else "ckpt.pt")
    if cfg.ckpt == "best" and not os.path.exists(path):
        path = os.path.join(cfg.out_dir, "ckpt.pt")
    ckpt = load_checkpoint(path, device, other="--ckpt=latest" if cfg.ckpt == "best" else "--ckpt=best")
    model = Transformer(ModelConfig(**ckpt["model_config"]))
    model.load_state_dict(ckpt["model"])
    return model.to(device).eval(), Tokenizer(ckpt["meta"]), ckpt["tokens"]


def main(argv):
    known = {f.name: ("sample", f.type) for f in fields(SampleConfig)}
    cfg = SampleConfig(**parse_settings(argv, known, "SampleConfig in sample.py"))
    check(cfg)
    device = pick_device(cfg.device)
    dtype = pick_dtype(cfg.dtype, device)
    # softmax tails leave tiny (denormal) floats that x86 CPUs handle 30x slower: round them to 0
    torch.set_flush_denormal(True)
    autocast = torch.autocast(device.type, dtype=dtype) if dtype != torch.float32 else nullcontext()
    model, tok, special = load(cfg, device)
    prompt = cfg.start
    if prompt.startswith("FILE:"):
        if not os.path.isfile(prompt[5:]):
            raise UsageError(f"prompt file {prompt[5:]!r} not found: check the path after FILE:")
        try:
            with open(prompt[5:], encoding="utf-8") as f:
                prompt = f.read()
        except UnicodeDecodeError:
            raise UsageError(f"prompt file {prompt[5:]!r} is not UTF-8 text: convert it first") from None
    unknown = tok.unknown(prompt.replace(MASK, ""))
    if unknown:
        raise UsageError(f"the prompt has characters the model's vocabulary lacks: {''.join(unknown)!r}; "
                         "remove or replace them")
    torch.manual_seed(cfg.seed)
    arch = model.config.arch
    if MASK not in prompt and arch != "decoder":
        raise UsageError(f"an {arch} fills in blanks: put {MASK} in --start where text is missing")
    run = {"decoder": continue_text, "encoder": fill_masks, "encoder-decoder": fill_spans}[arch]
    write = lambda s: (sys.stdout.write(s), sys.stdout.flush())  # noqa: E731
    n_tokens, t0 = 0, time.time()
    with autocast:
        for _ in range(cfg.num_samples):
            n_tokens += run(model, tok, special, prompt, cfg, device, write)
            write("\n---------------\n")
    dt = time.time() - t0
    print(f"sample.py: {n_tokens:,} tokens in {dt:.2f} s, {n_tokens / dt:,.1f} tokens/s "
          f"({arch}, {device}, {str(dtype).replace('torch.', '')})", file=sys.stderr)


def text_of(tok):
    """A function from one token id to the text it completes (BPE tokens may split a character)."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    return lambda i: decoder.decode(tok.decode_bytes([i])) if i < tok.vocab_size else ""


def continue_text(model, tok, special, prompt, cfg, device, write):
    ids = tok.encode(prompt)
    if not ids:
        raise UsageError("the prompt is empty: give --start some text (the default is a newline)")
    block = model.config.block_size
    if model.config.pos == "learned" and len(ids) > block:
        print(f"sample.py: the prompt is {len(ids)} tokens, longer than the {block} positions this model "
              f"learned: it sees the last {block}", file=sys.stderr)
    write(prompt)
    text = text_of(tok)
    x = torch.tensor([ids], device=device)
    for t in model.generate_tokens(x, cfg.max_new_tokens, cfg.temperature, cfg.top_k, cfg.top_p,
                                   vocab_limit=tok.vocab_size):
        write(text(t.item()))
    return cfg.max_new_tokens


def fill_masks(model, tok, special, prompt, cfg, device, write):
    """Masked LM: fill the masks left to right, each seeing the ones filled before it."""
    pieces = prompt.split(MASK)
    ids, holes = [], []
    for i, piece in enumerate(pieces):
        ids += tok.encode(piece)
        if i < len(pieces) - 1:
            holes.append(len(ids))
            ids.append(special["mask"])
    if model.config.pos == "learned" and len(ids) > model.config.block_size:
        raise UsageError(f"the text is {len(ids)} tokens, longer than the model's block_size="
                         f"{model.config.block_size}: shorten it")
    x = torch.tensor([ids], device=device)
    text = text_of(tok)
    write(pieces[0])
    for hole, piece in zip(holes, pieces[1:]):
        with torch.no_grad():
            logits = model(x)[0][:, hole, : tok.vocab_size]  # only real tokens may fill a hole
        x[0, hole] = sample(logits, cfg.temperature, cfg.top_k, cfg.top_p)[0, 0]
        write(text(x[0, hole].item()) + piece)
    return len(holes)


def fill_spans(model, tok, special, prompt, cfg, device, write):
    """Span corruption: each [MASK] becomes a sentinel; the decoder writes sentinel k followed
    by span k, and sentinel n after the last of the n spans."""
    pieces = prompt.split(MASK)
    first = special["sentinel"]
    ids = []
    for i, piece in enumerate(pieces):
        ids += tok.encode(piece)
        if i < len(pieces) - 1:
            ids.append(first + i)
    src = torch.tensor([ids], device=device)
    start = torch.tensor([[special["start"]]], device=device)
    text = text_of(tok)
    write(pieces[0])
    shown, n = 0, 0  # pieces written after the first; tokens generated
    limit = first + special["n_sentinel"]  # text and sentinels, no padding
    for t in model.generate_tokens(start, cfg.max_new_tokens, cfg.temperature, cfg.top_k, cfg.top_p, src=src,
                                   vocab_limit=limit):
        t, n = t.item(), n + 1
        if first < t < first + special["n_sentinel"]:  # sentinel k ends span k - 1
            while shown < min(t - first, len(pieces) - 1):
                shown += 1
                write(pieces[shown])
            if shown == len(pieces) - 1:
                break
        elif t < tok.vocab_size:
            write(text(t))
    for piece in pieces[shown + 1:]:  # spans the model did not close
        write(piece)
    return n


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except (UsageError, PrepareError, ValueError) as e:
        print(f"sample.py: error: {e}", file=sys.stderr)
        sys.exit(2)
