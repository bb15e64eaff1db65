"""Weights stored for decoding, beside the model (as gpt-fast keeps quantize.py): quantize_int8(model)
swaps every Linear layer for an Int8Linear, in place, after the weights are loaded; decode_layout(model)
lays the fp weights out for a CPU's matrix-vector products."""

import torch
import torch.nn as nn
import torch.nn.functional as F

from model import autocast_dtype


class Int8Linear(nn.Module):
    """A Linear layer with its weights stored as int8, one scale per output channel (4x smaller
    than fp32, 2x than bf16). Decoding one token at a time is bound by reading the weights, so
    smaller weights read faster where a kernel multiplies int8 directly."""

    def __init__(self, linear):
        super().__init__()
        w = linear.weight.detach().float()
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127  # the largest weight of a row maps to 127
        self.register_buffer("weight", torch.round(w / scale[:, None]).to(torch.int8).contiguous())
        self.register_buffer("scale", scale.to(linear.weight.dtype))
        self.bias = linear.bias

    def forward(self, x):
        dtype = autocast_dtype(x.device, x.dtype)  # as autocast would run nn.Linear
        x, scale = x.to(dtype), self.scale.to(dtype)
        if x.device.type == "cpu" and hasattr(torch, "_weight_int8pack_mm"):  # torch's int8 x float kernel
            y = torch._weight_int8pack_mm(x.reshape(-1, x.size(-1)), self.weight, scale)
            y = y.view(*x.shape[:-1], self.weight.size(0))  # not -1: x may hold no rows (an idle expert)
        else:
            y = F.linear(x, self.weight.to(dtype)) * scale
        return y if self.bias is None else y + self.bias.to(dtype)


def quantize_int8(model):
    """Replace every nn.Linear in model by an Int8Linear (in place); returns the model."""
    for name, child in model.named_children():
        if isinstance(child, nn.Linear):
            setattr(model, name, Int8Linear(child))
        else:
            quantize_int8(child)
    return model


def decode_layout(model):
    """Store each Linear layer's weight W (out, in) as the transpose of a contiguous (in, out)
    matrix, in place; values, shapes and names stay. F.linear then computes x @ Wᵀ as a plain
    product, which on a CPU streams a matrix-vector product's weights faster (bench.py sample times
    both layouts). A tied embedding then reads its rows strided: one row per token."""
    for m in model.modules():
        if isinstance(m, nn.Linear):
            m.weight.data = m.weight.data.t().contiguous().t()
    return model
