"""Properties of kernels.flash_attention: its output and its gradients equal those of attention
written out plainly in torch, over every feature it claims; and inside model.py, a model on the
kernel computes what the math path does, and "auto" takes it where it applies. Without a GPU the
kernels run in Triton's interpreter (conftest.py sets TRITON_INTERPRET=1), so the cases stay small."""

import os
import random
import sys

import pytest
import torch

import kernels
from model import Mask, ModelConfig, attn_impl
from generate import cache_size, generate, prefill, speculative_generate
from quantize import quantize_int8

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root
needs_triton = pytest.mark.skipif(not kernels.available, reason="triton is not installed")
# the autotuned kernels, {dtype: autotuner} each, and every autotuner's configs as kernels.py
# defines them (the interpreter has one per kernel)
TUNED = [kernels._fwd, kernels._bwd_dkdv, kernels._bwd_dq] if kernels.available else []
CONFIGS = {tuner: tuner.configs for tuned in TUNED for tuner in tuned.values()}


@pytest.fixture(autouse=True)
def one_config_per_kernel(monkeypatch):
    """On a GPU, each test's kernels run their first autotuning config: autotuning compiles every
    config for every new shape, 16 compilations where a test needs 3 (on an H100, the first 6 tests
    took 170 s). test_every_autotuning_config_computes_the_same_attention covers the others."""
    if CUDA:
        for tuner, configs in CONFIGS.items():
            monkeypatch.setattr(tuner, "configs", configs[:1])


def reference(q, k, v, causal=False, scale=None, alibi_slopes=None, window=0, key_padding_mask=None):
    """Attention as the definition reads, in the inputs' dtype: the whole (Tq, Tk) score matrix,
    masked, softmaxed, times v. Query i sits at position Tk - Tq + i."""
    B, Hq, Tq, D = q.shape
    Tk = k.size(2)
    group = Hq // k.size(1)
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # (B, Hq, Tk, D)
    dist = torch.arange(Tk - Tq, Tk, device=q.device)[:, None] - torch.arange(Tk, device=q.device)  # (Tq, Tk)
    visible = torch.ones(1, 1, Tq, Tk, dtype=torch.bool, device=q.device)
    if causal:
        visible = visible & (dist >= 0)
    if window:
        visible = visible & (dist.abs() < window)  # causal: 0 <= dist < window
    if key_padding_mask is not None:
        visible = visible & key_padding_mask[:, None, None, :]  # (B, 1, Tq, Tk)
    scores = (q @ k.transpose(-2, -1)) * (D ** -0.5 if scale is None else scale)  # (B, Hq, Tq, Tk)
    if alibi_slopes is not None:
        scores = scores - (alibi_slopes[:, None, None] * dist.abs()).to(scores.dtype)
    # A finite fill, and zeroing afterwards, gives a row with no visible key zero weights
    # (and zero gradients) where -inf would give NaN.
    weights = scores.masked_fill(~visible, torch.finfo(scores.dtype).min).softmax(-1) * visible
    return weights @ v


def forward_backward(attn, q, k, v, grad, **kw):
    """(out, dq, dk, dv) of attn for the upstream gradient grad."""
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    out = attn(q, k, v, **kw)
    return (out, *torch.autograd.grad(out, (q, k, v), grad))


def spec(B=1, Hq=2, Hkv=2, Tq=64, Tk=64, D=32, alibi=False, pad=False, **kw):
    """A test case: shapes, whether to draw ALiBi slopes and a padding mask, flash_attention's kw."""
    return dict(B=B, Hq=Hq, Hkv=Hkv, Tq=Tq, Tk=Tk, D=D, alibi=alibi, pad=pad, kw=kw)


def case(name, **kw):
    return pytest.param(spec(**kw), id=name)


