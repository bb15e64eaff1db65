"""Weights stored for decoding, beside the model (as gpt-fast keeps quantize.py): quantize_int8(model)
and quantize_int4(model) swap the plain Linear layers for Int8Linear or Int4Linear, in place, after the
weights are loaded; quantize_int8_dynamic(model) and quantize_int4_dynamic(model) for Int8DynamicLinear and
Int4DynamicLinear, which quantize the activations too.

Decoding one token at a time is bound by reading the weights, so smaller weights decode faster where
a kernel multiplies them without first writing them out in floating point. The two weight-only layers hand
torch's kernels bf16 activations: on a CPU those kernels are vectorized (AVX2, AVX-512) for bf16 only, and
fp32 activations take a scalar loop, 4x (int8) and 9x (int4) slower than fp32's own product (the
measurements: docs/performance.md). Each kernel accumulates in fp32 and rounds its output
to bf16; the result comes back in the dtype the layer was called with. W8A8 and W4A8 return fp32."""

import hashlib
import itertools
import os
import shlex
import shutil
import subprocess
import sys
import warnings
import weakref

import torch
import torch.nn as nn
import torch.nn.functional as F

import common
from common import UsageError
from model import autocast_dtype

INT4_GROUP_SIZES = (32, 64, 128, 256)  # what torch's int4 kernels take


def check_group_size(group_size):
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"group_size={group_size}: choose among {list(INT4_GROUP_SIZES)}")


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


class Int8DynamicLinear(nn.Module):
    """W8A8 (--quantize=int8-dynamic), as llama.cpp's Q8_0 multiplies: int8 weights, one scale per
    output channel, and at each call the activations quantized to 8 bits (over the call's rows, from
    their range), multiplied in integers by torch's dynamic quantized kernel (fbgemm on x86; VNNI where
    the CPU has it), fp32 out. CPU only. The weights are packed for the kernel, outside the state dict
    (`weight` holds them plainly, for a reader and the cache's device: twice int8's bytes, half of bf16's)."""

    def __init__(self, linear):
        super().__init__()
        w = linear.weight.detach().float().cpu()
        scale = w.abs().amax(dim=1).clamp(min=1e-12).double() / 127
        with warnings.catch_warnings():  # torch's quantized tensors are deprecated; the kernel is not
            warnings.simplefilter("ignore")
            q = torch.quantize_per_channel(w, scale, torch.zeros_like(scale, dtype=torch.long), 0, torch.qint8)
        bias = None if linear.bias is None else linear.bias.detach().float().cpu()
        self.packed = torch.ops.quantized.linear_prepack(q, bias)  # what the kernel reads
        self.register_buffer("weight", q.int_repr())  # the same int8 weights, as the other layers show theirs
        self.out_features, self.key = w.size(0), register_w8a8(self)

    def __setstate__(self, state):  # a copy (copy.deepcopy, pickle) is a layer of its own to w8a8_linear
        super().__setstate__(state)
        self.key = register_w8a8(self)

    def forward(self, x):
        if x.device.type != "cpu":
            raise RuntimeError(f"Int8DynamicLinear runs on a CPU, not {x.device}: --quantize=int8 or int4 there")
        rows = x.reshape(-1, x.size(-1)).float()
        if torch.compiler.is_compiling():  # see w8a8_linear
            y = w8a8_linear(rows, self.weight, self.key)
        else:
            y = torch.ops.quantized.linear_dynamic(rows, self.packed, False)
        return y.view(*x.shape[:-1], self.out_features).to(x.dtype)


W8A8_LAYERS, W8A8_KEYS = weakref.WeakValueDictionary(), itertools.count()  # key -> Int8DynamicLinear


def register_w8a8(layer):
    key = next(W8A8_KEYS)
    W8A8_LAYERS[key] = layer
    return key


# The product of the Int8DynamicLinear registered as `key`, as an operator of its own for torch.compile:
# dynamo cannot trace the packed weights (a torchbind object), so calling the kernel itself broke the
# compiled step's graph at every layer, slower than eager (docs/performance.md). weight, the layer's int8
# weights, ties the call to the layer in the graph. Eager calls the kernel: an operator's call costs more.
@torch.library.custom_op("nanoformer::w8a8_linear", mutates_args=())
def w8a8_linear(x: torch.Tensor, weight: torch.Tensor, key: int) -> torch.Tensor:
    return torch.ops.quantized.linear_dynamic(x, W8A8_LAYERS[key].packed, False)


