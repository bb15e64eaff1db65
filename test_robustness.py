"""Bad input gets one line that names the problem and the fix, exit status 2 and no traceback; and
no failure loses training: atomic checkpoints, signals, exact resume, non-finite losses, DDP."""

import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

import common
import train
from test_scripts import HERE, TINY, files_under, in_parallel, losses, one_line_error, run
from test_scripts import workdir  # noqa: F401  (a fixture)


@pytest.fixture(scope="module")
def trained(workdir):  # noqa: F811
    """A small decoder trained for a few iterations, with its checkpoints."""
    d, _ = workdir
    code, _, err = run("train.py", "--dataset=verse", "--out_dir=out-ok", "--max_iters=4", "--eval_interval=2", *TINY,
                       cwd=d)
    assert code == 0, err
    return d


# ----------------------------------------------------------------------------------------------
# prepare.py

@pytest.mark.parametrize("args, fragments", [
    (["text", "--input=nothing/*.txt", "--name=x"], ["matches no file", "quote the glob"]),
    (["text", "--input=texts/*.txt"], ["needs --input", "--name"]),
    (["text", "--input=texts/*.txt", "--name=../x"], ["--name='../x' is a path", "--data_dir"]),
    (["wikipedia"], ["dataset='wikipedia' is not known", "choose 'shakespeare_char'"]),
    (["text", "--input=empty.txt", "--name=x"], ["is empty"]),
    (["text", "--input=latin1.txt", "--name=x", "--tokenizer=char"], ["is not UTF-8", "iconv"]),
    (["text", "--input=texts/*.txt", "--name=x", "--data_dir=texts/part0.txt"], ["cannot write", "--data_dir"]),
])
def test_prepare_rejects_bad_input_in_one_line(workdir, args, fragments):  # noqa: F811
    d, _ = workdir
    (d / "empty.txt").write_bytes(b"")
    (d / "latin1.txt").write_bytes("Roméo et Juliette\n".encode("latin-1"))
    one_line_error(run("prepare.py", *args, cwd=d), *fragments)
    assert not os.path.exists(d / "data" / "x")


# ----------------------------------------------------------------------------------------------
# train.py

def test_train_rejects_bad_settings_in_one_line(workdir, tmp_path):  # noqa: F811
    d, _ = workdir
    # each run its own out_dir: runs that get as far as taking it would refuse one another
    train = lambda i, *a, env=None: run("train.py", "--dataset=verse", f"--out_dir=out-bad{i}", *TINY, *a,  # noqa: E731
                                        cwd=d, env=env)
    (tmp_path / "bad.py").write_text("n_head = 3\n")  # 32 wide is not divisible by 3 heads
    t5 = ("--arch=encoder-decoder", "--pos=learned")  # TINY's block_size is 16
    cases = [
        (("--lerning_rate=1e-3",), ["unknown setting 'lerning_rate'", "did you mean --learning_rate?"]),
        (("--max_iters=many",), ["max_iters='many' should be int"]),
        (("configs/nope.py",), ["config file 'configs/nope.py' not found"]),
        ((os.path.join(HERE, "configs"),), ["configs' is a folder: give a config file such as configs/shakespeare_char.py, or did you mean --out_dir="]),
        (("--lerning_rate",), ["unknown setting 'lerning_rate'", "did you mean --learning_rate?"]),
        (("--max_iters",), ["'--max_iters' has no value: write --max_iters=VALUE"]),
        ((str(tmp_path / "bad.py"),), ["n_embd=32 is not divisible by n_head=3"]),
        (("--dataset=poems",), ["dataset 'poems' is not prepared",
                                "python prepare.py text --input='your/*.txt' --name=poems"]),
        (("--init_from=resume", "--out_dir=out-none"), ["no checkpoint at out-none/ckpt.pt"]),
        (("--out_dir=texts/part0.txt/out",), ["is not writable", "choose another --out_dir"]),
        (("--device=CPU",), ["--device=CPU is not known: choose auto, cpu, cuda, cuda:N or mps"]),
        (("--batch_size=0",), ["batch_size=0 must be at least 1"]),
        (("--eval_interval=0",), ["eval_interval=0 must be at least 1"]),
        (("--gradient_accumulation_steps=-2",), ["gradient_accumulation_steps=-2 must be at least 1"]),
        (("--grad_clip=-1",), ["grad_clip=-1.0 must be at least 0"]),
        (("--beta1=2",), [r"beta1=2.0 must lie in [0, 1)"]),
        (("--seed=99999999999999999999",), ["seed is too large: give a number below 2**63"]),
        (("--max_iters=" + "9" * 400,), ["max_iters is too large: give a number below 2**63"]),
        (("--learning_rate=1" + "0" * 400,), ["learning_rate is too large for a float: give a finite number"]),
        (("--learning_rate=nan",), ["learning_rate=nan must be a finite number"]),
        (("--backend=mpi",), ["backend='mpi' is not known"]),
        (("--head_size=-4",), ["head_size=-4 must be a positive integer"]),
        ((*t5, "--block_size=1"), ["span corruption hides part of each sequence: block_size=1"]),
        ((*t5, "--noise_density=0.95"), ["gives the decoder 17 tokens, more than the 16 learned"]),
        ((*t5, "--block_size=1000", "--mean_span=1"), ["needs 151 sentinels, more than 100"]),
    ]
    if not torch.cuda.is_available():
        cases.append((("--device=cuda",), ["--device=cuda but torch sees no CUDA GPU", "--device=cpu"]))
    results = in_parallel(*(lambda i=i, args=args: train(i, *args) for i, (args, _) in enumerate(cases)))
    for (args, fragments), result in zip(cases, results):
        one_line_error(result, *fragments)
    assert not list(d.glob("out-bad*"))  # a run that stops before its first checkpoint leaves no out_dir
    if not torch.cuda.is_available():  # (tests run the kernel in Triton's interpreter; users do not)
        one_line_error(train("-triton", "--attn_impl=triton", env={"TRITON_INTERPRET": "0"}),
                       "attn_impl='triton' runs on CUDA GPUs")


