"""Greedy decoding tokens/s at batch 1 of a GPT-2-124M-shaped model (random weights), fp32 as
sample.py lays it out on a CPU (decode_layout; and with its SplitLinear on the head only, or none) against int8
(before: fp32 activations into torch's int8 kernel; after: bf16 ones) and int4, the decoders taking
turns in every round; medians.

    PYTHONPATH=. python tools/quantize_decode.py ROUNDS NEW_TOKENS [THREADS]   # e.g. 5 64 1
"""
import copy
import statistics
import sys
import time

import torch

import generate as generate_module
from generate import decode_layout, generate
from model import ModelConfig, Transformer, autocast_dtype
from quantize import Int8Linear, quantize_int4, quantize_int8

ROUNDS, NEW = int(sys.argv[1]), int(sys.argv[2])
if len(sys.argv) > 3:
    torch.set_num_threads(int(sys.argv[3]))
torch.set_flush_denormal(True)  # as sample.py runs


class Int8LinearBefore(Int8Linear):  # the forward before this change (fp32 into the kernel), the new bf16 scale
    def forward(self, x):
        dtype = autocast_dtype(x.device, x.dtype)
        x, scale = x.to(dtype), self.scale.view(torch.bfloat16).to(dtype)
        y = torch._weight_int8pack_mm(x.reshape(-1, x.size(-1)), self.weight, scale)
        y = y.view(*x.shape[:-1], self.weight.size(0))
        return y if self.bias is None else y + self.bias.to(dtype)


torch.manual_seed(0)
model = Transformer(ModelConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768)).eval()
before = quantize_int8(copy.deepcopy(model))
for m in before.modules():
    if isinstance(m, Int8Linear):
        m.__class__ = Int8LinearBefore
split_bytes, laid_out = generate_module.SPLIT_BYTES, {}
for name, limit in (("not split", 2**62), ("only the head split", 2**24)):  # no layer that large; only the head
    generate_module.SPLIT_BYTES = limit
    laid_out[f"fp32 (decode_layout, {name})"] = decode_layout(copy.deepcopy(model))
generate_module.SPLIT_BYTES = split_bytes
decoders = {"fp32 (decode_layout)": decode_layout(copy.deepcopy(model)), **laid_out,
            "int8, before (fp32 into the kernel)": before,
            "int8 (bf16 into the kernel)": quantize_int8(copy.deepcopy(model)),
            **{f"int4, group {g}": quantize_int4(copy.deepcopy(model), g) for g in (32, 64, 128)}}
idx = torch.randint(0, 50257, (1, 16), generator=torch.Generator().manual_seed(0))
times, out = {name: [] for name in decoders}, {}
with torch.no_grad():
    full = model(idx)[0]
    for name, m in decoders.items():
        out[name] = generate(m, idx, NEW, temperature=0, compile=False)
        logits = m(idx)[0]
        print(f"{name}: logits max |diff| / max |fp32| = {((logits - full).abs().max() / full.abs().max()).item():.4f}, "
              f"greedy tokens equal to fp32's: {(out[name] == out['fp32 (decode_layout)']).float().mean().item():.2f}")
    for _ in range(ROUNDS):
        for name, m in decoders.items():
            t = time.perf_counter()
            generate(m, idx, NEW, temperature=0, compile=False)
            times[name].append(time.perf_counter() - t)
cpu = next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name"))
print(f"{cpu}, {torch.get_num_threads()} threads, torch {torch.__version__}; 16-token prompt, {NEW} new tokens, "
      f"greedy, median of {ROUNDS} rounds (prefill included)")
base = NEW / statistics.median(times["fp32 (decode_layout)"])
for name, ts in times.items():
    tps = NEW / statistics.median(ts)
    print(f"{name:<38} {tps:7.1f} tokens/s  {tps / base:5.2f}x fp32   (min..max {NEW / max(ts):.1f}..{NEW / min(ts):.1f})")
