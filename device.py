"""
The device and dtype a script runs on, timing on it, its peak FLOP/s (for MFU), and running out
of its memory.
"""

import atexit
import os
import re
import sys
import time
from contextlib import nullcontext, suppress

import torch

from common import UsageError


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



def pick_device(name, local_rank=None):
    """The device --device names; under torchrun (local_rank given) a CUDA one is this process's GPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError(f"--device={name} but torch sees no CUDA GPU: use --device=cpu (or auto)")
    if name == "mps" and not torch.backends.mps.is_available():
        raise UsageError("--device=mps but MPS is not available: use --device=cpu (or auto)")
    if name not in ("cpu", "mps") and not re.fullmatch(r"cuda(:\d+)?", name):
        raise UsageError(f"--device={name} is not known: choose auto, cpu, cuda, cuda:N or mps")
    if local_rank is not None and name.startswith("cuda"):
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
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


def rng_state(device):
    state = dict(torch=torch.get_rng_state())
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state, device):
    torch.set_rng_state(state["torch"].cpu())
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"].cpu(), device)


def run_script(main, name, oom_hint=None):
    """python NAME.py: exit with main(argv)'s status; bad input (UsageError) and, given oom_hint (what
    to try), running out of memory as one line and status 2. Any other error is a bug, and keeps its
    traceback."""
    try:
        status = main(sys.argv[1:])
    except UsageError as e:
        print(f"{name}: error: {e}", file=sys.stderr)
        status = 2
    except (RuntimeError, MemoryError) as e:  # torch's allocators raise RuntimeErrors
        if oom_hint is None or (oom := out_of_memory(e)) is None:
            raise
        print(f"{name}: error: {oom}: {oom_hint}", file=sys.stderr)
        status = 2
    leave(status)


def leave(status):
    """Exit with status now that the script is done. Python's own exit would then collect garbage over
    every object torch made (and dynamo, which torch.optim imports): about a second on a CPU, in each of a
    run's processes. The exit handlers still run (wandb's, torch's), told the status, and the output is
    flushed; every file this project writes is closed where it is written. Threads still running are not
    waited for (the scripts start none that outlive main). A bug's traceback takes the ordinary way out."""
    with suppress(SystemExit):
        sys.exit(status)  # through whatever wraps sys.exit to learn the status: wandb marks a run failed by it
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status or 0)
