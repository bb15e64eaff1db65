"""
Sample from a trained model; the text streams to stdout as it is generated.

    python sample.py --out_dir=out-shakespeare-char --start="ROMEO:" --num_samples=3 \\
        --max_new_tokens=500 --temperature=0.8 --top_k=200 --seed=1337
    python sample.py --out_dir=out-shakespeare-char --start=FILE:prompt.txt
    python sample.py --out_dir=out-shakespeare-char --start=FILE:prompts.txt --batch   # one per line
    python sample.py --out_dir=out-shakespeare-char --draft_dir=out-small              # speculative
    python sample.py --out_dir=out-shakespeare-char --quantize=int8 --attention=attn.html
    python sample.py --out_dir=out-shakespeare-char-bert --start="To be, or not to be: [MASK][MASK][MASK][MASK] is the question"
    python sample.py --init_from=gpt2 --start="Hello"          # a Hugging Face model: a directory or a hub name

A decoder continues the prompt. An encoder (masked LM) fills each [MASK] with one token; an
encoder-decoder (span corruption) fills each [MASK] with a span of any length.
"""

import html
import json
import os
import signal
import sys
import time
from dataclasses import dataclass

# Ctrl-C while torch loads or the text streams out ends sampling quietly: status 130, no traceback;
# so does a reader that stops early (`| head`), as for any Unix tool (status 141, SIGPIPE)
if __name__ == "__main__":
    signal.signal(signal.SIGINT, lambda signum, frame: sys.exit(128 + signum))
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)

import torch

from common import (UsageError, check_ranges, compile_decode, load_model, out_of_memory, parse_settings, pick_device,
                    pick_dtype, precision, precision_name, timed, usage)
from model import Int8Linear, sample, speculative_generate

MASK = "[MASK]"
PAGE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "attention.html")


@dataclass
class SampleConfig:
    out_dir: str = "out"
    init_from: str = "resume"  # "resume" (the run in out_dir), or a Hugging Face model directory or hub name
    ckpt: str = "best"  # "best" (lowest val loss, best.pt) or "latest" (ckpt.pt)
    start: str = "\n"  # the prompt, or FILE:path to read it from a file
    num_samples: int = 1
    max_new_tokens: int = 500
    temperature: float = 0.8  # 0 = greedy; higher = more random
    top_k: int | None = 200  # sample only from the k most likely tokens
    top_p: float | None = None  # ...or from the most likely tokens that cover this probability
    seed: int = 1337
    device: str = "auto"
    dtype: str = "auto"  # bf16 on GPUs that have it (weights cast once), fp16 (under autocast), fp32 on the CPU
    compile: bool = False  # torch.compile the one-token decoding step
    batch: bool = False  # with --start=FILE:..., continue every line of the file, all in one batch
    draft_dir: str = ""  # out_dir of a small model that drafts tokens for speculative decoding
    draft_k: int = 4  # tokens the draft proposes per step
    quantize: str = ""  # "int8": weight-only int8 for every Linear layer
    attention: str = ""  # write the first sample's attention weights to this HTML file
    attention_tokens: int = 128  # ...for at most this many (the last) tokens


# the values each setting may take, beyond its type
RANGES = dict(ckpt=("best", "latest"), quantize=("", "int8"), max_new_tokens="[0, inf)", temperature="[0, inf)",
              top_k="[1, inf)", top_p="(0, 1]", num_samples="[1, inf)", draft_k="[1, inf)",
              attention_tokens="[1, inf)", seed="[0, inf)")


def check(cfg):
    check_ranges(cfg, RANGES)
    if cfg.batch and not cfg.start.startswith("FILE:"):
        raise UsageError("--batch takes its prompts from a file, one per line: --start=FILE:prompts.txt")
    if cfg.attention and (os.path.isdir(cfg.attention) or not os.path.isdir(os.path.dirname(cfg.attention) or ".")):
        raise UsageError(f"--attention={cfg.attention} is not a file in an existing folder: "
                         "give a path such as attn.html")  # found out now, not after sampling