def edit_meta(path, edit):
    meta = json.loads((path / "meta.json").read_text())
    edit(meta)
    (path / "meta.json").write_text(json.dumps(meta))


def test_train_refuses_damaged_data_in_one_line(workdir):  # noqa: F811
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
        one_line_error(run("train.py", f"--dataset={name}", f"--out_dir=out-{name}", *TINY, cwd=d),
                       f"dataset '{name}' is damaged", "prepare it again")


def test_train_out_of_memory_stops_in_one_line_and_keeps_the_checkpoints(trained):
    d = trained
    shutil.copytree(d / "out-ok", d / "out-oom")
    before = {f: (d / "out-oom" / f).read_bytes() for f in ("ckpt.pt", "best.pt")}
    # 200,000 sequences: gigabytes of activations, more than the 4 GiB the system grants here
    train = lambda *a: run("train.py", "--dataset=verse", *TINY, "--batch_size=200000", *a, cwd=d,  # noqa: E731
                           max_memory_bytes=4 * 2**30)
    for result in in_parallel(lambda: train("--out_dir=out-oom-new"),
                              lambda: train("--out_dir=out-oom", "--init_from=resume")):
        one_line_error(result, "out of memory (asked for", "GiB more): lower --batch_size",
                       "raising --gradient_accumulation_steps", "checkpoints already in out_dir are as they were")
    assert not (d / "out-oom-new").exists()
    assert {f: (d / "out-oom" / f).read_bytes() for f in before} == before


def test_out_of_memory_reads_torchs_messages():
    from device import out_of_memory
    cuda = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
                                  "79.19 GiB of which 1.06 GiB is free.")  # (torch's message, shortened)
    cpu = RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
                       "you tried to allocate 3276800000 bytes. Error code 12 (Cannot allocate memory)")
    assert out_of_memory(cuda) == "out of memory (asked for 2.00 GiB more)"
    assert out_of_memory(cpu) == "out of memory (asked for 3.1 GiB more)"
    assert out_of_memory(MemoryError()) == "out of memory"
    assert out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied")) is None  # a bug stays a bug


def test_a_new_run_never_overwrites_checkpoints_and_eval_only_writes_nothing(trained):
    d = trained
    before = {f: (d / "out-ok" / f).read_bytes() for f in ("ckpt.pt", "best.pt")}
    train = lambda *a: run("train.py", "--dataset=verse", "--out_dir=out-ok", *TINY, *a, cwd=d)  # noqa: E731
    new, *evals = in_parallel(train, lambda: train("--eval_only", "--init_from=resume", "--eval_interval=3"),
                              lambda: train("--eval_only", "--init_from=scratch"))
    one_line_error(new, "out-ok/ckpt.pt holds a run that a new one would overwrite", "--init_from=resume")
    for (code, out, err), at in zip(evals, (4, 0)):  # iteration 4 of the run is no multiple of 3: evaluated all the same
        assert code == 0 and re.search(rf"^step {at}: train loss [\d.]+, val loss [\d.]+", out, re.M), err
    assert {f: (d / "out-ok" / f).read_bytes() for f in before} == before


