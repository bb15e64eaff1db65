"""generate.py: decoding through model.py's KV cache equals recomputing everything, within and
past block_size; left-padded batches; decoding without host syncs, compiled; sampling; and
speculative decoding. Every model is conftest's tiny_model (vocab 61, context 32, 2 layers, 4 heads
of 8, width 32, eval mode), with the overrides a test names."""

import dataclasses
import itertools
import shutil

import pytest
import torch
import torch._dynamo.testing

import generate as generate_module
import model as model_module
from generate import (absolute_positions, accept_or_resample, cache_size, decode, generate, prefill,
                      speculative_generate)
from model import POSITIONS, KVCache, Transformer
from sampling import sample

V = 61  # tiny_model's vocabulary


def config_id(kw):
    return "-".join(str(v) for v in kw.values())


def prompt(T, B=1, seed=1):
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


def source(arch, B, S=7, seed=2):
    """An encoder-decoder's source; None for a decoder."""
    return prompt(S, B, seed) if arch == "encoder-decoder" else None


def greedy_without_cache(model, idx, steps, src=None, temperature=0.0):
    """The reference: every step runs the whole sequence again. A model sees at most block_size
    tokens: with absolute positions the last block_size (as nanoGPT crops); with relative ones
    every query attends to its last block_size keys (a sliding window, as generate's cache does)."""
    c = model.config
    if absolute_positions(model.config):
        crop = slice(-c.block_size, None)
    else:
        windowed = Transformer(dataclasses.replace(c, window=min(c.window or c.block_size, c.block_size))).eval()
        windowed.load_state_dict(model.state_dict())
        model, crop = windowed, slice(None)
    logits = []
    for _ in range(steps):
        step = model(idx[:, crop], src=src)[0][:, -1]
        logits.append(step)
        idx = torch.cat((idx, sample(step, temperature)), dim=1)
    return idx, torch.stack(logits, 1)


def greedy_with_cache(model, idx, steps, src=None):
    """The same, one token at a time through the cache, as generate() does (within block_size)."""
    memory = None
    if src is not None:
        memory = model.encoder(model.wte(src), torch.arange(src.size(1))[None])
    model.setup_kv_cache(idx.size(0), cache_size(model, idx.size(1), steps), memory)
    logits = prefill(model, idx, torch.arange(idx.size(1)))[:, None]
    for i in range(steps - 1):
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        idx = torch.cat((idx, nxt), dim=1)
        logits = torch.cat((logits, model(nxt, input_pos=torch.tensor([idx.size(1) - 1]))[0]), dim=1)
    model.clear_kv_cache()
    return logits


