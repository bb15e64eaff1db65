"""
Train any member of the family on one device or many.

    python train.py configs/shakespeare_char_cpu.py
    python train.py configs/shakespeare_char.py --n_layer=4 --pos=rope --max_iters=2000
    torchrun --standalone --nproc_per_node=8 train.py configs/gpt2_124m.py
    python train.py configs/shakespeare_char_cpu.py --bench   # time it against nanoGPT's recipe

Settings come from TrainConfig below and from ModelConfig (model.py); a config file is Python
that assigns some of them, and --key=value overrides either. The objective follows the
architecture: next-token prediction (decoder), masked LM (encoder), T5 span corruption
(encoder-decoder). Checkpoints in out_dir hold everything needed to resume exactly.
"""

import time

START = time.time()  # the run's wall clock counts from here, torch's import included

import ast
import difflib
import errno
import fcntl
import gc
import inspect
import json
import math
import os
import re
import resource
import signal
import sys
import types
from contextlib import ExitStack, nullcontext, suppress
from dataclasses import asdict, dataclass, fields, replace
from typing import get_args

# Ctrl-C while torch loads (seconds) or the run is set up ends it quietly: status 130, no traceback.
# The training loop then takes over SIGINT to save a checkpoint first. A reader that stops early
# (`| head`) ends the run as it ends any Unix tool, without a traceback.
if __name__ == "__main__":
    signal.signal(signal.SIGINT, lambda signum, frame: sys.exit(128 + signum))
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import kernels
from model import ModelConfig, Transformer, attn_impl


@dataclass
class TrainConfig:
    out_dir: str = "out"
    init_from: str = "scratch"  # "scratch" or "resume" (from out_dir/ckpt.pt)
    dataset: str = "shakespeare_char"  # data/<dataset>, made by prepare.py
    data_dir: str = "data"
    # batches: gradient_accumulation_steps * batch_size * block_size tokens per step, over all ranks
    batch_size: int = 12
    gradient_accumulation_steps: int = 1
    # AdamW, with weight decay on matrices only
    learning_rate: float = 6e-4
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # 0 = off
    # learning rate: linear warmup, then cosine decay to min_lr at lr_decay_iters
    decay_lr: bool = True
    warmup_iters: int = 100
    lr_decay_iters: int = 5000
    min_lr: float = 6e-5
    max_iters: int = 5000
    # evaluation, logging, checkpoints
    eval_interval: int = 250
    eval_iters: int = 20  # batches per split and rank
    eval_only: bool = False
    log_interval: int = 10
    always_save_checkpoint: bool = True  # ckpt.pt at every eval; best.pt only when val improves
    max_bad_steps: int = 5  # stop after this many steps in a row with a non-finite loss
    # objectives of the encoder (masked LM) and the encoder-decoder (span corruption)
    mask_prob: float = 0.15
    noise_density: float = 0.15
    mean_span: float = 3.0
    # system
    device: str = "auto"  # "auto" (cuda, then mps, then cpu), or "cpu", "cuda", "cuda:1", "mps"
    dtype: str = "auto"  # "auto" (bf16 where supported, else fp16 on GPUs, fp32 on CPU), or one of those
    compile: bool = False
    bench: bool = False  # time iterations against nanoGPT's recipe on the same model and data, then exit
    seed: int = 1337
    backend: str = "auto"  # distributed: "nccl" on CUDA, "gloo" on CPU


N_SENTINEL = 100  # T5's number of span sentinels


class UsageError(Exception):
    """Bad settings or data: reported as one line, exit status 2."""


# ----------------------------------------------------------------------------------------------
# Settings: defaults, then a config file, then --key=value

def settings_types():
    """Every setting's name -> (owner, type). vocab_size comes from the data."""
    known = {f.name: ("train", f.type) for f in fields(TrainConfig)}
    known.update({f.name: ("model", f.type) for f in fields(ModelConfig) if f.name != "vocab_size"})
    return known


def check_name(key, known, where):
    if key not in known:
        close = difflib.get_close_matches(key, known, n=1)
        hint = f"did you mean --{close[0]}?" if close else f"the settings are the fields of {where}"
        raise UsageError(f"unknown setting {key!r}: {hint}")


def check_value(key, value, known, where="TrainConfig in train.py and ModelConfig in model.py"):
    check_name(key, known, where)
    allowed = get_args(known[key][1]) or (known[key][1],)  # `int | None` -> (int, NoneType)
    if float in allowed and type(value) is int:
        try:
            value = float(value)
        except OverflowError:
            raise UsageError(f"{key} is too large for a float: give a finite number") from None
    if type(value) is float and not math.isfinite(value):
        raise UsageError(f"{key}={value} must be a finite number")
    if type(value) is int and not -2**63 <= value < 2**63:  # what torch and numpy hold
        raise UsageError(f"{key} is too large: give a number below 2**63")
    if type(value) not in allowed:
        names = " or ".join("None" if t is type(None) else t.__name__ for t in allowed)
        raise UsageError(f"{key}={value!r} should be {names}, not {type(value).__name__}")
    return value


def parse_settings(argv, known=None, where=None):
    """[config.py] [--key=value ...] -> a dict of the settings given (defaults not included).
    known maps each setting to (owner, type); by default, train.py's settings."""
    known, given = known or settings_types(), {}
    where = where or "TrainConfig in train.py and ModelConfig in model.py"
    for arg in argv:
        if not arg.startswith("--"):
            if not os.path.isfile(arg):
                what = "is a folder" if os.path.isdir(arg) else "not found"
                raise UsageError(f"config file {arg!r} {what}: give a file such as configs/shakespeare_char.py")
            scope = {}
            try:
                exec(compile(open(arg).read(), arg, "exec"), scope)
            except Exception as e:
                raise UsageError(f"{arg} does not run: {type(e).__name__}: {e}") from None
            for key, value in scope.items():
                if not key.startswith("_") and not isinstance(value, types.ModuleType):
                    given[key] = check_value(key, value, known, where)
        else:
            key, eq, text = arg[2:].partition("=")
            if not eq and known.get(key, (None, None))[1] is bool:
                eq, text = "=", "True"  # a bare --flag switches a yes/no setting on
            if not eq:
                check_name(key, known, where)
                raise UsageError(f"{arg!r} has no value: write --{key}=VALUE")
            try:  # a str setting takes the text as it is: --out_dir=2024, --start=1984
                value = text if known.get(key, (None, None))[1] is str else ast.literal_eval(text)
            except (ValueError, SyntaxError):
                value = text  # left for check_value to refuse: --max_iters=many
                with suppress(ValueError):
                    value = float(text)  # nan or inf, which Python literals lack: refused as such
            given[key] = check_value(key, value, known, where)
    return given


