"""
Watching a run. train.py hands each log line and each evaluation to a Report (on rank 0), which
- appends it to out_dir/metrics.jsonl, one JSON object per line;
- sends the same numbers to wandb, with --wandb_log=True (wandb is an optional import);
- at each evaluation rewrites out_dir/report.html: the curves, the settings and a short greedy
  sample on one self-contained page (inline SVG: no script, no network), which someone copies off
  a remote machine and opens.
A resumed run keeps one history: the lines past the iteration it resumes from go first.

python report.py compare OUT_DIR [OUT_DIR ...] --out=compare.html writes one such page comparing
runs: their val and train loss against time, tokens and FLOPs, one colour per run, and a table of
each run's member, the settings that differ between the runs, its speed and its best val loss. Runs
of different objectives (next token, masked LM, span corruption, BART denoising) have losses that do
not compare: each objective has its own section.
"""

import html
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, fields

import numpy as np
import torch

from common import UsageError, check_ranges, flag_meant, owners, parse_settings, usage, write_atomic
from data import span_corrupt
from device import run_script
from distributed import sharded
from generate import generate
from model import ModelConfig, Transformer
from tokenizer import Tokenizer

SAMPLE_PROMPT, SAMPLE_NEW = 32, 128  # the page's sample: tokens of val data it starts from, tokens it adds
COLORS = ("#9ab", "#1f77b4", "#d62728", "#2ca02c")
RUN_COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
              "#17becf")  # the compare page's: one per run (matplotlib's tab10), again from the first past ten


def hms(seconds):
    """98462.5 -> '27:21:02': hours, minutes and seconds, the hours past 24 if need be."""
    m, s = divmod(int(seconds), 60)
    return f"{m // 60}:{m % 60:02d}:{s:02d}"


def count(n):
    """1_234_567_890 -> '1.2B', 5_200_000 -> '5.2M', 640 -> '640': a number of tokens, short."""
    for div, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= div:
            return f"{n / div:.1f}{unit}"
    return str(n)


def log_line(it, loss, lr, dt, mfu, tokens_per_iter, max_iters):
    """train.py's line every log_interval: the loss, the learning rate, the pace (dt: seconds per
    iteration), the tokens seen of the run's total, and the time left at this pace."""
    return (f"iter {it}: loss {loss:.4f}, lr {lr:.2e}, {dt * 1000:.1f} ms/iter, {tokens_per_iter / dt:,.0f} tokens/s, "
            f"{f'mfu {mfu:.1%}, ' if mfu else ''}{count(it * tokens_per_iter)}/{count(max_iters * tokens_per_iter)} "
            f"tokens, {hms((max_iters - it) * dt)} left")


def member(c):
    """Which member of the family a ModelConfig is: 'decoder (pos=rope, norm=rmsnorm, mlp=swiglu)'."""
    extra = [f"{c.n_expert} experts"] * bool(c.n_expert) + [f"{c.attention} attention"] * (c.attention != "softmax")
    return f"{c.arch} (pos={c.pos}, norm={c.norm}, mlp={c.mlp}{''.join(', ' + e for e in extra)})"


def read_metrics(path):
    """The records of a metrics file, in order; a line cut short (a crash mid-write) is left out."""
    if not os.path.exists(path):
        return []
    records = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return records


def start_wandb(cfg, config):
    try:
        import wandb
    except ImportError:
        raise UsageError("--wandb_log=True needs the wandb package: pip install wandb, or leave out --wandb_log") from None
    try:  # its files go in out_dir/wandb, beside the run's own
        return wandb.init(project=cfg.wandb_project, name=cfg.wandb_run_name or None, dir=cfg.out_dir,
                          config=asdict(cfg) | {"model": asdict(config)})
    except wandb.errors.Error as e:  # not logged in, say
        raise UsageError(f"wandb did not start: {e} (or set WANDB_MODE=offline, or leave out --wandb_log)") from None