def sharp(model):
    """The model with its matrices scaled up 8 times: peaked predictions that depend on the context,
    unlike a freshly initialised model's, whose greedy output soon repeats one token (and any draft
    agrees)."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(8)
    return model


def noisy_copy(model, scale, seed=7):
    """A draft that agrees with the target only some of the time."""
    torch.manual_seed(seed)
    draft = Transformer(model.config).eval()
    with torch.no_grad():
        for p, q in zip(draft.parameters(), model.parameters()):
            p.copy_(q + scale * q.abs().mean() * torch.randn_like(q))
    return draft


# ----------------------------------------------------------------------------------------------
# The KV cache

# Every arch that generates with every position scheme, each with and without a window; the key/value
# heads (MHA, GQA, MQA) rotate so that each meets each position scheme and each window, with each arch.
CACHE_CASES = [dict(arch=a, pos=p, n_kv_head=[4, 2, 1][(i + j + w // 3) % 3], window=w)
               for i, a in enumerate(("decoder", "encoder-decoder")) for j, p in enumerate(POSITIONS) for w in (0, 3)]
CACHE_CASES += [dict(arch=a, pos="rope", n_kv_head=2, window=0, qk_norm=True, mlp="relu2", logit_softcap=15.0)
                for a in ("decoder", "encoder-decoder")]  # the modern recipe's options: keys normalised before caching


@pytest.fixture(params=[("cpu",), ()], ids=["slots-in-use", "every-slot"])
def slots(request, monkeypatch):
    """The tests that take it run twice: reading the cache's slots in use only (as on a CPU) and every
    slot (as on a GPU): generate.SLOTS_IN_USE_ON."""
    monkeypatch.setattr(generate_module, "SLOTS_IN_USE_ON", request.param)


@pytest.mark.usefixtures("slots")
@pytest.mark.parametrize("kw", CACHE_CASES, ids=config_id)
def test_cached_decoding_equals_recomputing_everything(kw, tiny_model):
    model = tiny_model(**kw)
    idx, src = prompt(5, B=2), source(kw["arch"], B=2)
    ref_tokens, ref_logits = greedy_without_cache(model, idx, 12, src)
    torch.testing.assert_close(greedy_with_cache(model, idx, 12, src), ref_logits, rtol=0, atol=1e-5)
    assert torch.equal(generate(model, idx, 12, temperature=0, src=src), ref_tokens)


@pytest.mark.usefixtures("slots")
@pytest.mark.parametrize("T", [5, 50], ids=["prompt5", "prompt50"])  # 50: longer than block_size, 6 times over
@pytest.mark.parametrize("pos", POSITIONS)
def test_generate_past_block_size_sees_block_size_tokens_as_the_reference_does(pos, T, monkeypatch, tiny_model):
    """And a prompt longer than the cache goes in by pieces: with relative positions too, which
    read the whole prompt, each query through a window of block_size. The cache's ring then has
    2 x block_size slots: the first piece fills it, each next one overwrites only keys that none of
    its queries sees, so attention over a prompt of T tokens takes O(block_size^2) memory, not
    O(T^2). (Absolute positions crop the prompt to its last block_size tokens instead.)"""
    model = tiny_model(pos=pos, block_size=8)
    idx = prompt(T, B=2)
    ref_tokens, ref_logits = greedy_without_cache(model, idx, 14)
    seen = []  # the logits generate() samples from, step by step
    monkeypatch.setattr(generate_module, "sample", lambda logits, *a: seen.append(logits) or logits.argmax(-1, keepdim=True))
    shapes, attend = [], model_module.attention  # (queries, keys) of each call
    monkeypatch.setattr(model_module, "attention", lambda q, k, *a: shapes.append(q.shape[2:3] + k.shape[2:3])
                        or attend(q, k, *a))
    assert torch.equal(generate(model, idx, 14, temperature=0), ref_tokens)
    torch.testing.assert_close(torch.stack(seen, 1), ref_logits, rtol=0, atol=1e-5)
    if T == 50 and not absolute_positions(model.config):
        layers = model.config.n_layer
        # 50 = 16 + 3 x 9 + 7 (a piece of n overwrites the n oldest of 16 keys: 9 = 16 - 8 + 1), then decoding
        assert shapes[:6 * layers:layers] == [(16, 16)] + [(9, 16)] * 3 + [(7, 16), (1, 16)]
        assert max(shapes) == (16, 16)  # never more than the ring


def test_windowed_cache_holds_at_most_window_positions(tiny_model):
    model = tiny_model(pos="rope", window=4)
    sizes = []
    model.decoder.h[0].attn.register_forward_hook(lambda m, i, o: sizes.append(m.cache.k.size(2)))
    generate(model, torch.zeros(1, 3, dtype=torch.long), 40, temperature=0)
    assert len(sizes) == 40 and set(sizes) == {4}


def test_the_cache_is_a_ring_written_in_place_one_slot_per_token(tiny_model):
    """A decode step writes its keys and values in place into one slot, position % size, and records
    the position there; the other slots stay as they were. generate() sizes the cache to the prompt
    and the new tokens, with no empty slots to attend over (unless compile_decode rounds it up)."""
    model = tiny_model(pos="rope", window=4)
    model.setup_kv_cache(1, 4)
    prefill(model, prompt(3, B=1), torch.arange(3))
    cache = model.decoder.h[0].attn.cache
    buffers = cache.k.data_ptr(), cache.v.data_ptr()
    for p in range(3, 10):
        k, v = cache.k.clone(), cache.v.clone()
        decode(model, prompt(1, B=1, seed=p), torch.tensor([[p]]))
        assert (cache.k.data_ptr(), cache.v.data_ptr()) == buffers
        for new, old in ((cache.k, k), (cache.v, v)):
            assert (new != old).any(dim=(0, 1, 3)).nonzero().flatten().tolist() == [p % 4]
        assert model.decoder.cache_pos[0].tolist() == [p - (p - s) % 4 for s in range(4)]  # the newest q = s mod 4
    model.clear_kv_cache()
    for window, T, size in ((0, 5, 12), (4, 3, 4), (4, 5, 8)):  # a prompt past the window: room for its pieces
        sizes, m = [], tiny_model(pos="rope", window=window)
        m.decoder.h[0].attn.register_forward_hook(lambda mod, i, o: sizes.append(mod.cache.k.size(2)))
        generate(m, prompt(T, B=1), 7, temperature=0)
        assert set(sizes) == {size}


def test_encoder_decoder_generation_encodes_the_source_once(tiny_model):
    model = tiny_model(arch="encoder-decoder", pos="relative")
    calls = []
    model.encoder.register_forward_hook(lambda m, i, o: calls.append(1))
    cross = model.decoder.h[0].cross_attn.c_kv
    cross.register_forward_hook(lambda m, i, o: calls.append(2))
    generate(model, prompt(1, B=2), 10, src=source("encoder-decoder", B=2))
    assert calls == [1, 2]  # one encoder pass, one projection of its keys and values


def test_gqa_cache_is_n_head_over_n_kv_head_times_smaller(tiny_model):
    def cache_numel(n_kv_head):
        model = tiny_model(n_head=8, n_kv_head=n_kv_head, n_embd=64)  # 8 heads: 1, 2 and 8 key/value heads
        model.setup_kv_cache(2, 16)
        return sum(b.numel() for m in model.modules() if isinstance(m, KVCache) for b in m.buffers())
    assert cache_numel(8) == 4 * cache_numel(2) == 8 * cache_numel(1)


def test_the_compiled_step_decodes_as_the_plain_one_in_a_cache_rounded_up_to_the_full_ring(monkeypatch, tiny_model):
    """generate(compile=True) steps through torch.compile's decode (a stand-in here: no compiler), in a
    cache rounded up (compiled_size: 256 slots here) so that other prompts reuse its graph, but never
    past the full ring's size (block_size 32; a window of 8 and 2 global tokens: 10), whose every slot
    a wrapped ring reads: the same tokens."""
    sizes = []
    def recording_compile(fn, **kw):
        return lambda model, *args: (sizes.append(model.decoder.cache_pos.size(1)), fn(model, *args))[1]
    monkeypatch.setattr(torch, "compile", recording_compile)
    idx = prompt(5)
    for kw, size in ((dict(block_size=1024), 256), ({}, 32), (dict(window=8, n_global=2), 10)):
        sizes.clear()
        model = tiny_model(pos="rope", **kw)
        assert torch.equal(generate(model, idx, 9, temperature=0, compile=True), generate(model, idx, 9, temperature=0))
        assert sizes == [size] * 8  # every step after the prefill


def test_a_compiled_cache_comes_in_few_sizes_each_its_own_graph():
    """Rounded up: on a CPU (which reads the slots in use only) to a power of two, so that a process
    compiles a few sizes at most; on a GPU (which reads every slot) to a multiple of 256."""
    cpu, gpu = torch.device("cpu"), torch.device("cuda")  # a device object: no GPU needed
    lengths = (1, 256, 257, 600, 1500, 5000)
    assert [generate_module.compiled_size(n, cpu) for n in lengths] == [256, 256, 512, 1024, 2048, 8192]
    assert [generate_module.compiled_size(n, gpu) for n in lengths] == [256, 256, 512, 768, 1536, 5120]


def test_generate_compiles_by_default_where_the_tokens_make_up_for_the_compile(monkeypatch, tiny_model):
    """Untold (compile=None), generate decodes through the compiled step where the tokens decoded
    through the cache reach COMPILE_PAYS_FROM: past block_size a model of absolute positions (or a
    prefix LM) recomputes its context, so those do not count; never for an encoder, an attention that
    keeps nothing, a mixture of experts, on other devices or without a C++ compiler.
    The same tokens either way."""
    from quantize import quantize_int8_dynamic
    calls = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: lambda *a: calls.append(1) or fn(*a))
    monkeypatch.setattr(generate_module, "COMPILE_PAYS_FROM", 20)
    pays, cpu = generate_module.compile_pays, torch.device("cpu")
    rope, learned = tiny_model(pos="rope"), tiny_model(pos="learned")  # block_size 32
    assert [pays(rope, cpu, n) for n in (19, 20, 500)] == [False, True, True]
    assert pays(rope, cpu, 10, samples=2) and not pays(rope, cpu, 10, samples=1)
    assert pays(learned, cpu, 500, prompt=12) and not pays(learned, cpu, 500, prompt=13)  # 20 tokens, then 19
    prefix_lm = tiny_model(arch="prefix-lm", pos="rope")
    assert pays(prefix_lm, cpu, 500, prompt=12) and not pays(prefix_lm, cpu, 500, prompt=13)
    assert pays(tiny_model(arch="encoder-decoder", pos="relative"), cpu, 20)
    never = (dict(arch="encoder"), dict(attention="lsh", bucket_size=8), dict(n_expert=4))
    assert not any(pays(tiny_model(**kw), cpu, 500) for kw in never)
    assert not pays(rope, torch.device("mps"), 500) and pays(quantize_int8_dynamic(tiny_model(pos="rope")), cpu, 20)
    with monkeypatch.context() as m:
        m.setattr(generate_module.shutil, "which", lambda name: None)  # no C++ compiler for inductor
        assert not pays(rope, cpu, 500) and pays(rope, torch.device("cuda"), 500)  # (a device object only)
    idx = prompt(3)
    for new, compiled in ((19, False), (20, True)):
        calls.clear()
        untold, eager = (generate(rope, idx, new, temperature=0, compile=c) for c in (None, False))
        assert torch.equal(untold, eager)
        assert len(calls) == (new - 1 if compiled else 0)  # every step after the prefill, or none


def test_stopping_after_ends_a_generation_early_in_the_cache_of_the_whole(monkeypatch, tiny_model):
    """Inside stopping_after(n), a generation yields n tokens, the first n of the whole run's, through a
    cache sized for all it was asked for; afterwards, even after an error inside, generations run whole."""
    sizes = []
    real = generate_module.prefill
    monkeypatch.setattr(generate_module, "prefill", lambda model, *a: sizes.append(model.decoder.cache_pos.size(1))
                        or real(model, *a))
    model, idx = tiny_model(pos="rope"), prompt(4)
    whole = generate(model, idx, 20, temperature=0)
    with generate_module.stopping_after(3):
        short = generate(model, idx, 20, temperature=0)
    assert torch.equal(short, whole[:, :4 + 3]) and sizes == [24, 24]
    with pytest.raises(KeyError), generate_module.stopping_after(2):
        raise KeyError
    assert torch.equal(generate(model, idx, 20, temperature=0), whole)


def test_the_compiled_step_runs_unguarded_from_its_third_step_until_the_ring_is_full(monkeypatch, tiny_model):
    """Dynamo's guards are skipped (generate.unguarded) only after two steps with full guards (the
    first compiles, the second makes the slots in use a size) and only while the cache has empty
    slots: once a ring is full a step may need another graph, which the guards must find. Never
    eager, never for a mixture of experts, and never under a stance the caller set."""
    options = []
    def recording_compile(fn, **kw):  # a stand-in: no compiler
        options.append(kw)
        return fn
    monkeypatch.setattr(torch, "compile", recording_compile)
    skipping = torch._dynamo.eval_frame._is_skip_guard_eval_unsafe_stance
    for kw, new in ((dict(n_expert=2), 9), (dict(pos="rope"), 9), (dict(pos="relative", window=16), 300)):
        model, steps = tiny_model(**kw), []  # the last: a ring of 16 slots (a window of 16), full
        model.register_forward_pre_hook(lambda m, a, k: steps.append((k["slots_used"], skipping(),
                                                                      m.decoder.cache_pos.size(1))), with_kwargs=True)
        eager = generate(model, prompt(5), new, temperature=0)
        assert not any(skip for _, skip, _ in steps)
        for stance in ("default", "eager_on_recompile"):
            steps.clear()
            with torch.compiler.set_stance(stance):
                assert torch.equal(generate(model, prompt(5), new, temperature=0, compile=True), eager)
            used = [(n, size) for n, _, size in steps[1:]]  # each step after the prefill
            fast = stance == "default" and not model.config.n_expert
            rule = [fast and i >= 2 and n < size for i, (n, size) in enumerate(used)]
            assert [skip for _, skip, _ in steps[1:]] == rule and not skipping()
            assert any(rule) or stance != "default" or model.config.n_expert
    assert used[-1] == (16, 16) and options[0] == dict(options=generate_module.CPU_INDUCTOR)  # C++, frozen weights


def test_each_model_compiles_a_step_of_its_own_and_keeps_it(monkeypatch, tiny_model):
    """generate(compile=True) compiles a copy of decode's code a model (own_step): dynamo keeps its graphs
    with the code, and several models' graphs on one code slowed each other. A model's next generation
    reuses its step."""
    compiled_code = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compiled_code.append(fn.__code__) or fn)
    models = [tiny_model(pos="rope"), tiny_model(pos="rope")]
    for model in models + models:
        assert torch.equal(generate(model, prompt(5), 4, temperature=0, compile=True),
                           generate(model, prompt(5), 4, temperature=0))
    assert len(compiled_code) == 2 and compiled_code[0] is not compiled_code[1]
    assert all(c is not decode.__code__ and c == decode.__code__ for c in compiled_code)  # copies of it


def test_a_model_compiles_its_step_again_once_a_weight_changed_in_place(monkeypatch, tiny_model):
    """A frozen step holds the weights' values (inductor's freezing, on a CPU), which no guard checks: own_step
    compiles again once a parameter or buffer changed in place (its version counter), as after more
    training or requantizing. An encoder-decoder's step is not frozen."""
    compiles = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compiles.append(kw) or fn)
    model = tiny_model(pos="rope")
    for _ in range(2):
        generate(model, prompt(5), 3, temperature=0, compile=True)
    assert len(compiles) == 1 and compiles[0]["options"] == generate_module.CPU_INDUCTOR
    with torch.no_grad():
        model.lm_head.weight.mul_(2)
    generate(model, prompt(5), 3, temperature=0, compile=True)
    model.decoder.register_buffer("scale", torch.ones(1))
    generate(model, prompt(5), 3, temperature=0, compile=True)
    model.decoder.scale.add_(1)
    generate(model, prompt(5), 3, temperature=0, compile=True)
    assert len(compiles) == 3  # a new buffer compiles nothing again; its change does
    assert generate_module.freezes(model, torch.device("cpu"))
    assert not generate_module.freezes(tiny_model(arch="encoder-decoder"), torch.device("cpu"))
    assert not generate_module.freezes(model, torch.device("cuda"))


