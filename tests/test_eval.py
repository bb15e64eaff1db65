"""eval.py: a text's loss, bits per byte and perplexity, and multiple-choice accuracy, each equal to an
independent computation with transformers' model on the run's export (and to lm-evaluation-harness's
numbers where it is installed); padding a batch changes no score; a prefix LM reads the context both
ways; an encoder scores its masked tokens; bad input refused in one line."""

import json
import math
import os
import random
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import checkpoint
import common
import eval as evaluate
import hf
import prepare
import train
from tokenizer import Tokenizer

WORDS = "love death king crown night day sweet sorrow heart blood fair lord lady sword grave".split()


def write_tasks(path, n=12, seed=0):
    """n questions in HellaSwag's schema from the corpus's words: four endings, one of them right."""
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n):
            ctx = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 8 if i else 12))).capitalize()
            ctx += " " if i % 3 == 0 else ""  # a trailing space goes to the ending
            endings = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 2))) + "." for _ in range(4)]
            f.write(json.dumps(dict(ctx=ctx, endings=endings, label=rng.randrange(4))) + "\n" * (1 + (i == 3)))


@pytest.fixture(scope="module", params=["char", "gpt2"])
def exported(request, trained, in_process, tiny_args):
    """A run exported, and transformers' model and tokenizer of the export: the trained run (out-ok,
    characters with an end-of-text token, block_size 16) to hf-ok, or one trained here on the same
    texts in GPT-2's BPE (out-bpe, where tokens are not bytes and a space joins the word after it) to hf-bpe."""
    transformers = pytest.importorskip("transformers")
    run = dict(char="out-ok", gpt2="out-bpe")[request.param]
    if request.param == "gpt2":
        request.getfixturevalue("gpt2_bpe")
        args = ["text", "--input=texts/*.txt", "--name=verse_bpe", "--tokenizer=gpt2", "--workers=1"]
        assert in_process(prepare.main, args, cwd=trained) in (None, 0)  # prepare.main returns nothing
        assert in_process(train.main, ["--dataset=verse_bpe", f"--out_dir={run}", "--max_iters=4",
                                       "--eval_interval=2", *tiny_args], cwd=trained) == 0
    export = run.replace("out-", "hf-")
    assert in_process(hf.main, ["export", run, export], cwd=trained) == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(trained / export).eval()
    tok = transformers.AutoTokenizer.from_pretrained(trained / export)
    return SimpleNamespace(d=trained, model=model, tok=tok, run=run, export=export, bpe=request.param == "gpt2")


def hf_log_probs(model, ids):
    with torch.no_grad():
        return F.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1)


def hf_loglikelihood(model, ctx, cont, T):
    """lm-evaluation-harness's definition: the last T + 1 ids of context + continuation, less the last,
    in one forward; the continuation's ids scored at the end."""
    full = (ctx + cont)[-(T + 1):]
    logp = hf_log_probs(model, full[:-1])[-len(cont):]
    return logp.gather(-1, torch.tensor(cont)[:, None]).sum().item()


def test_bits_per_byte_of_one_byte_tokens_is_the_loss_over_ln2(trained, in_process, capsys):
    text = "".join(line + "\n" for line in (trained / "texts" / "part1.txt").read_text().splitlines()[:30])
    text = text.replace("ó", "o")  # ASCII: a character is a byte is a token
    (trained / "ascii.txt").write_text(text)
    assert in_process(evaluate.main, ["--out_dir=out-ok", "--text=ascii.txt", "--out=r.json"], cwd=trained) == 0
    r = json.loads((trained / "r.json").read_text())
    assert r.keys() == {"loss", "bits_per_byte", "perplexity", "n"} and r["n"] == len(text) > 16  # many windows
    assert r["bits_per_byte"] == pytest.approx(r["loss"] / math.log(2), rel=1e-12)
    assert r["perplexity"] == pytest.approx(math.exp(r["loss"]), rel=1e-12)
    out, err = capsys.readouterr()
    assert out.startswith(f"ascii.txt: loss {r['loss']:.4f}") and "out-ok/best.pt: iteration 4" in err


