"""sample.py: its modes end to end on small trained runs (a batch of prompts, speculative decoding
with a draft, bf16 weights, int8 weights with the attention page, an encoder filling blanks and an
encoder-decoder filling spans), each giving its result and one summary line; bad input refused in
one line before any work; a prompt too long for the model cropped or refused; out of memory in one
line; Ctrl-C and a reader that stops early (`| head`) end it quietly."""

import json
import os
import re
import signal
import sys
from dataclasses import asdict

import pytest
import torch
import torch.nn as nn

import checkpoint
import common
import generate as generate_module
import sample
import train
from data import new_model_config
from generate import generate
from model import ModelConfig, Transformer
from quantize import Int4DynamicLinear, Int8DynamicLinear, quantize_int8, runs_here

# what sample.py prints on stderr before it samples: the checkpoint it loaded (its iteration, val loss)
LOADED = r"sample\.py: out-ok/best\.pt: iteration 4, [^\n]*\n"


def test_sample_rejects_bad_input_in_one_line(trained, refusal):
    d = trained
    (d / "latin1.txt").write_bytes("ROMEO: ¿Qué?".encode("latin-1"))
    cases = [("--start=ROMEO: ¿Qué?", "characters the model's vocabulary lacks: 'Qu¿é'"),
             ("--max_new_tokens=-1", "max_new_tokens=-1 must be at least 0"),
             ("--temperature=-0.5", "temperature=-0.5 must be at least 0"),
             ("--top_p=0", "top_p=0.0 must lie in (0, 1]"),
             ("--top_p=1.5", "top_p=1.5 must lie in (0, 1]"),
             ("--top_k=0", "top_k=0 must be at least 1"),
             ("--start=FILE:missing.txt", "prompt file 'missing.txt' not found"),
             (f"--start=FILE:{d / 'nope.txt'}", f"prompt file '{d / 'nope.txt'}' not found"),
             ("--start=FILE:texts", "prompt file 'texts' is a folder, not a file: check the path after FILE:"),
             ("--start=FILE:latin1.txt", "prompt file 'latin1.txt' is not UTF-8 text"),
             ("--num_samples=0", "num_samples=0 must be at least 1"),
             ("--out_dir=out-nothing", "no checkpoint at out-nothing/ckpt.pt")]
    for path in (".", "no/such/folder/attn.html"):  # refused before sampling, not after
        cases.append((f"--attention_page={path}", f"--attention_page={path} is not a file in an existing folder"))
    for arg, fragment in cases:
        refusal(sample.main, ["--out_dir=out-ok", "--max_new_tokens=5", arg], fragment, cwd=d)
    os.makedirs(d / "out-half", exist_ok=True)
    (d / "out-half" / "ckpt.pt").write_bytes((d / "out-ok" / "ckpt.pt").read_bytes()[:1000])
    message = refusal(sample.main, ["--out_dir=out-half"], "out-half/ckpt.pt is not a readable checkpoint", cwd=d)
    assert "--ckpt=" not in message  # there is no other checkpoint to suggest
    (d / "out-half" / "best.pt").write_bytes((d / "out-ok" / "best.pt").read_bytes()[:1000])
    refusal(sample.main, ["--out_dir=out-half"], "out-half/best.pt is not a readable checkpoint", "try --ckpt=latest",
            cwd=d)


def test_sample_refuses_spans_an_encoder_decoder_cannot_fill(workdir, in_process, refusal, capsys, tiny_args):
    d, _ = workdir
    assert in_process(train.main, ["--dataset=verse", "--out_dir=out-t5", "--arch=encoder-decoder", "--pos=learned",
                                   "--max_iters=2", "--eval_interval=2", *tiny_args], cwd=d) == 0
    fill = lambda start: ["--out_dir=out-t5", f"--start={start}", "--max_new_tokens=3"]  # noqa: E731
    refusal(sample.main, fill("a" * 20 + "[MASK]"), "the text is 21 tokens, longer than the model's block_size=16",
            cwd=d)
    refusal(sample.main, fill("a[MASK]" * 100), "the prompt has 100 [MASK]s; this model fills at most 99 spans", cwd=d)
    capsys.readouterr()
    assert in_process(sample.main, fill("a" * 10 + "[MASK]"), cwd=d) == 0
    assert capsys.readouterr().out.startswith("a" * 10)