@pytest.mark.skipif(shutil.which("g++") is None, reason="inductor compiles the step with g++")
def test_the_frozen_step_decodes_new_weights_and_new_sources_as_eager_does(tiny_model):
    """Through inductor itself: after an in-place change of the weights a frozen step decodes the new
    weights' tokens, and an encoder-decoder (not frozen) each source's."""
    model, idx = tiny_model(pos="rope"), prompt(4)
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(generate(model, idx, 6, temperature=0, compile=True),
                               generate(model, idx, 6, temperature=0))
            model.lm_head.weight.mul_(-1)  # (tied: the embedding too)
        seq2seq = tiny_model(arch="encoder-decoder", pos="rope")
        for seed in (2, 3):
            src = source("encoder-decoder", 1, seed=seed)
            assert torch.equal(generate(seq2seq, idx[:, :1], 6, src=src, temperature=0, compile=True),
                               generate(seq2seq, idx[:, :1], 6, src=src, temperature=0))


def test_the_cpu_step_runs_with_freezing_on_and_leaves_it_as_it_was(monkeypatch, tiny_model):
    """dynamo reads inductor's freezing as it traces (the weights become the graph's constants): frozen sets
    it around each call of the compiled step, and only there."""
    import torch._inductor.config as inductor_config
    seen = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: lambda *a: seen.append(inductor_config.freezing) or fn(*a))
    model, before = tiny_model(pos="rope"), inductor_config.freezing
    assert torch.equal(generate(model, prompt(5), 4, temperature=0, compile=True),
                       generate(model, prompt(5), 4, temperature=0))
    assert seen == [True] * 3 and inductor_config.freezing == before is False and generate_module.FROZEN == [False]


