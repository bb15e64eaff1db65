"""
Sample from a trained model; the text streams to stdout as it is generated.

    python sample.py --out_dir=out-shakespeare-char --start="ROMEO:" --num_samples=3 \\
        --max_new_tokens=500 --temperature=0.8 --top_k=200 --seed=1337
    python sample.py --out_dir=out-shakespeare-char --start=FILE:prompt.txt
    python sample.py --out_dir=out-shakespeare-char --start=FILE:prompts.txt --batch   # one per line
    python sample.py --out_dir=out-shakespeare-char --draft_dir=out-small              # speculative
    python sample.py --out_dir=out-shakespeare-char --quantize=int8 --attention=attn.html
    python sample.py --out_dir=out-shakespeare-char-bert --start="To be, or not to be: [MASK][MASK][MASK][MASK] is the question"
    python sample.py --bench                                                            # decoding speed

A decoder continues the prompt. An encoder (masked LM) fills each [MASK] with one token; an
encoder-decoder (span corruption) fills each [MASK] with a span of any length.
"""

import codecs
import copy
import html
import json
import os
import signal
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, fields

# Ctrl-C while torch loads or the text streams out ends sampling quietly: status 130, no traceback;
# so does a reader that stops early (`| head`), as for any Unix tool (status 141, SIGPIPE)
if __name__ == "__main__":
    signal.signal(signal.SIGINT, lambda signum, frame: sys.exit(128 + signum))
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)

import numpy as np
import torch

import kernels
from model import Int8Linear, ModelConfig, Transformer, quantize_int8, sample, speculative_generate
from prepare import PrepareError, Tokenizer
from train import (TrainConfig, UsageError, batch_rng, get_batch, load_checkpoint, out_of_memory, parse_settings,
                   pick_device, pick_dtype, timed, usage)

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
    dtype: str = "auto"  # bf16 on GPUs that have it (weights cast once), fp16 (under autocast), fp32 on the CPU
    compile: bool = False  # torch.compile the one-token decoding step
    batch: bool = False  # with --start=FILE:..., continue every line of the file, all in one batch
    draft_dir: str = ""  # out_dir of a small model that drafts tokens for speculative decoding
    draft_k: int = 4  # tokens the draft proposes per step
    quantize: str = ""  # "int8": weight-only int8 for every Linear layer
    attention: str = ""  # write the first sample's attention weights to this HTML file
    attention_tokens: int = 128  # ...for at most this many (the last) tokens
    bench: bool = False  # measure decoding speed on a GPT-2-124M-shaped model, then exit


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
    if cfg.quantize not in ("", "int8"):
        raise UsageError(f"quantize={cfg.quantize!r} is not known: use int8 (or leave it out)")
    if cfg.draft_k < 1:
        raise UsageError(f"draft_k={cfg.draft_k} must be at least 1")
    if cfg.batch and not cfg.start.startswith("FILE:"):
        raise UsageError("--batch takes its prompts from a file, one per line: --start=FILE:prompts.txt")
    for key in ("num_samples", "attention_tokens"):
        if getattr(cfg, key) < 1:
            raise UsageError(f"{key}={getattr(cfg, key)} must be at least 1")
    if not 0 <= cfg.seed < 2**63:
        raise UsageError(f"seed={cfg.seed} must lie in [0, 2**63)")
    if cfg.attention and (os.path.isdir(cfg.attention) or not os.path.isdir(os.path.dirname(cfg.attention) or ".")):
        raise UsageError(f"--attention={cfg.attention} is not a file in an existing folder: "
                         "give a path such as attn.html")  # found out now, not after sampling


def precision(dtype, device):
    """The dtype to hold the weights in, and the autocast context to sample under. bf16 weights are
    cast once, as gpt-fast does: under autocast a compiled decode step casts every fp32 weight
    again at each token (autocast's cache of casts stays outside compiled graphs), and an eager one
    keeps a bf16 copy beside each. fp16 keeps fp32 weights and autocast, whose residual stream stays
    fp32: fp16's narrow range is known to overflow in some models' activations (T5's)."""
    if dtype == torch.float16:
        return torch.float32, torch.autocast(device.type, dtype=dtype)
    return dtype, nullcontext()


def precision_name(weights, dtype):
    """How sample.py runs: "bfloat16 weights", "float32 weights under float16 autocast"."""
    autocast = " under float16 autocast" if dtype == torch.float16 else ""
    return str(weights).replace("torch.", "") + " weights" + autocast


