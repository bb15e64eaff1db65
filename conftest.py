"""What the test files share, as fixtures (no test file imports another): running a script as a
user would, the one-line error check, a small local text prepared as a dataset, the settings of
a tiny training run, and one factory of tiny models."""

import os
import random
import re
import resource
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from model import ModelConfig, Transformer

# Without a GPU, Triton kernels run in Triton's interpreter on CPU tensors. Triton reads
# TRITON_INTERPRET when a kernel is defined (at import of kernels.py), so it is set here, before
# any test module is collected. An explicit TRITON_INTERPRET in the environment wins.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

HERE = os.path.dirname(os.path.abspath(__file__))
# train.py settings of a run that takes seconds on a CPU
TINY = ["--device=cpu", "--n_layer=2", "--n_head=2", "--n_embd=32", "--block_size=16", "--batch_size=4",
        "--eval_iters=2", "--log_interval=1", "--warmup_iters=2", "--lr_decay_iters=8", "--learning_rate=3e-3"]


def run_script(script, *args, cwd, env=None, max_file_bytes=None, max_memory_bytes=None):
    """Run a script as a user would; returns (exit status, stdout, stderr). max_file_bytes: no file
    it writes may grow past this, as on a full disk. max_memory_bytes: the system refuses memory
    past this (of address space), as on a machine that has no more."""
    cmd = [sys.executable, os.path.join(HERE, script), *args] if script.endswith(".py") else [script, *args]
    limits = [(kind, n) for kind, n in [(resource.RLIMIT_FSIZE, max_file_bytes), (resource.RLIMIT_AS, max_memory_bytes)]
              if n]

    def limit():
        for kind, n in limits:
            resource.setrlimit(kind, (n, n))
    p = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=600, preexec_fn=limit if limits else None,
                       env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    return p.returncode, p.stdout, p.stderr


def check_one_line_error(result, *fragments):
    """The run failed with status 2 and a single stderr line holding every fragment; that line."""
    code, out, err = result
    assert code == 2, (code, out, err)
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    for fragment in fragments:
        assert fragment in err, err
    return err


def make_corpus(n_lines=3000, seed=0):
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


def make_model(seed=0, **kw):
    """The tiny model every model test starts from: kw overrides the config (vocab 61, context 32,
    2 layers, 4 heads, width 32), weights drawn from seed, in eval mode."""
    torch.manual_seed(seed)
    return Transformer(ModelConfig(**dict(vocab_size=61, block_size=32, n_layer=2, n_head=4, n_embd=32) | kw)).eval()


@pytest.fixture
def run():
    return run_script


@pytest.fixture
def one_line_error():
    return check_one_line_error


@pytest.fixture
def tiny_model():
    return make_model


@pytest.fixture
def tiny_args():
    return list(TINY)


@pytest.fixture
def corpus():
    return make_corpus


@pytest.fixture
def files_under():
    """Every file under d with its bytes: what a refused or stopped run must leave as it was."""
    return lambda d: {p: p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.fixture
def losses():
    """The training losses a train.py log printed, in order."""
    return lambda log: [float(m) for m in re.findall(r"iter \d+: loss ([\d.]+)", log)]


@pytest.fixture
def in_parallel():
    """The result of each call, run two at a time (a refused run spends most of its time importing torch)."""
    def both(*calls):
        with ThreadPoolExecutor(max_workers=2) as pool:
            return list(pool.map(lambda call: call(), calls))
    return both


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A folder holding texts/part{0,1,2}.txt (made-up verse) and data/verse, prepared from them
    in characters; returns (folder, the whole text)."""
    d = tmp_path_factory.mktemp("work")
    text = make_corpus()
    os.makedirs(d / "texts")
    third = len(text) // 3
    for i, part in enumerate((text[:third], text[third : 2 * third], text[2 * third :])):
        (d / "texts" / f"part{i}.txt").write_text(part, encoding="utf-8")
    code, _, err = run_script("prepare.py", "text", "--input=texts/*.txt", "--name=verse", "--tokenizer=char", cwd=d)
    assert code == 0, err
    return d, text