@pytest.mark.parametrize("kw", [dict(pos="rope", window=4), dict(attention="linear")])
def test_a_frozen_generation_reuses_the_caches_of_the_last_of_its_shapes_emptied(tiny_model, kw):
    """A frozen step guards each tensor it reads by identity (generate.reuse_caches): a generation gets
    back the caches of the last one of the same shapes, holding what new empty ones hold (a KV ring and
    its positions, a recurrent state); caches of other shapes are kept beside them."""
    model = tiny_model(**kw)
    def tensors():
        caches = [model.decoder.cache_pos] + [a.cache for a in model.modules() if hasattr(a, "cache")]
        return [t for c in caches for t in generate_module.cache_tensors(c)]
    def setup(batch):
        model.setup_kv_cache(batch, 8)
        empty = [t.clone() for t in tensors()]
        generate_module.reuse_caches(model)
        for t, e in zip(tensors(), empty):
            assert torch.equal(t, e)
        got = tensors()
        for t in got:
            t.fill_(7) if t.is_floating_point() else t.fill_(3)  # as a generation leaves them
        return got
    with torch.no_grad():
        one, two = setup(1), setup(2)
        assert len(one) >= 2 and all(t.size(0) == 1 for t in one) and all(t.size(0) == 2 for t in two)
        assert all(a is b for a, b in zip(setup(1), one)) and all(a is b for a, b in zip(setup(2), two))