def make(c, dtype, seed=0):
    """q, k, v, the upstream gradient and the keyword arguments of a case, in dtype."""
    g = torch.Generator().manual_seed(seed)
    B, Hq, Hkv, Tq, Tk, D = (c[n] for n in ("B", "Hq", "Hkv", "Tq", "Tk", "D"))
    q, k, v = (torch.randn(B, H, T, D, generator=g) for H, T in ((Hq, Tq), (Hkv, Tk), (Hkv, Tk)))
    grad = torch.randn(B, Hq, Tq, D, generator=g)
    kw = dict(c["kw"])
    if c["alibi"]:
        kw["alibi_slopes"] = torch.tensor([2.0 ** (-8 * (h + 1) / Hq) for h in range(Hq)], device=DEVICE)
    if c["pad"]:
        keep = torch.rand(B, Tk, generator=g) < 0.75
        keep[-1] = False  # the last sequence of the batch is all padding: every one of its rows is empty
        kw["key_padding_mask"] = keep.to(DEVICE)
    q, k, v, grad = (x.to(DEVICE, dtype) for x in (q, k, v, grad))
    return q, k, v, grad, kw


# A compact cover: every feature appears, alone and combined, with lengths 1, 17, 100, 130 (tails
# of partial blocks) and head sizes 3 and 8 (padded to 16 inside), 16, 32, 48 and 80 (padded to 64 and
# 128), 64, 128 (the largest the kernel takes).
CASES = [
    case("bidirectional-T128-D64", B=2, Tq=128, Tk=128, D=64),
    case("causal-T128-D64", Tq=128, Tk=128, D=64, causal=True),
    case("causal-prefill-Tq100-after-cache-Tk130", Tq=100, Tk=130, causal=True),
    case("causal-decode-Tq1-Tk130", Tq=1, Tk=130, causal=True),
    case("causal-more-queries-than-keys-Tq130-Tk100", Tq=130, Tk=100, D=16, causal=True),
    case("length1-D16", Tq=1, Tk=1, D=16),
    case("causal-T70-D128", Tq=70, Tk=70, D=128, causal=True),
    case("bidirectional-T40-D80", Tq=40, Tk=40, D=80),
    case("causal-T40-D8", Tq=40, Tk=40, D=8, causal=True),
    case("causal-T20-D3", Tq=20, Tk=20, D=3, causal=True),  # odd and under 8
    case("length17-D48-scale0.3", Tq=17, Tk=17, D=48, scale=0.3),
    case("gqa-4:1-causal", Hq=4, Hkv=1, Tq=100, Tk=100, causal=True),
    case("gqa-4:2-bidirectional-D16", Hq=4, Hkv=2, Tq=100, Tk=100, D=16),
    case("alibi-causal-gqa-4:2", Hq=4, Hkv=2, Tq=130, Tk=130, alibi=True, causal=True),
    case("alibi-bidirectional-D48", Tq=100, Tk=100, D=48, alibi=True),
    case("window7-causal", Tq=130, Tk=130, window=7, causal=True),
    case("window100-causal-T200-D16", Tq=200, Tk=200, D=16, window=100, causal=True),
    case("window20-bidirectional-Tq100-Tk130", Tq=100, Tk=130, window=20),
    case("key-padding-with-an-all-padded-sequence", B=3, Tq=100, Tk=100, pad=True),
    case("everything-at-once", B=2, Hq=4, Hkv=2, Tq=100, Tk=130, D=48, alibi=True, pad=True,
         causal=True, window=50, scale=0.2),
]


def sweep(n, seed=0):
    """Random lengths, windows and causality: the band's edges land on every kind of block
    boundary, where an off-by-one in choosing which blocks to visit would show."""
    rng = random.Random(seed)
    for _ in range(n):
        Tq, Tk, causal, window = rng.randint(1, 130), rng.randint(1, 130), rng.random() < 0.7, rng.randint(0, 70)
        name = f"Tq{Tq}-Tk{Tk}-{'causal' if causal else 'bidirectional'}-window{window}"
        yield case(name, Hq=2, Hkv=1, Tq=Tq, Tk=Tk, D=16, causal=causal, window=window)


