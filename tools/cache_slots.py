"""Decoding on a CPU that attends over the KV cache's slots up to the last one in use (as model.py does
there) against over every slot (as on a GPU; generate.SLOTS_IN_USE_ON emptied): the GPT-2-124M-shaped model of
`bench.py sample` (random weights, batch 1, greedy, NEW tokens after 16) in fp32 (as sample.py lays it
out), int8 and int4 (groups of 128), eager and, with `compile`, through the compiled step; tokens/s at the
best of 3 rounds taken in turn, and whether both give the same tokens.

    PYTHONPATH=. python tools/cache_slots.py NEW THREADS [compile]    # e.g. 1000 2 compile
"""
import copy
import sys
import time

import torch

import generate as generate_module
from generate import decode_layout, generate
from model import ModelConfig, Transformer
from quantize import quantize_int4, quantize_int8

NEW, COMPILE = int(sys.argv[1]), "compile" in sys.argv
torch.set_num_threads(int(sys.argv[2]))
torch.set_flush_denormal(True)  # as sample.py runs
torch.manual_seed(0)
fp32 = Transformer(ModelConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768)).eval()
models = {"int8": quantize_int8(copy.deepcopy(fp32)), "int4 g128": quantize_int4(copy.deepcopy(fp32)),
          "fp32": decode_layout(fp32)}
idx = torch.randint(0, 50257, (1, 16))
reads = {"every slot": (), "the slots in use": ("cpu",)}
times, outs = {}, {}
with torch.no_grad():
    for rnd in range(4):  # the first round warms up (and compiles)
        for name, model in models.items():
            for read, devices in reads.items():
                generate_module.SLOTS_IN_USE_ON = devices
                t = time.perf_counter()
                outs[name, read] = generate(model, idx, NEW, temperature=0, compile=COMPILE)
                times.setdefault((name, read), []).append(time.perf_counter() - t if rnd else float("inf"))
print(f"{NEW} tokens after 16, {torch.get_num_threads()} threads, torch {torch.__version__}, "
      f"{'compiled' if COMPILE else 'eager'}; tokens/s")
for name in models:
    every, used = (NEW / min(times[name, read]) for read in reads)
    same = torch.equal(outs[name, "every slot"], outs[name, "the slots in use"])
    print(f"{name:<10} every slot {every:6.1f} | the slots in use {used:6.1f} ({used / every:.2f}x) | "
          f"{'the same' if same else 'OTHER'} tokens")
