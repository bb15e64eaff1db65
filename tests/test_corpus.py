"""corpus.py and the corpora prepare.py reads through it: the same documents as .txt files, .parquet,
.jsonl, .jsonl.gz and .jsonl.zst give the same tokens; the validation split holds whole documents;
the web corpora come shard by shard from a hub laid out on disk (no network), each shard fetched once
and a cut-off one never read; offline, and without an optional package, prepare.py says so in one line."""

import fnmatch
import gzip
import json
import os
import shutil
import sys

import numpy as np
import pytest

import corpus as source  # (`corpus` is conftest's made-up verse)
import prepare
import tokenizer

pq = pytest.importorskip("pyarrow.parquet")
pa = pytest.importorskip("pyarrow")


def documents(corpus_text, n=24):
    """n documents of made-up verse of different lengths (one empty row's worth of text is no document)."""
    return [corpus_text(10 + 7 * i, seed=i) for i in range(n)]


def write_formats(d, docs):
    """The documents as one .txt file each, and as .parquet (small row groups), .jsonl, .jsonl.gz and
    (if zstandard is there) .jsonl.zst; the glob of each."""
    os.makedirs(d / "txt")
    for i, doc in enumerate(docs):
        (d / "txt" / f"{i:03d}.txt").write_text(doc, encoding="utf-8")
    pq.write_table(pa.table({"id": list(range(len(docs))), "body": docs}), d / "docs.parquet", row_group_size=5)
    lines = "".join(json.dumps({"body": doc, "id": i}) + "\n" for i, doc in enumerate(docs)).encode()
    (d / "docs.jsonl").write_bytes(lines)
    (d / "docs.jsonl.gz").write_bytes(gzip.compress(lines))
    globs = ["txt/*.txt", "docs.parquet", "docs.jsonl", "docs.jsonl.gz"]
    try:
        import zstandard
        (d / "docs.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines))
        globs.append("docs.jsonl.zst")
    except ImportError:
        pass
    return globs


def read_splits(d, name):
    meta = json.loads((d / "data" / name / "meta.json").read_text())
    return [np.fromfile(d / "data" / name / f"{s}.bin", dtype=meta["dtype"]).tolist() for s in ("train", "val")]


def in_documents(ids, eot=50256):
    """A split's ids cut at each end-of-text token: its documents' ids."""
    docs, current = [], []
    for i in ids:
        if i == eot:
            docs.append(current)
            current = []
        else:
            current.append(i)
    return docs + [current]


def test_the_same_documents_as_txt_parquet_jsonl_gz_and_zst_give_the_same_tokens(tmp_path, corpus, in_process,
                                                                                 gpt2_bpe):
    docs = documents(corpus)
    globs = write_formats(tmp_path, docs)
    enc = tokenizer.gpt2_encoding()
    want = [enc.encode_ordinary(doc) for doc in docs]
    streams = []
    for i, pattern in enumerate(globs):
        in_process(prepare.main, ["text", f"--input={pattern}", f"--name=f{i}", "--column=body", "--val_tokens=1000",
                                  "--workers=2"], cwd=tmp_path)
        streams.append(read_splits(tmp_path, f"f{i}"))
    assert all(s == streams[0] for s in streams), globs
    train, val = streams[0]
    # the first whole documents that hold 1,000 tokens are the validation split, each split's documents
    # separated by <|endoftext|>, none before its first
    k = next(k for k in range(len(want)) if sum(map(len, want[:k + 1])) >= 1000) + 1
    assert in_documents(val) == want[:k] and in_documents(train) == want[k:]


def test_the_default_validation_split_is_one_whole_document_in_ten_spread_over_the_corpus(tmp_path, corpus,
                                                                                        in_process, gpt2_bpe):
    docs = documents(corpus, n=60)
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    in_process(prepare.main, ["text", "--input=docs.jsonl", "--name=web", "--workers=2"], cwd=tmp_path)
    train, val = read_splits(tmp_path, "web")
    enc = tokenizer.gpt2_encoding()
    want = [enc.encode_ordinary(doc) for doc in docs]
    train_docs, val_docs = in_documents(train), in_documents(val)
    assert sorted(train_docs + val_docs) == sorted(want)  # every document whole, in one split
    assert [want.index(d) for d in train_docs] == sorted(want.index(d) for d in train_docs)  # in order
    assert [want.index(d) for d in val_docs] == sorted(want.index(d) for d in val_docs)
    longest = max(map(len, want)) + 1
    assert abs(len(val) - 0.1 * (len(train) + len(val))) <= longest  # a tenth, to within a document
    assert want.index(val_docs[0]) < 15 and want.index(val_docs[-1]) > 45  # from the start to the end


def test_rows_need_their_column_and_whole_files(tmp_path, corpus, refusal):
    docs = documents(corpus, n=6)
    write_formats(tmp_path, docs)
    (tmp_path / "cut.jsonl.gz").write_bytes((tmp_path / "docs.jsonl.gz").read_bytes()[:200])
    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\nnot json\n')
    cases = [("docs.parquet", "has no column 'text' (it has id, body): give --column=NAME"),
             ("docs.jsonl", "line 1 has no text field 'text': give --column=NAME"),
             ("cut.jsonl.gz", "cut.jsonl.gz line 1 cannot be read (EOFError"),
             ("bad.jsonl", "bad.jsonl line 2 cannot be read")]
    for pattern, message in cases:
        refusal(prepare.main, ["text", f"--input={pattern}", "--name=x", "--tokenizer=char"], message, cwd=tmp_path)
        assert not (tmp_path / "data" / "x").exists()


@pytest.mark.parametrize("module, path, package", [("pyarrow", "docs.parquet", "pyarrow"),
                                                   ("zstandard", "docs.jsonl.zst", "zstandard")])
def test_a_missing_optional_package_is_named_in_one_line(tmp_path, monkeypatch, module, path, package, refusal):
    (tmp_path / path).write_bytes(b"whatever")
    monkeypatch.setitem(sys.modules, module, None)  # import fails, as without the package
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    refusal(prepare.main, ["text", f"--input={path}", "--name=x", "--tokenizer=char"],
            f"needs {package}: pip install {package}", cwd=tmp_path)


# ----------------------------------------------------------------------------------------------
# The web corpora, from a hub laid out on disk

@pytest.fixture
def hub(tmp_path, monkeypatch, corpus):
    """FineWeb-Edu's repository as the hub lays it out (sample/10BT/00k_00000.parquet, 3 shards of 8
    documents) under tmp_path/hub, served by stand-ins for the hub's listing and download that
    record every file fetched; the cache in tmp_path/cache. Returns (the documents, fetched)."""
    repo = source.WEB["fineweb-edu"][0]
    root = tmp_path / "hub" / repo
    os.makedirs(root / "sample" / "10BT")
    docs = [corpus(12 + 5 * i, seed=100 + i) for i in range(24)]
    for k in range(3):
        pq.write_table(pa.table({"text": docs[8 * k:8 * k + 8], "id": list(range(8))}),
                       root / "sample" / "10BT" / f"{k:03d}_00000.parquet", row_group_size=3)
    (root / "README.md").write_text("not a shard")
    fetched = []

    def list_shards(repo_id, revision, pattern):
        files = [str(p.relative_to(tmp_path / "hub" / repo_id)) for p in (tmp_path / "hub" / repo_id).rglob("*")]
        return sorted(f for f in files if fnmatch.fnmatch(f, pattern))

    def fetch_shard(repo_id, revision, filename, local_dir):  # as hf_hub_download: whole, then moved into place
        fetched.append(filename)
        target = os.path.join(local_dir, filename)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copyfile(tmp_path / "hub" / repo_id / filename, target + ".incomplete")
        os.replace(target + ".incomplete", target)
        return target
    monkeypatch.setattr(source, "CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(source, "list_shards", list_shards)
    monkeypatch.setattr(source, "fetch_shard", fetch_shard)
    monkeypatch.setattr(source, "check_online", lambda: None)
    return docs, fetched


def test_a_web_corpus_fetches_only_the_shards_its_tokens_need_and_each_only_once(tmp_path, hub, in_process,
                                                                                 monkeypatch, gpt2_bpe, capsys):
    docs, fetched = hub
    # the reader runs a batch (4 MB of text a worker) ahead of the count of tokens: here a few rows
    monkeypatch.setattr(prepare, "CHUNK", 100)
    enc = tokenizer.gpt2_encoding()
    want = [enc.encode_ordinary(doc) for doc in docs]
    need = sum(map(len, want[3:10]))  # val: the first 3 documents; train: to the end of the 10th, in shard 1
    val_tokens = sum(map(len, want[:3])) - 5
    args = ["fineweb-edu", f"--tokens={need - 3}", f"--val_tokens={val_tokens}", "--workers=2"]
    in_process(prepare.main, args, cwd=tmp_path)
    assert fetched == ["sample/10BT/000_00000.parquet", "sample/10BT/001_00000.parquet"]  # not the third
    train, val = read_splits(tmp_path, "fineweb-edu")
    assert in_documents(val) == want[:3] and in_documents(train) == want[3:10]
    meta = json.loads((tmp_path / "data" / "fineweb-edu" / "meta.json").read_text())
    assert meta["settings"] == dict(column="text", val_tokens=val_tokens, tokens=need - 3)
    capsys.readouterr()
    in_process(prepare.main, args, cwd=tmp_path)  # prepared: nothing to do, nothing fetched
    assert "nothing to do" in capsys.readouterr().err and len(fetched) == 2
    shutil.rmtree(tmp_path / "data")
    in_process(prepare.main, args, cwd=tmp_path)  # made again from the shards in the cache
    assert len(fetched) == 2 and read_splits(tmp_path, "fineweb-edu") == [train, val]
    in_process(prepare.main, ["fineweb-edu", "--name=all", f"--val_tokens={val_tokens}"], cwd=tmp_path)
    assert fetched[2:] == ["sample/10BT/002_00000.parquet"]  # all of it: the third shard, and only it
    assert in_documents(read_splits(tmp_path, "all")[0]) == want[3:]


def test_a_cut_off_download_is_never_read_and_the_next_run_fetches_it_whole(tmp_path, hub, monkeypatch, in_process,
                                                                           refusal, files_under, gpt2_bpe):
    docs, fetched = hub
    whole = source.fetch_shard

    def cut_off(repo_id, revision, filename, local_dir):  # half the bytes arrive, then the connection drops
        if filename.startswith("sample/10BT/001"):
            part = os.path.join(local_dir, ".cache", "huggingface", "download", filename + ".incomplete")
            os.makedirs(os.path.dirname(part), exist_ok=True)
            data = (tmp_path / "hub" / repo_id / filename).read_bytes()
            open(part, "wb").write(data[:len(data) // 2])
            raise ConnectionError("Connection reset by peer")
        return whole(repo_id, revision, filename, local_dir)
    monkeypatch.setattr(source, "fetch_shard", cut_off)
    refusal(prepare.main, ["fineweb-edu", "--val_tokens=100"], "cannot reach the Hugging Face hub",
            "ConnectionError", "--input='shards/*.parquet'", cwd=tmp_path)
    assert not (tmp_path / "data" / "fineweb-edu").exists()  # nothing half made
    shards = tmp_path / "cache" / "hub" / "HuggingFaceFW--fineweb-edu" / "sample" / "10BT"
    assert sorted(os.listdir(shards)) == ["000_00000.parquet"]  # the cut one is not where a shard is read
    monkeypatch.setattr(source, "fetch_shard", whole)
    in_process(prepare.main, ["fineweb-edu", "--val_tokens=100"], cwd=tmp_path)
    enc = tokenizer.gpt2_encoding()
    train, val = read_splits(tmp_path, "fineweb-edu")
    assert in_documents(val) + in_documents(train) == [enc.encode_ordinary(doc) for doc in docs]
    assert fetched == [f"sample/10BT/00{k}_00000.parquet" for k in range(3)]  # the first shard once


def test_offline_a_web_corpus_is_refused_at_once_in_one_line(tmp_path, run, one_line_error):
    pytest.importorskip("huggingface_hub")
    for env in [{"HF_HUB_OFFLINE": "1"}, {"HF_ENDPOINT": "http://127.0.0.1:9"}]:  # a port where nothing listens
        one_line_error(run("prepare.py", "fineweb-edu", "--tokens=1M", cwd=tmp_path,
                           env={"NANOFORMER_CACHE": str(tmp_path / "cache"), **env}),
                       "cannot reach the Hugging Face hub for HuggingFaceFW/fineweb-edu",
                       "give them with --input='shards/*.parquet'")
    assert not (tmp_path / "data").exists()


@pytest.mark.parametrize("text, n", [("10B", 10_000_000_000), ("500M", 500_000_000), ("2e9", 2_000_000_000),
                                     ("1000", 1000), ("", 0)])
def test_tokens_are_written_with_a_suffix(text, n):
    assert prepare.token_count(text) == n


def test_bad_tokens_are_refused_in_one_line(tmp_path, refusal):
    for bad in ["many", "10X", "-5"]:
        refusal(prepare.main, ["fineweb-edu", f"--tokens={bad}"], f"--tokens={bad!r} is not a number of tokens",
                cwd=tmp_path)
