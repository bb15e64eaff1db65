"""AOTInductor's decode step (route 1 of the llama.cpp comparison, docs/performance.md) beside eager and
torch.compile's: the GPT-2-124M-shaped model of `bench.py sample` (random weights, batch 1, greedy, NEW tokens
after 16) in FORMAT (fp32 as stored, fp32-layout as sample.py lays it out, int8 or int4 in groups of 128). The
one-token step is exported once (torch.export; the cache's slots in use a dynamic size, as the compiled step
takes them) and compiled to a shared library (torch._inductor.aoti_compile_and_package), loaded, and called
once a token with no Python of the model's in between; the prompt goes in through the same step, a token at a
time (the library keeps its own copy of the cache). Prints the export and compile times, tokens/s at the best
of 3 rounds taken in turn, and whether the three give the same tokens.

    PYTHONPATH=. python tools/aoti_decode.py NEW THREADS FORMAT      # e.g. 256 2 int8

tools/llamacpp_compare.py DIR speed aoti runs the same step beside llama.cpp.
"""
import copy
import os
import sys
import tempfile
import time

import torch
import torch.nn as nn

from generate import cache_size, compiled_size, decode, decode_layout, generate
from model import ModelConfig, Transformer
from quantize import quantize_int4, quantize_int8


class Step(nn.Module):
    """generate.decode as a module: the logits after one token at position input_pos (1, 1), the cache's
    first n slots read, n the length of `used` (AOTInductor takes a size as a tensor's, not as an int)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, token, input_pos, used):
        return decode(self.model, token, input_pos, None, used.size(0))


def aoti_step(model, size):
    """The step exported over a cache of `size` slots and compiled ahead of time: (runner, seconds)."""
    token, m = torch.zeros(1, 1, dtype=torch.long), copy.deepcopy(model)
    m.setup_kv_cache(1, size)
    pos = m.decoder.cache_pos  # a plain attribute in model.py: a buffer here, so that the library updates it
    del m.decoder.cache_pos
    m.decoder.register_buffer("cache_pos", pos, persistent=False)
    t = time.perf_counter()
    # token and position as two tensors: one tensor passed twice is exported as one input, which both then read
    ep = torch.export.export(Step(m), (token, token.clone(), torch.empty(2)),
                             dynamic_shapes=(None, None, {0: torch.export.Dim("slots", min=2, max=size - 1)}), strict=False)
    path = torch._inductor.aoti_compile_and_package(ep, package_path=os.path.join(tempfile.mkdtemp(), "step.pt2"))
    return torch._inductor.aoti_load_package(path), time.perf_counter() - t


@torch.no_grad()
def aoti_generate(runner, idx, new, size):
    """Greedy: the prompt a token at a time through the library's cache (of `size` slots), then new tokens.
    The cache is never emptied: what a round reads past its own keys (slot 1 at its first token) holds a
    later position of the round before, which the causal mask hides."""
    out, used = idx, torch.empty(size)  # its first n: n slots in use
    for i in range(idx.size(1) + new - 1):
        token = out[:, i:i + 1]
        logits = runner(token, torch.full((1, 1), i), used[:max(i + 1, 2)])  # slots 0..i hold keys (2: the least)
        if i >= idx.size(1) - 1:
            out = torch.cat((out, logits.argmax(-1, keepdim=True)), dim=1)
    return out


if __name__ == "__main__":
    NEW, FORMAT = int(sys.argv[1]), sys.argv[3]
    torch.set_num_threads(int(sys.argv[2]))
    torch.set_flush_denormal(True)  # as sample.py runs
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768)).eval()
    model = {"fp32": lambda m: m, "fp32-layout": decode_layout, "int8": quantize_int8, "int4": quantize_int4}[FORMAT](model)
    idx = torch.randint(0, 50257, (1, 16))
    size = compiled_size(cache_size(model, idx.size(1), NEW), idx.device)  # as torch.compile's step sizes it
    assert idx.size(1) + NEW < min(size, model.config.block_size), "NEW: at most 1007 (the export takes size - 1 slots)"
    runner, compile_s = aoti_step(model, size)
    print(f"export and AOT compile: {compile_s:.1f} s ({size} slots)")
    paths = {"eager": lambda: generate(model, idx, NEW, temperature=0, compile=False),
             "torch.compile": lambda: generate(model, idx, NEW, temperature=0, compile=True),
             "AOTInductor": lambda: aoti_generate(runner, idx, NEW, size)}
    times, outs = {}, {}
    with torch.no_grad():
        for rnd in range(4):  # the first round warms up (and compiles the torch.compile step)
            for name, run in paths.items():
                t = time.perf_counter()
                outs[name] = run()
                times.setdefault(name, []).append(time.perf_counter() - t if rnd else float("inf"))
    print(f"{FORMAT}, {NEW} tokens after 16, {torch.get_num_threads()} threads, torch {torch.__version__}; tokens/s "
          f"(AOTInductor's also feeds the 16 prompt tokens one at a time)")
    for name in paths:
        same = torch.equal(outs[name], outs["eager"])
        print(f"{name:<14} {NEW / min(times[name]):6.1f}  {'the same tokens as eager' if same else 'OTHER tokens'}")
