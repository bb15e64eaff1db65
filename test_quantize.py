"""quantize.py: weight-only int8. Each weight rounds by at most half a step of its row's scale, in a
quarter of the bytes; a quantized model keeps its logits and decodes. Models are conftest's
tiny_model (vocab 61, context 32, 2 layers, 4 heads, width 32)."""

import pytest
import torch
import torch.nn as nn

from generate import generate
from quantize import Int8Linear, quantize_int8

V = 61  # tiny_model's vocabulary


def prompt(T, B=1, seed=1):
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kernel", [True, False], ids=["int8-kernel", "dequantized"])
def test_int8_linear_is_within_half_a_step_per_weight_and_4x_smaller(kernel, monkeypatch):
    if not kernel:  # the path of devices without torch's int8 x float kernel (CUDA)
        monkeypatch.delattr(torch, "_weight_int8pack_mm", raising=False)
    torch.manual_seed(0)
    linear = nn.Linear(64, 48)
    q = Int8Linear(linear)
    x = torch.randn(5, 64)
    with torch.no_grad():
        err = (q(x) - linear(x)).abs()
    bound = x.abs() @ (q.scale[:, None].expand(48, 64) / 2).T  # rounding moves each weight by <= step/2
    assert (err <= bound + 1e-5).all()
    assert q.weight.dtype == torch.int8 and q.weight.numel() * 4 == linear.weight.numel() * linear.weight.element_size()
    assert (q.weight.abs().amax(dim=1) == 127).all()  # each row's largest weight uses the full range
    assert q(torch.randn(0, 64)).shape == (0, 48)  # no rows: what an expert gets when no token picks it
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):  # as nn.Linear under autocast
        assert q(x).dtype == linear(x).dtype == torch.bfloat16


def test_quantize_int8_replaces_every_linear_and_keeps_the_logits_close(tiny_model):
    model = tiny_model(pos="rope", n_kv_head=2, mlp="swiglu")
    idx = prompt(10, B=2)
    with torch.no_grad():
        before = model(idx)[0]
        quantize_int8(model)
        after = model(idx)[0]
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert sum(isinstance(m, Int8Linear) for m in model.modules()) == 2 * 4 + 1  # qkv, proj, fc, proj; head
    assert ((after - before).abs().max() / before.abs().max()) < 0.05
    assert generate(model, idx, 5).shape == (2, 15)


def test_an_int8_mixture_of_experts_decodes_though_most_experts_get_no_token(tiny_model):
    model = quantize_int8(tiny_model(n_expert=4, expert_top_k=1))
    assert generate(model, prompt(3, B=1), 4, temperature=0).shape == (1, 7)  # one token a step: 3 experts idle
