"""train.py: every architecture trains and samples; a resumed run is bit for bit the run that
never stopped; DDP under torchrun agrees with one process; a signal saves and stops; bad
settings, data and memory are refused in one line; a non-finite loss keeps the last good
checkpoint; the learning rate schedule and the log."""

import io
import json
import os
import re
import shutil
import signal
import sys
import time
import traceback
from contextlib import redirect_stdout
from types import SimpleNamespace

import pytest
import torch

import kernels
import optim
import sample
import train

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")
# each architecture with some of its options: the runs of test_each_architecture_trains_and_samples,
# which test_resuming_halfway_gives_bit_identical_losses_and_weights resumes halfway
ARCHS = {"decoder": ["--pos=rope", "--n_kv_head=1", "--dropout=0.1"], "encoder": ["--norm_first=False"],
         "encoder-decoder": ["--pos=relative", "--norm=rmsnorm"], "prefix-lm": ["--pos=alibi"]}


def arch_args(arch, tiny_args):
    return ["--dataset=verse", "--eval_interval=3", f"--arch={arch}", *tiny_args, *ARCHS[arch]]


@pytest.fixture(scope="module")
def arch_runs(workdir, run, in_parallel, in_process, tiny_args):
    """Each architecture trained from the command line for 8 iterations (out-<arch>), two runs at a
    time, and in this process for the first 4 of them (out-<arch>-halves): {arch: (the 8's result,
    the 4's status and log)}."""
    d, _ = workdir
    results = in_parallel(*(lambda arch=arch: run("train.py", f"--out_dir=out-{arch}", "--max_iters=8",
                                                  *arch_args(arch, tiny_args), cwd=d) for arch in ARCHS))
    firsts = []
    for arch in ARCHS:
        with redirect_stdout(io.StringIO()) as log:
            status = in_process(train.main, [f"--out_dir=out-{arch}-halves", "--max_iters=4",
                                              *arch_args(arch, tiny_args)], cwd=d)
        firsts.append((status, log.getvalue()))
    return {arch: (straight, first) for arch, straight, first in zip(ARCHS, results, firsts)}


# ----------------------------------------------------------------------------------------------
# End to end

@pytest.mark.parametrize("arch", ARCHS)
def test_each_architecture_trains_and_samples(workdir, arch_runs, arch, run, losses, in_process, capsys):
    d, _ = workdir
    code, log, err = arch_runs[arch][0]
    assert code == 0, err
    assert len(losses(log)) == 8 and losses(log)[-1] < losses(log)[0]
    assert os.path.exists(d / f"out-{arch}" / "ckpt.pt") and os.path.exists(d / f"out-{arch}" / "best.pt")
    continues = arch in ("decoder", "prefix-lm")  # a prompt; else blanks
    start = "ROMEO:" if continues else "LEAR: [MASK]ear[MASK] day"
    args = [f"--out_dir=out-{arch}", f"--start={start}", "--max_new_tokens=30", "--num_samples=2", "--seed=3"]
    code, text, err = run("sample.py", *args, cwd=d)
    assert code == 0, err
    assert "tokens/s" in err and text.count("---------------") == 2
    first = text.split("\n---------------\n")[0]
    if continues:
        assert first.startswith("ROMEO:") and len(first) == len("ROMEO:") + 30
    else:  # the blanks are filled and the rest of the prompt kept
        assert re.fullmatch(r"LEAR: .+ear.+ day" if arch == "encoder" else r"LEAR: .*ear.* day", first, re.S)
        if arch == "encoder":
            assert len(first) == len("LEAR: ear day") + 2  # one character per [MASK]
    capsys.readouterr()
    assert in_process(sample.main, args, cwd=d) == 0
    assert capsys.readouterr().out == text  # the same seed, the same text (here in another process)


@pytest.mark.parametrize("arch", ARCHS)
def test_resuming_halfway_gives_bit_identical_losses_and_weights(workdir, arch_runs, arch, run, losses, tiny_args):
    d, _ = workdir
    (code, straight, err), (code_first, first) = arch_runs[arch]
    assert code == 0 and code_first == 0, err
    code, second, err = run("train.py", f"--out_dir=out-{arch}-halves", "--max_iters=8", "--init_from=resume",
                            *arch_args(arch, tiny_args), cwd=d)
    assert code == 0, err
    assert losses(first) + losses(second) == losses(straight) and len(losses(straight)) == 8  # to 4 decimals...
    a = torch.load(d / f"out-{arch}" / "ckpt.pt", weights_only=True)["model"]
    b = torch.load(d / f"out-{arch}-halves" / "ckpt.pt", weights_only=True)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)  # ...and the weights bit for bit