@w8a8_linear.register_fake
def _(x, weight, key):
    return x.new_empty(x.size(0), weight.size(0))


class Int4DynamicLinear(nn.Module):
    """W4A8 (--quantize=int4-dynamic), as llama.cpp multiplies Q4_0 by Q8_0: Int4Linear's 4-bit weights (the
    same groups, scales and zero points), and at each call the activations quantized to 8 bits in blocks of 32,
    multiplied in integers by w4a8.cpp (AVX-512 VNNI, else AVX2, else plain C++), fp32 out, the zero points'
    term from the exact activations. CPU only. The weights sit in w4a8.cpp's order: `weight` (out, in / 2) uint8, and
    `scale` and `zero` (out, groups) fp32, held as int32 bits (as Int4Linear holds bf16) so model.to(dtype)
    leaves them be; weight = q * scale + zero."""

    def __init__(self, linear, group_size=128):
        super().__init__()
        check_group_size(group_size)
        w4a8_kernel()  # compiled (once a machine) before the first call, which should not pay for it
        q, scales_and_zeros = int4_groups(linear.weight.detach().float().cpu(), group_size)
        scale, zero = scales_and_zeros.float().transpose(0, 1).unbind(-1)  # (out, groups) each
        chunks = q.view(q.size(0), -1, 2, 16).to(torch.uint8)  # (out, chunks of 32, halves, 16)
        self.register_buffer("weight", (chunks[:, :, 0] | chunks[:, :, 1] << 4).flatten(1).contiguous())
        self.register_buffer("scale", scale.contiguous().view(torch.int32))
        self.register_buffer("zero", (zero - 8 * scale).contiguous().view(torch.int32))  # int4_groups' q - 8
        self.bias, self.group_size = linear.bias, group_size

    def __setstate__(self, state):  # unpickled in another process: the operator is loaded there too
        super().__setstate__(state)
        w4a8_kernel()

    def forward(self, x):
        if x.device.type != "cpu":
            raise RuntimeError(f"Int4DynamicLinear runs on a CPU, not {x.device}: --quantize=int4 there")
        rows = x.reshape(-1, x.size(-1)).float().contiguous()
        bias = None if self.bias is None else self.bias.float()
        y = torch.ops.nanoformer.w4a8_linear(rows, self.weight, self.scale.view(torch.float32),
                                             self.zero.view(torch.float32), self.group_size, bias)
        return y.view(*x.shape[:-1], self.weight.size(0)).to(x.dtype)


def w4a8_kernel(flags=(), name="w4a8_linear"):
    """Load w4a8.cpp's kernel as torch.ops.nanoformer.<name>, compiled for this processor (-march=native)
    the first time into common.CACHE/kernels, under a name that hashes the source, the command, torch's
    version and the processor's features, so a change of any compiles it again. flags and name build
    another copy beside it (the tests' AVX2 build). The compiler is $CXX, else c++."""
    if name in W4A8_LOADED:
        return
    source = os.path.join(os.path.dirname(os.path.abspath(__file__)), "w4a8.cpp")
    root = os.path.dirname(torch.__file__)
    cmd = [*compiler(), "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC",
           "-std=c++20", f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}", f"-DW4A8_NAME={name}",
           *flags, f"-I{root}/include", f"-I{root}/include/torch/csrc/api/include"]
    libs = [f"-L{root}/lib", "-lc10", "-ltorch_cpu"]  # after the source: a linker drops libraries not yet needed
    cpu = os.uname().machine
    if os.path.exists("/proc/cpuinfo"):  # Linux: the instruction sets -march=native turns on (x86, Arm)
        with open("/proc/cpuinfo") as f:
            cpu = next((line for line in f if line.startswith(("flags", "Features"))), cpu)
    with open(source) as f:
        key = hashlib.sha256("\0".join([f.read(), *cmd, torch.__version__, cpu]).encode()).hexdigest()[:16]
    path = os.path.join(common.CACHE, "kernels", f"{name}-{key}.so")
    if not os.path.exists(path):
        print(f"compiling w4a8.cpp for this processor, once, into {os.path.dirname(path)}", file=sys.stderr)
        with common.cache_tmpdir() as tmp:  # the library takes its name when whole: a compile cut short leaves none
            try:
                done = subprocess.run([*cmd, source, "-o", os.path.join(tmp, "w4a8.so"), *libs],
                                      capture_output=True, text=True)
            except FileNotFoundError:
                raise UsageError(f"--quantize=int4-dynamic compiles w4a8.cpp, and there is no C++ compiler "
                                 f"{cmd[0]!r}: install g++ (or set CXX)") from None
            if done.returncode:
                raise RuntimeError(f"compiling w4a8.cpp failed: {' '.join(cmd)}\n{done.stderr}")
            os.makedirs(os.path.dirname(path), exist_ok=True)
            os.replace(os.path.join(tmp, "w4a8.so"), path)
    torch.ops.load_library(path)
    W4A8_LOADED.add(name)
    torch.library.register_fake(f"nanoformer::{name}")(
        lambda x, weight, scale, zero, group_size, bias: x.new_empty(x.size(0), weight.size(0)))


