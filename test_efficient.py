"""
Attention below O(T^2): linear attention (Katharopoulos et al. 2020) and global tokens beside a
sliding window (Longformer; attention sinks when decoding, StreamingLLM). Each form is checked
against the quadratic definition, and generation against one forward pass over the whole sequence.
"""

import pytest
import torch
import torch.nn.functional as F

import generate as generate_module
from generate import cache_size, generate
from model import ATTENTIONS, KVCache, LinearState, ModelConfig, linear_attention


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


@pytest.mark.parametrize("pos", ["none", "learned", "sinusoidal", "rope"])
def test_a_linear_decoder_generates_from_its_state_what_a_forward_pass_gives(pos, tiny_model):
    model = tiny_model(pos=pos, attention="linear", n_kv_head=2)
    prompt = torch.randint(0, 61, (2, 5))
    out, logits = greedy_logits(model, prompt, 20)  # 25 tokens, within block_size (32)
    torch.testing.assert_close(logits, model(out)[0][:, 5:-1], rtol=1e-4, atol=1e-4)
    assert not any(isinstance(m, KVCache) for m in model.modules())  # the state replaced it, and is gone


@pytest.mark.parametrize("pos", ["none", "rope"])
def test_a_linear_decoder_generates_past_block_size_in_constant_memory(pos, tiny_model):
    """Relative or no positions: the state carries every token before, past the context trained on.
    A model with a longer block_size (the same weights) gives the reference in one pass."""
    model = tiny_model(pos=pos, attention="linear", block_size=16)
    long = tiny_model(pos=pos, attention="linear", block_size=128)
    long.load_state_dict(model.state_dict())
    sizes = []
    model.register_forward_hook(lambda m, a, o: sizes.append(sum(
        b.numel() for s in m.modules() if isinstance(s, LinearState) for b in s.buffers())))
    out, logits = greedy_logits(model, torch.randint(0, 61, (1, 10)), 60)  # to position 70
    torch.testing.assert_close(logits, long(out)[0][:, 10:-1], rtol=1e-4, atol=1e-4)
    assert len(set(sizes)) == 1 and sizes[0] == 2 * (4 * 8 * 8 + 4 * 8)  # layers x (S + z), all along


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


@pytest.mark.parametrize("name", list(ATTENTIONS))
def test_each_kind_of_attention_is_what_its_row_in_the_table_says(name, tiny_model):
    """model.ATTENTIONS is what the config's checks, the caches and the attention page read: each
    row's facts hold of the model built with that kind."""
    kind = ATTENTIONS[name]
    for ok, kw in [(kind.causal, dict(arch="decoder")), (kind.bidirectional, dict(arch="encoder")),
                   (kind.bias, dict(pos="alibi")), (kind.bias, dict(pos="relative")), (kind.window, dict(window=4)),
                   (kind.window, dict(window=4, n_global=1)), (kind.kernel, dict(attn_impl="triton"))]:
        if ok:
            ModelConfig(attention=name, **kw)
        else:
            with pytest.raises(ValueError, match=f"{name} attention"):
                ModelConfig(attention=name, **kw)
    model = tiny_model(attention=name, pos="rope")
    model.setup_kv_cache(2, 8)
    assert isinstance(model.decoder.h[0].attn.cache, {"kv": KVCache, "state": LinearState}[kind.keeps])
    model.clear_kv_cache()
    weights = {}
    model(torch.zeros(2, 5, dtype=torch.long), weights=weights)
    assert any(weights.values()) == kind.weights


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
