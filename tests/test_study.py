"""study.py (python bench.py family / scaling): every config gets a run, a row in family.md and a place
on compare.html; a study started again skips the runs that finished and resumes the one cut short;
Ctrl-C stops it with that run's checkpoint kept; the fits recover the parameters of synthetic data;
bad input is one line, before anything trains."""

import io
import math
import os
import re
import signal
import subprocess
import sys
from contextlib import redirect_stdout

import numpy as np
import pytest
import torch

import bench
import report
import study

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root


def train_args(tiny_args, *more):
    return "--train_args=" + " ".join([*tiny_args, *more])


def printed(in_process, argv, cwd):
    """bench.main(argv) run in this process: its exit status and what the study printed (train.py's
    own lines go to the file descriptor, not here)."""
    with pytest.MonkeyPatch.context() as env, redirect_stdout(io.StringIO()) as out:
        env.setenv("OMP_NUM_THREADS", "1")  # each run's train.py on one thread, as conftest's run_script runs scripts
        status = in_process(bench.main, argv, cwd=cwd)
    return status, out.getvalue()


def mtimes(folder):
    return {p: p.stat().st_mtime_ns for p in sorted(folder.rglob("*")) if p.is_file()}


def polylines(page):
    """{chart title: {series name: number of points}} of every chart on the page."""
    return {re.search(r'class="title">(.*?)</text>', svg)[1]: {
        name: len(points.split()) for name, points in re.findall(r'data-series="(.*?)"[^>]*points="(.*?)"', svg)}
        for svg in page.split("<svg")[1:]}


# ----------------------------------------------------------------------------------------------
# The family

@pytest.fixture(scope="module")
def family(workdir, in_process, tiny_args):
    """study/dec (a decoder) and study/enc (an encoder), 4 iterations each, by `bench.py family`."""
    d, _ = workdir
    (d / "dec.py").write_text('dataset = "verse"\n')
    (d / "enc.py").write_text('dataset = "verse"\narch = "encoder"\n')
    argv = ["family", "--configs=dec.py,enc.py", "--max_time=", "--out_dir=study",
            train_args(tiny_args, "--max_iters=4", "--eval_interval=2")]
    status, out = printed(in_process, argv, d)
    return d, argv, status, out


def test_family_trains_every_config_with_a_row_in_family_md_and_a_place_on_the_page(family):
    d, _, status, out = family
    assert status == 0
    for k, name in enumerate(["dec", "enc"], 1):
        assert f"[{k}/2] {name}: start" in out and f"[{k}/2] {name}: finished in " in out
        assert torch.load(d / "study" / name / "ckpt.pt", weights_only=True)["iter_num"] == 4
    assert "[2/2] enc: start; the study: about " in out  # the time left, at the pace of dec's run
    table = (d / "study" / "family.md").read_text()
    assert table in out
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines()]
    assert rows[0] == ["config", "member", "parameters", "iterations", "best val loss", "objective"]
    for row, name, kind in zip(rows[2:], ["dec", "enc"], ["next token", "masked LM"]):
        run = report.read_run(str(d / "study" / name))
        assert row == [f"{name}.py", report.member(run["config"]), f"{run['params'] / 1e6:.2f}M", "4",
                       f"{run['best']['val_loss']:.4f}", kind]
    assert len(rows) == 4
    page = (d / "study" / "compare.html").read_text()
    assert [h.split(" <")[0] for h in re.findall(r"<h2>(.*?)</h2>", page)] == ["next token", "masked LM"]
    for name in ("dec", "enc"):
        assert f"&#9632;</span> {os.path.join('study', name)}</td>" in page  # its row in the run table


def test_a_family_started_again_skips_the_runs_that_finished(family, in_process):
    d, argv, _, _ = family
    before = mtimes(d / "study" / "dec") | mtimes(d / "study" / "enc")
    status, out = printed(in_process, argv, d)
    assert status == 0 and "start" not in out
    assert "[1/2] dec: skip: finished (iteration 4 of 4)" in out and "[2/2] enc: skip: finished" in out
    assert mtimes(d / "study" / "dec") | mtimes(d / "study" / "enc") == before  # not trained again
    assert (d / "study" / "family.md").read_text() in out


# ----------------------------------------------------------------------------------------------
# Stopped and started again, on the scaling ladder

def read_until(stream, start, seen):
    """Lines from stream into seen until one starts with start."""
    for line in stream:
        seen.append(line)
        if line.startswith(start):
            return
    raise AssertionError(f"the stream ended before a line {start!r}: {''.join(seen)}")


