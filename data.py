"""
Datasets that prepare.py made, and the training batches of each architecture's objective:
next-token prediction (decoder; a prefix LM's suffix), masked LM (encoder), T5's span corruption or
BART's denoising (encoder-decoder), and Transformer-XL's streams.
"""

import json
import math
import os

import numpy as np
import torch
import torch.nn.functional as F

from common import UsageError
from media import MEDIA, load_media
from model import ModelConfig
from tokenizer import Tokenizer


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
        if isinstance(meta, dict) and meta.get("kind") in MEDIA:  # images (or spectrograms) and their labels
            return load_media(path, meta), meta
        data = {s: np.memmap(os.path.join(path, f"{s}.bin"), dtype=meta["dtype"], mode="r") for s in ("train", "val")}
        check_meta(meta)
        for s, d in data.items():  # a file cut short (a copy stopped midway) reads as other tokens
            if len(d) != meta[f"{s}_tokens"]:
                raise ValueError(f"{s}.bin holds {len(d):,} tokens, meta.json says {meta[f'{s}_tokens']:,}")
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


def kind_mismatch(patch_size, meta):
    """Why a model with this patch_size cannot read a dataset of this meta.json, or None."""
    if bool(patch_size) != (meta.get("kind") in MEDIA):
        return (f"the dataset holds {meta['kind']} ({meta['classes'][:3]}...): a model of them reads patches, set "
                "patch_size (configs/vit_digits.py)") if not patch_size else (
                f"patch_size={patch_size} reads images, and the dataset holds tokens: prepare images "
                "(python prepare.py digits, images or audio), or leave out patch_size")


def new_model_config(model_args, data_vocab, meta=None):
    """The ModelConfig of a new model of these settings for data of data_vocab tokens: its vocabulary
    is the data's plus the special tokens its objective uses (a decoder none, an encoder the mask, an
    encoder-decoder the rest), rounded up to a multiple of 64, which matmuls like. With the data's meta.json,
    of images: their shape and classes, unless the settings say otherwise (check_data then compares)."""
    if meta is not None and (problem := kind_mismatch(model_args.get("patch_size"), meta)):
        raise UsageError(problem)
    if meta is not None and meta.get("kind") in MEDIA:
        C, S, _ = meta["shape"]
        try:
            return ModelConfig(**dict(arch="encoder", channels=C, image_size=S, n_classes=meta["n_classes"],
                                      tie_embeddings=False, vocab_size=1) | model_args)
        except ValueError as e:
            raise UsageError(f"bad model settings: {e}") from None
    tokens, arch = special_tokens(data_vocab), model_args.get("arch", ModelConfig.arch)
    used = {"decoder": data_vocab, "encoder": tokens["mask"] + 1,
            "encoder-decoder": tokens["sentinel"] + tokens["n_sentinel"]}.get(arch, data_vocab)
    try:
        return ModelConfig(vocab_size=64 * math.ceil(used / 64), **model_args)
    except ValueError as e:
        raise UsageError(f"bad model settings: {e}") from None


def sentence_ends(meta, objective):
    """BART's sentence permutation: {"sentence_end": the ids of ".", "!" and "?" in the data's
    tokenizer, those it writes as one token}, for the objective's special tokens ({} for another)."""
    if objective != "bart":
        return {}
    tok = Tokenizer(meta)
    return {"sentence_end": [ids[0] for c in ".!?" if len(ids := tok.encode(c)) == 1]}


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
              mean_span=3.0, objective="span"):
    """A random batch of the objective for this architecture, as CPU tensors (an encoder-decoder's:
    objective, "span" or "bart"); of images (data: load_media's split), images and their labels."""
    if isinstance(data, dict):
        ix = torch.randint(len(data["labels"]), (batch_size,), generator=gen).numpy()
        return dict(idx=torch.from_numpy(data["images"][ix]), targets=torch.from_numpy(data["labels"][ix].astype(int)))
    L = block_size + (arch in ("decoder", "prefix-lm"))  # a decoder's targets are its inputs shifted by one
    ix = torch.randint(len(data) - L, (batch_size,), generator=gen).tolist()
    x = torch.from_numpy(np.stack([data[i : i + L] for i in ix]).astype(np.int64))
    if arch == "decoder":
        return dict(idx=x[:, :-1], targets=x[:, 1:])
    if arch == "prefix-lm":
        return prefix_batch(x, gen)
    if arch == "encoder":
        return mask_tokens(x, gen, tokens, data_vocab, mask_prob)
    if objective == "bart":
        return bart_batch(x, gen, tokens)
    return span_corrupt(x, gen, tokens, noise_density, mean_span)


