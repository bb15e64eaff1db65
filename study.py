"""
Studies: many training runs under the same time budget, one after another, then one page of them.
bench.py dispatches them:

    python bench.py family --max_time=2m [--configs=a.py,b.py]   # the family, each member for 2 minutes
    python bench.py scaling --sizes=64,128,256 --max_time=1m     # a ladder of widths; L(N) and N_opt(C)

Each run is its own `python train.py CONFIG --max_time=T --out_dir=ROOT/NAME`, as a user would type
it (train.py fits its length to the time). A study stopped (Ctrl-C, a crash) and started again skips
the runs that finished, resumes a run cut short once its length was fitted, and starts afresh one
cut short before. ROOT/compare.html is report.py's compare page of the finished runs.
"""

import html
import math
import os
import shlex
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch

from common import UsageError, check_ranges, parse_settings, sizes, write_atomic
from data import load_data, new_model_config
from model import ModelConfig, Transformer
from optim import budget_seconds
from report import RUN_COLORS, chart, compare_page, duration, hms, member, read_metrics, read_run
from train import TRAIN_RANGES, TrainConfig

HERE = os.path.dirname(os.path.abspath(__file__))
# the family at equal time: every CPU member and attention variant in configs/. Left out: nanoGPT's
# GPU config (shakespeare_char.py), and the Llama member's recipes, shakespeare_char_fast.py and
# shakespeare_char_speedrun.py (another learning rate, optimizer or schedule, not another member):
# --configs adds them
FAMILY = tuple(f"shakespeare_char_{name}.py" for name in (
    "cpu", "llama", "alibi", "moe", "prefix", "xl", "linear", "performer", "lsh",  # next token
    "bert", "bert_linformer", "bert_bigbird",  # masked LM
    "t5", "bart"))  # span corruption, BART's denoising
SET_BY_STUDY = ("out_dir", "init_from", "max_time")  # each run's own: --train_args may not set them
FIT_POINTS = 100  # a fitted curve's points on a chart: past report.chart's 60, drawn as a line without dots


@dataclass
class FamilyConfig:
    configs: str = ""  # config files, comma-separated: --configs=a.py,b.py ("" = FAMILY in study.py)
    max_time: str = "2m"  # each run's budget, train.py's --max_time ("" = each config's max_iters)
    out_dir: str = "study-family"  # ROOT: each run in ROOT/<config's name>; compare.html and family.md
    train_args: str = ""  # more train.py settings for every run: --train_args="--device=cpu --seed=1"


@dataclass
class ScalingConfig:
    sizes: tuple | int = (64, 128, 256)  # the widths n_embd: --sizes=64,128,256 (n_head keeps the head size)
    config: str = "configs/shakespeare_char_cpu.py"  # the model and training every size starts from
    max_time: str = "1m"  # each run's budget, train.py's --max_time ("" = the config's max_iters)
    out_dir: str = "study-scaling"  # ROOT: each run in ROOT/n_embd-<size>; compare.html
    train_args: str = ""  # more train.py settings for every run: --train_args="--device=cpu --seed=1"


def ours(path):
    """A path in this project (its configs/), from the working directory: a study runs from anywhere."""
    return os.path.relpath(os.path.join(HERE, path))


def read_settings(argv, cls, files):
    """The study's settings and the train.py arguments it passes to every run, refused in one line
    before anything trains. files: the setting that names config files."""
    for a in argv:
        if not a.startswith("-") and a.endswith(".py"):
            raise UsageError(f"{a!r}: give config files as --{files}={a}")
    cfg = cls(**parse_settings(argv, cls, files=False)[0])
    budget_seconds(cfg.max_time)
    try:
        args = shlex.split(cfg.train_args)
    except ValueError as e:
        raise UsageError(f"--train_args={cfg.train_args!r} does not split into words: {e}") from None
    for a in args:
        key = a[2:].partition("=")[0]
        if not a.startswith("--"):
            raise UsageError(f"--train_args: {a!r} is not a setting: give --key=value")
        if key in SET_BY_STUDY:
            raise UsageError(f"--train_args: the study sets each run's --{key}: give the study's --out_dir and "
                             "--max_time, and leave out --init_from (a study started again resumes)")
    return cfg, args


