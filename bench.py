"""
Every benchmark, one per name. Each measures its baseline in the same run, on the same machine.

    python bench.py train configs/shakespeare_char_cpu.py   # train.py's iteration against nanoGPT's recipe
    python bench.py sample --out_dir=out-shakespeare-char-cpu   # decoding speed; what int8 costs a run
    python bench.py sample --out_dir=out-shakespeare-char --draft_dir=out-small --draft_k=4   # speculative
    python bench.py attention --seqs=1024,4096 --dims=64     # the Triton kernel against torch's (CUDA only)
    python bench.py stream --lengths=1024,4096,16384   # decoding long sequences: softmax, window, linear, performer
    python bench.py family --max_time=2m   # every member trained for the same time: compare.html, family.md
    python bench.py scaling --sizes=64,128,256 --max_time=1m   # widths at equal time: L(N), compute-optimal N(C)
    python bench.py prepare --size=1GB   # prepare.py's MB/s and peak memory against tiktoken's batch encoder
    python bench.py memory configs/gpt2_124m.py --gpus=8 --tensor_parallel=2   # what each rank holds (planned)

Settings as in the other scripts (--key=value, or a config file); a list (--seqs, --dims, --sizes) is
written with commas, --seqs=1024,4096, or one value alone. `python bench.py NAME --help` lists its settings.
"""

import copy
import inspect
import os
import resource
import sys
import tempfile
from contextlib import nullcontext
from dataclasses import dataclass, replace

import common  # no torch: it sets the signals before torch's import, as in the other scripts

if __name__ == "__main__":  # before torch's import, not in main: it takes seconds, and Ctrl-C counts then too
    common.exit_quietly_on_signals()

import numpy as np
import torch

import kernels
from checkpoint import load_model
from common import UsageError, check_ranges, parse_settings, sizes, usage
from corpus import PrepareBenchConfig, bench_prepare
from data import batch_rng, get_batch, load_data, new_model_config, special_tokens
from distributed import MemoryConfig, plan_memory
from device import peak_flops, pick_device, pick_dtype, precision, precision_name, run_script, timed
from efficient import LinearState, PerformerState
from generate import (cache_size, compile_pays, decode, decode_layout, generate, piece_size, slots_used,
                      speculative_generate)
from optim import make_optimizer, optimizer_step
from train import TRAIN_RANGES, TrainConfig
from model import KVCache, ModelConfig, Transformer, attn_impl, autocast_dtype
from quantize import QUANTIZED, quantize_int4, quantize_int4_dynamic, quantize_int8, quantize_int8_dynamic, runs_here
from sample import SampleConfig, load_draft
from study import FamilyConfig, ScalingConfig, family, scaling

# ----------------------------------------------------------------------------------------------
# Training: python bench.py train configs/shakespeare_char_cpu.py [--key=value ...]

def training_attention(model, device):
    """The attention path ("triton", "sdpa" or "math") that model's training batches take on device:
    whole sequences of block_size tokens, no padding."""
    stack = model.decoder if model.decoder is not None else model.encoder
    return attn_impl(model.config, device, True, stack.pieces(model.config.window), model.config.block_size)


