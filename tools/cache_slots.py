"""Eager decoding on a CPU reading the KV cache up to its last slot in use (as model.py's Stack does)
against reading every slot (as a compiled step and a GPU do; here by telling the model that it is being
compiled): the GPT-2-124M-shaped model of `bench.py sample` (random weights, batch 1, greedy, NEW tokens
after 16) in int8 and int4 (groups of 128; not fp32, whose SplitLinear would take its compiled path too);
tokens/s at the best of 3 rounds taken in turn, and whether both give the same tokens.

    PYTHONPATH=. python tools/cache_slots.py NEW [THREADS]    # e.g. 1000 2
"""
import copy
import sys
import time

import torch

from generate import generate
from model import ModelConfig, Transformer
from quantize import quantize_int4, quantize_int8

NEW = int(sys.argv[1])
torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else torch.get_num_threads())
torch.set_flush_denormal(True)  # as sample.py runs
torch.manual_seed(0)
fp32 = Transformer(ModelConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768)).eval()
models = {"int8": quantize_int8(copy.deepcopy(fp32)), "int4 g128": quantize_int4(fp32)}
idx = torch.randint(0, 50257, (1, 16))
is_compiling = torch.compiler.is_compiling
reads = {"every slot": lambda: True, "the slots in use": is_compiling}
times, outs = {}, {}
with torch.no_grad():
    for rnd in range(4):  # the first round warms up
        for name, model in models.items():
            for read, flag in reads.items():
                torch.compiler.is_compiling = flag
                t = time.perf_counter()
                outs[name, read] = generate(model, idx, NEW, temperature=0)
                times.setdefault((name, read), []).append(time.perf_counter() - t if rnd else float("inf"))
torch.compiler.is_compiling = is_compiling
print(f"{NEW} tokens after 16, {torch.get_num_threads()} threads, torch {torch.__version__}; tokens/s")
for name in models:
    every, used = (NEW / min(times[name, read]) for read in reads)
    same = torch.equal(outs[name, "every slot"], outs[name, "the slots in use"])
    print(f"{name:<10} every slot {every:6.1f} | the slots in use {used:6.1f} ({used / every:.2f}x) | "
          f"{'the same' if same else 'OTHER'} tokens")
