"""bench.py: the decoding benchmarks (against transformers on the same weights, int8, the compiled
step, the memory bound; speculative decoding against the target alone), the attention a training batch takes, and its command line in the style of the
other scripts; bench.py memory prints the plan. (bench.py train against nanoGPT's recipe: test_train.py.)"""

import io
import os
import re
from contextlib import redirect_stdout

import pytest
import torch

import bench
import common
import generate
import kernels
import train
from common import UsageError
from model import ModelConfig
from quantize import quantize_int8, runs_here

W4A8 = runs_here("int4-dynamic", torch.device("cpu"))  # w4a8.cpp builds here: a C++ compiler
FORMATS = ["", ", int8", ", int4", ", int8-dynamic"] + [", int4-dynamic"] * W4A8  # bench.py sample's rows on a CPU

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root, where configs/ is


# ----------------------------------------------------------------------------------------------
# Decoding

def test_bench_sample_times_the_target_alone_and_speculative_decoding_in_one_run(trained, in_process, tiny_args,
                                                                                  capsys):
    d = trained  # out-ok, the target; a draft of one layer beside it
    assert in_process(train.main, ["--dataset=verse", "--out_dir=out-draft", "--max_iters=2", "--eval_interval=2",
                                   *tiny_args, "--n_layer=1"], cwd=d) == 0
    capsys.readouterr()
    assert in_process(bench.main, ["sample", "--out_dir=out-ok", "--draft_dir=out-draft", "--draft_k=3",
                                   "--max_new_tokens=20", "--device=cpu"], cwd=d) == 0
    out = capsys.readouterr().out
    alone = float(re.search(r"^target alone: +([\d,.]+) tokens/s$", out, re.M)[1].replace(",", ""))
    fast = float(re.search(r"^speculative: +([\d,.]+) tokens/s \(draft tokens accepted \d+/\d+, [\d.]+%\)$", out,
                           re.M)[1].replace(",", ""))
    assert float(re.search(r"^speed-up: ([\d.]+)x$", out, re.M)[1]) == pytest.approx(fast / alone, abs=0.011)
    assert "k=3; 20 new tokens" in out


def test_bench_sample_prints_what_int8_and_int4_weights_cost_a_run(trained, monkeypatch, capsys):
    monkeypatch.chdir(trained)
    bench.quantized_quality("out-ok", torch.device("cpu"), n_batches=4)
    rows = dict((name, (float(loss), float(diff))) for name, loss, diff in re.findall(
        r"^  (\w[\w ,]*?) +([\d.]+) \([+-][\d.]+\)  ([\d.]+)$", capsys.readouterr().out, re.M))
    assert list(rows) == ["fp32", "int8", "int4, groups of 32", "int4, groups of 128"]
    assert rows["fp32"][1] == 0 and rows["int4, groups of 128"][1] > 0  # (128: out-ok's MLP projection only)
    assert 0 < rows["int8"][1] < rows["int4, groups of 32"][1] < 0.5  # int4's steps are 16 times as coarse
    assert abs(rows["int8"][0] - rows["fp32"][0]) < 0.01


@pytest.mark.parametrize("compile, pays_from", [(True, 5000), (None, 16)])  # told; untold, where it pays
def test_bench_compiled_row_decodes_through_the_compiled_step(monkeypatch, compile, pays_from):
    # a stand-in for torch.compile (no compiler needed) that records the cache size of each step it runs;
    # untold, compiled rows where the steps of the warm-up and rounds reach COMPILE_PAYS_FROM (8 + 8 here)
    monkeypatch.setattr(generate, "COMPILE_PAYS_FROM", pays_from)
    stepped = []
    def recording_compile(fn, **kw):
        def step(model, *args, **kwargs):
            stepped.append(model.decoder.cache_pos.size(1))
            return fn(model, *args, **kwargs)
        return step
    monkeypatch.setattr(torch, "compile", recording_compile)
    config = ModelConfig(vocab_size=97, block_size=64, n_layer=2, n_head=2, n_embd=32)
    with redirect_stdout(io.StringIO()) as out:
        bench.decode_speed(config, torch.device("cpu"), torch.float32, compile=compile, new=8, prompt=3, rounds=1)
    # 7 steps after the prefill, warm-up and round, for fp32, int8, int4, W8A8 and W4A8 (where it builds); the cache
    # rounded up to its full ring (block_size 64)
    assert stepped == [64] * 7 * 2 * len(FORMATS)
    compiled = {name for name in table(out.getvalue()) if name.endswith(", compiled")}
    assert compiled == {f"nanoformer{f}, compiled" for f in FORMATS}
    monkeypatch.setattr(generate, "COMPILE_PAYS_FROM", 17)  # one step short: no compiled row
    with redirect_stdout(io.StringIO()) as out:
        bench.decode_speed(config, torch.device("cpu"), torch.float32, new=8, prompt=3, rounds=1)
    assert not any("compiled" in name for name in table(out.getvalue())) and len(stepped) == 7 * 2 * len(FORMATS)


