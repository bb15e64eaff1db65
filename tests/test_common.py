"""What every script shares (common.py): settings from defaults, a config file and --key=value,
checked for names and types; --help read from the source; every config file a valid model; and
the command line's style: bad input is one line on stderr, exit status 2, no traceback."""

import os
import re
import sys
from dataclasses import fields

import pytest
import torch

import common
import prepare
import sample
import train
from model import ModelConfig, Transformer

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root
CONFIGS = sorted(name for name in os.listdir(os.path.join(HERE, "configs")) if name.endswith(".py"))


def train_settings(argv):
    """train.py's settings as it parses them: its own and the model's, in one dict."""
    ours, model = common.parse_settings(argv, train.TrainConfig, ModelConfig, skip=("vocab_size",))
    return {**ours, **model}


def test_settings_suggest_the_closest_key_and_check_types(tmp_path, refusal):
    given = train_settings(["--n_kv_head=None", "--pos=rope", "--min_lr=0", "--compile=True"])
    assert given == dict(n_kv_head=None, pos="rope", min_lr=0.0, compile=True)
    # a str setting takes its text as it is, even text that reads as a number or None
    assert train_settings(["--out_dir=2024", "--dataset=None"]) == dict(out_dir="2024", dataset="None")
    # a bare flag switches on a yes/no setting, and one that may also be None (sample.py's compile: None = auto)
    for argv, value in ((["--compile"], True), (["--compile=False"], False), (["--compile=None"], None)):
        assert common.parse_settings(argv, sample.SampleConfig)[0] == dict(compile=value)
    # the refusals, as train.py and sample.py meet them (each is one line: the script's __main__
    # prints it after "X.py: error: ", test_every_script_answers_bad_input_in_one_line_with_exit_status_2)
    cases = [
        (train, "--learning_rat=1e-3", ["did you mean --learning_rate"]),
        (train, "--lerning_rate=1e-3", ["unknown setting 'lerning_rate'", "did you mean --learning_rate?"]),
        (train, "--lerning_rate", ["unknown setting 'lerning_rate'", "did you mean --learning_rate?"]),
        (train, "--max_iters", ["'--max_iters' has no value: write --max_iters=VALUE"]),
        (train, "--n_layer=four", ["n_layer='four' should be int"]),
        (train, "--max_iters=many", ["max_iters='many' should be int"]),
        (train, "configs/nope.py", ["config file 'configs/nope.py' not found"]),
        (train, os.path.join(HERE, "configs"), ["configs' is a folder: give a config file such as "
                                                "configs/shakespeare_char.py, or did you mean --out_dir="]),
        (train, "--seed=99999999999999999999", ["seed is too large: give a number below 2**63"]),
        (sample, "--seed=99999999999999999999", ["seed is too large: give a number below 2**63"]),
        (train, "--max_iters=" + "9" * 400, ["max_iters is too large: give a number below 2**63"]),
        (train, "--learning_rate=1" + "0" * 400, ["learning_rate is too large for a float: give a finite number"]),
        (train, "--learning_rate=nan", ["learning_rate=nan must be a finite number"]),
        (train, "--learning_rate=1e999", ["learning_rate=inf must be a finite number"]),
        (train, "--rope_theta=-1e400", ["rope_theta=-inf must be a finite number"]),
        (sample, "--temperature=inf", ["temperature=inf must be a finite number"]),
    ]
    for script, arg, fragments in cases:
        refusal(script.main, [arg], *fragments, cwd=tmp_path)
    assert os.listdir(tmp_path) == []  # refused before anything is written


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


def test_every_script_answers_bad_input_in_one_line_with_exit_status_2(tmp_path, run, one_line_error, in_parallel):
    # the one run of each script from the command line: its __main__ block turns the UsageError
    # that main raises (tested in this process elsewhere) into this line
    cases = [("train.py", "--lerning_rate=1e-3", "unknown setting 'lerning_rate': did you mean --learning_rate?"),
             ("sample.py", "--temprature=0.5", "unknown setting 'temprature': did you mean --temperature?"),
             ("prepare.py", "--tokeniser=char", "unknown setting 'tokeniser': did you mean --tokenizer?"),
             ("hf.py", "--ckp=latest", "unknown setting 'ckp': did you mean --ckpt?")]
    results = in_parallel(*(lambda script=script, arg=arg: run(script, arg, cwd=tmp_path) for script, arg, _ in cases))
    for (script, _, message), result in zip(cases, results):
        assert one_line_error(result, message).strip() == f"{script}: error: {message}"
    assert os.listdir(tmp_path) == []


def test_importing_a_script_leaves_ctrl_c_to_the_importer(run):
    # run as scripts, each takes SIGINT over to exit quietly; imported (as the tests and bench.py
    # import them), none does (compared with what the process started with: a job started with `&` in a
    # script ignores SIGINT from the start)
    code, out, err = run(sys.executable, "-c", "import signal; before = signal.getsignal(signal.SIGINT); "
                         "import prepare, sample, train; print(signal.getsignal(signal.SIGINT) is before)", cwd=HERE)
    assert code == 0 and out.strip() == "True", err


def test_a_message_names_what_the_user_meant(trained, refusal, tmp_path, tiny_args):
    d = trained
    config = tmp_path / "rope.py"
    config.write_text("pos = 'rope'\n")
    refusal(train.main, [str(config), "--out_dir=out-ok", "--init_from=resume", *tiny_args],
            f"pos='rope' (from {config}) does not match out-ok/ckpt.pt's pos='learned'", cwd=d)
    refusal(train.main, ["max_iters=10"], "'max_iters=10' is not a setting: did you mean --max_iters=10?", cwd=d)
    refusal(train.main, ["-max_iter=10"], "did you mean --max_iters=10?", cwd=d)
    refusal(sample.main, ["out-ok"], "'out-ok' is a folder:", "did you mean --out_dir=out-ok?", cwd=d)
    refusal(prepare.main, ["text", "--input=texts/part0.txt", "texts/part1.txt", "--name=x"],
            "'texts/part1.txt' is not a setting", "quote it (--input='corpus/*.txt')", cwd=d)


def test_at_most_one_test_in_twenty_is_marked_slow(request):
    """The quick command (README) leaves out the tests marked slow; they must stay few. Counted over
    what this run collected, when it collected every test file: the full run (CI's) sees every mark."""
    items = request.session.items
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    files = {"test_model.py"} | {f for f in os.listdir(os.path.join(root, "tests")) if re.fullmatch(r"test_\w+\.py", f)}
    if not files <= {os.path.basename(str(item.path)) for item in items}:
        pytest.skip("a run of part of the suite: the share of slow tests is the whole suite's")
    slow = [item.nodeid for item in items if item.get_closest_marker("slow")]
    assert 20 * len(slow) <= len(items), (len(slow), len(items))


def test_the_readme_names_every_tool():
    """README's Files table lists every script under tools/ (a forker finds them there)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    readme = open(os.path.join(root, "README.md"), encoding="utf-8").read()
    tools = sorted(f for f in os.listdir(os.path.join(root, "tools")) if f.endswith((".py", ".sh")))
    assert tools and [f for f in tools if f"`tools/{f}`" not in readme] == []
