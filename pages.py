"""
Self-contained HTML pages, with no network and no JavaScript library: the attention page
(attention.html, filled with one sequence's weights: every layer's and head's, as heatmaps).
"""

import html
import json
import os

import torch

ATTENTION_PAGE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "attention.html")


def attention_maps(model, idx, src=None, prefix=None):
    """Each attention's weights for one sequence, {name: (layers, heads, Tq, Tk)}, from one forward
    pass that keeps them (on the math path, which computes them); prefix: a prefix LM's prompt length."""
    maps = {}
    prefix_len = torch.tensor([prefix], device=idx.device) if model.config.arch == "prefix-lm" else None
    with torch.no_grad():
        model(idx, src=src, weights=maps, prefix_len=prefix_len)
    return {name: torch.stack([att[0] for att in layers]) for name, layers in maps.items()}


def write_attention(path, model, tok, seq, n_tokens):
    """The attention page for the sequence seq (its idx, src for an encoder-decoder, the prompt's length
    as prefix for a prefix LM), written to path."""
    dev = model.wte.weight.device
    keep = min(n_tokens, model.config.block_size if model.config.pos == "learned" else n_tokens)
    idx = torch.tensor([seq["idx"][-keep:]], device=dev)
    src = torch.tensor([seq["src"][-keep:]], device=dev) if "src" in seq else None
    labels = lambda ids: [tok.decode([i]) if i < tok.vocab_size else f"<{i}>" for i in ids]  # noqa: E731
    tokens = {"decoder": labels(idx[0].tolist()), "encoder": labels((src if src is not None else idx)[0].tolist())}
    kinds = []
    prefix = max(0, seq.get("prefix", 0) - (len(seq["idx"]) - keep))  # a prefix LM's prompt, as far as it is kept
    for name, weights in attention_maps(model, idx, src, prefix).items():
        queries = tokens["encoder" if name.startswith("encoder") else "decoder"]
        keys = tokens["encoder" if name.startswith("encoder") or "cross" in name else "decoder"]
        kinds.append(dict(name=name, queries=queries, keys=keys,  # weights in units of 1e-4
                          weights=(weights.float() * 1e4).round().int().tolist()))
    data = json.dumps(dict(kinds=kinds), separators=(",", ":")).replace("</", "<\\/")
    with open(ATTENTION_PAGE, encoding="utf-8") as f:
        page = f.read()
    with open(path, "w", encoding="utf-8") as f:
        f.write(page.replace("/*DATA*/", data).replace("TITLE", html.escape(os.path.basename(path))))