def load(out_dir, which, device, dtype=torch.float32, quantize=""):
    """The model (its weights in dtype; its Linear layers in int8 with quantize="int8"), its
    tokenizer and its special tokens from out_dir."""
    path = {"best": os.path.join(out_dir, "best.pt"), "latest": os.path.join(out_dir, "ckpt.pt")}
    if which == "best" and not os.path.exists(path["best"]):
        which = "latest"
    other = "latest" if which == "best" else "best"
    # read into host memory: on the device, the optimizer's state would stay beside the model
    ckpt = load_checkpoint(path[which], "cpu", f"try --ckpt={other}" if os.path.exists(path[other]) else None)
    config = ModelConfig(**ckpt["model_config"])
    if config.attn_impl == "triton" and device.type != "cuda":  # trained through the kernel on a GPU:
        config.attn_impl = "auto"  # the same attention, through torch's SDPA here
    model = Transformer(config)
    model.load_state_dict(ckpt["model"])
    if quantize == "int8":
        quantize_int8(model)  # from the fp32 weights: one rounding, not two
    return model.to(device=device, dtype=dtype).eval(), Tokenizer(ckpt["meta"]), ckpt


def main(argv):
    known = {f.name: ("sample", f.type) for f in fields(SampleConfig)}
    if {"-h", "--help"} & set(argv):
        print(usage(__doc__, (SampleConfig,), known))
        return 0
    cfg = SampleConfig(**parse_settings(argv, known, "SampleConfig in sample.py"))
    check(cfg)
    device = pick_device(cfg.device)
    dtype = pick_dtype(cfg.dtype, device)
    # softmax tails leave tiny (denormal) floats that x86 CPUs handle 30x slower: round them to 0
    torch.set_flush_denormal(True)
    if cfg.bench:
        bench(ModelConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768),
              device, dtype, cfg.compile)
        if os.path.exists(os.path.join(cfg.out_dir, "ckpt.pt")):
            int8_quality(cfg.out_dir, device)
        return 0
    weights, autocast = precision(dtype, device)
    model, tok, ckpt = load(cfg.out_dir, cfg.ckpt, device, weights, cfg.quantize)
    special = ckpt["tokens"]
    if cfg.compile:
        compile_decode(model, device)
    prompt = read_prompt(cfg.start)
    unknown = tok.unknown(prompt.replace(MASK, ""))
    if unknown:
        raise UsageError(f"the prompt has characters the model's vocabulary lacks: {''.join(unknown)!r}; "
                         "remove or replace them")
    torch.manual_seed(cfg.seed)
    arch = model.config.arch
    if MASK not in prompt and arch != "decoder":
        raise UsageError(f"an {arch} fills in blanks: put {MASK} in --start where text is missing")
    write = lambda s: (sys.stdout.write(s), sys.stdout.flush())  # noqa: E731
    with autocast:
        if cfg.draft_dir:
            return speculate(model, tok, prompt, cfg, device, write)
        if cfg.batch:
            n_tokens, dt, picture = continue_batch(model, tok, prompt, cfg, device, write)
        else:
            run = {"decoder": continue_text, "encoder": fill_masks, "encoder-decoder": fill_spans}[arch]
            n_tokens, t0, picture = 0, time.time(), None
            for _ in range(cfg.num_samples):
                n, ids = run(model, tok, special, prompt, cfg, device, write)
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