def test_text_loss_equals_transformers_on_the_export(exported, in_process):
    d, model, tok = exported.d, exported.model, exported.tok
    text = (d / "texts" / "part2.txt").read_text(encoding="utf-8")[:700]  # with ó, two bytes
    assert "ó" in text
    (d / "verse.txt").write_text(text, encoding="utf-8")
    assert in_process(evaluate.main, [f"--out_dir={exported.run}", "--text=verse.txt", "--out=text.json"], cwd=d) == 0
    r = json.loads((d / "text.json").read_text())
    # every token once: predictions in chunks of T, each chunk from one forward of the T ids just before
    # its end, the end-of-text token first (the harness's rolling windows, in another form)
    T, ids = model.config.n_positions, tok.encode(text)
    full, ll = [tok.eos_token_id] + ids, 0.0
    for a in range(0, len(ids), T):
        b = min(a + T, len(ids))
        logp = hf_log_probs(model, full[max(0, b - T):b])[-(b - a):]
        ll += logp.gather(-1, torch.tensor(ids[a:b])[:, None]).sum().item()
    assert r["n"] == len(ids) and (len(ids) < len(text) / 2 if exported.bpe else len(ids) == len(text))
    assert len(ids) > 2 * T  # several windows
    assert r["loss"] == pytest.approx(-ll / len(ids), rel=1e-6)
    assert r["bits_per_byte"] == pytest.approx(-ll / math.log(2) / len(text.encode("utf-8")), rel=1e-6)
    assert r["bits_per_byte"] < r["loss"] / math.log(2)  # bytes, not tokens: ó is two; a BPE token several


def test_multiple_choice_equals_transformers_on_the_export(exported, in_process):
    d, model, tok = exported.d, exported.model, exported.tok
    write_tasks(d / "tasks.jsonl")
    assert in_process(evaluate.main, [f"--out_dir={exported.run}", "--tasks=tasks.jsonl", "--out=mc.json",
                                      "--batch_size=5"], cwd=d) == 0
    r = json.loads((d / "mc.json").read_text())
    T, right, right_norm, n = model.config.n_positions, 0, 0, 0
    for line in (d / "tasks.jsonl").read_text().splitlines():
        if not line:
            continue
        q, lls = json.loads(line), []
        ctx = q["ctx"].rstrip()
        for ending in q["endings"]:
            cont = q["ctx"][len(ctx):] + " " + ending
            whole, c = tok.encode(ctx + cont), tok.encode(ctx)
            lls.append(hf_loglikelihood(model, c, whole[len(c):], T))
        norm = [v / len(e) for v, e in zip(lls, q["endings"])]
        right += max(range(4), key=lls.__getitem__) == q["label"]
        right_norm += max(range(4), key=norm.__getitem__) == q["label"]
        n += 1
    assert r == dict(acc=pytest.approx(right / n, abs=1e-12), acc_norm=pytest.approx(right_norm / n, abs=1e-12), n=n)


def test_each_ending_scores_as_transformers_on_the_export(exported):
    d, model = exported.d, exported.model
    ours, ckpt = checkpoint.load_run(d / exported.run)
    scorer = evaluate.Scorer(ours.eval(), evaluate.vocab_in_use(ours, ckpt), 3, torch.device("cpu"))
    tok = Tokenizer(ckpt["meta"])
    pairs = [("Sweet sorrow ", "night."), ("King crown lady sword grave heart blood fair lord", " day."),
             ("", " love"), ("Fair", " lady sword.")]
    requests = [evaluate.encode_pair(tok, ctx, cont, ckpt["meta"]["eot"]) for ctx, cont in pairs]
    with torch.no_grad():
        got = evaluate.loglikelihoods(scorer, requests, "endings")
    want = [hf_loglikelihood(model, c, cont, 16) for c, cont in requests]
    assert got == pytest.approx(want, rel=1e-5, abs=1e-5)


