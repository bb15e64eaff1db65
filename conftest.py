"""What the test files share, as fixtures (no test file imports another): running a script as a
user would, or its main() in this process; the one-line error check of each; a small local text
prepared as a dataset, and a tiny run trained on it; the settings of a tiny training run; and one
factory of tiny models."""

import os
import random
import re
import resource
import shutil
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import pytest
import torch

# Without a GPU, Triton kernels run in Triton's interpreter on CPU tensors. Triton reads
# TRITON_INTERPRET when a kernel is defined (at import of kernels.py), so it is set here, before
# any test module is collected, and before model.py (which imports kernels.py) is imported. An
# explicit TRITON_INTERPRET in the environment wins.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# One thread per test process, as every script run here gets (OMP_NUM_THREADS=1): tiny tensors gain
# nothing from more, and on a machine whose cores the test workers share, torch's threads wait on
# each other (a model test took 55 s with 2 threads, 4.5 s with 1, on 2 shared cores).
torch.set_num_threads(1)

from common import UsageError  # noqa: E402
from model import ModelConfig, Transformer  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
# train.py settings of a run that takes seconds on a CPU
TINY = ["--device=cpu", "--n_layer=2", "--n_head=2", "--n_embd=32", "--block_size=16", "--batch_size=4",
        "--eval_iters=2", "--log_interval=1", "--warmup_iters=2", "--lr_decay_iters=8", "--learning_rate=3e-3"]

# `-n 2 --dist loadfile` hands each file whole to one of the two workers, by default the files of
# most tests first; a file of few but long tests handed out last runs alone at the end while the
# other worker idles. So the files that take longest go first, in this order, the rest after them.
LONGEST_FIRST = ["test_parallel.py", "test_kernels.py", "test_train.py", "test_generate.py", "test_distributed.py", "test_checkpoint.py"]


def pytest_configure(config):
    # the quick command leaves these out (-m "not slow"): many processes or end-to-end runs, at most one
    # test in twenty (tests/test_common.py counts); CI runs every test
    config.addinivalue_line("markers", "slow: a long test (many processes, end to end) that the quick run leaves out")
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist's own order, by number of tests
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file's tests stay in order


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


