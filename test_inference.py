"""Inference: sync-free and compilable decoding, batched prompts, speculative decoding, int8 weights
and attention pictures."""

import io
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
from contextlib import redirect_stdout
from dataclasses import asdict

import pytest
import torch
import torch.nn as nn

import bench
import checkpoint
import common
import sample as sample_py
from common import UsageError
from data import new_model_config
from model import ModelConfig, Transformer, accept_or_resample, speculative_generate
from quantize import Int8Linear, quantize_int8
from test_scripts import TINY, in_parallel, run, workdir  # noqa: F401  (workdir is a fixture)

V = 23


def model_of(seed=0, **kw):
    torch.manual_seed(seed)
    cfg = dict(vocab_size=V, block_size=32, n_layer=2, n_head=4, n_embd=32)
    return Transformer(ModelConfig(**{**cfg, **kw})).eval()


def prompt(T, B=1, seed=1):
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------------------------
# Fast decoding

def test_decoding_never_reads_a_tensor_value_on_the_host(monkeypatch):
    models = [model_of(pos="rope", n_kv_head=2), model_of(pos="learned", block_size=8, window=3)]
    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__"):
        def refuse(*args, name=name):
            raise AssertionError(f"Tensor.{name} would wait for the device")
        monkeypatch.setattr(torch.Tensor, name, refuse)
    for model in models:  # sampling with top-k and top-p, and the crop past a learned table
        out = model.generate(prompt(5, B=2), 12, temperature=0.9, top_k=10, top_p=0.9)
        assert out.shape == (2, 17)


@pytest.mark.parametrize("kw", [dict(pos="rope", n_kv_head=2), dict(pos="alibi", window=4),
                                dict(pos="relative", n_kv_head=1), dict(arch="encoder-decoder", pos="sinusoidal")],
                         ids=lambda kw: "-".join(map(str, kw.values())))
def test_the_decode_step_compiles_into_one_graph_and_matches_eager(kw):
    model = model_of(**kw)
    src = prompt(6, seed=2) if kw.get("arch") == "encoder-decoder" else None
    memory = model.encoder(model.wte(src), torch.arange(6)[None]) if src is not None else None
    step = torch.compile(model.decode, backend="aot_eager", fullgraph=True)  # fullgraph: no breaks
    outs = []
    for decode in (model.decode, step):
        model.setup_kv_cache(1, 16, memory)
        with torch.no_grad():
            model(prompt(3), input_pos=torch.arange(3))
            outs.append(torch.stack([decode(prompt(1, seed=i), torch.tensor([[3 + i]])) for i in range(5)]))
        model.clear_kv_cache()
    torch.testing.assert_close(outs[0], outs[1])


# ----------------------------------------------------------------------------------------------
# Batched prompts

@pytest.mark.parametrize("kw", [dict(pos="rope"), dict(pos="learned", block_size=12), dict(pos="alibi", n_kv_head=2),
                                dict(pos="relative", window=4), dict(pos="sinusoidal"), dict(pos="none")],
                         ids=lambda kw: "-".join(map(str, kw.values())))
def test_each_row_of_a_left_padded_batch_decodes_as_its_prompt_alone(kw):
    model = sharp(0, **kw)
    prompts = [prompt(n, seed=n)[0] for n in (3, 9, 1, 20)]  # 20: longer than the cache, in pieces
    T = max(map(len, prompts))
    idx = torch.zeros(len(prompts), T, dtype=torch.long)
    mask = torch.zeros(len(prompts), T, dtype=torch.bool)
    for i, p in enumerate(prompts):
        idx[i, T - len(p):], mask[i, T - len(p):] = p, True
    together = model.generate(idx, 15, temperature=0, mask=mask)[:, T:]
    for i, p in enumerate(prompts):
        assert torch.equal(together[i], model.generate(p[None], 15, temperature=0)[0, len(p):])


# ----------------------------------------------------------------------------------------------
# Speculative decoding