class Report:
    """The metrics file, wandb and the page of one run, which train.py's loop `add`s to."""

    def __init__(self, run, it, tokens_per_iter, dtype):
        cfg, c = run.cfg, run.raw_model.config
        self.run, self.tokens_per_iter = run, tokens_per_iter
        self.wandb = start_wandb(cfg, c) if cfg.wandb_log else None
        self.metrics, self.page = (os.path.join(cfg.out_dir, f) for f in ("metrics.jsonl", "report.html"))
        # one history: a resumed run drops the lines past its checkpoint, a new run starts afresh; both
        # rewrite the file at their first record (a run that fails before it leaves the file as it was)
        self.records = [r for r in read_metrics(self.metrics) if r["iter"] <= it] if cfg.init_from == "resume" else []
        self.rewrite = True
        self.t0 = time.time() - (self.records[-1]["elapsed"] if self.records else 0)  # elapsed goes on from there
        try:  # the page's samples need the tokenizer; training does not (an offline GPU machine lacks GPT-2's files)
            self.tokenizer = Tokenizer(run.meta) if "tokenizer" in run.meta else \
                f"(no sample: the model classifies {run.meta.get('kind', 'images')}; sample.py --image does)"
        except UsageError as e:
            self.tokenizer = f"(no sample: {e})"
            print(f"report.html will show no samples: {e}", file=sys.stderr)
        n_params = sum(p.numel() for p in run.raw_model.parameters())
        self.what = (f"{member(c)} &middot; {c.n_layer} layers, {c.n_head} heads, {c.n_embd} wide, "
                     f"context {c.block_size} &middot; {n_params / 1e6:.2f}M parameters &middot; "
                     f"{tokens_per_iter:,} tokens per iteration &middot; "
                     f"{run.world} &times; {run.device} ({str(dtype).removeprefix('torch.')})")

    def add(self, it, **numbers):
        """Record iteration it's numbers (a log line's, or an evaluation's) in the file and in wandb."""
        record = dict(iter=it, tokens=it * self.tokens_per_iter, elapsed=round(time.time() - self.t0, 3),
                      **{k: v for k, v in numbers.items() if v is not None})
        self.records.append(record)
        lines = self.records if self.rewrite else [record]
        self.write(self.metrics, "".join(json.dumps(r) + "\n" for r in lines), append=not self.rewrite)
        self.rewrite = False
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in record.items() if k != "iter"}, step=it)

    def evaluation(self, it, losses):
        """Record an evaluation, then rewrite the page with a greedy sample of the model as it is now."""
        self.add(it, train_loss=losses["train"], val_loss=losses["val"], val_acc=losses.get("val_acc"))
        if sharded(self.run.raw_model) or hasattr(self.run.raw_model, "whole_states"):  # (tp, pp: a part of it)
            pieces = [("(none under --fsdp=True, tp or pp, where rank 0 holds a part of the model: sample.py samples "
                       f"{self.run.cfg.out_dir}'s checkpoints)", False)]
        elif isinstance(self.tokenizer, str):
            pieces = [(self.tokenizer, False)]
        else:
            with self.run.autocast:
                pieces = greedy_sample(self.run.raw_model, self.run.data["val"], self.run.tokens, self.tokenizer)
        self.write(self.page, self.render(pieces))

    def write(self, path, text, append=False):
        """Append text to path, or replace the file whole (readers see the old page or the new one)."""
        try:
            if append:
                with open(path, "a", encoding="utf-8") as f:
                    f.write(text)
            else:
                write_atomic(path, text.encode())
        except OSError as e:  # a full disk, say: the checkpoints of this evaluation are written already
            raise UsageError(f"could not write {path} ({e.strerror}): free some space, then resume with "
                             "--init_from=resume") from None

    def render(self, pieces):
        cfg, recs = self.run.cfg, self.records
        steps, evals = [r for r in recs if "loss" in r], [r for r in recs if "val_loss" in r]
        series = lambda rows, key: [(r["iter"], r[key]) for r in rows if r.get(key) is not None]  # noqa: E731
        charts = [("loss", [("train loss (each log line)", series(steps, "loss")),
                            ("train loss (evaluation)", series(evals, "train_loss")),
                            ("val loss", series(evals, "val_loss"))]),
                  ("learning rate", [("lr", series(steps, "lr"))]),
                  ("tokens per second", [("tokens/s", series(steps, "tokens_per_s"))]),
                  ("model FLOPs utilization", [("MFU", series(steps, "mfu"))])]
        svgs = [chart(title, s, under=lambda v: short(v * self.tokens_per_iter)) for title, s in charts
                if any(points for _, points in s)]
        last, best = recs[-1], min(r["val_loss"] for r in evals)
        sample = "".join(f"<mark>{html.escape(t)}</mark>" if ours else html.escape(t) for t, ours in pieces)
        settings = [(name, asdict(obj)) for name, obj in (("training", cfg), ("model", self.run.raw_model.config))]
        tables = "".join(f"<table><tr><th colspan=2>{name}</th></tr>" + "".join(
            f"<tr><td>{k}</td><td>{html.escape(repr(v))}</td></tr>" for k, v in d.items()) + "</table>"
            for name, d in settings)
        return PAGE.format(
            style=STYLE, title=html.escape(f"{cfg.out_dir}: iteration {last['iter']}"),
            out_dir=html.escape(cfg.out_dir), what=self.what,
            newest=f"iteration {last['iter']:,} of {cfg.max_iters:,}, {hms(last['elapsed'])} into the run "
            f"({last['tokens']:,} tokens); page written {time.strftime('%Y-%m-%d %H:%M:%S %Z')}",
            losses=f"train loss {evals[-1]['train_loss']:.4f}, val loss {evals[-1]['val_loss']:.4f} "
            f"(best {best:.4f})", charts="\n".join(svgs), sample=sample, settings=tables)