def table(text):
    """The rows of decode_speed's table: {decoder: (tokens/s, vs transformers, MB/step, of the bound)}."""
    rows = re.findall(r"^(\w[\w ,-]*?) +\| +([\d.]+) \| +([\d.]+)x \| +([\d.]+) MB \| +(\d+)%$", text, re.M)
    return {name: tuple(map(float, numbers)) for name, *numbers in rows}


@pytest.mark.parametrize("batch", [1, 3])
def test_bench_sample_decodes_the_same_tokens_as_transformers_from_the_same_weights(batch, capsys):
    pytest.importorskip("transformers")
    config = ModelConfig(vocab_size=97, block_size=64, n_layer=2, n_head=2, n_embd=128)  # int4's groups of 128
    bench.decode_speed(config, torch.device("cpu"), torch.float32, batch=batch, new=8, prompt=3, rounds=2)
    text = capsys.readouterr().out
    assert f"decoding at batch {batch}:" in text and "the same weights, the same tokens" in text
    rows = table(text)
    assert set(rows) == {"transformers", "nanoformer, weights as stored"} | {f"nanoformer{f}" for f in FORMATS}
    assert rows["transformers"][1] == 1.0
    rate = float(re.search(r"memory reads ([\d.]+) GB/s", text)[1]) * 1e9
    for tps, vs, mb, bound in rows.values():
        assert vs == pytest.approx(tps / rows["transformers"][0], abs=0.006)
        assert bound == pytest.approx(100 * tps / batch * mb * 1e6 / rate, abs=max(1, 0.02 * bound))  # one read a step
    diff = re.search(r"max \|logit difference\| / max \|logit\|: int8 ([\d.]+), int4 ([\d.]+), int8-dynamic ([\d.]+)"
                     r"(?:, int4-dynamic ([\d.]+))?; greedy tokens equal to fp32's, of 8: int8 [\d.]+%, int4 [\d.]+%, "
                     r"int8-dynamic [\d.]+%(?:, int4-dynamic [\d.]+%)?$", text, re.M)
    assert (diff[4] is not None) == W4A8
    assert 0 < float(diff[1]) < 0.05  # int8 was applied, and rounds each weight by at most half a step
    assert 0 < float(diff[3]) < 0.05  # W8A8 too: each weight and each activation by at most half a step
    assert float(diff[1]) < float(diff[2]) < 0.5 and float(diff[1]) < float(diff[4] or 0.1) < 0.5  # int4: 16x coarser
    assert rows["nanoformer, int8"][2] < rows["nanoformer"][2] / 3 and rows["nanoformer, int4"][2] < rows["nanoformer"][2] / 6


def test_bench_stream_shows_the_cache_growing_with_length_and_the_window_and_states_not(in_process, capsys):
    assert in_process(bench.main, ["stream", "--lengths=64,256", "--steps=4", "--window=32", "--n_global=2",
                                   "--n_features=16", "--device=cpu"]) == 0
    rows = re.findall(r"^(.+?) +\| +(\d+) \| +([\d.]+) \| +([\d.]+) MiB$", capsys.readouterr().out, re.M)
    mib = {(name, int(L)): float(m) for name, L, _, m in rows}
    assert len(rows) == 8 and all(float(tps) > 0 for _, _, tps, _ in rows)
    # full attention keeps every position: 4 layers x k and v x 4 heads x 64, fp32, plus a position per slot
    per_slot = (4 * 2 * 4 * 64 * 4 + 8) / 2**20
    assert mib["softmax, full", 256] == pytest.approx(mib["softmax, full", 64] * 260 / 68, rel=0.01)
    assert mib["softmax, full", 64] == pytest.approx(per_slot * 68, abs=0.006)
    assert mib["window 32 + 2 global", 64] == mib["window 32 + 2 global", 256] == pytest.approx(per_slot * 66, abs=0.006)
    state = 4 * 4 * (64 * 64 + 64) * 4 / 2**20  # layers x n_kv_head x (S + z), fp32
    assert mib["linear", 64] == mib["linear", 256] == pytest.approx(state, abs=0.006)
    state = 4 * 4 * (16 * 64 + 16 + 1) * 4 / 2**20  # layers x n_kv_head x (S + z + the running max), fp32
    assert mib["performer, m=16", 64] == mib["performer, m=16", 256] == pytest.approx(state, abs=0.006)


def test_a_token_reads_every_linear_and_norm_weight_once(tiny_model):
    model = tiny_model()  # tied: the lm_head is the embedding table, read whole once
    c, C = model.config, model.config.n_embd
    per_block = (3 * C * C + 3 * C) + (C * C + C) + (4 * C * C + 4 * C) + (4 * C * C + C) + 2 * 2 * C  # + ln_1, ln_2
    assert bench.bytes_per_token(model) == 4 * (c.n_layer * per_block + 2 * C + c.vocab_size * C)
    assert bench.bytes_per_token(quantize_int8(model)) < bench.bytes_per_token(tiny_model()) / 3


# ----------------------------------------------------------------------------------------------
# Training

