"""scores.py: the five score functions of attention. What holds for every score (causal masks, the
KV cache, padding, the parameter count), each form against its formula, and the settings refused.
Every model is conftest's tiny_model (vocab 61, context 32, 2 layers, 4 heads of 8, width 32, eval
mode), with the overrides a test names."""

import math

import pytest
import torch

from generate import cache_size, generate, prefill
from model import Attention, ModelConfig
from scores import SCORES, score, score_weights

V = 61
OTHERS = [s for s in SCORES if s != "scaled_dot"]


def tokens(B, T, seed=1):
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


def trained_like(model, seed=3):
    """The model with its score's weights moved off their start (W = I for general, W_q = W_k = I for
    additive), so that a test sees what the weights do, not only where they begin."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".score_" in name:
                p.add_(0.3 * torch.randn(p.shape, generator=g))
    return model


@pytest.mark.parametrize("name", SCORES)
@pytest.mark.parametrize("arch", ["decoder", "encoder-decoder"])
def test_a_decoders_logits_ignore_later_tokens_under_every_score(name, arch, tiny_model):
    model = trained_like(tiny_model(arch=arch, score=name))
    idx, src = tokens(2, 10), tokens(2, 7, seed=2) if arch == "encoder-decoder" else None
    changed = idx.clone()
    changed[:, 5] = (changed[:, 5] + 1) % V
    a, b = model(idx, src=src)[0], model(changed, src=src)[0]
    torch.testing.assert_close(a[:, :5], b[:, :5], rtol=0, atol=1e-6)
    assert (a[:, 5] - b[:, 5]).abs().max() > 1e-5


@pytest.mark.parametrize("name", SCORES)
@pytest.mark.parametrize("arch", ["decoder", "encoder-decoder"])
def test_cached_decoding_equals_recomputing_everything_under_every_score(name, arch, tiny_model):
    model = trained_like(tiny_model(arch=arch, score=name))
    idx, src = tokens(2, 5), tokens(2, 7, seed=2) if arch == "encoder-decoder" else None
    memory = model.encode(src) if src is not None else None
    model.setup_kv_cache(2, cache_size(model, 5, 12), memory)
    logits = [prefill(model, idx, torch.arange(5))]
    seq = idx
    for _ in range(11):
        seq = torch.cat((seq, logits[-1].argmax(-1, keepdim=True)), dim=1)
        logits.append(model(seq[:, -1:], input_pos=torch.tensor([seq.size(1) - 1]))[0][:, -1])
    model.clear_kv_cache()
    recomputed = model(seq, src=src)[0][:, 4:]  # the logits of each position from the last prompt token on
    torch.testing.assert_close(torch.stack(logits, 1), recomputed, rtol=0, atol=1e-5)
    assert torch.equal(generate(model, idx, 12, temperature=0, src=src)[:, :16], seq)


@pytest.mark.parametrize("name", SCORES)
def test_location_and_every_score_past_block_size_generate_as_the_reference_recomputes(name, tiny_model):
    """Past block_size a location score, whose rows end there, recomputes the last block_size tokens
    from position 0, as absolute positions do; the others slide the cache's window."""
    model = trained_like(tiny_model(score=name, pos="none", block_size=8))
    out = generate(model, tokens(1, 5), 10, temperature=0)
    if name == "location":
        for t in range(5, 15):  # each token is the argmax of the forward pass over the 8 before it
            assert out[0, t] == model(out[:, max(0, t - 8):t])[0][0, -1].argmax()
        with pytest.raises(ValueError, match="longer than block_size"):
            model(tokens(1, 9))
    assert out.shape == (1, 15)