@torch.no_grad()
def greedy_sample(model, val, tokens, tok):
    """A short greedy sample from the start of the val data, as [(text, written by the model)]: a
    decoder continues SAMPLE_PROMPT tokens by SAMPLE_NEW; an encoder fills every 7th token, masked;
    an encoder-decoder fills spans cut out as in training."""
    c, dev = model.config, model.wte.weight.device
    text = lambda ids: tok.decode([i for i in ids if i < tok.vocab_size])  # noqa: E731  (special tokens: none)
    x = torch.from_numpy(val[: min(c.block_size, SAMPLE_NEW)].astype(np.int64))[None].to(dev)  # (1, T)
    was_training = model.training
    model.eval()
    try:
        if c.arch in ("decoder", "prefix-lm"):  # a prompt continued
            p = min(SAMPLE_PROMPT, c.block_size)
            out = generate(model, x[:, :p], SAMPLE_NEW, temperature=0, vocab_limit=tok.vocab_size)[0].tolist()
            return [(text(out[:p]), False), (text(out[p:]), True)]
        if c.arch == "encoder":
            hidden = torch.arange(x.size(1), device=dev) % 7 == 3
            fill = model(torch.where(hidden, tokens["mask"], x))[0][0, :, : tok.vocab_size].argmax(-1)
            return [(text([f if h else t]), bool(h)) for t, f, h in zip(x[0].tolist(), fill.tolist(), hidden.tolist())]
        b = span_corrupt(x.cpu(), torch.Generator().manual_seed(0), tokens)
        src, step = b["src"][0].tolist(), tokens.get("sentinel_step", 1)
        sentinel = {tokens["sentinel"] + k * step: k for k in range(tokens["n_sentinel"])}
        out = generate(model, torch.tensor([[tokens["start"]]], device=dev), b["targets"].size(1), temperature=0,
                       src=b["src"].to(dev))[0, 1:].tolist()
        fills, k = {}, None  # span k: what the model writes after sentinel k
        for t in out:
            k = sentinel.get(t, k)
            if k is not None and t not in sentinel:
                fills.setdefault(k, []).append(t)
        return [(text(fills.get(sentinel[t], [])), True) if t in sentinel else (text([t]), False) for t in src]
    finally:
        model.train(was_training)