def usage(doc, classes, known):
    """--help: the script's docstring, then each setting as its class declares it (type, default and
    comment), read from the source so that it never goes stale."""
    lines = [doc.strip(), "", "Settings (--key=value, or key = value in a config file):"]
    for cls in classes:
        lines += [line for line in inspect.getsource(cls).splitlines()
                  if (m := re.match(r"    (\w+): ", line)) and m[1] in known]
    return "\n".join(lines)


def check_ranges(cfg):
    """Values of the right type that training still cannot use, refused in one line."""
    at_least = dict(batch_size=1, gradient_accumulation_steps=1, eval_interval=1, eval_iters=1, log_interval=1,
                    max_bad_steps=1, max_iters=0, warmup_iters=0, lr_decay_iters=0, learning_rate=0, min_lr=0,
                    weight_decay=0, grad_clip=0, mean_span=1)  # grad_clip=0: no clipping
    for key, low in at_least.items():
        if getattr(cfg, key) < low:
            raise UsageError(f"{key}={getattr(cfg, key)} must be at least {low}")
    for key, ok, span in [("seed", 0 <= cfg.seed < 2**63, "[0, 2**63)"),
                          ("beta1", 0 <= cfg.beta1 < 1, "[0, 1)"), ("beta2", 0 <= cfg.beta2 < 1, "[0, 1)"),
                          ("mask_prob", 0 < cfg.mask_prob <= 1, "(0, 1]"),
                          ("noise_density", 0 < cfg.noise_density < 1, "(0, 1)")]:
        if not ok:
            raise UsageError(f"{key}={getattr(cfg, key)} must lie in {span}")
    if cfg.backend not in ("auto", "nccl", "gloo"):
        raise UsageError(f"backend={cfg.backend!r} is not known: choose auto, nccl or gloo")


# ----------------------------------------------------------------------------------------------
# Data and objectives

def special_tokens(data_vocab):
    """Ids after the data's vocabulary: a mask token (MLM), a decoder start token, then sentinels."""
    return dict(mask=data_vocab, start=data_vocab + 1, sentinel=data_vocab + 2, n_sentinel=N_SENTINEL)


def model_vocab_size(arch, data_vocab):
    """The data's tokens plus the special ones the objective uses, rounded up to a multiple of 64
    (which matmuls like): a decoder needs none, an encoder the mask, an encoder-decoder the rest."""
    tokens = special_tokens(data_vocab)
    used = {"decoder": data_vocab, "encoder": tokens["mask"] + 1,
            "encoder-decoder": tokens["sentinel"] + tokens["n_sentinel"]}[arch]
    return 64 * math.ceil(used / 64)


def random_lengths(total, parts, batch, gen):
    """Split `total` into `parts` positive lengths at random, per row: (batch, parts)."""
    cuts = torch.rand(batch, total - 1, generator=gen).argsort(dim=-1)[:, : parts - 1] + 1
    edges = torch.cat((torch.zeros(batch, 1, dtype=torch.long), cuts.sort(dim=-1).values,
                       torch.full((batch, 1), total)), dim=1)
    return edges.diff(dim=1)


def mask_tokens(x, gen, tokens, data_vocab, p=0.15):
    """BERT's masked LM: choose p of the tokens to predict (at least one per row); of those 80%
    become the mask token, 10% a random token and 10% stay as they are."""
    chosen = torch.rand(x.shape, generator=gen) < p
    r = torch.rand(x.shape, generator=gen)
    random_tokens = torch.randint(data_vocab, x.shape, generator=gen)
    # a row with nothing chosen has nothing to predict, and a batch of such rows a NaN loss: choose one
    one = torch.randint(x.shape[-1], (*x.shape[:-1], 1), generator=gen)
    chosen |= ~chosen.any(-1, keepdim=True) & (torch.arange(x.shape[-1]) == one)
    idx = torch.where(chosen & (r < 0.8), tokens["mask"], x)
    idx = torch.where(chosen & (r >= 0.8) & (r < 0.9), random_tokens, idx)
    return dict(idx=idx, targets=x.masked_fill(~chosen, -100))


def span_counts(L, noise_density, mean_span):
    """How many of L tokens T5's objective hides, and in how many spans (at least one of each;
    the decoder then reads n_noise + n_spans + 1 tokens: spans, sentinels and the start)."""
    n_noise = min(max(1, round(L * noise_density)), L - 1)
    return n_noise, min(max(1, round(n_noise / mean_span)), L - n_noise)


def check_span_corruption(config, cfg):
    L = config.block_size
    if L < 2:
        raise UsageError(f"span corruption hides part of each sequence: block_size={L} must be at least 2")
    n_noise, n_spans = span_counts(L, cfg.noise_density, cfg.mean_span)
    if n_spans + 1 > N_SENTINEL:
        raise UsageError(f"span corruption of {L} tokens needs {n_spans + 1} sentinels, more than "
                         f"{N_SENTINEL}: lower block_size or raise mean_span")
    if config.pos == "learned" and n_noise + n_spans + 1 > L:
        raise UsageError(f"span corruption of {L} tokens gives the decoder {n_noise + n_spans + 1} tokens, more "
                         f"than the {L} learned positions: lower noise_density, or use relative positions")