@pytest.mark.parametrize("arch", ["decoder", "prefix-lm"])
def test_padding_a_batch_changes_no_score(tiny_model, arch):
    model = tiny_model(arch=arch)
    rng = random.Random(1)
    requests = [([rng.randrange(61) for _ in range(rng.randint(1, 30))], [rng.randrange(61) for _ in
                 range(rng.randint(1, 6))]) for _ in range(9)]
    one = evaluate.Scorer(model, 61, 1, torch.device("cpu"))
    padded = evaluate.Scorer(model, 61, 9, torch.device("cpu"))
    with torch.no_grad():
        alone, batched = (evaluate.loglikelihoods(s, requests, "endings") for s in (one, padded))
        assert batched == pytest.approx(alone, rel=1e-5, abs=1e-5)
        for (ctx, cont), got in zip(requests, alone):  # a prefix LM: the context (up to 32 kept) is the prefix
            full = (ctx + cont)[-33:]
            P = torch.tensor([len(full) - len(cont)]) if arch == "prefix-lm" else None
            logp = F.log_softmax(model(torch.tensor([full[:-1]]), prefix_len=P)[0][0].double(), -1)
            want = logp[-len(cont):].gather(-1, torch.tensor(cont)[:, None]).sum().item()
            assert got == pytest.approx(want, rel=1e-5, abs=1e-5)


def test_an_encoder_scores_a_seeded_15_percent_of_its_tokens(workdir, in_process, tiny_args, refusal, capsys):
    d, text = workdir
    assert in_process(train.main, ["--dataset=verse", "--out_dir=out-bert", "--arch=encoder", "--max_iters=2",
                                   "--eval_interval=2", *tiny_args], cwd=d) == 0
    (d / "short.txt").write_text(text[:100], encoding="utf-8")
    runs = []
    for seed in (1, 1, 2):
        assert in_process(evaluate.main, ["--out_dir=out-bert", "--text=short.txt", f"--seed={seed}",
                                          "--out=mlm.json"], cwd=d) == 0
        runs.append(json.loads((d / "mlm.json").read_text()))
    assert runs[0].keys() == {"loss", "acc", "n"} and runs[0]["n"] == 6 * round(0.15 * 16) + round(0.15 * 4)
    assert runs[0] == runs[1] != runs[2] and 0 <= runs[0]["acc"] <= 1 and runs[0]["loss"] > 0
    assert "masked-token loss" in capsys.readouterr().out
    (d / "q.jsonl").write_text('{"ctx": "a", "endings": ["b", "c"], "label": 0}\n')
    refusal(evaluate.main, ["--out_dir=out-bert", "--tasks=q.jsonl"], "an encoder gives no likelihood", cwd=d)


