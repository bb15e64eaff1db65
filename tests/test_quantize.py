"""quantize.py: weight-only int8 and int4, W8A8 and W4A8 (w4a8.cpp). Each layer computes the product of its dequantized weights
to within the rounding of its arithmetic; each weight rounds by at most half a step; a quantized model
keeps its logits and decodes. Models are conftest's tiny_model (vocab 61, context 32, 2 layers, 4
heads, width 32).

The bound on a product: y = x @ ŵᵀ summed in fp32 over `in` terms is within in * 2^-24 * Σ|x||ŵ| of
the exact sum (each addition rounds by at most 2^-24 relative), and a scale multiplied after it (or
the int4 kernel's fp32 dequantization of each weight) adds 2^-24 * Σ|x||ŵ| (as |y| <= Σ|x||ŵ|).
The CPU kernels also round their input x and their output to bf16, 2^-8 relative each (8
significant bits): each adds at most 2^-8 * Σ|x||ŵ|. A bias added in fp32 rounds by 2^-24 of the
result."""

import copy
import platform

import pytest
import torch
import torch.nn as nn
from torch._dynamo.utils import counters

import generate as generate_module
import common
from common import UsageError
import quantize as quantize_module
from generate import generate
from lora import LoRALinear
from generate import SplitLinear, decode_layout
from quantize import (Int4DynamicLinear, Int4Linear, Int8DynamicLinear, Int8Linear, int4_groups, quantize_int4,
                      quantize_int4_dynamic, quantize_int8, quantize_int8_dynamic, runs_here, w4a8_kernel)

V = 61  # tiny_model's vocabulary
BF16 = 2.0**-8  # the relative rounding of a bf16 (8 significant bits), to nearest
FP32 = 2.0**-24
ARCHS = {"decoder, GQA": dict(pos="rope", n_kv_head=2, mlp="swiglu"),
         "mixture of experts": dict(n_expert=4, expert_top_k=4),  # every expert: no routing to flip on a rounding
         "encoder": dict(arch="encoder"),
         "encoder-decoder": dict(arch="encoder-decoder", pos="relative", norm="rmsnorm")}


def prompt(T, B=1, seed=1):
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


def rounding_bound(x, w, b, bf16_roundings):
    """x @ wᵀ + b in float64 and the bound of the module docstring on a product's distance from it."""
    x, w, b = x.double(), w.double(), b.double()
    exact = x @ w.T + b
    bound = (bf16_roundings * BF16 + (x.size(-1) + 1) * FP32) * (x.abs() @ w.abs().T) + FP32 * exact.abs()
    return exact, bound * 1.01  # 1.01: the bound's second-order terms


def assert_within_rounding(y, x, w, b, bf16_roundings):
    exact, bound = rounding_bound(x, w, b, bf16_roundings)
    assert ((y.double() - exact).abs() <= bound).all()


def dequantized_int4(w, group_size):
    """The weights an Int4Linear multiplies by: (q - 8) * scale + zero, group by group."""
    q, scales_and_zeros = int4_groups(w.detach().float(), group_size)
    scale, zero = scales_and_zeros.double().transpose(0, 1).unbind(-1)  # (out, groups) each
    return ((q.view(q.size(0), -1, group_size) - 8) * scale[..., None] + zero[..., None]).view(q.shape)


CXX = pytest.mark.skipif(not runs_here("int4-dynamic", torch.device("cpu")), reason="w4a8.cpp needs a C++ compiler")
INDUCTOR = pytest.mark.skipif(not generate_module.cxx(), reason="inductor compiles a CPU step with a C++ compiler")


