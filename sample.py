"""
Sample from a trained model; the text streams to stdout as it is generated.

    python sample.py --out_dir=out-shakespeare-char --start="ROMEO:" --num_samples=3 \\
        --max_new_tokens=500 --temperature=0.8 --top_k=200 --seed=1337
    python sample.py --out_dir=out-shakespeare-char --start=FILE:prompt.txt
    python sample.py --out_dir=out-shakespeare-char --start=FILE:prompts.txt --batch   # one per line
    python sample.py --out_dir=out-shakespeare-char --draft_dir=out-small              # speculative
    python sample.py --out_dir=out-shakespeare-char --quantize=int4 --attention_page=attn.html
    python sample.py --out_dir=out-shakespeare-char-bert --start="To be, or not to be: [MASK][MASK][MASK][MASK] is the question"
    python sample.py --init_from=gpt2 --start="Hello"          # a Hugging Face model: a directory or a hub name
    python sample.py --out_dir=out-vit-digits --image=digit.png   # an image classifier: its top classes

A decoder continues the prompt. An encoder (masked LM) fills each [MASK] with one token; an
encoder-decoder fills each [MASK] with a span of any length (span corruption), or writes it all again (BART).
"""

import contextlib
import io
import os
import sys
from dataclasses import dataclass, replace
from functools import partial
from typing import NamedTuple

import common  # no torch: it sets the signals before torch's import

if __name__ == "__main__":  # before torch's import, not in main: it takes seconds, and Ctrl-C counts then too
    common.exit_quietly_on_signals()

import torch

from checkpoint import describe, for_sampling, load_model
from hf import load_source
from media import top_classes
from common import UsageError, check_ranges, parse_settings, read_text_file, renamed, usage
from device import pick_device, pick_dtype, precision, precision_name, run_script, timed
from generate import (absolute_positions, compile_pays, decode_layout, generate, generate_tokens, speculative_generate,
                      stopping_after)
from model import ATTENTIONS
from pages import write_attention
from quantize import INT4_GROUP_SIZES, QUANTIZED
from sampling import sample

MASK = "[MASK]"
SEP = "\n---------------\n"  # after each sequence shown


@dataclass
class SampleConfig:
    out_dir: str = "out"
    init_from: str = "resume"  # "resume" (the run in out_dir), or a Hugging Face model directory or hub name
    ckpt: str = "best"  # "best" (lowest val loss, best.pt) or "latest" (ckpt.pt)
    start: str = "\n"  # the prompt, its escapes read as Python's (\n, \t, \\), or FILE:path for a file's text
    num_samples: int = 1  # samples of the prompt (with --batch, of every line)
    max_new_tokens: int = 500
    temperature: float = 0.8  # 0 = greedy; higher = more random
    top_k: int | None = 200  # sample only from the k most likely tokens
    top_p: float | None = None  # ...or from the most likely tokens that cover this probability
    seed: int = 1337
    device: str = "auto"
    dtype: str = "auto"  # bf16 on GPUs that have it (weights cast once), fp16 (under autocast), fp32 on the CPU
    compile: bool | None = None  # torch.compile the one-token decoding step; None: where it pays (compile counted)
    batch: bool = False  # with --start=FILE:..., continue every line of the file, all in one batch
    draft_dir: str = ""  # out_dir of a small model that drafts tokens for speculative decoding
    draft_k: int = 4  # tokens the draft proposes per step
    quantize: str = ""  # "int8", "int4": weights only, every Linear; "int8-dynamic", "int4-dynamic": W8A8, W4A8 (CPU)
    group_size: int = 128  # int4: weights per scale and zero point (32, 64, 128 or 256)
    attention_page: str = ""  # write the first sample's attention weights to this HTML file
    attention_tokens: int = 128  # ...for at most this many (the last) tokens
    image: str = ""  # an image classifier (ViT): the image (.png, .jpg; audio: .wav) whose 5 likeliest classes to print


RENAMED = {"attention": "attention_page"}  # old name: new name; the old one still works, with a notice
# the values each setting may take, beyond its type
RANGES = dict(ckpt=("best", "latest"), quantize=("", "int8", "int4", "int8-dynamic", "int4-dynamic"),
              group_size=INT4_GROUP_SIZES, max_new_tokens="[0, inf)", temperature="[0, inf)", top_k="[1, inf)",
              top_p="(0, 1]", num_samples="[1, inf)", draft_k="[1, inf)", attention_tokens="[1, inf)", seed="[0, inf)")


