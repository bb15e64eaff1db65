"""Weights stored for decoding, beside the model (as gpt-fast keeps quantize.py): quantize_int8(model)
and quantize_int4(model) swap the Linear layers for Int8Linear or Int4Linear, in place, after the
weights are loaded; decode_layout(model) lays the fp weights out for a CPU's matrix-vector products.

Decoding one token at a time is bound by reading the weights, so smaller weights decode faster where
a kernel multiplies them without first writing them out in floating point. Both layers hand torch's
kernels bf16 activations: on a CPU those kernels are vectorized (AVX2, AVX-512) for bf16 only, and
fp32 activations take a scalar loop, 4x (int8) and 9x (int4) slower than fp32's own product (the
measurements: docs/performance.md). Each kernel accumulates in fp32 and rounds its output
to bf16; the result comes back in the dtype the layer was called with."""

import torch
import torch.nn as nn
import torch.nn.functional as F

from model import autocast_dtype

INT4_GROUP_SIZES = (32, 64, 128, 256)  # what torch's int4 kernels take


class Int8Linear(nn.Module):
    """A Linear layer with its weights stored as int8, one bf16 scale per output channel (4x
    smaller than fp32, 2x than bf16): the weight is weight * scale.view(torch.bfloat16)[:, None]."""

    def __init__(self, linear):
        super().__init__()
        w = linear.weight.detach().float()
        # a row's largest weight maps to 127: rounding the scale to bf16 (2^-8) moves 127 by less than 0.5
        scale = (w.abs().amax(dim=1).clamp(min=1e-12) / 127).bfloat16()
        self.register_buffer("weight", torch.round(w / scale.float()[:, None]).to(torch.int8).contiguous())
        # bf16, as torch's kernel takes it, held as its int16 bits: model.to(dtype) leaves integers be,
        # and a cast at each call would stop torch.compile (inductor's lowering takes a stored scale only)
        self.register_buffer("scale", scale.view(torch.int16))
        self.bias = linear.bias

    def forward(self, x):
        dtype = autocast_dtype(x.device, x.dtype)  # as autocast would run nn.Linear
        scale = self.scale.view(torch.bfloat16)
        # torch's int8 x bf16 kernel loads 16 columns at a time from 32-byte aligned rows: it needs
        # in_features % 16 == 0 (other widths crash the process); elsewhere (and on a GPU) the
        # weight is converted at every call, which saves memory but not memory traffic.
        if x.device.type == "cpu" and self.weight.size(1) % 16 == 0:
            rows = x.reshape(-1, x.size(-1)).to(torch.bfloat16)
            y = torch._weight_int8pack_mm(rows, self.weight, scale).to(dtype)
            y = y.view(*x.shape[:-1], self.weight.size(0))  # not -1: x may hold no rows (an idle expert)
        else:
            y = F.linear(x.to(dtype), self.weight.to(dtype)) * scale.to(dtype)
        return y if self.bias is None else y + self.bias.to(dtype)


def int4_groups(w, group_size):
    """w (out, in) as q (out, in) in 0..15, int32, and scales_and_zeros (in / group_size, out, 2) in
    bf16, with w ≈ (q - 8) * scale + zero in each group of group_size along `in`: each group's
    [min, max] spread over the 16 levels (gpt-fast's asymmetric scheme, the layout torch's kernels
    read). q is rounded against the bf16 scale and zero, the ones the kernels multiply by."""
    g = w.reshape(w.size(0), -1, group_size)  # (out, groups, group_size)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    scale = ((hi - lo) / 15).clamp(min=1e-6).bfloat16().float()  # a constant group still gets a step
    zero = (lo + 8 * scale).bfloat16().float()
    q = torch.round((g - (zero - 8 * scale)[..., None]) / scale[..., None]).clamp(0, 15)
    return q.to(torch.int32).view(w.shape), torch.stack([scale, zero], dim=-1).transpose(0, 1).bfloat16().contiguous()


def pack_int4(q):
    """q (out, in) in 0..15 in the layout of torch's int4 kernel for q's device (which differs
    between a CPU and CUDA, and between AVX-512 and AVX2 CPUs)."""
    if q.device.type == "cpu":
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)  # innerKTiles: unused on a CPU
    tiles = next(t for t in (8, 4, 2) if q.size(1) % (16 * t) == 0)  # in_features is a multiple of 32
    return torch.ops.aten._convert_weight_to_int4pack((q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8), tiles)


class Int4Linear(nn.Module):
    """A Linear layer with 4-bit weights, a bf16 scale and zero point for each group of group_size
    weights along `in` (gpt-fast's WeightOnlyInt4Linear): 8x smaller than fp32, plus 4 bytes a
    group. The weights are packed once, for the device the Linear is on: a CPU's layout is not
    CUDA's, so the layer runs where it was made."""

    def __init__(self, linear, group_size=128):
        super().__init__()
        w = linear.weight.detach().float()
        self.out_features, self.group_size = w.size(0), group_size
        w = F.pad(w, (0, 0, 0, -w.size(0) % 16))  # the kernels take rows in blocks of 16; the padding's outputs go
        q, scales_and_zeros = int4_groups(w, group_size)
        self.register_buffer("weight", pack_int4(q))
        self.register_buffer("scales_and_zeros", scales_and_zeros.view(torch.int16))  # bf16 bits, as Int8Linear's scale
        self.bias = linear.bias

    def forward(self, x):
        dtype = autocast_dtype(x.device, x.dtype)  # as autocast would run nn.Linear
        cpu = x.device.type == "cpu"
        if cpu != (self.weight.dim() == 2):  # the CPU's packing is 2-d, CUDA's 4-d
            raise RuntimeError(f"Int4Linear packed for {'CUDA' if cpu else 'a CPU'} called on {x.device}: "
                               "quantize_int4 the model on the device it runs on")
        mm = torch.ops.aten._weight_int4pack_mm_for_cpu if cpu else torch.ops.aten._weight_int4pack_mm
        rows = x.reshape(-1, x.size(-1)).to(torch.bfloat16)
        y = mm(rows, self.weight, self.group_size, self.scales_and_zeros.view(torch.bfloat16))
        y = y[:, :self.out_features].to(dtype).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias.to(dtype)