def test_a_performer_redraws_its_features_every_feature_redraw_steps_and_resumes_exactly(workdir, in_process,
                                                                                          tiny_args, capsys):
    """feature_redraw=3: new random features after steps 3 and 6, drawn from (seed, step) and saved with
    the weights; a run of 2 + 2 + 4 iterations, resumed twice, ends bit for bit where one of 8 does."""
    d, _ = workdir
    args = ["--dataset=verse", "--attention=performer", "--n_features=8", "--feature_redraw=3", *tiny_args]
    ckpt = lambda out: torch.load(d / out / "ckpt.pt", weights_only=True)["model"]  # noqa: E731
    assert in_process(train.main, ["--out_dir=out-performer-8", "--max_iters=8", *args], cwd=d) == 0
    drawn = []
    for i, n in enumerate((2, 4, 8)):
        resume = ["--init_from=resume"] if i else []
        assert in_process(train.main, ["--out_dir=out-performer", f"--max_iters={n}", *resume, *args], cwd=d) == 0
        drawn.append(ckpt("out-performer")["decoder.h.0.attn.proj"])
    assert not torch.equal(drawn[0], drawn[1]) and not torch.equal(drawn[1], drawn[2])  # after steps 3 and 6
    one, resumed = ckpt("out-performer-8"), ckpt("out-performer")
    assert all(torch.equal(one[k], resumed[k]) for k in one)
    capsys.readouterr()


def test_a_transformer_xl_run_carries_its_memory_and_resumes_exactly(workdir, in_process, tiny_args, capsys):
    """mem_len: each row a stream, the memory carried from iteration to iteration and saved in the
    checkpoint, so that 4 + 4 iterations end bit for bit where 8 do; evaluation reads streams too."""
    d, _ = workdir
    args = ["--dataset=verse", "--pos=rope", "--mem_len=16", "--eval_interval=4", *tiny_args]
    ckpt = lambda out: torch.load(d / out / "ckpt.pt", weights_only=True)  # noqa: E731
    assert in_process(train.main, ["--out_dir=out-xl-8", "--max_iters=8", *args], cwd=d) == 0
    assert in_process(train.main, ["--out_dir=out-xl", "--max_iters=4", *args], cwd=d) == 0
    mems = ckpt("out-xl")["mems"]
    assert list(mems) == [0] and len(mems[0]) == 2 and mems[0][0].shape == (4, 16, 32)  # micro-step 0's layers
    assert in_process(train.main, ["--out_dir=out-xl", "--max_iters=8", "--init_from=resume", *args], cwd=d) == 0
    one, resumed = ckpt("out-xl-8"), ckpt("out-xl")
    assert all(torch.equal(one["model"][k], resumed["model"][k]) for k in one["model"])
    assert one["best_val_loss"] == resumed["best_val_loss"]
    capsys.readouterr()


def test_bench_times_train_py_against_nanogpts_recipe_and_both_compute_the_same(workdir, run, tiny_args):
    d, _ = workdir
    code, log, err = run("bench.py", "train", "--dataset=verse", "--out_dir=out-bench", "--attn_impl=math",
                         *tiny_args, cwd=d)
    assert code == 0, err
    assert "attention: math in train.py, sdpa in nanoGPT's recipe" in log  # nanoGPT's own attention
    ms = dict(re.findall(r"^(nanoGPT's recipe|train.py) +([\d.]+)", log, re.M))
    assert set(ms) == {"nanoGPT's recipe", "train.py"} and all(float(v) > 0 for v in ms.values())
    speedup = float(re.search(r"^train.py .* ([\d.]+)x", log, re.M).group(1))
    a, b = float(ms["nanoGPT's recipe"]), float(ms["train.py"])
    # the speed-up of the unrounded times: each ms figure is printed to within 0.05, the speed-up to 0.005
    assert (a - 0.05) / (b + 0.05) - 0.005 <= speedup <= (a + 0.05) / (b - 0.05) + 0.005
    # fused AdamW and the written-out attention change the speed, not the weights beyond rounding
    # (a step of AdamW moves a weight by about the learning rate, 1e-3)
    assert float(re.search(r"parameter difference is (\S+) after one iteration", log).group(1)) < 1e-5
    assert not os.path.exists(d / "out-bench")  # a benchmark writes no checkpoint


# ----------------------------------------------------------------------------------------------
# The schedule, the log, the checkpoints a run keeps

def test_learning_rate_warms_up_linearly_then_decays_by_cosine_to_min_lr():
    cfg = train.TrainConfig(learning_rate=1.0, min_lr=0.1, warmup_iters=10, lr_decay_iters=110)
    lrs = [optim.learning_rate(i, cfg) for i in range(200)]
    assert lrs[:10] == pytest.approx([(i + 1) / 11 for i in range(10)])
    assert lrs[10] == pytest.approx(1.0) and lrs[60] == pytest.approx(0.55) and lrs[110] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(lrs[10:111], lrs[11:112])) and lrs[150] == 0.1


def test_the_optimizer_runs_at_the_scheduled_learning_rate(trained):
    ckpt = torch.load(trained / "out-ok" / "ckpt.pt", weights_only=True)
    scheduled = optim.learning_rate(ckpt["iter_num"], train.TrainConfig(**ckpt["train_config"]))
    assert [g["lr"] for g in ckpt["optimizer"]["param_groups"]] == [scheduled] * 2  # decayed and not