@needs_triton
@pytest.mark.parametrize("c", CASES + list(sweep(24)))
def test_fp32_output_and_gradients_equal_the_reference(c):
    q, k, v, grad, kw = make(c, torch.float32)
    got = forward_backward(kernels.flash_attention, q, k, v, grad, **kw)
    want = forward_backward(reference, q, k, v, grad, **kw)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert a.dtype == torch.float32 and a.shape == b.shape
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=lambda m: f"{name}: {m}")


HALF = [torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    not CUDA, reason="Triton's interpreter computes bf16 wrongly: bf16 is checked on a GPU"))]


@needs_triton
@pytest.mark.parametrize("dtype", HALF, ids=["fp16", "bf16"])
@pytest.mark.parametrize("c", CASES)
def test_half_precision_error_is_within_twice_that_of_torchs_own_attention(c, dtype):
    """Against the fp32 reference, the kernel in fp16/bf16 is at most twice as far off as torch's
    attention run in that dtype (plus a small floor for outputs that are nearly exact)."""
    q, k, v, grad, kw = make(c, dtype)
    got = forward_backward(kernels.flash_attention, q, k, v, grad, **kw)
    torch_half = forward_backward(reference, q, k, v, grad, **kw)
    exact = forward_backward(reference, q.float(), k.float(), v.float(), grad.float(), **kw)
    for name, a, b, want in zip(("out", "dq", "dk", "dv"), got, torch_half, exact):
        assert a.dtype == dtype
        err, torch_err = (a.float() - want).abs().max().item(), (b.float() - want).abs().max().item()
        assert err <= 2 * torch_err + 1e-4, f"{name}: error {err:.2e}, torch's own {torch_err:.2e}"


@needs_triton
@pytest.mark.skipif(not CUDA, reason="the interpreter runs one config per kernel; a GPU autotunes over several")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_every_autotuning_config_computes_the_same_attention(dtype, monkeypatch):
    c = spec(B=2, Hq=4, Hkv=2, Tq=100, Tk=130, D=48, alibi=True, pad=True, causal=True, window=50)
    q, k, v, grad, kw = make(c, dtype)
    exact = forward_backward(reference, q.float(), k.float(), v.float(), grad.float(), **kw)
    torch_own = forward_backward(reference, q, k, v, grad, **kw)
    tuners = [tuned[dtype] for tuned in TUNED]
    configs = [CONFIGS[tuner] for tuner in tuners]
    for i in range(max(map(len, configs))):  # every config of every kernel at least once
        for tuner, options in zip(tuners, configs):
            monkeypatch.setattr(tuner, "configs", [options[i % len(options)]])
        got = forward_backward(kernels.flash_attention, q, k, v, grad, **kw)
        for name, a, b, want in zip(("out", "dq", "dk", "dv"), got, torch_own, exact):
            err, torch_err = (a.float() - want).abs().max().item(), (b.float() - want).abs().max().item()
            assert err <= 2 * torch_err + 1e-4, f"config {i}, {name}: error {err:.2e}, torch's own {torch_err:.2e}"


@needs_triton
def test_a_query_that_sees_no_key_gets_exact_zeros_and_zero_gradients():
    # causal with 10 more queries than keys: queries 0..9 sit before the first key. And the
    # second sequence of the batch is all padding.
    q, k, v, grad, _ = make(spec(B=2, Hkv=1, Tq=40, Tk=30, D=16), torch.float32)
    keep = torch.ones(2, 30, dtype=torch.bool, device=DEVICE)
    keep[1] = False
    out, dq, dk, dv = forward_backward(kernels.flash_attention, q, k, v, grad, causal=True, key_padding_mask=keep)
    assert all(x.isfinite().all() for x in (out, dq, dk, dv))
    assert (out[:, :, :10] == 0).all() and (dq[:, :, :10] == 0).all()
    assert (out[1] == 0).all() and (dq[1] == 0).all() and (dk[1] == 0).all() and (dv[1] == 0).all()
    assert (out[0, :, 10:] != 0).any()