def training(argv, rounds=5, iters=20, warmup=10):
    """train.py's recipe (attention as `auto` picks it, fused AdamW, compiled if asked) against
    nanoGPT's on a new model of the same settings and the same batches: attention through SDPA,
    AdamW fused only on CUDA, compiled only on a GPU (as nanoGPT's train.py and its CPU example do).
    The two run in alternating rounds, so that both see the same machine; the report gives the
    median round, split into forward+backward and update, and how far apart the two runs' weights end."""
    train_args, model_args = parse_settings(argv, TrainConfig, ModelConfig, skip=("vocab_size",))
    cfg = TrainConfig(**train_args)
    check_ranges(cfg, TRAIN_RANGES)
    if cfg.init_from != "scratch":
        raise UsageError(f"bench.py train times a new model of these settings: leave out --init_from={cfg.init_from}")
    device = pick_device(cfg.device)
    dtype = pick_dtype(cfg.dtype, device)
    data, meta = load_data(cfg.data_dir, cfg.dataset)
    config = new_model_config(model_args, meta["vocab_size"])
    torch.manual_seed(cfg.seed)
    ours = Transformer(config).to(device)
    ref = Transformer(replace(config, attn_impl="sdpa")).to(device)
    ref.load_state_dict(ours.state_dict())
    autocast = torch.autocast(device.type, dtype=dtype) if dtype != torch.float32 else nullcontext()
    if device.type == "cuda":  # as both train.py and nanoGPT's do
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    recipes = {  # each: the model, what runs it, its optimizer and its own gradient scaler
        "nanoGPT's recipe": (ref, torch.compile(ref) if cfg.compile and device.type == "cuda" else ref,
                             make_optimizer(ref, cfg, fused=device.type == "cuda")),
        "train.py": (ours, torch.compile(ours) if cfg.compile else ours,
                     make_optimizer(ours, cfg, fused=device.type in ("cuda", "cpu")))}
    recipes = {k: (*v, torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)) for k, v in recipes.items()}

    def forward_backward(compiled, scaler, it):
        for micro in range(cfg.gradient_accumulation_steps):
            b = get_batch(data["train"], config.arch, cfg.batch_size, config.block_size, batch_rng(cfg.seed, it, micro),
                          special_tokens(meta["vocab_size"]), meta["vocab_size"], cfg.mask_prob, cfg.noise_density,
                          cfg.mean_span)
            if device.type == "cuda":  # pinned memory lets the copy overlap with compute, in both recipes
                b = {k: v.contiguous().pin_memory() for k, v in b.items()}
            with autocast:
                loss = compiled(**{k: v.to(device, non_blocking=True) for k, v in b.items()})[1]
            scaler.scale(loss / cfg.gradient_accumulation_steps).backward()

    apart = lambda: max((p - q).abs().max().item() for p, q in zip(ours.parameters(), ref.parameters()))  # noqa: E731
    for it in range(warmup):  # warm up (and compile) outside the timings
        for model, compiled, opt, scaler in recipes.values():
            forward_backward(compiled, scaler, it)
            optimizer_step(model, opt, scaler, cfg.grad_clip)
        if it == 0:
            first = apart()
    times, memory = time_rounds(recipes, forward_backward, cfg.grad_clip, device, rounds, iters, warmup)
    tokens = cfg.gradient_accumulation_steps * cfg.batch_size * config.block_size
    flops = ours.flops_per_token(config.block_size) * tokens
    peak = peak_flops(device, dtype)[0]
    median = {name: sorted(ts, key=sum)[rounds // 2] for name, ts in times.items()}
    base = sum(median["nanoGPT's recipe"])
    print(f"bench: {rounds} rounds of {iters} iterations after {warmup} of warm-up, {tokens:,} tokens per "
          f"iteration, {device} {str(dtype).replace('torch.', '')}{', compiled' if cfg.compile else ''}; "
          f"attention: {training_attention(ours, device)} in train.py, sdpa in nanoGPT's recipe")
    print(f"{'':18} {'ms/iter':>8} {'fwd+bwd':>8} {'update':>7} {'tokens/s':>9} {'MFU':>6} {'speed-up':>9}"
          f"  each round (ms/iter)")
    for name, (fb, up) in median.items():
        dt = fb + up
        print(f"{name:18} {dt * 1e3:8.1f} {fb * 1e3:8.1f} {up * 1e3:7.1f} {tokens / dt:9,.0f} {flops / dt / peak:6.1%} "
              f"{base / dt:8.2f}x  " + " ".join(f"{sum(t) * 1e3:.1f}" for t in times[name])
              + (f"  peak {memory[name] / 2**20:,.0f} MiB over the models' weights and optimizer states"
                 if device.type == "cuda" else ""))
    print(f"the same computation: from the same weights on the same batches, the largest parameter difference "
          f"is {first:.2g} after one iteration, {apart():.2g} after {warmup + rounds * iters} (rounding, amplified "
          "by training)")
    if device.type != "cuda":
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10
        print(f"peak memory of the process (both runs): {rss:,.0f} MiB")
    return 0


def time_rounds(recipes, forward_backward, grad_clip, device, rounds, iters, warmup):
    """Each recipe's (forward+backward, update) seconds per iteration in each round, the recipes
    taking turns round by round; and on a GPU, its peak memory above what both models hold
    between iterations."""
    times, memory = {name: [] for name in recipes}, {name: 0 for name in recipes}
    for r in range(rounds):
        for name, (model, compiled, opt, scaler) in recipes.items():
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
                resident = torch.cuda.memory_allocated(device)
            spent = [0.0, 0.0]
            for it in range(warmup + r * iters, warmup + (r + 1) * iters):
                spent[0] += timed(lambda: forward_backward(compiled, scaler, it), device)[1] / iters
                spent[1] += timed(lambda: optimizer_step(model, opt, scaler, grad_clip), device)[1] / iters
            times[name].append(spent)
            if device.type == "cuda":
                memory[name] = max(memory[name], torch.cuda.max_memory_allocated(device) - resident)
    return times, memory


# ----------------------------------------------------------------------------------------------
# Decoding: python bench.py sample [--out_dir=DIR] [--draft_dir=DIR] [--compile] [--device=cuda] [--dtype=bfloat16]

@dataclass
class DecodeConfig:
    out_dir: str = "out"  # a run whose ckpt.pt shows what int8 and int4 weights cost it (skipped if none)
    device: str = "auto"
    dtype: str = "auto"
    compile: bool | None = None  # torch.compile the one-token decoding step; None: where it pays, as sample.py decides
    batch: int = 1  # prompts decoded together (GPT-2 shape only; speculative decoding takes one)
    draft_dir: str = ""  # instead: out_dir's model alone against speculative decoding with this run as the draft
    draft_k: int = 4  # ...tokens the draft proposes per step
    max_new_tokens: int = 500  # ...tokens each timed run generates
    temperature: float = 0.8  # ...0 = greedy; top_k, top_p and the prompt as sample.py's defaults


def read_rate(device, gib=1, reps=5):
    """Bytes per second that device's memory is read at: a sum over `gib` GiB, the best of reps."""
    x = torch.ones(gib * 2**28, device=device)
    return x.numel() * 4 / min(timed(x.sum, device)[1] for _ in range(reps))


def bytes_per_token(model):
    """What decoding one token reads at batch 1: every weight of the Linear layers (the lm_head
    included, tied or not) and of the norms, once (an embedding's one row is left out)."""
    kinds = (torch.nn.Linear, *QUANTIZED, torch.nn.LayerNorm, torch.nn.RMSNorm)
    return sum(t.numel() * t.element_size() for m in model.modules() if isinstance(m, kinds)
               for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)])