def sharp(seed, **kw):
    """A random model with large weights: peaked predictions that depend on the context, unlike a
    freshly initialised one, whose greedy output soon repeats one token (and any draft agrees)."""
    model = model_of(seed, **kw)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(8)
    return model


def noisy_copy(model, scale, seed=7):
    """A draft that agrees with the target only some of the time."""
    torch.manual_seed(seed)
    draft = Transformer(model.config).eval()
    with torch.no_grad():
        for p, q in zip(draft.parameters(), model.parameters()):
            p.copy_(q + scale * q.abs().mean() * torch.randn_like(q))
    return draft


@pytest.mark.parametrize("kw, draft_kw", [
    (dict(pos="rope"), dict(n_layer=1)),
    (dict(pos="sinusoidal", window=3), dict(n_layer=1, pos="alibi")),
    (dict(pos="learned", block_size=16), dict(pos="learned", block_size=24, n_layer=1)),  # past the table
    (dict(pos="relative", n_kv_head=2), dict(n_layer=1, n_embd=16, n_head=2)),
], ids=["rope", "window", "learned-past-block", "relative-gqa"])
def test_greedy_speculative_decoding_is_the_targets_greedy_decoding(kw, draft_kw):
    target = sharp(0, **kw)
    drafts = [sharp(1, **{**kw, **draft_kw}), noisy_copy(target, 0.5)]  # mostly rejected; half accepted
    accepted = proposed = 0
    for draft in drafts:
        for T in (1, 6, 40):  # 40: a prompt longer than the caches, which go in by pieces
            idx = prompt(T)
            # 8 new tokens stay within block_size, where stale cache slots after a rollback would show
            for k, n in itertools.product((1, 3, 5), (8, 30)):
                out, a, p = speculative_generate(target, draft, idx, n, k=k, temperature=0)
                assert torch.equal(out, target.generate(idx, n, temperature=0))
                accepted, proposed = accepted + a, proposed + p
    assert 0 < accepted < proposed  # both paths, keeping drafts and rolling them back, were taken


def test_a_draft_identical_to_the_target_is_always_accepted():
    target = model_of(pos="rope")
    _, accepted, proposed = speculative_generate(target, target, prompt(4), 20, k=4, temperature=0.8)
    assert accepted == proposed > 0


def test_accept_or_resample_gives_the_targets_distribution_whatever_the_draft():
    torch.manual_seed(0)
    p = torch.tensor([[0.1, 0.5, 0.3, 0.1], [0.25, 0.25, 0.25, 0.25]])  # the target at 2 positions
    q = torch.tensor([[0.6, 0.1, 0.1, 0.2]])  # a draft that disagrees
    first = torch.zeros(4)
    n = 20000
    for _ in range(n):
        drafted = torch.multinomial(q[0], 1)
        first[accept_or_resample(p, q, drafted)[0]] += 1
    torch.testing.assert_close(first / n, p[0], rtol=0, atol=0.012)


def test_speculative_sampling_draws_the_first_token_from_the_target():
    target, draft = model_of(0, pos="rope", vocab_size=6), model_of(5, pos="rope", vocab_size=6, n_layer=1)
    idx = prompt(3) % 6
    with torch.no_grad():
        want = target(idx)[0][0, -1].softmax(-1)
    torch.manual_seed(0)
    counts = torch.zeros(6)
    for _ in range(2000):
        counts[speculative_generate(target, draft, idx, 1, k=2, temperature=1.0)[0][0, -1]] += 1
    torch.testing.assert_close(counts / 2000, want, rtol=0, atol=0.035)  # about 4 standard errors


# ----------------------------------------------------------------------------------------------
# int8 weights

