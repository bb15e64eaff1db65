"""Where a decoded token's time goes: the GPT-2-124M-shaped model of `bench.py sample` (random weights,
batch 1, greedy, NEW tokens after 16) in fp32 (as sample.py lays it out), int8 and int4 (groups of 128),
eager and through the compiled step. Each row: tokens/s (best of 3 rounds), then
torch.profiler's time a token in the Linear products (torch's fp32, int8 and int4 kernels) and in
attention (SDPA over the KV cache), from one more round under the profiler (the prefill counted in),
and the rest of the unprofiled time: the time between them (norms, casts, cache writes, sampling, Python).

    PYTHONPATH=. python tools/decode_profile.py NEW [THREADS]    # e.g. 256 2
"""
import copy
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

import generate as G
from model import ModelConfig, Transformer
from generate import decode_layout
from quantize import quantize_int4, quantize_int8

NEW = int(sys.argv[1])
torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else torch.get_num_threads())
torch.set_flush_denormal(True)  # as sample.py runs
PRODUCTS = ("aten::bmm", "aten::mm", "aten::addmm", "aten::_weight_int8pack_mm", "aten::_weight_int4pack_mm_for_cpu")
ATTENTION = ("aten::_scaled_dot_product_flash_attention_for_cpu",)

torch.manual_seed(0)
fp32 = Transformer(ModelConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768)).eval()
models = {"int8": quantize_int8(copy.deepcopy(fp32)), "int4 g128": quantize_int4(copy.deepcopy(fp32)),
          "fp32": decode_layout(fp32)}
idx = torch.randint(0, 50257, (1, 16))
print(f"{NEW} tokens after 16, {torch.get_num_threads()} threads, torch {torch.__version__}; ms a token "
      f"(the compiled step's cache: {G.compiled_size(G.cache_size(fp32, 16, NEW), torch.device('cpu'))} slots, eager's "
      f"{16 + NEW})")
print(f"{'weights':<22} | {'tokens/s':>8} | {'products':>8} | {'attention':>9} | {'the rest':>8}")
with torch.no_grad():
    for name, model in models.items():
        for compile in (False, True):
            run = lambda: G.generate(model, idx, NEW, temperature=0, compile=compile)  # noqa: E731
            run()  # warm up (and compile)
            best = float("inf")
            for _ in range(3):
                t = time.perf_counter(); run(); best = min(best, time.perf_counter() - t)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                run()
            self_ms = {e.key: e.self_cpu_time_total / 1e3 for e in prof.key_averages()}
            products = sum(self_ms.get(k, 0) for k in PRODUCTS) / NEW  # the kernels' own time: the profiler
            attention = sum(self_ms.get(k, 0) for k in ATTENTION) / NEW  # adds its cost between them
            rest = best / NEW * 1e3 - products - attention
            label = name + (", compiled" if compile else "")
            print(f"{label:<22} | {NEW / best:>8.1f} | {products:>8.2f} | {attention:>9.2f} | {rest:>8.2f}")