def span_corrupt(x, gen, tokens, noise_density=0.15, mean_span=3.0):
    """T5's span corruption. Random spans covering noise_density of x (B, L) are cut out: the
    encoder reads what is left with a sentinel in each gap, the decoder writes each sentinel
    followed by the span it stands for, and a last sentinel to end."""
    B, L = x.shape
    n_noise, n_spans = span_counts(L, noise_density, mean_span)
    # alternate kept and noise spans, starting with a kept one (as T5 does)
    lengths = torch.stack((random_lengths(L - n_noise, n_spans, B, gen),
                           random_lengths(n_noise, n_spans, B, gen)), dim=-1).view(B, -1)
    segment = torch.searchsorted(lengths.cumsum(-1), torch.arange(L).expand(B, L).contiguous(), right=True)
    noise = segment % 2 == 1  # (B, L)

    def replace_runs(runs):  # each run of `runs` becomes one sentinel; the rest stays
        first = runs & ~F.pad(runs[:, :-1], (1, 0))
        out = torch.where(first, tokens["sentinel"] + first.cumsum(-1) - 1, x)
        return out[~runs | first].view(B, -1)  # the same length in every row
    src = replace_runs(noise)
    target = torch.cat((replace_runs(~noise), torch.full((B, 1), tokens["sentinel"] + n_spans)), dim=1)
    start = torch.full((B, 1), tokens["start"])
    return dict(src=src, idx=torch.cat((start, target[:, :-1]), dim=1), targets=target)


def check_meta(meta):
    """A ValueError unless meta (a dataset's meta.json) holds the tokenizer that prepare.py
    writes, which the checkpoint carries to sample.py: "char" with its vocab, or "gpt2"."""
    n, kind = meta["vocab_size"], meta["tokenizer"]
    if type(n) is not int or n < 1:
        raise ValueError(f"vocab_size={n!r} is not a positive integer")
    if kind not in ("char", "gpt2"):
        raise ValueError(f"tokenizer={kind!r} is not 'char' or 'gpt2'")
    if kind == "char" and not (type(meta["vocab"]) is list and len(meta["vocab"]) == n):
        raise ValueError(f"vocab is not a list of vocab_size={n} characters")


def batch_rng(*key):
    """A generator seeded by key = (seed, iteration, micro-step): every training batch is a function
    of where it falls in the run, so resuming needs no saved data state, and the global batch is
    the same whatever the number of processes it is split over."""
    return torch.Generator().manual_seed(int(np.random.SeedSequence(key).generate_state(1)[0]))


def eval_rng(seed, *key):
    """The generator of evaluation batch key = (split, rank, k), spawned from the seed: a stream
    apart from training's. (SeedSequence pads short entropy with zeros, so as a plain key
    (seed, 0, 0, 0) would be iteration 0's first batch, evaluated as if never seen.) torch's CPU
    generator keeps 32 bits of a seed, so a chance match with a training batch remains possible."""
    return torch.Generator().manual_seed(int(np.random.SeedSequence(seed, spawn_key=key).generate_state(1)[0]))


def get_batch(data, arch, batch_size, block_size, gen, tokens, data_vocab, cfg):
    """A random batch of the objective for this architecture, as CPU tensors."""
    L = block_size + (arch == "decoder")  # a decoder's targets are its inputs shifted by one
    ix = torch.randint(len(data) - L, (batch_size,), generator=gen).tolist()
    x = torch.from_numpy(np.stack([data[i : i + L] for i in ix]).astype(np.int64))
    if arch == "decoder":
        return dict(idx=x[:, :-1], targets=x[:, 1:])
    if arch == "encoder":
        return mask_tokens(x, gen, tokens, data_vocab, cfg.mask_prob)
    return span_corrupt(x, gen, tokens, cfg.noise_density, cfg.mean_span)


def learning_rate(it, cfg):
    """Linear warmup, then cosine decay to min_lr."""
    if not cfg.decay_lr:
        return cfg.learning_rate
    if it < cfg.warmup_iters:
        return cfg.learning_rate * (it + 1) / (cfg.warmup_iters + 1)
    if it > cfg.lr_decay_iters:
        return cfg.min_lr
    ratio = (it - cfg.warmup_iters) / max(1, cfg.lr_decay_iters - cfg.warmup_iters)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (cfg.learning_rate - cfg.min_lr)


# ----------------------------------------------------------------------------------------------
# Measuring

def flops_per_token(model, T):
    """Training FLOPs per token (PaLM appendix B): 6 per weight, plus attention's 12 * layers *
    heads * head_size * T, per stack. Position tables count no weight FLOPs."""
    c = model.config
    skip = ("wpe", "wte", "lm_head")  # lookups cost nothing; the output layer is added once below
    n = sum(p.numel() * (c.expert_top_k / c.n_expert if ".experts." in name else 1)  # a token uses k experts
            for name, p in model.named_parameters() if not any(s in name for s in skip))
    n += c.vocab_size * c.n_embd  # the output layer, whether it shares the embedding's matrix or not
    stacks = 1 + (c.arch == "encoder-decoder")
    return 6 * n + stacks * 12 * c.n_layer * c.n_head * c.head_size * T


# dense bf16/fp16 TFLOP/s by words of the GPU's name; the first that matches counts
PEAK_TFLOPS = {"H100 PCIe": 756, "H100 NVL": 835, "H100": 989, "H200": 989, "GH200": 989, "B200": 2250,
               "A100": 312, "A800": 312, "L40S": 362, "L40": 181, "A10": 125, "L4": 121, "RTX 4090": 165,
               "RTX 3090": 71, "V100": 125, "T4": 65}


def spec_tflops(name):
    """The dense bf16 TFLOP/s of the GPU called name (as CUDA calls it), or None if the table lacks it.
    Whole words only: an A10G is not an A10, nor an H200 a GH200."""
    return next((t for key, t in PEAK_TFLOPS.items() if re.search(rf"\b{key}\b", name)), None)