def hf_twin(model, device, dtype):
    """transformers' own model of model's weights, copied across through save_pretrained; None
    without transformers (a test requirement)."""
    try:
        import transformers
    except ImportError:
        return None
    import hf
    transformers.utils.logging.disable_progress_bar()  # its loading bar would cut into the table
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(model, d)
        return transformers.AutoModelForCausalLM.from_pretrained(d, dtype=dtype).to(device).eval()


def decoding(argv):
    """Tokens/s decoding a GPT-2-124M-shaped model with random weights at batch 1, greedy, against
    transformers' generate on the same weights, and each as a fraction of the memory bound; what
    int8 weights cost a trained model in out_dir. With draft_dir: tokens/s of out_dir's model alone
    and with speculative decoding, as sample.py decodes, and the ratio."""
    cfg = DecodeConfig(**parse_settings(argv, DecodeConfig)[0])
    check_ranges(cfg, dict(draft_k="[1, inf)", max_new_tokens="[1, inf)", temperature="[0, inf)", batch="[1, inf)"))
    device = pick_device(cfg.device)
    dtype = pick_dtype(cfg.dtype, device)
    torch.set_flush_denormal(True)  # as sample.py runs
    if cfg.draft_dir:
        speculative_speed(cfg, device, dtype)
        return 0
    decode_speed(ModelConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768),
                 device, dtype, cfg.compile, cfg.batch)
    if os.path.exists(os.path.join(cfg.out_dir, "ckpt.pt")):
        quantized_quality(cfg.out_dir, device)
    return 0


