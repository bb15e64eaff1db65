"""pages.py: the attention page is self-contained and holds every layer's and head's weights, rows
that sum to one, nothing from the future in a decoder; Chromium draws its first heatmap whole.
(sample.py's --attention, end to end: test_sample_modes.py.)"""

import json
import os
import re
import shutil
import subprocess

import pytest
import torch

import pages

V = 61  # tiny_model's vocabulary


def prompt(T, seed=1):
    return torch.randint(0, V, (1, T), generator=torch.Generator().manual_seed(seed))


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
def test_attention_page_holds_every_layer_and_head(tmp_path, arch, kinds, tiny_model):
    model = tiny_model(arch=arch, pos="alibi")
    seq = dict(idx=prompt(7)[0].tolist())
    if arch == "encoder-decoder":
        seq["src"] = prompt(5, seed=3)[0].tolist()
    tok = type("Tok", (), dict(vocab_size=V, decode=lambda self, ids: "".join(chr(97 + i) for i in ids)))()
    pages.write_attention(tmp_path / "attn.html", model, tok, seq, 128)
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
