"""When the compiled decoding step makes up for its compile (generate.compile_pays, COMPILE_PAYS_FROM):
one model in one process, random weights, batch 1, greedy, NEW tokens after 8. The compile is timed
as sample.py times it (a warm-up of 2 steps in the run's cache size: generate.stopping_after), then
eager and compiled tokens/s at the best of 2 rounds taken in turn; the break-even is the compile's
seconds over the seconds a token saves. Run it twice with one TORCHINDUCTOR_CACHE_DIR: the first
compiles cold, the second reads inductor's cache on disk, as a later run of sample.py does.

    PYTHONPATH=. python tools/compile_pays.py SHAPE FORMAT NEW    # SHAPE: gpt2 or char; FORMAT: fp32, int8, int4, int4-dynamic
"""
import sys
import time

import torch

from generate import decode_layout, generate, stopping_after
from model import ModelConfig, Transformer
from quantize import quantize_int4, quantize_int4_dynamic, quantize_int8

SHAPES = dict(gpt2=dict(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768),  # bench.py sample's
              char=dict(vocab_size=65, block_size=256, n_layer=6, n_head=6, n_embd=384, bias=False))  # shakespeare_char
shape, fmt, NEW = sys.argv[1], sys.argv[2], int(sys.argv[3])
torch.set_flush_denormal(True)  # as sample.py runs
torch.manual_seed(0)
model = Transformer(ModelConfig(**SHAPES[shape])).eval()
model = decode_layout({"fp32": lambda m: m, "int8": quantize_int8, "int4": quantize_int4,
                       "int4-dynamic": quantize_int4_dynamic}[fmt](model))
idx = torch.randint(0, SHAPES[shape]["vocab_size"], (1, 8))
with torch.no_grad():
    t = time.perf_counter()
    with stopping_after(3):
        generate(model, idx, NEW, temperature=0, compile=True)
    compile_s, rates = time.perf_counter() - t, {False: [], True: []}
    generate(model, idx, 4, temperature=0, compile=False)  # eager's first call warms up too
    for _ in range(2):
        for compiled in rates:
            t = time.perf_counter()
            generate(model, idx, NEW, temperature=0, compile=compiled)
            rates[compiled].append(NEW / (time.perf_counter() - t))
eager, compiled = max(rates[False]), max(rates[True])
saved = 1 / eager - 1 / compiled  # seconds a token
print(f"{shape} {fmt}, {NEW} tokens, {torch.get_num_threads()} threads: compile {compile_s:.1f} s, eager {eager:.1f}, "
      f"compiled {compiled:.1f} tokens/s: " + (f"pays from {compile_s / saved:,.0f} tokens" if saved > 0 else "never pays"))