def test_eval_rejects_bad_input_in_one_line(trained, refusal, run, one_line_error):
    d = trained
    (d / "latin1.txt").write_bytes("¿Qué?".encode("latin-1"))
    (d / "empty.txt").write_text("")
    (d / "odd.txt").write_text("ROMEO: ¿Qué?")
    lines = ['{"ctx": "Love", "endings": ["day.", "night."], "label": 1}']
    bad = {"not JSON (": "{ctx", 'lacks "ctx"': '{"endings": ["a", "b"], "label": 0}',
           '"endings" should be a list of two or more non-empty strings':
               '{"ctx": "a", "endings": ["b", ""], "label": 0}',
           '"label" should be the index of the right ending, 0 to 1, not 2':
               '{"ctx": "a", "endings": ["b", "c"], "label": 2}',
           "characters the model's vocabulary lacks: '¿'": '{"ctx": "¿a", "endings": ["b", "c"], "label": 0}'}
    cases = [([], "give one of --text=FILE"), (["--text=a.txt", "--tasks=b.jsonl"], "give one of --text=FILE"),
             (["--text=missing.txt"], "text file 'missing.txt' not found"),
             (["--text=texts"], "text file 'texts' is a folder"), (["--text=latin1.txt"], "is not UTF-8 text"),
             (["--text=empty.txt"], "text file 'empty.txt' is empty"),
             (["--text=odd.txt"], "text file 'odd.txt' has characters the model's vocabulary lacks: 'Qu¿é'"),
             (["--tasks=missing.jsonl"], "task file 'missing.jsonl' not found"),
             (["--tasks=empty.txt"], "holds no question"), (["--batch_size=0", "--text=x"], "batch_size=0 must be"),
             (["--text=x", "--out=no/such/r.json"], "--out=no/such/r.json is not a file in an existing folder"),
             (["--text=x", "--ckpt=worst"], "ckpt='worst' is not known")]
    for i, (fragment, line) in enumerate(bad.items()):
        (d / f"bad{i}.jsonl").write_text("\n".join(lines + ["", line]) + "\n", encoding="utf-8")
        cases.append(([f"--tasks=bad{i}.jsonl"], f"bad{i}.jsonl line 3"))
        cases.append(([f"--tasks=bad{i}.jsonl"], fragment))
    for args, fragment in cases:
        refusal(evaluate.main, ["--out_dir=out-ok", *args], fragment, cwd=d)
    one_line_error(run("eval.py", "--out_dir=out-ok", "--tasks=bad0.jsonl", cwd=d), "eval.py: error: ",
                   "bad0.jsonl line 3 is not JSON")


def test_the_bar_shows_only_on_long_work(monkeypatch, capsys):
    clock = iter([0, 0.5, 2, 2.1, 3])  # the start, then one time per step
    monkeypatch.setattr(evaluate.time, "time", lambda: next(clock))
    step = evaluate.progress(4, "windows")
    for _ in range(4):
        step(1)
    bar = lambda n: f"\reval.py: windows [{'#' * (30 * n // 4):<30}] {n}/4"  # noqa: E731
    assert capsys.readouterr().err == bar(2) + bar(4) + "\n"  # nothing in the first second; then 5 a second at most


@pytest.mark.slow
def test_lm_evaluation_harness_gives_the_same_numbers(exported, in_process):
    """Run where lm-eval is installed (pip install lm-eval): its acc, acc_norm and bits per byte on the
    export, offline, with local tasks in HellaSwag's schema and a text."""
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager
    d = exported.d
    write_tasks(d / "mc.jsonl", n=20, seed=3)
    text = (d / "texts" / "part0.txt").read_text(encoding="utf-8")[:600]
    (d / "doc.txt").write_text(text, encoding="utf-8")
    (d / "doc.jsonl").write_text(json.dumps(dict(text=text)) + "\n", encoding="utf-8")
    common = "dataset_path: json\ntest_split: test\n"
    (d / "tasks").mkdir(exist_ok=True)
    (d / "tasks" / "mc.yaml").write_text(
        f"task: nano_mc\n{common}dataset_kwargs:\n  data_files:\n    test: {d / 'mc.jsonl'}\n"
        "output_type: multiple_choice\ndoc_to_text: '{{ctx}}'\ndoc_to_choice: '{{endings}}'\n"
        "doc_to_target: '{{label}}'\n"
        "metric_list:\n  - metric: acc\n  - metric: acc_norm\n")
    (d / "tasks" / "text.yaml").write_text(
        f"task: nano_text\n{common}dataset_kwargs:\n  data_files:\n    test: {d / 'doc.jsonl'}\n"
        "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
        "metric_list:\n  - metric: bits_per_byte\n")
    out = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={d / exported.export},dtype=float32",
                                  device="cpu", tasks=["nano_mc", "nano_text"], batch_size=4,
                                  task_manager=TaskManager(include_path=str(d / "tasks")))["results"]
    for task, args in (("mc", ["--tasks=mc.jsonl", "--out=h_mc.json"]),
                       ("text", ["--text=doc.txt", "--out=h_text.json"])):
        assert in_process(evaluate.main, [f"--out_dir={exported.run}", *args], cwd=d) == 0
        ours = json.loads((d / f"h_{task}.json").read_text())
        for key in ("acc", "acc_norm") if task == "mc" else ("bits_per_byte",):
            assert ours[key] == pytest.approx(out[f"nano_{task}"][f"{key},none"], abs=1e-3), key