@contextmanager
def script_state(cwd):
    """A script's main() run in this process from folder cwd, as `python X.py` there would run it;
    afterwards the process is as it was: the working directory, the SIGINT and SIGTERM handlers
    (train.py's loop takes them over), torch's random state (every script seeds it), denormal
    flushing (sample.py turns it on) and TF32 (train.py turns it on for CUDA). It runs on one
    thread, as run_script's processes do (OMP_NUM_THREADS=1), so that it computes what they compute
    to the last bit."""
    here, handlers = os.getcwd(), {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    threads = torch.get_num_threads()
    os.chdir(cwd)
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        os.chdir(here)
        torch.set_num_threads(threads)
        for s, handler in handlers.items():
            signal.signal(s, handler)
        torch.set_flush_denormal(False)
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32


def call_main(main, argv, cwd="."):
    """What main(argv) returns, run in this process from cwd (script_state)."""
    with script_state(cwd):
        return main(list(argv))


def check_refusal(main, argv, *fragments, cwd="."):
    """main(argv), run in this process from cwd, raised a UsageError (which the script's __main__
    block prints as its one line, exit status 2) of one line holding every fragment; the message."""
    with pytest.raises(UsageError) as refused:
        call_main(main, argv, cwd)
    message = str(refused.value)
    assert "\n" not in message, message
    for fragment in fragments:
        assert fragment in message, message
    return message


@pytest.fixture(scope="session")
def run():
    return run_script


@pytest.fixture(scope="session")
def one_line_error():
    return check_one_line_error


@pytest.fixture(scope="session")
def in_process():
    """call(main, argv, cwd="."): a script's main(argv) run in this process from cwd, as `python X.py
    argv` would run there without starting Python and torch again; what main changes in the process
    is put back (script_state). Returns what main returns."""
    return call_main


@pytest.fixture(scope="session")
def refusal():
    """check(main, argv, *fragments, cwd="."): main(argv) run in this process (in_process) refused
    the input with a UsageError of one line holding every fragment; returns the message."""
    return check_refusal


@pytest.fixture(scope="session")
def tiny_model():
    """make(seed=0, **kw): the tiny model of the model tests (make_model)."""
    return make_model


@pytest.fixture(scope="session")
def tiny_args():
    """train.py's settings of a run that takes seconds on a CPU (a list: leave it as it is)."""
    return list(TINY)


@pytest.fixture(scope="session")
def corpus():
    return make_corpus


@pytest.fixture(scope="session")
def files_under():
    """Every file under d with its bytes: what a refused or stopped run must leave as it was."""
    return lambda d: {p: p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.fixture(scope="session")
def losses():
    """The training losses a train.py log printed, in order."""
    return lambda log: [float(m) for m in re.findall(r"iter \d+: loss ([\d.]+)", log)]


@pytest.fixture(scope="session")
def in_parallel():
    """The result of each call, run two at a time (a refused run spends most of its time importing torch)."""
    def both(*calls):
        with ThreadPoolExecutor(max_workers=2) as pool:
            return list(pool.map(lambda call: call(), calls))
    return both


@pytest.fixture(scope="session")
def prepared(tmp_path_factory):
    """texts/part{0,1,2}.txt (made-up verse) and data/verse, prepared from them by prepare.py in
    characters, once per test process; (folder, the whole text). Copied for each module (workdir)."""
    d = tmp_path_factory.mktemp("prepared")
    text = make_corpus()
    os.makedirs(d / "texts")
    third = len(text) // 3
    for i, part in enumerate((text[:third], text[third : 2 * third], text[2 * third :])):
        (d / "texts" / f"part{i}.txt").write_text(part, encoding="utf-8")
    code, _, err = run_script("prepare.py", "text", "--input=texts/*.txt", "--name=verse", "--tokenizer=char", cwd=d)
    assert code == 0, err
    return d, text


@pytest.fixture(scope="module")
def workdir(prepared, tmp_path_factory):
    """A folder of the module's own holding texts/part{0,1,2}.txt (made-up verse) and data/verse,
    prepared from them in characters; returns (folder, the whole text)."""
    src, text = prepared
    d = tmp_path_factory.mktemp("work")
    shutil.copytree(src, d, dirs_exist_ok=True)
    return d, text


@pytest.fixture(scope="session")
def trained_once(prepared, tmp_path_factory):
    """out-ok: a small decoder trained on data/verse for 4 iterations (evaluated at 0, 2 and 4), once
    per test process; its folder."""
    import train
    d = tmp_path_factory.mktemp("trained")
    shutil.copytree(prepared[0] / "data", d / "data")
    assert call_main(train.main, ["--dataset=verse", "--out_dir=out-ok", "--max_iters=4", "--eval_interval=2", *TINY],
                     cwd=d) == 0
    return d / "out-ok"


@pytest.fixture(scope="module")
def trained(workdir, trained_once):
    """The module's workdir with out-ok in it (trained_once); the folder."""
    d, _ = workdir
    shutil.copytree(trained_once, d / "out-ok")
    return d


@pytest.fixture
def start():
    """start(script, *args, cwd, env=None, **popen): the script (or a program) started as run_script
    would, its stdout and stderr piped as text and unbuffered, so that each line arrives as it is
    printed; a signal test waits for a line (wait_for), never for a time. Whatever is still running
    at the end of the test is killed (its whole group, if start_new_session)."""
    started = []

    def start_(script, *args, cwd, env=None, **popen):
        cmd = [sys.executable, os.path.join(HERE, script), *args] if script.endswith(".py") else [script, *args]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
        p = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, **popen)
        started.append((p, popen.get("start_new_session", False)))
        return p
    yield start_
    for p, group in started:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL) if group else p.kill()
            p.communicate()


def child_pids(pid):
    """Process ids whose parent is pid (from /proc): the ranks of a torchrun, which runs each in a
    session of its own (a signal to torchrun's group does not reach them)."""
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


@pytest.fixture(scope="session")
def children():
    return child_pids


@pytest.fixture(scope="session")
def wait_for():
    """wait(stream, match): read lines from stream until one starts with match (a str) or satisfies
    it (a function); that line. Fails if the stream ends first (the process stopped)."""
    def wait(stream, match):
        for line in stream:
            if (line.startswith(match) if isinstance(match, str) else match(line)):
                return line
        raise AssertionError(f"the stream ended before a line {match!r}")
    return wait


@pytest.fixture(scope="session")
def gpt2_bpe():
    """GPT-2's BPE files are in the cache (.ci/run fetches them); without them the test is skipped."""
    import common
    import tokenizer
    if not all(os.path.exists(os.path.join(common.CACHE, "gpt2-" + n)) for n in tokenizer.GPT2_FILES):
        pytest.skip("GPT-2 BPE files not cached (.ci/run fetches them)")