def decode_speed(config, device, dtype, compile=None, batch=1, new=256, prompt=16, rounds=3):
    """nanoformer's KV cache against transformers' generate on the same weights, and int8 and int4 weights
    (compiled too where told, or untold where generate would: never at 256 tokens), all greedy from one
    prompt: each at its best of `rounds`, the decoders taking turns in every round."""
    torch.manual_seed(0)
    weights, autocast = precision(dtype, device)  # as sample.py samples
    model = Transformer(config).eval()
    quantized = {"int8": quantize_int8(copy.deepcopy(model)).to(device, weights),  # from the fp32 weights, as
                 "int4": quantize_int4(copy.deepcopy(model).to(device)).to(dtype=weights),  # sample.py does
                 **{q: f(copy.deepcopy(model)) for q, f in (("int8-dynamic", quantize_int8_dynamic),  # W8A8 and
                    ("int4-dynamic", quantize_int4_dynamic)) if runs_here(q, device)}}  # W4A8, where they run
    twin = hf_twin(model, device, weights)
    model = model.to(device, weights)
    plain = {"nanoformer, weights as stored": copy.deepcopy(model), "nanoformer": decode_layout(model)} \
        if device.type == "cpu" else {"nanoformer": model}  # on a CPU as sample.py lays them out, and as stored
    decoders = plain | {f"nanoformer, {q}": m for q, m in quantized.items()}
    pays = lambda m: compile_pays(m, device, new, rounds + 1, prompt) if compile is None else compile  # noqa: E731
    decoders |= {name + ", compiled": m for name, m in list(decoders.items()) if "stored" not in name and pays(m)}
    idx = torch.randint(0, config.vocab_size, (batch, prompt), device=device)
    runs = {name: (lambda m=m, c="compiled" in name: generate(m, idx, new, temperature=0, compile=c))
            for name, m in decoders.items()}
    if twin is not None:  # min_new_tokens: no early stop at an end-of-text token
        runs = {"transformers": lambda: twin.generate(idx, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                                      pad_token_id=0), **runs}
    rate, times = read_rate(device), {name: [] for name in runs}
    with torch.no_grad(), autocast:
        outputs = {name: run() for name, run in runs.items()}  # warm up (and compile) outside the timings
        for _ in range(rounds):
            for name, run in runs.items():
                times[name].append(timed(run, device)[1])
    print(f"decoding at batch {batch}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters "
          f"({config.n_layer} layers, width {config.n_embd}, random weights), {precision_name(weights, dtype)} on "
          f"{device}; a {prompt}-token prompt, {new} new tokens, greedy; best of {rounds}")
    print(f"memory reads {rate / 1e9:.1f} GB/s (a sum over 1 GiB): the bound is a step's bytes over that rate")
    if twin is not None:
        same = all(torch.equal(outputs["transformers"], out) for name, out in outputs.items() if ", int" not in name)
        print(f"transformers {sys.modules['transformers'].__version__}: the same weights, "
              f"{'the same' if same else 'OTHER'} tokens")
    print(f"{'decoder':<33} | {'tokens/s':>8} | {'vs transformers':>15} | {'bytes/step':>11} | {'of the bound':>12}")
    for name, ts in times.items():
        m = next((q for k, q in quantized.items() if name.split(", ")[1:2] == [k]), model)
        tps, read = batch * new / min(ts), bytes_per_token(m)  # the weights are read once a step
        ratio = f"{min(times['transformers']) / min(ts):.2f}x" if twin is not None else "-"
        print(f"{name:<33} | {tps:>8.1f} | {ratio:>15} | {read / 1e6:>8.1f} MB | {tps / batch * read / rate:>12.0%}")
    with torch.no_grad(), autocast:
        full = model(idx)[0].float()
        error = {q: ((full - m(idx)[0].float()).abs().max() / full.abs().max()).item() for q, m in quantized.items()}
    same = {q: (outputs[f"nanoformer, {q}"] == outputs["nanoformer"])[:, prompt:].float().mean() for q in quantized}
    print("max |logit difference| / max |logit|: " + ", ".join(f"{q} {e:.4f}" for q, e in error.items()) +
          f"; greedy tokens equal to fp32's, of {new}: " + ", ".join(f"{q} {s:.1%}" for q, s in same.items()))