def test_each_log_line_times_the_iterations_since_the_last_line_or_eval(workdir, monkeypatch, capsys, in_process,
                                                                         tiny_args):
    d, _ = workdir
    clock = [0.0]  # a clock that only an update moves, by one second
    real_step = train.optimizer_step

    def step(*args):
        real_step(*args)
        clock[0] += 1.0
    monkeypatch.setattr(train, "optimizer_step", step)
    monkeypatch.setattr(train, "time", SimpleNamespace(time=lambda: clock[0], perf_counter=time.perf_counter))
    args = ["--dataset=verse", "--out_dir=out-clock", *tiny_args, "--log_interval=4", "--eval_interval=3"]
    # evals at 0, 3 and 6; a resume from 6, then evals at 9, 12 and 13 (the last iteration): each
    # log line (the first of a run, then every log_interval) follows fewer than log_interval
    # iterations since the last eval, line or resume
    assert in_process(train.main, [*args, "--max_iters=6"], cwd=d) == 0
    assert in_process(train.main, [*args, "--max_iters=13", "--init_from=resume"], cwd=d) == 0
    log = capsys.readouterr().out
    timed = re.findall(r"iter (\d+): loss [\d.]+, lr \S+ ([\d.]+) ms/iter, ([\d,]+) tokens/s", log)
    assert timed == [(i, "1000.0", "64") for i in ("1", "4", "7", "8", "12")]  # 4 x 16 tokens per second
    assert re.findall(r"step (\d+):", log) == ["0", "3", "6", "9", "12", "13"]  # the resume does not evaluate 6 again