def main(argv):
    if {"-h", "--help"} & set(argv):
        print(usage(__doc__, SampleConfig))
        return 0
    cfg = SampleConfig(**parse_settings(argv, SampleConfig)[0])
    check(cfg)
    device = pick_device(cfg.device)
    dtype = pick_dtype(cfg.dtype, device)
    torch.set_flush_denormal(True)  # softmax tails leave denormal floats, which x86 CPUs handle far slower
    weights, autocast = precision(dtype, device)
    model, tok, ckpt = load_model(cfg.out_dir, device, weights, cfg.quantize, cfg.ckpt, cfg.init_from)
    if cfg.compile:
        compile_decode(model, device)
    prompt = read_prompt(cfg.start)
    if unknown := tok.unknown(prompt.replace(MASK, "")):
        raise UsageError(f"the prompt has characters the model's vocabulary lacks: {''.join(unknown)!r}; "
                         "remove or replace them")
    arch = model.config.arch
    if MASK not in prompt and arch != "decoder":
        raise UsageError(f"an {arch} fills in blanks: put {MASK} in --start where text is missing")
    torch.manual_seed(cfg.seed)
    with autocast:
        if cfg.draft_dir:
            return speculate(model, tok, prompt, cfg, device)
        if cfg.batch:
            n_tokens, dt, picture = continue_batch(model, tok, prompt, cfg, device)
        else:
            fill = {"decoder": continue_text, "encoder": fill_masks, "encoder-decoder": fill_spans}[arch]
            n_tokens, t0, picture = 0, time.time(), None
            for _ in range(cfg.num_samples):
                n, ids = fill(model, tok, ckpt["tokens"], prompt, cfg, device)
                n_tokens, picture = n_tokens + n, picture or ids
                write("\n---------------\n")
            dt = time.time() - t0
    n_int8 = sum(isinstance(m, Int8Linear) for m in model.modules())
    print(f"sample.py: {n_tokens:,} tokens in {dt:.2f} s, {n_tokens / dt:,.1f} tokens/s ({arch}, {device}, "
          f"{precision_name(model.wte.weight.dtype, dtype)}{f', {n_int8} Linear layers in int8' if n_int8 else ''})",
          file=sys.stderr)
    if cfg.attention:
        write_attention(cfg.attention, model, tok, picture, cfg.attention_tokens)
        print(f"sample.py: attention weights of the first sample in {cfg.attention}", file=sys.stderr)
    return 0


def write(text):
    print(text, end="", flush=True)  # the sample streams as it is made


def read_prompt(start):
    if not start.startswith("FILE:"):
        return start
    path = start[5:]
    if not os.path.isfile(path):
        what = "is a folder, not a file" if os.path.isdir(path) else "not found"
        raise UsageError(f"prompt file {path!r} {what}: check the path after FILE:")
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError:
        raise UsageError(f"prompt file {path!r} is not UTF-8 text: convert it first") from None


def encode_prompt(model, tok, prompt):
    ids = tok.encode(prompt, special=True)
    if not ids:
        raise UsageError("the prompt is empty: give --start some text (the default is a newline)")
    block = model.config.block_size
    if model.absolute_positions and len(ids) > block:  # relative positions slide a window over it instead
        print(f"sample.py: the prompt is {len(ids)} tokens, longer than the {block} positions this model "
              f"knows: it sees the last {block}", file=sys.stderr)
    return ids


# ----------------------------------------------------------------------------------------------
# Decoders: continue the prompt

def continue_text(model, tok, special, prompt, cfg, device):
    ids = encode_prompt(model, tok, prompt)
    write(prompt)
    text = tok.streamer(ids)
    for t in model.generate_tokens(torch.tensor([ids], device=device), cfg.max_new_tokens, cfg.temperature,
                                   cfg.top_k, cfg.top_p, vocab_limit=tok.vocab_size):
        t = t.item()  # printing as we go needs the token on the host
        ids.append(t)
        write(text(t))
    write(text(None))
    return cfg.max_new_tokens, dict(idx=ids)


def continue_batch(model, tok, prompts, cfg, device):
    """Every line of the prompt file in one batch: left-padded, each row masked and counting its
    positions from its first token, so that it decodes as it would alone."""
    if model.config.arch != "decoder":
        raise UsageError("--batch continues prompts: it needs a decoder checkpoint")
    lines = [line for line in prompts.splitlines() if line.strip()]
    if not lines:
        raise UsageError("the prompt file has no non-empty line to continue")
    rows = [encode_prompt(model, tok, line) for line in lines]
    T = max(map(len, rows))
    idx = torch.zeros(len(rows), T, dtype=torch.long, device=device)
    mask = torch.zeros(len(rows), T, dtype=torch.bool, device=device)
    for i, row in enumerate(rows):
        idx[i, T - len(row):] = torch.tensor(row)
        mask[i, T - len(row):] = True
    t0 = time.time()
    out = model.generate(idx, cfg.max_new_tokens, cfg.temperature, cfg.top_k, cfg.top_p,
                         vocab_limit=tok.vocab_size, mask=mask)[:, T:].tolist()
    dt = time.time() - t0
    for line, row, new in zip(lines, rows, out):  # the text after the prompt's, as a streamer shows it
        text = tok.streamer(row)
        write(line + "".join(map(text, new)) + text(None) + "\n---------------\n")
    return len(rows) * cfg.max_new_tokens, dt, dict(idx=rows[0] + out[0])