def ticks(lo, hi, n=5):
    """About n round values from lo to hi."""
    step = 10 ** math.floor(math.log10((hi - lo) / n))
    step *= next(m for m in (1, 2, 5, 10) if (hi - lo) / (step * m) <= n)
    return [k * step for k in range(math.ceil(lo / step), math.floor(hi / step) + 1)]


def short(v):
    """A tick label: 12,000,000 -> '12M', 3e18 -> '3E', 0.0003 -> '0.0003'."""
    for div, unit in ((1e18, "E"), (1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(v) >= div:
            return f"{v / div:g}{unit}"
    return f"{v:.4g}"


def legend(names, title, W, left, right):
    """Where each series' name goes in the legend at the top, as (its right end, its row), and the
    rows: the names in order, in rows aligned right, the first beside the title."""
    rows, width = [[]], 0
    for k, name in enumerate(names):
        room = W - right - left - (8 * len(title) + 10 if len(rows) == 1 else 0)
        if rows[-1] and width + 6 * len(name) > room:
            rows, width = rows + [[]], 0
        rows[-1].append(k)
        width += 6 * len(name) + 14
    at = {}
    for r, row in enumerate(rows):
        x = W - right
        for k in reversed(row):
            at[k], x = (x, r), x - 6 * len(names[k]) - 14
    return [at[k] for k in range(len(names))], len(rows)


def chart(title, series, x_label="iterations (tokens)", under=None, colors=None, W=600, H=250, left=60, right=30,
          top=28, bottom=46):
    """One SVG line chart of series [(name, [(x, value)])], x from 0 (iterations, tokens...), each series
    one polyline, one point per record; under: the text under each x tick (the tokens seen by an
    iteration), if any; colors: one per series (else the report's). The legend is at the top."""
    places, rows = legend([name for name, _ in series], title, W, left, right)
    top, H = top + 14 * (rows - 1), H + 14 * (rows - 1)
    pts = [(x, y) for _, s in series for x, y in s if math.isfinite(y)]
    x1 = max(1, max(x for x, _ in pts))
    y0, y1 = min(y for _, y in pts), max(y for _, y in pts)
    y0, y1 = (y0 - abs(y0) * 0.1 - 1e-12, y1 + abs(y1) * 0.1 + 1e-12) if y1 - y0 < 1e-9 * max(1, abs(y1)) else (y0, y1)
    sx = lambda x: left + x / x1 * (W - left - right)  # noqa: E731
    sy = lambda y: H - bottom - (y - y0) / (y1 - y0) * (H - top - bottom)  # noqa: E731
    out = [f'<svg class="chart" xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}">',
           f'<text x="{left}" y="16" class="title">{html.escape(title)}</text>']
    for v in ticks(y0, y1):
        out.append(f'<line x1="{left}" x2="{W - right}" y1="{sy(v):.1f}" y2="{sy(v):.1f}" class="grid"/>'
                   f'<text x="{left - 6}" y="{sy(v) + 4:.1f}" text-anchor="end">{short(v)}</text>')
    for v in ticks(0, x1):
        out.append(f'<line x1="{sx(v):.1f}" x2="{sx(v):.1f}" y1="{top}" y2="{H - bottom}" class="grid"/>'
                   f'<text x="{sx(v):.1f}" y="{H - bottom + 15}" text-anchor="middle">{short(v)}</text>')
        if under:
            out.append(f'<text x="{sx(v):.1f}" y="{H - bottom + 29}" text-anchor="middle" class="tokens">'
                       f'{under(v)}</text>')
    out.append(f'<text x="{W - right}" y="{H - 4}" text-anchor="end" class="tokens">{html.escape(x_label)}</text>')
    for k, (name, s) in reversed(list(enumerate(series))):  # the first series drawn last, on top
        color = colors[k] if colors else COLORS[k if len(series) > 1 else 1]
        xy = [(sx(x), sy(y)) for x, y in s if math.isfinite(y)]
        out.append(f'<polyline data-series="{html.escape(name)}" fill="none" stroke="{color}" stroke-width="1.5" '
                   f'points="{" ".join(f"{a:.1f},{b:.1f}" for a, b in xy)}"/>')
        out += [f'<circle cx="{a:.1f}" cy="{b:.1f}" r="2.5" fill="{color}"/>' for a, b in xy if len(s) <= 60]
        x, row = places[k]
        out.append(f'<text x="{x}" y="{16 + 14 * row}" text-anchor="end" fill="{color}">{html.escape(name)}</text>')
    return "\n".join(out + ["</svg>"])


STYLE = """
body { font: 14px system-ui, sans-serif; margin: 24px; color: #222; max-width: 1320px; }
h1 { font-size: 20px; margin: 0 0 6px; } p { margin: 4px 0; }
.charts { display: flex; flex-wrap: wrap; gap: 8px; margin: 16px 0; }
svg.chart { border: 1px solid #ddd; background: #fff; font-size: 11px; }
svg .title { font-size: 13px; font-weight: 600; } svg .grid { stroke: #eee; } svg .tokens { fill: #888; }
pre { white-space: pre-wrap; background: #f6f6f6; padding: 10px; border: 1px solid #ddd; }
mark { background: #d6ecff; }
table { display: inline-table; vertical-align: top; border-collapse: collapse; margin: 0 16px 16px 0; }
td, th { padding: 1px 8px; border-bottom: 1px solid #eee; text-align: left; font-family: monospace; }
td.n { text-align: right; } .wide { overflow-x: auto; } .wide td { white-space: nowrap; }
"""

PAGE = """<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>{title}</title>
<style>{style}</style></head><body>
<h1>nanoformer run: {out_dir}</h1>
<p>{what}</p>
<p>newest point: {newest}</p>
<p>last evaluation: {losses}</p>
<div class="charts">
{charts}
</div>
<h2>greedy sample at this evaluation <small>(highlighted: the model's)</small></h2>
<pre class="sample">{sample}</pre>
<h2>settings</h2>
{settings}
</body></html>
"""


# ----------------------------------------------------------------------------------------------
# Comparing runs: python report.py compare OUT_DIR [OUT_DIR ...] --out=compare.html

@dataclass
class CompareConfig:
    command: str = ""  # "compare": the first word; the runs' out_dirs follow it
    out: str = ""  # the page to write, such as compare.html (a file; one that exists is replaced)


# the objectives, whose losses do not compare with each other's: what each one's loss measures
OBJECTIVES = {"next token": "decoders and prefix LMs: the loss of each next token",
              "masked LM": "encoders: the loss of the masked tokens",
              "span corruption": "encoder-decoders, T5's objective: the loss of the spans cut out",
              "BART denoising": "encoder-decoders: the loss of the text rebuilt from its infilled, permuted sentences"}
MEMBER = ("arch", "pos", "norm", "mlp", "n_expert", "attention")  # the settings member() shows
WHERE = ("out_dir", "init_from", "wandb_log", "wandb_project", "wandb_run_name")  # where a run is, not what it is


def objective(arch, train_config):
    if arch in ("decoder", "prefix-lm"):
        return "next token"
    if arch == "encoder":
        return "masked LM"
    return "BART denoising" if train_config.get("objective") == "bart" else "span corruption"


def read_run(out_dir):
    """One run as the compare page sees it: its records, what its checkpoint (ckpt.pt, else best.pt)
    says, and numbers from both. Of the checkpoint only the settings are read: the weights stay on
    disk (mmap), and the model is built on the meta device, for its sizes alone."""
    metrics = os.path.join(out_dir, "metrics.jsonl")
    records = read_metrics(metrics)
    if not records:
        raise UsageError(f"{out_dir} has no {'records in ' if os.path.exists(metrics) else ''}metrics.jsonl: give "
                         "the out_dir of a run that train.py has started")
    path = next((p for p in (os.path.join(out_dir, n) for n in ("ckpt.pt", "best.pt")) if os.path.exists(p)), None)
    if path is None:
        raise UsageError(f"{out_dir} has no checkpoint (ckpt.pt or best.pt) to say what the run is: compare it after "
                         "its first evaluation")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        model_config, train_config = dict(ckpt["model_config"]), dict(ckpt.get("train_config") or {})
    except Exception as e:  # not a zip file, an object that would run code, not a checkpoint's dict
        raise UsageError(f"{path} is not a readable checkpoint ({type(e).__name__}): leave {out_dir} out") from None
    known = {f.name for f in fields(ModelConfig)}
    try:  # (settings that this model.py no longer has are left out, as checkpoint.py leaves them out)
        c = ModelConfig(**{k: v for k, v in model_config.items() if k in known})
    except (TypeError, ValueError) as e:
        raise UsageError(f"{path} holds a model this model.py cannot build ({e}): leave {out_dir} out") from None
    with torch.device("meta"):
        model = Transformer(c)
    speeds = [r["tokens_per_s"] for r in records if r.get("tokens_per_s") is not None]
    best = min((r for r in records if math.isfinite(r.get("val_loss", math.nan))), key=lambda r: r["val_loss"],
               default=None)
    return dict(dir=os.path.normpath(out_dir), records=records, config=c, settings=asdict(c) | train_config,
                kind=objective(c.arch, train_config), params=sum(p.numel() for p in model.parameters()),
                flops_per_token=model.flops_per_token(c.block_size),
                tokens_per_s=statistics.median(speeds) if speeds else None, best=best)


def differing(runs):
    """The settings (model, then training) whose values differ between the runs that have them (a
    run of an earlier version may lack a later setting), but those that say where a run is and those
    that its member says."""
    names = dict.fromkeys(k for r in runs for k in r["settings"] if k not in MEMBER + WHERE)
    return [k for k in names if len({repr(r["settings"][k]) for r in runs if k in r["settings"]}) > 1]


def duration(seconds):
    """'12.3 s' under a minute, else '1:02:05'."""
    return f"{seconds:.1f} s" if seconds < 60 else hms(seconds)


def run_table(runs, colors):
    """One row per run: which it is, the settings that differ, its size, speed and best val loss."""
    keys = differing(runs)
    head = ["run", "member", *keys, "parameters", "tokens/s", "best val loss", "time to it"]
    rows = []
    for r, color in zip(runs, colors):
        best, missing = r["best"], "&ndash;"
        cells = [f'<td><span style="color:{color}">&#9632;</span> {html.escape(r["dir"])}</td>',
                 f"<td>{html.escape(member(r['config']))}</td>"]
        cells += [f"<td>{html.escape(repr(r['settings'][k])) if k in r['settings'] else missing}</td>" for k in keys]
        cells += [f'<td class="n">{v}</td>' for v in (
            f"{r['params'] / 1e6:.2f}M", f"{r['tokens_per_s']:,.0f}" if r["tokens_per_s"] is not None else missing,
            f"{best['val_loss']:.4f}" if best else missing, duration(best["elapsed"]) if best else missing)]
        rows.append(f"<tr>{''.join(cells)}</tr>")
    return (f"<div class=wide><table><tr>{''.join(f'<th>{html.escape(h)}</th>' for h in head)}</tr>\n"
            + "\n".join(rows) + "</table></div>")


def section(kind, runs, colors):
    """One objective's runs: their table, then the val and the training loss against time, tokens and FLOPs."""
    longest = max(r["records"][-1]["elapsed"] for r in runs)
    unit, name = next((u, n) for u, n in ((3600, "hours"), (60, "minutes"), (1, "seconds")) if longest >= 3 * u
                      or u == 1)
    axes = [("time", f"time (elapsed, {name})", lambda r, rec: rec["elapsed"] / unit),
            ("tokens", "tokens", lambda r, rec: rec["tokens"]),
            ("FLOPs", "FLOPs (tokens x the model's training FLOPs per token)",
             lambda r, rec: rec["tokens"] * r["flops_per_token"])]
    svgs = []
    for axis, x_label, x in axes:
        for title, key in (("val loss", "val_loss"), ("train loss (each log line)", "loss")):
            series = [(r["dir"], [(x(r, rec), rec[key]) for rec in r["records"] if rec.get(key) is not None])
                      for r in runs]
            if any(math.isfinite(y) for _, points in series for _, y in points):
                svgs.append(chart(f"{title} by {axis}", series, x_label, colors=colors))
    return (f'<h2>{html.escape(kind)} <small>({html.escape(OBJECTIVES[kind])}): {len(runs)} '
            f'run{"s" * (len(runs) > 1)}</small></h2>\n{run_table(runs, colors)}\n<div class="charts">\n'
            + "\n".join(svgs) + "\n</div>")


def compare_page(runs, extra=""):
    """The page comparing runs (read_run's): one section per objective, one colour per run; extra: HTML
    put before the sections (a study's own charts)."""
    colors = [RUN_COLORS[k % len(RUN_COLORS)] for k in range(len(runs))]
    kinds = {}
    for k, r in enumerate(runs):
        kinds.setdefault(r["kind"], []).append(k)
    sections = [section(kind, [runs[k] for k in ks], [colors[k] for k in ks]) for kind, ks in kinds.items()]
    counts = "; ".join(f"{kind}: {len(ks)}" for kind, ks in kinds.items())
    return COMPARE_PAGE.format(
        style=STYLE, n=len(runs), written=time.strftime("%Y-%m-%d %H:%M:%S %Z"), extra=extra,
        sections="\n".join(sections),
        note=f"Runs of different objectives have losses that do not compare, so each objective has a section "
        f"of its own ({counts} run{'s' * (len(runs) > 1)}).")


COMPARE_PAGE = """<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>nanoformer: {n} runs compared</title>
<style>{style}</style></head><body>
<h1>nanoformer: {n} runs compared</h1>
<p>From each run's metrics.jsonl and checkpoint; page written {written}.</p>
<p>{note}</p>
{extra}{sections}
</body></html>
"""


def main(argv):
    if {"-h", "--help"} & set(argv):
        print(usage(__doc__, CompareConfig, files=False))
        return 0
    words, flags = [a for a in argv if not a.startswith("--")], [a for a in argv if a.startswith("--")]
    cfg = CompareConfig(**parse_settings(words[:1] + flags, CompareConfig, positional=("command",), files=False)[0])
    if cfg.command:
        check_ranges(cfg, dict(command=("compare",)))
    if len(words) < 2:
        raise UsageError("name the runs: python report.py compare OUT_DIR [OUT_DIR ...] --out=compare.html")
    for d in words[1:]:
        if meant := flag_meant(d, owners(CompareConfig)):
            raise UsageError(f"{d!r} is not a run's out_dir: did you mean {meant}?")
    if not cfg.out:
        raise UsageError("name the page to write: --out=compare.html")
    if os.path.isdir(cfg.out):
        raise UsageError(f"--out={cfg.out} is a directory{' (not empty)' if os.listdir(cfg.out) else ''}: give the "
                         f"page's file name, such as {os.path.join(cfg.out, 'compare.html')}")
    runs = [read_run(d) for d in words[1:]]
    try:
        write_atomic(cfg.out, compare_page(runs).encode())
    except OSError as e:
        raise UsageError(f"could not write {cfg.out} ({e.strerror or e}): choose another --out") from None
    print(f"report.py: {len(runs)} runs compared in {cfg.out}")
    return 0


if __name__ == "__main__":
    run_script(main, "report.py")