@pytest.fixture(scope="module")
def ladder(workdir, in_process, tiny_args):
    """`bench.py scaling` over widths 16, 32 and 48 (300 iterations each) as a user runs it, stopped
    by SIGINT once the second run has evaluated; then the same command again, in this process. The
    folder, the stopped study's (status, stdout, stderr), the first run's files' mtimes before the
    second command, and its (status, what it printed)."""
    d, _ = workdir
    (d / "base.py").write_text('dataset = "verse"\n')
    argv = ["scaling", "--config=base.py", "--sizes=16,32,48", "--max_time=", "--out_dir=ladder",
            train_args(tiny_args, "--max_iters=300", "--eval_interval=100", "--log_interval=50")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    p = subprocess.Popen([sys.executable, os.path.join(HERE, "bench.py"), *argv], cwd=d, env=env, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        seen = []
        read_until(p.stdout, "[2/3] n_embd-32: start", seen)
        read_until(p.stdout, "step 0:", seen)  # train.py's loop: its handlers, which save, are in place
        p.send_signal(signal.SIGINT)  # to the study alone: it passes it on
        out, err = p.communicate(timeout=300)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    before = mtimes(d / "ladder" / "n_embd-16")
    return d, (p.returncode, "".join(seen) + out, err), before, printed(in_process, argv, d)


@pytest.mark.slow
def test_ctrl_c_stops_the_study_cleanly_and_the_run_keeps_its_checkpoint(ladder):
    d, (code, out, err), _, _ = ladder
    assert code == 130 and "Traceback" not in err, err
    assert "study stopped by SIGINT during n_embd-32: its checkpoint is kept" in out
    saved = re.search(r"stopped by SIGINT at iteration (\d+)", out)  # train.py's own line: it saved
    assert saved and "[3/3]" not in out and "n_embd-32: finished" not in out
    assert "[1/3] n_embd-16: finished in " in out


@pytest.mark.slow
def test_a_study_started_again_skips_the_finished_runs_and_resumes_the_one_cut_short(ladder):
    d, (_, first, _), before, (status, out) = ladder
    saved = int(re.search(r"stopped by SIGINT at iteration (\d+)", first)[1])
    assert status == 0
    assert "[1/3] n_embd-16: skip: finished (iteration 300 of 300)" in out
    assert f"[2/3] n_embd-32: resuming at iteration {saved} of 300" in out and "[3/3] n_embd-48: start" in out
    assert mtimes(d / "ladder" / "n_embd-16") == before
    for s in (16, 32, 48):
        ckpt = torch.load(d / "ladder" / f"n_embd-{s}" / "ckpt.pt", weights_only=True)
        assert ckpt["iter_num"] == 300 and ckpt["model_config"]["n_embd"] == s
        assert ckpt["model_config"]["n_head"] == s // 16  # the head size of the base's 32 / 2 kept


@pytest.mark.slow
def test_scaling_prints_the_fits_and_puts_them_on_the_compare_page(ladder):
    d, _, _, (_, out) = ladder
    alpha, E, A = (float(x) for x in re.search(r"^alpha = (\S+), E = (\S+), A = (\S+)$", out, re.M).groups())
    rows = re.findall(r"^(n_embd-\d+) +(\d+) +([\d,]+) +([\d.]+) +([\d.]+)$", out, re.M)
    assert [r[0] for r in rows] == ["n_embd-16", "n_embd-32", "n_embd-48"]
    for name, width, n, loss, fitted in rows:
        state = torch.load(d / "ladder" / name / "ckpt.pt", weights_only=True)["model"]
        # Kaplan's N: all but the token and position embeddings and the output layer (tied to the first)
        assert int(n.replace(",", "")) == sum(v.numel() for k, v in state.items()
                                              if not k.startswith(("wte.", "lm_head.")) and "wpe." not in k)
        best = min(r["val_loss"] for r in report.read_metrics(d / "ladder" / name / "metrics.jsonl") if "val_loss" in r)
        assert loss == f"{best:.4f}"
        assert float(fitted) == pytest.approx(E + A * int(n.replace(",", "")) ** -alpha, abs=1e-3)  # as printed
    assert re.search(r"^compute-optimal(: no FLOP budget| size \(Chinchilla's approach 1)", out, re.M)
    assert re.search(r"^caveat: ", out, re.M)
    page = (d / "ladder" / "compare.html").read_text()
    charts = polylines(page)
    assert charts["best val loss by size"] == {"runs": 3, f"fit E + A / N^{alpha:.3f}": study.FIT_POINTS}
    assert "<h2>scaling" in page and "val loss by FLOPs" in charts  # and report.py's own sections


# ----------------------------------------------------------------------------------------------
# The fits, on synthetic data

def test_the_power_law_fit_recovers_known_parameters():
    for N in (np.geomspace(1e5, 1e7, 5), [2e5, 8e5, 3.2e6]):  # three points: as many as the parameters
        E, A, alpha = study.fit_power_law(N, [1.2 + 5 / n ** 0.3 for n in N])
        assert (E, A, alpha) == pytest.approx((1.2, 5, 0.3), abs=1e-3)


def test_the_compute_optimal_exponent_is_recovered_from_synthetic_curves():
    # at compute C the loss of size N is lowest where N = k C^a: each budget C_j is won by size N_j
    a, k = 0.5, 0.1
    sizes = [10 ** (5 + 0.25 * j) for j in range(9)]
    budgets = [(n / k) ** (1 / a) for n in sizes]

    def loss(n, C):
        return 1 + (math.log(n) - a * math.log(C) - math.log(k)) ** 2
    curves = [(n, [(C, loss(n, C)) for C in budgets]) for n in sizes]
    points, k_fit, a_fit = study.compute_optimal(curves, budgets)
    assert [N for _, N, _ in points] == sizes and (k_fit, a_fit) == pytest.approx((k, a), rel=1e-6)
    # budgets of its own, between the curves' evaluations: N_opt is one of the sizes, so a is near
    dense = np.geomspace(budgets[0], budgets[-1], 400)
    points, _, a_fit = study.compute_optimal([(n, [(C, loss(n, C)) for C in dense]) for n in sizes])
    assert len(points) == 8 and a_fit == pytest.approx(a, abs=0.05)
    # a budget that one curve alone reaches is no comparison: none, and no fit
    assert study.compute_optimal([(1, [(1, 2.0), (2, 1.0)]), (2, [(3, 2.0), (4, 1.0)])]) == ([], None, None)


def test_a_run_is_skipped_once_finished_resumed_once_its_length_is_fixed_else_started_afresh():
    cut = dict(iter=100, max_iters=2000, max_time="2m", fitted=None)
    assert study.action("finished", dict(cut, iter=2000), timed=120) == "skip"
    assert study.action("cut short", dict(cut, fitted=1500), timed=120) == "resume"
    assert study.action("cut short", cut, timed=120) == "afresh"  # before the fit: it would get a budget anew
    assert study.action("cut short", dict(cut, max_time=""), timed=None) == "resume"  # max_iters: fixed
    assert study.action("new", None, timed=120) == "afresh"
    assert study.left(120, 2, 60) == "; the study: about 0:05:00 left" and study.left(None, 2) == ""


# ----------------------------------------------------------------------------------------------
# Bad input

def test_bad_input_is_refused_in_one_line_before_anything_trains(family, tiny_args, refusal, run, one_line_error,
                                                                 in_parallel, files_under):
    d, argv, _, _ = family
    tiny = train_args(tiny_args)
    (d / "base.py").write_text('dataset = "verse"\n')  # as the ladder's (slow) fixture writes it
    before = files_under(d)
    for args, fragment in [
            (["family", "--configs=nope.py"], "config file 'nope.py' not found"),
            (["family", "dec.py"], "'dec.py': give config files as --configs=dec.py"),
            (["family", "--config=dec.py"], "did you mean --configs?"),
            (["family", "--configs=dec.py", "--max_time=soon"], "max_time='soon' is not a duration"),
            (["family", "--configs=dec.py", "--train_args=--out_dir=x"], "the study sets each run's --out_dir"),
            (["family", "--configs=dec.py", "--train_args=--n_head=5"], "bad model settings"),
            (["family", "--configs=dec.py", "--train_args=--dataset=prose"], "dataset 'prose' is not prepared"),
            (["family", "--configs=dec.py,dec.py"], "two configs of the same name"),
            ([*argv[:2], "--max_time=5m", *argv[3:]], "study/dec was trained with --max_time='', not '5m'"),
            (["scaling", "--config=base.py", "--sizes=16,0,32", tiny], "sizes=(16, 0, 32) should be positive whole"),
            (["scaling", "--config=base.py", "--sizes=16,32.5,48", tiny], "should be positive whole numbers"),
            (["scaling", "--config=base.py", "--sizes=sixteen", tiny], "sizes='sixteen' should be tuple or int"),
            (["scaling", "--config=base.py", "--sizes=16,32", tiny], "takes 3 sizes or more"),
            (["scaling", "--config=base.py", "--sizes=16,24,32", tiny], "24 is not a multiple of 16")]:
        refusal(bench.main, args, fragment, cwd=d)
    assert files_under(d) == before  # nothing trained, nothing written
    (code, out, _), refused = in_parallel(lambda: run("bench.py", "family", "--help", cwd=d),
                                          lambda: run("bench.py", "scaling", "--sizes=0", cwd=d))
    assert code == 0 and "--max_time=T --out_dir=ROOT/NAME" in out and "train_args" in out
    one_line_error(refused, "bench.py: error: sizes=0 should be positive whole numbers")


def test_study_py_run_alone_says_to_use_bench_py(run, one_line_error, tmp_path):
    """study.py is bench.py's library: run alone it names the commands that run studies, exit 2."""
    one_line_error(run("study.py", cwd=tmp_path), "bench.py family|scaling")