def check_run(args):
    """A run's train.py arguments, checked as train.py would check them, its data included; its
    TrainConfig and ModelConfig."""
    train_args, model_args = parse_settings(args, TrainConfig, ModelConfig, skip=("vocab_size",))
    cfg = TrainConfig(**train_args)
    check_ranges(cfg, TRAIN_RANGES)
    _, meta = load_data(cfg.data_dir, cfg.dataset)
    return cfg, new_model_config(model_args, meta["vocab_size"])


# ----------------------------------------------------------------------------------------------
# Running: each run a train.py of its own, skipped once finished

def run_state(out_dir):
    """Where a run stands, from its out_dir: ("new", None) without ckpt.pt; else "finished" or "cut
    short", and its checkpoint's iteration, max_iters, max_time and fitted length. Finished: ckpt.pt
    holds iteration max_iters. train.py writes ckpt.pt at its last iteration, and under --max_time
    the max_iters it saves is the fitted length (fitted_iters); before the fit, the config's."""
    path = os.path.join(out_dir, "ckpt.pt")
    if not os.path.exists(path):
        return "new", None
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)  # the weights stay on disk
        cfg = ckpt["train_config"]
        info = dict(iter=ckpt["iter_num"], max_iters=cfg["max_iters"], max_time=cfg.get("max_time", ""),
                    fitted=ckpt.get("fitted_iters"))
    except Exception as e:  # not a checkpoint, or one of another program
        raise UsageError(f"{path} is not a readable checkpoint ({type(e).__name__}): move {out_dir} aside") from None
    return ("finished" if info["iter"] >= info["max_iters"] else "cut short"), info


def action(state, info, timed):
    """What a study does with a run: "skip" it (finished), "resume" it (cut short once its length was
    decided: fitted under --max_time, or max_iters without it), or start it "afresh" (new, or cut
    short before the fit: resumed, it would fit the rest to a whole budget of its own)."""
    if state == "finished":
        return "skip"
    return "resume" if state == "cut short" and (info["fitted"] or not timed) else "afresh"


def train_one(cmd):
    """Run train.py as a child; its exit status (None if a signal came first) and the signals the study
    got meanwhile. The child has a session of its own, and each SIGINT or SIGTERM the study gets
    is passed on to it: so it gets each signal once, whether a terminal's Ctrl-C or a `kill` of the
    study sent it (train.py saves and stops at the first; a second stops it at once, unsaved)."""
    got, child = [], []

    def forward(signum, frame):
        got.append(signum)
        if child:
            child[0].send_signal(signum)
    handlers = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        if not got:
            child.append(subprocess.Popen(cmd, start_new_session=True))  # a group would do; process_group needs 3.11
        return child[0].wait() if child else None, got
    finally:
        for s, handler in handlers.items():
            signal.signal(s, handler)