@needs_triton
def test_one_token_decode_equals_the_last_row_of_the_prefill():
    q, k, v, _, _ = make(spec(Hq=4, Tq=70, Tk=70), torch.float32)
    full = kernels.flash_attention(q, k, v, causal=True, window=30)
    step = kernels.flash_attention(q[:, :, -1:], k, v, causal=True, window=30)  # a cache of 70 keys
    # a p-weighted sum (sum of p = 1) of the window's 30 values: key blocks of another size (a GPU tunes them by
    # Tq) reorder it, up to 30 * eps * max|v| apart
    torch.testing.assert_close(step, full[:, :, -1:], atol=30 * torch.finfo(torch.float32).eps * v.abs().max().item(),
                               rtol=1e-5)


@needs_triton
@pytest.mark.skipif(not CUDA, reason="a GPU's limit; the interpreter would take minutes for 65,600 programs")
def test_more_than_65535_batch_times_heads_in_one_launch():
    # CUDA allows 65,535 programs on a grid's second axis: a decode step of a large batch has more
    q, k, v, grad, _ = make(spec(B=4100, Hq=16, Hkv=4, Tq=1, Tk=20, D=16), torch.float16)
    got = forward_backward(kernels.flash_attention, q, k, v, grad, causal=True)
    want = forward_backward(reference, *(x.float() for x in (q, k, v, grad)), causal=True)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.float(), b, atol=2e-2, rtol=2e-2)


@needs_triton
def test_strided_views_give_the_same_result_as_contiguous_copies():
    # q, k, v sliced out of one packed (B, T, 3, H, D) projection, as a model produces them, and an
    # upstream gradient whose last dimension is not contiguous
    B, T, H, D = 2, 50, 2, 32
    packed = torch.randn(B, T, 3, H, D, device=DEVICE)
    q, k, v = (packed[:, :, i].transpose(1, 2) for i in range(3))  # (B, H, T, D) views
    grad = torch.randn(B, H, D, T, device=DEVICE).transpose(-2, -1)
    got = forward_backward(kernels.flash_attention, q, k, v, grad, causal=True)
    want = forward_backward(kernels.flash_attention, q.contiguous(), k.contiguous(), v.contiguous(),
                            grad.contiguous(), causal=True)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    out = got[0]
    assert out.transpose(1, 2).is_contiguous()  # heads side by side: merging them is a view


@needs_triton
def test_torch_compile_captures_forward_and_backward_in_one_graph():
    # aot_eager traces the op through its fake (meta) implementation and the registered autograd
    # formula, as inductor does, without generating code; fullgraph fails on any graph break.
    q, k, v, grad, kw = make(spec(Hq=4, Tq=40, Tk=50, alibi=True, pad=True, causal=True), torch.float32)

    def loss(q, k, v):
        return (kernels.flash_attention(q, k, v, **kw) * grad).sum()

    def loss_and_grads(f):
        qkv = [x.detach().requires_grad_() for x in (q, k, v)]
        value = f(*qkv)
        value.backward()
        return [value] + [x.grad for x in qkv]

    compiled = torch.compile(loss, backend="aot_eager", fullgraph=True)
    for a, b in zip(loss_and_grads(compiled), loss_and_grads(loss)):
        torch.testing.assert_close(a, b)


@needs_triton
def test_custom_ops_pass_torch_library_opcheck():
    q, k, v, grad, kw = make(spec(Hkv=1, Tq=20, Tk=30, D=16, alibi=True, pad=True), torch.float32)
    fwd = (q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), kw["alibi_slopes"],
           kw["key_padding_mask"], 0.25, True, 0)
    torch.library.opcheck(torch.ops.nanoformer.flash_attention.default, fwd)
    out, lse = torch.ops.nanoformer.flash_attention(*fwd)
    bwd = (grad, q.detach(), k.detach(), v.detach(), out.detach(), lse, *fwd[3:])
    torch.library.opcheck(torch.ops.nanoformer.flash_attention_backward.default, bwd)