def speculate(model, tok, prompt, cfg, device):
    """Speculative decoding with the draft in --draft_dir, timed against the target alone."""
    draft, draft_tok, _ = load_model(cfg.draft_dir, device, model.wte.weight.dtype, cfg.quantize, cfg.ckpt)
    if draft_tok.kind != tok.kind or draft_tok.vocab_size != tok.vocab_size or (
            tok.kind == "char" and draft_tok.chars != tok.chars):
        raise UsageError(f"the draft in {cfg.draft_dir} has another vocabulary than the target: train it on "
                         "the same dataset")
    idx = torch.tensor([encode_prompt(model, tok, prompt)], device=device)
    args = (cfg.max_new_tokens, cfg.temperature, cfg.top_k, cfg.top_p)
    accepted = proposed = 0
    times = {"target alone": 0.0, "speculative": 0.0}
    for _ in range(cfg.num_samples):
        (out, a, p), dt = timed(lambda: speculative_generate(model, draft, idx, *args[:1], cfg.draft_k, *args[1:],
                                                             tok.vocab_size), device)
        times["speculative"] += dt
        accepted, proposed = accepted + a, proposed + p
        write(tok.decode(out[0].tolist()) + "\n---------------\n")
        times["target alone"] += timed(lambda: model.generate(idx, *args, vocab_limit=tok.vocab_size), device)[1]
    rate = {k: cfg.num_samples * cfg.max_new_tokens / v for k, v in times.items()}
    print(f"sample.py: draft tokens accepted {accepted}/{proposed} ({accepted / max(proposed, 1):.1%}); "
          f"speculative {rate['speculative']:,.1f} tokens/s, target alone {rate['target alone']:,.1f} tokens/s: "
          f"{rate['speculative'] / rate['target alone']:.2f}x (k={cfg.draft_k})", file=sys.stderr)
    return 0


# ----------------------------------------------------------------------------------------------
# Encoders and encoder-decoders: fill the blanks

def blanks(model, tok, prompt, blank_id):
    """The prompt's ids with blank_id(k) in place of its k-th [MASK], the places of those, and the
    text between them. An encoder reads the whole text at once: it must fit learned positions."""
    pieces = prompt.split(MASK)
    ids, holes = [], []
    for k, piece in enumerate(pieces):
        ids += tok.encode(piece)
        if k < len(pieces) - 1:
            holes.append(len(ids))
            ids.append(blank_id(k))
    try:
        model.check_length(len(ids))
    except ValueError:
        raise UsageError(f"the text is {len(ids)} tokens, longer than the model's block_size="
                         f"{model.config.block_size}: shorten it") from None
    return ids, holes, pieces


def fill_masks(model, tok, special, prompt, cfg, device):
    """Masked LM: fill the masks left to right, each seeing the ones filled before it."""
    ids, holes, pieces = blanks(model, tok, prompt, lambda k: special["mask"])
    x = torch.tensor([ids], device=device)
    write(pieces[0])
    for hole, piece in zip(holes, pieces[1:]):
        with torch.no_grad():
            logits = model(x)[0][:, hole, : tok.vocab_size]  # only real tokens may fill a hole
        x[0, hole] = sample(logits, cfg.temperature, cfg.top_k, cfg.top_p)[0, 0]
        text = tok.streamer(ids[:hole])  # the token's text where it stands
        write(text(x[0, hole].item()) + text(None) + piece)
    return len(holes), dict(idx=x[0].tolist())