def check_data(config, data, dataset, tokens, noise_density, mean_span, objective="span"):
    """That the data and the objective fit the model: a UsageError that says how, before any work."""
    L = config.block_size
    if isinstance(data["train"], dict) or config.patch_size:  # images: of the model's shape, for its classes
        meta = dict(kind="images", classes=["..."]) if isinstance(data["train"], dict) else {}
        if problem := kind_mismatch(config.patch_size, meta):
            raise UsageError(problem)
        shape, want = data["train"]["images"].shape[1:], (config.channels, config.image_size, config.image_size)
        if shape != want or config.n_classes <= data["train"]["labels"].max(initial=0):
            raise UsageError(f"{dataset} holds images {tuple(shape)} of up to {int(data['train']['labels'].max()) + 1} "
                             f"classes; the model reads {want} of {config.n_classes}: train a new model on it")
        return
    if config.arch == "encoder-decoder" and objective == "span":  # a part of each sequence, in spans, each a sentinel
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


def prefix_batch(x, gen):
    """The prefix LM's batch (T5's paper): rows x (B, T + 1) split at a prefix length P drawn per row
    uniform in [1, T - 1]; the loss counts the suffix only, from its first token, predicted at P - 1."""
    idx, targets = x[:, :-1], x[:, 1:]
    P = torch.randint(1, idx.size(1), (idx.size(0),), generator=gen)  # (B,)
    before = torch.arange(idx.size(1)) < (P - 1)[:, None]  # targets of the prefix itself: no loss
    return dict(idx=idx, targets=targets.masked_fill(before, -100), prefix_len=P)


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


def bart_noise(ids, mask_id, generator, ratio=0.3, poisson=3.0, sentence_end=None):
    """BART's noise (Lewis et al. 2020) on one sequence ids (n,), which it leaves as it is: a new
    sequence, of a length of its own. First sentence permutation: a sentence ends at a run of
    sentence_end ids (an id or a list; None: no permutation), and the text after the last one is a
    sentence too. Then text infilling: span lengths drawn from Poisson(poisson) until they cover
    round(ratio * n) ids (the last span cut to fit), placed at random among the ids kept, each
    replaced by one mask_id: a span of length 0 inserts one, and masks side by side merge into one."""
    n = len(ids)
    if sentence_end is not None and n:
        end = torch.isin(ids, torch.as_tensor(sentence_end))
        last = end & ~F.pad(end[1:], (0, 1))  # the last id of a run of sentence ends ("?!", "...")
        sentence = F.pad(last[:-1].cumsum(0), (1, 0))  # (n,) each id's sentence
        place = torch.randperm(int(sentence[-1]) + 1, generator=generator)  # each sentence's new place
        ids = ids[torch.sort(place[sentence], stable=True).indices]
    n_cover = round(ratio * n)
    if n_cover and poisson <= 0:
        raise ValueError(f"spans of mean length poisson={poisson} never cover a token: give a mean above 0")
    lengths = torch.zeros(0, dtype=torch.long)
    while lengths.sum() < n_cover:  # draw until the spans cover n_cover ids
        drawn = torch.poisson(torch.full((n_cover,), float(poisson)), generator=generator).long()
        lengths = torch.cat((lengths, drawn))
    k = int(torch.searchsorted(lengths.cumsum(0), n_cover)) + 1 if n_cover else 0  # the draw that gets there
    lengths = lengths[:k]
    if k:
        lengths[-1] -= lengths.sum() - n_cover
    # n - n_cover kept ids and k spans in a random order: k of the slots are spans, in order
    span = torch.zeros(n - n_cover + k, dtype=torch.bool)
    span[torch.randperm(len(span), generator=generator)[:k]] = True
    covered = span.repeat_interleave(torch.ones(len(span), dtype=torch.long).masked_scatter(span, lengths))  # (n,)
    out = torch.full((len(span),), mask_id, dtype=ids.dtype).masked_scatter(~span, ids[~covered])
    return out[~(span & F.pad(span[:-1], (1, 0)))]  # a span right after a span: no second mask


def bart_batch(x, gen, tokens):
    """BART's denoising batch of x (B, L): the encoder reads each row noised by bart_noise (the
    sentences end at tokens["sentence_end"], if tokens has it: the data's ids of ".", "!", "?"),
    padded to L with src_mask False there (a row grows past L only when zero-length spans
    outnumber the ids masked; it keeps its first L); the decoder reads the start token and the
    row, and writes the row."""
    B, L = x.shape
    src, src_mask = torch.zeros_like(x), torch.zeros(B, L, dtype=torch.bool)
    for b in range(B):
        row = bart_noise(x[b], tokens["mask"], gen, sentence_end=tokens.get("sentence_end"))[:L]
        src[b, : len(row)], src_mask[b, : len(row)] = row, True
    start = torch.full((B, 1), tokens["start"])
    return dict(src=src, src_mask=src_mask, idx=torch.cat((start, x[:, :-1]), dim=1), targets=x)