def test_a_run_and_its_export_resolve_to_the_same_model_tokenizer_and_tokens(exported):
    """hf.load_source, the one place every script reads a model from: the run and its Hugging Face
    export give the same logits, the same encoding, the same end-of-text token and vocabulary."""
    d = exported.d
    (ours, run), (theirs, export) = hf.load_source("resume", d / exported.run), hf.load_source(d / exported.export)
    text = (d / "texts" / "part1.txt").read_text()[:15]  # characters of the run's corpus
    run_tok, export_tok = Tokenizer(run["meta"]), Tokenizer(export["meta"])
    assert run_tok.encode(text) == export_tok.encode(text) and run_tok.vocab_size == export_tok.vocab_size
    assert evaluate.end_of_text(run, run_tok) == evaluate.end_of_text(export, export_tok) is not None
    idx = torch.tensor([run_tok.encode(text)])
    with torch.no_grad():  # the export keeps only the ids the run uses
        a, b = ours(idx)[0][..., :theirs.config.vocab_size], theirs(idx)[0]
    assert torch.allclose(a, b, atol=1e-5 * a.abs().max().item())  # the same weights; fp32 rounding of sums


def test_hellaswag_is_fetched_once_into_the_cache_and_scored_as_a_tasks_file(trained, in_process, refusal, monkeypatch,
                                                                            tmp_path):
    """--tasks=hellaswag downloads the validation set once (here a stand-in served from a file:// URL),
    keeps it only whole, scores it as the same file given by name, and offline with nothing cached
    says so in one line."""
    d = trained
    write_tasks(d / "stand-in.jsonl", n=12, seed=5)
    monkeypatch.setattr(common, "CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(evaluate, "HELLASWAG", ((d / "stand-in.jsonl").as_uri(), 13))  # one more than it has
    refusal(evaluate.main, ["--out_dir=out-ok", "--tasks=hellaswag"], "12 lines, not HellaSwag's 13", cwd=d)
    assert not os.path.exists(tmp_path / "cache" / "hellaswag_val.jsonl")  # a wrong download is not kept
    monkeypatch.setattr(evaluate, "HELLASWAG", ((d / "stand-in.jsonl").as_uri(), 12))
    for args in (["--tasks=hellaswag", "--out=h.json"], ["--tasks=stand-in.jsonl", "--out=f.json"]):
        assert in_process(evaluate.main, ["--out_dir=out-ok", *args], cwd=d) == 0
    assert json.loads((d / "h.json").read_text()) == json.loads((d / "f.json").read_text())
    monkeypatch.setattr(evaluate, "HELLASWAG", ("http://127.0.0.1:9/hellaswag_val.jsonl", 12))  # nothing listens
    assert in_process(evaluate.main, ["--out_dir=out-ok", "--tasks=hellaswag", "--out=c.json"], cwd=d) == 0  # cached
    assert json.loads((d / "c.json").read_text()) == json.loads((d / "f.json").read_text())
    monkeypatch.setattr(common, "CACHE", str(tmp_path / "empty"))
    refusal(evaluate.main, ["--out_dir=out-ok", "--tasks=hellaswag"], "could not download", "check the network",
            str(tmp_path / "empty" / "hellaswag_val.jsonl"), cwd=d)