def train_all(runs, max_time):
    """Train the runs that have not finished, one after another, with a line as each starts and ends
    and the study's time left: the runs to come at max_time each, the current one's remainder (at
    the pace so far without max_time). The names of the runs that failed; a signal stops the study."""
    seconds = budget_seconds(max_time)
    plan = [(r, *run_state(r["out_dir"])) for r in runs]
    for r, state, info in plan:  # runs of another budget would not compare: refused before any trains
        if info and budget_seconds(info["max_time"]) != seconds:
            raise UsageError(f"{r['out_dir']} was trained with --max_time={info['max_time']!r}, not "
                             f"{max_time!r}: give the same --max_time, or another --out_dir")
    todo, failed, spent = sum(state != "finished" for _, state, _ in plan), [], []
    print(f"study: {len(runs)} runs, {len(runs) - todo} finished already, {todo} to train"
          f"{f' at --max_time={max_time} each' if max_time else ''}", flush=True)
    for k, (r, state, info) in enumerate(plan, 1):
        tag, what = f"[{k}/{len(runs)}] {r['name']}", action(state, info, seconds)
        if what == "skip":
            print(f"{tag}: skip: finished (iteration {info['iter']:,} of {info['max_iters']:,})", flush=True)
            continue
        todo -= 1
        each = seconds or (statistics.mean(spent) if spent else None)
        now = each and (each * (1 - info["iter"] / info["max_iters"]) if what == "resume" else each)
        if what == "afresh":  # a new run that train.py would refuse to start over them
            for name in ("ckpt.pt", "best.pt"):
                if os.path.exists(os.path.join(r["out_dir"], name)):
                    os.remove(os.path.join(r["out_dir"], name))
        how = f"resuming at iteration {info['iter']:,} of {info['max_iters']:,}" if what == "resume" else "start"
        print(f"{tag}: {how}{left(each, todo, now)}", flush=True)
        t0 = time.time()
        cmd = [sys.executable, os.path.join(HERE, "train.py"), *r["args"], f"--out_dir={r['out_dir']}"]
        cmd += [f"--max_time={max_time}"] * bool(max_time) + ["--init_from=resume"] * (what == "resume")
        code, got = train_one(cmd)
        spent.append(time.time() - t0)
        if got:
            print(f"study stopped by {signal.Signals(got[0]).name} during {r['name']}: its checkpoint is kept; "
                  "the same command again goes on from there", flush=True)
            return failed, 128 + got[0]
        if code == 0 and run_state(r["out_dir"])[0] == "finished":
            best = min((x["val_loss"] for x in read_metrics(os.path.join(r["out_dir"], "metrics.jsonl"))
                        if "val_loss" in x), default=math.nan)
            print(f"{tag}: finished in {duration(spent[-1])}, best val loss {best:.4f}{left(each, todo)}", flush=True)
        else:
            failed.append(r["name"])
            print(f"{tag}: failed (train.py's exit status {code}){left(each, todo)}", flush=True)
    return failed, 0


def left(each, runs, now=0.0):
    """'; the study: about 0:24:00 left' (nothing without a time to go by, or with none left)."""
    return f"; the study: about {hms(each * runs + (now or 0))} left" if each and (runs or now) else ""


def finished(runs, failed):
    """The finished runs as report.read_run reads them, for the page: every run not failed."""
    return [dict(r, **read_run(r["out_dir"])) for r in runs if r["name"] not in failed]


def write(path, text):
    try:
        write_atomic(path, text.encode())
    except OSError as e:
        raise UsageError(f"could not write {path} ({e.strerror or e}): free some space, then run the study "
                         "again (its finished runs are skipped)") from None


def write_page(root, runs, extra=""):
    write(os.path.join(root, "compare.html"), compare_page(runs, extra))
    print(f"{os.path.join(root, 'compare.html')}: the {len(runs)} finished runs side by side")


# ----------------------------------------------------------------------------------------------
# The family: python bench.py family --max_time=2m [--configs=a.py,b.py]