def test_train_bench_names_the_attention_a_training_batch_takes_as_auto_would_on_a_gpu(monkeypatch, tiny_model):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    kernel = "triton" if kernels.available else "sdpa"
    def used(**kw):  # 4096 positions: where the kernel beats SDPA
        return bench.training_attention(tiny_model(**dict(block_size=4096, n_layer=1, pos="alibi") | kw),
                                        torch.device("cuda"))
    assert used() == used(pos="rope", window=8) == used(arch="encoder", pos="rope", window=8) == kernel
    assert used(pos="rope") == used(dropout=0.1) == used(block_size=2048) == "sdpa"  # dropout: when training


# ----------------------------------------------------------------------------------------------
# The command line, in the style of the other scripts

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


@pytest.mark.parametrize("args, message", [
    (["train", "--max_iter=3"], "did you mean --max_iters?"),
    (["attention", "--sqes=1"], "did you mean --seqs?"),
    ([], "no benchmark named: choose one of train, sample, attention, stream, family, scaling, prepare, memory"),
    (["attentoin"], "unknown benchmark 'attentoin': choose one of train, sample, attention, stream, family, scaling, prepare, memory"),
    pytest.param(["attention", "--seqs=512"], "attention needs a CUDA GPU", marks=pytest.mark.skipif(
        torch.cuda.is_available(), reason="checks the message printed where there is no GPU")),
], ids=["misspelt-train-setting", "misspelt-attention-setting", "no-name", "unknown-name", "no-gpu"])
def test_bench_refuses_a_misspelt_setting_an_unknown_benchmark_or_no_gpu_in_one_line(args, message, refusal, capsys):
    refusal(bench.main, args, message)
    assert capsys.readouterr().out == ""  # nothing measured, nothing printed


def test_bench_from_the_command_line_answers_help_and_refuses_in_one_line_with_exit_2(tmp_path, run, in_parallel,
                                                                                      one_line_error):
    # the command line's own runs: its __main__ block turns main's UsageError into this line
    (code, text, _), (code2, out, err) = in_parallel(lambda: run("bench.py", "--help", cwd=tmp_path),
                                                     lambda: run("bench.py", "attentoin", cwd=tmp_path))
    assert code == 0 and "Settings (--key=value" in text
    assert out == "" and one_line_error((code2, out, err), "choose one of train, sample, attention, stream, family, scaling, prepare, memory")
    assert err == "bench.py: error: unknown benchmark 'attentoin': choose one of train, sample, attention, stream, family, scaling, prepare, memory " \
                  "(python bench.py --help lists their settings)\n", err


# ----------------------------------------------------------------------------------------------
# prepare.py's speed and memory

def test_bench_prepare_measures_prepare_py_and_tiktoken_on_the_same_text(tmp_path, in_process, gpt2_bpe, capsys):
    assert in_process(bench.main, ["prepare", "--size=3MB", "--workers=1", f"--dir={tmp_path}"], cwd=tmp_path) == 0
    out = capsys.readouterr().out
    ours = re.search(r"^prepare.py: +([\d.]+) MB/s +([\d,]+) tokens/s +\(([\d,]+) tokens in ([\d.]+) s\)$", out, re.M)
    theirs = re.search(r"^tiktoken encode_ordinary_batch: +([\d.]+) MB/s +([\d,]+) tokens/s +\(([\d,]+) tokens", out, re.M)
    n, m = (int(x[3].replace(",", "")) for x in (ours, theirs))
    assert abs(n - m) < 100 and n > 500_000  # the same text (cut into pieces at other lines)
    assert float(re.search(r"^prepare.py / tiktoken: +([\d.]+)x$", out, re.M)[1]) > 0
    pss, rss = (float(x.replace(",", "")) for x in re.search(r"([\d,]+) MiB \(PSS summed\), ([\d,]+) MiB \(RSS", out).groups())
    assert 10 < pss <= rss < 2000
    assert list(tmp_path.iterdir()) == []  # the corpus and the dataset removed


def test_bench_prepare_refuses_a_size_it_cannot_read(refusal):
    refusal(bench.main, ["prepare", "--size=lots"], "--size='lots' is not a size", "--size=1GB")


# ----------------------------------------------------------------------------------------------
# What each rank of a mesh holds, planned (distributed.plan; tests/test_parallel.py checks the plan)

def test_bench_memory_prints_the_plan(in_process, capsys):
    capsys.readouterr()
    assert in_process(bench.main, ["memory", "--params=7.5e9", "--accounting=paper", "--gpus=64"]) == 0
    out = capsys.readouterr().out
    for row, total in (("DDP", "120"), ("ZeRO-1", "31.4"), ("ZeRO-2", "16.6"), ("ZeRO-3", "1.88")):
        assert re.search(rf"^{row} .* {total}  (yes|no)", out, re.M), out
    assert in_process(bench.main, ["memory", "configs/gpt2_124m.py", "--gpus=8", "--tensor_parallel=2"],
                      cwd=ROOT) == 0
    out = capsys.readouterr().out
    assert "0.124B parameters on 8 GPUs" in out and "mesh (pp, dp, cp, tp) = (1, 4, 1, 2)" in out, out
    assert re.search(r"the deepest of this width that fits under --zero=\d: n_layer=\d+", out), out
