"""
Watching a run. train.py hands each log line and each evaluation to a Report (on rank 0), which
- appends it to out_dir/metrics.jsonl, one JSON object per line;
- sends the same numbers to wandb, with --wandb_log=True (wandb is an optional import);
- at each evaluation rewrites out_dir/report.html: the curves, the settings and a short greedy
  sample on one self-contained page (inline SVG: no script, no network), which someone copies off
  a remote machine and opens.
A resumed run keeps one history: the lines past the iteration it resumes from go first.
"""

import html
import json
import math
import os
import sys
import time
from dataclasses import asdict

import numpy as np
import torch

from common import UsageError, write_atomic
from data import span_corrupt
from distributed import sharded
from generate import generate
from tokenizer import Tokenizer

SAMPLE_PROMPT, SAMPLE_NEW = 32, 128  # the page's sample: tokens of val data it starts from, tokens it adds
COLORS = ("#9ab", "#1f77b4", "#d62728", "#2ca02c")


def hms(seconds):
    """98462.5 -> '27:21:02': hours, minutes and seconds, the hours past 24 if need be."""
    m, s = divmod(int(seconds), 60)
    return f"{m // 60}:{m % 60:02d}:{s:02d}"


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
            self.tokenizer = Tokenizer(run.meta)
        except UsageError as e:
            self.tokenizer = f"(no sample: {e})"
            print(f"report.html will show no samples: {e}", file=sys.stderr)
        n_params = sum(p.numel() for p in run.raw_model.parameters())
        self.what = (f"{c.arch} (pos={c.pos}, norm={c.norm}, mlp={c.mlp}{f', {c.n_expert} experts' if c.n_expert else ''})"
                     f" &middot; {c.n_layer} layers, {c.n_head} heads, {c.n_embd} wide, context {c.block_size} &middot; "
                     f"{n_params / 1e6:.2f}M parameters &middot; {tokens_per_iter:,} tokens per iteration &middot; "
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
        self.add(it, train_loss=losses["train"], val_loss=losses["val"])
        if sharded(self.run.raw_model):  # rank 0 alone would wait for the others to gather each weight
            pieces = [("(none under --fsdp=True, where rank 0 holds a slice of each weight: sample.py samples "
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
        svgs = [chart(title, s, self.tokens_per_iter) for title, s in charts if any(points for _, points in s)]
        last, best = recs[-1], min(r["val_loss"] for r in evals)
        sample = "".join(f"<mark>{html.escape(t)}</mark>" if ours else html.escape(t) for t, ours in pieces)
        settings = [(name, asdict(obj)) for name, obj in (("training", cfg), ("model", self.run.raw_model.config))]
        tables = "".join(f"<table><tr><th colspan=2>{name}</th></tr>" + "".join(
            f"<tr><td>{k}</td><td>{html.escape(repr(v))}</td></tr>" for k, v in d.items()) + "</table>"
            for name, d in settings)
        return PAGE.format(
            title=html.escape(f"{cfg.out_dir}: iteration {last['iter']}"), out_dir=html.escape(cfg.out_dir),
            what=self.what, newest=f"iteration {last['iter']:,} of {cfg.max_iters:,}, {hms(last['elapsed'])} into the run "
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
    """A tick label: 12,000,000 -> '12M', 0.0003 -> '0.0003'."""
    for div, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(v) >= div:
            return f"{v / div:g}{unit}"
    return f"{v:.4g}"


def chart(title, series, tokens_per_iter, W=600, H=250, left=60, right=30, top=28, bottom=46):
    """One SVG line chart of series [(name, [(iteration, value)])] against iterations, the tokens
    seen under each iteration tick. Each series is one polyline, one point per record."""
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
                   f'<text x="{sx(v):.1f}" y="{H - bottom + 15}" text-anchor="middle">{short(v)}</text>'
                   f'<text x="{sx(v):.1f}" y="{H - bottom + 29}" text-anchor="middle" class="tokens">'
                   f'{short(v * tokens_per_iter)}</text>')
    out.append(f'<text x="{W - right}" y="{H - 4}" text-anchor="end" class="tokens">iterations (tokens)</text>')
    legend_x = W - right  # the legend: one row at the top, right-aligned
    for k, (name, s) in reversed(list(enumerate(series))):
        color, xy = COLORS[k if len(series) > 1 else 1], [(sx(x), sy(y)) for x, y in s if math.isfinite(y)]
        out.append(f'<polyline data-series="{html.escape(name)}" fill="none" stroke="{color}" stroke-width="1.5" '
                   f'points="{" ".join(f"{a:.1f},{b:.1f}" for a, b in xy)}"/>')
        out += [f'<circle cx="{a:.1f}" cy="{b:.1f}" r="2.5" fill="{color}"/>' for a, b in xy if len(s) <= 60]
        out.append(f'<text x="{legend_x}" y="16" text-anchor="end" fill="{color}">{html.escape(name)}</text>')
        legend_x -= 6 * len(name) + 14
    return "\n".join(out + ["</svg>"])


PAGE = """<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>{title}</title>
<style>
body {{ font: 14px system-ui, sans-serif; margin: 24px; color: #222; max-width: 1320px; }}
h1 {{ font-size: 20px; margin: 0 0 6px; }} p {{ margin: 4px 0; }}
.charts {{ display: flex; flex-wrap: wrap; gap: 8px; margin: 16px 0; }}
svg.chart {{ border: 1px solid #ddd; background: #fff; font-size: 11px; }}
svg .title {{ font-size: 13px; font-weight: 600; }} svg .grid {{ stroke: #eee; }} svg .tokens {{ fill: #888; }}
pre {{ white-space: pre-wrap; background: #f6f6f6; padding: 10px; border: 1px solid #ddd; }}
mark {{ background: #d6ecff; }}
table {{ display: inline-table; vertical-align: top; border-collapse: collapse; margin: 0 16px 16px 0; }}
td, th {{ padding: 1px 8px; border-bottom: 1px solid #eee; text-align: left; font-family: monospace; }}
</style></head><body>
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
