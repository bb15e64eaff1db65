"""Training data (data.py): the batches of the objectives (next token, a prefix LM's suffix, masked LM,
span corruption, BART's denoising), Transformer-XL's streams, and the seed of every batch of a run."""

import json
import math

import numpy as np
import pytest
import torch

import data


@pytest.mark.parametrize("L", [64, 73])  # 73: 11 hidden tokens make round(11 / 3) = 4 spans, not floor's 3
def test_span_corruption_loses_nothing_and_hides_15_percent(L):
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 50, (16, L))
    tokens = data.special_tokens(50)
    b = data.span_corrupt(x, g, tokens)
    s0 = tokens["sentinel"]
    for row in range(16):  # put every span back in place of its sentinel: the original returns
        src, tgt = b["src"][row].tolist(), b["targets"][row].tolist()
        spans, current = {}, None
        for t in tgt:
            if t >= s0:
                current = spans.setdefault(t, [])
            else:
                current.append(t)
        rebuilt = [u for t in src for u in (spans[t] if t >= s0 else [t])]
        assert rebuilt == x[row].tolist()
        assert sum(len(v) for v in spans.values()) == round(L * 0.15)
        assert len(spans) - 1 == round(round(L * 0.15) / 3)  # one span per 3 tokens, and an end sentinel
    assert torch.equal(b["idx"][:, 1:], b["targets"][:, :-1]) and (b["idx"][:, 0] == tokens["start"]).all()


def test_masked_lm_predicts_15_percent_of_which_80_masked_10_random_10_kept():
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 50, (200, 200))
    b = data.mask_tokens(x, g, data.special_tokens(50), 50)
    chosen = b["targets"] != -100
    assert abs(chosen.float().mean() - 0.15) < 0.005
    assert torch.equal(b["targets"][chosen], x[chosen]) and torch.equal(b["idx"][~chosen], x[~chosen])
    masked = (b["idx"] == 50) & chosen
    kept = (b["idx"] == x) & chosen
    assert abs(masked.sum() / chosen.sum() - 0.8) < 0.01
    assert abs(kept.sum() / chosen.sum() - (0.1 + 0.1 / 50)) < 0.01  # a random token can be the same one


def test_masked_lm_gives_every_row_something_to_predict_even_at_a_tiny_mask_prob():
    x = torch.randint(0, 50, (64, 8))
    b = data.mask_tokens(x, torch.Generator().manual_seed(0), data.special_tokens(50), 50, p=1e-6)
    chosen = b["targets"] != -100
    assert (chosen.sum(1) == 1).all() and torch.equal(b["targets"][chosen], x[chosen])
    # nothing else moves: the same draws as before, where every row had a target already
    g1, g2 = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    full = data.mask_tokens(x, g1, data.special_tokens(50), 50, p=0.9)
    assert (full["targets"] != -100).any(1).all()
    chosen = torch.rand(x.shape, generator=g2) < 0.9
    assert torch.equal(full["targets"] != -100, chosen)


def test_batches_follow_the_objective_settings():
    ids = np.random.default_rng(0).integers(0, 50, 100_000).astype(np.uint16)
    tokens = data.special_tokens(50)
    mlm = data.get_batch(ids, "encoder", 64, 64, torch.Generator().manual_seed(0), tokens, 50, mask_prob=0.3)
    assert abs((mlm["targets"] != -100).float().mean() - 0.3) < 0.02
    t5 = data.get_batch(ids, "encoder-decoder", 4, 64, torch.Generator().manual_seed(0), tokens, 50,
                        noise_density=0.3)
    assert ((t5["targets"] < tokens["sentinel"]).sum(1) == round(64 * 0.3)).all()  # hidden tokens per row


def test_every_batch_of_a_run_has_a_seed_of_its_own():
    # training batches (iteration, micro-step) and evaluation batches (split, rank, k): a training
    # batch evaluated as a held-out one, or two evaluation batches alike, would bias the losses
    seeds = [data.batch_rng(1337, it, micro).initial_seed() for it in range(4) for micro in range(3)]
    seeds += [data.eval_rng(1337, split, rank, k).initial_seed()
              for split in (False, True) for rank in range(2) for k in range(3)]
    assert len(set(seeds)) == len(seeds) == 4 * 3 + 2 * 2 * 3
    assert data.eval_rng(1337, True, 1, 2).initial_seed() == seeds[-1]  # and each is the same every time