@pytest.mark.parametrize("kernel", [True, False], ids=["int8-kernel", "dequantized"])
def test_int8_linear_is_within_half_a_step_per_weight_and_4x_smaller(kernel, monkeypatch):
    if not kernel:  # the path of devices without torch's int8 x float kernel (CUDA)
        monkeypatch.delattr(torch, "_weight_int8pack_mm", raising=False)
    torch.manual_seed(0)
    linear = nn.Linear(64, 48)
    q = Int8Linear(linear)
    x = torch.randn(5, 64)
    with torch.no_grad():
        err = (q(x) - linear(x)).abs()
    bound = x.abs() @ (q.scale[:, None].expand(48, 64) / 2).T  # rounding moves each weight by <= step/2
    assert (err <= bound + 1e-5).all()
    assert q.weight.dtype == torch.int8 and q.weight.numel() * 4 == linear.weight.numel() * linear.weight.element_size()
    assert (q.weight.abs().amax(dim=1) == 127).all()  # each row's largest weight uses the full range
    assert q(torch.randn(0, 64)).shape == (0, 48)  # no rows: what an expert gets when no token picks it
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):  # as nn.Linear under autocast
        assert q(x).dtype == linear(x).dtype == torch.bfloat16


def test_quantize_int8_replaces_every_linear_and_keeps_the_logits_close():
    model = model_of(pos="rope", n_kv_head=2, mlp="swiglu")
    idx = prompt(10, B=2)
    with torch.no_grad():
        before = model(idx)[0]
        quantize_int8(model)
        after = model(idx)[0]
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert sum(isinstance(m, Int8Linear) for m in model.modules()) == 2 * 4 + 1  # qkv, proj, fc, proj; head
    assert ((after - before).abs().max() / before.abs().max()) < 0.05
    assert model.generate(idx, 5).shape == (2, 15)


def test_an_int8_mixture_of_experts_decodes_though_most_experts_get_no_token():
    model = quantize_int8(model_of(n_expert=4, expert_top_k=1))
    assert model.generate(prompt(3, B=1), 4, temperature=0).shape == (1, 7)  # one token a step: 3 experts idle


# ----------------------------------------------------------------------------------------------
# Attention pictures

def page_data(path):
    text = open(path, encoding="utf-8").read()
    assert "<script src" not in text and "<link" not in text and "http" not in text  # self-contained
    return json.loads(re.search(r"const DATA = (.*);\n", text).group(1))


