"""Training data (data.py): the batches of the three objectives (next token, masked LM, span
corruption) and the seed of every batch of a run."""

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
