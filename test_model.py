"""Properties of model.py's forward pass, each checked over the family of configs it claims to hold:
causality, attention, padding, norms, positions, sizes, mixture of experts, learning, and the
config's refusals. Generation (the KV cache, sampling, speculative decoding) is in test_generate.py,
the Triton kernel in test_kernels.py. Every model is conftest's tiny_model (vocab 61, context 32,
2 layers, 4 heads of 8, width 32, eval mode), with the overrides a test names."""

import itertools
import math
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import kernels
import model as model_module
from generate import generate
from model import (ARCHS, POSITIONS, Mask, ModelConfig, Stack, Transformer, alibi_slopes, apply_rope, attention,
                   relative_bucket, rope, sinusoidal)

V = 61  # tiny_model's vocabulary: small, and not a power of two


# A covering matrix: every arch with every position scheme, the other options rotating through
# their values so that each appears with each arch (GQA/MQA, pre/post-norm, norms, MLPs, window).
FFNS = [dict(mlp="gelu", qk_norm=True, logit_softcap=15.0), dict(mlp="swiglu"),
        dict(mlp="relu", n_expert=4, expert_top_k=2), dict(mlp="geglu"), dict(mlp="relu2", n_expert=3, expert_top_k=1)]
MATRIX = []
for i, (arch, pos) in enumerate(itertools.product(ARCHS, POSITIONS)):
    window = 0 if arch == "prefix-lm" else [0, 3][i // 3 % 2]  # a prefix LM has none
    MATRIX.append(dict(arch=arch, pos=pos, n_kv_head=[4, 2, 1][i % 3], norm_first=i % 2 == 0,
                       norm=["layernorm", "rmsnorm"][i // 2 % 2], window=window, **FFNS[i % 5]))


def config_id(kw):
    return "-".join(str(v) for v in kw.values())


def inputs(arch, B=2, T=10, S=7, seed=1):
    """Tokens for the decoder (or the encoder), and a source for an encoder-decoder."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, V, (B, T), generator=g)
    src = torch.randint(0, V, (B, S), generator=g) if arch == "encoder-decoder" else None
    return idx, src


# ----------------------------------------------------------------------------------------------
# Causality

@pytest.mark.parametrize("kw", MATRIX, ids=config_id)
def test_decoder_logits_ignore_future_tokens_and_encoder_logits_do_not(kw, tiny_model):
    model = tiny_model(**kw)
    idx, src = inputs(kw["arch"])
    t = 4
    changed = idx.clone()
    changed[:, t + 1] = (changed[:, t + 1] + 1) % V  # change only the token right after t
    a, _ = model(idx, src=src)
    b, _ = model(changed, src=src)
    if kw["arch"] == "encoder":
        assert (a[:, t] - b[:, t]).abs().max() > 1e-5  # an encoder looks ahead
    else:
        torch.testing.assert_close(a[:, : t + 1], b[:, : t + 1], rtol=0, atol=1e-6)
        assert (a[:, t + 1] - b[:, t + 1]).abs().max() > 1e-5


@pytest.mark.parametrize("window", [1, 3])
def test_sliding_window_hides_keys_further_back_than_the_window(window, tiny_model):
    model = tiny_model(pos="none", window=window, n_layer=1)
    idx, _ = inputs("decoder")
    changed = idx.clone()
    changed[:, 2] = (changed[:, 2] + 1) % V
    a, _ = model(idx)
    b, _ = model(changed)
    torch.testing.assert_close(a[:, 2 + window:], b[:, 2 + window:], rtol=0, atol=1e-6)  # out of reach
    assert (a[:, 2 + window - 1] - b[:, 2 + window - 1]).abs().max() > 1e-5  # the last one in reach


# ----------------------------------------------------------------------------------------------
# Attention

def test_grouped_query_attention_is_multi_head_attention_with_key_value_heads_shared(tiny_model):
    # n_kv_head == n_head: exactly torch's multi-head attention
    mha = tiny_model(n_kv_head=4)
    ours, cfg = mha.decoder.h[0].attn, mha.config
    theirs = nn.MultiheadAttention(cfg.n_embd, cfg.n_head, batch_first=True)
    with torch.no_grad():
        theirs.in_proj_weight.copy_(ours.c_attn.weight)  # q, k, v rows one after another in both
        theirs.in_proj_bias.copy_(ours.c_attn.bias)
        theirs.out_proj.weight.copy_(ours.c_proj.weight)
        theirs.out_proj.bias.copy_(ours.c_proj.bias)
    x = torch.randn(3, 9, cfg.n_embd)
    future = torch.ones(9, 9, dtype=torch.bool).triu(1)
    torch.testing.assert_close(ours(x, Mask(causal=True)), theirs(x, x, x, attn_mask=future, need_weights=False)[0])
    # fewer key/value heads: multi-head attention whose heads repeat each key/value head
    gqa = tiny_model(n_kv_head=2)
    state = gqa.state_dict()
    for name, w in state.items():  # repeat each key/value head for the 2 query heads that share it
        if "c_attn" in name:  # rows: 4 query heads, then 2 key heads, then 2 value heads, of 8 each
            q, kv = w.split((32, 32))
            kv = kv.view(2, 2, 1, 8, -1).expand(2, 2, 2, 8, -1).reshape(-1, *w.shape[1:])
            w = torch.cat((q, kv))
        state[name] = w
    mha.load_state_dict(state)
    idx, _ = inputs("decoder")
    torch.testing.assert_close(gqa(idx)[0], mha(idx)[0])


def test_self_attention_projects_q_k_v_in_one_matrix_and_cross_attention_q_and_kv_in_two(tiny_model):
    state = tiny_model(arch="encoder-decoder", n_kv_head=2).state_dict()
    assert state["decoder.h.0.attn.c_attn.weight"].shape == (32 + 2 * 16, 32)  # q, then k and v of 2 heads
    assert "decoder.h.0.attn.c_q.weight" not in state
    assert state["decoder.h.0.cross_attn.c_q.weight"].shape == (32, 32)  # queries from the decoder
    assert state["decoder.h.0.cross_attn.c_kv.weight"].shape == (2 * 16, 32)  # keys, values from the encoder


@pytest.mark.parametrize("kw", [dict(pos="alibi", window=3), dict(pos="relative"), dict(arch="encoder", pos="rope")],
                         ids=config_id)
def test_math_path_equals_sdpa_and_hands_over_weights_that_sum_to_one(kw, tiny_model):
    idx, _ = inputs("decoder")
    fast = tiny_model(attn_impl="sdpa", n_kv_head=2, **kw)
    slow = tiny_model(attn_impl="math", n_kv_head=2, **kw)
    weights = {}
    torch.testing.assert_close(fast(idx)[0], slow(idx, weights=weights)[0], rtol=1e-5, atol=1e-5)
    [stack] = weights.values()  # one forward pass, one stack, a weight matrix per layer
    assert len(stack) == 2
    att = stack[1]
    assert att.shape == (2, 4, 10, 10)
    torch.testing.assert_close(att.sum(-1), torch.ones(2, 4, 10))
    if kw.get("arch") != "encoder":
        assert att.triu(1).abs().max() == 0  # no weight on the future


@pytest.mark.parametrize("impl", ["sdpa", "math", "triton"])
def test_attention_function_is_the_softmax_formula_with_a_bias_and_with_causal_queries_after_a_cache(impl):
    """With a dense bias (sdpa and math: the kernel takes no dense bias): softmax(q k^T / sqrt(d) +
    bias) v. Causal, with grouped heads: query i sees keys 0..i; the kernel also takes three new
    queries on seven keys, at positions 4, 5, 6: query i sees keys 0..4+i (SDPA's is_causal would
    let it see 0..i, so a KV cache, whose ring is in no order, always comes with a dense bias)."""
    if impl == "triton" and not kernels.available:
        pytest.skip("triton is not installed")
    torch.manual_seed(0)
    if impl != "triton":
        q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 4, 7, 8), torch.randn(2, 4, 7, 8)
        bias = torch.randn(2, 4, 5, 7)
        want = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(8) + bias, -1) @ v
        torch.testing.assert_close(attention(q, k, v, Mask(bias=bias, backend=impl))[0], want)
    Tq = 3 if impl == "triton" else 7
    q, k, v = torch.randn(2, 4, Tq, 8), torch.randn(2, 2, 7, 8), torch.randn(2, 2, 7, 8)
    future = torch.ones(Tq, 7, dtype=torch.bool).triu(8 - Tq)
    scores = q @ k.repeat_interleave(2, 1).transpose(-1, -2) / math.sqrt(8)
    want = torch.softmax(scores.masked_fill(future, float("-inf")), -1) @ v.repeat_interleave(2, 1)
    torch.testing.assert_close(attention(q, k, v, Mask(causal=True, backend=impl))[0], want)


def test_the_attention_path_is_picked_and_the_mask_built_once_per_stack_not_per_layer(monkeypatch, tiny_model):
    calls, pick, bias = [], model_module.attn_impl, model_module.Stack.attn_bias
    monkeypatch.setattr(model_module, "attn_impl", lambda *a: calls.append("pick") or pick(*a))
    monkeypatch.setattr(model_module.Stack, "attn_bias", lambda *a: calls.append("bias") or bias(*a))
    model = tiny_model(arch="encoder-decoder", pos="alibi", n_layer=3)
    idx, src = inputs("encoder-decoder")
    model(idx, src=src)
    # the encoder's mask, the decoder's, and its cross-attention's (no padding: no dense bias to build)
    assert calls == ["pick", "bias", "pick", "bias", "pick"]


# ----------------------------------------------------------------------------------------------
# Padding (a decoder's left-padded batches: test_generate.py; the kernel's key padding: test_kernels.py)

@pytest.mark.parametrize("arch", ["encoder", "encoder-decoder"])
def test_padding_of_an_encoders_input_or_a_source_changes_nothing_for_the_real_tokens(arch, tiny_model):
    """Whatever the padding holds, the real tokens' logits (an encoder's; an encoder-decoder's
    decoder, reading a padded source) are those of the sequence without padding at all."""
    model = tiny_model(arch=arch, pos="relative")
    idx, src = inputs(arch)
    valid = torch.ones(2, 10 if arch == "encoder" else 7, dtype=torch.bool)
    valid[0, -3:] = False  # row 0 ends with three padding tokens
    padded = (idx if arch == "encoder" else src).clone()
    repadded = padded.clone()
    repadded[0, -3:] = (repadded[0, -3:] + 7) % V  # whatever the padding holds
    if arch == "encoder":
        a, b = model(padded, mask=valid)[0], model(repadded, mask=valid)[0]
        torch.testing.assert_close(a[0, :-3], b[0, :-3], rtol=0, atol=1e-6)
        alone = model(padded[:1, :-3])[0]  # and the same as the sequence without padding at all
    else:
        a, b = model(idx, src=padded, src_mask=valid)[0], model(idx, src=repadded, src_mask=valid)[0]
        torch.testing.assert_close(a[0], b[0], rtol=0, atol=1e-6)
        alone = model(idx[:1], src=padded[:1, :-3])[0]
    torch.testing.assert_close(a[:1, : alone.size(1)], alone, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------
# Norms

@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
def test_post_norm_blocks_end_normalised_and_pre_norm_blocks_do_not(norm, tiny_model):
    x = torch.randn(2, 6, 32) * 3 + 1
    rms = [tiny_model(norm=norm, norm_first=first).decoder.h[0](x).pow(2).mean(-1) for first in (False, True)]
    torch.testing.assert_close(rms[0], torch.ones(2, 6), rtol=0, atol=1e-3)  # unit scale, then weight = 1
    assert (rms[1] - 1).abs().min() > 0.5  # the residual stream keeps its own scale


# ----------------------------------------------------------------------------------------------
# Positions

def test_rope_score_depends_only_on_the_offset():
    torch.manual_seed(0)
    q, k = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16)

    def score(m, n):
        cq, sq = rope(torch.tensor([[m]]), 16)
        ck, sk = rope(torch.tensor([[n]]), 16)
        return (apply_rope(q, cq, sq) * apply_rope(k, ck, sk)).sum().item()
    for offset in (0, 3, 17):
        scores = [score(n + offset, n) for n in (0, 5, 100, 1000)]
        # fp32 angles p * freq up to 1017 rad, each ~eps * p off (product, freq, cos/sin); a score moves |q||k| a radian
        assert max(scores) - min(scores) < 2 * 1017 * torch.finfo(torch.float32).eps * q.norm() * k.norm()
    assert abs(score(3, 0) - score(5, 0)) > 1e-3  # and it does depend on the offset


def test_rope_scaling_maps_position_p_to_p_over_the_factor():
    cos2, sin2 = rope(torch.tensor([[10]]), 16, scaling=2.0)
    cos1, sin1 = rope(torch.tensor([[5]]), 16)
    torch.testing.assert_close((cos2, sin2), (cos1, sin1))


def test_sinusoidal_position_plus_k_is_a_fixed_linear_map_of_position():
    dim, k = 32, 7
    omega = 1 / 10000 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)  # the paper's frequencies
    c, s = torch.cos(k * omega), torch.sin(k * omega)
    shift = torch.zeros(dim, dim, dtype=torch.float64)  # sin(a+b) = sin a cos b + cos a sin b, ...
    shift[0::2, 0::2], shift[0::2, 1::2] = torch.diag(c), torch.diag(s)
    shift[1::2, 0::2], shift[1::2, 1::2] = torch.diag(-s), torch.diag(c)
    pe = sinusoidal(torch.arange(1000), dim).double()
    # one matrix for every pos; fp32 angles up to 1000 rad, each ~eps * 1000 off (product, freq, sin/cos), both sides
    torch.testing.assert_close(pe[:-k] @ shift.T, pe[k:], rtol=0, atol=2 * 1000 * torch.finfo(torch.float32).eps)


@pytest.mark.parametrize("arch", ["encoder", "decoder"])
def test_alibi_and_relative_biases_are_the_papers_formulas(arch, tiny_model):
    T = 10
    i, j = torch.arange(T)[:, None], torch.arange(T)  # query, key
    visible = torch.ones(T, T, dtype=torch.bool) if arch == "encoder" else j <= i
    for pos in ("alibi", "relative"):
        model = tiny_model(arch=arch, pos=pos)
        stack = model.encoder if arch == "encoder" else model.decoder
        bias = stack.attn_bias(j[None], j[None], j, 0)[0]  # queries and keys at 0..T-1 -> (nh, T, T)
        if pos == "alibi":  # -slope_h * |i - j|, in both directions for an encoder
            expected = -torch.tensor(alibi_slopes(4))[:, None, None] * (i - j).abs()
        else:  # T5: a learned scalar per head for the bucket of (key - query)
            expected = stack.rel.weight[relative_bucket(j - i, arch == "encoder", 32, 128)].permute(2, 0, 1)
        torch.testing.assert_close(bias[:, visible], expected[:, visible])
        assert (bias[:, ~visible] == float("-inf")).all()


def test_rope_theta_and_scaling_reach_the_rotation(monkeypatch, tiny_model):
    cos, sin = rope(torch.tensor([[1]]), 16, theta=5e5)
    omega = 5e5 ** (-torch.arange(0, 16, 2) / 16)  # Llama 3's base: slower turning channels
    torch.testing.assert_close((cos.flatten(), sin.flatten()), (omega.cos(), omega.sin()))
    seen, original = [], model_module.rope
    monkeypatch.setattr(model_module, "rope", lambda pos, hs, theta, scaling: seen.append((theta, scaling))
                        or original(pos, hs, theta, scaling))
    tiny_model(pos="rope", rope_theta=5e5, rope_scaling=2.0)(torch.zeros(1, 4, dtype=torch.long))
    assert seen == [(5e5, 2.0)]


@pytest.mark.parametrize("pos", ["learned", "sinusoidal", "rope"])
def test_the_first_block_reads_tokens_plus_absolute_positions(pos, tiny_model):
    model, idx = tiny_model(pos=pos), torch.randint(0, V, (2, 9))
    seen = []
    model.decoder.h[0].register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    model(idx)
    expected, at = model.wte(idx), torch.arange(9)  # RoPE: the tokens alone (it rotates queries and keys)
    if pos == "learned":  # GPT-2
        expected = expected + model.decoder.wpe(at)
    if pos == "sinusoidal":  # Vaswani et al. scale the tokens up so that the sines do not drown them
        expected = expected * math.sqrt(32) + sinusoidal(at, 32)
    torch.testing.assert_close(seen[0], expected)


def test_alibi_slopes_for_8_heads_are_a_half_to_one_over_256():
    assert alibi_slopes(8) == [1 / 2 ** i for i in range(1, 9)]
    six = alibi_slopes(6)  # not a power of two: 4 heads' slopes, then odd ones of 8 heads'
    assert six == [1 / 4, 1 / 16, 1 / 64, 1 / 256, 1 / 2, 1 / 8]


def test_relative_buckets_are_exact_near_and_logarithmic_far():
    offsets = torch.arange(-300, 301)
    both = relative_bucket(offsets, True, 32, 128)
    assert torch.equal(both[293:301].flip(0), torch.arange(8))  # offsets 0, -1, ..., -7: one bucket each
    assert torch.equal(both[301:308], torch.arange(17, 24))  # offsets +1..+7: the other half
    assert both.max() == 31 and both.min() == 0
    assert torch.equal(both[: 300 - 128], torch.full((172,), 15))  # far past: one bucket
    assert (both[:301].flip(0).diff() >= 0).all()  # grows with distance
    causal = relative_bucket(offsets, False, 32, 128)
    assert (causal[301:] == 0).all() and torch.equal(causal[285:301].flip(0), torch.arange(16))


# ----------------------------------------------------------------------------------------------
# Sizes

def test_gpt2_124m_has_124439808_parameters():
    cfg = ModelConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768, pos="learned",
                      norm="layernorm", mlp="gelu", bias=True, tie_embeddings=True)
    with torch.device("meta"):
        model = Transformer(cfg)
    assert sum(p.numel() for p in model.parameters()) == 124_439_808


@pytest.mark.parametrize("d", [64, 96, 768])
def test_a_block_with_biases_and_layernorm_has_12_d_squared_plus_13_d(d):
    with torch.device("meta"):
        block = Transformer(ModelConfig(n_embd=d, n_head=4, n_layer=1)).decoder.h[0]
    assert sum(p.numel() for p in block.parameters()) == 12 * d * d + 13 * d


@pytest.mark.parametrize("tie", [True, False])
def test_flops_per_token_are_6_per_weight_and_output_weight_plus_12_l_h_hs_t_for_attention(tie, tiny_model):
    C, L, T = 32, 2, 10
    n = L * (12 * C * C + 2 * C) + C + V * C  # blocks (qkv, proj, fc, proj; two gains), ln_f, the output layer
    model = tiny_model(pos="rope", bias=False, tie_embeddings=tie)  # no position table, no biases
    assert model.flops_per_token(T) == 6 * n + 12 * L * 4 * 8 * T  # 4 heads of 8; the output counted once
    encoder = tiny_model(arch="encoder", pos="rope", bias=False, tie_embeddings=tie)  # its MLM head's C x C counts
    assert encoder.flops_per_token(T) == 6 * (n + C * C + C) + 12 * L * 4 * 8 * T  # (and the head's norm gain)


def test_swiglu_default_hidden_keeps_the_parameter_count_of_a_plain_mlp():
    with torch.device("meta"):
        gelu = Transformer(ModelConfig(n_embd=768, bias=False, mlp="gelu")).decoder.h[0].mlp
        swiglu = Transformer(ModelConfig(n_embd=768, bias=False, mlp="swiglu")).decoder.h[0].mlp
    n = [sum(p.numel() for p in m.parameters()) for m in (gelu, swiglu)]
    assert swiglu.c_proj.in_features == 2048 and n[0] == n[1]


@pytest.mark.parametrize("mlp", ["gelu", "geglu"])
def test_gelu_approximate_picks_gpt2s_tanh_form_or_the_exact_erf_form(mlp, tiny_model):
    x = torch.randn(2, 5, 32) * 30  # pre-activations of order 1, where the two forms differ most
    out = {}
    for form in ("tanh", "none"):
        ffn = tiny_model(mlp=mlp, gelu_approximate=form).decoder.h[0].mlp
        h = ffn.c_fc(x)
        gate = h if mlp == "gelu" else h.chunk(2, -1)[1]
        cdf = (1 + torch.erf(gate / math.sqrt(2))) / 2 if form == "none" else \
            (1 + torch.tanh(math.sqrt(2 / math.pi) * (gate + 0.044715 * gate ** 3))) / 2
        act = gate * cdf if mlp == "gelu" else h.chunk(2, -1)[0] * gate * cdf
        out[form] = ffn(x)
        torch.testing.assert_close(out[form], ffn.c_proj(act))
    assert (out["tanh"] - out["none"]).abs().max() > 1e-5  # the two forms really differ


def test_residual_projections_start_smaller_by_the_root_of_the_number_of_branches(tiny_model):
    model = tiny_model(arch="encoder-decoder", n_layer=8, n_embd=256, n_head=4)  # enough weights for their std
    std = lambda p: p.std().item()  # noqa: E731
    assert abs(std(model.decoder.h[0].attn.c_attn.weight) - 0.02) < 0.002
    assert abs(std(model.encoder.h[0].attn.c_proj.weight) - 0.02 / math.sqrt(2 * 8)) < 2e-4  # attention, MLP
    for branch in (model.decoder.h[0].attn, model.decoder.h[0].cross_attn, model.decoder.h[0].mlp):
        assert abs(std(branch.c_proj.weight) - 0.02 / math.sqrt(3 * 8)) < 2e-4  # and cross-attention


# ----------------------------------------------------------------------------------------------
# Mixture of experts

def test_moe_output_is_the_gate_weighted_sum_of_the_chosen_experts(tiny_model):
    moe = tiny_model(n_expert=4, expert_top_k=2).decoder.h[0].mlp
    x = torch.randn(2, 5, 32)
    probs = moe.router(x).softmax(-1)
    w, e = probs.topk(2, dim=-1)
    w = w / w.sum(-1, keepdim=True)
    want = torch.zeros_like(x)
    for b, t, j in itertools.product(range(2), range(5), range(2)):
        want[b, t] += w[b, t, j] * moe.experts[e[b, t, j]](x[b, t])
    torch.testing.assert_close(moe(x), want)


def test_moe_balance_loss_is_switchs_formula_and_trains_the_router(tiny_model):
    moe = tiny_model(n_expert=4, expert_top_k=2).decoder.h[0].mlp
    x = torch.randn(1, 8, 32)
    moe(x)
    probs = moe.router(x.view(8, 32)).softmax(-1)  # (N, E)
    chosen = F.one_hot(probs.topk(2).indices, 4).sum(1).float()  # (N, E): 1 where a token goes
    share = chosen.mean(0) / 2  # the fraction of the 8 x 2 assignments each expert receives
    torch.testing.assert_close(moe.aux_loss, 4 * (share * probs.mean(0)).sum())
    moe.aux_loss.backward()  # through the mean probabilities: the router learns to balance
    assert moe.router.weight.grad.abs().sum() > 0


def test_moe_balance_loss_is_one_when_routing_is_uniform_and_is_added_to_the_loss(tiny_model):
    model = tiny_model(n_expert=4, expert_top_k=1, moe_aux_weight=0.5)
    moe = model.decoder.h[0].mlp
    nn.init.zeros_(moe.router.weight)  # every expert equally likely...
    x = torch.randn(1, 8, 32)
    moe(x)
    # ...and topk picks expert 0 for all: share (1, 0, 0, 0) . probs (1/4 each) * 4 = 1
    assert abs(moe.aux_loss.item() - 1.0) < 1e-6
    idx, _ = inputs("decoder")
    logits, loss = model(idx, idx)
    ce = F.cross_entropy(logits.view(-1, V), idx.view(-1))
    aux = sum(b.mlp.aux_loss for b in model.decoder.h)
    torch.testing.assert_close(loss, ce + 0.5 * aux)


# ----------------------------------------------------------------------------------------------
# Learning

def task(arch, n=8, T=12, seed=0):
    """A fixed batch for each architecture: next-token, masked-token, or copy-the-source."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(1, V - 1, (n, T), generator=g)
    if arch == "decoder":
        return dict(idx=x[:, :-1], targets=x[:, 1:])
    if arch == "encoder":
        masked = torch.rand(n, T, generator=g) < 0.3
        return dict(idx=x.masked_fill(masked, V - 1), targets=x.masked_fill(~masked, -100))
    start = torch.zeros(n, 1, dtype=torch.long)  # token 0 starts the decoder
    return dict(src=x, idx=torch.cat((start, x[:, :-1]), 1), targets=x)


def test_optimizer_groups_partition_the_trainable_parameters_and_decay_exactly_the_matrices(tiny_model):
    model = tiny_model(arch="encoder-decoder", pos="relative")
    model.decoder.ln_f.weight.requires_grad_(False)  # frozen: in neither group
    decay, no_decay = model.optimizer_groups(0.1)
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.1, 0.0)
    grouped = [id(p) for group in (decay, no_decay) for p in group["params"]]
    assert len(grouped) == len(set(grouped))  # no parameter twice (the tied output layer included)
    assert set(grouped) == {id(p) for p in model.parameters() if p.requires_grad}
    matrices = {id(m.weight) for m in model.modules() if isinstance(m, (nn.Linear, nn.Embedding))}
    assert {id(p) for p in decay["params"]} == matrices  # Linear and Embedding weights, the T5 bias table too
    torch.optim.AdamW(model.optimizer_groups(0.1), lr=1e-3)  # what AdamW takes


@pytest.mark.parametrize("kw", [MATRIX[i] for i in (0, 4, 8, 9, 13, 14, 15)], ids=config_id)
def test_each_architecture_drives_the_loss_on_a_fixed_batch_below_0_1(kw, tiny_model):
    model = tiny_model(n_embd=64, **kw).train()  # width 64: at 32 some of these learn the batch slowly
    batch = task(kw["arch"])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    for step in range(300):
        logits, loss = model(**batch)
        if loss.item() < 0.05:
            break
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.1, f"loss {loss.item():.3f} after {step} steps"


# ----------------------------------------------------------------------------------------------
# Bad configs

@pytest.mark.parametrize("kw, message", [
    (dict(n_embd=30, n_head=4), "n_embd=30 is not divisible by n_head=4"),
    (dict(n_head=6, n_kv_head=4, n_embd=36), r"n_kv_head among \[1, 2, 3, 6\]"),
    (dict(pos="rope", n_embd=36, n_head=4), "head_size=9 must be even"),
    (dict(pos="rotary"), "pos='rotary' is not known: choose one of 'learned'"),
    (dict(arch="gpt"), "'decoder', 'encoder', 'encoder-decoder'"),
    (dict(norm="batchnorm"), "'layernorm', 'rmsnorm'"),
    (dict(mlp="tanh"), "'swiglu'"),
    (dict(gelu_approximate="erf"), "gelu_approximate='erf' is not known: choose one of 'tanh', 'none'"),
    (dict(attn_impl="flash"), "'math'"),
    (dict(n_expert=2, expert_top_k=3), "expert_top_k=3 must lie between 1 and n_expert=2"),
    (dict(window=-1), "window=-1"),
    (dict(dropout=1.5), r"dropout=1.5 must lie in \[0, 1\)"),
    (dict(n_layer=0), "n_layer=0 must be a positive integer"),
    (dict(head_size=-4), "head_size=-4 must be a positive integer"),
    (dict(mlp_hidden=0), "mlp_hidden=0 must be a positive integer"),
    (dict(pos="relative", rel_buckets=2), "rel_buckets=2, rel_max_distance=128: need at least 4 buckets"),
    (dict(pos="relative", rel_buckets=32, rel_max_distance=16), "rel_max_distance above rel_buckets / 2"),
    (dict(attn_impl="triton", pos="relative"), "no T5 relative bias: use attn_impl='auto' or 'sdpa'"),
    (dict(attn_impl="triton", n_embd=512, n_head=2), "heads of at most 128, not head_size=256"),
    (dict(attn_impl="triton", dropout=0.1), "does not drop attention weights: set dropout=0"),
])
def test_bad_configs_raise_value_error_saying_what_to_change(kw, message, tiny_model):
    with pytest.raises(ValueError, match=message):
        tiny_model(**kw)  # refused by ModelConfig, before any weight is made


def test_learned_positions_refuse_sequences_longer_than_block_size(tiny_model):
    with pytest.raises(ValueError, match="longer than block_size=32"):
        tiny_model()(torch.zeros(1, 33, dtype=torch.long))
    t5, long_src = tiny_model(arch="encoder-decoder"), torch.zeros(1, 33, dtype=torch.long)
    with pytest.raises(ValueError, match="longer than block_size=32"):  # the source, too
        t5(torch.zeros(1, 3, dtype=torch.long), src=long_src)
    with pytest.raises(ValueError, match="longer than block_size=32"):
        generate(t5, long_src[:, :1], 2, src=long_src)


# ----------------------------------------------------------------------------------------------
# The modern recipe's options: QK-norm, ReLU², logit soft-capping, zero-initialised projections

@pytest.mark.parametrize("arch", ["decoder", "encoder-decoder"])
def test_qk_norm_makes_attention_blind_to_the_scale_of_queries_and_keys(arch, tiny_model):
    idx, src = inputs(arch)
    for qk_norm in (True, False):
        model = tiny_model(arch=arch, pos="rope", qk_norm=qk_norm)
        before = model(idx, src=src)[0]
        with torch.no_grad():  # queries and keys 7 times longer: their weights' and biases' rows
            for m in (m for m in model.modules() if isinstance(m, model_module.Attention)):
                for layer, rows in ((m.c_q, slice(None)), (m.c_kv, slice(0, 32))) if m.cross else ((m.c_attn, slice(0, 64)),):
                    layer.weight[rows] *= 7
                    layer.bias[rows] *= 7
        after = model(idx, src=src)[0]
        assert torch.allclose(after, before, atol=1e-4) == qk_norm


def test_relu2_is_relu_squared_between_the_two_layers(tiny_model):
    mlp = tiny_model(mlp="relu2").decoder.h[0].mlp
    x = torch.randn(2, 5, 32)
    want = F.relu(x @ mlp.c_fc.weight.T + mlp.c_fc.bias).square() @ mlp.c_proj.weight.T + mlp.c_proj.bias
    torch.testing.assert_close(mlp(x), want)
    assert mlp.c_fc.weight.shape == tiny_model(mlp="gelu").decoder.h[0].mlp.c_fc.weight.shape


@pytest.mark.parametrize("arch", ARCHS)
def test_logit_softcap_bounds_the_logits_by_c_tanh(arch, tiny_model):
    idx, src = inputs(arch)
    capped, plain = tiny_model(arch=arch, logit_softcap=0.1), tiny_model(arch=arch)  # the same seed: the same weights
    raw = plain(idx, src=src)[0]
    torch.testing.assert_close(capped(idx, src=src)[0], 0.1 * torch.tanh(raw / 0.1))
    assert capped(idx, src=src)[0].abs().max() < 0.1 < raw.abs().max()


def test_zero_init_starts_each_residual_branch_and_an_untied_head_at_zero(tiny_model):
    untied = tiny_model(arch="encoder-decoder", pos="relative", zero_init=True, tie_embeddings=False)
    projections = [p for n, p in untied.named_parameters() if n.endswith("c_proj.weight")]
    assert len(projections) == 2 * 2 + 3 * 2 and all((p == 0).all() for p in projections)  # encoder 2, decoder 3 per layer
    idx, src = inputs("encoder-decoder")
    logits, loss = untied(idx, idx, src=src)
    assert (logits == 0).all() and loss.item() == pytest.approx(math.log(V))  # uniform at the start
    tied = tiny_model(zero_init=True)  # a tied head is the embedding table: it keeps its initialisation
    assert tied.lm_head.weight.std().item() == pytest.approx(0.02, rel=0.1)


# ----------------------------------------------------------------------------------------------
# Transformer-XL's memory: segment-level recurrence

def xl_reference(model, idx, L, M):
    """One forward pass over the whole of idx (B, N) under Transformer-XL's mask, where position i
    sees the keys j <= i with j >= (i // L) L - M: its segment up to itself and M positions before."""
    N, stack = idx.size(1), model.decoder
    pos = torch.arange(N)[None]
    i, j = pos[0, :, None], pos[0, None, :]
    allowed = (j <= i) & (j >= (i // L) * L - M)
    bias = stack.attn_bias(pos, pos, torch.arange(N), 0).masked_fill(~allowed, float("-inf"))
    cos_sin = rope(pos, model.config.head_size) if model.config.pos == "rope" else None
    x = model.wte(idx)
    for block in stack.h:
        x = block(x, Mask(True, bias=bias, backend="math"), cos_sin)
    return model.lm_head(stack.ln_f(x))


@pytest.mark.parametrize("pos, L, M", [("rope", 8, 8), ("alibi", 8, 5), ("relative", 6, 12), ("none", 8, 8)])
def test_segments_with_memory_are_one_pass_under_transformer_xls_mask(pos, L, M, tiny_model):
    model = tiny_model(pos=pos, mem_len=M, n_kv_head=2)
    idx = torch.randint(0, V, (2, 4 * L), generator=torch.Generator().manual_seed(0))
    want, mems, got = xl_reference(model, idx, L, M), None, []
    for s in range(4):
        logits, _, mems = model(idx[:, s * L:(s + 1) * L], mems=mems, return_mems=True)
        got.append(logits)
        assert len(mems) == 2 and mems[0].shape == (2, min(M, (s + 1) * L), 32) and not mems[0].requires_grad
    torch.testing.assert_close(torch.cat(got, 1), want, rtol=1e-5, atol=1e-5)
    if M >= L:  # the second segment sees all of the first: the last L positions of a plain pass over both
        plain = model(idx[:, :2 * L])[0][:, L:]
        second = model(idx[:, L:2 * L], mems=model(idx[:, :L], return_mems=True)[2])[0]
        torch.testing.assert_close(second, plain, rtol=1e-5, atol=1e-5)


def test_the_loss_on_a_segment_gives_the_memorys_tokens_no_gradient(tiny_model):
    """The memory is detached: the loss on segment 2 reaches segment 1's embeddings through nothing
    (they get no gradient), while it does depend on them (without the memory it differs)."""
    model = tiny_model(pos="rope", mem_len=8).train()
    idx = torch.randint(0, V, (1, 16), generator=torch.Generator().manual_seed(0))
    embedded = []

    def keep(module, args, out):  # each segment's embeddings, with the gradient they get
        out.retain_grad()
        embedded.append(out)
    model.wte.register_forward_hook(keep)
    _, _, mems = model(idx[:, :8], return_mems=True)
    _, loss = model(idx[:, 8:], idx[:, 8:], mems=mems)
    loss.backward()
    assert embedded[0].grad is None and embedded[1].grad.abs().sum() > 0
    assert all(not m.requires_grad for m in mems)
    assert not torch.isclose(loss, model(idx[:, 8:], idx[:, 8:])[1])  # the memory is seen


@pytest.mark.parametrize("kw, words", [(dict(arch="encoder"), "for decoders"), (dict(pos="learned"), "restart at 0"),
                                       (dict(mem_len=-1), "must be 0 (off) or positive")])
def test_a_memory_is_refused_where_it_cannot_be(kw, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        ModelConfig(**dict(mem_len=8, pos="rope") | kw)


# ----------------------------------------------------------------------------------------------
# The prefix LM: a prefix read both ways, the rest causally

PREFIX_POSITIONS = ["rope", "relative"]  # relative: T5's two-way buckets inside the prefix, causal ones after it


@pytest.mark.parametrize("pos", PREFIX_POSITIONS)
def test_a_prefix_lm_reads_its_prefix_both_ways_and_the_rest_causally(pos, tiny_model):
    """Per row P: logits at t >= P - 1 ignore every later token (the first suffix token is predicted
    at P - 1, which sees the whole prefix); logits before P - 1 do see later prefix tokens."""
    model = tiny_model(arch="prefix-lm", pos=pos)
    idx = torch.randint(0, V, (2, 20), generator=torch.Generator().manual_seed(0))
    P = torch.tensor([6, 13])
    logits = model(idx, prefix_len=P)[0]
    for t in range(19):
        later = idx.clone()
        later[:, t + 1:] = (later[:, t + 1:] + 7) % V
        changed = (model(later, prefix_len=P)[0] - logits).abs().amax(-1)  # (B, T)
        for b in range(2):
            if t >= P[b] - 1:
                assert changed[b, :t + 1].max() == 0  # a later token moves nothing at or before t
            else:  # t inside the prefix, before its end: the prefix's later tokens are seen
                assert changed[b, t] > 1e-4


@pytest.mark.parametrize("pos", PREFIX_POSITIONS)
def test_a_whole_sequence_prefix_is_an_encoder(pos, tiny_model):
    """P = T: every position sees every other, the decoder stack computes what an encoder stack of the
    same weights does (T5's relative bias included: keys ahead take the encoder's buckets)."""
    model = tiny_model(arch="prefix-lm", pos=pos)
    encoder = Stack(model.config, causal=False)
    encoder.load_state_dict(model.decoder.state_dict())
    encoder.eval()
    x, at = torch.randn(2, 12, model.config.n_embd), torch.arange(12)[None]  # (B, T, C) and positions (1, T)
    torch.testing.assert_close(model.decoder(x, at, prefix=torch.full((2,), 12)), encoder(x, at), rtol=0, atol=0)


@pytest.mark.parametrize("pos", PREFIX_POSITIONS)
def test_a_prefix_of_one_is_a_plain_decoder_and_the_loss_counts_the_suffix_only(pos, tiny_model):
    prefix_lm, decoder = tiny_model(arch="prefix-lm", pos=pos), tiny_model(pos=pos)
    decoder.load_state_dict(prefix_lm.state_dict())  # the same parameters: the mask is all that differs
    idx = torch.randint(0, V, (2, 12))
    for P in (0, 1):
        torch.testing.assert_close(prefix_lm(idx, prefix_len=torch.full((2,), P))[0], decoder(idx)[0], rtol=0, atol=0)
    targets = torch.randint(0, V, (2, 12))
    P = torch.tensor([4, 9])  # no -100 in the prefix's targets: the model leaves them out itself
    logits, loss = prefix_lm(idx, targets, prefix_len=P)
    counted = [logits[b, P[b] - 1:] for b in range(2)], [targets[b, P[b] - 1:] for b in range(2)]
    want = F.cross_entropy(torch.cat(counted[0]), torch.cat(counted[1]))
    torch.testing.assert_close(loss, want)


def test_a_prefix_lm_takes_no_loss_on_the_targets_its_prefix_sees(tiny_model):
    """Per row P: the target at t < P - 1 is the prefix's next token, which position t sees, so changing
    it changes no loss; changing the one at P - 1 (the first suffix token, unseen), P or T - 1 changes
    the loss by that term's change over the n targets counted."""
    model = tiny_model(arch="prefix-lm", pos="rope")
    g = torch.Generator().manual_seed(0)
    idx, targets = torch.randint(0, V, (2, 12), generator=g), torch.randint(0, V, (2, 12), generator=g)
    P = torch.tensor([4, 9])
    logits, loss = model(idx, targets, prefix_len=P)
    logp = F.log_softmax(logits.double(), -1)
    n = (12 - (P - 1)).sum().item()
    # two float32 means of n terms near log V: each of the n partial sums rounds by at most an ulp of n log V
    tol = 2 * n * torch.finfo(torch.float32).eps * 2 * math.log(V)
    for b in range(2):
        for t in [*range(P[b] - 1), P[b] - 1, P[b], 11]:
            changed = targets.clone()  # to the least likely token (the likeliest if it is that already)
            changed[b, t] = logp[b, t].argmin() if logp[b, t].argmin() != targets[b, t] else logp[b, t].argmax()
            delta = model(idx, changed, prefix_len=P)[1] - loss
            if t < P[b] - 1:
                assert delta == 0
            else:
                want = (logp[b, t, targets[b, t]] - logp[b, t, changed[b, t]]) / n
                assert abs(want) > 10 * tol
                torch.testing.assert_close(delta.double(), want, rtol=0, atol=tol)


@pytest.mark.parametrize("kw, words", [(dict(arch="prefix-lm", window=4), "no window"),
                                       (dict(arch="prefix-lm", attention="performer"), "with softmax attention"),
                                       (dict(feature_redraw=10), "feature_redraw draws a performer's")])
def test_settings_a_prefix_lm_or_the_performer_cannot_take_are_refused(kw, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        ModelConfig(**kw)


def test_a_forward_pass_refuses_what_its_model_does_not_take(tiny_model):
    idx = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="prefix_len is a prefix LM's"):
        tiny_model()(idx, prefix_len=torch.tensor([2]))
    with pytest.raises(ValueError, match="mems need a model with mem_len"):
        tiny_model()(idx, mems=[torch.zeros(1, 4, 32)] * 2)
    xl = tiny_model(pos="rope", mem_len=4)
    with pytest.raises(ValueError, match="a memory takes no padding"):
        xl(idx, mems=xl(idx, return_mems=True)[2], mask=torch.ones(1, 4, dtype=torch.bool))


# ----------------------------------------------------------------------------------------------
# Images: ViT's patches, [CLS] and classification head

VIT = dict(arch="encoder", patch_size=4, image_size=8, channels=3, n_classes=5, block_size=8)


def test_a_vit_embeds_patches_as_a_conv2d_of_stride_p_prepends_cls_and_classifies_its_final_state(tiny_model):
    model = tiny_model(**VIT)
    images, labels = torch.randn(2, 3, 8, 8), torch.tensor([1, 4])
    conv = F.conv2d(images, model.wte.weight.view(32, 3, 4, 4), model.wte.bias, stride=4)  # (B, C, 2, 2)
    captured = {}
    model.encoder.register_forward_hook(lambda m, args, out: captured.update(x=args[0], out=out))
    logits, loss = model(images, labels)
    torch.testing.assert_close(captured["x"][:, 1:], conv.flatten(2).transpose(1, 2), rtol=1e-5, atol=1e-6)
    assert torch.equal(captured["x"][:, 0], model.cls[0].expand(2, -1))  # [CLS] first, then 4 patches in raster order
    torch.testing.assert_close(logits, model.lm_head(captured["out"][:, 0]))
    torch.testing.assert_close(loss, F.cross_entropy(logits, labels))
    assert logits.shape == (2, 5) and model.mlm_head is None


@pytest.mark.parametrize("kw", [dict(), dict(pos="rope", norm="rmsnorm", mlp="swiglu"), dict(attention="linear")])
def test_a_vit_learns_a_fixed_batch_of_images_with_each_encoders_choices(kw, tiny_model):
    torch.manual_seed(0)
    model = tiny_model(**VIT, **kw).train()
    images, labels = torch.randn(16, 3, 8, 8), torch.randint(0, 5, (16,))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(60):
        loss = model(images, labels)[1]
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.1
    assert (model.eval()(images)[0].argmax(-1) == labels).all()


@pytest.mark.parametrize("kw", [dict(arch="decoder"), dict(arch="encoder-decoder"), dict(n_classes=0),
                                dict(image_size=10), dict(block_size=4), dict(patch_size=0)])
def test_a_vit_is_an_encoder_with_classes_of_whole_patches_or_refused_in_one_line(kw):
    with pytest.raises(ValueError, match="a ViT .* is an encoder") as refused:
        ModelConfig(**(VIT | kw))
    assert "\n" not in str(refused.value)


def test_a_vit_refuses_images_of_another_shape_and_token_ids(tiny_model):
    model = tiny_model(**VIT)
    for wrong in (torch.randn(2, 1, 8, 8), torch.randn(2, 3, 16, 16), torch.zeros(2, 10, dtype=torch.long)):
        with pytest.raises(ValueError, match=r"not \(B, channels=3, 8, 8\)"):
            model(wrong)