def test_best_checkpoint_is_kept_apart_from_the_latest(workdir, in_process, capsys, tiny_args):
    d, _ = workdir  # a learning rate high enough that the val loss goes up and down
    assert in_process(train.main, ["--dataset=verse", "--out_dir=out-bumpy", *tiny_args, "--learning_rate=0.2",
                                   "--min_lr=0.2", "--warmup_iters=0", "--max_iters=35", "--eval_interval=5"],
                      cwd=d) == 0
    log = capsys.readouterr().out
    evals = [(int(i), float(v)) for i, v in re.findall(r"step (\d+): train loss [\d.]+, val loss ([\d.]+)", log)]
    best_iter, best_val = min(evals, key=lambda e: e[1])
    assert best_iter != evals[-1][0]  # so that best.pt and ckpt.pt must differ
    best = torch.load(d / "out-bumpy" / "best.pt", weights_only=True)
    latest = torch.load(d / "out-bumpy" / "ckpt.pt", weights_only=True)
    assert (best["iter_num"], latest["iter_num"]) == (best_iter, 35)
    assert round(best["best_val_loss"], 4) == best_val == round(latest["best_val_loss"], 4)
    assert not torch.equal(best["model"]["lm_head.weight"], latest["model"]["lm_head.weight"])


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_between_log_lines_the_host_reads_no_tensor(workdir, in_process, monkeypatch, tiny_args, optimizer):
    """On a GPU every read of a tensor's value waits for the device: the loop reads none between log
    lines (the skip of non-finite steps is decided on the device). The batches are drawn on the host,
    from tensors in its memory, by design: their reads do not count."""
    d, _ = workdir
    reads = []

    def counted(real):
        def read(t, *args):
            if not any(f.name == "get_batch" for f in traceback.extract_stack()):
                reads.append(t)
            return real(t, *args)
        return read
    for name in ("item", "tolist", "__bool__", "__float__", "__int__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, counted(getattr(torch.Tensor, name)))
    counts = []
    for iters in (20, 40):  # the same evaluations (at 0 and at the end); 20 more iterations, one more log line
        reads.clear()
        assert in_process(train.main, ["--dataset=verse", f"--out_dir=out-reads-{optimizer}-{iters}", *tiny_args,
                                       f"--max_iters={iters}", "--log_interval=20", "--eval_interval=1000",
                                       f"--optimizer={optimizer}"], cwd=d) == 0
        counts.append(len(reads))
    assert 0 < counts[1] - counts[0] <= 3  # the log line's: the skip counts and the loss


def test_a_non_finite_loss_skips_steps_then_stops_keeping_the_last_good_checkpoint(workdir, in_process, capsys,
                                                                                    tiny_args):
    d, _ = workdir
    # a learning rate that blows the weights up
    status = in_process(train.main, ["--dataset=verse", "--out_dir=out-nan", *tiny_args, "--max_iters=100",
                                     "--eval_interval=5", "--learning_rate=1e6", "--warmup_iters=0", "--decay_lr=False",
                                     "--grad_clip=0", "--max_bad_steps=3"], cwd=d)
    log, err = capsys.readouterr()
    assert status == 1 and "Traceback" not in err
    assert re.search(r"iter \d+: \d+ steps skipped since the last log line, the loss not finite \(3 in a row", log)
    assert "the loss was not finite for 3 steps in a row; out-nan/ckpt.pt keeps iteration 0" in err
    ckpt = torch.load(d / "out-nan" / "ckpt.pt", weights_only=True)
    assert ckpt["iter_num"] == 0 and all(torch.isfinite(w).all() for w in ckpt["model"].values())


def test_a_new_run_never_overwrites_checkpoints_and_eval_only_writes_nothing(trained, in_process, refusal, capsys,
                                                                              tiny_args):
    d = trained
    before = {f: (d / "out-ok" / f).read_bytes() for f in ("ckpt.pt", "best.pt")}
    args = ["--dataset=verse", "--out_dir=out-ok", *tiny_args]
    refusal(train.main, args, "out-ok/ckpt.pt holds a run that a new one would overwrite", "--init_from=resume", cwd=d)
    # iteration 4 of the run is no multiple of 3: evaluated all the same
    for extra, at in ((["--eval_only", "--init_from=resume", "--eval_interval=3"], 4),
                      (["--eval_only", "--init_from=scratch"], 0)):
        capsys.readouterr()
        assert in_process(train.main, [*args, *extra], cwd=d) == 0
        assert re.search(rf"^step {at}: train loss [\d.]+, val loss [\d.]+", capsys.readouterr().out, re.M)
    assert {f: (d / "out-ok" / f).read_bytes() for f in before} == before


def test_a_resumed_run_may_change_attn_impl_and_dropout_and_says_which_settings_changed(trained, in_process, capsys,
                                                                                        monkeypatch, tiny_args):
    d = trained
    shutil.copytree(d / "out-ok", d / "out-kernel")
    for f in ("ckpt.pt", "best.pt"):  # as if trained through the Triton kernel on a GPU
        ckpt = torch.load(d / "out-kernel" / f, weights_only=True)
        ckpt["model_config"]["attn_impl"] = "triton"
        ckpt["model_config"]["linear_impl"] = "onednn"  # as earlier versions wrote: a run-time choice, since gone
        torch.save(ckpt, d / "out-kernel" / f)
    monkeypatch.setattr(kernels, "INTERPRET", False)  # as users run it: no interpreter
    assert in_process(sample.main, ["--out_dir=out-kernel", "--max_new_tokens=5"], cwd=d) == 0
    assert capsys.readouterr().out.strip()
    assert in_process(train.main, ["--dataset=verse", "--out_dir=out-kernel", "--init_from=resume", *tiny_args,
                                   "--attn_impl=auto", "--dropout=0.1", "--max_iters=6", "--weight_decay=0.05",
                                   "--beta2=0.5"], cwd=d) == 0
    # out-ok trained with --eval_interval=2, not given here: said, with the new max_iters (not out_dir)
    assert ("training settings changed from the checkpoint's: weight_decay 0.1 -> 0.05, beta2 0.95 -> 0.5, "
            "max_iters 4 -> 6, eval_interval 2 -> 250\n") in capsys.readouterr().out
    saved = torch.load(d / "out-kernel" / "ckpt.pt", weights_only=True)
    assert saved["iter_num"] == 6
    # and the optimizer took them up, not the checkpoint's (matrices decay, gains and biases do not)
    assert [(g["betas"], g["weight_decay"]) for g in saved["optimizer"]["param_groups"]] == [((0.9, 0.5), 0.05),
                                                                                             ((0.9, 0.5), 0.0)]
    assert [saved["model_config"][k] for k in ("attn_impl", "dropout")] == ["auto", 0.1]
    assert "linear_impl" not in saved["model_config"]


def test_init_from_auto_starts_a_run_then_resumes_it_exactly_and_refuses_another_models_checkpoint(
        workdir, in_process, refusal, files_under, capsys, losses, tiny_args):
    """What a run that torchrun --max_restarts starts again relies on (tested so under torchrun below)."""
    d, _ = workdir
    args = ["--dataset=verse", *tiny_args, "--eval_interval=2"]
    auto = [*args, "--out_dir=out-auto", "--init_from=auto"]
    assert in_process(train.main, [*auto, "--max_iters=2"], cwd=d) == 0  # an empty out_dir: a new run
    assert in_process(train.main, [*auto, "--max_iters=4"], cwd=d) == 0  # its checkpoint: resumed
    log = capsys.readouterr().out
    assert "resuming out-auto/ckpt.pt from iteration 2 (--init_from=auto)" in log and len(losses(log)) == 4
    assert in_process(train.main, [*args, "--out_dir=out-auto-straight", "--max_iters=4"], cwd=d) == 0
    a, b = (torch.load(d / out / "ckpt.pt", weights_only=True)["model"] for out in ("out-auto", "out-auto-straight"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    before = files_under(d / "out-auto")
    # another model's run is refused, not resumed with its settings: one asked for on the command line, or
    # a default that differs from the checkpoint's (which --init_from=resume would take from it, as ever)
    refusal(train.main, [*auto, "--n_layer=3"], "--n_layer=3 does not match out-auto/ckpt.pt's n_layer=2", cwd=d)
    refusal(train.main, [a for a in auto if a != "--n_embd=32"], "--init_from=auto: the default n_embd=768 does not "
            "match out-auto/ckpt.pt's n_embd=32: set --n_embd=32 to continue that run", cwd=d)
    os.makedirs(d / "out-auto-best")  # best.pt alone is no run to resume: refused as a new run over it
    shutil.copy(d / "out-auto" / "best.pt", d / "out-auto-best")
    refusal(train.main, [*args, "--out_dir=out-auto-best", "--init_from=auto"],
            "out-auto-best/best.pt holds a run that a new one would overwrite", cwd=d)
    assert {p: b for p, b in files_under(d / "out-auto").items() if p.name != ".lock"} == \
        {p: b for p, b in before.items() if p.name != ".lock"}


def test_a_run_resumes_in_another_precision(trained, in_process, capsys, tiny_args):
    d = trained
    shutil.copytree(d / "out-ok", d / "out-fp16")
    # fp32 left the loss scaler's state empty; fp16 starts a scale of its own
    assert in_process(train.main, ["--dataset=verse", "--out_dir=out-fp16", "--init_from=resume", "--dtype=float16",
                                   "--max_iters=5", *tiny_args], cwd=d) == 0
    assert "done: 5 iterations" in capsys.readouterr().out


# ----------------------------------------------------------------------------------------------
# Bad settings, data and memory: one line, nothing written

def test_train_rejects_bad_settings_in_one_line(workdir, tmp_path, refusal, monkeypatch, tiny_args):
    d, _ = workdir
    (tmp_path / "bad.py").write_text("n_head = 3\n")  # 32 wide is not divisible by 3 heads
    t5 = ("--arch=encoder-decoder", "--pos=learned")  # TINY's block_size is 16
    cases = [
        ((str(tmp_path / "bad.py"),), ["n_embd=32 is not divisible by n_head=3"]),
        (("--dataset=poems",), ["dataset 'poems' is not prepared",
                                "python prepare.py text --input='your/*.txt' --name=poems"]),
        (("--init_from=resume", "--out_dir=out-none"), ["no checkpoint at out-none/ckpt.pt"]),
        (("--out_dir=texts/part0.txt/out",), ["is not writable", "choose another --out_dir"]),
        (("--device=CPU",), ["--device=CPU is not known: choose auto, cpu, cuda, cuda:N or mps"]),
        (("--batch_size=0",), ["batch_size=0 must be at least 1"]),
        (("--eval_interval=0",), ["eval_interval=0 must be at least 1"]),
        (("--keep_checkpoints=-1",), ["keep_checkpoints=-1 must be at least 0"]),
        (("--gradient_accumulation_steps=-2",), ["gradient_accumulation_steps=-2 must be at least 1"]),
        (("--grad_clip=-1",), ["grad_clip=-1.0 must be at least 0"]),
        (("--beta1=2",), [r"beta1=2.0 must lie in [0, 1)"]),
        (("--backend=mpi",), ["backend='mpi' is not known"]),
        (("--head_size=-4",), ["head_size=-4 must be a positive integer"]),
        ((*t5, "--block_size=1"), ["span corruption hides part of each sequence: block_size=1"]),
        ((*t5, "--noise_density=0.95"), ["gives the decoder 17 tokens, more than the 16 learned"]),
        ((*t5, "--block_size=1000", "--mean_span=1"), ["needs 151 sentinels, more than 100"]),
    ]
    if not torch.cuda.is_available():
        cases.append((("--device=cuda",), ["--device=cuda but torch sees no CUDA GPU", "--device=cpu"]))
    # each run its own out_dir: runs that get as far as taking it would refuse one another
    for i, (args, fragments) in enumerate(cases):
        refusal(train.main, ["--dataset=verse", f"--out_dir=out-bad{i}", *tiny_args, *args], *fragments, cwd=d)
    if not torch.cuda.is_available():  # (tests run the kernel in Triton's interpreter; users do not)
        monkeypatch.setattr(kernels, "INTERPRET", False)
        refusal(train.main, ["--dataset=verse", "--out_dir=out-bad-triton", *tiny_args, "--attn_impl=triton"],
                "attn_impl='triton' runs on CUDA GPUs", cwd=d)
    for k, v in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="2").items():  # as torchrun starts rank 0 of 2
        monkeypatch.setenv(k, v)
    refusal(train.main, ["--dataset=verse", "--out_dir=out-bad-ddp", *tiny_args, "--gradient_accumulation_steps=3"],
            "gradient_accumulation_steps=3 is not divisible by the 2 processes", cwd=d)
    assert not list(d.glob("out-bad*"))  # a run that stops before its first checkpoint leaves no out_dir


def edit_meta(path, edit):
    import json
    meta = json.loads((path / "meta.json").read_text())
    edit(meta)
    (path / "meta.json").write_text(json.dumps(meta))


def test_train_refuses_damaged_data_in_one_line(workdir, refusal, tiny_args):
    d, _ = workdir
    for name, damage in [("no-val", lambda p: os.remove(p / "val.bin")),
                         ("empty-val", lambda p: open(p / "val.bin", "wb").close()),
                         ("cut-meta", lambda p: (p / "meta.json").write_text((p / "meta.json").read_text()[:20])),
                         ("list-meta", lambda p: (p / "meta.json").write_text("[1, 2]")),
                         ("no-vocab", lambda p: edit_meta(p, lambda m: m.pop("vocab_size"))),
                         ("text-vocab", lambda p: edit_meta(p, lambda m: m.update(vocab_size=str(m["vocab_size"])))),
                         ("zero-vocab", lambda p: edit_meta(p, lambda m: m.update(vocab_size=0))),
                         ("no-tokenizer", lambda p: edit_meta(p, lambda m: m.pop("tokenizer"))),
                         ("short-chars", lambda p: edit_meta(p, lambda m: m["vocab"].pop())),
                         ("bad-dtype", lambda p: edit_meta(p, lambda m: m.update(dtype="uint12")))]:
        shutil.copytree(d / "data" / "verse", d / "data" / name)
        damage(d / "data" / name)
        refusal(train.main, [f"--dataset={name}", f"--out_dir=out-{name}", *tiny_args],
                f"dataset '{name}' is damaged", "prepare it again", cwd=d)
        assert not (d / f"out-{name}").exists()


@pytest.mark.slow
def test_train_out_of_memory_stops_in_one_line_and_keeps_the_checkpoints(trained, run, one_line_error, refusal,
                                                                         monkeypatch, tiny_args):
    d = trained
    shutil.copytree(d / "out-ok", d / "out-oom")
    before = {f: (d / "out-oom" / f).read_bytes() for f in ("ckpt.pt", "best.pt")}
    # 50,000 sequences: gigabytes of activations, more than the 3 GiB the system grants here
    one_line_error(run("train.py", "--dataset=verse", *tiny_args, "--batch_size=50000", "--out_dir=out-oom",
                       "--init_from=resume", cwd=d, max_memory_bytes=3 * 2**30),
                   "out of memory (asked for", "GiB more): lower --batch_size", "raising --gradient_accumulation_steps",
                   "checkpoints already in out_dir are as they were")
    assert {f: (d / "out-oom" / f).read_bytes() for f in before} == before

    def forward(*args, **kwargs):  # what torch's CPU allocator raises where the system refuses memory
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
                           "you tried to allocate 3276800000 bytes. Error code 12 (Cannot allocate memory)")
    monkeypatch.setattr(train.Transformer, "forward", forward)  # a new run's first forward pass
    refusal(train.main, ["--dataset=verse", *tiny_args, "--out_dir=out-oom-new"],
            "out of memory (asked for 3.1 GiB more): lower --batch_size", "raising --gradient_accumulation_steps",
            "checkpoints already in out_dir are as they were", cwd=d)
    assert not (d / "out-oom-new").exists()  # the out_dir made for it goes with it


# ----------------------------------------------------------------------------------------------
# Signals: a checkpoint, then a quiet stop

@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_sigint_or_sigterm_saves_a_checkpoint_and_exits_cleanly(workdir, sig, start, wait_for, in_process, capsys,
                                                               losses, tiny_args):
    d, _ = workdir
    args = ["--dataset=verse", f"--out_dir=out-{sig.name}", *tiny_args, "--eval_interval=1000000"]
    p = start("train.py", *args, "--max_iters=1000000", cwd=d)
    wait_for(p.stdout, "iter 3:")  # it trains, its handlers installed (they are before its first line)
    p.send_signal(sig)
    out_text, err = p.communicate(timeout=300)
    assert p.returncode == 128 + sig and "Traceback" not in err
    saved = torch.load(d / f"out-{sig.name}" / "ckpt.pt", weights_only=True)["iter_num"]
    assert saved >= 3 and f"stopped by {sig.name} at iteration {saved}" in out_text
    capsys.readouterr()
    assert in_process(train.main, [*args, "--init_from=resume", f"--max_iters={saved + 3}"], cwd=d) == 0
    assert len(losses(capsys.readouterr().out)) == 3


def test_ctrl_c_cuts_a_long_evaluation_short_and_the_resumed_run_evaluates_again(trained, start, wait_for,
                                                                                 in_process, capsys, losses,
                                                                                 tiny_args):
    d = trained
    shutil.copytree(d / "out-ok", d / "out-long-eval")  # iteration 4, evaluated there
    args = ["--dataset=verse", "--out_dir=out-long-eval", *tiny_args, "--eval_interval=5", "--max_iters=5",
            "--init_from=resume"]
    p = start("train.py", *args, "--eval_iters=1000000", cwd=d)  # an evaluation of minutes at iteration 5
    wait_for(p.stdout, "iter 5:")  # the last log line before that evaluation
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=300)
    assert p.returncode == 130 and "Traceback" not in err, err
    assert "stopped by SIGINT at iteration 5" in out and "step 5:" not in out
    assert torch.load(d / "out-long-eval" / "ckpt.pt", weights_only=True)["iter_num"] == 5
    capsys.readouterr()
    assert in_process(train.main, [*args, "--max_iters=6"], cwd=d) == 0
    log = capsys.readouterr().out  # 5 evaluated first, then iteration 6 trained (and evaluated: the last)
    assert re.findall(r"step (\d+):", log)[0] == "5" and len(losses(log)) == 1