def test_a_prompt_longer_than_learned_positions_is_cropped_and_said(trained, in_process, capsys):
    assert in_process(sample.main, ["--out_dir=out-ok", "--start=" + "ROMEO: " * 10, "--max_new_tokens=5"],
                      cwd=trained) == 0
    out, err = capsys.readouterr()
    assert "the prompt is 70 tokens, longer than the 16 positions" in err
    assert out.startswith("ROMEO: " * 10)


@pytest.mark.slow
def test_sample_out_of_memory_stops_in_one_line(trained, run, one_line_error):
    d = trained
    line = next(line for line in (d / "texts" / "part0.txt").read_text(encoding="utf-8").splitlines() if line.strip())
    # 300,000 prompts in one batch: their cache (8 KiB each) and logits are more than the 3 GiB granted here
    (d / "many.txt").write_text((line + "\n") * 300_000, encoding="utf-8")
    code, out, err = run("sample.py", "--out_dir=out-ok", "--start=FILE:many.txt", "--batch", "--max_new_tokens=5",
                         cwd=d, max_memory_bytes=3 * 2**30)
    loaded = re.match(LOADED, err)  # after the line naming the checkpoint, the error in one line
    assert loaded, err
    one_line_error((code, out, err[loaded.end():]), "sample.py: error: out of memory (asked for",
                   "GiB more): give fewer prompts at once")


def test_a_reader_that_stops_early_ends_sample_py_quietly(trained, start):
    p = start("sample.py", "--out_dir=out-ok", "--max_new_tokens=1000000", cwd=trained)
    assert p.stdout.read(20)  # as `python sample.py ... | head`
    p.stdout.close()
    _, err = p.communicate(timeout=300)
    assert p.returncode == -signal.SIGPIPE and re.fullmatch(LOADED, err), err  # as `yes | head` ends `yes`


def test_ctrl_c_while_text_streams_out_exits_quietly(trained, start):
    p = start("sample.py", "--out_dir=out-ok", "--max_new_tokens=1000000", cwd=trained)
    assert p.stdout.read(20)  # it streams text
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=300)
    assert p.returncode == 130 and re.fullmatch(LOADED, err), err  # nothing after the checkpoint's line


def test_start_reads_escapes_as_its_help_says_and_the_run_names_its_checkpoint(trained, in_process, capsys):
    assert in_process(sample.main, ["--out_dir=out-ok", "--start=LEAR:\\nKING \\u00f3", "--max_new_tokens=0"],
                      cwd=trained) == 0
    out, err = capsys.readouterr()
    assert out.startswith("LEAR:\nKING ó") and re.search(r"^sample.py: out-ok/best.pt: iteration \d, val loss [\d.]+$",
                                                          err, re.M)
    assert sample.main(["--help"]) == 0 and "escapes read as Python's (\\n" in capsys.readouterr().out
    with pytest.raises(common.UsageError, match=r"--start has a broken escape"):
        in_process(sample.main, ["--out_dir=out-ok", "--start=\\x"], cwd=trained)


SEP = "\n---------------\n"  # after each sequence sample.py shows
# what sample.py prints on stderr before it samples: the checkpoint it loaded (its iteration, val loss)
LOADED = r"sample\.py: out-[\w-]+/(best|ckpt)\.pt: iteration \d+, [^\n]*\n"


def page_data(path):
    text = open(path, encoding="utf-8").read()
    assert "<script src" not in text and "<link" not in text and "http" not in text  # self-contained
    return json.loads(re.search(r"const DATA = (.*);\n", text).group(1))


@pytest.fixture(scope="module")
def target_and_draft(workdir, in_process, tiny_args):
    """out-target (RoPE, 20 iterations) and out-draft (the same with one layer), trained on data/verse;
    the folder."""
    d, _ = workdir
    for out, extra in (("out-target", ["--pos=rope"]), ("out-draft", ["--pos=rope", "--n_layer=1"])):
        assert in_process(train.main, ["--dataset=verse", f"--out_dir={out}", "--max_iters=20", "--eval_interval=10",
                                       *tiny_args, *extra], cwd=d) == 0
    return d


@pytest.fixture
def sample_py(target_and_draft, in_process, capsys):
    """sample(*args): sample.py's (stdout, stderr) for args, run in this process from target_and_draft."""
    def run_sample(*args):
        capsys.readouterr()
        assert in_process(sample.main, list(args), cwd=target_and_draft) == 0
        return capsys.readouterr()
    return run_sample


