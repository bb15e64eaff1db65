"""Properties of kernels.linear, the fp32 products that run through oneDNN on a CPU where torch's
default library is the slower: the same values and gradients as F.linear to fp32 rounding, and
oneDNN only where it applies."""

import copy

import pytest
import torch

import kernels
from model import ModelConfig, Transformer

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


@pytest.fixture
def onednn_calls(monkeypatch):
    """The number of products that went through oneDNN, as a one-element list."""
    calls = [0]
    apply = kernels._OneDNNLinear.apply

    def counted(*args):
        calls[0] += 1
        return apply(*args)
    monkeypatch.setattr(kernels._OneDNNLinear, "apply", counted)
    return calls


def values_and_grads(x, w, b, impl):
    """linear's output and the gradients of x, w, b (b may be None) for a fixed upstream gradient."""
    x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
    b = b.detach().requires_grad_() if b is not None else None
    y = kernels.linear(x, w, b, impl)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=y.dtype)
    y.backward(dy)
    return y, x.grad, w.grad, None if b is None else b.grad


@needs_onednn
@pytest.mark.parametrize("bias", [True, False])
# (..., M, K, N): x (..., M, K), w (N, K); K < N and K > N take the weight gradient's two orders
@pytest.mark.parametrize("shape", [(768, 128, 512), (3, 70, 96, 200), (768, 512, 128)])
def test_onednn_gives_torchs_values_and_gradients_to_fp32_rounding(shape, bias, onednn_calls):
    *lead, K, N = shape
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(*lead, K, generator=g), torch.randn(N, K, generator=g) / K**0.5, torch.randn(N, generator=g)
    b = b if bias else None
    ours = values_and_grads(x, w, b, "onednn")
    assert onednn_calls[0] == 1
    exact = values_and_grads(x.double(), w.double(), None if b is None else b.double(), "torch")
    theirs = values_and_grads(x, w, b, "torch")
    for o, e, t in zip(ours, exact, theirs):
        if e is None:
            assert o is None and t is None
            continue
        assert o.dtype == torch.float32 and o.shape == e.shape
        # as close to the float64 result as torch's own fp32 product is, within a small factor:
        # fp32 sums (a bf16 or TF32 product would be about 1e3 times farther)
        scale = e.abs().max().item()
        assert (o.double() - e).abs().max().item() < max(4 * (t.double() - e).abs().max().item(), 1e-6 * scale)


@needs_onednn
def test_onednn_reads_a_transposed_input(onednn_calls):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(128, 256, generator=g).t()  # (256, 128), not contiguous
    w = torch.randn(64, 128, generator=g)
    ours, theirs = values_and_grads(x, w, None, "onednn"), values_and_grads(x, w, None, "torch")
    assert onednn_calls[0] == 1
    for o, t in zip(ours[:3], theirs[:3]):
        torch.testing.assert_close(o, t, rtol=1e-5, atol=1e-5)


@needs_onednn
def test_onednn_takes_only_large_fp32_cpu_products_outside_autocast(onednn_calls, monkeypatch):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(256, 64, generator=g)
    large = torch.randn(64, 64, generator=g)  # 64 * 64 * 256 = 2**20 multiply-adds: just large enough
    small = large[:63]
    for x, impl, used in [(large, "onednn", 1), (small, "onednn", 0), (large, "torch", 0),
                          (large.double(), "onednn", 0)]:
        before = onednn_calls[0]
        kernels.linear(x, w.to(x.dtype), None, impl)
        assert onednn_calls[0] - before == used, (x.shape, x.dtype, impl)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast's bf16 product, as for nn.Linear
        assert kernels.linear(large, w, None, "onednn").dtype == torch.bfloat16
    assert onednn_calls[0] == 1
    for measured, used in [(True, 1), (False, 0)]:  # "auto" follows the measurement
        monkeypatch.setattr(kernels, "_onednn_faster", measured)
        before = onednn_calls[0]
        kernels.linear(large, w)
        assert onednn_calls[0] - before == used


def test_measuring_onednn_leaves_the_random_stream_alone(monkeypatch):
    monkeypatch.setattr(kernels, "_onednn_faster", None)
    state = torch.get_rng_state()
    assert kernels.onednn_faster() in (True, False)
    assert torch.equal(torch.get_rng_state(), state)
    assert kernels._onednn_faster is not None  # measured once, then kept


@needs_onednn
@pytest.mark.parametrize("arch, extra", [("decoder", dict(bias=True)), ("encoder", {}),
                                         ("encoder-decoder", dict(n_expert=4, n_kv_head=2))])
def test_a_model_on_onednn_computes_what_it_computes_on_torch(arch, extra, onednn_calls, monkeypatch):
    # every product through oneDNN (the threshold lowered to one multiply-add), attention's
    # projections, the MLP's, each expert's (some get no token) and the output layer
    monkeypatch.setattr(kernels, "ONEDNN_MIN_MACS", 1)
    config = ModelConfig(arch=arch, vocab_size=96, block_size=32, n_layer=2, n_head=4, n_embd=64,
                         linear_impl="onednn", **extra)
    torch.manual_seed(0)
    ours = Transformer(config)
    theirs = copy.deepcopy(ours)
    theirs.config.linear_impl = "torch"  # every module reads the one config
    assert ours.config.linear_impl == "onednn"
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 96, (4, 32), generator=g)
    src = torch.randint(0, 96, (4, 32), generator=g) if arch == "encoder-decoder" else None
    losses = []
    for model in (ours, theirs):
        _, loss = model(idx, targets=idx.roll(-1, 1), src=src)
        loss.backward()
        losses.append(loss.item())
    assert onednn_calls[0] >= 2 * config.n_layer
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
        if q.grad is None:  # an expert that no token reached
            assert p.grad is None, name
            continue
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6 * q.grad.abs().max().item(), msg=name)