@needs_triton
@pytest.mark.parametrize("bad, message", [
    (dict(k=torch.zeros(1, 3, 8, 16)), "Hq % Hkv"),  # 4 query heads cannot share 3 key heads
    (dict(k=torch.zeros(1, 2, 8, 32), v=torch.zeros(1, 2, 8, 32)), "expected q"),  # head sizes differ
    (dict(v=torch.zeros(1, 2, 8, 16, dtype=torch.float64)), "dtype"),
    (dict(alibi_slopes=torch.ones(3)), "alibi_slopes"),
    (dict(key_padding_mask=torch.ones(1, 9, dtype=torch.bool)), "key_padding_mask"),
    (dict(key_padding_mask=torch.zeros(1, 8)), "must be bool"),  # an additive mask, 0 where kept
    (dict(window=-1), "window"),
    (dict(scale=0.0), "scale"),
    (dict(q=torch.zeros(4, 8, 16)), "expected q"),  # no batch dimension
])
def test_invalid_arguments_are_refused_with_a_message(bad, message):
    args = dict(q=torch.zeros(1, 4, 8, 16), k=torch.zeros(1, 2, 8, 16), v=torch.zeros(1, 2, 8, 16))
    args.update(bad)
    with pytest.raises(ValueError, match=message):
        kernels.flash_attention(**{n: x.to(DEVICE) if torch.is_tensor(x) else x for n, x in args.items()})


def test_without_triton_the_module_imports_and_the_kernel_says_to_install_it(run):
    code, _, err = run(sys.executable, "-c",
                       "import sys; sys.modules['triton'] = None\n"  # makes `import triton` fail
                       "import torch, kernels\n"
                       "assert kernels.available is False\n"
                       "try:\n"
                       "    kernels.flash_attention(*torch.zeros(3, 1, 1, 4, 16))\n"
                       "except RuntimeError as e:\n"
                       "    assert 'pip install triton' in str(e), e\n"
                       "else:\n"
                       "    raise AssertionError('no error')\n", cwd=HERE)
    assert code == 0, err


# ----------------------------------------------------------------------------------------------
# The kernel inside model.py (conftest's tiny_model: vocab 61, context 32, 2 layers, 4 heads of 8)

MODEL_CASES = [
    dict(arch="decoder", pos="alibi", window=5, n_kv_head=2),
    dict(arch="decoder", pos="rope", n_kv_head=1, mlp="swiglu", norm="rmsnorm"),
    dict(arch="encoder", pos="learned", norm_first=False, padded=True),
    dict(arch="encoder-decoder", pos="sinusoidal", n_kv_head=2, padded=True),
]


@needs_triton
@pytest.mark.parametrize("kw", MODEL_CASES, ids=lambda kw: "-".join(map(str, kw.values())))
def test_a_model_on_the_kernel_has_the_logits_and_gradients_of_the_math_path(kw, tiny_model):
    kw = dict(kw)
    padded = kw.pop("padded", False)
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 40, (2, 12), generator=g).to(DEVICE)
    src = torch.randint(0, 40, (2, 9), generator=g).to(DEVICE) if kw["arch"] == "encoder-decoder" else None
    valid = torch.ones(2, 12 if src is None else 9, dtype=torch.bool, device=DEVICE)
    if padded:
        valid[0, -4:] = False  # the real tokens never see these; padded rows themselves may differ
    targets = idx.masked_fill(~valid, -100) if kw["arch"] == "encoder" and padded else idx
    results = []
    for impl in ("triton", "math"):
        model = tiny_model(attn_impl=impl, **kw).to(DEVICE).train()
        inputs = dict(src=src, src_mask=valid if padded else None) if src is not None else \
            dict(mask=valid if padded else None)
        logits, loss = model(idx, targets, **inputs)
        loss.backward()
        real = logits[valid] if kw["arch"] == "encoder" else logits
        results.append((real, {n: p.grad for n, p in model.named_parameters()}))
    (a, grads_a), (b, grads_b) = results
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], rtol=1e-4, atol=1e-5, msg=name)


