"""llama.cpp (through llama-cpp-python) against nanoformer: greedy tokens of two runs' exports, or (speed)
decoding GPT-2-124M-shaped random weights in f32 / Q8_0 / Q4_0 against fp32 / int8 / int4 (and int8-dynamic,
W8A8), 2 threads, batch 1, 256 new tokens, best of 3 rounds taken in turn (docs/performance.md). DIR holds the Hugging Face exports and
their GGUF conversions as docs/model.md makes them: gpt2, llama (exports of out-bpe-gpt2, out-bpe-llama) with
gpt2-f32.gguf, llama-f32.gguf; gpt2-124m (hf.save_pretrained of the random model, GPT-2's tokenizer files
copied in) with gpt2-124m-f32.gguf and gpt2-124m-q8_0.gguf (Q4_0 is made here).

    pip install llama-cpp-python    # builds llama.cpp (minutes)
    python tools/llamacpp_compare.py DIR            # greedy tokens
    python tools/llamacpp_compare.py DIR speed      # tokens/s
    python tools/llamacpp_compare.py DIR speed compile   # and nanoformer's through the compiled step
    python tools/llamacpp_compare.py DIR speed aoti      # and through the step compiled ahead of time
    python tools/llamacpp_compare.py DIR speed compile q4_0   # one format (f32, q8_0, q4_0) and ours beside it
"""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch
import llama_cpp
from llama_cpp import Llama
import hf
from checkpoint import for_sampling
from generate import decode_layout, generate

torch.set_num_threads(2)
torch.set_flush_denormal(True)

def ours_greedy(out_dir, prompt, n):
    model, ckpt = hf.load_source("resume", out_dir)
    model, tok = for_sampling(model, ckpt, torch.device("cpu"))
    model = decode_layout(model)  # as sample.py lays it out
    ids = tok.encode(prompt)
    out = generate(model, torch.tensor([ids]), n, temperature=0)[0].tolist()
    return ids, out[len(ids):]

def llama_greedy(path, ids, n):
    llm = Llama(model_path=path, n_ctx=64, n_threads=2, verbose=False)
    got = []
    for t in llm.generate(ids, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
        got.append(t)
        if len(got) == n:
            break
    return llm.tokenize(PROMPT.encode(), add_bos=False, special=False), got

PROMPT = "ROMEO: what say you"
DIR = sys.argv[1]
if unknown := set(sys.argv[2:]) - {"speed", "compile", "aoti", "f32", "q8_0", "q4_0"}:
    sys.exit(f"llamacpp_compare.py: unknown words {sorted(unknown)}: give speed, compile, aoti, f32, q8_0 or q4_0")
for name, run in (() if "speed" in sys.argv else (("gpt2", "out-bpe-gpt2"), ("llama", "out-bpe-llama"))):
    ids, ours = ours_greedy(run, PROMPT, 40)
    lids, theirs = llama_greedy(f"{DIR}/{name}-f32.gguf", ids, 40)
    same = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), len(ours))
    print(f"{name}: prompt ids equal {lids == ids}; greedy tokens equal for the first {same} of {len(ours)}")
    if same < len(ours):
        print("  ours  ", ours); print("  llama ", theirs)

if "speed" in sys.argv:
    q4 = f"{DIR}/gpt2-124m-q4_0.gguf"
    if not os.path.exists(q4):
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0
        llama_cpp.llama_model_quantize(f"{DIR}/gpt2-124m-f32.gguf".encode(), q4.encode(), params)
    runs = {}
    for t in ("f32", "q8_0", "q4_0"):
        llm = Llama(model_path=f"{DIR}/gpt2-124m-{t}.gguf", n_ctx=512, n_threads=2, verbose=False)
        def run(llm=llm):
            got = 0
            for _ in llm.generate(list(range(100, 116)), top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
                got += 1
                if got == 256:
                    break
        runs[f"llama.cpp {t}"] = run
    model = hf.from_pretrained(f"{DIR}/gpt2-124m")
    model = decode_layout(for_sampling(model, dict(meta=dict(tokenizer="char", vocab=["a"])), torch.device("cpu"))[0])
    idx = torch.arange(100, 116)[None]
    runs["nanoformer fp32"] = lambda: generate(model, idx, 256, temperature=0, compile=False)
    from quantize import quantize_int4, quantize_int4_dynamic, quantize_int8, quantize_int8_dynamic
    models = {"fp32": model}
    for q, f in (("int8", quantize_int8), ("int4 g128", quantize_int4), ("int8-dynamic", quantize_int8_dynamic),
                 ("int4-dynamic g128", quantize_int4_dynamic)):
        m = f(hf.from_pretrained(f"{DIR}/gpt2-124m")).eval()
        runs[f"nanoformer {q}"] = lambda m=m: generate(m, idx, 256, temperature=0, compile=False)
        models[q] = m
    only = [a for a in sys.argv[2:] if a in ("f32", "q8_0", "q4_0")]  # a format alone, if named
    mine = {"f32": ("fp32",), "q8_0": ("int8", "int8-dynamic"), "q4_0": ("int4 g128", "int4-dynamic g128")}
    keep = [f"llama.cpp {t}" for t in only] + [f"nanoformer {q}" for t in only for q in mine[t]]
    weights = lambda run: run.split(",")[0].replace(" as stored", "")  # noqa: E731  (a run's eager one)
    if "compile" in sys.argv:  # the same through the compiled decode step
        for q, m in models.items():
            runs[f"nanoformer {q}, compiled"] = lambda m=m: generate(m, idx, 256, temperature=0, compile=True)
    if "aoti" in sys.argv:  # and through the step compiled ahead of time (tools/aoti_decode.py; not int8-dynamic)
        from aoti_decode import aoti_generate, aoti_step
        for q in [q for q in ("fp32 as stored", "int8", "int4 g128") if not only or weights(f"nanoformer {q}") in keep]:
            m = models[q] if q != "fp32 as stored" else hf.from_pretrained(f"{DIR}/gpt2-124m").eval()
            runner, seconds = aoti_step(m, 512)
            print(f"{q}: exported and compiled ahead of time in {seconds:.0f} s")
            runs[f"nanoformer {q}, AOTInductor"] = lambda r=runner: aoti_generate(r, idx, 256, 512)
    runs = {k: r for k, r in runs.items() if not only or weights(k) in keep}
    times, outs = {k: [] for k in runs}, {}
    with torch.no_grad():
        for k, r in runs.items():
            outs[k] = r()
        for _ in range(3):
            for k, r in runs.items():
                t = time.perf_counter(); r(); times[k].append(time.perf_counter() - t)
    for k, ts in times.items():  # a faster path of ours against the eager one of the same weights
        faster = k != weights(k) and "llama" not in k
        same = f"  {'the same' if torch.equal(outs[k], outs[weights(k)]) else 'OTHER'} tokens as eager" if faster else ""
        print(f"{k:28} {256 / min(ts):7.1f} tokens/s (best of 3){same}")