def test_ctrl_c_while_torch_loads_exits_quietly(workdir, start, wait_for, tiny_args):
    d, _ = workdir
    # -X importtime prints a line as each module finishes loading: the first of torch's own modules
    # comes while torch's import, which takes seconds, is under way
    p = start(sys.executable, "-X", "importtime", os.path.join(HERE, "train.py"), "--dataset=verse",
              "--out_dir=out-early", *tiny_args, cwd=d)
    wait_for(p.stderr, lambda line: line.split("| ")[-1].strip().startswith("torch."))
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=300)
    assert p.returncode == 130 and "Traceback" not in err and out == "" and not (d / "out-early").exists(), err


# ----------------------------------------------------------------------------------------------
# DDP under torchrun

@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_two_process_torchrun_on_cpu_trains_ranks_agree_and_ends_with_the_parameters_of_one_process(
        optimizer, workdir, run, in_process, capsys, losses, tiny_args):
    d, _ = workdir
    args = ["--dataset=verse", "--max_iters=4", "--eval_interval=2", "--gradient_accumulation_steps=2",
            f"--optimizer={optimizer}", *tiny_args]
    shutil.rmtree(d / "out-ddp", ignore_errors=True)
    shutil.rmtree(d / "out-one", ignore_errors=True)
    code, log, err = run(TORCHRUN, "--standalone", "--nproc_per_node=2", os.path.join(HERE, "train.py"),
                         "--out_dir=out-ddp", *args, cwd=d)
    assert code == 0, err
    assert "on 2 x cpu" in log and len(losses(log)) == 4
    assert "ranks agree: max parameter difference 0" in log
    # the same global batch in one process: the same logged losses (the mean over the ranks) and parameters
    capsys.readouterr()
    assert in_process(train.main, ["--out_dir=out-one", *args], cwd=d) == 0
    assert losses(capsys.readouterr().out) == pytest.approx(losses(log), abs=1e-4)
    a = torch.load(d / "out-one" / "ckpt.pt", weights_only=True)["model"]
    b = torch.load(d / "out-ddp" / "ckpt.pt", weights_only=True)["model"]
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)
    # its checkpoint is an ordinary one: it samples, and resumes in one process
    capsys.readouterr()
    assert in_process(sample.main, ["--out_dir=out-ddp", "--max_new_tokens=5", "--start=LEAR:"], cwd=d) == 0
    assert capsys.readouterr().out.startswith("LEAR:")
    assert in_process(train.main, ["--out_dir=out-ddp", *args, "--max_iters=5", "--init_from=resume"], cwd=d) == 0
    assert len(losses(capsys.readouterr().out)) == 1