class Result(NamedTuple):
    """What every mode returns for one sample (with --batch, one of every line)."""
    tokens: int  # tokens generated
    seqs: list  # the sequences shown: {"idx": ids} (and "src" of an encoder-decoder); the attention page draws seqs[0]
    accepted: int = 0  # with a draft: its tokens that the target kept
    proposed: int = 0  # ...of those it proposed


def check(cfg):  # found out now, not after loading and sampling
    check_ranges(cfg, RANGES)
    if cfg.batch and not cfg.start.startswith("FILE:"):
        raise UsageError("--batch takes its prompts from a file, one per line: --start=FILE:prompts.txt")
    if cfg.batch and cfg.draft_dir:
        raise UsageError("speculative decoding continues one prompt at a time: leave out --batch or --draft_dir")
    page = cfg.attention_page
    if page and (os.path.isdir(page) or not os.path.isdir(os.path.dirname(page) or ".")):
        raise UsageError(f"--attention_page={page} is not a file in an existing folder: give a path such as attn.html")


def refusals(cfg, model, draft):
    """What this model cannot do of what was asked, read from its kind of attention (model.ATTENTIONS)."""
    for m in (model, draft) if draft is not None else ():
        if ATTENTIONS[m.config.attention].keeps != "kv":
            raise UsageError(f"{m.config.attention} attention's state cannot take back rejected draft tokens: "
                             "leave out --draft_dir")
    if draft is not None and model.config.arch == "prefix-lm":  # speculative_generate's prefill is causal
        raise UsageError("a prefix LM reads its prompt both ways, which drafting cannot: leave out --draft_dir")
    if cfg.attention_page and not ATTENTIONS[model.config.attention].weights:
        raise UsageError(f"{model.config.attention} attention has no weights to draw: leave out --attention_page")


def int8_on_cuda(cfg, device):
    """cfg without int8 weights on CUDA, saying why: torch has no fused int8 product there, so the layer
    converts its weights at every product and decodes at 0.36x bf16's speed (int4: 1.5x; docs/performance.md)."""
    if cfg.quantize.endswith("-dynamic") and device.type != "cpu":
        raise UsageError(f"--quantize={cfg.quantize} is a CPU kernel, not {device.type}'s: use --quantize=int8 or int4")
    if cfg.quantize != "int8" or device.type != "cuda":
        return cfg
    print("sample.py: --quantize=int8 decodes slower than unquantized weights on CUDA (torch converts the int8 "
          "weights at every product); decoding without it. --quantize=int4 is the faster one there", file=sys.stderr)
    return replace(cfg, quantize="")