def family(argv):
    """Every member of the family trained for the same time, one after another (by default the CPU
    configs of the members and attention variants, study.FAMILY), each by `python train.py CONFIG
    --max_time=T --out_dir=ROOT/NAME`; then ROOT/compare.html, report.py's page of them, and a table
    (config, member, parameters, iterations, best val loss, objective), printed and in ROOT/family.md.
    Started again, it skips the runs that finished and goes on with one cut short."""
    cfg, args = read_settings(argv, FamilyConfig, "configs")
    paths = [p.strip() for p in cfg.configs.split(",") if p.strip()] or [ours(f"configs/{f}") for f in FAMILY]
    names = [os.path.splitext(os.path.basename(p))[0] for p in paths]
    if len(set(names)) < len(names):
        raise UsageError("--configs: two configs of the same name would share a run's folder: rename one")
    runs = [dict(name=n, out_dir=os.path.join(cfg.out_dir, n), args=[p, *args]) for n, p in zip(names, paths)]
    for r in runs:
        check_run(r["args"])
    failed, status = train_all(runs, cfg.max_time)
    if status:
        return status
    done = finished(runs, failed)
    if done:
        write_page(cfg.out_dir, done)
        table = family_table(done)
        print(table, end="")
        write(os.path.join(cfg.out_dir, "family.md"), table)
    if failed:
        print(f"study: {len(failed)} of {len(runs)} runs failed ({', '.join(failed)}): the same command again "
              "trains them, skipping the rest")
    return 1 if failed else 0


def family_table(runs):
    """A markdown table, one row per run (its config: the first of its train.py arguments)."""
    rows = ["| config | member | parameters | iterations | best val loss | objective |",
            "|---|---|--:|--:|--:|---|"]
    for r in runs:
        best = f"{r['best']['val_loss']:.4f}" if r["best"] else "-"
        rows.append(f"| {os.path.basename(r['args'][0])} | {member(r['config'])} | {r['params'] / 1e6:.2f}M | "
                    f"{max(x['iter'] for x in r['records']):,} | {best} | {r['kind']} |")
    return "\n".join(rows) + "\n"


# ----------------------------------------------------------------------------------------------
# Scaling: python bench.py scaling --sizes=64,128,256 --max_time=1m

CAVEAT = ("caveat: each size had the same time, so the larger ones saw fewer tokens: this L(N) is the loss at the "
          "budget, not the converged loss of Kaplan et al.; and a few sizes over a short range give rough exponents "
          "(N_opt is always one of the sizes trained): a demonstration of the method, not a measurement")


def scaling(argv):
    """A ladder of model widths (--sizes, n_embd; n_head keeps the config's head size), each trained for
    the same time as `python train.py CONFIG --n_embd=S --n_head=H --max_time=T --out_dir=ROOT/n_embd-S`;
    then L(N) = E + A / N^alpha fitted by least squares to each run's best val loss against its
    non-embedding parameters N (as Kaplan et al. 2020 count them), and the compute-optimal size
    N_opt = k C^a by Chinchilla's approach 1 (Hoffmann et al. 2022) from the runs' val loss against
    FLOPs. It prints the fits and their points; ROOT/compare.html is report.py's page of the runs
    with the fits on it. Started again, it skips the runs that finished."""
    cfg, args = read_settings(argv, ScalingConfig, "config")
    runs = ladder(cfg, args)
    failed, status = train_all(runs, cfg.max_time)
    if status:
        return status
    done = [r for r in finished(runs, failed) if r["best"]]
    if len(done) < 3:
        print(f"study: {len(done)} runs finished with a finite val loss: fitting E + A / N^alpha takes 3")
        return 1
    text, extra = scaling_report(done)
    print(text)
    write_page(cfg.out_dir, done, extra)
    return 1 if failed else 0


def ladder(cfg, args):
    """The runs: the config at each width, n_head = n_embd / its head size (its query heads per key/value
    head kept). Width rather than depth: N grows as the width squared, so three sizes a factor 2 apart
    span 16x in N, each with the config's layers and heads of the same size."""
    widths = sorted(set(sizes(cfg, "sizes", "64,128,256")))
    if len(widths) < 3:
        raise UsageError(f"sizes={cfg.sizes!r}: fitting E + A / N^alpha takes 3 sizes or more, as --sizes=64,128,256")
    path = cfg.config if os.path.exists(cfg.config) or cfg.config != ScalingConfig.config else ours(cfg.config)
    base = check_run([path, *args])[1]
    hs, group = base.head_size, base.n_head // base.n_kv_head
    runs = []
    for s in widths:
        if s % (hs * group):
            raise UsageError(f"--sizes: {s} is not a multiple of {hs * group}: n_head = n_embd / the head size "
                             f"({hs}){f', a multiple of the {group} query heads per key/value head' * (group > 1)}")
        more = [f"--n_embd={s}", f"--n_head={s // hs}"] + [f"--n_kv_head={s // hs // group}"] * (group > 1)
        name = f"n_embd-{s}"
        runs.append(dict(name=name, out_dir=os.path.join(cfg.out_dir, name), args=[path, *args, *more]))
        check_run(runs[-1]["args"])
    return runs