def test_sample_batch_gives_each_line_what_it_gets_alone(target_and_draft, sample_py):
    (target_and_draft / "prompts.txt").write_text("ROMEO:\nLEAR: Blood\n\nJULIET: sweet love\n")
    args = ["--out_dir=out-target", "--max_new_tokens=25", "--temperature=0"]  # 25: past block_size=16
    together, _ = sample_py(*args, "--start=FILE:prompts.txt", "--batch")
    texts = together.split(SEP)
    for i, line in enumerate(["ROMEO:", "LEAR: Blood", "JULIET: sweet love"]):
        alone, _ = sample_py(*args, f"--start={line}")
        assert texts[i] == alone.split(SEP)[0]


def test_a_compiled_sample_times_its_compile_apart_and_samples_what_eager_does(sample_py, monkeypatch):
    """--compile=True compiles the step before the timing (a warm-up of 2 steps in the run's cache
    size, its output hidden), says how long that took, and samples with the seed's draws as an eager
    run does. Untold, sample.py compiles where generate.compile_pays says it takes less time."""
    steps = []
    def recording_compile(fn, **kw):  # a stand-in for torch.compile: no compiler needed
        return lambda model, *args: steps.append((model.decoder.cache_pos.size(1), args[-1])) or fn(model, *args)
    monkeypatch.setattr(torch, "compile", recording_compile)
    monkeypatch.setattr(generate_module, "COMPILED_CACHE_STEP", 4)  # a 2-token warm-up's cache: 8 slots, the run's 16
    args = ["--out_dir=out-target", "--start=LEAR:", "--max_new_tokens=12", "--seed=3"]
    eager, err = sample_py(*args)
    assert not steps and err.endswith(", eager)\n")  # 12 steps: too few to make up for a compile
    compiled, err = sample_py(*args, "--compile=True")
    assert compiled == eager and len(steps) == 2 + 11 and all(isinstance(n, int) for _, n in steps)
    assert len({size for size, _ in steps}) == 1  # the warm-up's cache is the run's
    assert re.fullmatch(LOADED + r"sample.py: compiled the decode step in [\d.]+ s\n"
                        r"sample.py: 12 tokens in [\d.]+ s, [\d.,]+ tokens/s \(decoder, cpu, float32 weights, compiled step\)\n", err)
    for pays_from, path in ((12 * 2, "compiled step"), (12 * 2 + 1, "eager")):  # two samples of 12 tokens
        monkeypatch.setattr(generate_module, "COMPILE_PAYS_FROM", pays_from)
        out, err = sample_py(*args, "--num_samples=2")
        assert err.endswith(f", {path})\n") and out.split(SEP)[0] + SEP == eager
    steps.clear()  # a draft decodes without the compiled step, told or not: no warm-up, the summary says eager
    _, err = sample_py(*args, "--compile=True", "--draft_dir=out-draft")
    assert not steps and "compiled" not in err and ", eager); draft tokens accepted" in err


def test_sample_with_a_draft_prints_the_acceptance_rate_and_the_target_text(sample_py):
    args = ["--out_dir=out-target", "--start=LEAR:", "--max_new_tokens=30", "--temperature=0"]
    plain, _ = sample_py(*args)
    fast, err = sample_py(*args, "--draft_dir=out-draft", "--draft_k=3")
    assert fast == plain  # greedy: the same text
    assert re.fullmatch(LOADED + r"sample.py: 30 tokens in [\d.]+ s, [\d.,]+ tokens/s \(decoder, cpu, float32 weights, eager\); "
                        r"draft tokens accepted \d+/\d+ \([\d.]+%, k=3\)\n", err)  # no second run of the target alone


def test_sample_in_bf16_holds_the_weights_in_bf16_with_or_without_a_draft(target_and_draft, sample_py):
    args = ["--out_dir=out-target", "--start=LEAR:", "--max_new_tokens=20", "--temperature=0", "--dtype=bfloat16"]
    text, err = sample_py(*args)
    fast, _ = sample_py(*args, "--draft_dir=out-draft")
    assert "(decoder, cpu, bfloat16 weights, eager)" in err  # cast once, not by autocast at every token
    model, tok, _ = checkpoint.load_model(str(target_and_draft / "out-target"), torch.device("cpu"), torch.bfloat16)
    out = generate(model, torch.tensor([tok.encode("LEAR:")]), 20, temperature=0)
    assert text.split(SEP)[0] == tok.decode(out[0].tolist())
    assert fast == text  # the draft, loaded in the target's dtype: greedy, the same text


