"""
efficient.py, attention below O(T^2): linear attention (Katharopoulos et al. 2020), global tokens
beside a sliding window (Longformer; attention sinks when decoding, StreamingLLM), Reformer's LSH
attention, Linformer, BigBird's random blocks and Performer's random features. Each form is checked
against its definition, and generation against one forward pass over the whole sequence.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import generate as generate_module
from efficient import (LinearState, PerformerState, linear_attention, linformer_attention, lsh_attention, lsh_buckets,
                       lsh_rotations, performer_attention, random_features, random_mask)
from generate import cache_size, generate
from model import ATTENTIONS, KVCache, ModelConfig


def phi(x):
    return F.elu(x) + 1


def quadratic(q, k, v, see):
    """Linear attention by its definition: weights phi(q_i)·phi(k_j) where see (B|1, T, T), normalised."""
    g = q.size(1) // k.size(1)
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    w = (phi(q) @ phi(k).mT) * see[:, None]
    return (w / w.sum(-1, keepdim=True)) @ v


@pytest.mark.parametrize("T, chunk", [(1, 64), (37, 8), (64, 64), (100, 64)])
def test_causal_linear_attention_in_chunks_is_the_quadratic_form(T, chunk):
    torch.manual_seed(T)
    q, k, v = torch.randn(2, 4, T, 8), torch.randn(2, 2, T, 8), torch.randn(2, 2, T, 8)  # grouped-query
    causal = torch.ones(T, T).tril()[None]
    torch.testing.assert_close(linear_attention(q, k, v, True, chunk=chunk), quadratic(q, k, v, causal))


def test_bidirectional_linear_attention_ignores_padding_keys():
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 10, 8), torch.randn(2, 4, 10, 8), torch.randn(2, 4, 10, 8)
    valid = torch.ones(2, 10, dtype=torch.bool)
    valid[1, 7:] = False  # the second row: 3 padding tokens
    y = linear_attention(q, k, v, False, valid)
    torch.testing.assert_close(y, quadratic(q, k, v, valid[:, None, :].float().expand(2, 10, 10)))
    k2, v2 = k.clone(), v.clone()
    k2[1, :, 7:], v2[1, :, 7:] = float("nan"), 1e6  # whatever sits at the padding
    torch.testing.assert_close(linear_attention(q, k2, v2, False, valid), y)


def test_the_recurrent_form_is_the_parallel_form():
    """Tokens fed one at a time, or a few, through a LinearState give what one pass over all gives."""
    torch.manual_seed(1)
    q, k, v = torch.randn(1, 4, 50, 8), torch.randn(1, 2, 50, 8), torch.randn(1, 2, 50, 8)
    whole = linear_attention(q, k, v, True)
    for pieces in ([1] * 50, [13, 1, 1, 20, 15]):
        state, out, s = LinearState(1, 2, 8, "cpu"), [], 0
        for n in pieces:
            out.append(linear_attention(q[:, :, s:s + n], k[:, :, s:s + n], v[:, :, s:s + n], True, state=state))
            s += n
        torch.testing.assert_close(torch.cat(out, dim=2), whole)
    assert state.S.shape == (1, 2, 8, 8) and state.z.shape == (1, 2, 8)  # n_kv_head x hs x hs, and the normaliser


def greedy_logits(model, prompt, n):
    """The logits of each of n greedy steps of generate(): the model's own decoding path."""
    seen, step = [], generate_module.decode

    def decode(*args):
        seen.append(step(*args))
        return seen[-1]
    generate_module.decode = decode
    try:
        out = generate(model, prompt, n, temperature=0)
    finally:
        generate_module.decode = step
    return out, torch.stack(seen, dim=1)  # (B, n - 1, V): the logits after each new token but the last


RECURRENT = {"linear": dict(attention="linear"), "performer": dict(attention="performer", n_features=16)}


@pytest.mark.parametrize("kind", RECURRENT)
@pytest.mark.parametrize("pos", ["none", "learned", "sinusoidal", "rope"])
def test_a_recurrent_decoder_generates_from_its_state_what_a_forward_pass_gives(kind, pos, tiny_model):
    model = tiny_model(pos=pos, n_kv_head=2, **RECURRENT[kind])
    prompt = torch.randint(0, 61, (2, 5))
    out, logits = greedy_logits(model, prompt, 20)  # 25 tokens, within block_size (32)
    torch.testing.assert_close(logits, model(out)[0][:, 5:-1], rtol=1e-4, atol=1e-4)
    assert not any(isinstance(m, KVCache) for m in model.modules())  # the state replaced it, and is gone


@pytest.mark.parametrize("kind", RECURRENT)
@pytest.mark.parametrize("pos", ["none", "rope"])
def test_a_recurrent_decoder_generates_past_block_size_in_constant_memory(kind, pos, tiny_model):
    """Relative or no positions: the state carries every token before, past the context trained on.
    A model with a longer block_size (the same weights) gives the reference in one pass."""
    model = tiny_model(pos=pos, block_size=16, **RECURRENT[kind])
    long = tiny_model(pos=pos, block_size=128, **RECURRENT[kind])
    long.load_state_dict(model.state_dict())
    sizes = []
    model.register_forward_hook(lambda m, a, o: sizes.append(sum(
        b.numel() for s in m.modules() if isinstance(s, (LinearState, PerformerState)) for b in s.buffers())))
    out, logits = greedy_logits(model, torch.randint(0, 61, (1, 10)), 60)  # to position 70
    torch.testing.assert_close(logits, long(out)[0][:, 10:-1], rtol=1e-4, atol=1e-4)
    # layers x heads x (S + z): hs x hs and hs for linear; m x hs, m and the running max for the performer
    per_head = 8 * 8 + 8 if kind == "linear" else 16 * 8 + 16 + 1
    assert len(set(sizes)) == 1 and sizes[0] == 2 * 4 * per_head  # the same size all along


