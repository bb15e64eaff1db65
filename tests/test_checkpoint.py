"""Checkpoints (checkpoint.py): saved atomically, so that a kill or a full disk mid-save leaves the
previous one whole; loaded with weights_only, so that a file that would run code is refused; a
broken, foreign or mismatched one refused in one line that says what to do; out_dir locked while
a run writes it."""

import glob
import os
import re
import shutil
import signal
import sys

import pytest
import torch

import checkpoint
import prepare
import sample
import train

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root


# ----------------------------------------------------------------------------------------------
# Loading: weights only, and a run that can be resumed

class RunsCode:
    """What a malicious checkpoint could carry: an object whose unpickling runs code (here it
    creates a marker file)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def test_a_checkpoint_that_would_run_code_when_loaded_is_refused_and_nothing_runs(trained, files_under, refusal,
                                                                                  tiny_args):
    d = trained
    marker, planted = d / "code-ran", d / "out-planted"
    ckpt = torch.load(d / "out-ok" / "ckpt.pt", weights_only=True)
    ckpt["meta"]["note"] = RunsCode(marker)
    os.makedirs(planted)
    for f in ("ckpt.pt", "best.pt"):
        torch.save(ckpt, planted / f)
    torch.load(planted / "ckpt.pt", weights_only=False)  # the plant works: unrestricted loading runs it
    assert marker.exists()
    marker.unlink()
    before = files_under(planted)
    resume = ["--dataset=verse", "--out_dir=out-planted", "--init_from=resume", *tiny_args]
    for main, argv in ((sample.main, ["--out_dir=out-planted"]), (train.main, [*resume, "--eval_only=True"]),
                       (train.main, [*resume, "--max_iters=6"])):
        refusal(main, argv, "out-planted/", "holds objects that loading would have to run code for (",
                "so it is not loaded", cwd=d)
    assert not marker.exists()
    assert {p: b for p, b in files_under(planted).items() if p.name != ".lock"} == before  # nothing changed


def test_train_rejects_broken_or_mismatched_checkpoints(trained, refusal, in_process, tiny_args):
    d = trained

    def write(name, data=None, edit=lambda ckpt: None):  # a copy of out-ok's checkpoint, edited
        os.makedirs(d / f"out-{name}", exist_ok=True)
        if data is not None:
            (d / f"out-{name}" / "ckpt.pt").write_bytes(data)
        else:
            ckpt = torch.load(d / "out-ok" / "ckpt.pt", weights_only=True)
            edit(ckpt)
            torch.save(ckpt, d / f"out-{name}" / "ckpt.pt")

    # a checkpoint from before gelu_approximate existed was trained with its default, the tanh form
    for name in ("old", "old-resumed"):
        write(name, edit=lambda c: c["model_config"].pop("gelu_approximate"))
    write("lacking", edit=lambda c: c.pop("optimizer"))
    write("newer", edit=lambda c: c["model_config"].update(n_predict=4))  # a setting from a later version
    whole = (d / "out-ok" / "ckpt.pt").read_bytes()
    write("truncated", data=whole[: len(whole) // 2])
    write("garbage", data=os.urandom(4096))
    write("truncated-best", data=whole[: len(whole) // 2])
    (d / "out-truncated-best" / "best.pt").write_bytes((d / "out-ok" / "best.pt").read_bytes())
    for i in range(3):  # the same text with "a" spelt "@": as many characters, other ones
        os.makedirs(d / "texts-at", exist_ok=True)
        (d / "texts-at" / f"{i}.txt").write_text((d / "texts" / f"part{i}.txt").read_text("utf-8").replace("a", "@"),
                                                 "utf-8")
    in_process(prepare.main, ["text", "--input=texts-at/*.txt", "--name=verse-at", "--tokenizer=char"], cwd=d)
    cases = [
        (("out-ok", "--n_layer=3"),
         ["--n_layer=3 does not match out-ok/ckpt.pt's n_layer=2", "set --n_layer=2 or drop it"]),
        (("out-old", "--gelu_approximate=none"),
         ["--gelu_approximate='none' does not match out-old/ckpt.pt's gelu_approximate='tanh'"]),
        (("out-ok", "--dataset=verse-at"),
         ["was trained on other data", "than verse-at: resume with --dataset=verse"]),
        (("out-lacking",), ["out-lacking/ckpt.pt is not a nanoformer checkpoint (it lacks ['optimizer'])"]),
        (("out-newer",), ["model settings this model.py does not know (n_predict)", "another version of nanoformer"]),
        (("out-truncated",), ["is not a readable checkpoint", "truncated or corrupted"]),
        (("out-garbage",), ["is not a readable checkpoint", "truncated or corrupted"]),
        (("out-truncated-best",), ["copy out-truncated-best/best.pt to out-truncated-best/ckpt.pt to resume from "
                                   "the best checkpoint"]),
    ]
    resume = lambda out, *a: ["--dataset=verse", f"--out_dir={out}", "--init_from=resume", *tiny_args, *a]  # noqa: E731
    for args, fragments in cases:
        message = refusal(train.main, resume(*args), *fragments, cwd=d)
        if args[0] in ("out-truncated", "out-garbage"):
            assert "best.pt" not in message  # there is none to fall back on
    assert in_process(train.main, resume("out-old-resumed", "--max_iters=5"), cwd=d) == 0  # the old checkpoint resumes


def test_an_out_dir_with_only_best_pt_is_told_how_to_go_on(trained, refusal, tiny_args):
    d = trained
    os.makedirs(d / "out-best-only")
    shutil.copy(d / "out-ok" / "best.pt", d / "out-best-only")
    refusal(train.main, ["--dataset=verse", "--out_dir=out-best-only", "--init_from=resume", *tiny_args],
            "no checkpoint at out-best-only/ckpt.pt: copy out-best-only/best.pt to out-best-only/ckpt.pt", cwd=d)
    refusal(sample.main, ["--out_dir=out-best-only", "--ckpt=latest"],
            "no checkpoint at out-best-only/ckpt.pt: try --ckpt=best", cwd=d)


# ----------------------------------------------------------------------------------------------
# The out_dir lock

@pytest.mark.slow
def test_a_second_run_is_refused_while_another_writes_the_same_out_dir(workdir, start, wait_for, refusal, in_process,
                                                                       tiny_args):
    d, _ = workdir
    args = ["--dataset=verse", "--out_dir=out-busy", *tiny_args, "--eval_interval=2", "--max_iters=1000000"]
    first = start("train.py", *args, cwd=d)
    wait_for(first.stdout, "iter 3:")  # it has saved a checkpoint and trains on
    stray = d / "out-busy" / "ckpt.pt.tmp.999999999"  # stands for the file of a save in progress
    stray.write_bytes(b"half a checkpoint")
    for extra in (["--max_iters=10"], ["--init_from=resume", "--max_iters=10"]):
        refusal(train.main, [*args, *extra], f"out_dir 'out-busy' is in use by another train.py (process {first.pid})",
                "choose another --out_dir", cwd=d)
        assert stray.exists()  # nothing of the running one was touched
    first.send_signal(signal.SIGINT)
    _, err = first.communicate(timeout=300)
    assert first.returncode == 130, err
    assert in_process(train.main, [*args, "--init_from=resume", "--max_iters=1"], cwd=d) == 0  # the lock went with it
    assert not stray.exists()


# ----------------------------------------------------------------------------------------------
# Saving: atomic, whatever stops it

# train.py, run as `python train.py ARGS` would run it, whose process dies (SIGKILL) halfway
# through writing a ckpt.pt over an earlier one: torch.save writes half of the bytes, then the kill
KILL_MID_SAVE = """
import io, os, runpy, signal, sys
import torch
real_save = torch.save