def test_generate_rejects_an_encoder(tiny_model):
    with pytest.raises(ValueError, match="encoder does not generate"):
        generate(tiny_model(arch="encoder"), torch.zeros(1, 2, dtype=torch.long), 3)


# ----------------------------------------------------------------------------------------------
# Fast decoding

def test_decoding_reads_no_value_on_the_host(monkeypatch, tiny_model):
    """Nothing waits for the device (gpt-fast's rule): generate.py counts the cache's slots in use on
    the host and passes them in (slots_used), so no pass reads a tensor, on a CPU as elsewhere."""
    models = [tiny_model(pos="rope", n_kv_head=2), tiny_model(pos="learned", block_size=8, window=3)]
    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__"):
        def refuse(*args, name=name):
            raise AssertionError(f"Tensor.{name} would wait for the device")
        monkeypatch.setattr(torch.Tensor, name, refuse)
    used, passes = [], []
    for model in models:  # sampling with top-k and top-p, and the crop past a learned table
        model.register_forward_pre_hook(lambda m, args, kw: passes.append(kw.get("slots_used")), with_kwargs=True)
    for devices in (("cpu",), ()):
        monkeypatch.setattr(generate_module, "SLOTS_IN_USE_ON", devices)
        passes.clear()
        for model in models:
            out = generate(model, prompt(5, B=2), 12, temperature=0.9, top_k=10, top_p=0.9)
            assert out.shape == (2, 17)
        used.append(passes[:])
    # rope: the prompt of 5 (its prefill), then 11 steps, each one more slot in use
    assert len(used[0]) >= 22 and all(isinstance(n, int) for n in used[0]) and set(used[1]) == {None}
    assert used[0][:12] == list(range(5, 17))