@pytest.mark.parametrize("arch", ["encoder", "encoder-decoder"])
def test_linear_encoders_read_both_ways_and_skip_padding(arch, tiny_model):
    model = tiny_model(arch=arch, attention="linear", pos="rope")
    idx, mask = torch.randint(0, 61, (2, 12)), torch.ones(2, 12, dtype=torch.bool)
    mask[1, 9:] = False
    if arch == "encoder":
        a = model(idx, mask=mask)[0]
        b = model(torch.where(mask, idx, 0), mask=mask)[0]  # other tokens at the padding: the same
        torch.testing.assert_close(a[mask], b[mask])
        changed = model(idx.index_fill(1, torch.tensor([11]), 3))[0]  # the last token is seen by the first
        assert not torch.allclose(changed[:, 0], model(idx)[0][:, 0])
    else:  # the decoder is causal linear attention, its cross-attention softmax over the encoder's output
        gen = generate(model, torch.zeros(2, 1, dtype=torch.long), 10, temperature=0, src=idx, src_mask=mask)
        teacher = model(gen[:, :-1], src=idx, src_mask=mask)[0].argmax(-1)
        assert torch.equal(teacher, gen[:, 1:])


@pytest.mark.parametrize("kw, words", [
    (dict(attention="linear", pos="alibi"), "pos='alibi' adds a bias to attention scores"),
    (dict(attention="linear", pos="relative"), "which linear attention has none of"),
    (dict(attention="linear", window=8), "it has no window (set window=0)"),
    (dict(n_global=2), "global tokens are seen from a window's queries"),
    (dict(window=8, n_global=2, attn_impl="triton"), "the Triton kernel has neither"),
    (dict(attention="quadratic"), "attention='quadratic' is not known"),
])
def test_settings_that_cannot_go_together_are_refused(kw, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        ModelConfig(**kw)


KIND_SETTINGS = dict(lsh=dict(bucket_size=4, n_hashes=2), performer=dict(n_features=16),
                     linformer=dict(proj_len=8))  # the tiny model's sizes: context 32, heads of 8


@pytest.mark.parametrize("name", list(ATTENTIONS))
def test_each_kind_of_attention_is_what_its_row_in_the_table_says(name, tiny_model):
    """model.ATTENTIONS is what the config's checks, the caches and the attention page read: each
    row's facts hold of the model built with that kind."""
    kind, kw = ATTENTIONS[name], dict(attention=name, **KIND_SETTINGS.get(name, {}))
    for ok, more in [(kind.causal, dict(arch="decoder")), (kind.bidirectional, dict(arch="encoder")),
                     (kind.bias, dict(pos="alibi")), (kind.bias, dict(pos="relative")), (kind.window, dict(window=4)),
                     (kind.window, dict(window=4, n_global=1)), (kind.kernel, dict(attn_impl="triton")),
                     (kind.scores, dict(score="general"))]:
        more = dict(arch="decoder" if kind.causal else "encoder") | more
        if ok:
            ModelConfig(block_size=32, **kw, **more)
        else:
            with pytest.raises(ValueError, match=f"{name} attention"):
                ModelConfig(block_size=32, **kw, **more)
    model = tiny_model(arch="decoder" if kind.causal else "encoder-decoder", pos="rope", **kw)
    # an encoder-only kind leaves an encoder-decoder's decoder with softmax attention, which keeps a KV cache
    keeps = kind.keeps if kind.causal else "kv"
    model.setup_kv_cache(2, 8)
    kept = {"kv": KVCache, "state": (LinearState, PerformerState), "none": type(None)}[keeps]
    assert isinstance(model.decoder.h[0].attn.cache, kept)
    model.clear_kv_cache()
    weights = {}
    idx = torch.zeros(2, 5, dtype=torch.long)
    model(idx, weights=weights, src=idx if not kind.causal else None)
    assert bool(weights.get(f"{'decoder' if kind.causal else 'encoder'} self-attention")) == kind.weights


@pytest.mark.parametrize("name", list(ATTENTIONS))
def test_what_a_layer_holds_and_runs_is_what_its_row_in_the_table_says(name, tiny_model):
    """The row's facts that Attention reads: its draws (held by their names, learned or fixed, redrawn
    or not), its state, shared queries and keys, and the longest sequence its draws allow."""
    kind, kw = ATTENTIONS[name], dict(attention=name, **KIND_SETTINGS.get(name, {}))
    stack = "decoder" if kind.causal else "encoder"
    model = tiny_model(arch=stack, pos="rope", feature_redraw=1 if kind.redraws else 0, **kw)
    c, attn = model.config, getattr(model, stack).h[0].attn
    drawn, learned, fixed = kind.draws(c), dict(attn.named_parameters()), dict(attn.named_buffers())
    for n, t in drawn.items():  # under their names in checkpoints (and Hugging Face's exports' refusals)
        assert f"{stack}.h.0.attn.{n}" in model.state_dict() and getattr(attn, n).shape == t.shape
        assert (n in learned, n in fixed) == ((True, False) if isinstance(t, torch.nn.Parameter) else (False, True))
    assert (kind.attend is None) == (name == "softmax")  # softmax is Attention's own, every other kind a function
    assert (kind.state is not None) == (kind.keeps == "state")
    if kind.redraws:  # its fixed draws change at a redraw, and only those
        assert drawn and not any(isinstance(t, torch.nn.Parameter) for t in drawn.values())
        before = {k: v.clone() for k, v in model.state_dict().items()}
        model.redraw_features(step=1, seed=0)
        changed = {k for k, v in model.state_dict().items() if not torch.equal(v, before[k])}
        assert changed == {f"{stack}.h.{i}.attn.{n}" for i in range(c.n_layer) for n in drawn}
    else:
        with pytest.raises(ValueError, match="feature_redraw"):
            ModelConfig(arch=stack, feature_redraw=1, **kw)
    hs = c.head_size  # q, k and v, or q and v only where the keys are made from the queries
    assert attn.c_attn.out_features == c.n_head * hs + (1 if kind.shared_qk else 2) * c.n_kv_head * hs
    if kind.shared_qk:
        with pytest.raises(ValueError, match=f"{name} attention shares queries and keys"):
            ModelConfig(arch=stack, n_kv_head=2, **kw)
    longer = torch.zeros(1, c.block_size + 1, dtype=torch.long)  # RoPE: only a kind's draws can bound the length
    if kind.fixed_length:
        with pytest.raises(ValueError, match="longer than block_size"):
            model(longer)
    else:
        assert model(longer)[0].shape == (1, c.block_size + 1, c.vocab_size)


@pytest.mark.parametrize("causal", [True, False])
def test_global_tokens_see_and_are_seen_beside_the_window(causal, tiny_model):
    """Longformer's mask: keys within the window, plus the first n_global positions for every query;
    in an encoder the global queries also see every key."""
    model = tiny_model(arch="decoder" if causal else "encoder", window=3, n_global=2, pos="rope")
    stack = model.decoder if causal else model.encoder
    T = 10
    pos = torch.arange(T)[None]
    bias = stack.attn_bias(pos, pos, torch.arange(T), 3)[0, 0]
    i, j = torch.arange(T)[:, None], torch.arange(T)[None]
    want = ((i - j).abs() < 3) | (j < 2) | (i < 2 if not causal else False)
    if causal:
        want &= j <= i
    assert torch.equal(bias == 0, want)


@pytest.mark.parametrize("window, n_global", [(6, 2), (5, 1)])
def test_a_windowed_decoder_with_sinks_streams_past_block_size_in_bounded_memory(window, n_global, tiny_model):
    """The KV cache keeps the global tokens beside the window's ring; the logits equal a forward
    pass over the whole sequence under the same mask (a longer block_size, the same weights)."""
    model = tiny_model(pos="rope", window=window, n_global=n_global, block_size=16, n_kv_head=2)
    long = tiny_model(pos="rope", window=window, n_global=n_global, block_size=128, n_kv_head=2)
    long.load_state_dict(model.state_dict())
    slots = []
    model.register_forward_hook(lambda m, a, o: slots.append(m.decoder.cache_pos.size(1)))
    for prompt in (4, 30):  # a prompt within the window, and one that goes in by pieces
        slots.clear()
        out, logits = greedy_logits(model, torch.randint(0, 61, (1, prompt)), 50)
        torch.testing.assert_close(logits, long(out)[0][:, prompt:-1], rtol=1e-4, atol=1e-4)
        assert set(slots) == {cache_size(model, prompt, 50)} and slots[0] <= n_global + 2 * window


# ----------------------------------------------------------------------------------------------
# Reformer's LSH attention against its definition: a dense oracle that builds each round's T x T
# mask (same bucket, the band in sorted order, causal, valid, itself only when alone)

def dense_lsh(q, v, rotations, bucket_size, causal, valid=None):
    """LSH attention by its definition, in O(T^2) per round: returns (B, nh, T, hs) and the masks
    (B, nh, n_hashes, T, T) of the keys each query sees."""
    B, nh, T, hs = q.shape
    n_buckets = 2 * rotations.size(-1)
    valid = torch.ones(B, T, dtype=torch.bool) if valid is None else valid
    xR = torch.einsum("bntd,hdr->bnhtr", q, rotations)
    bucket = torch.cat([xR, -xR], -1).argmax(-1)  # (B, nh, H, T): h(x) = argmax([xR; -xR])
    bucket = torch.where(valid[:, None, None], bucket, n_buckets)  # padding: a last bucket of its own
    place = (bucket * T + torch.arange(T)).argsort(-1).argsort(-1)  # each position's place in the sort
    d = place[..., None, :] - place[..., :, None]  # (B, nh, H, T, T): key's place minus query's place
    same = bucket[..., :, None] == bucket[..., None, :]
    # a bucket's run of places [start, end); a bidirectional query sees the 2 bs places of its run nearest
    # to it: the band of 2 bs + 1 places around it, shifted to lie inside the run where the run allows
    start, end = place - (same & (d < 0)).sum(-1), place + (same & (d > 0)).sum(-1) + 1
    lo = torch.minimum((place - bucket_size).clamp(min=start), (end - 1 - 2 * bucket_size).clamp(min=start)) - place
    lo = lo[..., None]
    band = (d >= -2 * bucket_size) & (d < 0) if causal else (d >= lo) & (d <= lo + 2 * bucket_size) & (d != 0)
    others = band & same & valid[:, None, None, None, :]
    see = others | (torch.eye(T, dtype=torch.bool) & ~others.any(-1, keepdim=True))
    k = q / q.norm(dim=-1, keepdim=True)
    att = (q @ k.mT / hs ** 0.5)[:, :, None].masked_fill(~see, float("-inf"))  # (B, nh, H, T, T)
    lse = att.logsumexp(-1)  # (B, nh, H, T)
    y = torch.softmax(att, -1) @ v[:, :, None]
    return (lse.softmax(2)[..., None] * y).sum(2), see


def test_lsh_rotations_are_gaussian_one_per_round():
    R = lsh_rotations(3, 16, 8, generator=torch.Generator().manual_seed(0))
    assert R.shape == (3, 16, 4) and R.dtype == torch.float32
    many = lsh_rotations(100, 16, 64, generator=torch.Generator().manual_seed(1))  # 51,200 draws of N(0, 1)
    assert abs(many.mean()) < 5 / 51200 ** 0.5 and abs(many.var() - 1) < 5 * 2 ** 0.5 / 51200 ** 0.5  # 5 sigma
    assert torch.equal(R, lsh_rotations(3, 16, 8, generator=torch.Generator().manual_seed(0)))


# bucket_size 4: the 2 · 4 nearest places are every other key for T <= 9, as the 8 places back are causally
@pytest.mark.parametrize("causal, T", [(False, 1), (False, 5), (False, 8), (False, 9), (True, 1), (True, 5), (True, 9)])
def test_one_bucket_and_one_round_is_shared_qk_attention_over_all_but_itself(causal, T):
    """With one bucket the sorted order is the positions, and a band as long as the sequence is every key."""
    torch.manual_seed(T)
    q, v = torch.randn(2, 3, T, 8), torch.randn(2, 3, T, 8)
    q[..., 0] = q[..., 0].abs() + 0.1  # xR > 0 for R = e_0: every token hashes to bucket 0 of 2
    R = torch.zeros(1, 8, 1)
    R[0, 0] = 1.0
    assert (lsh_buckets(q, R) == 0).all()
    k = q / q.norm(dim=-1, keepdim=True)
    i, j = torch.arange(T)[:, None], torch.arange(T)
    see = (j < i) | ((i == 0) & (j == 0)) if causal else (j != i) | (T == 1)  # itself only when alone
    att = (q @ k.mT / 8 ** 0.5).masked_fill(~see, float("-inf"))
    torch.testing.assert_close(lsh_attention(q, v, R, 4, causal), torch.softmax(att, -1) @ v)


def test_causal_output_at_i_ignores_every_later_token_even_its_hash():
    """Later tokens replaced by huge other ones (which move their buckets, hence the sort) change
    nothing up to i. To 1e-6, not bitwise: later tokens of lower buckets shift i's sorted place, so the
    same keys are summed at other places of the chunked windows, in another fp32 order."""
    torch.manual_seed(0)
    B, nh, T, hs = 2, 2, 64, 8
    q, v = torch.randn(B, nh, T, hs), torch.randn(B, nh, T, hs)
    R = lsh_rotations(2, hs, 8, generator=torch.Generator().manual_seed(1))
    y = lsh_attention(q, v, R, 4, causal=True)
    for i in range(0, T - 1, 3):
        q2, v2 = q.clone(), v.clone()
        q2[:, :, i + 1:] = 1e3 * torch.randn(B, nh, T - i - 1, hs)
        v2[:, :, i + 1:] = 1e3 * torch.randn(B, nh, T - i - 1, hs)
        assert (lsh_buckets(q2, R) != lsh_buckets(q, R))[..., i + 1:].any()  # later tokens did move
        torch.testing.assert_close(lsh_attention(q2, v2, R, 4, causal=True)[:, :, :i + 1], y[:, :, :i + 1],
                                   atol=1e-6, rtol=0)


@pytest.mark.parametrize("causal", [False, True])
def test_lsh_attention_is_its_dense_definition_with_padding(causal):
    """Several buckets, 2 rounds, T not a multiple of bucket_size, padding at both ends and inside. fp32
    sums in another order: 1e-6 absolute on outputs of order 1."""
    torch.manual_seed(2)
    B, nh, T, hs, bucket_size = 2, 3, 45, 8, 4
    q, v = torch.randn(B, nh, T, hs), torch.randn(B, nh, T, hs)
    R = lsh_rotations(2, hs, 6, generator=torch.Generator().manual_seed(3))
    valid = torch.ones(B, T, dtype=torch.bool)
    valid[0, :5], valid[1, 30:], valid[1, 10:13] = False, False, False
    y = lsh_attention(q, v, R, bucket_size, causal, valid)
    expected, see = dense_lsh(q, v, R, bucket_size, causal, valid)
    torch.testing.assert_close(y[valid[:, None].expand(B, nh, T)], expected[valid[:, None].expand(B, nh, T)],
                               atol=1e-6, rtol=1e-5)
    assert torch.isfinite(y).all()
    n_seen = see.sum(-1)[valid[:, None, None].expand(B, nh, 2, T)]
    assert n_seen.min() == 1 and n_seen.max() > 1  # the case is not trivial: some alone, some with company


@pytest.mark.parametrize("causal", [False, True])
def test_padding_keys_get_no_weight(causal):
    """Whatever sits at padding (nan, huge) changes no real token's output, and right padding gives
    what the unpadded sequence gives (padding takes no place in a real token's band)."""
    torch.manual_seed(4)
    B, nh, T, hs = 2, 2, 40, 8
    q, v = torch.randn(B, nh, T, hs), torch.randn(B, nh, T, hs)
    R = lsh_rotations(2, hs, 4, generator=torch.Generator().manual_seed(5))
    valid = torch.ones(B, T, dtype=torch.bool)
    valid[1, 25:], valid[0, :3] = False, False
    y = lsh_attention(q, v, R, 4, causal, valid)
    q2, v2 = q.clone(), v.clone()
    q2[1, :, 25:], v2[1, :, 25:], q2[0, :, :3], v2[0, :, :3] = float("nan"), 1e6, -1e6, float("nan")
    y2 = lsh_attention(q2, v2, R, 4, causal, valid)
    assert torch.isfinite(y2).all()  # padding queries too
    torch.testing.assert_close(y2[1, :, :25], y[1, :, :25], atol=0, rtol=0)
    torch.testing.assert_close(y2[0, :, 3:], y[0, :, 3:], atol=0, rtol=0)
    torch.testing.assert_close(y[1:, :, :25], lsh_attention(q[1:, :, :25], v[1:, :, :25], R, 4, causal))


class LargestStorage(TorchDispatchMode):
    """Records the most elements any tensor made during the call holds in memory (its storage, so an
    expanded or unfolded view counts for what it really takes)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.untyped_storage().nbytes() // t.element_size())
        return out


@pytest.mark.parametrize("causal", [False, True])
def test_lsh_attention_makes_no_t_by_t_tensor(causal):
    """T = 1024, bucket_size 8: every tensor within n_hashes · B · nh · T · (5 · bucket_size + hs) elements
    (a round's window of at most 5 · bucket_size scores per query, or its window of keys), which is under
    a fifth of the B · nh · T · T that dense attention's scores take."""
    B, nh, T, hs, n_hashes, bucket_size = 1, 2, 1024, 8, 2, 8
    q, v = torch.randn(B, nh, T, hs), torch.randn(B, nh, T, hs)
    R = lsh_rotations(n_hashes, hs, 16)
    with LargestStorage() as mode:
        lsh_attention(q, v, R, bucket_size, causal, torch.ones(B, T, dtype=torch.bool))
    bound = n_hashes * B * nh * T * (5 * bucket_size + hs)
    assert mode.largest <= bound <= B * nh * T * T / 5, (mode.largest, bound)


@pytest.mark.parametrize("causal", [False, True])
def test_an_lsh_model_is_strictly_causal_and_generates_what_recomputing_gives(causal, tiny_model):
    """A decoder's logits at i ignore every later token through all layers (their hashes included);
    generation recomputes its context each step (no cache) and gives the greedy tokens of forward passes."""
    model = tiny_model(arch="decoder" if causal else "encoder", attention="lsh", bucket_size=4, pos="rope")
    idx = torch.randint(0, 61, (2, 32), generator=torch.Generator().manual_seed(0))
    logits = model(idx)[0]
    later = idx.clone()
    later[:, 20:] = torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(1))
    changed = (model(later)[0] - logits).abs().amax(dim=(0, 2))  # per position
    if not causal:  # an encoder's earlier positions do see later tokens: the test can tell
        assert changed[:20].max() > 1e-3
        return
    assert changed[:20].max() <= 1e-5 and changed[20:].min() > 1e-3  # fp32 sums in another sorted order
    out = generate(model, idx[:, :5], 8, temperature=0)
    for t in range(5, 13):  # each new token is the argmax of a forward pass over what came before
        assert torch.equal(out[:, t], model(out[:, :t])[0][:, -1].argmax(-1))


def test_linformer_with_identity_projections_at_full_length_is_softmax_attention(tiny_model):
    """k = T = block_size, no padding, E = F = identity: the projected keys are the keys. The function,
    and an encoder against a softmax encoder with the same weights."""
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 16, 8), torch.randn(2, 2, 16, 8), torch.randn(2, 2, 16, 8)
    eye = torch.eye(16)
    torch.testing.assert_close(linformer_attention(q, k, v, eye, eye),
                               F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
    lin = tiny_model(arch="encoder", attention="linformer", proj_len=32)
    soft = tiny_model(arch="encoder")
    for block in lin.encoder.h:
        block.attn.proj_k.data, block.attn.proj_v.data = torch.eye(32), torch.eye(32)
    soft.load_state_dict({k: v for k, v in lin.state_dict().items() if "proj_" not in k})
    idx = torch.randint(0, 61, (2, 32))
    torch.testing.assert_close(lin(idx)[0], soft(idx)[0], rtol=1e-5, atol=1e-5)


def test_linformer_padding_changes_no_real_tokens_output_and_serves_encoders_only(tiny_model):
    model = tiny_model(arch="encoder", attention="linformer", proj_len=8)
    idx = torch.randint(0, 61, (2, 20), generator=torch.Generator().manual_seed(0))
    valid = torch.ones(2, 20, dtype=torch.bool)
    valid[1, 12:] = False
    other = idx.clone()
    other[1, 12:] = (other[1, 12:] + 7) % 61  # other tokens at the padding
    torch.testing.assert_close(model(idx, mask=valid)[0][1, :12], model(other, mask=valid)[0][1, :12], rtol=0, atol=0)
    with pytest.raises(ValueError, match="linformer attention mixes later keys into earlier ones"):
        ModelConfig(attention="linformer")
    t5 = tiny_model(arch="encoder-decoder", attention="linformer", proj_len=8)  # the encoder's; the decoder softmax
    assert t5.encoder.kind == "linformer" and t5.decoder.kind == "softmax"
    assert generate(t5, idx[:, :1], 4, temperature=0, src=idx, src_mask=valid).shape == (2, 5)


def test_bigbird_queries_see_their_window_the_global_keys_and_r_random_blocks_exactly(tiny_model):
    """At T = block_size, on the math path's weights: every non-global query sees exactly the keys of
    its window, the global keys, and r·s random keys, none of which it already saw, the same every pass."""
    w, g, r, s = 3, 2, 2, 4
    model = tiny_model(arch="encoder", window=w, n_global=g, n_random=r, sparse_block=s)
    weights = {}
    model(torch.randint(0, 61, (1, 32)), weights=weights)
    i, j = torch.arange(32)[:, None], torch.arange(32)
    near = ((i - j).abs() < w) | (j < g)  # the window and the global keys
    for layer, att in enumerate(weights["encoder self-attention"]):
        blocks = model.encoder.h[layer].attn.random_blocks  # (nh, 8 blocks, r)
        for h in range(4):
            seen = att[0, h] > 0
            assert torch.equal(seen[g:] & near[g:], near[g:])  # the window and the global keys
            extra = seen[g:] & ~near[g:]  # and r·s random ones: the blocks drawn for its block of queries
            assert (extra.sum(-1) == r * s).all()
            assert torch.equal(extra, random_mask(blocks, 32, s)[h, g:])
    again = {}
    model(torch.randint(0, 61, (1, 32)), weights=again)
    assert all(torch.equal(a > 0, b > 0) for a, b in zip(weights["encoder self-attention"],
                                                        again["encoder self-attention"]))


def test_bigbird_without_random_blocks_is_the_window_and_global_model_and_a_decoder_is_refused(tiny_model):
    """n_random=0 takes the same weights as the BigBird model and computes the window + global
    attention; with random blocks the output differs; the pattern is saved with the weights."""
    big = tiny_model(arch="encoder", window=4, n_global=2, n_random=2, sparse_block=4)
    plain = tiny_model(arch="encoder", window=4, n_global=2)
    state = big.state_dict()
    plain.load_state_dict({k: v for k, v in state.items() if "random_blocks" not in k})  # strict: nothing else
    idx = torch.randint(0, 61, (2, 32))
    assert (big(idx)[0] - plain(idx)[0]).abs().max() > 1e-3
    for block in big.encoder.h:  # each block of queries drawing itself, inside its window: nothing new to see
        block.attn.random_blocks = torch.arange(8)[None, :, None].expand(4, 8, 1).clone()
    torch.testing.assert_close(big(idx)[0], plain(idx)[0])
    other = tiny_model(seed=1, arch="encoder", window=4, n_global=2, n_random=2, sparse_block=4)
    other.load_state_dict(state)  # the pattern comes with the weights, as a checkpoint holds it
    assert all(torch.equal(b.attn.random_blocks, state[f"encoder.h.{i}.attn.random_blocks"])
               for i, b in enumerate(other.encoder.h))
    with pytest.raises(ValueError, match="random blocks \\(n_random\\) join an encoder's window"):
        ModelConfig(window=3, n_random=1, sparse_block=4, block_size=32)


# ----------------------------------------------------------------------------------------------
# Performer (FAVOR+): its random features estimate softmax's weights without bias, the chunked causal
# form is the quadratic definition and never looks ahead, the recurrent form is the parallel one, and
# the outputs approach softmax attention's as the number of features grows

def favor_exponents(x, proj):
    """log φ(x) by the formula: w·x̂ - ‖x̂‖²/2 - log(m)/2, x̂ = x hs^-¼."""
    x = x * x.size(-1) ** -0.25
    return x @ proj.mT - x.square().sum(-1, keepdim=True) / 2 - math.log(proj.size(-2)) / 2


def favor_phi(x, proj):
    """FAVOR+'s features by the formula, nothing stabilised: exp(w·x̂ - ‖x̂‖²/2) / √m."""
    return favor_exponents(x, proj).exp()


def favor_quadratic(q, k, v, proj, see):
    """Performer attention by its definition: weights φ(q_i)·φ(k_j) where see (B|1, T, T), normalised."""
    g = q.size(1) // k.size(1)
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    w = (favor_phi(q, proj) @ favor_phi(k, proj).mT) * see[:, None]
    return (w / w.sum(-1, keepdim=True)) @ v


def plain_qr_features(m, hs, generator):
    """random_features' rows but from Q of a plain QR, without the sign fix: Q's signs follow R's diagonal."""
    blocks = [torch.linalg.qr(torch.randn(hs, hs, generator=generator))[0] for _ in range(-(-m // hs))]
    return torch.cat(blocks)[:m] * torch.randn(m, hs, generator=generator).norm(dim=1, keepdim=True)


def estimates(features, q, k, hs, draws=2000):
    """φ(q)·φ(k) with m = hs features from each of `draws` independent orthogonal blocks (one block each)."""
    proj = features(draws * hs, hs, torch.Generator().manual_seed(0)).view(draws, hs, hs)
    return (favor_phi(q, proj) * favor_phi(k, proj)).sum(-1)  # (draws,)


def test_random_features_estimate_softmax_weights_without_bias():
    hs = 8
    # along (1, ..., 1), where plain QR's bias shows; small, so that the draws' spread, exp(‖q̂ + k̂‖²), is too
    q, k = torch.full((hs,), 0.4), torch.full((hs,), 0.4)
    exact = math.exp(q @ k / hs ** 0.5)
    for features, unbiased in [(random_features, True), (plain_qr_features, False)]:
        x = estimates(features, q, k, hs)
        # the mean of 2000 independent draws: a normal within 4 standard errors but once in 15,000 runs
        z_score = abs(x.mean().item() - exact) / (x.std().item() / len(x) ** 0.5)
        assert (z_score < 4) == unbiased, (features.__name__, z_score)


def test_random_feature_directions_average_to_zero():
    hs, draws = 8, 2000
    for features, unbiased in [(random_features, True), (plain_qr_features, False)]:
        proj = features(draws * hs, hs, torch.Generator().manual_seed(1)).view(draws, hs, hs)
        mean = (proj / proj.norm(dim=-1, keepdim=True)).mean(0)  # (hs, hs): row r's mean direction
        # a unit vector's coordinate has variance 1/hs: a mean over 2000 has standard error 1/sqrt(hs·2000);
        # 5 of them bound 64 such means but once in 30,000 runs. Plain QR's diagonal is off by ~0.25
        assert (mean.abs().max() < 5 / (hs * draws) ** 0.5) == unbiased, features.__name__


def test_random_features_are_orthogonal_in_blocks_with_chi_norms():
    hs, m = 8, 8 * 4000 + 3  # m not a multiple of hs: the last block is cut
    proj = random_features(m, hs, torch.Generator().manual_seed(2))
    assert proj.shape == (m, hs) and proj.dtype == torch.float32
    unit = proj[:-3].view(-1, hs, hs) / proj[:-3].view(-1, hs, hs).norm(dim=-1, keepdim=True)
    # fp32 QR and a division: the Gram matrix is the identity to a few ulps of 1
    torch.testing.assert_close(unit @ unit.mT, torch.eye(hs).expand_as(unit @ unit.mT), atol=1e-5, rtol=0)
    norms = proj.norm(dim=-1).double()
    mean = math.sqrt(2) * math.exp(math.lgamma((hs + 1) / 2) - math.lgamma(hs / 2))  # chi(hs)'s mean
    # chi(hs) has variance hs - mean²: the mean of m norms within 5 standard errors; so is the mean square
    # (chi² has mean hs and variance 2 hs)
    assert abs(norms.mean() - mean) < 5 * ((hs - mean ** 2) / m) ** 0.5
    assert abs(norms.square().mean() - hs) < 5 * (2 * hs / m) ** 0.5


@pytest.mark.parametrize("T, chunk, padded", [(1, 64, False), (37, 8, False), (64, 64, False), (100, 64, True)])
def test_causal_performer_in_chunks_is_the_quadratic_form(T, chunk, padded):
    torch.manual_seed(T)
    q, k, v = torch.randn(2, 4, T, 8), torch.randn(2, 2, T, 8), torch.randn(2, 2, T, 8)  # grouped-query
    proj = random_features(32, 8, torch.Generator().manual_seed(T))
    valid = torch.ones(2, T, dtype=torch.bool)
    valid[1, :3] = ~padded  # left padding: the second row's first 3 tokens
    see = torch.ones(T, T).tril() * valid[:, None, :]  # (B, T, T)
    want = favor_quadratic(q, k, v, proj, see)
    got = performer_attention(q, k, v, proj, True, valid if padded else None, chunk=chunk)
    if padded:  # a query with no valid key before it has no weights to normalise: 0 by the guard, nan by 0/0
        got, want = got[:, :, 3:], want[:, :, 3:]
    # fp32 sums of <= 100 positive terms in another order and at another scale: relative error ~1e-6
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def whole_sequence_max(q, k, v, proj):
    """Causal FAVOR+, quadratic, with the keys' exp() stabilised by their max over the whole sequence (the
    reference code's choice): a later key that raises the max underflows the weights earlier queries see."""
    g = q.size(1) // k.size(1)
    eq, ek = favor_exponents(q, proj), favor_exponents(k.repeat_interleave(g, 1), proj)
    w = ((eq - eq.amax(-1, keepdim=True)).exp() @ (ek - ek.amax((-2, -1), keepdim=True)).exp().mT).tril()
    return (w / w.sum(-1, keepdim=True)) @ v.repeat_interleave(g, 1)


def test_causal_performer_never_looks_ahead():
    """Output i is the same, to 1e-6, whatever a later token holds: huge keys, keys that raise the max
    exponent (w_0 hs^¼ gives the largest possible, ‖w_0‖²/2), huge values, in this chunk or a later one."""
    torch.manual_seed(3)
    hs, T, j = 8, 40, 13  # chunk 8: token 13 is mid-chunk, with 3 earlier ones in its chunk
    q, v = torch.randn(2, 4, T, hs), torch.randn(2, 2, T, hs)
    k = 10 * torch.randn(2, 2, T, hs)  # large keys: max_r log φ(k)_r in [-290, -1], far below a raised max
    proj = random_features(16, hs, torch.Generator().manual_seed(3))
    y = performer_attention(q, k, v, proj, True, chunk=8)
    for at in (j, 30):
        for change in ("k += 50", "k = w_0", "v += 1e4"):
            k2, v2 = k.clone(), v.clone()
            if change == "k += 50":
                k2[..., at, :] += 50
            elif change == "k = w_0":
                k2[..., at, :] = proj[0] * hs ** 0.25
            else:
                v2[..., at, :] += 1e4
            y2 = performer_attention(q, k2, v2, proj, True, chunk=8)
            assert (y2[:, :, :at] - y[:, :, :at]).abs().max() <= 1e-6, (at, change)
            if change == "k = w_0":  # the largest key there is: it changes what it and later queries see
                assert (y2[:, :, at:] - y[:, :, at:]).abs().max() > 0.1
    # a max over the whole sequence, as in the reference code, would leak: the raised max underflows the rest
    k2 = k.clone()
    k2[..., j, :] = proj[0] * hs ** 0.25
    assert not torch.allclose(whole_sequence_max(q, k2, v, proj)[:, :, :j], whole_sequence_max(q, k, v, proj)[:, :, :j])


def test_causal_performer_stays_exact_when_keys_lie_far_below_the_max():
    """Keys whose largest exponents spread over [-290, -1] (exp() of most underflows in fp32): the running
    max keeps each query's weights in range, so the output is the fp64 definition, taken in log space."""
    torch.manual_seed(3)
    q, k, v = torch.randn(2, 4, 40, 8), 10 * torch.randn(2, 2, 40, 8), torch.randn(2, 2, 40, 8)
    proj = random_features(16, 8, torch.Generator().manual_seed(3))
    wide = proj.double()
    eq, ek = favor_exponents(q.double(), wide), favor_exponents(k.double().repeat_interleave(2, 1), wide)
    logits = torch.logsumexp(eq[..., :, None, :] + ek[..., None, :, :], -1)  # log φ(q_i)·φ(k_j): (B, nh, T, T)
    logits = logits.masked_fill(torch.ones(40, 40, dtype=torch.bool).triu(1), float("-inf"))
    want = (logits.softmax(-1) @ v.double().repeat_interleave(2, 1)).float()
    # fp32 exponents of size ~300 carry an absolute error ~300 * 2^-24 ≈ 2e-5, so the weights ~2e-5 relative
    torch.testing.assert_close(performer_attention(q, k, v, proj, True, chunk=8), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("attend", ["linear", "performer", "lsh"])
def test_the_fp32_methods_compute_in_fp32_under_bf16_autocast(attend):
    """Their sums, exponents and states are meant in fp32: autocast, which would run their products in
    bf16 even on fp32 tensors, is off inside them, so the output under it is the fp32 one exactly."""
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 24, 8), torch.randn(2, 4, 24, 8), torch.randn(2, 4, 24, 8)
    run = {"linear": lambda: linear_attention(q, k, v, True),
           "performer": lambda: performer_attention(q, k, v, random_features(16, 8), True),
           "lsh": lambda: lsh_attention(q, v, lsh_rotations(2, 8, 4, torch.Generator().manual_seed(0)), 4, True)}[attend]
    torch.manual_seed(1)
    want = run()
    torch.manual_seed(1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = run()
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_performers_recurrent_form_is_its_parallel_form():
    """Tokens fed one at a time, or a few, through a PerformerState give what one pass over all gives."""
    torch.manual_seed(4)
    q, k, v = torch.randn(1, 4, 50, 8), 3 * torch.randn(1, 2, 50, 8), torch.randn(1, 2, 50, 8)
    proj = random_features(24, 8, torch.Generator().manual_seed(4))
    whole = performer_attention(q, k, v, proj, True, chunk=16)
    for pieces in ([1] * 50, [13, 1, 1, 20, 15]):
        state, out, s = PerformerState(1, 2, 24, 8, "cpu"), [], 0
        for n in pieces:
            out.append(performer_attention(q[:, :, s:s + n], k[:, :, s:s + n], v[:, :, s:s + n], proj, True,
                                           state=state, chunk=16))
            s += n
        # the same sums, rescaled at other steps as the running max grows: fp32 rounding, ~1e-6 relative
        torch.testing.assert_close(torch.cat(out, dim=2), whole, rtol=1e-5, atol=1e-5)
    assert state.S.shape == (1, 2, 24, 8) and state.z.shape == (1, 2, 24) and state.M.shape == (1, 2)
    assert not any(name in state.state_dict() for name in ("S", "z", "M"))  # non-persistent


def test_bidirectional_performer_ignores_padding_keys():
    torch.manual_seed(5)
    q, k, v = torch.randn(2, 4, 10, 8), torch.randn(2, 2, 10, 8), torch.randn(2, 2, 10, 8)
    proj = random_features(32, 8, torch.Generator().manual_seed(5))
    valid = torch.ones(2, 10, dtype=torch.bool)
    valid[1, 7:] = False  # the second row: 3 padding tokens
    y = performer_attention(q, k, v, proj, False, valid)
    # one fp32 sum of 10 positive terms each way: relative error ~1e-7
    torch.testing.assert_close(y, favor_quadratic(q, k, v, proj, valid[:, None, :].float().expand(2, 10, 10)))
    k2, v2 = k.clone(), v.clone()
    k2[1, :, 7], k2[1, :, 8], k2[1, :, 9] = float("nan"), 1e6, proj[0] * 8 ** 0.25  # the last: the largest exponent
    v2[1, :, 7:] = float("nan")
    torch.testing.assert_close(performer_attention(q, k2, v2, proj, False, valid), y)


def test_performer_approaches_softmax_attention_as_features_grow():
    """The error falls as m grows; slowly while m is below the estimator's spread, exp(‖q̂ + k̂‖²) per feature,
    which grows fast with q and k: so the table shows entries of std 0.5 (logits q·k/√hs of std 0.25) and of
    std 1 (logits of std 1, as with QK-norm), the assertion the first."""
    hs, T, seeds = 16, 64, 4
    for std in (0.5, 1.0):
        torch.manual_seed(6)
        q, k, v = std * torch.randn(1, 2, T, hs), std * torch.randn(1, 2, T, hs), torch.randn(1, 2, T, hs)
        want = F.scaled_dot_product_attention(q, k, v)  # softmax(q·k/√hs), the weights FAVOR+ estimates
        errors = {m: sum((performer_attention(q, k, v, random_features(m, hs, torch.Generator().manual_seed(s)),
                                              False) - want).abs().mean().item() for s in range(seeds)) / seeds
                  for m in (16, 64, 256, 1024, 4096)}
        print(f"\nmean |performer - softmax| (T={T}, hs={hs}, q, k entries of std {std}, {seeds} seeds):",
              ", ".join(f"m={m}: {e:.4f}" for m, e in errors.items()))
        e = list(errors.values())
        # each 4 x the features lowers the error, up to a noise of 10% of the step before
        assert all(b < 1.1 * a for a, b in zip(e, e[1:])), std
        # a Monte Carlo error falls as 1/sqrt(m) once m is past the spread: 256 x the features, at least 4 x
        # lower (16 x in the limit); with std 1 only ~2.5 x lower here, as m is not yet past it
        assert e[-1] < e[0] / (4 if std == 0.5 else 1.5), std