def save(obj, f, *args, **kwargs):
    final = f.name.split(".tmp.")[0]
    if final.endswith("ckpt.pt") and os.path.exists(final):
        whole = io.BytesIO()
        real_save(obj, whole, *args, **kwargs)
        f.write(whole.getvalue()[: whole.tell() // 2])
        f.flush()
        print(f"killed after {whole.tell() // 2} of {whole.tell()} bytes", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    real_save(obj, f, *args, **kwargs)

torch.save = save
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(sys.argv[0]))
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_keep_checkpoints_keeps_the_last_n_states_of_ckpt_pt_each_one_that_resumes(workdir, in_process, monkeypatch,
                                                                                   capsys, tiny_args):
    d, _ = workdir
    args = ["--dataset=verse", *tiny_args, "--eval_interval=2", "--keep_checkpoints=2"]
    kept = lambda out: sorted(p.name for p in (d / out).glob("ckpt-*"))  # noqa: E731
    assert in_process(train.main, [*args, "--out_dir=out-keep", "--max_iters=7"], cwd=d) == 0  # saves 0, 2, 4, 6, 7
    assert kept("out-keep") == ["ckpt-6.pt", "ckpt-7.pt"]
    assert (d / "out-keep" / "ckpt-7.pt").read_bytes() == (d / "out-keep" / "ckpt.pt").read_bytes()
    assert os.stat(d / "out-keep" / "ckpt-7.pt").st_nlink == 2  # a hard link: no bytes written twice
    # a kept state is a checkpoint like any: the run from 6 again ends where the run did
    os.makedirs(d / "out-keep-6")
    shutil.copy(d / "out-keep" / "ckpt-6.pt", d / "out-keep-6" / "ckpt.pt")
    assert in_process(train.main, [*args, "--out_dir=out-keep-6", "--max_iters=7", "--init_from=resume"], cwd=d) == 0
    a, b = (torch.load(d / out / "ckpt.pt", weights_only=True)["model"] for out in ("out-keep", "out-keep-6"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    # a file system without hard links gets copies, written as a checkpoint is
    def no_links(src, dst):
        raise PermissionError(1, "Operation not permitted")
    monkeypatch.setattr(checkpoint.os, "link", no_links)
    assert in_process(train.main, [*args, "--out_dir=out-keep-copy", "--max_iters=5"], cwd=d) == 0
    assert kept("out-keep-copy") == ["ckpt-4.pt", "ckpt-5.pt"] and not glob.glob(str(d / "out-keep-copy" / "*.tmp.*"))
    assert (d / "out-keep-copy" / "ckpt-5.pt").read_bytes() == (d / "out-keep-copy" / "ckpt.pt").read_bytes()
    assert os.stat(d / "out-keep-copy" / "ckpt-5.pt").st_nlink == 1
    assert kept("out-keep-6") == ["ckpt-7.pt"]  # it saved 7 alone (6 was its start)


@pytest.mark.slow
def test_killing_the_process_mid_save_leaves_the_previous_checkpoint_loadable(workdir, run, in_process, capsys,
                                                                              losses, tiny_args):
    d, _ = workdir
    out = d / "out-kill"
    args = ["--dataset=verse", "--out_dir=out-kill", *tiny_args, "--eval_interval=1"]
    code, log, err = run(sys.executable, "-c", KILL_MID_SAVE, os.path.join(HERE, "train.py"), *args,
                         "--max_iters=1000", cwd=d)
    assert code == -signal.SIGKILL, err  # killed in its second save of ckpt.pt, at iteration 1
    written, whole = map(int, re.search(r"killed after (\d+) of (\d+) bytes", log).groups())
    partial = glob.glob(str(out / "ckpt.pt.tmp.*"))
    assert len(partial) == 1 and 0 < os.path.getsize(partial[0]) == written < whole
    before = torch.load(out / "ckpt.pt", weights_only=True)["iter_num"]
    assert before == 0
    capsys.readouterr()
    assert in_process(train.main, [*args, "--init_from=resume", f"--max_iters={before + 2}"], cwd=d) == 0
    assert losses(capsys.readouterr().out) and torch.load(out / "ckpt.pt", weights_only=True)["iter_num"] == before + 2
    assert not glob.glob(str(out / "*.tmp.*"))  # the half-written file is cleared away


@pytest.mark.slow
def test_a_full_disk_during_a_save_keeps_the_previous_checkpoints_whole(trained, run, one_line_error, in_parallel,
                                                                        in_process, tiny_args):
    d = trained
    for out in ("out-full", "out-full-probe"):
        shutil.copytree(d / "out-ok", d / out)
    assert in_process(train.main, ["--dataset=verse", "--out_dir=out-full-kept", *tiny_args, "--max_iters=4",
                                   "--eval_interval=2", "--keep_checkpoints=2"], cwd=d) == 0  # ckpt-2.pt, ckpt-4.pt
    saved = {p.name: p.read_bytes() for p in (d / "out-full-kept").glob("*.pt")}
    limit = os.path.getsize(d / "out-ok" / "ckpt.pt") // 2  # no file may grow past this: a save fails halfway
    def resume(out, limit, *args):
        return run("train.py", "--dataset=verse", f"--out_dir={out}", "--init_from=resume", *tiny_args,
                   "--max_iters=6", "--eval_interval=2", *args, cwd=d, max_file_bytes=limit)
    halfway, kept, none, new = in_parallel(
        lambda: resume("out-full", limit),
        # a run that keeps one state, whose save fails: the two it kept stay (they go only after a new one is whole)
        lambda: resume("out-full-kept", limit, "--keep_checkpoints=1"),
        lambda: resume("out-full-probe", 1),  # a disk with no room at all is found before training starts
        lambda: run("train.py", "--dataset=verse", "--out_dir=out-full-new", *tiny_args, cwd=d, max_file_bytes=1))
    # the operating system's reason (here the file size limit's), not torch.save's internal message
    one_line_error(halfway, "could not write out-full/", "(File too large); the previous checkpoint is intact")
    one_line_error(kept, "could not write out-full-kept/", "(File too large); the previous checkpoint is intact")
    assert sorted(saved) == ["best.pt", "ckpt-2.pt", "ckpt-4.pt", "ckpt.pt"]
    assert {p.name: p.read_bytes() for p in (d / "out-full-kept").glob("*.pt")} == saved
    assert not glob.glob(str(d / "out-full-kept" / "*.tmp.*"))
    one_line_error(none, "out_dir 'out-full-probe' is not writable (File too large): free some space, "
                         "or choose another --out_dir")
    one_line_error(new, "out_dir 'out-full-new' is not writable (File too large)")
    for out in ("out-full", "out-full-probe"):
        for f in ("ckpt.pt", "best.pt"):
            assert (d / out / f).read_bytes() == (d / "out-ok" / f).read_bytes()
        assert not glob.glob(str(d / out / "*.tmp.*"))
        assert not glob.glob(str(d / out / ".write-test.*"))  # the probe that found it is gone too
    assert not (d / "out-full-new").exists()  # made for the run, and removed with its probe


@pytest.mark.slow
def test_under_torchrun_a_full_disk_stops_every_rank_with_one_line(trained, run, tiny_args):
    d = trained
    shutil.copytree(d / "out-ok", d / "out-full-ddp")
    limit = os.path.getsize(d / "out-ok" / "ckpt.pt") // 2
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    code, _, err = run(torchrun, "--standalone", "--nproc_per_node=2", os.path.join(HERE, "train.py"),
                       "--dataset=verse", "--out_dir=out-full-ddp", "--init_from=resume", *tiny_args, "--max_iters=6",
                       "--eval_interval=2", "--gradient_accumulation_steps=2", cwd=d, max_file_bytes=limit)
    # rank 0 says why; rank 1 stops with it instead of a traceback at its next collective
    assert code != 0 and err.count("train.py: error: could not write out-full-ddp/") == 1, err
    assert "[rank1]" not in err and "Connection closed" not in err, err
    for f in ("ckpt.pt", "best.pt"):
        assert (d / "out-full-ddp" / f).read_bytes() == (d / "out-ok" / f).read_bytes()


def test_the_loaded_checkpoint_is_named_with_its_iteration_and_val_loss_and_a_newer_unevaluated_latest(trained,
                                                                                                       tmp_path):
    run = tmp_path / "run"
    shutil.copytree(trained / "out-ok", run)
    best = torch.load(run / "best.pt", weights_only=True)
    _, ckpt = checkpoint.load_run(str(run))
    it = best["iter_num"]
    assert checkpoint.describe(ckpt) == f"{run / 'best.pt'}: iteration {it}, val loss {best['val_loss']:.4f}"
    latest = torch.load(run / "ckpt.pt", weights_only=True)
    latest.update(iter_num=it + 5, evaluated_at=it)  # trained on past best.pt, not evaluated since (a Ctrl-C)
    torch.save(latest, run / "ckpt.pt")
    assert checkpoint.describe(ckpt).endswith(f"; {run / 'ckpt.pt'} trained on to iteration {it + 5} with no "
                                              "evaluation since: --ckpt=latest samples it")
    _, newer = checkpoint.load_run(str(run), "latest")
    assert checkpoint.describe(newer) == f"{run / 'ckpt.pt'}: iteration {it + 5}, not evaluated since iteration {it}"
