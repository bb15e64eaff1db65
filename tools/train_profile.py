"""Where a training iteration's GPU time goes: train.py's recipe (a new model of the settings,
attention as `auto` picks it, fused AdamW or Muon, the same batches, the non-finite check, gradient
clipping) timed for each variant of the settings, then one iteration of the first under
torch.profiler: the top kernels by GPU time, grouped, and how much of the iteration the GPU was busy.

    PYTHONPATH=. python tools/train_profile.py configs/gpt2_124m.py --dataset=shakespeare --compile=True \\
        -- "" "optimizer=muon" "batch_size=32 gradient_accumulation_steps=16"

Each variant after `--` is settings over the command's ("" = none); the tool's own: sdp=cudnn|flash
(the only SDPA backends allowed) and inductor=tuned (Inductor's coordinate-descent tuning). Each
variant builds its model afresh and compiles it anew. Times: the median of `ITERS` iterations after
`WARMUP`, the host waiting only at each iteration's end; MFU against the spec sheet's dense bf16 peak.
"""
import statistics
import sys
import time
from contextlib import nullcontext

import torch
from torch.profiler import ProfilerActivity, profile

from common import parse_settings
from data import batch_rng, get_batch, load_data, new_model_config, special_tokens
from device import peak_flops, pick_device, pick_dtype, sync
from model import ModelConfig, Transformer
from optim import Skips, make_optimizer, optimizer_step
from train import TrainConfig

WARMUP, ITERS, TOP = 2, 4, 12
GROUPS = [("attention", ("flash", "fmha", "sdpa", "attention")),  # before the products: cuDNN's names say wgmma
          ("matrix products", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "wgmma", "splitk")),
          ("optimizer", ("adam", "multi_tensor", "foreach", "muon", "newton")),
          ("fused by inductor", ("triton_",))]


def group_of(name):
    name = name.lower()
    return next((g for g, keys in GROUPS if any(k in name for k in keys)), "other")


def setup(argv, extra):
    """The model, its compiled form, optimizer, batches and settings of one variant."""
    own = dict(kv.split("=", 1) for kv in extra.split() if kv.split("=", 1)[0] in ("sdp", "inductor"))
    argv = argv + [f"--{kv}" for kv in extra.split() if kv.split("=", 1)[0] not in own]
    train_args, model_args = parse_settings(argv, TrainConfig, ModelConfig, skip=("vocab_size",))
    cfg = TrainConfig(**train_args)
    torch._dynamo.reset()  # each variant compiles afresh: no shapes marked dynamic by the one before
    torch._inductor.config.coordinate_descent_tuning = own.get("inductor") == "tuned"
    sdp = own.get("sdp")
    torch.backends.cuda.enable_flash_sdp(sdp in (None, "flash"))
    torch.backends.cuda.enable_mem_efficient_sdp(sdp is None)
    torch.backends.cuda.enable_cudnn_sdp(sdp in (None, "cudnn"))
    device, data_meta = pick_device(cfg.device), load_data(cfg.data_dir, cfg.dataset)
    dtype = pick_dtype(cfg.dtype, device)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True  # as train.py
    config = new_model_config(model_args, data_meta[1]["vocab_size"])
    torch.manual_seed(cfg.seed)
    model = Transformer(config).to(device)
    optimizer = make_optimizer(model, cfg, fused=True)
    compiled = torch.compile(model) if cfg.compile else model
    return cfg, config, device, dtype, data_meta, model, compiled, optimizer