def speculative_speed(cfg, device, dtype, rounds=3):
    """The target in out_dir alone, then drafted for by the model in draft_dir, taking turns round by
    round from sample.py's default prompt; each at its median round."""
    weights, autocast = precision(dtype, device)  # as sample.py samples
    model, tok, _ = load_model(cfg.out_dir, device, weights)
    model, draft = decode_layout(model), load_draft(cfg.draft_dir, model, tok, device)  # as sample.py lays them out
    if tok.unknown(SampleConfig.start):
        raise UsageError(f"the model in {cfg.out_dir} cannot encode sample.py's default prompt {SampleConfig.start!r}")
    idx = torch.tensor([tok.encode(SampleConfig.start, special=True)], device=device)
    n, how = cfg.max_new_tokens, (cfg.temperature, SampleConfig.top_k, SampleConfig.top_p)
    compile = compile_pays(model, device, n, rounds + 1, idx.size(1)) if cfg.compile is None else cfg.compile
    alone = lambda: generate(model, idx, n, *how, vocab_limit=tok.vocab_size, compile=compile)  # noqa: E731
    runs = {"target alone": lambda: (alone(), 0, 0),
            "speculative": lambda: speculative_generate(model, draft, idx, n, cfg.draft_k, *how, tok.vocab_size)}
    times, accepted, proposed = {name: [] for name in runs}, 0, 0
    torch.manual_seed(0)
    with autocast:
        for run in runs.values():  # warm up (and compile) outside the timings
            run()
        for _ in range(rounds):
            for name, run in runs.items():
                (_, a, p), dt = timed(run, device)
                times[name].append(dt)
                accepted, proposed = accepted + a, proposed + p
    rate = {name: n / sorted(ts)[rounds // 2] for name, ts in times.items()}
    size = lambda m: f"{sum(w.numel() for w in m.parameters()) / 1e6:.2f}M parameters"  # noqa: E731
    print(f"speculative decoding: target {cfg.out_dir} ({size(model)}), draft {cfg.draft_dir} ({size(draft)}), "
          f"k={cfg.draft_k}; {n} new tokens, temperature {cfg.temperature:g}, {precision_name(weights, dtype)} on "
          f"{device}{', compiled decode step' if compile else ''}; median of {rounds} rounds")
    print(f"target alone: {rate['target alone']:9,.1f} tokens/s")
    print(f"speculative:  {rate['speculative']:9,.1f} tokens/s (draft tokens accepted {accepted}/{proposed}, "
          f"{accepted / max(proposed, 1):.1%})")
    print(f"speed-up: {rate['speculative'] / rate['target alone']:.2f}x")


@torch.no_grad()
def quantized_quality(out_dir, device, n_batches=50):
    """What int8 and int4 weights (groups of 32 and 128), and W8A8 and W4A8 on a CPU, cost a trained model: its loss on
    the same validation batches in fp32 and quantized (as sample.py loads each), and the largest logit difference."""
    kinds = [("fp32", "", 128), ("int8", "int8", 128), ("int4, groups of 32", "int4", 32), ("int4, groups of 128", "int4",
             128), ("int8-dynamic (W8A8)", "int8-dynamic", 128), ("int4-dynamic (W4A8)", "int4-dynamic", 128)]
    models = {name: load_model(out_dir, device, quantize=q, which="latest", group_size=g) for name, q, g in kinds
              if runs_here(q, device)}
    cfg, meta, c, tokens = (models["fp32"][2][k] for k in ("train_config", "meta", "model_config", "tokens"))
    data = np.memmap(os.path.join(cfg["data_dir"], cfg["dataset"], "val.bin"), dtype=meta["dtype"], mode="r")
    loss, rel = dict.fromkeys(models, 0.0), dict.fromkeys(models, 0.0)
    for i in range(n_batches):  # a batch at a time, a model at a time: a BPE model's logits are 300 MB a batch
        b = {k: v.to(device) for k, v in get_batch(data, c["arch"], 12, c["block_size"], batch_rng(0, i), tokens,
             meta["vocab_size"], cfg["mask_prob"], cfg["noise_density"], cfg["mean_span"]).items()}
        ref = None  # fp32's logits: it comes first
        for name, (m, _, _) in models.items():
            logits, batch_loss = m(**b)
            ref = logits if ref is None else ref
            loss[name] += batch_loss.item() / n_batches
            rel[name] = max(rel[name], ((logits - ref).abs().max() / ref.abs().max()).item())
    print(f"{out_dir} ({cfg['dataset']}, {n_batches} val batches of 12): loss; max |logit difference| / max |logit|")
    for name in models:
        print(f"  {name:<20} {loss[name]:.4f} ({loss[name] - loss['fp32']:+.4f})  {rel[name]:.4f}")


# ----------------------------------------------------------------------------------------------
# The attention kernel: python bench.py attention [--seqs=1024,4096] [--dims=64]

@dataclass
class AttentionConfig:
    seqs: tuple | int = (512, 1024, 2048, 4096, 8192, 16384)  # sequence lengths T: --seqs=1024,4096 (or --seqs=1024)
    dims: tuple | int = (64, 128)  # head sizes D: --dims=64,128 (or --dims=64)
    tokens: int = 16384  # batch size * sequence length, kept constant
    width: int = 2048  # heads * head size, kept constant
    dtype: str = "bfloat16"  # or "float16"
    no_math: bool = False  # skip the math path, which writes out T x T: slow and memory-hungry


def _math_attention(q, k, v, causal):
    """Attention that writes out the T x T matrix, as model.py's math path does."""
    s = (q @ k.transpose(-2, -1)).float() * q.size(-1) ** -0.5  # (B, H, T, T)
    if causal:
        s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), float("-inf"))
    return s.softmax(-1).to(q.dtype) @ v