def peak_flops(device, dtype):
    """The device's dense bf16/fp16 peak from a table of GPUs, or else what a large matmul reaches
    (through oneDNN where it is the faster on this CPU: kernels.linear)."""
    if device.type == "cuda" and dtype != torch.float32:
        name = torch.cuda.get_device_name(device)
        if tflops := spec_tflops(name):
            return tflops * 1e12, f"{name} {tflops} TFLOP/s (spec sheet)"
    # large enough to reach a GPU's peak; on a CPU without half-precision matmul instructions a
    # 1024^3 product in bf16/fp16 can take seconds (about 1 GFLOP/s), and 256^3 measures the same rate
    n = 8192 if device.type == "cuda" else 1024 if dtype == torch.float32 else 256
    # random numbers (all ones would draw less power, and a GPU can clock higher), from a generator
    # of its own: the global RNG state is the run's
    a = b = torch.randn(n, n, device=device, generator=torch.Generator(device).manual_seed(0)).to(dtype)
    for _ in range(2):
        kernels.linear(a, b)
    sync(device)
    t, reps = time.perf_counter(), 0
    while time.perf_counter() - t < 0.3:
        kernels.linear(a, b)
        reps += 1
    sync(device)
    flops = 2 * n**3 * reps / (time.perf_counter() - t)
    return flops, f"{flops / 1e12:.3g} TFLOP/s (measured {n}^3 matmul, {dtype})"


def hms(seconds):
    """98462.5 -> '27:21:02': hours, minutes and seconds, the hours past 24 if need be."""
    m, s = divmod(int(seconds), 60)
    return f"{m // 60}:{m % 60:02d}:{s:02d}"


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device):
    """fn()'s result and the seconds it took, the device's queued work included."""
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - t0


def training_attention(model, device):
    """The attention path ("triton", "sdpa" or "math") that model's training batches take on device:
    whole sequences of block_size tokens, no padding."""
    stack = model.decoder if model.decoder is not None else model.encoder
    return attn_impl(model.config, device, True, stack.mask(model.config.window), model.config.block_size)