def test_a_second_run_is_refused_while_another_writes_the_same_out_dir(workdir):  # noqa: F811
    d, _ = workdir
    args = ["--dataset=verse", "--out_dir=out-busy", *TINY, "--eval_interval=2", "--max_iters=1000000"]
    first = subprocess.Popen([sys.executable, os.path.join(HERE, "train.py"), *args], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, cwd=d)
    for line in first.stdout:  # wait until it has saved a checkpoint and trains on
        if line.startswith("iter 3:"):
            break
    stray = d / "out-busy" / "ckpt.pt.tmp.999999999"  # stands for the file of a save in progress
    stray.write_bytes(b"half a checkpoint")
    for extra in (["--max_iters=10"], ["--init_from=resume", "--max_iters=10"]):
        one_line_error(run("train.py", *args, *extra, cwd=d),
                       f"out_dir 'out-busy' is in use by another train.py (process {first.pid})",
                       "choose another --out_dir")
        assert stray.exists()  # nothing of the running one was touched
    first.send_signal(signal.SIGINT)
    _, err = first.communicate(timeout=60)
    assert first.returncode == 130, err
    code, out, err = run("train.py", *args, "--init_from=resume", "--max_iters=1", cwd=d)  # the lock went with it
    assert code == 0 and not stray.exists(), err


def test_a_resumed_run_may_change_attn_impl_and_dropout_and_says_which_settings_changed(trained):
    d = trained
    shutil.copytree(d / "out-ok", d / "out-kernel")
    for f in ("ckpt.pt", "best.pt"):  # as if trained through the Triton kernel on a GPU
        ckpt = torch.load(d / "out-kernel" / f, weights_only=True)
        ckpt["model_config"]["attn_impl"] = "triton"
        ckpt["model_config"]["linear_impl"] = "onednn"  # as earlier versions wrote: a run-time choice, since gone
        torch.save(ckpt, d / "out-kernel" / f)
    cpu = {"TRITON_INTERPRET": "0"}  # as users run it: no interpreter
    code, out, err = run("sample.py", "--out_dir=out-kernel", "--max_new_tokens=5", cwd=d, env=cpu)
    assert code == 0 and out.strip(), err
    code, out, err = run("train.py", "--dataset=verse", "--out_dir=out-kernel", "--init_from=resume", *TINY,
                         "--attn_impl=auto", "--dropout=0.1", "--max_iters=6",
                         "--weight_decay=0.05", "--beta2=0.5", cwd=d, env=cpu)
    assert code == 0, err
    # out-ok trained with --eval_interval=2, not given here: said, with the new max_iters (not out_dir)
    assert ("training settings changed from the checkpoint's: weight_decay 0.1 -> 0.05, beta2 0.95 -> 0.5, "
            "max_iters 4 -> 6, eval_interval 2 -> 250\n") in out
    saved = torch.load(d / "out-kernel" / "ckpt.pt", weights_only=True)
    assert saved["iter_num"] == 6
    # and the optimizer took them up, not the checkpoint's (matrices decay, gains and biases do not)
    assert [(g["betas"], g["weight_decay"]) for g in saved["optimizer"]["param_groups"]] == [((0.9, 0.5), 0.05),
                                                                                             ((0.9, 0.5), 0.0)]
    assert [saved["model_config"][k] for k in ("attn_impl", "dropout")] == ["auto", 0.1]
    assert "linear_impl" not in saved["model_config"]