def main(argv):
    if {"-h", "--help"} & set(argv):
        print(usage(__doc__, SampleConfig))
        return 0
    cfg = SampleConfig(**parse_settings(renamed(argv, RENAMED, "sample.py"), SampleConfig)[0])
    check(cfg)
    device = pick_device(cfg.device)
    dtype = pick_dtype(cfg.dtype, device)
    torch.set_flush_denormal(True)  # softmax tails leave denormal floats, which x86 CPUs handle far slower
    weights, autocast = precision(dtype, device)
    cfg = int8_on_cuda(cfg, device)
    model, ckpt = load_source(cfg.init_from, cfg.out_dir, cfg.ckpt)  # a run's checkpoint or a Hugging Face model
    if cfg.init_from == "resume":
        print(f"sample.py: {describe(ckpt)}", file=sys.stderr)
    if cfg.image or model.config.patch_size:  # an image classifier: its likeliest classes, with probabilities
        print("\n".join(f"{p:.4f}  {name}" for name, p in top_classes(model.to(device), ckpt["meta"], cfg.image)))
        return 0
    model, tok = for_sampling(model, ckpt, device, weights, cfg.quantize, cfg.group_size)
    model = decode_layout(model)  # on a CPU, the weights laid out for one token at a time (generate.py)
    prompt = read_prompt(cfg.start)
    if unknown := tok.unknown(prompt.replace(MASK, "")):
        raise UsageError(f"the prompt has characters the model's vocabulary lacks: {''.join(unknown)!r}; remove them")
    arch, continues = model.config.arch, model.config.arch in ("decoder", "prefix-lm")  # a prompt; else blanks
    if not continues and (cfg.batch or cfg.draft_dir):
        raise UsageError(f"an {arch} fills in blanks, one prompt at a time: leave out --batch and --draft_dir")
    if MASK not in prompt and not continues:
        raise UsageError(f"an {arch} fills in blanks: put {MASK} in --start where text is missing")
    draft = (load_draft(cfg.draft_dir, model, tok, device, cfg.quantize, cfg.ckpt, cfg.group_size)
             if cfg.draft_dir else None)
    refusals(cfg, model, draft)
    if draft is not None:  # each mode: (model, tok, prompt, cfg, device) -> Result
        mode = partial(speculate, draft=draft)
    elif cfg.batch or continues:
        mode = continue_batch if cfg.batch else continue_text
    else:
        fill = reconstruct if ckpt.get("train_config", {}).get("objective") == "bart" else fill_spans
        mode = partial({"encoder": fill_masks, "encoder-decoder": fill}[arch], special=ckpt["tokens"])
    prompt_len = continues and len(tok.encode(prompt, special=True))  # (a batch file's: all its lines)
    pays = continues and compile_pays(model, device, cfg.max_new_tokens, cfg.num_samples, prompt_len)
    cfg = replace(cfg, compile=draft is None and (pays if cfg.compile is None else cfg.compile))  # a draft: eager
    if cfg.compile:  # compiled (or read back from inductor's cache) before the timing: tokens/s is the step's
        with autocast, contextlib.redirect_stdout(io.StringIO()), stopping_after(3):  # the run's shapes, 2 steps
            dt = timed(lambda: mode(model, tok, prompt, cfg, device), device)[1]
        print(f"sample.py: compiled the decode step in {dt:.1f} s", file=sys.stderr)
    torch.manual_seed(cfg.seed)
    with autocast:
        results, dt = timed(lambda: [mode(model, tok, prompt, cfg, device) for _ in range(cfg.num_samples)], device)
    n_tokens, accepted, proposed = (sum(getattr(r, k) for r in results) for k in ("tokens", "accepted", "proposed"))
    n_q, path = sum(isinstance(m, QUANTIZED) for m in model.modules()), "compiled step" if cfg.compile else "eager"
    print(f"sample.py: {n_tokens:,} tokens in {dt:.2f} s, {n_tokens / dt:,.1f} tokens/s ({arch}, {device}, "
          f"{precision_name(model.wte.weight.dtype, dtype)}{f', {n_q} Linear layers in {cfg.quantize}' if n_q else ''}, {path})"
          + (f"; draft tokens accepted {accepted}/{proposed} ({accepted / max(proposed, 1):.1%}, k={cfg.draft_k})"
             if cfg.draft_dir else ""), file=sys.stderr)
    if cfg.attention_page:
        write_attention(cfg.attention_page, model, tok, results[0].seqs[0], cfg.attention_tokens)
        print(f"sample.py: attention weights of the first sample in {cfg.attention_page}", file=sys.stderr)
    return 0


write = partial(print, end="", flush=True)  # the sample streams as it is made


def read_prompt(start):
    """--start's text with its escapes read as Python reads them ('ROMEO:\\n' ends in a newline), or
    the text of the file FILE:path names, as it is."""
    if not start.startswith("FILE:"):
        try:  # non-ASCII characters pass through as themselves
            return start.encode("latin-1", "backslashreplace").decode("unicode_escape")
        except UnicodeDecodeError as e:
            raise UsageError(f"--start has a broken escape ({e.reason}): write \\\\ for a backslash") from None
    return read_text_file(start[5:], "prompt file", ": check the path after FILE:")


def encode_prompt(model, tok, prompt):
    ids = tok.encode(prompt, special=True)
    if not ids:
        raise UsageError("the prompt is empty: give --start some text (the default is a newline)")
    block = model.config.block_size
    if absolute_positions(model.config) and len(ids) > block:  # relative positions slide a window over it instead
        print(f"sample.py: the prompt is {len(ids)} tokens, longer than the {block} positions this model "
              f"knows: it sees the last {block}", file=sys.stderr)
    return ids


# ----------------------------------------------------------------------------------------------
# Decoders: continue the prompt

def continue_text(model, tok, prompt, cfg, device):
    ids = encode_prompt(model, tok, prompt)
    write(prompt)
    text = tok.streamer(ids)
    for t in generate_tokens(model, torch.tensor([ids], device=device), cfg.max_new_tokens, cfg.temperature,
                             cfg.top_k, cfg.top_p, vocab_limit=tok.vocab_size, compile=cfg.compile):
        t = t.item()  # printing as we go needs the token on the host
        ids.append(t)
        write(text(t))
    write(text(None) + SEP)
    return Result(cfg.max_new_tokens, [dict(idx=ids, prefix=len(ids) - cfg.max_new_tokens)])  # the prompt's length