@pytest.mark.slow
def test_under_torchrun_a_bad_setting_is_reported_once(workdir, run, tiny_args):
    d, _ = workdir
    code, _, err = run(TORCHRUN, "--standalone", "--nproc_per_node=2", os.path.join(HERE, "train.py"),
                       "--dataset=verse", "--batchsize=4", *tiny_args, cwd=d)
    # torchrun adds its own report of the failed processes after our line; the line comes once
    # (a setting that only a number of processes makes bad: test_train_rejects_bad_settings_in_one_line)
    assert code != 0 and err.count("train.py: error: unknown setting 'batchsize': did you mean --batch_size?") == 1


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the ranks through /proc")
def test_a_crashed_rank_makes_the_others_exit_instead_of_hanging(workdir, start, wait_for, children, tiny_args):
    d, _ = workdir
    p = start(TORCHRUN, "--standalone", "--nproc_per_node=2", os.path.join(HERE, "train.py"), "--dataset=verse",
              "--out_dir=out-crash", "--max_iters=1000000", "--eval_interval=1000000",
              "--gradient_accumulation_steps=2", *tiny_args, cwd=d, start_new_session=True)
    wait_for(p.stdout, "iter 2:")  # both ranks train (each iteration waits for the other's gradients)
    os.kill(max(children(p.pid)), signal.SIGKILL)  # one of the two ranks dies without a word
    p.communicate(timeout=300)  # rather than waiting for the dead rank's gradients (30 minutes, gloo's timeout)
    assert p.returncode != 0


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the ranks through /proc")
def test_torchrun_max_restarts_with_init_from_auto_survives_a_killed_rank_and_ends_as_a_run_never_killed(
        workdir, run, start, wait_for, children, tiny_args):
    """A night's run: one of the two ranks dies (SIGKILL) after a checkpoint, with iterations trained past
    it; torchrun starts both again, they resume from ckpt.pt, and the run ends with the weights, the
    kept checkpoints and the metrics of the same run never killed (both under torchrun: bit for bit)."""
    d, _ = workdir
    args = [os.path.join(HERE, "train.py"), "--dataset=verse", "--init_from=auto", "--max_iters=30",
            "--eval_interval=5", "--gradient_accumulation_steps=2", "--keep_checkpoints=2", *tiny_args]
    p = start(TORCHRUN, "--standalone", "--nproc_per_node=2", "--max_restarts=3", *args, "--out_dir=out-killed",
              cwd=d, start_new_session=True)
    wait_for(p.stdout, "iter 7:")  # ckpt.pt holds iteration 5, and the ranks train past it
    ranks = {int(re.search(r"\0RANK=(\d+)\0", "\0" + open(f"/proc/{pid}/environ").read())[1]): pid
             for pid in children(p.pid)}
    os.kill(ranks[0], signal.SIGKILL)  # the rank that writes the checkpoints and metrics
    log, err = p.communicate(timeout=300)
    assert p.returncode == 0, err
    resumed = re.findall(r"resuming out-killed/ckpt.pt from iteration (\d+) \(--init_from=auto\)", log)
    assert len(resumed) == 1 and 5 <= int(resumed[0]) < 30, log  # started again once, from a checkpoint
    assert "connectFullMesh" not in err  # no rank of the new start looked for one of the old (join_ranks)
    code, _, err = run(TORCHRUN, "--standalone", "--nproc_per_node=2", *args, "--out_dir=out-never-killed", cwd=d)
    assert code == 0, err
    for name in ("ckpt.pt", "ckpt-25.pt", "ckpt-30.pt"):
        a, b = (torch.load(d / out / name, weights_only=True)["model"] for out in ("out-killed", "out-never-killed"))
        assert all(torch.equal(a[k], b[k]) for k in a), name
    assert sorted(p.name for p in (d / "out-killed").glob("ckpt-*")) == ["ckpt-25.pt", "ckpt-30.pt"]
    # one history: the lines that the killed ranks wrote past their checkpoint are gone, none twice
    history = [[(r["iter"], r.get("loss"), r.get("lr"), r.get("val_loss")) for r in
                map(json.loads, (d / out / "metrics.jsonl").read_text().splitlines())]
               for out in ("out-killed", "out-never-killed")]
    assert history[0] == history[1] and [i for i, loss, _, _ in history[0] if loss is not None] == list(range(1, 31))


