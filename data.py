"""
Datasets that prepare.py made, and the training batches of each architecture's objective:
next-token prediction (decoder), masked LM (encoder), T5's span corruption (encoder-decoder).
"""

import json
import math
import os

import numpy as np
import torch
import torch.nn.functional as F

from common import UsageError
from model import ModelConfig


def load_data(data_dir, dataset):
    """A dataset that prepare.py made: its train and val tokens (memory-mapped) and its meta.json."""
    path = os.path.join(data_dir, dataset)
    meta_path = os.path.join(path, "meta.json")
    if not os.path.exists(meta_path):
        cmd = (f"python prepare.py {dataset}" if dataset in ("shakespeare_char", "shakespeare")  # its own datasets
               else f"python prepare.py text --input='your/*.txt' --name={dataset}")
        raise UsageError(f"dataset {dataset!r} is not prepared ({meta_path} is missing): run `{cmd}`")
    try:
        with open(meta_path) as f:
            meta = json.load(f)
        data = {s: np.memmap(os.path.join(path, f"{s}.bin"), dtype=meta["dtype"], mode="r") for s in ("train", "val")}
        check_meta(meta)
    except (OSError, ValueError, KeyError, TypeError) as e:  # a missing, empty or cut-off file; a bad meta.json
        raise UsageError(f"dataset {dataset!r} is damaged ({type(e).__name__}: {e}): move {path} "
                         "aside and prepare it again") from None
    return data, meta


def check_meta(meta):
    """A ValueError unless meta (a dataset's meta.json) holds the tokenizer that prepare.py
    writes, which the checkpoint carries to sample.py: "char" with its vocab, "gpt2", or "hf" with
    its tokenizer.json."""
    n, kind = meta["vocab_size"], meta["tokenizer"]
    if type(n) is not int or n < 1:
        raise ValueError(f"vocab_size={n!r} is not a positive integer")
    if kind not in ("char", "gpt2", "hf"):
        raise ValueError(f"tokenizer={kind!r} is not 'char', 'gpt2' or 'hf'")
    if kind == "char" and not (type(meta["vocab"]) is list and len(meta["vocab"]) == n):
        raise ValueError(f"vocab is not a list of vocab_size={n} characters")
    if kind == "hf" and type(meta["tokenizer_json"]) is not str:
        raise ValueError("tokenizer_json is not the text of a tokenizer.json")


N_SENTINEL = 100  # T5's number of span sentinels


def special_tokens(data_vocab):
    """The objectives' own tokens, after the data's vocabulary: a mask token (MLM), a decoder start
    token, then the sentinels, sentinel k being sentinel + k * sentinel_step (a pretrained T5's
    count down: step -1)."""
    return dict(mask=data_vocab, start=data_vocab + 1, sentinel=data_vocab + 2, n_sentinel=N_SENTINEL,
                sentinel_step=1)


def new_model_config(model_args, data_vocab):
    """The ModelConfig of a new model of these settings for data of data_vocab tokens: its vocabulary
    is the data's plus the special tokens its objective uses (a decoder none, an encoder the mask, an
    encoder-decoder the rest), rounded up to a multiple of 64, which matmuls like."""
    tokens, arch = special_tokens(data_vocab), model_args.get("arch", ModelConfig.arch)
    used = {"decoder": data_vocab, "encoder": tokens["mask"] + 1,
            "encoder-decoder": tokens["sentinel"] + tokens["n_sentinel"]}.get(arch, data_vocab)
    try:
        return ModelConfig(vocab_size=64 * math.ceil(used / 64), **model_args)
    except ValueError as e:
        raise UsageError(f"bad model settings: {e}") from None


def batch_rng(*key):
    """A generator seeded by key = (seed, iteration, micro-step): every training batch is a function
    of where it falls in the run, so resuming needs no saved data state, and the global batch is
    the same whatever the number of processes it is split over."""
    return torch.Generator().manual_seed(int(np.random.SeedSequence(key).generate_state(1)[0]))


def eval_rng(seed, *key):
    """The generator of evaluation batch key = (split, rank, k), spawned from the seed: a stream
    apart from training's. (SeedSequence pads short entropy with zeros, so as a plain key
    (seed, 0, 0, 0) would be iteration 0's first batch, evaluated as if never seen.) torch's CPU
    generator keeps 32 bits of a seed, so a chance match with a training batch remains possible."""
    return torch.Generator().manual_seed(int(np.random.SeedSequence(seed, spawn_key=key).generate_state(1)[0]))


def get_batch(data, arch, batch_size, block_size, gen, tokens, data_vocab, mask_prob=0.15, noise_density=0.15,
              mean_span=3.0):
    """A random batch of the objective for this architecture, as CPU tensors."""
    L = block_size + (arch == "decoder")  # a decoder's targets are its inputs shifted by one
    ix = torch.randint(len(data) - L, (batch_size,), generator=gen).tolist()
    x = torch.from_numpy(np.stack([data[i : i + L] for i in ix]).astype(np.int64))
    if arch == "decoder":
        return dict(idx=x[:, :-1], targets=x[:, 1:])
    if arch == "encoder":
        return mask_tokens(x, gen, tokens, data_vocab, mask_prob)
    return span_corrupt(x, gen, tokens, noise_density, mean_span)