def test_a_stream_batch_reads_each_rows_text_segment_after_segment():
    """Transformer-XL's rows: segment s + 1 of a row starts where segment s ended (its memory is of
    the text just before), wrapping round the data, and the starts come from the generator alone."""
    text = np.arange(1000, dtype=np.uint16)
    segments = [data.stream_batch(text, 4, 16, torch.Generator().manual_seed(7), s) for s in range(3)]
    for a, b in zip(segments, segments[1:]):
        assert torch.equal((a["idx"][:, -1] + 1) % (1000 - 17), b["idx"][:, 0] % (1000 - 17))
    assert torch.equal(segments[0]["targets"][:, :-1], segments[0]["idx"][:, 1:])
    assert not torch.equal(segments[0]["idx"], data.stream_batch(text, 4, 16, torch.Generator().manual_seed(8), 0)["idx"])


def test_a_prefix_lm_batch_draws_each_rows_prefix_in_1_to_t_minus_1_and_counts_its_suffix_only():
    x = torch.randint(0, 50, (4000, 17), generator=torch.Generator().manual_seed(0))
    b = data.prefix_batch(x, torch.Generator().manual_seed(1))
    P, T = b["prefix_len"], 16
    assert P.min() == 1 and P.max() == T - 1 and abs(P.float().mean() - T / 2) < 0.2  # uniform in [1, T - 1]
    t = torch.arange(T)
    assert ((b["targets"] == -100) == (t < (P - 1)[:, None])).all()  # the first suffix token (at P - 1) counts
    assert torch.equal(b["targets"][t >= (P - 1)[:, None]], x[:, 1:][t >= (P - 1)[:, None]])
    assert torch.equal(b["idx"], x[:, :-1])


MASK = -1  # bart_noise's mask id in these tests: no id of the text


def mask_gaps(out, n):
    """For the noised out of arange(n) (kept ids in order, MASK in each gap): the ids each mask
    stands for, in order."""
    gaps, before = [], -1
    for i, t in enumerate(out + [n]):
        if t != MASK:
            assert t > before  # kept ids keep their order
            if i and out[i - 1] == MASK:
                gaps.append(t - before - 1)
            before = t
    return gaps


@pytest.mark.parametrize("n", [64, 201])
def test_bart_infilling_masks_30_percent_in_spans_of_one_mask_each_never_two_masks_in_a_row(n):
    g, ids = torch.Generator().manual_seed(0), torch.arange(n)
    covered = []
    for _ in range(300):
        out = data.bart_noise(ids, MASK, g).tolist()
        assert all(not (a == b == MASK) for a, b in zip(out, out[1:]))
        gaps = mask_gaps(out, n)
        assert len(gaps) == out.count(MASK) and sum(gaps) == n - (len(out) - out.count(MASK))
        covered.append(sum(gaps))
    assert set(covered) == {round(0.3 * n)}  # the last span is cut so that they cover 30% to the token
    assert torch.equal(ids, torch.arange(n))  # its input as it was


def test_bart_span_lengths_are_poisson_3_and_a_zero_length_span_inserts_a_mask():
    # 300 spans' worth among 30,000 ids: spans almost never meet, and the one cut to fit is 1 in 100
    g, n, gaps = torch.Generator().manual_seed(0), 30_000, []
    for _ in range(50):
        gaps += mask_gaps(data.bart_noise(torch.arange(n), MASK, g, ratio=0.01).tolist(), n)
    counts = torch.bincount(torch.tensor(gaps), minlength=8)[:8] / len(gaps)
    poisson = torch.tensor([math.exp(-3) * 3**k / math.factorial(k) for k in range(8)])
    assert counts[0] > 0.04  # a mask between two ids that were side by side: inserted
    torch.testing.assert_close(counts, poisson, rtol=0, atol=0.015)


def test_bart_permutes_whole_sentences_and_the_text_after_the_last_end_is_one_too():
    END, Q = 0, 1  # "." and "?": a run of ends ("?.") ends one sentence
    sentences = [[10, 11, END], [20, Q, END], [30, 31, 32, Q], [40, END, END], [50, 51]]  # the last has no end
    ids = torch.tensor(sum(sentences, []))
    g, orders = torch.Generator().manual_seed(0), set()
    for _ in range(200):
        out, order = data.bart_noise(ids, MASK, g, ratio=0, sentence_end=[END, Q]).tolist(), []
        while out:  # each sentence starts with an id of its own: peel them off the front
            k = next(k for k, s in enumerate(sentences) if s[0] == out[0])
            assert out[: len(sentences[k])] == sentences[k]
            out, order = out[len(sentences[k]):], order + [k]
        assert sorted(order) == list(range(5))
        orders.add(tuple(order))
    assert len(orders) > 60 and any(o[-1] != 4 for o in orders)  # the end's sentence moves too
    assert torch.equal(data.bart_noise(ids, MASK, g, ratio=0), ids)  # no sentence ends given: no permutation
    assert torch.equal(ids, torch.tensor(sum(sentences, [])))