def fill_spans(model, tok, special, prompt, cfg, device):
    """Span corruption: each [MASK] becomes a sentinel; the decoder writes sentinel k followed
    by span k, and sentinel n after the last of the n spans."""
    n_sentinel = special["n_sentinel"]
    sentinels = [special["sentinel"] + k * special.get("sentinel_step", 1) for k in range(n_sentinel)]
    if prompt.count(MASK) >= n_sentinel:  # n spans take n + 1 sentinels: the last one ends the output
        raise UsageError(f"the prompt has {prompt.count(MASK)} {MASK}s; this model fills at most "
                         f"{n_sentinel - 1} spans: use fewer")
    ids, _, pieces = blanks(model, tok, prompt, lambda k: sentinels[k])
    ends = tok.specials() - set(sentinels)  # a pretrained T5's </s> and padding
    out, shown, text = [special["start"]], 0, tok.streamer()  # shown: pieces written after the first
    write(pieces[0])
    for t in model.generate_tokens(torch.tensor([out], device=device), cfg.max_new_tokens, cfg.temperature,
                                   cfg.top_k, cfg.top_p, src=torch.tensor([ids], device=device),
                                   vocab_limit=max(tok.vocab_size, max(sentinels) + 1)):  # text and sentinels
        t = t.item()
        out.append(t)
        if t in sentinels[1:]:  # sentinel k ends span k - 1
            while shown < min(sentinels.index(t), len(pieces) - 1):
                shown += 1
                write(pieces[shown])
            if shown == len(pieces) - 1:
                break
        elif t in ends:
            break
        elif t < tok.vocab_size and t not in sentinels:
            write(text(t))
    write(text(None))
    for piece in pieces[shown + 1:]:  # spans the model did not close
        write(piece)
    return len(out) - 1, dict(idx=out, src=ids)


# ----------------------------------------------------------------------------------------------
# The attention page: every layer's and head's weights as heatmaps (its page: attention.html)

def attention_maps(model, idx, src=None):
    """Each attention's weights for one sequence, from a forward pass on the math path:
    {name: (layers, heads, Tq, Tk)}."""
    config = model.config
    saved, config.attn_impl = config.attn_impl, "math"  # every module reads this one config
    try:
        with torch.no_grad():
            model(idx, src=src)
    finally:
        config.attn_impl = saved
    maps = {}
    for stack in ("encoder", "decoder"):
        blocks = getattr(model, stack).h if getattr(model, stack) is not None else []
        if blocks:
            maps[f"{stack} self-attention"] = torch.stack([b.attn.att[0] for b in blocks])
        if blocks and blocks[0].cross_attn is not None:
            maps["decoder cross-attention (to the encoder)"] = torch.stack([b.cross_attn.att[0] for b in blocks])
    for block in [b for s in (model.encoder, model.decoder) if s is not None for b in s.h]:
        for attn in (block.attn, block.cross_attn):
            if attn is not None:
                attn.att = None  # let go of the memory
    return maps


def write_attention(path, model, tok, seq, n_tokens):
    """The attention page for the sequence seq (its idx, and src for an encoder-decoder), written to path."""
    dev = model.wte.weight.device
    keep = min(n_tokens, model.config.block_size if model.config.pos == "learned" else n_tokens)
    idx = torch.tensor([seq["idx"][-keep:]], device=dev)
    src = torch.tensor([seq["src"][-keep:]], device=dev) if "src" in seq else None
    labels = lambda ids: [tok.decode([i]) if i < tok.vocab_size else f"<{i}>" for i in ids]  # noqa: E731
    tokens = {"decoder": labels(idx[0].tolist()), "encoder": labels((src if src is not None else idx)[0].tolist())}
    kinds = []
    for name, weights in attention_maps(model, idx, src).items():
        queries = tokens["encoder" if name.startswith("encoder") else "decoder"]
        keys = tokens["encoder" if name.startswith("encoder") or "cross" in name else "decoder"]
        kinds.append(dict(name=name, queries=queries, keys=keys,  # weights in units of 1e-4
                          weights=(weights.float() * 1e4).round().int().tolist()))
    data = json.dumps(dict(kinds=kinds), separators=(",", ":")).replace("</", "<\\/")
    with open(PAGE, encoding="utf-8") as f:
        page = f.read()
    with open(path, "w", encoding="utf-8") as f:
        f.write(page.replace("/*DATA*/", data).replace("TITLE", html.escape(os.path.basename(path))))


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except (UsageError, ValueError) as e:
        print(f"sample.py: error: {e}", file=sys.stderr)
        sys.exit(2)
    except (RuntimeError, MemoryError) as e:  # torch's allocators raise RuntimeErrors
        if (oom := out_of_memory(e)) is None:
            raise
        print(f"sample.py: error: {oom}: give fewer prompts at once (lines of a --batch file), a shorter prompt, "
              "or smaller weights (--dtype=bfloat16, --quantize=int8)", file=sys.stderr)
        sys.exit(2)