def continue_batch(model, tok, prompts, cfg, device):
    """Every line of the prompt file in one batch: left-padded, each row masked and counting its
    positions from its first token, so that it decodes as it would alone."""
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
    out = generate(model, idx, cfg.max_new_tokens, cfg.temperature, cfg.top_k, cfg.top_p, vocab_limit=tok.vocab_size,
                   mask=mask, compile=cfg.compile)[:, T:].tolist()
    for line, row, new in zip(lines, rows, out):  # the text after the prompt's, as a streamer shows it
        text = tok.streamer(row)
        write(line + "".join(map(text, new)) + text(None) + SEP)
    return Result(len(rows) * cfg.max_new_tokens, [dict(idx=row + new, prefix=len(row)) for row, new in zip(rows, out)])


def load_draft(draft_dir, model, tok, device, quantize="", which="best", group_size=128):
    """The run in draft_dir, ready to draft for model (a decoder of the same vocabulary), in its dtype."""
    draft, draft_tok, _ = load_model(draft_dir, device, model.wte.weight.dtype, quantize, which, group_size)
    vocab = lambda t: (t.kind, t.vocab_size, getattr(t, "chars", None))  # noqa: E731
    if draft.config.arch != "decoder" or vocab(draft_tok) != vocab(tok):
        what = f"an {draft.config.arch}" if draft.config.arch != "decoder" else "a decoder of another vocabulary"
        raise UsageError(f"the model in {draft_dir} is {what}: give --draft_dir a small decoder trained on the "
                         "same dataset as the target")
    return decode_layout(draft)


def speculate(model, tok, prompt, cfg, device, draft):
    """The draft proposes --draft_k tokens, the target keeps those it agrees with (bench.py sample times it)."""
    idx = torch.tensor([encode_prompt(model, tok, prompt)], device=device)
    out, accepted, proposed = speculative_generate(model, draft, idx, cfg.max_new_tokens, cfg.draft_k, cfg.temperature,
                                                   cfg.top_k, cfg.top_p, tok.vocab_size)
    write(tok.decode(out[0].tolist()) + SEP)
    return Result(cfg.max_new_tokens, [dict(idx=out[0].tolist())], accepted, proposed)


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


def fill_masks(model, tok, prompt, cfg, device, special):
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
    write(SEP)
    return Result(len(holes), [dict(idx=x[0].tolist())])


def fill_spans(model, tok, prompt, cfg, device, special):
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
    for t in generate_tokens(model, torch.tensor([out], device=device), cfg.max_new_tokens, cfg.temperature,
                             cfg.top_k, cfg.top_p, src=torch.tensor([ids], device=device),
                             vocab_limit=max(tok.vocab_size, max(sentinels) + 1), compile=cfg.compile):
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
    write(text(None) + "".join(pieces[shown + 1:]) + SEP)  # then the text after spans the model did not close
    return Result(len(out) - 1, [dict(idx=out, src=ids)])


def reconstruct(model, tok, prompt, cfg, device, special):
    """BART: each [MASK] becomes the mask token; the decoder writes the whole text from its start token
    until it ends as the prompt does, at the prompt's length or more (or --max_new_tokens tokens)."""
    ids, _, pieces = blanks(model, tok, prompt, lambda k: special["mask"])
    out, text, written = [special["start"]], tok.streamer(), ""
    for t in generate_tokens(model, torch.tensor([out], device=device), cfg.max_new_tokens, cfg.temperature,
                             cfg.top_k, cfg.top_p, src=torch.tensor([ids], device=device), vocab_limit=tok.vocab_size,
                             compile=cfg.compile):
        out.append(t.item())
        write(new := text(out[-1]))
        if pieces[-1] and len(written := written + new) >= len("".join(pieces)) and written.endswith(pieces[-1]):
            break
    write(text(None) + SEP)
    return Result(len(out) - 1, [dict(idx=out, src=ids)])


if __name__ == "__main__":
    run_script(main, "sample.py", "give fewer prompts at once (lines of a --batch file), a shorter prompt, or "
               "smaller weights (--dtype=bfloat16, --quantize=int8)")