def iteration(cfg, config, device, data_meta, model, compiled, optimizer, autocast, skips, it):
    """One of train.py's iterations: its micro-steps, the finite check, the update."""
    data, meta = data_meta
    step_loss = torch.zeros((), device=device)
    for micro in range(cfg.gradient_accumulation_steps):
        b = get_batch(data["train"], config.arch, cfg.batch_size, config.block_size, batch_rng(cfg.seed, it, micro),
                      special_tokens(meta["vocab_size"]), meta["vocab_size"])
        pinned = device.type == "cuda"  # as train.py: the copy overlaps with compute
        b = {k: (v.contiguous().pin_memory() if pinned else v).to(device, non_blocking=pinned) for k, v in b.items()}
        with autocast:
            loss = compiled(**b)[1]
        (loss / cfg.gradient_accumulation_steps).backward()
        step_loss += loss.detach() / cfg.gradient_accumulation_steps
    bad = (~torch.isfinite(step_loss)).float()
    skips.add(bad)
    optimizer_step(model, optimizer, torch.amp.GradScaler(device.type, enabled=False), cfg.grad_clip, bad)
    return step_loss


def variant(argv, extra, profiled):
    cfg, config, device, dtype, data_meta, model, compiled, optimizer = setup(argv, extra)
    autocast = torch.autocast(device.type, dtype=dtype) if dtype != torch.float32 else nullcontext()
    skips, run = Skips(device), lambda it: iteration(cfg, config, device, data_meta, model, compiled, optimizer,
                                                     autocast, skips, it)
    t0 = time.perf_counter()
    for it in range(WARMUP):
        run(it)
    sync(device)
    warm, times, cuda = time.perf_counter() - t0, [], device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for it in range(WARMUP, WARMUP + ITERS):
        t = time.perf_counter()
        loss = run(it)
        sync(device)
        times.append(time.perf_counter() - t)
    dt = statistics.median(times)
    tokens = cfg.gradient_accumulation_steps * cfg.batch_size * config.block_size
    mfu = model.flops_per_token(config.block_size) * tokens / dt / peak_flops(device, dtype)[0]
    breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
    print(f"{extra or '(as given)':<48} {dt * 1e3:9.1f} {tokens / dt:11,.0f} {mfu:6.1%} "
          f"{torch.cuda.max_memory_allocated() / 2**30 if cuda else 0:7.1f} {warm:7.1f} {breaks:6} {loss.item():7.3f}", flush=True)
    if profiled:
        kernel_table(lambda: run(WARMUP + ITERS), device)


def kernel_table(step, device):
    """One iteration under the profiler: the top kernels, the groups, and the GPU's busy share."""
    sync(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        step()
        sync(device)
        wall = time.perf_counter() - t
    kernels = [e for e in prof.key_averages() if e.device_type.name == "CUDA" and e.self_device_time_total > 0]
    kernels.sort(key=lambda e: -e.self_device_time_total)
    busy = sum(e.self_device_time_total for e in kernels) / 1e6  # seconds
    print(f"\none iteration under the profiler: {wall * 1e3:.1f} ms, GPU busy {busy * 1e3:.1f} ms ({busy / wall:.0%})")
    print(f"{'kernel':<72} {'group':<18} {'calls':>6} {'ms':>8} {'share':>6}")
    for e in kernels[:TOP]:
        print(f"{e.key[:72]:<72} {group_of(e.key):<18} {e.count:6} {e.self_device_time_total / 1e3:8.1f} "
              f"{e.self_device_time_total / 1e6 / busy:6.1%}")
    totals = {}
    for e in kernels:
        totals[group_of(e.key)] = totals.get(group_of(e.key), 0) + e.self_device_time_total / 1e6
    print("groups: " + ", ".join(f"{g} {s * 1e3:.1f} ms ({s / busy:.0%})" for g, s in
                                 sorted(totals.items(), key=lambda x: -x[1])), flush=True)


def main(argv):
    base, extras = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [""])
    print(f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU'}, torch {torch.__version__}; {' '.join(base)}")
    print(f"{'variant':<48} {'ms/iter':>9} {'tokens/s':>11} {'MFU':>6} {'GiB':>7} {'warm s':>7} {'breaks':>6} "
          f"{'loss':>7}")
    for i, extra in enumerate(extras or [""]):
        variant(base, extra, profiled=i == 0)


if __name__ == "__main__":
    main(sys.argv[1:])