@pytest.mark.parametrize("name", SCORES)
def test_padding_changes_nothing_for_the_real_tokens_under_every_score(name, tiny_model):
    """A left-padded decoder row counting its positions from 0, and a right-padded encoder row, give
    the logits of the row alone, whatever the padding holds."""
    model = trained_like(tiny_model(score=name))
    idx = tokens(2, 10)
    valid = torch.ones(2, 10, dtype=torch.bool)
    valid[0, :3] = False
    positions = (torch.arange(10) - torch.tensor([[3], [0]])).clamp(min=0)
    logits = model(idx, mask=valid, input_pos=positions)[0]
    torch.testing.assert_close(logits[0, 3:], model(idx[:1, 3:])[0][0], rtol=1e-5, atol=1e-5)
    encoder = trained_like(tiny_model(arch="encoder", score=name))
    valid = valid.flip(1)  # row 0 ends with three padding tokens
    repadded = idx.clone()
    repadded[0, -3:] = (repadded[0, -3:] + 7) % V
    a, b = encoder(idx, mask=valid)[0], encoder(repadded, mask=valid)[0]
    torch.testing.assert_close(a[0, :-3], b[0, :-3], rtol=0, atol=1e-6)
    torch.testing.assert_close(a[0, :-3], encoder(idx[:1, :-3])[0][0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", SCORES)
@pytest.mark.parametrize("arch", ["decoder", "encoder-decoder"])
def test_the_parameter_count_is_the_scaled_dot_products_plus_the_scores_shapes(name, arch, tiny_model):
    nh, hs, L = 4, 8, 32  # tiny_model's heads, head size and block_size
    per_layer = {"scaled_dot": 0, "dot": 0, "general": nh * hs * hs, "additive": 2 * nh * hs * hs + nh * hs,
                 "location": nh * L * hs}[name]
    attentions = 2 * (1 if arch == "decoder" else 3)  # 2 layers: self-attention; encoder, decoder and cross
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert count(tiny_model(arch=arch, score=name)) == count(tiny_model(arch=arch)) + attentions * per_layer
    shapes = {n: tuple(p.shape) for n, p in score_weights(ModelConfig(n_head=nh, n_embd=32, score=name,
                                                                       block_size=L)).items()}
    assert shapes == {"scaled_dot": {}, "dot": {}, "general": {"score_w": (nh, hs, hs)},
                      "additive": {"score_wq": (nh, hs, hs), "score_wk": (nh, hs, hs), "score_v": (nh, hs)},
                      "location": {"score_w": (nh, L, hs)}}[name]


def test_general_with_w_the_identity_is_dot_and_dot_is_scaled_dot_on_queries_times_root_hs(tiny_model):
    general, dot = tiny_model(score="general"), tiny_model(score="dot")
    assert all(torch.equal(w, torch.eye(8).expand(4, 8, 8)) for n, w in general.state_dict().items() if "score_w" in n)
    dot.load_state_dict({k: v for k, v in general.state_dict().items() if "score_w" not in k})
    idx = tokens(2, 10)
    torch.testing.assert_close(general(idx)[0], dot(idx)[0], rtol=0, atol=0)
    scaled = tiny_model()
    state = dot.state_dict()
    for i in range(2):  # the queries' rows of c_attn, times sqrt(hs): the scaled product of dot's scores
        for k in (f"decoder.h.{i}.attn.c_attn.weight", f"decoder.h.{i}.attn.c_attn.bias"):
            state[k] = torch.cat((state[k][:32] * math.sqrt(8), state[k][32:]))
    scaled.load_state_dict(state)
    torch.testing.assert_close(scaled(idx)[0], dot(idx)[0], rtol=1e-5, atol=1e-5)


def test_each_score_is_its_formula_written_as_a_loop_over_queries_and_keys():
    c = ModelConfig(n_head=2, n_embd=6, block_size=5)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 2, 3, 3, generator=g), torch.randn(1, 2, 4, 3, generator=g)
    for name in SCORES:
        layer = Attention(ModelConfig(n_head=2, n_embd=6, block_size=5, score=name))
        for p in layer.parameters():
            p.data = torch.randn(p.shape, generator=g)
        got = score(layer, torch.tensor([[0, 1, 2, 4]]), q, k)
        for h in range(2):
            for i in range(3):
                for j, pos in enumerate([0, 1, 2, 4]):
                    qi, kj = q[0, h, i], k[0, h, j]
                    want = {"scaled_dot": lambda: qi @ kj / math.sqrt(c.head_size), "dot": lambda: qi @ kj,
                            "general": lambda: qi @ layer.score_w[h] @ kj,
                            "additive": lambda: layer.score_v[h] @ torch.tanh(layer.score_wq[h] @ qi
                                                                              + layer.score_wk[h] @ kj),
                            "location": lambda: (layer.score_w[h] @ qi)[pos]}[name]()
                    torch.testing.assert_close(got[0, h, i, j], want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", OTHERS)
def test_a_score_takes_the_math_path_and_a_location_score_ignores_the_keys(name, monkeypatch, tiny_model):
    model = tiny_model(score=name, attn_impl="sdpa")
    seen = []
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", lambda *a, **k: seen.append(1))
    model(tokens(1, 6))
    assert not seen
    if name == "location":
        layer, q = model.decoder.h[0].attn, torch.randn(1, 4, 3, 8)
        torch.testing.assert_close(score(layer, None, q, torch.randn(1, 4, 5, 8)),
                                   score(layer, None, q, torch.randn(1, 4, 5, 8)))


@pytest.mark.parametrize("kw, words", [
    (dict(score="dot", attention="linear"), "not linear attention"),
    (dict(score="general", attn_impl="triton"), "Triton"),
    (dict(score="location", mem_len=4, pos="rope"), "no location score"),
    (dict(score="cosine"), "score='cosine' is not known"),
])
def test_a_score_with_what_it_cannot_go_with_is_refused_in_one_line(kw, words):
    with pytest.raises(ValueError, match=words) as refused:
        ModelConfig(**kw)
    assert "\n" not in str(refused.value)