def cells_rendered(path):
    """The heatmap squares Chromium draws for the page as first shown (layer 0, head 0)."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    out = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                          "--disable-component-update", "--disable-sync", "--no-first-run", "--dump-dom",
                          f"file://{os.path.abspath(path)}"], capture_output=True, text=True, timeout=120).stdout
    return out.count('class="cell"')


@pytest.mark.parametrize("arch, kinds", [("decoder", 1), ("encoder", 1), ("encoder-decoder", 3)])
def test_attention_page_holds_every_layer_and_head(tmp_path, arch, kinds):
    model = model_of(arch=arch, pos="alibi")
    seq = dict(idx=prompt(7)[0].tolist())
    if arch == "encoder-decoder":
        seq["src"] = prompt(5, seed=3)[0].tolist()
    tok = type("Tok", (), dict(vocab_size=V, decode=lambda self, ids: "".join(chr(97 + i) for i in ids)))()
    sample_py.write_attention(tmp_path / "attn.html", model, tok, seq, 128)
    data = page_data(tmp_path / "attn.html")
    assert len(data["kinds"]) == kinds
    for kind in data["kinds"]:
        w = torch.tensor(kind["weights"]) / 1e4  # (layers, heads, Tq, Tk)
        assert w.shape == (2, 4, len(kind["queries"]), len(kind["keys"]))
        torch.testing.assert_close(w.sum(-1), torch.ones(w.shape[:-1]), rtol=0, atol=2e-3)
        if kind["name"] == "decoder self-attention":
            assert w.triu(1).abs().max() == 0  # nothing from the future
    if shutil.which("chromium") is None and shutil.which("chromium-browser") is None:
        pytest.skip("headless Chromium is not installed (.ci/run installs Debian's chromium)")
    first = data["kinds"][0]
    assert cells_rendered(tmp_path / "attn.html") == len(first["queries"]) * len(first["keys"])


# ----------------------------------------------------------------------------------------------
# sample.py end to end

@pytest.fixture(scope="module")
def target_and_draft(workdir):  # noqa: F811
    d, _ = workdir
    for out, extra in (("out-target", ["--pos=rope"]), ("out-draft", ["--pos=rope", "--n_layer=1"])):
        code, _, err = run("train.py", "--dataset=verse", f"--out_dir={out}", "--max_iters=20", "--eval_interval=10",
                           *TINY, *extra, cwd=d)
        assert code == 0, err
    return d


def test_sample_batch_gives_each_line_what_it_gets_alone(target_and_draft):
    d = target_and_draft
    (d / "prompts.txt").write_text("ROMEO:\nLEAR: Blood\n\nJULIET: sweet love\n")
    code, together, err = run("sample.py", "--out_dir=out-target", "--start=FILE:prompts.txt", "--batch",
                              "--max_new_tokens=25", "--temperature=0", cwd=d)
    assert code == 0, err
    for line, text in zip(["ROMEO:", "LEAR: Blood", "JULIET: sweet love"], together.split("\n---------------\n")):
        code, alone, err = run("sample.py", "--out_dir=out-target", f"--start={line}", "--max_new_tokens=25",
                               "--temperature=0", cwd=d)
        assert text == alone.split("\n---------------\n")[0]


def test_sample_with_a_draft_prints_the_acceptance_rate_and_the_target_text(target_and_draft):
    d = target_and_draft
    args = ["--out_dir=out-target", "--start=LEAR:", "--max_new_tokens=30", "--temperature=0"]
    code, plain, _ = run("sample.py", *args, cwd=d)
    code, fast, err = run("sample.py", *args, "--draft_dir=out-draft", "--draft_k=3", cwd=d)
    assert code == 0, err
    assert fast == plain  # greedy: the same text
    assert re.fullmatch(r"sample.py: 30 tokens in [\d.]+ s, [\d.,]+ tokens/s \(decoder, cpu, float32 weights\); "
                        r"draft tokens accepted \d+/\d+ \([\d.]+%, k=3\)\n", err)  # no second run of the target alone


def test_sample_in_bf16_holds_the_weights_in_bf16_with_or_without_a_draft(target_and_draft):
    d = target_and_draft
    args = ["--out_dir=out-target", "--start=LEAR:", "--max_new_tokens=20", "--temperature=0", "--dtype=bfloat16"]
    (code, text, err), (code2, fast, err2) = in_parallel(lambda: run("sample.py", *args, cwd=d),
                                                         lambda: run("sample.py", *args, "--draft_dir=out-draft", cwd=d))
    assert code == 0 and code2 == 0, err + err2
    assert "(decoder, cpu, bfloat16 weights)" in err  # cast once, not by autocast at every token
    model, tok, _ = checkpoint.load_model(str(d / "out-target"), torch.device("cpu"), torch.bfloat16)
    out = model.generate(torch.tensor([tok.encode("LEAR:")]), 20, temperature=0)
    assert text.split("\n---------------\n")[0] == tok.decode(out[0].tolist())
    assert fast == text  # the draft, loaded in the target's dtype: greedy, the same text


def test_sample_int8_and_attention_page(target_and_draft):
    d = target_and_draft
    code, text, err = run("sample.py", "--out_dir=out-target", "--start=LEAR:", "--max_new_tokens=10",
                          "--quantize=int8", "--attention=attn.html", "--temperature=0", cwd=d)
    assert code == 0, err
    data = page_data(d / "attn.html")
    assert [len(k["queries"]) for k in data["kinds"]] == [len("LEAR:") + 10]
    # the same here: the int8 model's greedy text, and each layer's weights (in units of 1e-4)
    model, tok, _ = checkpoint.load_model(str(d / "out-target"), torch.device("cpu"))
    assert f"{sum(isinstance(m, nn.Linear) for m in model.modules())} Linear layers in int8" in err
    quantize_int8(model)
    out = model.generate(torch.tensor([tok.encode("LEAR:")]), 10, temperature=0)
    assert text.split("\n---------------\n")[0] == tok.decode(out[0].tolist())
    model.config.attn_impl = "math"  # the path that computes the weights, handed to each layer's hook
    layers = []
    for block in model.decoder.h:
        block.attn.weights_hook = lambda att: layers.append(att[0])
    model(out)
    layers = torch.stack(layers) * 1e4  # (n_layer, nh, T, T)
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
        every_arch, args, arch, shown, tokens, monkeypatch, capsys):
    monkeypatch.chdir(every_arch)
    results, timed = [], sample_py.timed
    monkeypatch.setattr(sample_py, "timed", lambda fn, device: (results.append(timed(fn, device)), results[-1])[1])
    assert sample_py.main([*args, "--num_samples=2", "--max_new_tokens=6", "--attention=attn.html"]) == 0
    out, err = capsys.readouterr()
    (samples, _), = results  # main timed every sample at once
    assert len(samples) == 2 and all(isinstance(r, sample_py.Result) and len(r.seqs) == shown for r in samples)
    assert out.count(sample_py.SEP) == 2 * shown  # each sequence shown ends with the separator
    n = sum(r.tokens for r in samples)
    assert tokens in (None, n)  # an encoder-decoder ends where it closes the last span
    draft = r"; draft tokens accepted \d+/\d+ \([\d.]+%, k=4\)" if "--draft_dir=out-draft" in args else ""
    assert re.fullmatch(rf"sample.py: {n} tokens in [\d.]+ s, [\d.,]+ tokens/s \({arch}, cpu, float32 weights\)"
                        rf"{draft}\nsample.py: attention weights of the first sample in attn.html\n", err)
    first = samples[0].seqs[0]
    assert len(page_data("attn.html")["kinds"][0]["queries"]) == len(first.get("src", first["idx"]))


@pytest.mark.parametrize("args, message", [
    (["--out_dir=out-target", "--start=FILE:two.txt", "--batch", "--draft_dir=out-draft"], "leave out --batch"),
    (["--out_dir=out-encoder", "--start=[MASK]", "--draft_dir=out-draft"], "an encoder fills in blanks"),
    (["--out_dir=out-target", "--draft_dir=out-encoder"], "out-encoder is an encoder: give --draft_dir a small decoder"),
], ids=["batch", "encoder-target", "encoder-draft"])
def test_sample_refuses_what_speculative_decoding_cannot_do_before_it_starts(every_arch, args, message, monkeypatch):
    monkeypatch.chdir(every_arch)
    with pytest.raises(UsageError, match=message):
        sample_py.main(args)


def test_sample_keeps_the_traceback_of_a_value_error_that_a_bug_raises(target_and_draft):
    # sample.py turns bad input into one line; any other error, a ValueError too, is a bug to report whole
    broken = ("import runpy, sys, model\n"
              "def generate_tokens(*args, **kwargs):\n"
              "    raise ValueError('a bug')\n"
              "model.Transformer.generate_tokens = generate_tokens\n"
              f"runpy.run_path({os.path.abspath(sample_py.__file__)!r}, run_name='__main__')\n")
    code, _, err = run(sys.executable, "-c", broken, "--out_dir=out-target", "--max_new_tokens=3", cwd=target_and_draft,
                       env={"PYTHONPATH": os.path.dirname(os.path.abspath(sample_py.__file__))})
    assert code == 1 and "Traceback" in err and err.strip().endswith("ValueError: a bug"), err


def test_bench_sample_times_the_target_alone_and_speculative_decoding_in_one_run(target_and_draft, monkeypatch, capsys):
    monkeypatch.chdir(target_and_draft)
    assert bench.main(["sample", "--out_dir=out-target", "--draft_dir=out-draft", "--draft_k=3", "--max_new_tokens=20",
                       "--device=cpu"]) == 0
    out = capsys.readouterr().out
    alone = float(re.search(r"^target alone: +([\d,.]+) tokens/s$", out, re.M)[1].replace(",", ""))
    fast = float(re.search(r"^speculative: +([\d,.]+) tokens/s \(draft tokens accepted \d+/\d+, [\d.]+%\)$", out,
                           re.M)[1].replace(",", ""))
    assert float(re.search(r"^speed-up: ([\d.]+)x$", out, re.M)[1]) == pytest.approx(fast / alone, abs=0.011)
    assert "k=3; 20 new tokens" in out



def test_bench_compiled_times_each_models_own_decode_step(monkeypatch):
    # torch.compile wraps decode in a closure over the model: a copy made after compiling would
    # decode with the original (a stand-in closure, so that the test needs no compiler)
    decoded = set()
    def closure_compile(fn, **kw):
        def step(*args, **kwargs):
            decoded.add(any(isinstance(m, Int8Linear) for m in fn.__self__.modules()))
            return fn(*args, **kwargs)
        return step
    monkeypatch.setattr(torch, "compile", closure_compile)
    config = ModelConfig(vocab_size=97, block_size=64, n_layer=2, n_head=2, n_embd=32)
    with redirect_stdout(io.StringIO()):
        bench.decode_speed(config, torch.device("cpu"), torch.float32, compile=True, news=(4, 8), prompt=3)
    assert decoded == {False, True}  # the full-precision model and the int8 one, each its own

def test_bench_prints_cache_no_cache_int8_and_floor():
    config = ModelConfig(vocab_size=97, block_size=64, n_layer=2, n_head=2, n_embd=32)
    out = io.StringIO()
    with redirect_stdout(out):
        bench.decode_speed(config, torch.device("cpu"), torch.float32, news=(4, 8), prompt=3)
    text = out.getvalue()
    assert "floor (every weight's product once):" in text
    diff = float(re.search(r"int8 logits: max \|difference\| / max \|logit\| = ([\d.]+)", text).group(1))
    assert 0 < diff < 0.05  # int8 was applied, and rounds each weight by at most half a step
    rows = [line for line in text.splitlines() if re.match(r"\s+\d+ \|", line)]
    assert [int(r.split("|")[0]) for r in rows] == [4, 8] and all(r.count("tok/s") == 3 for r in rows)


# ----------------------------------------------------------------------------------------------
# bench.py's command line, in the style of the other scripts

def test_bench_help_lists_every_benchmarks_settings_and_one_benchmarks_alone(capsys):
    assert bench.main(["--help"]) == 0
    text = capsys.readouterr().out
    assert text.startswith(bench.__doc__.strip())
    assert all(f"\n    {key}: " in text for key in ("max_iters", "n_layer", "draft_dir", "seqs", "no_math"))
    assert bench.main(["attention", "-h"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("python bench.py attention: ") and "\n    seqs: tuple | int = " in text
    assert "max_iters" not in text


def test_bench_attention_reads_lists_with_commas():
    cfg = bench.AttentionConfig(**common.parse_settings(["--seqs=1024,4096", "--dims=64"], bench.AttentionConfig)[0])
    assert (bench.sizes(cfg, "seqs"), bench.sizes(cfg, "dims")) == ((1024, 4096), (64,))
    with pytest.raises(UsageError, match="seqs=.* should be positive whole numbers: write --seqs=1024,4096"):
        bench.sizes(bench.AttentionConfig(seqs=(512, 0)), "seqs")


def test_bench_from_the_command_line_answers_help_and_a_misspelt_setting_in_one_line(tmp_path):
    results = in_parallel(lambda: run("bench.py", "--help", cwd=tmp_path),
                          lambda: run("bench.py", "train", "--max_iter=3", cwd=tmp_path),
                          lambda: run("bench.py", "attention", "--sqes=1", cwd=tmp_path))
    (code, text, _), *errors = results
    assert code == 0 and "Settings (--key=value" in text
    for (code, _, err), want in zip(errors, ("did you mean --max_iters?", "did you mean --seqs?")):
        assert code == 2 and err.count("\n") == 1 and err.startswith("bench.py: error: ") and want in err, err