@needs_triton
@pytest.mark.parametrize("kw", [MODEL_CASES[0], MODEL_CASES[3]], ids=["decoder-alibi-window-gqa", "encoder-decoder"])
def test_cached_generation_on_the_kernel_equals_the_math_path(kw, tiny_model):
    kw = {k: v for k, v in kw.items() if k != "padded"}
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 40, (2, 1 if kw["arch"] == "encoder-decoder" else 6), generator=g).to(DEVICE)
    src = torch.randint(0, 40, (2, 9), generator=g).to(DEVICE) if kw["arch"] == "encoder-decoder" else None
    out = [generate(tiny_model(attn_impl=impl, **kw).to(DEVICE), idx, 8, temperature=0, src=src)
           for impl in ("triton", "math")]
    assert torch.equal(out[0], out[1])


@needs_triton
@pytest.mark.parametrize("pos", ["rope", "alibi"])
def test_past_block_size_a_kernel_model_slides_the_window_the_math_path_does(pos, tiny_model):
    # relative positions: a cached model sees the last block_size keys, prompt and output alike; a
    # model set to the kernel reads its cache's ring through SDPA's dense bias
    idx = torch.randint(0, 40, (2, 20), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    logits = []
    for impl in ("triton", "math"):
        model = tiny_model(attn_impl=impl, pos=pos, block_size=8).to(DEVICE)
        model.setup_kv_cache(2, cache_size(model, 16, 4))
        with torch.no_grad():  # a prefill twice block_size long, then one token at a time
            out = [prefill(model, idx[:, :16], torch.arange(16, device=DEVICE))[:, None]]
            out += [model(idx[:, t : t + 1], input_pos=torch.tensor([t], device=DEVICE))[0] for t in range(16, 20)]
        logits.append(torch.cat(out, dim=1))
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-4, atol=1e-5)


@needs_triton
def test_under_autocast_the_kernel_decodes_speculatively_and_with_int8_weights(tiny_model):
    # autocast casts SDPA's inputs but not a custom op's: the kernel's path meets autocast's dtype
    # itself (a draft's cache, an int8 layer's output and the rest would otherwise disagree)
    idx = torch.randint(0, 40, (1, 6), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    def greedy(impl, int8=False):
        model = tiny_model(attn_impl=impl).to(DEVICE)
        return generate(quantize_int8(model) if int8 else model, idx, 8, temperature=0)
    with torch.no_grad(), torch.autocast(DEVICE, dtype=torch.float16):
        want = greedy("math")
        target, draft = tiny_model(attn_impl="triton").to(DEVICE), tiny_model(1, attn_impl="triton", n_layer=1).to(DEVICE)
        assert torch.equal(speculative_generate(target, draft, idx, 8, k=3, temperature=0)[0], want)
        assert torch.equal(greedy("triton", int8=True), greedy("math", int8=True))


@needs_triton
def test_auto_on_a_gpu_mixes_the_kernel_and_sdpa_per_mask_and_computes_what_the_math_path_does(monkeypatch,
                                                                                               tiny_model):
    # an encoder-decoder with a padded source, as "auto" runs it on a GPU (here the CPU stands in,
    # and 8 queries count as many): the padded masks go to the kernel, the decoder's plain causal
    # self-attention and every one-query decode step to SDPA
    import model
    chosen, pick = [], model.attn_impl
    def on_gpu(config, device, training, mask, Tq):
        chosen.append((pick(config, torch.device("cuda"), training, mask, Tq), Tq))
        return chosen[-1][0]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(model, "attn_impl", on_gpu)
    monkeypatch.setattr(model, "KERNEL_MIN_QUERIES", 8)
    kw = dict(arch="encoder-decoder", pos="sinusoidal", n_kv_head=2, block_size=4096)
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 40, (2, 12), generator=g).to(DEVICE)
    src = torch.randint(0, 40, (2, 9), generator=g).to(DEVICE)
    valid = torch.ones(2, 9, dtype=torch.bool, device=DEVICE)
    valid[0, -4:] = False
    results = []
    for impl in ("auto", "math"):
        net = tiny_model(attn_impl=impl, **kw).to(DEVICE).train()  # training: the path a training batch takes
        logits, loss = net(idx, idx, src=src, src_mask=valid)
        loss.backward()
        out = generate(net.eval(), idx[:, :1], 2, temperature=0, src=src, src_mask=valid)  # a prefill, a cached step
        results.append((logits, [p.grad for p in net.parameters()], out))
        if impl == "auto":
            assert {c for c, Tq in chosen if Tq > 1} == {"triton", "sdpa"}
            assert {c for c, Tq in chosen if Tq == 1} == {"sdpa"}
    (a, grads_a, out_a), (b, grads_b, out_b) = results
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    for x, y in zip(grads_a, grads_b):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5)
    assert torch.equal(out_a, out_b)