def text_of(tok):
    """A function from one token id to the text it completes (BPE tokens may split a character)."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    return lambda i: decoder.decode(tok.decode_bytes([i])) if i < tok.vocab_size else ""


def encode_prompt(model, tok, prompt):
    ids = tok.encode(prompt)
    if not ids:
        raise UsageError("the prompt is empty: give --start some text (the default is a newline)")
    block = model.config.block_size
    if model.absolute_positions and len(ids) > block:  # relative positions slide a window over it instead
        print(f"sample.py: the prompt is {len(ids)} tokens, longer than the {block} positions this model "
              f"knows: it sees the last {block}", file=sys.stderr)
    return ids


# ----------------------------------------------------------------------------------------------
# Decoders: continue the prompt

def continue_text(model, tok, special, prompt, cfg, device, write):
    ids = encode_prompt(model, tok, prompt)
    write(prompt)
    text = text_of(tok)
    for t in model.generate_tokens(torch.tensor([ids], device=device), cfg.max_new_tokens, cfg.temperature,
                                   cfg.top_k, cfg.top_p, vocab_limit=tok.vocab_size):
        t = t.item()  # printing as we go needs the token on the host
        ids.append(t)
        write(text(t))
    return cfg.max_new_tokens, dict(idx=ids)


def continue_batch(model, tok, prompts, cfg, device, write):
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
    for line, new in zip(lines, out):
        write(line + tok.decode(new) + "\n---------------\n")
    return len(rows) * cfg.max_new_tokens, dt, dict(idx=rows[0] + out[0])


def speculate(model, tok, prompt, cfg, device, write):
    """Speculative decoding with the draft in --draft_dir, timed against the target alone."""
    draft, draft_tok, draft_ckpt = load(cfg.draft_dir, cfg.ckpt, device, model.wte.weight.dtype, cfg.quantize)
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
    n = cfg.num_samples * cfg.max_new_tokens
    rate = {k: n / v for k, v in times.items()}
    print(f"sample.py: draft tokens accepted {accepted}/{proposed} ({accepted / max(proposed, 1):.1%}); "
          f"speculative {rate['speculative']:,.1f} tokens/s, target alone {rate['target alone']:,.1f} tokens/s: "
          f"{rate['speculative'] / rate['target alone']:.2f}x (k={cfg.draft_k})", file=sys.stderr)
    return 0


# ----------------------------------------------------------------------------------------------
# Encoders and encoder-decoders: fill the blanks

def check_fits(model, ids):
    """An encoder reads its whole text at once: with learned positions it must fit the table."""
    try:
        model.check_length(len(ids))
    except ValueError:
        raise UsageError(f"the text is {len(ids)} tokens, longer than the model's block_size="
                         f"{model.config.block_size}: shorten it") from None


def fill_masks(model, tok, special, prompt, cfg, device, write):
    """Masked LM: fill the masks left to right, each seeing the ones filled before it."""
    pieces = prompt.split(MASK)
    ids, holes = [], []
    for i, piece in enumerate(pieces):
        ids += tok.encode(piece)
        if i < len(pieces) - 1:
            holes.append(len(ids))
            ids.append(special["mask"])
    check_fits(model, ids)
    x = torch.tensor([ids], device=device)
    text = text_of(tok)
    write(pieces[0])
    for hole, piece in zip(holes, pieces[1:]):
        with torch.no_grad():
            logits = model(x)[0][:, hole, : tok.vocab_size]  # only real tokens may fill a hole
        x[0, hole] = sample(logits, cfg.temperature, cfg.top_k, cfg.top_p)[0, 0]
        write(text(x[0, hole].item()) + piece)
    return len(holes), dict(idx=x[0].tolist())


def fill_spans(model, tok, special, prompt, cfg, device, write):
    """Span corruption: each [MASK] becomes a sentinel; the decoder writes sentinel k followed
    by span k, and sentinel n after the last of the n spans."""
    pieces = prompt.split(MASK)
    first = special["sentinel"]
    if len(pieces) > special["n_sentinel"]:  # n spans take n + 1 sentinels: the last one ends the output
        raise UsageError(f"the prompt has {len(pieces) - 1} {MASK}s; this model fills at most "
                         f"{special['n_sentinel'] - 1} spans: use fewer")
    ids = []
    for i, piece in enumerate(pieces):
        ids += tok.encode(piece)
        if i < len(pieces) - 1:
            ids.append(first + i)
    check_fits(model, ids)
    src = torch.tensor([ids], device=device)
    out = [special["start"]]
    text = text_of(tok)
    write(pieces[0])
    shown = 0  # pieces written after the first
    limit = first + special["n_sentinel"]  # text and sentinels, no padding
    for t in model.generate_tokens(torch.tensor([out], device=device), cfg.max_new_tokens, cfg.temperature,
                                   cfg.top_k, cfg.top_p, src=src, vocab_limit=limit):
        t = t.item()
        out.append(t)
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
    return len(out) - 1, dict(idx=out, src=ids)


# ----------------------------------------------------------------------------------------------
# Attention pictures

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
    """A self-contained HTML page with every layer's and head's attention weights as heatmaps."""
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
    with open(path, "w", encoding="utf-8") as f:
        f.write(ATTENTION_PAGE.replace("/*DATA*/", data).replace("TITLE", html.escape(os.path.basename(path))))


ATTENTION_PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>TITLE</title>
<style>
body { font: 14px system-ui, sans-serif; margin: 20px; color: #222; }
label { margin-right: 14px; }
#info { margin: 10px 0; font-family: monospace; min-height: 1.2em; }
#map { display: grid; width: max-content; }
.cell { width: 14px; height: 14px; }
.cell:hover { outline: 1px solid #000; }
.q, .k { font: 11px monospace; white-space: pre; color: #555; }
.q { text-align: right; padding-right: 4px; line-height: 14px; }
.k { writing-mode: vertical-rl; transform: rotate(180deg); height: 56px; width: 14px; overflow: hidden; }
</style></head><body>
<h2>Attention weights</h2>
<p>Rows are queries, columns keys; darker means more weight. Hover a square for its exact weight.</p>
<label>attention <select id="kind"></select></label>
<label>layer <select id="layer"></select></label>
<label>head <select id="head"></select></label>
<div id="info"></div>
<div id="map"></div>
<script>
const DATA = /*DATA*/;
const $ = (id) => document.getElementById(id);
const show = (s) => s.replace(/\\n/g, "\\u23ce").replace(/ /g, "\\u00b7");
function options(select, n, label) {
  const keep = Math.min(select.selectedIndex, n - 1);
  select.innerHTML = "";
  for (let i = 0; i < n; i++) select.add(new Option(label(i), i));
  select.selectedIndex = Math.max(keep, 0);
}
function render() {
  const kind = DATA.kinds[$("kind").selectedIndex];
  options($("layer"), kind.weights.length, (i) => "layer " + i);
  options($("head"), kind.weights[0].length, (i) => "head " + i);
  const w = kind.weights[$("layer").selectedIndex][$("head").selectedIndex];
  const map = $("map");
  map.innerHTML = "";
  map.style.gridTemplateColumns = "auto repeat(" + kind.keys.length + ", 14px)";
  map.appendChild(document.createElement("div"));
  for (const k of kind.keys) {
    const d = document.createElement("div"); d.className = "k"; d.textContent = show(k); map.appendChild(d);
  }
  kind.queries.forEach((q, i) => {
    const d = document.createElement("div"); d.className = "q"; d.textContent = show(q); map.appendChild(d);
    kind.keys.forEach((k, j) => {
      const c = document.createElement("div");
      const v = w[i][j] / 1e4;
      c.className = "cell";
      c.style.background = "rgba(30, 70, 200, " + Math.sqrt(v) + ")";
      c.title = show(q) + " (" + i + ") \\u2192 " + show(k) + " (" + j + "): " + v.toFixed(4);
      c.onmouseenter = () => { $("info").textContent = c.title; };
      map.appendChild(c);
    });
  });
}
DATA.kinds.forEach((k, i) => $("kind").add(new Option(k.name, i)));
for (const id of ["kind", "layer", "head"]) $(id).onchange = render;
render();
</script></body></html>
"""