@pytest.mark.parametrize("quantize, layer", [("int8-dynamic", Int8DynamicLinear), pytest.param(
    "int4-dynamic", Int4DynamicLinear, marks=pytest.mark.skipif(not runs_here("int4-dynamic", torch.device("cpu")),
                                                                reason="w4a8.cpp needs a C++ compiler"))])
def test_sample_with_activations_quantized_prints_the_models_text_and_names_its_path(target_and_draft, sample_py,
                                                                                      quantize, layer):
    d = target_and_draft
    text, err = sample_py("--out_dir=out-target", "--start=LEAR:", "--max_new_tokens=10", f"--quantize={quantize}",
                          "--group_size=32", "--temperature=0")
    model, tok, _ = checkpoint.load_model(str(d / "out-target"), torch.device("cpu"), quantize=quantize, group_size=32)
    n = sum(isinstance(m, layer) for m in model.modules())
    assert n > 0 and f"{n} Linear layers in {quantize}, eager)" in err
    out = generate(model, torch.tensor([tok.encode("LEAR:")]), 10, temperature=0)
    assert text.split(SEP)[0] == tok.decode(out[0].tolist())
    with pytest.raises(common.UsageError, match=f"{quantize} is a CPU kernel, not cuda's: use --quantize=int8 or int4"):
        sample.int8_on_cuda(sample.SampleConfig(quantize=quantize), torch.device("cuda"))


def test_sample_in_int8_prints_the_int8_models_text_and_pages_its_attention_weights(target_and_draft, sample_py):
    d = target_and_draft
    text, err = sample_py("--out_dir=out-target", "--start=LEAR:", "--max_new_tokens=10", "--quantize=int8",
                          "--attention=attn.html", "--temperature=0")  # the page's old setting: still taken
    assert "sample.py: --attention is now --attention_page\n" in err
    data = page_data(d / "attn.html")
    assert [len(k["queries"]) for k in data["kinds"]] == [len("LEAR:") + 10]
    # the same here: the int8 model's greedy text, and each layer's weights (in units of 1e-4)
    model, tok, _ = checkpoint.load_model(str(d / "out-target"), torch.device("cpu"))
    assert f"{sum(isinstance(m, nn.Linear) for m in model.modules())} Linear layers in int8" in err
    quantize_int8(model)
    out = generate(model, torch.tensor([tok.encode("LEAR:")]), 10, temperature=0)
    assert text.split(SEP)[0] == tok.decode(out[0].tolist())
    weights = {}  # each layer's, from the math path, which computes them
    model(out, weights=weights)
    layers = torch.stack([att[0] for att in weights["decoder self-attention"]]) * 1e4  # (n_layer, nh, T, T)
    page = torch.tensor(data["kinds"][0]["weights"], dtype=torch.float32)
    torch.testing.assert_close(page, layers.round(), rtol=0, atol=1.0)  # 1e-4: threads may round apart


@pytest.fixture(scope="module")
def every_arch(target_and_draft):
    """target_and_draft's runs, and beside them an encoder's and an encoder-decoder's (random weights)."""
    d = target_and_draft
    ckpt = torch.load(d / "out-target" / "ckpt.pt", weights_only=True)
    for arch in ("encoder", "encoder-decoder"):
        config = new_model_config(dict(arch=arch, n_layer=1, n_head=2, n_embd=32, block_size=16),
                                  ckpt["meta"]["vocab_size"])
        os.makedirs(d / f"out-{arch}", exist_ok=True)
        torch.save({**ckpt, "model_config": asdict(config), "model": Transformer(config).state_dict()},
                   d / f"out-{arch}" / "ckpt.pt")
    linear = ModelConfig(**ckpt["model_config"] | dict(attention="linear"))  # the target's shapes, linear attention
    os.makedirs(d / "out-linear", exist_ok=True)
    torch.save({**ckpt, "model_config": asdict(linear), "model": Transformer(linear).state_dict()},
               d / "out-linear" / "ckpt.pt")
    (d / "two.txt").write_text("ROMEO:\nLEAR: Blood\n")
    return d