class RunsCode:
    """What a malicious checkpoint could carry: an object whose unpickling runs code (here it
    creates a marker file)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def test_a_checkpoint_that_would_run_code_when_loaded_is_refused_and_nothing_runs(trained):
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
    resume = ("train.py", "--dataset=verse", "--out_dir=out-planted", "--init_from=resume", *TINY)
    results = in_parallel(lambda: run("sample.py", "--out_dir=out-planted", cwd=d),
                          lambda: run(*resume, "--eval_only=True", cwd=d))
    results.append(run(*resume, "--max_iters=6", cwd=d))  # it writes: after the others, not beside them
    for result in results:
        one_line_error(result, "out-planted/", "holds objects that loading would have to run code for (",
                       "so it is not loaded")
    assert not marker.exists()
    assert {p: b for p, b in files_under(planted).items() if p.name != ".lock"} == before  # nothing changed


def test_train_rejects_broken_or_mismatched_checkpoints(trained):
    d = trained
    train = lambda out, *a: run("train.py", "--dataset=verse", f"--out_dir={out}", "--init_from=resume", *TINY, *a,
                                cwd=d)  # noqa: E731

    def write(name, ckpt=None, data=None, edit=lambda ckpt: None):  # a copy of out-ok's checkpoint, edited
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
    write("ok-copy")  # runs in parallel take their out_dir: one out-ok would refuse the second
    write("lacking", edit=lambda c: c.pop("optimizer"))
    write("newer", edit=lambda c: c["model_config"].update(qk_norm=True))
    whole = (d / "out-ok" / "ckpt.pt").read_bytes()
    write("truncated", data=whole[: len(whole) // 2])
    write("garbage", data=os.urandom(4096))
    write("truncated-best", data=whole[: len(whole) // 2])
    (d / "out-truncated-best" / "best.pt").write_bytes((d / "out-ok" / "best.pt").read_bytes())
    for i in range(3):  # the same text with "a" spelt "@": as many characters, other ones
        os.makedirs(d / "texts-at", exist_ok=True)
        (d / "texts-at" / f"{i}.txt").write_text((d / "texts" / f"part{i}.txt").read_text("utf-8").replace("a", "@"),
                                                 "utf-8")
    assert run("prepare.py", "text", "--input=texts-at/*.txt", "--name=verse-at", "--tokenizer=char",
               cwd=d)[0] == 0
    cases = [
        (("out-ok", "--n_layer=3"),
         ["--n_layer=3 does not match out-ok/ckpt.pt's n_layer=2", "set --n_layer=2 or drop it"]),
        (("out-old", "--gelu_approximate=none"),
         ["--gelu_approximate='none' does not match out-old/ckpt.pt's gelu_approximate='tanh'"]),
        (("out-ok-copy", "--dataset=verse-at"), ["was trained on other data"]),
        (("out-lacking",), ["out-lacking/ckpt.pt is not a nanoformer checkpoint (it lacks ['optimizer'])"]),
        (("out-newer",), ["model settings this model.py does not know (qk_norm)", "another version of nanoformer"]),
        (("out-truncated",), ["is not a readable checkpoint", "truncated or corrupted"]),
        (("out-garbage",), ["is not a readable checkpoint", "truncated or corrupted"]),
        (("out-truncated-best",), ["copy out-truncated-best/best.pt to out-truncated-best/ckpt.pt to resume from "
                                   "the best checkpoint"]),
    ]
    results = in_parallel(*(lambda args=args: train(*args) for args, _ in cases),
                          lambda: train("out-old-resumed", "--max_iters=5"))
    for (args, fragments), result in zip(cases, results):
        err = one_line_error(result, *fragments)
        if args[0] in ("out-truncated", "out-garbage"):
            assert "best.pt" not in err  # there is none to fall back on
    code, _, err = results[-1]  # the old checkpoint resumes
    assert code == 0, err


def test_a_run_resumes_in_another_precision(trained):
    d = trained
    shutil.copytree(d / "out-ok", d / "out-fp16")
    # fp32 left the loss scaler's state empty; fp16 starts a scale of its own
    code, log, err = run("train.py", "--dataset=verse", "--out_dir=out-fp16", "--init_from=resume",
                         "--dtype=float16", "--max_iters=5", *TINY, cwd=d)
    assert code == 0 and "done: 5 iterations" in log, err


def test_under_torchrun_a_bad_setting_is_reported_once(workdir):  # noqa: F811
    d, _ = workdir
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    code, _, err = run(torchrun, "--standalone", "--nproc_per_node=2", os.path.join(HERE, "train.py"),
                       "--dataset=verse", "--batchsize=4", *TINY, cwd=d)
    # torchrun adds its own report of the failed processes after our line; the line comes once
    assert code != 0 and err.count("train.py: error: unknown setting 'batchsize': did you mean --batch_size?") == 1
    code, _, err = run(torchrun, "--standalone", "--nproc_per_node=2", os.path.join(HERE, "train.py"),
                       "--dataset=verse", "--gradient_accumulation_steps=3", *TINY, cwd=d)
    assert code != 0 and err.count("gradient_accumulation_steps=3 is not divisible by the 2 processes") == 1


# ----------------------------------------------------------------------------------------------
# sample.py

def test_sample_rejects_bad_input_in_one_line(trained):
    d = trained
    sample = lambda *a: run("sample.py", "--out_dir=out-ok", "--max_new_tokens=5", *a, cwd=d)  # noqa: E731
    (d / "latin1.txt").write_bytes("ROMEO: ¿Qué?".encode("latin-1"))
    cases = [("--start=ROMEO: ¿Qué?", "characters the model's vocabulary lacks: 'Qu¿é'"),
             ("--max_new_tokens=-1", "max_new_tokens=-1 must be at least 0"),
             ("--temperature=-0.5", "temperature=-0.5 must be at least 0"),
             ("--temperature=inf", "temperature=inf must be a finite number"),
             ("--top_p=0", "top_p=0.0 must lie in (0, 1]"),
             ("--top_p=1.5", "top_p=1.5 must lie in (0, 1]"),
             ("--top_k=0", "top_k=0 must be at least 1"),
             ("--start=FILE:missing.txt", "prompt file 'missing.txt' not found"),
             ("--start=FILE:latin1.txt", "prompt file 'latin1.txt' is not UTF-8 text"),
             ("--num_samples=0", "num_samples=0 must be at least 1"),
             ("--seed=99999999999999999999", "seed is too large: give a number below 2**63"),
             ("--out_dir=out-nothing", "no checkpoint at out-nothing/ckpt.pt")]
    for path in (".", "no/such/folder/attn.html"):  # refused before sampling, not after
        cases.append((f"--attention={path}", f"--attention={path} is not a file in an existing folder"))
    for (arg, fragment), result in zip(cases, in_parallel(*(lambda arg=arg: sample(arg) for arg, _ in cases))):
        one_line_error(result, fragment)
    os.makedirs(d / "out-half", exist_ok=True)
    (d / "out-half" / "ckpt.pt").write_bytes((d / "out-ok" / "ckpt.pt").read_bytes()[:1000])
    err = one_line_error(run("sample.py", "--out_dir=out-half", cwd=d), "out-half/ckpt.pt is not a readable checkpoint")
    assert "--ckpt=" not in err  # there is no other checkpoint to suggest
    (d / "out-half" / "best.pt").write_bytes((d / "out-ok" / "best.pt").read_bytes()[:1000])
    one_line_error(run("sample.py", "--out_dir=out-half", cwd=d), "out-half/best.pt is not a readable checkpoint",
                   "try --ckpt=latest")


def test_sample_out_of_memory_stops_in_one_line(trained):
    d = trained
    line = next(line for line in (d / "texts" / "part0.txt").read_text(encoding="utf-8").splitlines() if line.strip())
    # 200,000 prompts in one batch: more than the 4 GiB the system grants here
    (d / "many.txt").write_text((line + "\n") * 200_000, encoding="utf-8")
    one_line_error(run("sample.py", "--out_dir=out-ok", "--start=FILE:many.txt", "--batch", "--max_new_tokens=5",
                       cwd=d, max_memory_bytes=4 * 2**30),
                   "sample.py: error: out of memory (asked for", "GiB more): give fewer prompts at once")


def test_a_prompt_path_that_is_a_folder_is_named_as_one(tmp_path):
    import sample
    with pytest.raises(common.UsageError, match="prompt file '.*' is a folder, not a file: check the path after FILE:"):
        sample.read_prompt(f"FILE:{tmp_path}")
    with pytest.raises(common.UsageError, match="prompt file '.*nope.txt' not found"):
        sample.read_prompt(f"FILE:{tmp_path / 'nope.txt'}")


def test_sample_refuses_spans_an_encoder_decoder_cannot_fill(workdir):  # noqa: F811
    d, _ = workdir
    code, _, err = run("train.py", "--dataset=verse", "--out_dir=out-t5", "--arch=encoder-decoder", "--pos=learned",
                       "--max_iters=2", "--eval_interval=2", *TINY, cwd=d)
    assert code == 0, err
    sample = lambda start: run("sample.py", "--out_dir=out-t5", f"--start={start}", "--max_new_tokens=3", cwd=d)  # noqa: E731
    too_long, too_many, (code, out, err) = in_parallel(*(lambda start=start: sample(start) for start in
                                                         ("a" * 20 + "[MASK]", "a[MASK]" * 100, "a" * 10 + "[MASK]")))
    one_line_error(too_long, "the text is 21 tokens, longer than the model's block_size=16")
    one_line_error(too_many, "the prompt has 100 [MASK]s; this model fills at most 99 spans")
    assert code == 0 and out.startswith("a" * 10), err


def test_a_prompt_longer_than_learned_positions_is_cropped_and_said(trained):
    code, out, err = run("sample.py", "--out_dir=out-ok", "--start=" + "ROMEO: " * 10, "--max_new_tokens=5",
                         cwd=trained)
    assert code == 0 and "the prompt is 70 tokens, longer than the 16 positions" in err
    assert out.startswith("ROMEO: " * 10)


# ----------------------------------------------------------------------------------------------
# Nothing lost

def test_killing_the_process_mid_save_leaves_the_previous_checkpoint_loadable(workdir):  # noqa: F811
    d, _ = workdir
    out = d / "out-kill"
    # a model big enough (about 40 MB of checkpoint) that a save takes a while
    cmd = [sys.executable, os.path.join(HERE, "train.py"), "--dataset=verse", f"--out_dir={out}", "--device=cpu",
           "--n_layer=4", "--n_embd=256", "--n_head=4", "--block_size=16", "--batch_size=2", "--eval_iters=1",
           "--eval_interval=1", "--max_iters=1000", "--log_interval=1000"]
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=d)
    partial, deadline = None, time.time() + 120
    while p.poll() is None and time.time() < deadline:  # kill once a new ckpt.pt is half written
        tmp = glob.glob(str(out / "ckpt.pt.tmp.*"))
        try:
            if tmp and (out / "ckpt.pt").exists() and os.path.getsize(tmp[0]) > 1 << 20:
                p.kill()
                partial = tmp[0]
                break
        except FileNotFoundError:  # renamed between the glob and the size: try the next save
            pass
    p.wait()
    assert partial is not None and os.path.getsize(partial) < os.path.getsize(out / "ckpt.pt")
    before = torch.load(out / "ckpt.pt", weights_only=True)["iter_num"]
    code, log, err = run("train.py", *cmd[2:-3], "--init_from=resume", f"--max_iters={before + 2}",
                         "--log_interval=1", cwd=d)
    assert code == 0, err
    assert losses(log) and torch.load(out / "ckpt.pt", weights_only=True)["iter_num"] == before + 2
    assert not glob.glob(str(out / "*.tmp.*"))  # the half-written file is cleared away


def test_a_full_disk_during_a_save_keeps_the_previous_checkpoints_whole(trained):
    d = trained
    shutil.copytree(d / "out-ok", d / "out-full")
    limit = os.path.getsize(d / "out-ok" / "ckpt.pt") // 2  # no file may grow past this: a save fails halfway
    # the operating system's reason (here the file size limit's), not torch.save's internal message
    one_line_error(run("train.py", "--dataset=verse", "--out_dir=out-full", "--init_from=resume", *TINY,
                       "--max_iters=6", "--eval_interval=2", cwd=d, max_file_bytes=limit),
                   "could not write out-full/", "(File too large); the previous checkpoint is intact")
    for f in ("ckpt.pt", "best.pt"):
        assert (d / "out-full" / f).read_bytes() == (d / "out-ok" / f).read_bytes()
    assert not glob.glob(str(d / "out-full" / "*.tmp.*"))
    # a disk with no room at all is found before training starts
    one_line_error(run("train.py", "--dataset=verse", "--out_dir=out-full", "--init_from=resume", *TINY,
                       "--max_iters=6", cwd=d, max_file_bytes=1),
                   "out_dir 'out-full' is not writable (File too large): free some space, or choose another --out_dir")
    for f in ("ckpt.pt", "best.pt"):
        assert (d / "out-full" / f).read_bytes() == (d / "out-ok" / f).read_bytes()
    assert not glob.glob(str(d / "out-full" / ".write-test.*"))  # the probe that found it is gone too
    one_line_error(run("train.py", "--dataset=verse", "--out_dir=out-full-new", *TINY, cwd=d, max_file_bytes=1),
                   "out_dir 'out-full-new' is not writable (File too large)")
    assert not (d / "out-full-new").exists()  # made for the run, and removed with its probe


def test_under_torchrun_a_full_disk_stops_every_rank_with_one_line(trained):
    d = trained
    shutil.copytree(d / "out-ok", d / "out-full-ddp")
    limit = os.path.getsize(d / "out-ok" / "ckpt.pt") // 2
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    code, _, err = run(torchrun, "--standalone", "--nproc_per_node=2", os.path.join(HERE, "train.py"),
                       "--dataset=verse", "--out_dir=out-full-ddp", "--init_from=resume", *TINY, "--max_iters=6",
                       "--eval_interval=2", "--gradient_accumulation_steps=2", cwd=d, max_file_bytes=limit)
    # rank 0 says why; rank 1 stops with it instead of a traceback at its next collective
    assert code != 0 and err.count("train.py: error: could not write out-full-ddp/") == 1, err
    assert "[rank1]" not in err and "Connection closed" not in err, err
    for f in ("ckpt.pt", "best.pt"):
        assert (d / "out-full-ddp" / f).read_bytes() == (d / "out-ok" / f).read_bytes()


def test_an_out_dir_with_only_best_pt_is_told_how_to_go_on(trained):
    d = trained
    os.makedirs(d / "out-best-only")
    shutil.copy(d / "out-ok" / "best.pt", d / "out-best-only")
    one_line_error(run("train.py", "--dataset=verse", "--out_dir=out-best-only", "--init_from=resume", *TINY, cwd=d),
                   "no checkpoint at out-best-only/ckpt.pt: copy out-best-only/best.pt to out-best-only/ckpt.pt")
    one_line_error(run("sample.py", "--out_dir=out-best-only", "--ckpt=latest", cwd=d),
                   "no checkpoint at out-best-only/ckpt.pt: try --ckpt=best")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_sigint_or_sigterm_saves_a_checkpoint_and_exits_cleanly(workdir, sig):  # noqa: F811
    d, _ = workdir
    out = f"out-{sig.name}"
    cmd = [sys.executable, os.path.join(HERE, "train.py"), "--dataset=verse", f"--out_dir={out}", *TINY,
           "--max_iters=1000000", "--eval_interval=1000000", "--log_interval=10"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=d)
    for line in p.stdout:  # wait until it trains
        if line.startswith("iter 20:"):
            break
    p.send_signal(sig)
    out_text, err = p.communicate(timeout=60)
    assert p.returncode == 128 + sig and "Traceback" not in err
    saved = torch.load(d / out / "ckpt.pt", weights_only=True)["iter_num"]
    assert saved >= 20 and f"stopped by {sig.name} at iteration {saved}" in out_text
    code, log, err = run("train.py", *cmd[2:-3], "--init_from=resume", f"--max_iters={saved + 3}",
                         "--eval_interval=1000000", cwd=d)
    assert code == 0 and len(losses(log)) == 3, err


def test_ctrl_c_cuts_a_long_evaluation_short_and_the_resumed_run_evaluates_again(workdir):  # noqa: F811
    d, _ = workdir
    args = ["--dataset=verse", "--out_dir=out-long-eval", *TINY, "--eval_interval=5"]
    code, _, err = run("train.py", *args, "--max_iters=5", cwd=d)  # evaluates 0 and 5, saves 5
    assert code == 0, err
    cmd = [sys.executable, os.path.join(HERE, "train.py"), *args, "--max_iters=10", "--init_from=resume",
           "--eval_iters=1000000"]  # an evaluation of minutes at iteration 10
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=d,
                         env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        for line in p.stdout:
            if line.startswith("iter 10:"):  # the last log line before that evaluation
                break
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=60)
    finally:
        p.kill()
    assert p.returncode == 130 and "Traceback" not in err, err
    assert "stopped by SIGINT at iteration 10" in out and "step 10:" not in out
    assert torch.load(d / "out-long-eval" / "ckpt.pt", weights_only=True)["iter_num"] == 10
    code, log, err = run("train.py", *args, "--max_iters=10", "--init_from=resume", cwd=d)
    assert code == 0 and re.findall(r"step (\d+):", log) == ["10"] and losses(log) == [], err


def test_a_reader_that_stops_early_ends_sample_py_quietly(trained):
    cmd = [sys.executable, os.path.join(HERE, "sample.py"), "--out_dir=out-ok", "--max_new_tokens=1000000"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=trained)
    assert p.stdout.read(20)  # as `python sample.py ... | head`
    p.stdout.close()
    _, err = p.communicate(timeout=60)
    assert p.returncode == -signal.SIGPIPE and err == "", err  # as `yes | head` ends `yes`


def test_ctrl_c_while_torch_loads_or_text_streams_out_exits_quietly(trained):
    d = trained
    # -X importtime prints a line as each module finishes loading: the first of torch's own modules
    # comes while torch's import, which takes seconds, is under way
    cmd = [sys.executable, "-X", "importtime", os.path.join(HERE, "train.py"), "--dataset=verse", "--out_dir=out-early",
           *TINY]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=d)
    for line in p.stderr:
        if line.split("| ")[-1].strip().startswith("torch."):
            break
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 130 and "Traceback" not in err and out == "" and not (d / "out-early").exists(), err
    cmd = [sys.executable, os.path.join(HERE, "sample.py"), "--out_dir=out-ok", "--max_new_tokens=1000000"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=d)
    assert p.stdout.read(20)  # it streams text
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 130 and err == "", err
    # prepare.py while numpy loads (about 0.1 s): stopped after numpy's first module, before its last
    cmd = [sys.executable, "-X", "importtime", os.path.join(HERE, "prepare.py"), "shakespeare_char",
           f"--data_dir={d / 'data-early'}"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=d)
    for line in p.stderr:
        if "| " in line and line.split("| ")[-1].strip().startswith("numpy."):
            break
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 130 and "Traceback" not in err and not (d / "data-early").exists(), err
    # imported (as the tests import them), neither takes Ctrl-C over
    code, out, err = run(sys.executable, "-c", "import signal, sample, prepare; "
                         "print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)", cwd=HERE)
    assert code == 0 and out.strip() == "True", err


@pytest.mark.parametrize("arch, extra", [("decoder", ["--dropout=0.1"]), ("encoder", []),
                                          ("encoder-decoder", ["--pos=relative"])])
def test_resuming_halfway_gives_bit_identical_losses_and_weights(workdir, arch, extra):  # noqa: F811
    d, _ = workdir
    args = ["--dataset=verse", "--eval_interval=3", f"--arch={arch}", *TINY, *extra]
    (code, straight, err), (code_first, first, err_first) = in_parallel(
        lambda: run("train.py", f"--out_dir=out-{arch}-straight", "--max_iters=8", *args, cwd=d),
        lambda: run("train.py", f"--out_dir=out-{arch}-halves", "--max_iters=4", *args, cwd=d))
    assert code == 0 and code_first == 0, err + err_first
    code, second, err = run("train.py", f"--out_dir=out-{arch}-halves", "--max_iters=8", "--init_from=resume", *args,
                            cwd=d)
    assert code == 0, err
    assert losses(first) + losses(second) == losses(straight) and len(losses(straight)) == 8  # to 4 decimals...
    a = torch.load(d / f"out-{arch}-straight" / "ckpt.pt", weights_only=True)["model"]
    b = torch.load(d / f"out-{arch}-halves" / "ckpt.pt", weights_only=True)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)  # ...and the weights bit for bit


def test_a_non_finite_loss_skips_steps_then_stops_keeping_the_last_good_checkpoint(workdir):  # noqa: F811
    d, _ = workdir
    code, log, err = run("train.py", "--dataset=verse", "--out_dir=out-nan", *TINY, "--max_iters=100",
                         "--eval_interval=5", "--learning_rate=1e6", "--warmup_iters=0", "--decay_lr=False",
                         "--grad_clip=0", "--max_bad_steps=3", cwd=d)  # a learning rate that blows the weights up
    assert code == 1 and "Traceback" not in err
    assert "step skipped (3 in a row)" in log
    assert "the loss was not finite for 3 steps in a row; out-nan/ckpt.pt keeps iteration 0" in err
    ckpt = torch.load(d / "out-nan" / "ckpt.pt", weights_only=True)
    assert ckpt["iter_num"] == 0 and all(torch.isfinite(w).all() for w in ckpt["model"].values())


def test_the_optimizer_runs_at_the_scheduled_learning_rate(trained):
    ckpt = torch.load(trained / "out-ok" / "ckpt.pt", weights_only=True)
    scheduled = train.learning_rate(ckpt["iter_num"], train.TrainConfig(**ckpt["train_config"]))
    assert [g["lr"] for g in ckpt["optimizer"]["param_groups"]] == [scheduled] * 2  # decayed and not


def test_best_checkpoint_is_kept_apart_from_the_latest(workdir):  # noqa: F811
    d, _ = workdir  # a learning rate high enough that the val loss goes up and down
    code, log, err = run("train.py", "--dataset=verse", "--out_dir=out-bumpy", *TINY, "--learning_rate=0.2",
                         "--min_lr=0.2", "--warmup_iters=0", "--max_iters=35", "--eval_interval=5", cwd=d)
    assert code == 0, err
    evals = [(int(i), float(v)) for i, v in re.findall(r"step (\d+): train loss [\d.]+, val loss ([\d.]+)", log)]
    best_iter, best_val = min(evals, key=lambda e: e[1])
    assert best_iter != evals[-1][0]  # so that best.pt and ckpt.pt must differ
    best = torch.load(d / "out-bumpy" / "best.pt", weights_only=True)
    latest = torch.load(d / "out-bumpy" / "ckpt.pt", weights_only=True)
    assert (best["iter_num"], latest["iter_num"]) == (best_iter, 35)
    assert round(best["best_val_loss"], 4) == best_val == round(latest["best_val_loss"], 4)
    assert not torch.equal(best["model"]["lm_head.weight"], latest["model"]["lm_head.weight"])


# ----------------------------------------------------------------------------------------------
# DDP

def test_two_processes_end_with_the_parameters_of_one_with_the_same_global_batch(workdir):  # noqa: F811
    d, _ = workdir
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    args = ["--dataset=verse", "--max_iters=6", "--eval_interval=3", "--gradient_accumulation_steps=2", *TINY]
    code, _, err = run("train.py", "--out_dir=out-one", *args, cwd=d)
    assert code == 0, err
    code, log, err = run(torchrun, "--standalone", "--nproc_per_node=2", os.path.join(HERE, "train.py"),
                         "--out_dir=out-two", *args, cwd=d)
    assert code == 0, err
    a = torch.load(d / "out-one" / "ckpt.pt", weights_only=True)["model"]
    b = torch.load(d / "out-two" / "ckpt.pt", weights_only=True)["model"]
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)


def children(pid):
    """Process ids whose parent is pid (from /proc)."""
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        kids.append(int(entry))
            except (OSError, IndexError, ValueError):
                pass
    return kids


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the ranks through /proc")
def test_a_crashed_rank_makes_the_others_exit_instead_of_hanging(workdir):  # noqa: F811
    d, _ = workdir
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    p = subprocess.Popen([torchrun, "--standalone", "--nproc_per_node=2", os.path.join(HERE, "train.py"),
                          "--dataset=verse", "--out_dir=out-crash", "--max_iters=1000000", "--eval_interval=1000000",
                          "--gradient_accumulation_steps=2", *TINY, "--log_interval=10"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=d)
    for line in p.stdout:  # wait until both ranks train
        if line.startswith("iter 20:"):
            break
    os.kill(max(children(p.pid)), signal.SIGKILL)  # one of the two ranks dies without a word
    start = time.time()
    p.stdout.close()
    assert p.wait(timeout=120) != 0 and time.time() - start < 120