# ----------------------------------------------------------------------------------------------
# Benchmark: python sample.py --bench

def floor_seconds(model, x_dtype, reps=5):
    """The time of the model's matrix-vector products alone at batch 1: every weight once, through
    the product the model uses (kernels.linear), about what one decoded token must cost at least."""
    layers = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    dev = layers[0].weight.device
    xs = {m.in_features: torch.randn(1, m.in_features, device=dev, dtype=x_dtype) for m in layers}
    products = lambda: [kernels.linear(xs[m.in_features], m.weight.to(x_dtype), None, m.config.linear_impl)  # noqa: E731
                        for m in layers]
    return min(timed(products, dev)[1] for _ in range(reps))


def no_cache_generate(model, idx, n):
    """nanoGPT's generate: every step recomputes the whole (cropped) sequence; sampling included."""
    for _ in range(n):
        logits = model(idx[:, -model.config.block_size:])[0][:, -1]
        idx = torch.cat((idx, sample(logits, 1.0, 200)), dim=1)
    return idx


def compile_decode(model, device):
    """Compile the one-token decoding step: one static graph per cache size (sizes come in steps
    of 256), replayed as a CUDA graph on a GPU, plain inductor code elsewhere."""
    model.decode = torch.compile(model.decode, dynamic=False, mode="reduce-overhead" if device.type == "cuda" else None)