def test_auto_takes_the_kernel_on_cuda_only_where_it_applies(monkeypatch):
    window, alibi, padded = Mask(True, window=8), Mask(True, alibi=torch.ones(4)), Mask(valid=torch.ones(1, 8) > 0)
    def pick(device, training=False, mask=window, block_size=4096, Tq=4096, **kw):
        return attn_impl(ModelConfig(block_size=block_size, **kw), torch.device(device), training, mask, Tq)
    capability = [(9, 0)]  # an H100's, asked of the (possibly absent) GPU
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability[0])
    kernel = "triton" if kernels.available else "sdpa"
    assert pick("cpu") == "sdpa" and pick("cuda") == pick("cuda", mask=alibi) == pick("cuda", mask=padded) == kernel
    # plain causal (or no mask): SDPA's own fused kernels, cuDNN's on an H100, are faster
    assert pick("cuda", mask=Mask(True)) == pick("cuda", mask=Mask()) == "sdpa"
    assert pick("cuda", mask=Mask(True), attn_impl="triton") == "triton"
    # at 1024 positions SDPA with a dense bias was faster too; at 4096 the kernel was
    assert pick("cuda", block_size=2048) == "sdpa" and pick("cuda", block_size=2048, attn_impl="triton") == "triton"
    # a decode step (one query) or a few queries: SDPA, whatever the mask; the kernel from one block of queries
    assert pick("cuda", Tq=1) == pick("cuda", Tq=63, mask=alibi) == "sdpa" and pick("cuda", Tq=64) == kernel
    assert pick("cuda", Tq=1, attn_impl="triton") == "triton"
    assert pick("cuda", pos="relative") == "sdpa"  # no T5 bias in the kernel
    assert pick("cuda", window=8, n_global=2) == "sdpa"  # nor global tokens: SDPA takes them in its dense bias
    assert pick("cuda", training=True, dropout=0.1) == "sdpa" and pick("cuda", dropout=0.1) == kernel
    assert pick("cuda", n_embd=512, n_head=4) == kernel and pick("cuda", n_embd=1024, n_head=4) == "sdpa"  # hs 256
    assert pick("cuda", attn_impl="math") == "math"
    capability[0] = (8, 0)  # an A100's, the first with bf16 tensor-core products
    assert pick("cuda") == kernel
    capability[0] = (7, 5)  # a T4: none
    assert pick("cuda") == "sdpa" and pick("cuda", attn_impl="triton") == "triton"