@pytest.mark.parametrize("args, arch, shown, tokens", [
    (["--out_dir=out-target", "--start=LEAR:"], "decoder", 1, 2 * 6),  # 2 samples of 6 new tokens
    (["--out_dir=out-target", "--start=FILE:two.txt", "--batch"], "decoder", 2, 2 * 2 * 6),
    (["--out_dir=out-target", "--start=LEAR:", "--draft_dir=out-draft"], "decoder", 1, 2 * 6),
    (["--out_dir=out-encoder", "--start=LEAR: [MASK]lo[MASK]d"], "encoder", 1, 2 * 2),
    (["--out_dir=out-encoder-decoder", "--start=LEAR: [MASK] blood"], "encoder-decoder", 1, None),
], ids=["decoder", "batch", "draft", "encoder", "encoder-decoder"])
def test_every_sample_mode_gives_a_result_one_summary_line_and_its_first_sequences_page(
        every_arch, args, arch, shown, tokens, monkeypatch, in_process, capsys):
    results, timed = [], sample.timed
    monkeypatch.setattr(sample, "timed", lambda fn, device: (results.append(timed(fn, device)), results[-1])[1])
    capsys.readouterr()
    assert in_process(sample.main, [*args, "--num_samples=2", "--max_new_tokens=6", "--attention_page=attn.html"],
                      cwd=every_arch) == 0
    out, err = capsys.readouterr()
    (samples, _), = results  # main timed every sample at once
    assert len(samples) == 2 and all(isinstance(r, sample.Result) and len(r.seqs) == shown for r in samples)
    assert out.count(sample.SEP) == 2 * shown  # each sequence shown ends with the separator
    n = sum(r.tokens for r in samples)
    assert tokens in (None, n)  # an encoder-decoder ends where it closes the last span
    draft = r"; draft tokens accepted \d+/\d+ \([\d.]+%, k=4\)" if "--draft_dir=out-draft" in args else ""
    assert re.fullmatch(rf"{LOADED}sample.py: {n} tokens in [\d.]+ s, [\d.,]+ tokens/s \({arch}, cpu, float32 weights, eager\)"
                        rf"{draft}\nsample.py: attention weights of the first sample in attn.html\n", err)
    first = samples[0].seqs[0]
    assert len(page_data(every_arch / "attn.html")["kinds"][0]["queries"]) == len(first.get("src", first["idx"]))


@pytest.mark.parametrize("args, message", [
    (["--out_dir=out-target", "--start=FILE:two.txt", "--batch", "--draft_dir=out-draft"], "leave out --batch"),
    (["--out_dir=out-encoder", "--start=[MASK]", "--draft_dir=out-draft"], "an encoder fills in blanks"),
    (["--out_dir=out-target", "--draft_dir=out-encoder"], "out-encoder is an encoder: give --draft_dir a small decoder"),
    (["--out_dir=out-target", "--draft_dir=out-linear"], "linear attention's state cannot take back rejected draft"),
    (["--out_dir=out-linear", "--attention_page=attn.html"], "linear attention has no weights to draw"),
], ids=["batch", "encoder-target", "encoder-draft", "linear-draft", "linear-page"])
def test_sample_refuses_what_speculative_decoding_cannot_do_before_it_starts(every_arch, args, message, refusal):
    refusal(sample.main, args, message, cwd=every_arch)


def test_a_linear_attention_decoder_samples_what_its_generate_gives(every_arch, in_process, capsys):
    capsys.readouterr()
    assert in_process(sample.main, ["--out_dir=out-linear", "--start=LEAR:", "--max_new_tokens=6", "--temperature=0",
                                    "--num_samples=1"], cwd=every_arch) == 0
    model, tok, _ = checkpoint.load_model(every_arch / "out-linear", torch.device("cpu"))
    want = tok.decode(generate(model, torch.tensor([tok.encode("LEAR:")]), 6, temperature=0)[0].tolist())
    assert capsys.readouterr().out.startswith(want)