def test_a_step_attends_over_the_slots_in_use_and_gets_the_logits_of_every_slot(tiny_model):
    """On a CPU a step's queries read the cache up to its last slot in use (slots_used), and get the
    logits that reading every slot (as a GPU does) gives."""
    model, logits = tiny_model(pos="rope"), []
    for used in (6, None):
        model.setup_kv_cache(1, 20)
        weights = {}
        prefill(model, prompt(5), torch.arange(5)[None])
        logits.append(model(prompt(1, seed=3), input_pos=torch.tensor([[5]]), weights=weights, slots_used=used)[0])
        assert [w.size(-1) for w in weights["decoder self-attention"]] == [used or 20] * 2
        model.clear_kv_cache()
    torch.testing.assert_close(logits[0], logits[1])  # the empty slots' weights are exact zeros


@pytest.mark.parametrize("kw", [dict(pos="rope", n_kv_head=2), dict(pos="alibi", window=4),
                                dict(pos="relative", n_kv_head=1), dict(arch="encoder-decoder", pos="sinusoidal")],
                         ids=config_id)
def test_the_decode_step_compiles_into_one_graph_and_matches_eager(kw, tiny_model):
    model = tiny_model(**kw)
    src = prompt(6, seed=2) if kw.get("arch") == "encoder-decoder" else None
    memory = model.encoder(model.wte(src), torch.arange(6)[None]) if src is not None else None
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")  # fullgraph: no breaks, and one
    compiled = generate_module.compiled(torch.device("cpu"), backend=counter, fullgraph=True)  # graph for any fill
    outs, frames = [], []
    for step in (decode, compiled):
        model.setup_kv_cache(1, 5 if kw.get("window") else 16, memory)  # the window's ring wraps: all 5 in use
        for cache in (m for m in model.modules() if isinstance(m, KVCache)):  # NaN where a step must not read:
            cache.k.fill_(float("nan")), cache.v.fill_(float("nan"))  # past the slots in use
        with torch.no_grad():
            model(prompt(3), input_pos=torch.arange(3), slots_used=3)
            used = [min(4 + i, cache.k.size(2)) for i in range(5)]  # the slots in use: a size, not a read
            outs.append([])
            for i in range(5):
                outs[-1].append(step(model, prompt(1, seed=i), torch.tensor([[3 + i]]), None, used[i]))
                frames.append(counter.frame_count)
        model.clear_kv_cache()
    outs = [torch.stack(o) for o in outs]
    torch.testing.assert_close(outs[0], outs[1])  # both finite (assert_close takes NaN as a difference)
    # the first count compiled as a constant, the second as a size, which serves every count after it: 4 to
    # 8 slots in use (or with a window 4, then all 5: its ring full)
    assert outs[0].isfinite().all() and 1 <= frames[6] == frames[-1] <= 2
    counter.frame_count = 0
    model.setup_kv_cache(1, 5 if kw.get("window") else 16, memory)
    with torch.no_grad():
        model(prompt(3), input_pos=torch.arange(3), slots_used=3)
        compiled(model, prompt(1), torch.tensor([[3]]), None, 4)
        model.clear_kv_cache()
    assert counter.frame_count == 0  # and a second generation reuses it
    assert not torch._dynamo.config.capture_scalar_outputs  # no flag of dynamo's patched: a forker's own compile


# ----------------------------------------------------------------------------------------------
# Left-padded batches

@pytest.mark.usefixtures("slots")
@pytest.mark.parametrize("kw", [dict(pos="rope"), dict(pos="learned", block_size=12), dict(pos="alibi", n_kv_head=2),
                                dict(pos="relative", window=4), dict(pos="sinusoidal"), dict(pos="none")],
                         ids=config_id)