def bench(config, device, dtype, compile=False, news=(64, 256), prompt=16):
    """Tokens/s decoding at batch 1 with random weights: the KV cache, no cache, int8 weights and
    the matrix-vector floor, all measured here and now."""
    torch.manual_seed(0)
    weights, autocast = precision(dtype, device)  # as sample.py samples
    model = Transformer(config).to(device).eval()
    # int8 from the fp32 weights, as load() does; before compiling: a copy would keep the original's step
    int8 = quantize_int8(copy.deepcopy(model)).to(weights)
    model.to(weights)
    if compile:  # each cache size is compiled in the warm-up, not in the timings
        compile_decode(model, device)
        compile_decode(int8, device)
    idx = torch.randint(0, config.vocab_size, (1, prompt), device=device)
    floor = floor_seconds(model, dtype)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"decoding at batch 1: {n_params / 1e6:.1f}M parameters ({config.n_layer} layers, width "
          f"{config.n_embd}), {precision_name(weights, dtype)} on {device}, {prompt}-token prompt"
          f"{', compiled decode step' if compile else ''}")
    print(f"floor (every weight's product once): {floor * 1e3:.1f} ms/token = {1 / floor:.1f} tokens/s")
    linear = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    int8_bytes = sum(m.weight.numel() + m.scale.numel() * m.scale.element_size() for m in int8.modules()
                     if isinstance(m, Int8Linear))
    print(f"Linear weights: {sum(w.numel() * w.element_size() for w in linear) / 2**20:.1f} MiB, "
          f"int8: {int8_bytes / 2**20:.1f} MiB")
    with torch.no_grad(), autocast:
        full, small = model(idx)[0].float(), int8(idx)[0].float()
    print(f"int8 logits: max |difference| / max |logit| = {((full - small).abs().max() / full.abs().max()).item():.4f}")
    print(f"{'new tokens':>10} | {'KV cache':>14} | {'no cache':>14} | {'int8 + cache':>14} | "
          f"{'cache / no cache':>16} | {'ms/token / floor':>16}")
    with torch.no_grad(), autocast:
        for n in news if compile else (8,):  # warm up (and compile) outside the timings
            model.generate(idx, n)
            int8.generate(idx, n)
        no_cache_generate(model, idx, 2)
        for n in news:
            rates = {}
            for name, run in (("cache", lambda: model.generate(idx, n, top_k=200)),
                              ("no cache", lambda: no_cache_generate(model, idx, n)),
                              ("int8", lambda: int8.generate(idx, n, top_k=200))):
                rates[name] = n / timed(run, device)[1]
            print(f"{n:>10} | {rates['cache']:>7.1f} tok/s | {rates['no cache']:>7.1f} tok/s | "
                  f"{rates['int8']:>7.1f} tok/s | {rates['cache'] / rates['no cache']:>15.1f}x | "
                  f"{1 / rates['cache'] / floor:>15.2f}x")
    return 0


def int8_quality(out_dir, device, n_batches=50):
    """What int8 weights cost a trained model: its loss on the same validation batches before and
    after, and the largest logit difference."""
    model, _, ckpt = load(out_dir, "latest", device)
    cfg = ckpt["train_config"]
    data = np.memmap(os.path.join(cfg["data_dir"], cfg["dataset"], "val.bin"), dtype=ckpt["meta"]["dtype"], mode="r")
    batches = [get_batch(data, model.config.arch, 12, model.config.block_size, batch_rng(0, i), ckpt["tokens"],
                         ckpt["meta"]["vocab_size"], TrainConfig(**cfg)) for i in range(n_batches)]
    with torch.no_grad():
        full = [model(**{k: v.to(device) for k, v in b.items()}) for b in batches]
        quantize_int8(model)
        small = [model(**{k: v.to(device) for k, v in b.items()}) for b in batches]
    loss = [sum(out[1].item() for out in outs) / n_batches for outs in (full, small)]
    rel = max(((a[0] - b[0]).abs().max() / a[0].abs().max()).item() for a, b in zip(full, small))
    print(f"int8 on {out_dir} ({cfg['dataset']}, {n_batches} val batches of 12): loss {loss[0]:.4f} -> "
          f"{loss[1]:.4f} ({loss[1] - loss[0]:+.4f}); max |logit difference| / max |logit| = {rel:.4f}")


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except (UsageError, PrepareError, ValueError) as e:
        print(f"sample.py: error: {e}", file=sys.stderr)
        sys.exit(2)
    except (RuntimeError, MemoryError) as e:  # torch's allocators raise RuntimeErrors
        if (oom := out_of_memory(e)) is None:
            raise
        print(f"sample.py: error: {oom}: give fewer prompts at once (lines of a --batch file), a shorter prompt, "
              "or smaller weights (--dtype=bfloat16, --quantize=int8)", file=sys.stderr)
        sys.exit(2)