def test_sample_keeps_the_traceback_of_a_value_error_that_a_bug_raises(target_and_draft, run):
    # sample.py turns bad input into one line; any other error, a ValueError too, is a bug to report whole
    broken = ("import runpy, sys, generate\n"
              "def generate_tokens(*args, **kwargs):\n"
              "    raise ValueError('a bug')\n"
              "generate.generate_tokens = generate_tokens\n"
              f"runpy.run_path({os.path.abspath(sample.__file__)!r}, run_name='__main__')\n")
    code, _, err = run(sys.executable, "-c", broken, "--out_dir=out-target", "--max_new_tokens=3", cwd=target_and_draft,
                       env={"PYTHONPATH": os.path.dirname(os.path.abspath(sample.__file__))})
    assert code == 1 and "Traceback" in err and err.strip().endswith("ValueError: a bug"), err


def test_a_bart_run_writes_the_whole_text_that_generate_gives_for_the_masked_source(
        workdir, in_process, capsys, tiny_args, monkeypatch):
    d, _ = workdir
    assert in_process(train.main, ["--dataset=verse", "--out_dir=out-bart", "--arch=encoder-decoder", "--objective=bart",
                                   "--max_iters=2", "--eval_interval=2", *tiny_args], cwd=d) == 0
    model, tok, ckpt = checkpoint.load_model(str(d / "out-bart"), torch.device("cpu"))
    mask, start = ckpt["tokens"]["mask"], ckpt["tokens"]["start"]
    capsys.readouterr()
    args = ["--out_dir=out-bart", "--max_new_tokens=12", "--temperature=0"]
    assert in_process(sample.main, [*args, "--start=LEAR: [MASK] bl[MASK]"], cwd=d) == 0
    src = torch.tensor([tok.encode("LEAR: ") + [mask] + tok.encode(" bl") + [mask]])  # each [MASK] one mask token
    out = generate(model, torch.tensor([[start]]), 12, temperature=0, src=src, vocab_limit=tok.vocab_size)
    assert capsys.readouterr().out == tok.decode(out[0, 1:].tolist()) + SEP  # the whole text, from the start token
    # it stops once it has written the prompt's end, at the prompt's length or more
    written = iter(tok.encode("LEAR: bl blood, and sweet"))
    monkeypatch.setattr(sample, "generate_tokens", lambda *a, **k: (torch.tensor([[t]]) for t in written))
    assert in_process(sample.main, [*args, "--start=LEAR: b[MASK]d[MASK], and"], cwd=d) == 0
    assert capsys.readouterr().out == "LEAR: bl blood, and" + SEP


def test_sample_in_int4_prints_the_int4_models_text_which_follows_the_fp32_models(target_and_draft, sample_py):
    text, err = sample_py("--out_dir=out-target", "--start=LEAR:", "--max_new_tokens=20", "--quantize=int4",
                          "--group_size=32", "--temperature=0")
    model, tok, _ = checkpoint.load_model(str(target_and_draft / "out-target"), torch.device("cpu"))
    assert f"{sum(isinstance(m, nn.Linear) for m in model.modules())} Linear layers in int4" in err
    fp32 = generate(model, torch.tensor([tok.encode("LEAR:")]), 20, temperature=0)
    small, _, _ = checkpoint.load_model(str(target_and_draft / "out-target"), torch.device("cpu"), quantize="int4",
                                        group_size=32)
    out = generate(small, torch.tensor([tok.encode("LEAR:")]), 20, temperature=0)
    assert text.split(SEP)[0] == tok.decode(out[0].tolist())  # the int4 model's greedy text
    # close to fp32's: along fp32's greedy text the int4 model picks the same next token nearly everywhere
    with torch.no_grad():
        same = (small(fp32[:, :-1])[0].argmax(-1) == model(fp32[:, :-1])[0].argmax(-1))[0, len("LEAR:") - 1:]
    assert same.float().mean() >= 0.8  # (all 20 here; int4's logits stay within 0.2 of fp32's: test_quantize)


def test_int8_on_cuda_falls_back_to_unquantized_weights_and_says_why(capsys):
    """On CUDA torch has no fast int8 product (docs/performance.md): sample.py decodes without it, in one
    line; int4 and every CPU keep what was asked."""
    asked = sample.SampleConfig(quantize="int8")
    assert sample.int8_on_cuda(asked, torch.device("cuda")).quantize == ""
    said = capsys.readouterr().err.strip().splitlines()
    assert len(said) == 1 and "int8" in said[0] and "int4" in said[0]
    for cfg, device in [(asked, "cpu"), (sample.SampleConfig(quantize="int4"), "cuda")]:
        assert sample.int8_on_cuda(cfg, torch.device(device)) == cfg
    assert capsys.readouterr().err == ""