def non_embedding_params(config):
    """N as Kaplan et al. (2020) count it: every parameter but the embeddings (tokens, positions,
    relative position biases) and the output layer (the token embedding's transpose, tied or not)."""
    with torch.device("meta"):  # sizes alone: no memory, no time
        model = Transformer(config)
    skip = {id(p) for m in model.modules() if isinstance(m, torch.nn.Embedding) for p in m.parameters()}
    skip |= {id(p) for p in model.lm_head.parameters()}
    return sum(p.numel() for p in model.parameters() if id(p) not in skip)


def fit_power_law(N, L, rounds=10, alphas=(0.01, 3.0)):
    """E, A and alpha of L = E + A / N^alpha by least squares, E and A at least 0 (a loss that cannot go
    below zero, falling with N): at each alpha of a grid over `alphas`, E and A are a linear problem;
    the grid then narrows around the best alpha, round by round (numpy alone). N is divided by its
    geometric mean inside, so that N^-alpha stays near 1."""
    N, L = np.asarray(N, dtype=np.float64), np.asarray(L, dtype=np.float64)
    scale = np.exp(np.log(N).mean())

    def solve(alpha):  # the squared error at alpha, and (E, A at the scaled N)
        x = (N / scale) ** -alpha
        free = np.linalg.lstsq(np.stack([np.ones_like(x), x], 1), L, rcond=None)[0]
        # a quadratic's least on the quadrant: its free least if inside, else the least of its two edges
        fits = [free] * bool(min(free) >= 0) + [np.array([0, max(0, x @ L / (x @ x))]), np.array([max(0, L.mean()), 0])]
        return min(((((E + A * x) - L) ** 2).sum(), (E, A)) for E, A in fits)
    grid = np.linspace(*alphas, 300)
    for _ in range(rounds):
        best = min(grid, key=lambda alpha: solve(alpha)[0])
        step = grid[1] - grid[0]
        grid = np.linspace(max(best - step, alphas[0]), min(best + step, alphas[1]), 21)
    E, A = solve(best)[1]
    return float(E), float(A * scale ** best), float(best)


def compute_optimal(curves, budgets=None, n=8):
    """Chinchilla's approach 1: at each compute budget C, the size N whose val loss is lowest at C among
    the runs whose curve reaches C (each curve [(FLOPs, val loss)] in order, interpolated linearly in
    log C); then N_opt = k C^a fitted by least squares in log space. By default n budgets evenly apart
    in log C, from where two curves have begun to where two still go on. ([(C, N_opt, its loss)], k,
    a); k and a are None with fewer than 2 budgets."""
    curves = [(N, np.asarray(c, dtype=np.float64)) for N, c in curves if len(c)]
    if budgets is None:
        starts, ends = sorted(c[0, 0] for _, c in curves), sorted(c[-1, 0] for _, c in curves)
        budgets = np.geomspace(starts[1], ends[-2], n) if len(curves) > 1 and starts[1] < ends[-2] else []
    points = []
    for C in budgets:
        reach = [(float(np.interp(np.log(C), np.log(c[:, 0]), c[:, 1])), N) for N, c in curves
                 if c[0, 0] <= C <= c[-1, 0]]
        if reach:
            loss, N = min(reach)
            points.append((float(C), N, loss))
    if len(points) < 2:
        return points, None, None
    a, log_k = np.polyfit(np.log([C for C, _, _ in points]), np.log([N for _, N, _ in points]), 1)
    return points, float(np.exp(log_k)), float(a)