def check_data(config, data, dataset, tokens, noise_density, mean_span):
    """That the data and the objective fit the model: a UsageError that says how, before any work."""
    L = config.block_size
    if config.arch == "encoder-decoder":  # span corruption: a part of each sequence, in spans, each a sentinel
        if L < 2:
            raise UsageError(f"span corruption hides part of each sequence: block_size={L} must be at least 2")
        n_noise, n_spans = span_counts(L, noise_density, mean_span)
        if n_spans + 1 > tokens["n_sentinel"]:
            raise UsageError(f"span corruption of {L} tokens needs {n_spans + 1} sentinels, more than "
                             f"{tokens['n_sentinel']}: lower block_size or raise mean_span")
        if config.pos == "learned" and n_noise + n_spans + 1 > L:
            raise UsageError(f"span corruption of {L} tokens gives the decoder {n_noise + n_spans + 1} tokens, more "
                             f"than the {L} learned positions: lower noise_density, or use relative positions")
    for split, d in data.items():
        if len(d) <= L + 1:
            raise UsageError(f"{split}.bin of {dataset} holds {len(d)} tokens, fewer than block_size={L} + 2: "
                             "lower --block_size or use more text")


STREAM = 2**63 - 1  # the key of a stream's start, in place of an iteration or an evaluation batch: none has it


def stream_batch(data, batch_size, block_size, gen, segment):
    """Transformer-XL's batches: row b reads the data as a stream from a start that gen draws, segment
    after segment, so that the memory it carries from one segment to the next is of its own text:
    the decoder's inputs and targets of segment `segment` of each row (wrapping round the data)."""
    n = len(data) - block_size - 1
    ix = [(start + segment * block_size) % n for start in torch.randint(n, (batch_size,), generator=gen).tolist()]
    x = torch.from_numpy(np.stack([data[i : i + block_size + 1] for i in ix]).astype(np.int64))
    return dict(idx=x[:, :-1], targets=x[:, 1:])


def mask_tokens(x, gen, tokens, data_vocab, p=0.15):
    """BERT's masked LM: choose p of the tokens to predict (at least one per row); of those 80%
    become the mask token, 10% a random token and 10% stay as they are."""
    chosen = torch.rand(x.shape, generator=gen) < p
    r = torch.rand(x.shape, generator=gen)
    random_tokens = torch.randint(data_vocab, x.shape, generator=gen)
    # a row with nothing chosen has nothing to predict, and a batch of such rows a NaN loss: choose one
    one = torch.randint(x.shape[-1], (*x.shape[:-1], 1), generator=gen)
    chosen |= ~chosen.any(-1, keepdim=True) & (torch.arange(x.shape[-1]) == one)
    idx = torch.where(chosen & (r < 0.8), tokens["mask"], x)
    idx = torch.where(chosen & (r >= 0.8) & (r < 0.9), random_tokens, idx)
    return dict(idx=idx, targets=x.masked_fill(~chosen, -100))


def span_counts(L, noise_density, mean_span):
    """How many of L tokens T5's objective hides, and in how many spans (at least one of each;
    the decoder then reads n_noise + n_spans + 1 tokens: spans, sentinels and the start)."""
    n_noise = min(max(1, round(L * noise_density)), L - 1)
    return n_noise, min(max(1, round(n_noise / mean_span)), L - n_noise)


def random_lengths(total, parts, batch, gen):
    """Split `total` into `parts` positive lengths at random, per row: (batch, parts)."""
    cuts = torch.rand(batch, total - 1, generator=gen).argsort(dim=-1)[:, : parts - 1] + 1
    edges = torch.cat((torch.zeros(batch, 1, dtype=torch.long), cuts.sort(dim=-1).values,
                       torch.full((batch, 1), total)), dim=1)
    return edges.diff(dim=1)


def replace_runs(x, runs, first_id, step=1):
    """x (B, L) with each run of True in runs (B, L) replaced by one id, first_id + k * step for the
    k-th run of its row. Every row must keep the same number of tokens."""
    first = runs & ~F.pad(runs[:, :-1], (1, 0))
    out = torch.where(first, first_id + step * (first.cumsum(-1) - 1), x)
    return out[~runs | first].view(x.shape[0], -1)


def span_corrupt(x, gen, tokens, noise_density=0.15, mean_span=3.0):
    """T5's span corruption. Random spans covering noise_density of x (B, L) are cut out: the
    encoder reads what is left with a sentinel in each gap, the decoder writes each sentinel
    followed by the span it stands for, and a last sentinel to end."""
    B, L = x.shape
    n_noise, n_spans = span_counts(L, noise_density, mean_span)
    # alternate kept and noise spans, starting with a kept one (as T5 does)
    lengths = torch.stack((random_lengths(L - n_noise, n_spans, B, gen),
                           random_lengths(n_noise, n_spans, B, gen)), dim=-1).view(B, -1)
    segment = torch.searchsorted(lengths.cumsum(-1), torch.arange(L).expand(B, L).contiguous(), right=True)
    noise = segment % 2 == 1  # (B, L)
    first, step = tokens["sentinel"], tokens.get("sentinel_step", 1)
    src = replace_runs(x, noise, first, step)
    target = torch.cat((replace_runs(x, ~noise, first, step), torch.full((B, 1), first + step * n_spans)), dim=1)
    start = torch.full((B, 1), tokens["start"])
    return dict(src=src, idx=torch.cat((start, target[:, :-1]), dim=1), targets=target)