def test_each_row_of_a_left_padded_batch_has_the_logits_and_the_greedy_output_of_its_prompt_alone(kw, tiny_model):
    # the forward pass, on SDPA and the math path, of this config and of its position scheme alone:
    # row 0 is a 7-token prompt, left-padded to 10
    idx = prompt(10, B=2)
    valid = torch.ones(2, 10, dtype=torch.bool)
    valid[0, :3] = False
    positions = (torch.arange(10) - torch.tensor([[3], [0]])).clamp(min=0)  # each row counts from 0
    for config, impl in itertools.product({config_id(c): c for c in (kw, dict(pos=kw["pos"]))}.values(),
                                          ("sdpa", "math")):
        model = tiny_model(attn_impl=impl, **config)
        logits = model(idx, mask=valid, input_pos=positions)[0]
        assert not logits.isnan().any()  # padding rows see themselves, so no softmax is empty
        torch.testing.assert_close(logits[0, 3:], model(idx[:1, 3:])[0][0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(logits[1], model(idx[1:])[0][0], rtol=1e-5, atol=1e-5)
    # greedy decoding, of prompts of 3, 9, 1 and 20 tokens (20: longer than the cache, in pieces)
    model = sharp(tiny_model(**kw))
    prompts = [prompt(n, seed=n)[0] for n in (3, 9, 1, 20)]
    T = max(map(len, prompts))
    idx = torch.zeros(len(prompts), T, dtype=torch.long)
    mask = torch.zeros(len(prompts), T, dtype=torch.bool)
    for i, p in enumerate(prompts):
        idx[i, T - len(p):], mask[i, T - len(p):] = p, True
    together = generate(model, idx, 15, temperature=0, mask=mask)[:, T:]
    for i, p in enumerate(prompts):
        assert torch.equal(together[i], generate(model, p[None], 15, temperature=0)[0, len(p):])


# ----------------------------------------------------------------------------------------------
# Sampling

def test_sampling_follows_temperature_top_k_and_top_p():
    torch.manual_seed(0)
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(20000, 1)
    freq = torch.bincount(sample(logits).view(-1), minlength=4) / 20000
    torch.testing.assert_close(freq, torch.tensor([0.5, 0.3, 0.15, 0.05]), rtol=0, atol=0.015)
    top2 = torch.bincount(sample(logits, top_k=2).view(-1), minlength=4) / 20000
    torch.testing.assert_close(top2, torch.tensor([0.625, 0.375, 0, 0]), rtol=0, atol=0.015)
    nucleus = torch.bincount(sample(logits, top_p=0.7).view(-1), minlength=4) / 20000  # 0.5 + 0.3 cover 0.7
    torch.testing.assert_close(nucleus, torch.tensor([0.625, 0.375, 0, 0]), rtol=0, atol=0.015)
    assert (sample(logits, top_p=0.4) == 0).all()  # the top token alone covers 0.4
    assert (sample(logits, top_p=0.5) == 0).all()  # ...and exactly reaches 0.5: the smallest such set
    assert (sample(logits, temperature=0) == 0).all()
    hot = torch.bincount(sample(logits, temperature=100.0).view(-1), minlength=4) / 20000
    assert hot.min() > 0.2  # a high temperature flattens towards uniform


def test_the_same_seed_samples_the_same_text(tiny_model):
    model = tiny_model(pos="rope")
    idx = torch.zeros(2, 1, dtype=torch.long)
    torch.manual_seed(7)
    a = generate(model, idx, 20, temperature=1.0, top_k=10)
    torch.manual_seed(7)
    assert torch.equal(a, generate(model, idx, 20, temperature=1.0, top_k=10))


# ----------------------------------------------------------------------------------------------
# Speculative decoding

@pytest.mark.usefixtures("slots")
@pytest.mark.parametrize("kw, draft_kw", [
    (dict(pos="rope"), dict(n_layer=1)),
    (dict(pos="sinusoidal", window=3), dict(n_layer=1, pos="alibi")),
    (dict(pos="learned", block_size=16), dict(pos="learned", block_size=24, n_layer=1)),  # past the table
    (dict(pos="relative", n_kv_head=2), dict(n_layer=1, n_embd=16, n_head=2)),
], ids=["rope", "window", "learned-past-block", "relative-gqa"])
def test_greedy_speculative_decoding_is_the_targets_greedy_decoding(kw, draft_kw, tiny_model):
    target = sharp(tiny_model(0, **kw))
    drafts = [sharp(tiny_model(1, **{**kw, **draft_kw})), noisy_copy(target, 0.5)]  # mostly rejected; half accepted
    accepted = proposed = 0
    want = {}  # the target's own greedy output, for each prompt length and number of new tokens
    for draft in drafts:
        for T in (1, 6, 40):  # 40: a prompt longer than the caches, which go in by pieces
            idx = prompt(T)
            # 8 new tokens stay within block_size, where stale cache slots after a rollback would show
            for k, n in itertools.product((1, 3, 5), (8, 30)):
                out, a, p = speculative_generate(target, draft, idx, n, k=k, temperature=0)
                if (T, n) not in want:
                    want[T, n] = generate(target, idx, n, temperature=0)
                assert torch.equal(out, want[T, n])
                accepted, proposed = accepted + a, proposed + p
    assert 0 < accepted < proposed  # both paths, keeping drafts and rolling them back, were taken


def test_a_draft_identical_to_the_target_is_always_accepted(tiny_model):
    target = tiny_model(pos="rope")
    _, accepted, proposed = speculative_generate(target, target, prompt(4), 20, k=4, temperature=0.8)
    assert accepted == proposed > 0


def test_accept_or_resample_gives_the_targets_distribution_whatever_the_draft():
    torch.manual_seed(0)
    p = torch.tensor([[0.1, 0.5, 0.3, 0.1], [0.25, 0.25, 0.25, 0.25]])  # the target at 2 positions
    q = torch.tensor([[0.6, 0.1, 0.1, 0.2]])  # a draft that disagrees
    first = torch.zeros(4)
    n = 20000
    for _ in range(n):
        drafted = torch.multinomial(q[0], 1)
        first[accept_or_resample(p, q, drafted)[0]] += 1
    torch.testing.assert_close(first / n, p[0], rtol=0, atol=0.012)


def test_speculative_sampling_draws_the_first_token_from_the_target(tiny_model):
    target, draft = tiny_model(0, pos="rope", vocab_size=6), tiny_model(5, pos="rope", vocab_size=6, n_layer=1)
    idx = prompt(3) % 6
    with torch.no_grad():
        draft.lm_head.weight.mul_(4)  # a draft far from the target: most of its proposals are turned down
        want = target(idx)[0][0, -1].softmax(-1)
        drafts = draft(idx)[0][0, -1].softmax(-1)
    torch.manual_seed(0)
    n, counts = 600, torch.zeros(6)
    for _ in range(n):
        counts[speculative_generate(target, draft, idx, 1, k=2, temperature=1.0)[0][0, -1]] += 1
    # Pearson's chi-square against the target's distribution: above 25.74, its 1 - 1e-4 quantile at 5
    # degrees of freedom, a right sampler fails once in 10,000 runs; the draft's distribution fails it
    chi2 = lambda p: ((counts - n * p) ** 2 / (n * p)).sum().item()  # noqa: E731
    assert chi2(want) < 25.74 < chi2(drafts), (chi2(want), chi2(drafts))


def test_a_transformer_xl_decoder_generates_with_block_size_plus_mem_len_keys_in_view(tiny_model):
    """Segments of 8 and a memory of 8: while generating, each query sees the last 16 keys, as a plain
    decoder of context 16 (RoPE, the same weights) does when it slides past its block_size."""
    xl = tiny_model(pos="rope", block_size=8, mem_len=8)
    plain = tiny_model(pos="rope", block_size=16)
    plain.load_state_dict(xl.state_dict())
    idx = prompt(5, B=2)
    assert torch.equal(generate(xl, idx, 40, temperature=0), generate(plain, idx, 40, temperature=0))


@pytest.mark.parametrize("pos", ["rope", "relative"])
def test_a_prefix_lm_takes_the_prompt_as_its_prefix_and_decodes_as_full_passes_do(pos, tiny_model):
    """The prompt is prefilled once, read both ways; then each cached step's greedy token is the
    argmax of a full forward pass under the prefix mask, also past block_size (the prompt's part
    still in view is the prefix), and for left-padded prompts of two lengths."""
    model = tiny_model(arch="prefix-lm", pos=pos, block_size=16)
    idx = prompt(6, B=2)
    out = generate(model, idx, 8, temperature=0)
    for t in range(6, 14):
        want = model(out[:, :t], prefix_len=torch.full((2,), 6))[0][:, -1].argmax(-1)
        assert torch.equal(out[:, t], want)
    long = generate(model, idx, 14, temperature=0)[:, :20]  # past 16: the last 16 tokens, 2 of the prompt in view
    assert torch.equal(long[:, 19], model(long[:, 3:19], prefix_len=torch.full((2,), 3))[0][:, -1].argmax(-1))
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[0, :2] = False  # row 0: a prompt of 4, left-padded
    together = generate(model, idx, 5, temperature=0, mask=mask)
    assert torch.equal(together[0, 6:], generate(model, idx[:1, 2:], 5, temperature=0)[0, 4:])