# ----------------------------------------------------------------------------------------------
# After training: what is sampled is what was trained; progress from the first seconds

def test_a_run_evaluates_at_its_last_iteration_so_both_checkpoints_know_its_end(workdir, in_process, capsys,
                                                                                 tiny_args):
    d, _ = workdir
    args = ["--dataset=verse", "--out_dir=out-end", *tiny_args, "--max_iters=7", "--eval_interval=5"]
    assert in_process(train.main, args, cwd=d) == 0
    log = capsys.readouterr().out
    assert re.findall(r"step (\d+):", log) == ["0", "5", "7"]
    last_val = float(re.search(r"step 7: train loss \S+, val loss ([\d.]+)", log)[1])
    latest = torch.load(d / "out-end" / "ckpt.pt", weights_only=True)
    assert latest["iter_num"] == latest["evaluated_at"] == 7 and latest["val_loss"] == pytest.approx(last_val, abs=1e-4)
    best = torch.load(d / "out-end" / "best.pt", weights_only=True)
    assert best["val_loss"] == best["best_val_loss"] == min(latest["best_val_loss"], best["val_loss"])


def test_a_finished_run_resumed_has_nothing_to_do_and_a_resume_takes_the_runs_own_dataset(workdir, in_process,
                                                                                          capsys, tiny_args):
    d, _ = workdir
    args = ["--dataset=verse", "--out_dir=out-finished", *tiny_args, "--max_iters=3", "--eval_interval=2"]
    assert in_process(train.main, args, cwd=d) == 0
    capsys.readouterr()
    before = (d / "out-finished" / "ckpt.pt").read_bytes()
    resume = ["--out_dir=out-finished", "--init_from=resume", *tiny_args]  # no --dataset: the run's own, verse
    assert in_process(train.main, [*resume, "--max_iters=3"], cwd=d) == 0
    out = capsys.readouterr().out
    assert "out-finished/ckpt.pt is at iteration 3 of max_iters=3: nothing to do" in out and "raise --max_iters" in out
    assert "done:" not in out and (d / "out-finished" / "ckpt.pt").read_bytes() == before
    assert in_process(train.main, [*resume, "--max_iters=4"], cwd=d) == 0
    out = capsys.readouterr().out
    assert re.findall(r"step (\d+):", out) == ["4"] and "iter 4: loss" in out


def test_the_first_iteration_and_a_long_evaluation_show_at_once_and_a_cpu_gets_no_mfu(workdir, in_process, capsys,
                                                                                      monkeypatch, tiny_args):
    d, _ = workdir
    monkeypatch.setattr(train, "EVAL_NOTICE_S", 0)  # every evaluation counts as a long one
    args = ["--dataset=verse", "--out_dir=out-progress", *tiny_args, "--max_iters=3", "--log_interval=100",
            "--eval_interval=100"]
    assert in_process(train.main, args, cwd=d) == 0
    log = capsys.readouterr().out.splitlines()
    notice = [i for i, line in enumerate(log) if re.fullmatch(r"step 0: evaluating 4 batches per rank, about \d+ s", line)]
    assert notice and log[notice[0] + 1].startswith("step 0: train loss")  # said before its result
    iters = [line for line in log if line.startswith("iter ")]
    assert len(iters) == 1 and re.fullmatch(r"iter 1: loss \S+, lr \S+, \S+ ms/iter, \S+ tokens/s, 64/192 tokens, "
                                            r"\d+:\d\d:\d\d left", iters[0])  # 4 x 16 tokens an iteration, of 3
    assert not any("mfu" in line.lower() for line in log)