def uneven_linear(n_in, n_out, group_size):
    """A Linear whose groups of weights differ in size by factors of up to about 50, so that a group's
    scale or zero point taken for another's shows far beyond rounding."""
    linear = nn.Linear(n_in, n_out)
    with torch.no_grad():
        linear.weight *= (4 ** torch.randn(n_out, n_in // group_size)).repeat_interleave(group_size, dim=1)
    return linear


def w4a8_reference(layer, x):
    """What w4a8.cpp computes, in float64 from its roundings (x in blocks of 32 to 8 bits: 127 / max |x|
    and the product in fp32, rounded half to even, as the kernel does): Σ d q8 · q4 scale over each block, plus
    zero · Σ x over each group (which the kernel sums in float64, then rounds once), plus the bias; and the sizes
    of those terms, Σ |each term|."""
    g, (M, K) = layer.group_size, x.shape
    blocks = x.reshape(M, -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    x8 = (torch.round(blocks * (127 / amax)) * (amax / 127).double()).reshape(M, K)  # each block's d q8
    lo, hi = layer.weight.view(layer.weight.size(0), -1, 16) & 15, layer.weight.view(layer.weight.size(0), -1, 16) >> 4
    q4 = torch.cat([lo, hi], dim=-1).flatten(1).double()  # (out, in): a block's bytes hold weights i and i + 16
    scale, zero = (t.view(torch.float32).double().repeat_interleave(g, dim=1) for t in (layer.scale, layer.zero))
    sums = x.double().reshape(M, -1, g).sum(-1).repeat_interleave(g, dim=1) / g  # Σ x over each group, spread
    bias = layer.bias.double()
    y = x8 @ (q4 * scale).T + sums @ zero.T + bias
    return y, x8.abs() @ (q4 * scale).abs().T + sums.abs() @ zero.abs().T + bias.abs()


GROUPS = [(32, 416), (64, 448), (128, 384), (256, 512)]  # 416 and 448 inputs leave blocks after VNNI's steps of 128


@CXX
@pytest.mark.parametrize("group_size, n_in", GROUPS)
def test_int4_dynamic_linear_computes_w4a8s_product_within_half_a_step_of_each_activation(group_size, n_in):
    """Against the dequantized weights' product x ŵᵀ + b: each activation rounds to 8 bits in blocks of 32 (a
    step d = max |x| / 127 a block) and multiplies each weight's q * scale = ŵ - zero, the zero points' term
    taking the exact x: within Σ |ŵ - zero| d / 2, plus fp32's rounding. Against w4a8_reference, which
    rounds x as the kernel does: within fp32's rounding of the sums, (blocks + groups + 32) 2^-24 of
    their terms' sizes."""
    torch.manual_seed(0)
    linear = uneven_linear(n_in, 41, group_size)
    q = Int4DynamicLinear(linear, group_size)
    x = torch.randn(5, n_in) * torch.rand(5, 1) * 4
    with torch.no_grad():
        y = q(x)
        reference, sizes = w4a8_reference(q, x)
        w = dequantized_int4(linear.weight, group_size)
    arithmetic = (n_in // 32 + n_in // group_size + 32) * FP32 * sizes
    assert ((y.double() - reference).abs() <= arithmetic).all()
    d = (x.double().abs().reshape(5, -1, 32).amax(-1) / 127).repeat_interleave(32, dim=-1)
    err = (y.double() - (x.double() @ w.T + linear.bias.double())).abs()
    half_steps = (d / 2) @ (w - q.zero.view(torch.float32).double().repeat_interleave(group_size, dim=1)).abs().T
    assert (err <= half_steps + (n_in + 1) * FP32 * sizes).all()
    assert err.max() > 100 * arithmetic.max()  # the activations were rounded: not the weight-only product
    assert q(x[:, None]).shape == (5, 1, 41) and y.dtype == torch.float32 and q(torch.randn(0, n_in)).shape == (0, 41)
    assert q.weight.numel() * 2 == 41 * n_in and q.weight.dtype == torch.uint8  # 4 bits a weight
    with pytest.raises(ValueError, match="group_size=96"):
        Int4DynamicLinear(linear, 96)
    with pytest.raises(RuntimeError, match="group_size is 32, 64 or a multiple of 128"):
        torch.ops.nanoformer.w4a8_linear(x, q.weight, q.scale.view(torch.float32), q.zero.view(torch.float32), 96, None)


@CXX
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="AVX2 is x86's")
@pytest.mark.parametrize("group_size, n_in", GROUPS)
def test_w4a8s_avx2_build_computes_what_the_reference_does(group_size, n_in):
    """w4a8.cpp has a path for AVX-512 VNNI, one for AVX2 and one in plain C++ (which also takes what is
    left after the others' steps). Built again without AVX-512 (a library of its own, in the cache), the
    AVX2 path is within fp32's rounding of w4a8_reference too."""
    torch.manual_seed(1)
    q = Int4DynamicLinear(uneven_linear(n_in, 41, group_size), group_size)
    x = torch.randn(3, n_in)
    w4a8_kernel(("-mno-avx512f",), "w4a8_linear_avx2")
    with torch.no_grad():
        y = torch.ops.nanoformer.w4a8_linear_avx2(x, q.weight, q.scale.view(torch.float32), q.zero.view(torch.float32),
                                                  group_size, q.bias)
        reference, sizes = w4a8_reference(q, x)
    assert ((y.double() - reference).abs() <= (n_in // 32 + n_in // group_size + 32) * FP32 * sizes).all()


def dequantize_model(model, group_size):
    """model's copy in fp32 with each Linear's weights as int4 rounds them."""
    model = copy.deepcopy(model)
    for m in model.modules():
        if isinstance(m, nn.Linear):
            m.weight = nn.Parameter(dequantized_int4(m.weight, group_size).float())
    return model


@pytest.mark.parametrize("n_in", [64, 40], ids=["int8-kernel", "dequantized"])  # the kernel takes in % 16 == 0
def test_int8_linear_computes_its_dequantized_product_within_half_a_step_per_weight(n_in):
    torch.manual_seed(0)
    linear = nn.Linear(n_in, 48)
    q = Int8Linear(linear)
    x = torch.randn(5, n_in)
    scale = q.scale.view(torch.bfloat16).float()[:, None]
    bf16_roundings = 2 if n_in % 16 == 0 else 0  # the kernel's input and output; none converting the weight
    with torch.no_grad():
        y = q(x)
        assert_within_rounding(y, x, q.weight * scale, linear.bias, bf16_roundings)
        # against the weights before rounding: each moved by <= half a step, plus the arithmetic's bound
        exact, bound = rounding_bound(x, q.weight * scale, linear.bias, bf16_roundings)
        half_steps = x.double().abs().sum(-1, keepdim=True) * scale.double().T / 2  # Σ_in |x| * step / 2
        assert ((y.double() - linear(x).double()).abs() <= bound + half_steps).all()
    assert q.weight.dtype == torch.int8 and q.weight.numel() * 4 == linear.weight.numel() * linear.weight.element_size()
    assert (q.weight.abs().amax(dim=1) == 127).all()  # each row's largest weight uses the full range
    assert q(torch.randn(0, n_in)).shape == (0, 48)  # no rows: what an expert gets when no token picks it
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):  # as nn.Linear under autocast
        assert q(x).dtype == linear(x).dtype == torch.bfloat16


def test_int8_dynamic_linear_is_within_half_a_step_of_each_weight_and_each_activation():
    """W8A8: the kernel quantizes the call's activations to 8 bits over their range [min, max] (with 0):
    a step sx = (max - min) / 255; each weight row to its own step sw = max |w| / 127; it sums the integer
    products exactly. So each output is within Σ_in (|x| sw / 2 + |w| sx / 2 + sx sw / 4) of x wᵀ + b, plus
    fp32's rounding of the result."""
    torch.manual_seed(0)
    linear = nn.Linear(64, 48)
    q = Int8DynamicLinear(linear)
    x = torch.randn(5, 64) * torch.rand(5, 1) * 4
    with torch.no_grad():
        y = q(x)
        exact, arithmetic = rounding_bound(x, linear.weight, linear.bias, 0)
    sx = (x.max().clamp(min=0) - x.min().clamp(max=0)).double() / 255
    sw = linear.weight.detach().double().abs().amax(dim=1) / 127  # (out,)
    half_steps = (x.double().abs().sum(-1, keepdim=True) * sw / 2 + linear.weight.detach().double().abs().sum(-1) * sx / 2
                  + 64 * sx * sw / 4)
    err = (y.double() - exact).abs()
    assert (err <= arithmetic + 1.01 * half_steps).all()
    assert err.max() > 100 * arithmetic.max()  # the activations were rounded: not fp32's product
    assert q(x[:, None]).shape == (5, 1, 48) and y.dtype == torch.float32
    assert q(torch.randn(0, 64)).shape == (0, 48)


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_groups_round_each_weight_by_at_most_half_a_step(group_size):
    torch.manual_seed(0)
    w = torch.randn(40, 256) * 0.02
    q, scales_and_zeros = int4_groups(w, group_size)
    scale, zero = scales_and_zeros.float().transpose(0, 1).unbind(-1)  # (out, groups) each
    assert q.min() >= 0 and q.max() <= 15 and scales_and_zeros.shape == (256 // group_size, 40, 2)
    # half a step, but at the ends of a group's range: its bf16 zero moves the 16 levels by 2^-8 |zero|
    bound = (scale / 2 + BF16 * zero.abs()).repeat_interleave(group_size, dim=1)
    assert ((dequantized_int4(w, group_size) - w).abs() <= bound * 1.001).all()


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_linear_computes_its_dequantized_product_and_is_8x_smaller(group_size):
    torch.manual_seed(0)
    linear = nn.Linear(256, 40)  # 40 rows: the kernel's blocks of 16 are padded and the padding dropped
    q = Int4Linear(linear, group_size)
    x = torch.randn(2, 5, 256)
    with torch.no_grad():
        assert_within_rounding(q(x), x, dequantized_int4(linear.weight, group_size), linear.bias, 2)
    assert q.weight.numel() * q.weight.element_size() * 8 == 48 * 256 * 4  # 4 bits a weight, 48 rows padded
    assert q(torch.randn(0, 256)).shape == (0, 40)  # no rows: an idle expert
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert q(x).dtype == linear(x).dtype == torch.bfloat16


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA's int4 and int8 paths (tools/gpu.sh tests runs them)")
@pytest.mark.parametrize("group_size", [32, 128])
def test_on_cuda_int4_and_int8_layers_compute_their_dequantized_products(group_size):
    """CUDA's int4 kernel (_weight_int4pack_mm, its own packing) and int8's fp32 product. int4's bound
    allows a third bf16 rounding: a GPU kernel may dequantize each weight to bf16 before multiplying."""
    torch.manual_seed(0)
    linear = nn.Linear(256, 40).cuda()
    x = torch.randn(2, 5, 256, device="cuda")
    with torch.no_grad():
        q4, q8 = Int4Linear(linear, group_size), Int8Linear(linear)
        assert q4.weight.dim() == 4  # CUDA's packing
        assert_within_rounding(q4(x).cpu(), x.cpu(), dequantized_int4(linear.weight.cpu(), group_size),
                               linear.bias.cpu(), 3)
        w8 = q8.weight.double() * q8.scale.view(torch.bfloat16).double()[:, None]
        # int8 on CUDA multiplies in fp32 (one bf16 rounding allows for TF32's inputs, should it be on)
        assert_within_rounding(q8(x).cpu(), x.cpu(), w8.cpu(), linear.bias.cpu(), 1)


@pytest.mark.parametrize("arch", ARCHS)
def test_quantize_int4_keeps_the_logits_of_every_arch(tiny_model, arch):
    model = tiny_model(**ARCHS[arch])
    idx, src = prompt(10, B=2), dict(src=prompt(7, B=2, seed=2)) if arch == "encoder-decoder" else {}
    with torch.no_grad():
        full, rounded = model(idx, **src)[0], dequantize_model(model, 32)(idx, **src)[0]
        after = quantize_int4(model, group_size=32)(idx, **src)[0]
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    # the dequantized weights' model to within bf16 activations (measured <= 0.004 relative L2)...
    assert (after - rounded).norm() / rounded.norm() < 0.01
    # ...and fp32's to within int4's rounding (measured 0.07-0.13 relative L2 over seeds 0-3)
    assert (after - full).norm() / full.norm() < 0.2


@pytest.mark.parametrize("arch", ["decoder, GQA", "encoder-decoder"])
def test_an_int4_model_decodes(tiny_model, arch):
    model = quantize_int4(tiny_model(**ARCHS[arch]), group_size=32)
    src = dict(src=prompt(7, B=2, seed=2)) if arch == "encoder-decoder" else {}
    assert generate(model, prompt(3, B=2), 5, temperature=0, **src).shape == (2, 8)


def test_quantize_int4_leaves_the_layers_whose_width_its_group_does_not_divide(tiny_model):
    model = quantize_int4(tiny_model(), group_size=64)  # width 32: only the MLP's c_proj (128 wide) is grouped
    assert {type(m.mlp.c_proj) for m in model.decoder.h} == {Int4Linear}
    assert sum(isinstance(m, Int4Linear) for m in model.modules()) == 2
    with pytest.raises(ValueError, match=r"group_size=48: choose among \[32, 64, 128, 256\]"):
        quantize_int4(tiny_model(), group_size=48)


def test_w4a8_without_a_compiler_stops_in_one_line_and_leaves_nothing_in_the_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", "no-such-compiler")
    monkeypatch.setattr(common, "CACHE", str(tmp_path))
    assert not runs_here("int4-dynamic", torch.device("cpu")) and runs_here("int8-dynamic", torch.device("cpu"))
    with pytest.raises(UsageError, match=r"no C\+\+ compiler 'no-such-compiler': install g\+\+ \(or set CXX\)"):
        w4a8_kernel(name="w4a8_linear_uncompiled")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("quantize", [quantize_int8, lambda m: quantize_int4(m, 32),
                                      pytest.param(lambda m: quantize_int4_dynamic(m, 32), marks=CXX)],
                         ids=["int8", "int4", "int4-dynamic"])
def test_a_quantized_model_cast_to_another_dtype_keeps_its_weights_and_scales(tiny_model, quantize):
    model = quantize(tiny_model())
    layers = [m for m in model.modules() if isinstance(m, (Int8Linear, Int4Linear, Int4DynamicLinear))]
    stored = lambda: [b for m in layers for b in m.buffers()]  # noqa: E731
    before, idx = [b.clone() for b in stored()], prompt(6)
    with torch.no_grad():
        full = model(idx)[0]
        half = model.to(torch.bfloat16)(idx)[0]  # as checkpoint.for_sampling casts after quantizing
    assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(before, stored()))  # bf16 scales as int16
    assert half.dtype == torch.bfloat16 and ((half.float() - full).norm() / full.norm()) < 0.02


@pytest.mark.parametrize("quantize, layer", [(quantize_int8, Int8Linear), (quantize_int8_dynamic, Int8DynamicLinear),
                                             pytest.param(lambda m: quantize_int4_dynamic(m, 32), Int4DynamicLinear,
                                                          marks=CXX)],
                         ids=["int8", "int8-dynamic", "int4-dynamic"])
def test_quantize_int8_replaces_every_linear_and_keeps_the_logits_close(tiny_model, quantize, layer):
    model = tiny_model(pos="rope", n_kv_head=2, mlp="swiglu")
    idx = prompt(10, B=2)
    with torch.no_grad():
        before = model(idx)[0]
        quantize(model)
        after = model(idx)[0]
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert sum(isinstance(m, layer) for m in model.modules()) == 2 * 4 + 1  # qkv, proj, fc, proj; head
    assert ((after - before).abs().max() / before.abs().max()) < 0.05
    assert generate(model, idx, 5).shape == (2, 15)


@pytest.mark.parametrize("quantize", [quantize_int8, lambda m: quantize_int4(m, 32),
                                      pytest.param(lambda m: quantize_int4_dynamic(m, 32), marks=CXX)],
                         ids=["int8", "int4", "int4-dynamic"])
def test_a_quantized_mixture_of_experts_decodes_though_most_experts_get_no_token(tiny_model, quantize):
    model = quantize(tiny_model(n_expert=4, expert_top_k=1))
    assert generate(model, prompt(3, B=1), 4, temperature=0).shape == (1, 7)  # one token a step: 3 experts idle


def test_a_w8a8_step_compiles_into_one_graph_and_a_copied_layer_is_one_of_its_own(tiny_model):
    """dynamo cannot trace the W8A8 kernel's packed weights: the compiled step calls each layer's
    product as one operator (quantize.w8a8_linear), so the step is one graph, not one a layer. A copy
    of a layer registers itself under a key of its own, and computes what the original does."""
    model, idx = quantize_int8_dynamic(tiny_model(pos="rope")), prompt(4)
    model.setup_kv_cache(1, 16)
    with torch.no_grad():
        generate_module.prefill(model, idx, torch.arange(4)[None])
        explained = torch._dynamo.explain(generate_module.decode)(model, idx[:, -1:], torch.tensor([[4]]), None, 5)
    model.clear_kv_cache()
    assert explained.graph_count == 1 and explained.graph_break_count == 0
    layer = model.lm_head
    twin = copy.deepcopy(layer)
    x = torch.randn(3, 32)
    assert twin.key != layer.key and quantize_module.W8A8_LAYERS[twin.key] is twin
    with torch.no_grad():
        assert torch.equal(twin(x), layer(x)) and torch.equal(quantize_module.w8a8_linear(x, twin.weight, twin.key),
                                                               layer(x))


@INDUCTOR
@pytest.mark.parametrize("quantize", [quantize_int8, lambda m: quantize_int4(m, 32), quantize_int8_dynamic,
                                      pytest.param(lambda m: quantize_int4_dynamic(m, 32), marks=CXX)],
                         ids=["int8", "int4", "int8-dynamic", "int4-dynamic"])
def test_a_quantized_model_decodes_the_same_through_the_compiled_step(tiny_model, quantize):
    model, idx = quantize(tiny_model(pos="rope")), prompt(4)  # inductor lowers torch's kernels itself
    assert torch.equal(generate(model, idx, 6, temperature=0, compile=True), generate(model, idx, 6, temperature=0))


@pytest.mark.parametrize("parts, bias", [(2, True), (3, False), (4, True)])
def test_a_split_linear_computes_the_linear_product_for_one_row_and_many(parts, bias):
    """Column blocks of the (in, out) weight, each a view, multiplied at once (out = 50 is no multiple
    of 3 or 4: the rest takes a plain product); fp32 sums of `in` terms, in another order."""
    torch.manual_seed(0)
    linear = nn.Linear(24, 50, bias=bias)
    linear.weight.data = linear.weight.data.t().contiguous().t()  # as decode_layout stores it
    split = SplitLinear(linear, parts)
    assert split.weight is linear.weight and split.bias is linear.bias  # no copy: a tie holds
    for x in (torch.randn(1, 1, 24), torch.randn(24), torch.randn(2, 3, 24)):  # one row, a vector, a prompt
        exact = x.double() @ linear.weight.double().T + (linear.bias.double() if bias else 0)
        bound = 25 * FP32 * (x.double().abs() @ linear.weight.double().abs().T) + FP32 * exact.abs()
        with torch.no_grad():
            got = split(x)
        assert got.shape == exact.shape and ((got.double() - exact).abs() <= bound).all()


def test_a_split_linear_splits_only_fp32_rows_without_autograd_or_autocast(monkeypatch):
    calls = []
    product = generate_module.split_product
    monkeypatch.setattr(generate_module, "split_product", lambda *a: calls.append(1) or product(*a))
    linear = nn.Linear(32, 64)
    split, row = SplitLinear(linear, 2), torch.randn(1, 32)
    with torch.no_grad():
        split(row)
        assert len(calls) == 1  # the split product
        split(torch.randn(3, 32))  # a prompt
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert split(row).dtype == linear(row).dtype == torch.bfloat16  # as nn.Linear under autocast
    split(row).sum().backward()  # autograd: the plain product, which has a gradient
    assert len(calls) == 1 and linear.weight.grad is not None
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr(generate_module, "SPLIT_BYTES", 1024)
    bf16 = decode_layout(nn.Sequential(nn.Linear(32, 64)).to(torch.bfloat16))  # torch's bf16 bmm copies its blocks
    assert type(bf16[0]) is nn.Linear
    adapted = decode_layout(nn.Sequential(LoRALinear(nn.Linear(32, 64), rank=4, alpha=8)))
    assert type(adapted[0]) is LoRALinear  # a Linear of another kind keeps its forward (here its update)
    assert type(decode_layout(nn.Sequential(nn.Linear(32, 64)))[0]) is SplitLinear
    small = decode_layout(nn.Sequential(nn.Linear(8, 16)))[0]  # below two blocks: one part, torch's own product
    assert type(small) is SplitLinear and small.parts == 1
    with torch.no_grad():
        small(torch.randn(1, 8))
    assert len(calls) == 1


def test_decode_layout_splits_the_large_layers_and_keeps_the_logits_and_the_tie(tiny_model, monkeypatch):
    model = tiny_model(pos="rope", n_kv_head=2)
    want = model(prompt(5))[0]
    monkeypatch.setattr(generate_module, "SPLIT_BYTES", 3072)  # the attention's 32 x 32 c_proj (4 kB) is less than two blocks
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)  # at most a block a thread
    model = decode_layout(model)
    split = {n: m.parts for n, m in model.named_modules() if isinstance(m, SplitLinear)}
    assert split == {"lm_head": 2, **{f"decoder.h.{i}.{n}": 1 if n == "attn.c_proj" else 2 for i in range(2)
                                      for n in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")}}
    assert model.lm_head.weight is model.wte.weight  # tied still
    assert all(m.weight.t().is_contiguous() for m in model.modules() if isinstance(m, nn.Linear))
    with torch.no_grad():
        torch.testing.assert_close(model(prompt(5))[0], want, rtol=1e-5, atol=1e-5)  # the prompt: F.linear
        a = generate(model, prompt(3), 6, temperature=0)  # the steps: one row, split
        b = generate(tiny_model(pos="rope", n_kv_head=2), prompt(3), 6, temperature=0)
    assert torch.equal(a, b)


@INDUCTOR
def test_split_layers_decode_the_same_through_the_compiled_step(tiny_model, monkeypatch):
    monkeypatch.setattr(generate_module, "SPLIT_BYTES", 3072)  # as above: most layers split in two
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    model = decode_layout(tiny_model(pos="rope"))
    packed = counters["inductor"]["mkldnn_linear_weight_pack_matcher_count"]  # F.linear products packed for MKL
    assert sum(isinstance(m, SplitLinear) for m in model.modules()) == 9  # compiled: frozen_product, one row or two
    for idx in (prompt(4), prompt(4, B=2)):
        assert torch.equal(generate(model, idx, 6, temperature=0, compile=True), generate(model, idx, 6, temperature=0))
    assert counters["inductor"]["mkldnn_linear_weight_pack_matcher_count"] == packed  # no product left to F.linear


@INDUCTOR
def test_a_frozen_fp32_step_laid_out_for_decoding_is_kept_in_inductors_cache_on_disk(tiny_model, monkeypatch,
                                                                                      tmp_path):
    """decode_layout's layers reach a frozen step as batched products, which inductor's MKL weight-pack pass
    leaves alone: a graph holding MKL-packed weights is never written to inductor's cache, so that every
    process compiled fp32's step again (as the model as stored still does). Read back only for the same
    weights: the step read back holds weights its GEMM templates packed, which another model's must not
    take (generate.frozen; so for every frozen step, int8's too)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # empty: the first compile is cold
    seen = []
    for seed in (0, 0, 5):
        model, before = decode_layout(tiny_model(seed, pos="rope")), counters["inductor"].copy()
        out = generate(model, prompt(4), 6, temperature=0, compile=True)
        seen.append({k: counters["inductor"][k] - before[k] for k in ("fxgraph_cache_bypass", "fxgraph_cache_miss",
                                                                     "fxgraph_cache_hit")})
        assert torch.equal(out, generate(model, prompt(4), 6, temperature=0))
    cold, read_back, other_weights = seen
    assert cold["fxgraph_cache_bypass"] == 0 and cold["fxgraph_cache_miss"] > 0
    assert read_back["fxgraph_cache_bypass"] == read_back["fxgraph_cache_miss"] == 0
    assert read_back["fxgraph_cache_hit"] > 0
    assert other_weights["fxgraph_cache_hit"] == 0 and other_weights["fxgraph_cache_miss"] > 0