def scaling_report(runs):
    """The fits of the finished runs: the lines to print, and the section of the compare page."""
    N = [non_embedding_params(r["config"]) for r in runs]
    L = [r["best"]["val_loss"] for r in runs]
    E, A, alpha = fit_power_law(N, L)
    curves = [(n, [(x["tokens"] * r["flops_per_token"], x["val_loss"]) for x in r["records"]
                   if x["tokens"] > 0 and math.isfinite(x.get("val_loss", math.nan))]) for n, r in zip(N, runs)]
    points, k, a = compute_optimal(curves)
    out = [f"scaling: L(N) = E + A / N^alpha by least squares over {len(runs)} runs (N: non-embedding parameters, "
           "as Kaplan et al. 2020 count them; L: the best val loss)",
           f"{'run':<14} {'n_embd':>6} {'N':>12} {'best val loss':>13} {'fit':>7}"]
    out += [f"{r['name']:<14} {r['config'].n_embd:>6} {n:>12,} {loss:>13.4f} {E + A * n ** -alpha:>7.4f}"
            for r, n, loss in zip(runs, N, L)]
    out.append(f"alpha = {alpha:.4f}, E = {E:.4f}, A = {A:.6g}")
    if not E or not A:  # the fit sits on a bound: say so, rather than let its numbers pass for a law
        out.append("note: the fit sits on its bound " + ("A = 0: the loss does not fall with N" if not A else
                                                         "E = 0: the loss falls faster than a power law with a floor"))
    if k is None:
        out.append("compute-optimal: no FLOP budget that two runs' evaluations reach: no fit")
    else:
        out.append(f"compute-optimal size (Chinchilla's approach 1, {len(points)} budgets C): N_opt = k C^a with "
                   f"a = {a:.4f}, k = {k:.4g}")
        out += [f"  C = {C:.4g} FLOPs: N_opt = {n:,} (val loss {loss:.4f})" for C, n, loss in points]
    out.append(CAVEAT)
    return "\n".join(out), scaling_section(N, L, (E, A, alpha), points, k, a)


def scaling_section(N, L, fit, points, k, a):
    """The compare page's section of the fits: val loss by N, the points and the fitted curve; N_opt
    by C, likewise."""
    E, A, alpha = fit
    grid = np.linspace(min(N), max(N), FIT_POINTS)
    svgs = [chart("best val loss by size", [("runs", sorted(zip(N, L))), (
        f"fit E + A / N^{alpha:.3f}", [(x, E + A * x ** -alpha) for x in grid])], "N: non-embedding parameters",
        colors=(RUN_COLORS[1], RUN_COLORS[0]))]
    if k is not None:
        grid = np.geomspace(points[0][0], points[-1][0], FIT_POINTS)
        svgs.append(chart("compute-optimal size by budget", [("N_opt: the size lowest at C", [
            (C, n) for C, n, _ in points]), (f"fit k C^{a:.3f}", [(C, k * C ** a) for C in grid])],
            "C: FLOPs (tokens x the model's training FLOPs per token)", colors=(RUN_COLORS[1], RUN_COLORS[0])))
    fits = f"alpha {alpha:.3f}, E {E:.3f}, A {A:.3g}" + (f"; N_opt = k C^a: a {a:.3f}" if k is not None else "")
    return (f"<h2>scaling <small>(L(N) = E + A / N^alpha: {fits})</small></h2>\n<p>{html.escape(CAVEAT)}</p>\n"
            '<div class="charts">\n' + "\n".join(svgs) + "\n</div>\n")


if __name__ == "__main__":  # a library of bench.py's, which runs its studies: say so rather than exit 0 silently
    print("study.py: error: studies run through bench.py: python bench.py family|scaling [--key=value ...] "
          "(python bench.py family --help lists the settings)", file=sys.stderr)
    sys.exit(2)