def bench(ours, model, cfg, device, dtype, batch, flops_per_iter, peak, rounds=5, iters=20, warmup=10):
    """Time train.py's iteration, ours = (forward_backward(it), update()) on model, against
    nanoGPT's recipe on a copy of the model: attention through SDPA, products through torch's
    default library, AdamW fused only on CUDA, compiled only on a GPU (as nanoGPT's train.py and
    its CPU example do). The two run in alternating rounds, so that both see the same machine; the
    report gives the median round, split into forward+backward and update, and how far apart the
    two runs' weights end."""
    ref = Transformer(replace(model.config, attn_impl="sdpa", linear_impl="torch")).to(device)
    ref.load_state_dict(model.state_dict())
    opt = configure_optimizer(ref, cfg, fused=device.type == "cuda")
    compiled = torch.compile(ref) if cfg.compile and device.type == "cuda" else ref
    autocast = torch.autocast(device.type, dtype=dtype) if dtype != torch.float32 else nullcontext()
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)

    def forward_backward(it):
        for micro in range(cfg.gradient_accumulation_steps):
            with autocast:
                loss = compiled(**batch(it, micro))[1] / cfg.gradient_accumulation_steps
            scaler.scale(loss).backward()

    def apart():
        return max((p - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))

    runs = {"nanoGPT's recipe": (forward_backward, lambda: optimizer_step(ref, opt, scaler, cfg.grad_clip)),
            "train.py": ours}
    for it in range(warmup):  # warm up (and compile) outside the timings
        for fb, up in runs.values():
            fb(it)
            up()
        if it == 0:
            first = apart()
    times = {name: [] for name in runs}  # per round: (forward+backward, update) seconds per iteration
    memory = {name: 0 for name in runs}  # the peak above what both models hold between iterations
    for r in range(rounds):
        for name, (fb, up) in runs.items():
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
                resident = torch.cuda.memory_allocated(device)
            spent = [0.0, 0.0]
            for it in range(warmup + r * iters, warmup + (r + 1) * iters):
                spent[0] += timed(lambda: fb(it), device)[1] / iters
                spent[1] += timed(up, device)[1] / iters
            times[name].append(spent)
            if device.type == "cuda":
                memory[name] = max(memory[name], torch.cuda.max_memory_allocated(device) - resident)
    tokens = cfg.gradient_accumulation_steps * cfg.batch_size * model.config.block_size
    used = training_attention(model, device)
    onednn = kernels.onednn_applies(model.config.linear_impl, device, dtype) and not cfg.compile
    products = "onednn" if onednn else "torch"
    median = {name: sorted(ts, key=sum)[rounds // 2] for name, ts in times.items()}
    base = sum(median["nanoGPT's recipe"])
    lines = [f"bench: {rounds} rounds of {iters} iterations after {warmup} of warm-up, {tokens:,} tokens per "
             f"iteration, {device} {str(dtype).replace('torch.', '')}{', compiled' if cfg.compile else ''}; "
             f"attention: {used} in train.py, sdpa in nanoGPT's recipe; products: {products} in train.py, "
             "torch in nanoGPT's recipe",
             f"{'':18} {'ms/iter':>8} {'fwd+bwd':>8} {'update':>7} {'tokens/s':>9} {'MFU':>6} {'speed-up':>9}"
             f"  each round (ms/iter)"]
    for name, (fb, up) in median.items():
        dt = fb + up
        lines.append(f"{name:18} {dt * 1e3:8.1f} {fb * 1e3:8.1f} {up * 1e3:7.1f} {tokens / dt:9,.0f} "
                     f"{flops_per_iter / dt / peak:6.1%} {base / dt:8.2f}x  "
                     + " ".join(f"{sum(t) * 1e3:.1f}" for t in times[name])
                     + (f"  peak {memory[name] / 2**20:,.0f} MiB over the models' weights and optimizer states"
                        if device.type == "cuda" else ""))
    lines.append(f"the same computation: from the same weights on the same batches, the largest parameter "
                 f"difference is {first:.2g} after one iteration, {apart():.2g} after {warmup + rounds * iters} "
                 "(rounding, amplified by training)")
    if device.type != "cuda":
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10
        lines.append(f"peak memory of the process (both runs): {rss:,.0f} MiB")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# Checkpoints

def save_atomic(obj, path):
    """Write to a temporary file, flush it to disk, then rename: a crash at any instant leaves
    either the old file or the new one, never half of one."""
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
    except (OSError, RuntimeError) as e:  # a full disk or quota (torch.save wraps some as RuntimeError)
        with suppress(FileNotFoundError):
            os.remove(tmp)
        cause = e if isinstance(e, OSError) else e.__context__  # the OSError that torch.save's error hides
        reason = cause.strerror if isinstance(cause, OSError) and cause.strerror else str(e)
        raise UsageError(f"could not write {path} ({reason}); the previous checkpoint is intact: free some space, "
                         "then continue with --init_from=resume") from None
    os.replace(tmp, path)
    dirfd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(dirfd)
    finally:
        os.close(dirfd)


def load_checkpoint(path, device, hint=None):
    """A checkpoint written by save_atomic, or a one-line UsageError that says what to do instead
    (hint: what else to try, e.g. the run's other checkpoint)."""
    if not os.path.exists(path):
        raise UsageError(f"no checkpoint at {path}: {hint or 'train first, or point --out_dir at a run'}")
    try:
        ckpt = torch.load(path, map_location=device, weights_only=False)
    except Exception as e:
        raise UsageError(f"{path} is not a readable checkpoint ({type(e).__name__}): it is truncated or "
                         f"corrupted; {hint + ', or ' if hint else ''}start a new run in another out_dir") from None
    keys = {"model", "optimizer", "scaler", "model_config", "train_config", "iter_num", "best_val_loss", "rng",
            "tokens", "meta"}  # what train.py writes
    if not isinstance(ckpt, dict) or not keys <= ckpt.keys():
        missing = sorted(keys - ckpt.keys()) if isinstance(ckpt, dict) else "everything"
        raise UsageError(f"{path} is not a nanoformer checkpoint (it lacks {missing})")
    unknown = sorted(ckpt["model_config"].keys() - {f.name for f in fields(ModelConfig)})
    if unknown:
        raise UsageError(f"{path} has model settings this model.py does not know ({', '.join(unknown)}): "
                         "it was written by a newer nanoformer; update this one")
    return ckpt


def rng_state(device):
    state = dict(torch=torch.get_rng_state())
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state, device):
    torch.set_rng_state(state["torch"].cpu())
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"].cpu(), device)


# ----------------------------------------------------------------------------------------------
# The run

def pick_device(name):
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError(f"--device={name} but torch sees no CUDA GPU: use --device=cpu (or auto)")
    if name == "mps" and not torch.backends.mps.is_available():
        raise UsageError("--device=mps but MPS is not available: use --device=cpu (or auto)")
    if name not in ("cpu", "mps") and not re.fullmatch(r"cuda(:\d+)?", name):
        raise UsageError(f"--device={name} is not known: choose auto, cpu, cuda, cuda:N or mps")
    return torch.device(name)


def pick_dtype(name, device):
    if name == "auto":
        if device.type == "cuda":
            name = "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
        else:
            name = "float32"
    names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if name not in names:
        raise UsageError(f"dtype={name!r} is not known: choose auto, float32, bfloat16 or float16")
    return names[name]


RUN_TIME = ("attn_impl", "linear_impl", "dropout")  # model settings that a resumed run may change


def main(argv):
    with ExitStack() as held:  # what the run holds until it ends, however it ends: its lock on out_dir
        try:
            return run(argv, held)
        except (RuntimeError, MemoryError) as e:  # torch's allocators raise RuntimeErrors
            oom = out_of_memory(e)
            if oom is None:
                raise
            raise UsageError(f"{oom}: lower --batch_size, raising --gradient_accumulation_steps to keep the "
                             "tokens per step; checkpoints already in out_dir are as they were") from None


def out_of_memory(e):
    """'out of memory (asked for 2.0 GiB more)' if e says that torch or Python could not allocate
    memory, on a GPU or on the CPU where the system refuses (where it kills the process instead,
    nothing can answer); else None."""
    if not (isinstance(e, (torch.OutOfMemoryError, MemoryError)) or "can't allocate memory" in str(e)):
        return None
    asked = re.search(r"[Tt]ried to allocate ([\d.]+) (\w+)", str(e))  # "2.00 GiB", "3276800000 bytes"
    if not asked:
        return "out of memory"
    size = f"{int(asked[1]) / 2**30:.1f} GiB" if asked[2] == "bytes" else f"{asked[1]} {asked[2]}"
    return f"out of memory (asked for {size} more)"


def run(argv, held):
    known = settings_types()
    if {"-h", "--help"} & set(argv):
        print(usage(__doc__, (TrainConfig, ModelConfig), known))
        return 0
    given = parse_settings(argv, known)
    cfg = TrainConfig(**{k: v for k, v in given.items() if known[k][0] == "train"})
    check_ranges(cfg)
    model_args = {k: v for k, v in given.items() if known[k][0] == "model"}

    # distributed: torchrun sets RANK, LOCAL_RANK and WORLD_SIZE
    ddp = "RANK" in os.environ
    rank, local_rank, world = (int(os.environ[k]) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE")) if ddp else (0, 0, 1)
    master = rank == 0
    log = print if master else (lambda *a, **k: None)
    device = pick_device(cfg.device)
    if ddp and device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    if cfg.bench and ddp:
        raise UsageError("--bench times one process against nanoGPT's recipe: run it with python, not torchrun")
    if cfg.gradient_accumulation_steps % world:
        raise UsageError(f"gradient_accumulation_steps={cfg.gradient_accumulation_steps} is not divisible by "
                         f"the {world} processes: make it a multiple of {world}")
    accum = cfg.gradient_accumulation_steps // world
    dtype = pick_dtype(cfg.dtype, device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    autocast = torch.autocast(device.type, dtype=dtype) if dtype != torch.float32 else nullcontext()
    writes = not (cfg.bench or cfg.eval_only)  # --eval_only looks at a run and writes nothing
    if master and writes:  # take out_dir, and find out now that it takes files, not at the first checkpoint
        prepare_out_dir(cfg.out_dir, held)
    if writes and cfg.init_from == "scratch":
        existing = [p for p in (os.path.join(cfg.out_dir, f) for f in ("ckpt.pt", "best.pt")) if os.path.exists(p)]
        if existing:
            raise UsageError(f"{existing[0]} holds a run that a new one would overwrite: continue it with "
                             "--init_from=resume, or choose another --out_dir (or delete it)")

    # data
    data_path = os.path.join(cfg.data_dir, cfg.dataset)
    meta_path = os.path.join(data_path, "meta.json")
    if not os.path.exists(meta_path):
        hint = {"shakespeare_char": "python prepare.py shakespeare_char", "shakespeare": "python prepare.py shakespeare"}
        cmd = hint.get(cfg.dataset, f"python prepare.py text --input 'your/*.txt' --name {cfg.dataset}")
        raise UsageError(f"dataset {cfg.dataset!r} is not prepared ({meta_path} is missing): run `{cmd}`")
    try:
        with open(meta_path) as f:
            meta = json.load(f)
        data = {s: np.memmap(os.path.join(data_path, f"{s}.bin"), dtype=meta["dtype"], mode="r")
                for s in ("train", "val")}
        check_meta(meta)
        tokens = special_tokens(meta["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError) as e:  # a missing, empty or cut-off file; a bad meta.json
        raise UsageError(f"dataset {cfg.dataset!r} is damaged ({type(e).__name__}: {e}): move {data_path} "
                         "aside and prepare it again") from None

    # model: from the settings, or from the checkpoint when resuming
    ckpt_path = os.path.join(cfg.out_dir, "ckpt.pt")
    ckpt = None
    if cfg.init_from == "resume":
        best = os.path.join(cfg.out_dir, "best.pt")
        ckpt = load_checkpoint(ckpt_path, "cpu", f"copy {best} to {ckpt_path} to resume from the best checkpoint"
                               if os.path.exists(best) else None)
        model_config = ModelConfig(**ckpt["model_config"])  # a field newer than the checkpoint: its default
        try:  # how attention and products run, and what dropout drops, are the run's; the rest is the model's
            model_config = replace(model_config, **{k: v for k, v in model_args.items() if k in RUN_TIME})
        except ValueError as e:
            raise UsageError(f"bad model settings: {e}") from None
        saved = asdict(model_config)
        clash = {k: (v, saved[k]) for k, v in model_args.items() if saved[k] != v}
        if clash:  # from the command line or the config file
            k, (want, have) = next(iter(clash.items()))
            raise UsageError(f"--{k}={want!r} does not match the checkpoint's {k}={have!r}: set --{k}={have!r} "
                             "or drop it to resume, or use another --out_dir to start a new run")
        if any(ckpt["meta"].get(k) != meta.get(k) for k in ("vocab_size", "tokenizer", "vocab")):  # vocab: chars
            raise UsageError(f"{ckpt_path} was trained on other data ({ckpt['meta']['tokenizer']}, vocabulary "
                             f"{ckpt['meta']['vocab_size']}) than {cfg.dataset}: resume with its --dataset")
        # as in nanoGPT, training settings come from the command line and config file, not the
        # checkpoint: say which differ, so that a resume without the run's config file is noticed
        changed = [f"{k} {v!r} -> {getattr(cfg, k)!r}" for k, v in ckpt["train_config"].items()
                   if k not in ("init_from", "out_dir") and hasattr(cfg, k) and getattr(cfg, k) != v]
        if changed:
            log("resuming with training settings changed from the checkpoint's: " + ", ".join(changed))
    elif cfg.init_from == "scratch":
        try:
            arch = model_args.get("arch", ModelConfig.arch)
            model_config = ModelConfig(vocab_size=model_vocab_size(arch, meta["vocab_size"]), **model_args)
        except ValueError as e:
            raise UsageError(f"bad model settings: {e}") from None
    else:
        raise UsageError(f"init_from={cfg.init_from!r} is not known: use 'scratch' or 'resume'")
    if model_config.arch == "encoder-decoder":
        check_span_corruption(model_config, cfg)
    if model_config.attn_impl == "triton" and device.type != "cuda" and not kernels.INTERPRET:
        raise UsageError("attn_impl='triton' runs on CUDA GPUs: use --attn_impl=auto (torch's SDPA here)")
    for split, d in data.items():
        if len(d) <= model_config.block_size + 1:
            raise UsageError(f"{split}.bin of {cfg.dataset} holds {len(d)} tokens, fewer than block_size="
                             f"{model_config.block_size} + 2: lower --block_size or use more text")

    if ddp:  # only now: a bad setting above stops every rank at once, before any waits for the others
        backend = cfg.backend if cfg.backend != "auto" else "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend=backend)
    torch.manual_seed(cfg.seed + rank)  # each rank its own dropout; DDP copies rank 0's weights to all
    model = Transformer(model_config).to(device)
    raw_model = model
    optimizer = configure_optimizer(model, cfg, fused=device.type in ("cuda", "cpu"))
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    iter_num, best_val_loss = 0, float("inf")
    evaluated_at = None  # the last iteration whose evaluation ran to the end
    if ckpt is not None:
        if any(".attn.c_q." in k for k in ckpt["model"]):  # written before c_attn: see model.join_q_kv
            join_q_kv_moments(ckpt["optimizer"], optimizer, model)
        model.load_state_dict(ckpt["model"])
        settings = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
        optimizer.load_state_dict(ckpt["optimizer"])  # the moments, and the checkpoint's betas and decay...
        for group, ours in zip(optimizer.param_groups, settings):  # ...which give way to this run's, as logged
            group.update(ours)
        if ckpt["scaler"]:  # empty from a run without fp16: a run that switches to fp16 starts a new scale
            scaler.load_state_dict(ckpt["scaler"])
        iter_num, best_val_loss = ckpt["iter_num"], ckpt["best_val_loss"]
        evaluated_at = ckpt.get("evaluated_at", iter_num)  # absent from older checkpoints
        if len(ckpt["rng"]) == world:  # each rank carries on with its own dropout stream
            set_rng_state(ckpt["rng"][rank], device)
        del ckpt
    if cfg.compile:
        model = torch.compile(model)
    if ddp:  # experts a batch does not route to get no gradient, which DDP must be told
        model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None,
                    find_unused_parameters=model_config.n_expert > 0)

    tokens_per_iter = cfg.gradient_accumulation_steps * cfg.batch_size * model_config.block_size
    flops_per_iter = flops_per_token(raw_model, model_config.block_size) * tokens_per_iter / world
    peak, peak_source = peak_flops(device, dtype)
    n_params = sum(p.numel() for p in raw_model.parameters())
    log(f"{model_config.arch} with {n_params / 1e6:.2f}M parameters on {world} x {device} ({dtype}); "
        f"{tokens_per_iter:,} tokens per iteration; MFU against {peak_source}")

    def batch(split, g):
        b = get_batch(data[split], model_config.arch, cfg.batch_size, model_config.block_size, g, tokens,
                      meta["vocab_size"], cfg)
        if device.type == "cuda":  # pinned memory lets the copy overlap with compute (if contiguous)
            return {k: v.contiguous().pin_memory().to(device, non_blocking=True) for k, v in b.items()}
        return {k: v.to(device) for k, v in b.items()}

    def all_ranks(x, op=dist.ReduceOp.SUM):
        """x (a tensor) reduced over the ranks; x itself without DDP."""
        if ddp:
            dist.all_reduce(x, op=op)
        return x

    stop = []  # the signals received: see on_signal below

    def stopping():
        """Whether a signal asks the run to stop. Under DDP all ranks stop together: they agree each
        time they ask, a wait for the device that one process does without."""
        if ddp:
            return all_ranks(torch.tensor(float(bool(stop)), device=device), dist.ReduceOp.MAX).item() > 0
        return bool(stop)

    @torch.no_grad()
    def evaluate():
        """Mean loss over eval_iters batches per split and rank (the same batches at every eval),
        averaged over the ranks; None if a signal cuts it short."""
        model.eval()
        out = {}
        for split in ("train", "val"):
            losses = torch.zeros(cfg.eval_iters, device=device)
            for k in range(cfg.eval_iters):
                if stopping():  # a long evaluation gives way to Ctrl-C; the resumed run does it again
                    model.train()
                    return None
                with autocast:
                    losses[k] = model(**batch(split, eval_rng(cfg.seed, split == "val", rank, k)))[1]
            out[split] = all_ranks(losses.mean()).item() / world
        model.train()
        return out

    def save(path):
        """Write a checkpoint, unless the weights are broken (then the last good one stays)."""
        if not all(torch.isfinite(p).all() for p in raw_model.parameters()):
            log(f"not saving {path}: the weights are not finite; it keeps its last good state")
            return False
        states = [rng_state(device)]
        if ddp:  # every rank's dropout state, so that each resumes where it stopped
            states = [None] * world
            dist.all_gather_object(states, {k: v.cpu() for k, v in rng_state(device).items()})
        failed = None
        if master:
            try:
                save_atomic(dict(model=raw_model.state_dict(), optimizer=optimizer.state_dict(),
                                 scaler=scaler.state_dict(), model_config=asdict(model_config),
                                 train_config=asdict(cfg), iter_num=iter_num, best_val_loss=best_val_loss,
                                 evaluated_at=evaluated_at, rng=states, tokens=tokens, meta=meta), path)
            except UsageError as e:  # a full disk: every rank stops with it (rank 0 says why), rather than
                failed = e  # the others meeting a closed connection at their next collective
        if ddp and all_ranks(torch.tensor(float(failed is not None), device=device)).item() and not failed:
            failed = UsageError(f"rank 0 could not write {path}")
        if failed:
            raise failed
        return True

    def forward_backward(it):
        """The gradients of iteration it's batch (this rank's share of its micro-steps); its mean loss."""
        step_loss = torch.zeros((), device=device)
        for micro in range(accum):
            b = batch("train", batch_rng(cfg.seed, it, rank * accum + micro))
            if ddp:  # average gradients across ranks only on the last micro-step
                model.require_backward_grad_sync = micro == accum - 1
            with autocast:
                _, loss = model(**b)
            scaler.scale(loss / accum).backward()
            step_loss += loss.detach() / accum
        return step_loss

    def update():
        optimizer_step(model, optimizer, scaler, cfg.grad_clip)

    if cfg.bench:
        report = bench((forward_backward, update), raw_model, cfg, device, dtype,
                       lambda it, micro: batch("train", batch_rng(cfg.seed, it, micro)), flops_per_iter, peak)
        log(report)
        return 0

    # SIGINT (Ctrl-C) or SIGTERM (a scheduler, torchrun) ends the run at the next iteration (or
    # within an evaluation) with a checkpoint; a second Ctrl-C stops at once
    def on_signal(signum, frame):
        stop.append(signum)
        signal.signal(signum, signal.SIG_DFL)
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, on_signal)

    saved_at = iter_num if cfg.init_from == "resume" else None  # what ckpt.pt holds

    def kept():
        return "no checkpoint was written" if saved_at is None else f"{ckpt_path} keeps iteration {saved_at}"
    bad_steps = skipped = 0
    t_start = time.time()
    t0, t0_iter = t_start, iter_num  # the start of the timing that the next log line reports
    while True:
        lr = learning_rate(iter_num, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr
        due = cfg.eval_only or iter_num % cfg.eval_interval == 0 and iter_num != evaluated_at
        losses = evaluate() if due else None  # None also when a signal cut it short
        if losses is not None:
            evaluated_at = iter_num
            log(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f} "
                f"({time.time() - START:.1f} s since start)")
            if not math.isfinite(losses["val"]):
                log(f"the val loss is not finite: no checkpoint written ({kept()})")
            elif writes:
                if losses["val"] < best_val_loss:
                    best_val_loss = losses["val"]
                    save(os.path.join(cfg.out_dir, "best.pt"))
                if cfg.always_save_checkpoint and save(ckpt_path):
                    saved_at = iter_num
            t0, t0_iter = time.time(), iter_num  # evaluation is not training time
        if stopping():
            if writes and iter_num != saved_at and save(ckpt_path):
                saved_at = iter_num
            name = signal.Signals(stop[0]).name if stop else "a signal to another rank"
            log(f"stopped by {name} at iteration {iter_num}: {kept()}; resume with --init_from=resume")
            return 128 + (stop[0] if stop else signal.SIGTERM)
        if cfg.eval_only or iter_num >= cfg.max_iters:
            break

        step_loss = forward_backward(iter_num)
        # a non-finite loss (a spike, an overflow) would poison the weights: skip the step instead
        if not all_ranks(torch.isfinite(step_loss).float(), dist.ReduceOp.MIN).item():
            optimizer.zero_grad(set_to_none=True)
            bad_steps, skipped = bad_steps + 1, skipped + 1
            log(f"iter {iter_num}: loss is {step_loss.item()}: step skipped ({bad_steps} in a row)")
            if bad_steps >= cfg.max_bad_steps:
                if master:
                    print(f"train.py: stopping: the loss was not finite for {bad_steps} steps in a row; {kept()}: "
                          "lower learning_rate, raise warmup_iters or set grad_clip", file=sys.stderr)
                return 1
            iter_num += 1
            continue
        bad_steps = 0
        update()
        iter_num += 1

        if iter_num % cfg.log_interval == 0 and master:
            sync(device)
            dt = (time.time() - t0) / (iter_num - t0_iter)  # fewer than log_interval after a resume or an eval
            t0, t0_iter = time.time(), iter_num
            left = (cfg.max_iters - iter_num) * dt
            log(f"iter {iter_num}: loss {step_loss.item():.4f}, lr {lr:.2e}, {dt * 1000:.1f} ms/iter, "
                f"{tokens_per_iter / dt:,.0f} tokens/s, mfu {flops_per_iter / dt / peak:.1%}, "
                f"{hms(left)} left")

    if writes and iter_num != saved_at:
        save(ckpt_path)  # the final state, unless the last evaluation has just saved it
    if ddp:  # DDP keeps the replicas equal; check it, since a silent divergence would be costly
        flat = torch.cat([p.detach().float().flatten() for p in raw_model.parameters()])
        spread = all_ranks(torch.stack((flat, -flat)), dist.ReduceOp.MAX)
        log(f"ranks agree: max parameter difference {(spread[0] + spread[1]).max().item():.3g}")
    log(f"done: {iter_num} iterations ({skipped} skipped), best val loss {best_val_loss:.4f}, "
        f"{time.time() - t_start:.1f} s")
    return 0


def prepare_out_dir(path, held):
    """Make out_dir, check that it takes files, lock it, and remove temporary files of a killed save.
    The lock is out_dir/.lock, flock-ed until `held` (the run's ExitStack) closes: a second train.py
    writing there would overwrite this run's checkpoints or remove the one it is writing, so it is
    refused meanwhile; the kernel releases the lock when the process ends, however it ends. An
    out_dir this run made and left empty (it failed before its first checkpoint) goes at the end."""
    made = not os.path.isdir(path)
    probe = os.path.join(path, f".write-test.{os.getpid()}")
    try:
        os.makedirs(path, exist_ok=True)
        try:
            with open(probe, "w") as f:  # some bytes, so that a full disk is found now too
                f.write(f"{os.getpid()}\n")
        finally:
            with suppress(OSError):
                os.remove(probe)
    except OSError as e:
        if made:
            with suppress(OSError):
                os.rmdir(path)
        full = e.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
        raise UsageError(f"out_dir {path!r} is not writable ({e.strerror}): "
                         f"{'free some space, or ' if full else ''}choose another --out_dir") from None
    lock = open(os.path.join(path, ".lock"), "a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "?"
        lock.close()
        raise UsageError(f"out_dir {path!r} is in use by another train.py (process {holder}): wait for it to "
                         "end, or choose another --out_dir") from None
    with suppress(OSError):  # the pid only names the holder to a second run: the lock holds without it
        lock.truncate(0)
        lock.write(f"{os.getpid()}\n")
        lock.flush()
    held.enter_context(lock)
    if made:
        held.callback(remove_if_unused, path)
    for name in os.listdir(path):
        if ".pt.tmp." in name:
            os.remove(os.path.join(path, name))


def remove_if_unused(path):
    if os.listdir(path) == [".lock"]:
        with suppress(OSError):  # another train.py may have just taken it
            os.remove(os.path.join(path, ".lock"))
            os.rmdir(path)


def configure_optimizer(model, cfg, fused):
    """AdamW that decays matrices (weights of Linear and Embedding) but not biases and norm gains.
    fused: one kernel for the whole update instead of ~10 small operations per tensor."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [dict(params=[p for p in params if p.dim() >= 2], weight_decay=cfg.weight_decay),
              dict(params=[p for p in params if p.dim() < 2], weight_decay=0.0)]
    return torch.optim.AdamW(groups, lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2), fused=fused)


def join_q_kv_moments(saved, optimizer, model):
    """AdamW's state from a checkpoint written before self-attention's c_attn, whose rows were two
    parameters, c_q then c_kv: join their moments as model.join_q_kv joins the weights. The saved
    state numbers the parameters in the order of optimizer's groups, where each c_attn was two."""
    names = {p: name for name, p in model.named_parameters()}
    old, new, state = 0, 0, {}
    for saved_group, group in zip(saved["param_groups"], optimizer.param_groups):
        saved_group["params"] = []
        for p in group["params"]:
            parts = [saved["state"].get(old + i) for i in range(1 + (".c_attn." in names[p]))]
            if parts[0] is not None:  # experts that never saw a token have no state
                state[new] = {k: torch.cat([s[k] for s in parts]) if torch.is_tensor(v) and v.dim() else v
                              for k, v in parts[0].items()}
            saved_group["params"].append(new)
            old, new = old + len(parts), new + 1
    saved["state"] = state


def optimizer_step(model, optimizer, scaler, grad_clip):
    """Clip the gradients (unscaled first, under fp16), step, and clear them for the next batch."""
    if grad_clip:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)


if __name__ == "__main__":
    try:
        status = main(sys.argv[1:])
    except UsageError as e:
        rank0, connected = os.environ.get("RANK", "0") == "0", dist.is_initialized()
        if not rank0 and not connected:
            # under torchrun every rank meets a bad setting and rank 0 reports it. torchrun stops
            # all ranks as soon as one exits, maybe before rank 0 has printed: so the others wait
            # to be stopped, and speak only if they are not (an error of their own)
            time.sleep(10)
        if rank0 or not connected:
            print(f"train.py: error: {e}", file=sys.stderr)
        status = 2
    if dist.is_initialized():
        # release DDP and wait for every rank before tearing down: gloo threads that still hold
        # Python objects at interpreter exit abort the process (SIGABRT) now and then
        gc.collect()
        if status == 0:
            dist.barrier()
        dist.destroy_process_group()
    sys.exit(status)