def runs_here(quantize, device):
    """Whether the format `quantize` (sample.py's --quantize: "", "int8", "int4", "int8-dynamic",
    "int4-dynamic") runs on device here: W8A8 and W4A8 on a CPU only, W4A8 where a C++ compiler can
    build w4a8.cpp ($CXX, else c++)."""
    if quantize.endswith("-dynamic") and device.type != "cpu":
        return False
    return quantize != "int4-dynamic" or shutil.which(compiler()[0]) is not None


def compiler():
    """The C++ compiler's command: $CXX (which may carry arguments: "ccache g++"), else c++."""
    return shlex.split(os.environ.get("CXX", "c++"))


W4A8_LOADED = set()
QUANTIZED = (Int8Linear, Int4Linear, Int8DynamicLinear, Int4DynamicLinear)  # the layers that quantize_* put in


def plain_linear(m):
    """The one rule for a Linear layer that may be swapped for another (quantized, laid out, adapted):
    nn.Linear itself. A subclass (lora.LoRALinear, generate.SplitLinear) computes more than x Wᵀ + b."""
    return type(m) is nn.Linear


def replace_linears(model, make):
    """Replace each plain Linear in model, in place, by make(linear); returns the model."""
    for name, child in model.named_children():
        if plain_linear(child):
            setattr(model, name, make(child))
        else:
            replace_linears(child, make)
    return model


def refuse_other_linears(model):
    """Quantizing copies a layer's weight and bias only: a Linear of another kind (LoRA's adapters) is
    refused in one line, where its update would be dropped without a word."""
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear) and not plain_linear(m):
            raise ValueError(f"{name} is a {type(m).__name__}, whose update quantizing would drop: merge it first "
                             "(lora.merge_lora(model))")


def quantize_int8(model):
    """Replace every nn.Linear in model by an Int8Linear (in place); returns the model. A tied
    lm_head gets its own int8 copy; the embedding keeps its weights."""
    refuse_other_linears(model)
    return replace_linears(model, Int8Linear)


def quantize_int8_dynamic(model):
    """Replace every nn.Linear in model (on a CPU) by an Int8DynamicLinear, in place; returns the model.
    A tied lm_head gets its own copy; the embedding keeps its weights."""
    refuse_other_linears(model)
    return replace_linears(model, Int8DynamicLinear)


def quantize_int4_dynamic(model, group_size=128):
    """Replace every nn.Linear in model (on a CPU) whose in_features group_size divides by an
    Int4DynamicLinear, in place; returns the model. A tied lm_head gets its own copy."""
    check_group_size(group_size)
    refuse_other_linears(model)
    return replace_linears(model, lambda m: Int4DynamicLinear(m, group_size) if m.in_features % group_size == 0 else m)


def quantize_int4(model, group_size=128):
    """Replace every nn.Linear in model by an Int4Linear in groups of group_size (in place), packed
    for the device model is on: move the model there first. Returns the model. A layer whose
    in_features group_size does not divide stays as it is (torch's kernels read whole groups). A
    tied lm_head gets its own int4 copy; the embedding keeps its weights."""
    check_group_size(group_size)
    if not hasattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu"):
        raise RuntimeError(f"int4 weights need torch >= 2.6 (its int4 kernels' layout); this is {torch.__version__}")
    refuse_other_linears(model)
    return replace_linears(model, lambda m: Int4Linear(m, group_size) if m.in_features % group_size == 0 else m)