def test_bart_batch_reconstructs_the_text_from_its_noised_rows_padded_or_cropped_to_L():
    B, L = 400, 3  # so short that some rows grow: a zero-length span inserts a mask, and the row keeps its first L
    x = torch.randint(0, 50, (B, L), generator=torch.Generator().manual_seed(0))
    tokens = data.special_tokens(50) | {"sentence_end": [7]}
    b = data.bart_batch(x, torch.Generator().manual_seed(1), tokens)
    assert b["src"].shape == b["src_mask"].shape == b["idx"].shape == b["targets"].shape == (B, L)
    assert torch.equal(b["targets"], x) and torch.equal(b["idx"][:, 1:], x[:, :-1])
    assert (b["idx"][:, 0] == tokens["start"]).all()
    g, grown = torch.Generator().manual_seed(1), 0
    for row in range(B):  # each row as bart_noise gives it, padded (src_mask False there) or cropped
        want = data.bart_noise(x[row], tokens["mask"], g, sentence_end=[7])
        n = min(len(want), L)
        assert torch.equal(b["src"][row, :n], want[:L]) and b["src_mask"][row].tolist() == [True] * n + [False] * (L - n)
        grown += len(want) > L
    assert grown > 0
    text = np.random.default_rng(0).integers(0, 50, 100_000).astype(np.uint16)
    t = data.get_batch(text, "encoder-decoder", 8, 64, torch.Generator().manual_seed(0), tokens, 50, objective="bart")
    assert t["src"].shape == (8, 64) and torch.equal(t["idx"][:, 1:], t["targets"][:, :-1])
    assert ((t["src"] == tokens["mask"]) & t["src_mask"]).any(1).all()


def test_batches_are_drawn_past_2_to_the_31_tokens_of_a_memory_mapped_file(tmp_path, monkeypatch):
    # FineWeb-Edu's 10B sample is 5 times 2^31 tokens: offsets and lengths must not wrap at 32 bits. A
    # sparse file of 3 * 2^31 + 1,000 tokens takes no disk but the few known tokens written near its end
    n, tail = 3 * 2**31 + 1000, np.arange(1, 501, dtype=np.uint16)
    d = tmp_path / "big"
    d.mkdir()
    with open(d / "train.bin", "wb") as f:
        f.truncate(2 * n)
        f.seek(2 * (n - len(tail)))
        f.write(tail.tobytes())
    (d / "val.bin").write_bytes(np.arange(100, dtype=np.uint16).tobytes())
    meta = dict(vocab_size=50257, tokenizer="gpt2", dtype="uint16", train_tokens=n, val_tokens=100)
    (d / "meta.json").write_text(json.dumps(meta))
    loaded, _ = data.load_data(str(tmp_path), "big")  # the checks of meta.json hold past 2^31
    train = loaded["train"]
    assert len(train) == n and train[n - 1] == 500 and train[n - 500] == 1
    g = torch.Generator().manual_seed(0)
    starts = torch.randint(n - 9, (10_000,), generator=g)  # get_batch's draw: int64, over the whole file
    assert (starts > 2**32).float().mean() > 0.3 and starts.max() <= n - 10  # a third of them past 2^32
    picked = iter([[n - 9, n - 300]])  # two rows from the known tail: x is the row, its targets shifted by one
    monkeypatch.setattr(torch, "randint", lambda high, size, generator: torch.tensor(next(picked)))
    b = data.get_batch(train, "decoder", 2, 8, g, {}, 50257)
    assert b["idx"].tolist() == [list(range(492, 500)), list(range(201, 209))]
    assert b["targets"].tolist() == [list(range(493, 501)), list(range(202, 210))]
    meta["train_tokens"] = n + 1  # a file cut short is refused
    (d / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(data.UsageError, match="train.bin holds 6,442,451,944 tokens, meta.json says 6,442,451,945"):
        data.load_data(str(tmp_path), "big")