def _sdpa(q, k, v, causal):
    """torch's own choice of fused kernel (cuDNN's on an H100, FlashAttention-2 on an A100)."""
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)


def _sdpa_flash(q, k, v, causal):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)


def _triton(q, k, v, causal):
    return kernels.flash_attention(q, k, v, causal=causal)


def _attention_cell(attn, q, k, v, dout, causal):
    """[forward ms, forward+backward ms, peak MiB above the inputs during forward+backward],
    each None where the GPU ran out of memory."""
    from triton.testing import do_bench

    def forward():
        with torch.no_grad():
            attn(q, k, v, causal)

    def forward_backward():
        torch.autograd.grad(attn(q, k, v, causal), (q, k, v), dout)

    def peak_memory():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        forward_backward()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**20

    results = []
    for measure in (lambda: do_bench(forward, return_mode="median"),
                    lambda: do_bench(forward_backward, return_mode="median"), peak_memory):
        try:
            results.append(measure())
        except torch.OutOfMemoryError:
            results.append(None)
            torch.cuda.empty_cache()
    return results


def _attention_row(methods, D, causal, T, B, H, dtype):
    """One line of the table: TFLOP/s and MiB of each method, then the kernel's error."""
    flops = 4 * B * H * T * T * D / (2 if causal else 1)
    q, k, v = (torch.randn(B, H, T, D, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
    dout = torch.randn_like(q)
    row = f"{D:>4} {str(causal):>6} {T:>6} {B:>4} {H:>3}"
    for name, attn in methods.items():
        try:
            fwd, both, mib = _attention_cell(attn, q, k, v, dout, causal)
            cells = (fwd and flops / fwd / 1e9, both and 3.5 * flops / both / 1e9, mib)
            row += " |" + "".join(f" {'OOM' if x is None else f'{x:.{digits}f}':>{width}}"
                                  for x, width, digits in zip(cells, (15, 7, 7), (1, 1, 0)))
        except RuntimeError as e:  # e.g. no flash kernel in torch for this GPU or shape
            print(f"# {name}, D={D}, T={T}: {str(e).splitlines()[0]}", file=sys.stderr)
            row += f" | {'n/a':>15} {'n/a':>7} {'n/a':>7}"
    try:
        with torch.no_grad():
            err = f"{(_triton(q, k, v, causal) - _sdpa_flash(q, k, v, causal)).abs().max().item():.1e}"
    except RuntimeError:
        err = "n/a"
    return f"{row} | {err:>7}"


def attention(argv):
    """TFLOP/s and memory of kernels.flash_attention against torch's attention, on a CUDA GPU: each
    head size D, causal or not, at each sequence length T, with B * T and H * D kept constant."""
    cfg = AttentionConfig(**parse_settings(argv, AttentionConfig)[0])
    check_ranges(cfg, dict(tokens="[1, inf)", width="[1, inf)", dtype=("bfloat16", "float16")))
    seqs, dims = sizes(cfg, "seqs"), sizes(cfg, "dims")
    if not torch.cuda.is_available() or kernels.INTERPRET or not kernels.available:
        why = ("no CUDA GPU found" if not torch.cuda.is_available() else
               "TRITON_INTERPRET is set" if kernels.INTERPRET else "triton is not installed")
        raise UsageError(f"attention needs a CUDA GPU and compiled Triton kernels ({why})")
    dtype = getattr(torch, cfg.dtype)
    methods = {"triton": _triton, "sdpa": _sdpa, "sdpa-flash": _sdpa_flash}
    if not cfg.no_math:
        methods["math"] = _math_attention
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | triton {kernels.triton.__version__} | {cfg.dtype}")
    print(f"B * T = {cfg.tokens} tokens, H * D = {cfg.width}. TFLOP/s: forward 4·B·H·T²·D (half that when "
          f"causal), forward+backward 3.5x the forward.\nMiB: peak memory above the inputs during forward+backward. "
          f"err: max |triton - sdpa-flash| of the forward output.")
    header = f"{'D':>4} {'causal':>6} {'T':>6} {'B':>4} {'H':>3}" + "".join(
        f" | {name + ' fwd':>15} {'fwd+bwd':>7} {'MiB':>7}" for name in methods)
    print(header + f" | {'err':>7}")
    print("-" * (len(header) + 10))
    for D in dims:
        for causal in (False, True):
            for T in seqs:
                B, H = max(1, cfg.tokens // T), max(1, cfg.width // D)
                print(_attention_row(methods, D, causal, T, B, H, dtype), flush=True)
                torch.cuda.empty_cache()  # the row's tensors are gone: give their memory back
    return 0


# ----------------------------------------------------------------------------------------------
# Long sequences: python bench.py stream [--lengths=1024,4096,16384]

@dataclass
class StreamConfig:
    lengths: tuple | int = (1024, 4096, 16384)  # positions read before each timing: --lengths=1024,4096
    steps: int = 64  # decoding steps timed after them
    window: int = 512  # the windowed model's window...
    n_global: int = 4  # ...and its global tokens, the sinks
    n_features: int = 256  # the performer's random features per head
    device: str = "auto"
    dtype: str = "auto"


def streaming(argv):
    """Decoding tokens/s and the memory of the KV cache (or recurrent state) after each length, at batch
    1: softmax, a window with global tokens (sinks), linear attention and the performer (the kinds that
    keep something: LSH recomputes), on 4 layers with random weights and RoPE. Every model reads its
    sequence in pieces of 512, then decodes `steps` tokens greedily, timed."""
    cfg = StreamConfig(**parse_settings(argv, StreamConfig)[0])
    check_ranges(cfg, dict(steps="[1, inf)", window="[1, inf)", n_global="[0, inf)", n_features="[1, inf)"))
    lengths, device = sizes(cfg, "lengths"), pick_device(cfg.device)
    dtype = pick_dtype(cfg.dtype, device)
    weights, autocast = precision(dtype, device)
    base = dict(vocab_size=4096, n_layer=4, n_head=4, n_embd=256, pos="rope", block_size=max(lengths) + cfg.steps)
    models = {"softmax, full": {}, f"window {cfg.window} + {cfg.n_global} global": dict(
        window=cfg.window, n_global=cfg.n_global), "linear": dict(attention="linear"),
        f"performer, m={cfg.n_features}": dict(attention="performer", n_features=cfg.n_features)}
    print(f"decoding at batch 1 after L positions: 4 layers, width 256, 4 heads (RoPE), random weights, "
          f"{precision_name(weights, dtype)} on {device}; {cfg.steps} greedy steps timed")
    print(f"{'attention':<24} | {'L':>6} | {'tokens/s':>8} | {'cache or state':>14}")
    for name, kw in models.items():
        torch.manual_seed(0)
        model = Transformer(ModelConfig(**base | kw)).eval().to(device, weights)
        for L in lengths:
            with torch.no_grad(), autocast:
                tps, nbytes = stream_speed(model, L, cfg.steps, device)
            print(f"{name:<24} | {L:>6} | {tps:>8.1f} | {nbytes / 2**20:>10.2f} MiB", flush=True)
    return 0


def stream_speed(model, L, steps, device, piece=512):
    """Tokens/s of `steps` decoding steps after L random tokens, and the bytes the cache holds."""
    model.setup_kv_cache(1, size := cache_size(model, L, steps), dtype=autocast_dtype(device))
    if L + steps > size:  # a ring that wraps takes the pieces prefill takes
        piece = min(piece, piece_size(model, L))
    idx = torch.randint(0, model.config.vocab_size, (1, L), device=device)
    for s in range(0, L, piece):
        end = min(L, s + piece)
        logits = model(idx[:, s:end], input_pos=torch.arange(s, end, device=device), slots_used=slots_used(model, end))[0]
    state = [logits[:, -1:].argmax(-1), torch.tensor([[L]], device=device)]  # the next token, its position

    def run():
        for i in range(steps):
            state[:] = decode(model, *state, None, slots_used(model, L + i + 1)).argmax(-1, keepdim=True), state[1] + 1
    seconds = timed(run, device)[1]
    cache = [b for m in model.modules() if isinstance(m, (KVCache, LinearState, PerformerState)) for b in m.buffers()]
    nbytes = sum(b.numel() * b.element_size() for b in cache + [model.decoder.cache_pos] if b is not None)
    model.clear_kv_cache()
    return steps / seconds, nbytes


# ----------------------------------------------------------------------------------------------

# each benchmark: its function, and the settings it parses (which --help lists) but those it skips
def memory(argv):
    """What each rank of a mesh holds, computed (distributed.plan): weights, gradients, optimizer state and
    activations, under DDP and ZeRO-1/2/3, and the deepest model of the config's width that fits."""
    return plan_memory(argv, TrainConfig, TRAIN_RANGES)


BENCHES = {"train": (training, (TrainConfig, ModelConfig), ("vocab_size",)), "sample": (decoding, (DecodeConfig,), ()),
           "attention": (attention, (AttentionConfig,), ()), "stream": (streaming, (StreamConfig,), ()),
           "family": (family, (FamilyConfig,), ()), "scaling": (scaling, (ScalingConfig,), ()),
           "prepare": (bench_prepare, (PrepareBenchConfig,), ()), "memory": (memory, (MemoryConfig, TrainConfig, ModelConfig), ())}


def main(argv):
    name, rest = (argv[0], argv[1:]) if argv else (None, [])
    if name in ("-h", "--help"):
        print("\n\n".join([__doc__.strip()] + [help_of(n) for n in BENCHES]))
        return 0
    if name not in BENCHES:
        raise UsageError(f"{f'unknown benchmark {name!r}' if name else 'no benchmark named'}: choose one of "
                         f"{', '.join(BENCHES)} (python bench.py --help lists their settings)")
    if {"-h", "--help"} & set(rest):
        print(help_of(name))
        return 0
    return BENCHES[name][0](rest)


def help_of(name):
    """A benchmark's --help: what it measures, then its settings."""
    run, classes, skip = BENCHES[name]
    return usage(f"python bench.py {name}: {inspect.cleandoc(run.__doc__)}", *classes, skip=skip)


if __name__ == "__main__":
    run_script(main, "bench.py")