def replace_linears(model, make):
    """Replace each nn.Linear in model, in place, by make(linear); returns the model."""
    for name, child in model.named_children():
        if isinstance(child, nn.Linear):
            setattr(model, name, make(child))
        else:
            replace_linears(child, make)
    return model


def quantize_int8(model):
    """Replace every nn.Linear in model by an Int8Linear (in place); returns the model. A tied
    lm_head gets its own int8 copy; the embedding keeps its weights."""
    return replace_linears(model, Int8Linear)


def quantize_int4(model, group_size=128):
    """Replace every nn.Linear in model by an Int4Linear in groups of group_size (in place), packed
    for the device model is on: move the model there first. Returns the model. A layer whose
    in_features group_size does not divide stays as it is (torch's kernels read whole groups). A
    tied lm_head gets its own int4 copy; the embedding keeps its weights."""
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"group_size={group_size}: choose among {list(INT4_GROUP_SIZES)}")
    if not hasattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu"):
        raise RuntimeError(f"int4 weights need torch >= 2.6 (its int4 kernels' layout); this is {torch.__version__}")
    return replace_linears(model, lambda m: Int4Linear(m, group_size) if m.in_features % group_size == 0 else m)


def decode_layout(model):
    """Lay each Linear layer out for decoding on a CPU, in place; values, shapes and names stay.
    Its weight W (out, in) is stored as the transpose of a contiguous (in, out) matrix, so F.linear
    computes x @ Wᵀ as a plain product, which streams a matrix-vector product's weights faster (bench.py
    sample times both layouts); and a plain fp32 nn.Linear of two SPLIT_BYTES or more becomes a
    SplitLinear, in blocks of SPLIT_BYTES or more, one a thread at most. A tied embedding then reads its
    rows strided: one row per token."""
    for m in model.modules():
        if isinstance(m, nn.Linear):
            m.weight.data = m.weight.data.t().contiguous().t()
    parts = lambda m: min(torch.get_num_threads(), m.weight.nbytes // SPLIT_BYTES)  # noqa: E731
    fp32 = lambda m: type(m) is nn.Linear and m.weight.dtype == torch.float32  # noqa: E731
    return replace_linears(model, lambda m: SplitLinear(m, parts(m)) if fp32(m) and parts(m) > 1 else m)


SPLIT_BYTES = 2 ** 21  # below about 2 MB a block, splitting costs more than it saves


class SplitLinear(nn.Linear):
    """A Linear layer whose product with one row of input runs on several cores. torch's fp32
    matrix-vector product on a CPU runs on one core, which reads the weights at about half the rate
    that two do (docs/performance.md). A batched product runs its batch on all of torch's threads:
    so the (in, out) weight's columns are viewed, without a copy, as `parts` blocks (parts, in,
    out / parts), and the row multiplies each block at once. Several rows (a prompt) take torch's
    own multi-threaded product, as do other dtypes (torch's bf16 bmm would copy the blocks at every
    call), autocast and autograd."""

    def __init__(self, linear, parts):
        super().__init__(linear.in_features, linear.out_features, bias=False, device="meta")  # no weight of its own
        self.weight, self.bias, self.parts = linear.weight, linear.bias, parts  # the same tensors: ties hold

    def forward(self, x):
        if (x.numel() != x.size(-1) or self.weight.dtype != torch.float32 or torch.is_grad_enabled()
                or torch.is_autocast_enabled(x.device.type)):
            return F.linear(x, self.weight, self.bias)
        mv = split_mv if torch.compiler.is_compiling() else split_product  # see split_mv
        y = mv(x.reshape(1, -1), self.weight.t(), self.parts)
        return (y if self.bias is None else y + self.bias).view(*x.shape[:-1], self.out_features)


def split_product(x: torch.Tensor, w: torch.Tensor, parts: int) -> torch.Tensor:
    """x (1, in) @ w (in, out), contiguous, as one batched product of `parts` column blocks."""
    q = w.size(1) // parts  # a block's columns; the last out % parts take a plain product
    blocks = w[:, :parts * q].reshape(w.size(0), parts, q).transpose(0, 1)  # (parts, in, q): a view
    y = torch.bmm(x.reshape(1, 1, -1).expand(parts, 1, -1), blocks).view(1, parts * q)
    return y if parts * q == w.size(1) else torch.cat([y, x @ w[:, parts * q:]], dim=1)


# The same as an operator of its own, for torch.compile, which calls it as it is (inductor would rewrite a
# bmm of one row as a slower sum). Eager calls the function: an operator's first call costs most of a second.
split_mv = torch.library.custom_op("nanoformer::split_mv", split_product, mutates_args=())


@split_mv.register_fake
def _(x, w, parts):
    return x.new_empty(1, w.size(1))
