"""
Train any member of the family on one device or many.

    python train.py configs/shakespeare_char_cpu.py
    python train.py configs/shakespeare_char.py --n_layer=4 --pos=rope --max_iters=2000
    torchrun --standalone --nproc_per_node=8 train.py configs/gpt2_124m.py
    torchrun --standalone --nproc_per_node=8 train.py configs/gpt2_124m.py --fsdp=True
    torchrun --standalone --nproc_per_node=8 train.py configs/gpt2_124m.py --tensor_parallel=2 --pipeline_parallel=2
    torchrun --standalone --nproc_per_node=8 --max_restarts=3 train.py configs/gpt2_124m.py --init_from=auto

Settings come from TrainConfig (below) and ModelConfig (model.py); a config file is Python
that assigns some of them, and --key=value overrides either. The objective follows the
architecture: next-token prediction (decoder), masked LM (encoder), T5 span corruption
(encoder-decoder). Checkpoints in out_dir hold everything needed to resume exactly.
"""

import time

START = time.time()  # the run's wall clock counts from here, torch's import included

import gc
import math
import os
import signal
import sys
from contextlib import ExitStack, nullcontext
from dataclasses import asdict, dataclass, replace

import common  # no torch: it sets the signals before torch's import

if __name__ == "__main__":  # before torch's import, not in main: it takes seconds, and Ctrl-C counts then too
    common.exit_quietly_on_signals()

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import kernels
from checkpoint import (checkpoint_paths, holds, keep_checkpoints, model_config_of, prepare_out_dir, restore,
                        save_atomic, starting_point)
from hf import load_source
from common import UsageError, check_ranges, parse_settings, usage
from data import (STREAM, batch_rng, check_data, eval_rng, get_batch, load_data, sentence_ends, special_tokens,
                  stream_batch)
from device import leave, out_of_memory, peak_flops, pick_device, pick_dtype, rng_state, sync
from distributed import (FSDP2, all_ranks, context_line, context_shard, finite, join_ranks, memory_line, sharded,
                         state_dicts)
from parallel import Pipeline, check_mesh, coordinates, make_mesh, mesh_line, mesh_shape, parallelize, problems, zero_one
from model import ModelConfig, Transformer
from lora import add_lora, lora_line
from optim import Budget, Skips, budget_seconds, lr_factor, make_optimizer, optimizer_step
from report import Report, log_line


@dataclass
class TrainConfig:
    out_dir: str = "out"
    init_from: str = "scratch"  # "scratch", "resume" (out_dir/ckpt.pt), "auto" (resume if it exists), or a HF model
    dataset: str = "shakespeare_char"  # data/<dataset>, made by prepare.py
    data_dir: str = "data"
    # batches: gradient_accumulation_steps * batch_size * block_size tokens per step, over all ranks
    batch_size: int = 12
    gradient_accumulation_steps: int = 1
    # AdamW, with weight decay on matrices only; or Muon on the blocks' matrices and AdamW on the rest
    optimizer: str = "adamw"  # "adamw" or "muon"
    learning_rate: float = 6e-4  # AdamW's peak
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    muon_lr: float = 0.02  # Muon's peak: the schedule scales it as it scales learning_rate
    muon_momentum: float = 0.95  # ...warming up from 0.85 over its first 300 steps
    grad_clip: float = 1.0  # 0 = off
    # LoRA (Hu et al. 2021): train only a low-rank update beside these Linear layers, the rest frozen
    lora_rank: int = 0  # r; 0 = off: every weight trains
    lora_alpha: float = 16.0  # the update is scaled by alpha / r
    lora_dropout: float = 0.0
    lora_targets: str = "c_attn"  # the adapted layers, by name, comma-separated: c_attn (q, k, v), c_proj, c_fc...
    # learning rate: linear warmup, then a decay to min_lr at lr_decay_iters
    decay_lr: bool = True
    schedule: str = "cosine"  # the decay: "cosine", "linear", or "wsd" (warmup, flat, then linear over decay_frac)
    decay_frac: float = 0.2  # wsd: the last part of the run (of lr_decay_iters) that decays
    warmup_iters: int = 100
    lr_decay_iters: int = 5000
    min_lr: float = 6e-5
    max_iters: int = 5000
    max_time: str = ""  # a budget for the whole run, "90s", "45m", "8h" (bare: seconds): it sets max_iters
    # evaluation, logging, checkpoints
    eval_interval: int = 250
    eval_iters: int = 20  # batches per split, shared out over the data-parallel ranks
    eval_only: bool = False
    log_interval: int = 10
    always_save_checkpoint: bool = True  # ckpt.pt at every eval; best.pt only when val improves
    keep_checkpoints: int = 0  # also keep the last N states of ckpt.pt as ckpt-<iter>.pt beside it; 0 = none
    # out_dir/metrics.jsonl and report.html are always written; wandb too, as in nanoGPT, when asked
    wandb_log: bool = False
    wandb_project: str = "nanoformer"
    wandb_run_name: str = ""  # "" = a name wandb makes up
    max_bad_steps: int = 5  # stop after this many steps in a row with a non-finite loss
    # objectives of the encoder (masked LM) and the encoder-decoder ("span": T5's span corruption, or "bart")
    objective: str = "span"  # an encoder-decoder's: "span", or "bart" (text infilling and sentence permutation)
    mask_prob: float = 0.15
    noise_density: float = 0.15
    mean_span: float = 3.0
    # system
    device: str = "auto"  # "auto" (cuda, then mps, then cpu), or "cpu", "cuda", "cuda:1", "mps"
    dtype: str = "auto"  # "auto" (bf16 where supported, else fp16 on GPUs, fp32 on CPU), or one of those
    compile: bool = False
    seed: int = 1337
    backend: str = "auto"  # distributed: "nccl" on CUDA, "gloo" on CPU
    fsdp: bool = False  # under torchrun: shard weights, gradients and optimizer state over the ranks (FSDP2), not DDP
    context_parallel: int = 1  # under torchrun: split each sequence over this many ranks (ring attention)
    tensor_parallel: int = 1  # under torchrun: split each block's heads and MLP over this many ranks (parallel.py)
    pipeline_parallel: int = 1  # under torchrun: split the blocks into this many stages of whole blocks
    pipeline_schedule: str = "1F1B"  # the stages' order of micro-steps: "1F1B", "GPipe" or "Interleaved1F1B"
    zero: int = 0  # ZeRO's stage over the data-parallel ranks: 0 (DDP), 1 (optimizer state), 2 (and gradients), 3


# the values each setting may take, beyond its type (grad_clip=0: no clipping)
TRAIN_RANGES = dict(backend=("auto", "nccl", "gloo"), optimizer=("adamw", "muon"), muon_lr="[0, inf)",
                    schedule=("cosine", "linear", "wsd"), decay_frac="(0, 1]", objective=("span", "bart"),
                    lora_rank="[0, inf)", lora_alpha="(0, inf)", lora_dropout="[0, 1)", muon_momentum="[0, 1)",
                    batch_size="[1, inf)", gradient_accumulation_steps="[1, inf)", eval_interval="[1, inf)",
                    eval_iters="[1, inf)", log_interval="[1, inf)", max_bad_steps="[1, inf)", max_iters="[0, inf)",
                    warmup_iters="[0, inf)", lr_decay_iters="[0, inf)", learning_rate="[0, inf)", min_lr="[0, inf)",
                    weight_decay="[0, inf)", grad_clip="[0, inf)", mean_span="[1, inf)", seed="[0, inf)",
                    context_parallel="[1, inf)", beta1="[0, 1)", beta2="[0, 1)", mask_prob="(0, 1]",
                    noise_density="(0, 1)", keep_checkpoints="[0, inf)", tensor_parallel="[1, inf)",
                    pipeline_parallel="[1, inf)", pipeline_schedule=("1F1B", "GPipe", "Interleaved1F1B"),
                    zero=(0, 1, 2, 3))
MASTER = os.environ.get("RANK", "0") == "0"  # under torchrun only rank 0 logs and writes
EVAL_NOTICE_S = 5  # an evaluation expected to take longer than this (seconds) says so early on
STOP = []  # the signals received (SIGINT, SIGTERM): the run saves and stops at the next iteration


def log(message):
    if MASTER:
        print(message)


def on_signal(signum, frame):
    STOP.append(signum)
    signal.signal(signum, signal.SIG_DFL)  # a second Ctrl-C stops at once


def stopping(device, agree=True):
    """Whether a signal asks the run to stop. Under torchrun all ranks stop together: they agree when
    asked to (agree), a wait for the device that one process does without."""
    if not dist.is_initialized():
        return bool(STOP)
    return agree and all_ranks(torch.tensor(float(bool(STOP)), device=device), dist.ReduceOp.MAX).item() > 0


# ----------------------------------------------------------------------------------------------
# Setting up: the out_dir, the data, the model

def check_fits(config, cfg, data, device, tokens, ddp):
    """Settings of the right kinds that still cannot train together, refused before any work."""
    n, world = cfg.context_parallel, int(os.environ.get("WORLD_SIZE", 1))
    for wrong, problem in [  # --fsdp and --context_parallel: what they need
            (cfg.fsdp and not ddp, "--fsdp=True shards the model over the processes that torchrun starts: run "
             "torchrun --standalone --nproc_per_node=N train.py ... --fsdp=True"),
            (cfg.fsdp and not FSDP2, f"--fsdp=True needs FSDP2 (torch.distributed.fsdp.fully_shard, torch "
             f"2.6 or later); this torch is {torch.__version__}: upgrade torch, or train under DDP without --fsdp"),
            (n > 1 and (not ddp or world % n or cfg.fsdp), f"--context_parallel={n} splits each sequence over n of "
             "the processes torchrun starts, under DDP: run torchrun with a multiple of n processes, without --fsdp"),
            (n > 1 and config.block_size % n, f"--context_parallel={n}: block_size={config.block_size} must be a "
             "multiple of it, so that every rank holds as many positions"),
            (n > 1 and (config.arch != "decoder" or config.window or config.pos in ("alibi", "relative") or
                        (config.attention, config.score) != ("softmax", "scaled_dot") or config.mem_len),
             "--context_parallel: ring attention is exact softmax attention (the scaled dot product) of a decoder "
             "(whose shards count equal tokens in the loss), with no window, score bias or memory"),
            (cfg.objective == "bart" and config.arch != "encoder-decoder", "--objective=bart trains an encoder-decoder "
             "to denoise: set --arch=encoder-decoder, or leave out --objective"),
            (config.mem_len and ddp, "mem_len (Transformer-XL) trains in one process here: the memory of each "
             "rank's rows would have to be gathered to be saved; leave out torchrun, or set mem_len=0"),
            (config.attn_impl == "triton" and device.type != "cuda" and not kernels.INTERPRET,
             "attn_impl='triton' runs on CUDA GPUs: use --attn_impl=auto (torch's SDPA here)"),
            *problems(config, cfg, world, ddp)]:
        if wrong:
            raise UsageError(problem)
    check_data(config, data, cfg.dataset, tokens, cfg.noise_density, cfg.mean_span, cfg.objective)


@dataclass
class Run:
    """What the training loop works with, set up by main."""
    cfg: TrainConfig
    device: torch.device
    autocast: object  # the context of every forward pass: autocast in bf16/fp16, nothing in fp32
    data: dict
    meta: dict
    model: torch.nn.Module  # compiled and wrapped in DDP as asked
    raw_model: Transformer  # the model itself (sharded in place under FSDP), whose weights are saved
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    tokens: dict  # the objectives' special tokens: a mask, a decoder start, sentinels
    rank: int = 0
    world: int = 1
    group: object = None  # context parallel: the ranks that hold this rank's sequences, a shard each


def batch(run, split, gen, segment):
    """A batch of the objective on the run's device, drawn by the generator gen; with a memory
    (Transformer-XL), segment `segment` of the streams whose starts gen draws."""
    c, cfg = run.raw_model.config, run.cfg
    b = stream_batch(run.data[split], cfg.batch_size, c.block_size, gen, segment) if c.mem_len else \
        get_batch(run.data[split], c.arch, cfg.batch_size, c.block_size, gen, run.tokens, run.meta.get("vocab_size"),
                  cfg.mask_prob, cfg.noise_density, cfg.mean_span, cfg.objective)
    pinned = run.device.type == "cuda"  # pinned memory lets the copy overlap with compute (if contiguous)
    b = {k: (v.contiguous().pin_memory() if pinned else v).to(run.device, non_blocking=pinned) for k, v in b.items()}
    return b if run.group is None else context_shard(b, run.rank, cfg.context_parallel, run.group)  # its shard


@torch.no_grad()
def evaluate(run, it):
    """Mean loss over eval_iters batches per split, the same at every eval whatever the mesh (the dp ranks
    share them out), and an image classifier's val_acc; None if a signal cuts it short (the resumed run
    evaluates again). One that will take more than a few seconds says so after its second batch."""
    run.model.eval()
    out, t0, stream = {}, time.time(), bool(run.raw_model.config.mem_len)  # streams: eval_iters segments on
    (_, dp, cp, tp), d = mesh_shape(run.cfg, run.world), coordinates(run.cfg, run.rank, run.world)["dp"]
    right = torch.zeros((), device=run.device) if run.raw_model.config.n_classes else None  # val's right answers
    for split in ("train", "val"):
        losses, mems = torch.zeros(run.cfg.eval_iters, device=run.device), {}
        for k in range(d, run.cfg.eval_iters, dp):
            if stopping(run.device):
                run.model.train()
                return None
            gen = eval_rng(run.cfg.seed, split == "val", 0, STREAM if stream else k)
            losses[k] = forward(run, batch(run, split, gen, k), mems, right=right if split == "val" else None)
            if split == "train" and k < 2 * dp:  # timed by its second batch: the first pays for warming up
                sync(run.device)
                now = time.time()
                if k >= dp and (eta := (now - t0) * 2 * run.cfg.eval_iters / dp) > EVAL_NOTICE_S:
                    log(f"step {it}: evaluating {2 * run.cfg.eval_iters} batches per rank, about {eta:.0f} s")
                t0 = now
        out[split] = all_ranks(losses.mean()).item() / (cp * tp)  # each batch's loss: cp shards, tp copies
    if right is not None:  # (an image model trains data-parallel only: parallel.problems)
        out["val_acc"] = all_ranks(right).item() / (run.cfg.eval_iters * run.cfg.batch_size)
    run.model.train()
    return out


def save(run, path, iter_num, **progress):
    """Write a checkpoint of iteration iter_num, unless the weights are broken (then the last good
    one stays). Under DDP and FSDP every rank takes part, and rank 0 writes."""
    if not finite(run.raw_model):
        log(f"not saving {path}: the weights are not finite; it keeps its last good state")
        return False
    states = [rng_state(run.device)]
    if dist.is_initialized():  # every rank's dropout state, so that each resumes where it stopped
        states = [None] * run.world
        dist.all_gather_object(states, {k: v.cpu() for k, v in rng_state(run.device).items()})
    model_state, optimizer_state = state_dicts(run.raw_model, run.optimizer)  # whole, even under FSDP
    failed = None
    if MASTER:
        try:
            save_atomic(dict(model=model_state, optimizer=optimizer_state,
                             scaler=run.scaler.state_dict(), model_config=asdict(run.raw_model.config),
                             train_config=asdict(run.cfg), rng=states, meta=run.meta,
                             tokens=run.tokens, iter_num=iter_num, **progress), path)
            if path == checkpoint_paths(run.cfg.out_dir)[0]:  # after ckpt.pt is whole: an old state may go
                keep_checkpoints(path, iter_num, run.cfg.keep_checkpoints)
        except UsageError as e:  # a full disk: every rank stops with it (rank 0 says why), rather than
            failed = e  # the others meeting a closed connection at their next collective
    if all_ranks(torch.tensor(float(failed is not None), device=run.device)).item() and not failed:
        failed = UsageError(f"rank 0 could not write {path}")
    if failed:
        raise failed
    return True


def forward(run, b, mems, key=0, right=None):
    """The loss of batch b; with a memory (Transformer-XL), the segment after the one that left
    mems[key] (each layer's memory), which it replaces. right: an image classifier's right answers add to it."""
    with run.autocast:
        if not run.raw_model.config.mem_len:
            logits, loss = run.model(**b)
            if right is not None:
                right += (logits.argmax(-1) == b["targets"]).sum()
            return loss
        _, loss, mems[key] = run.model(**b, mems=mems.get(key), return_mems=True)
        return loss


def forward_backward(run, it, mems):
    """The gradients of iteration it's batch (this rank's share of its micro-steps); its mean loss.
    mems: the memory of each micro-step's streams (Transformer-XL), carried to the next iteration."""
    d = coordinates(run.cfg, run.rank, run.world)["dp"]  # the ranks of other dims draw the same batches
    accum = run.cfg.gradient_accumulation_steps // mesh_shape(run.cfg, run.world)[1]
    if isinstance(run.raw_model, Pipeline):  # the micro-steps in the schedule's order, the backward with them
        return run.raw_model.step([batch(run, "train", batch_rng(run.cfg.seed, it, d * accum + m), it) for m in
                                   range(accum)])
    step_loss = torch.zeros((), device=run.device)
    for micro in range(accum):  # a stream (Transformer-XL) draws its start once, then reads segment it
        key = (STREAM if run.raw_model.config.mem_len else it, d * accum + micro)
        b = batch(run, "train", batch_rng(run.cfg.seed, *key), it)
        if isinstance(run.model, DDP):  # average gradients across ranks only on the last micro-step
            run.model.require_backward_grad_sync = micro == accum - 1
        elif sharded(run.raw_model):  # FSDP's reduce-scatter, likewise
            run.raw_model.set_requires_gradient_sync(micro == accum - 1)
        loss = forward(run, b, mems, micro)
        run.scaler.scale(loss / accum).backward()
        step_loss += loss.detach() / accum
    return step_loss


# ----------------------------------------------------------------------------------------------
# The run

def main(argv):
    if {"-h", "--help"} & set(argv):
        print(usage(__doc__, TrainConfig, ModelConfig, skip=("vocab_size",)))
        return 0
    train_args, model_args = parse_settings(argv, TrainConfig, ModelConfig, skip=("vocab_size",))
    cfg = TrainConfig(**train_args)
    check_ranges(cfg, TRAIN_RANGES)
    budget_seconds(cfg.max_time)  # refused now, not after setting up
    STOP.clear()  # signals from an earlier run in this process (tests) are not this run's
    with ExitStack() as held:  # what the run holds until it ends, however it ends: its lock on out_dir
        try:
            return train(cfg, model_args, held, given=set(train_args))
        except (RuntimeError, MemoryError) as e:  # torch's allocators raise RuntimeErrors
            if (oom := out_of_memory(e)) is None:
                raise
            raise UsageError(f"{oom}: lower --batch_size, raising --gradient_accumulation_steps to keep the "
                             "tokens per step; checkpoints already in out_dir are as they were") from None


def train(cfg, model_args, held, given=()):
    # distributed: torchrun sets RANK, LOCAL_RANK and WORLD_SIZE
    ddp = "RANK" in os.environ
    rank, local_rank, world = (int(os.environ[k]) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE")) if ddp else (0, 0, 1)
    device = pick_device(cfg.device, local_rank if ddp else None)
    check_mesh(cfg, world) if ddp else None  # (without torchrun: check_fits says to use it)
    dtype = pick_dtype(cfg.dtype, device)
    if device.type == "cuda":  # fp32 products on tensor cores
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    writes = not cfg.eval_only  # --eval_only looks at a run and writes nothing
    if MASTER and writes:  # take out_dir, and find out now that it takes files, not at the first checkpoint
        prepare_out_dir(cfg.out_dir, held)
    ckpt_path, auto = checkpoint_paths(cfg.out_dir)[0], cfg.init_from == "auto"
    # what the model starts from: a checkpoint to resume, or a pretrained model's weights
    cfg, ckpt = starting_point(cfg, writes, given)
    data, meta = load_data(cfg.data_dir, cfg.dataset)
    if cfg.init_from not in ("scratch", "resume"):  # what sample.py and eval.py read it as
        model, ckpt = load_source(cfg.init_from)
        ckpt["model"] = model.state_dict()
    config, changed = model_config_of(cfg, model_args, meta, ckpt, ckpt_path, whole=auto)
    if changed:  # as in nanoGPT the training settings come from the command line: say which differ
        log("resuming with training settings changed from the checkpoint's: " + ", ".join(changed))
    # the objectives' own tokens: a mask, a decoder start, sentinels, (BART) the ends of sentences it permutes
    tokens = ckpt["tokens"] if ckpt else special_tokens(meta.get("vocab_size", 0))  # (images: unused)
    tokens = tokens | sentence_ends(meta, cfg.objective)
    check_fits(config, cfg, data, device, tokens, ddp)
    if ddp:  # only now: a bad setting above stops every rank at once, before any waits for the others
        join_ranks(cfg.backend if cfg.backend != "auto" else "nccl" if device.type == "cuda" else "gloo")
    mesh = make_mesh(device, cfg, world) if ddp else None  # (pp, dp, cp, tp)
    group = mesh["cp"].get_group() if cfg.context_parallel > 1 else None

    model = build_model(cfg, config, ckpt, device, rank)  # split before the optimizer, which steps on the parts
    model = parallelize(model, mesh, cfg, device, dtype, make_optimizer)
    optimizer = zero_one(make_optimizer(model, cfg, fused=device.type in ("cuda", "cpu")), cfg, mesh)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    # progress: the best val loss so far, and the iteration and val loss of the last full evaluation
    it, progress = 0, dict(best_val_loss=float("inf"), evaluated_at=None, val_loss=None, fitted_iters=None, mems={})
    if cfg.init_from == "resume":
        it, progress = restore(ckpt, model, optimizer, scaler, rank, world, device)
        log(f"resuming {ckpt_path} from iteration {it}" + " (--init_from=auto)" * auto)
        if it >= cfg.max_iters and not cfg.eval_only:
            log(f"{ckpt_path} is at iteration {it} of max_iters={cfg.max_iters}: nothing to do. To train on, raise "
                f"--max_iters (and --lr_decay_iters, where the learning rate has decayed)")
            return 0
    del ckpt
    compiled = torch.compile(model) if cfg.compile else model
    # experts that a batch does not route to get no gradient, which DDP must be told
    if ddp and not sharded(model) and mesh_shape(cfg, world)[::3] == (1, 1):
        compiled = DDP(compiled, device_ids=[local_rank] if device.type == "cuda" else None,
                       find_unused_parameters=config.n_expert > 0)
    autocast = torch.autocast(device.type, dtype=dtype) if dtype != torch.float32 else nullcontext()
    run = Run(cfg, device, autocast, data, meta, compiled, model, optimizer, scaler, tokens, rank, world, group)
    for s in (signal.SIGINT, signal.SIGTERM):  # from now on: a checkpoint, then stop
        signal.signal(s, on_signal)
    return loop(run, it, progress, dtype)


def build_model(cfg, config, ckpt, device, rank):
    """The model: its weights drawn from the seed, the same on every rank (FSDP keeps each rank's slice
    of them), or the checkpoint's; with --lora_rank, LoRA's adapters beside the chosen layers, every
    other weight frozen. Each rank then draws its own dropout."""
    torch.manual_seed(cfg.seed)
    model = Transformer(config).to(device)
    try:  # LoRA before the checkpoint's weights: a resumed LoRA run holds its adapters
        add_lora(model, cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout, tuple(cfg.lora_targets.split(","))) \
            if cfg.lora_rank else None
    except ValueError as e:  # no layer of that name
        raise UsageError(f"--lora_targets={cfg.lora_targets}: {e}") from None
    if rank:
        torch.manual_seed(cfg.seed + rank)
    if ckpt is not None:
        for k in [k for k in ckpt["model"] if k.endswith("wpe.weight")]:  # a shorter block_size: fewer positions
            ckpt["model"][k] = ckpt["model"][k][: config.block_size]
        missing = model.load_state_dict(ckpt["model"], strict=not cfg.lora_rank).missing_keys  # whole, before FSDP
        assert all(k.endswith((".lora_A", ".lora_B")) for k in missing), missing  # only new adapters start afresh
    return model


def start_line(run, dtype):
    """Log what trains where; returns the tokens per iteration and seconds per iteration -> MFU (None without a
    peak: a GPU's is its spec sheet's, or a large matmul's; a CPU's would move with the machine's other load)."""
    c, device = run.raw_model.config, run.device
    tokens_per_iter = run.cfg.gradient_accumulation_steps * run.cfg.batch_size * c.block_size
    flops_per_iter = run.raw_model.flops_per_token(c.block_size) * tokens_per_iter / run.world
    peak, source = peak_flops(device, dtype) if device.type == "cuda" else (None, "")
    n_params = getattr(run.raw_model, "whole_params", 0) or sum(p.numel() for p in run.raw_model.parameters())
    log(f"{c.arch} with {n_params / 1e6:.2f}M parameters on {run.world} x {device} ({dtype}); {tokens_per_iter:,} "
        f"tokens per iteration" + (f"; MFU against {source}" if peak else ""))
    if sharded(run.raw_model):
        log(memory_line(run.optimizer, run.world))
    if run.world > 1:
        log(mesh_line(run))
    if run.group is not None:
        log(context_line(c, run.cfg.context_parallel, run.cfg.batch_size, dtype))
    if run.cfg.lora_rank:
        log(lora_line(run.raw_model))
    return tokens_per_iter, lambda dt: flops_per_iter / dt / peak if peak else None


def record_evaluation(run, it, losses, progress, saved_at, report):
    """Log an evaluation, save best.pt when val improves and ckpt.pt (unless the loss is not finite),
    then hand it to the report; returns the iteration that ckpt.pt holds."""
    cfg, (ckpt_path, best_path) = run.cfg, checkpoint_paths(run.cfg.out_dir)
    progress.update(evaluated_at=it, val_loss=losses["val"])
    acc = f", val acc {losses['val_acc']:.4f}" if "val_acc" in losses else ""  # an image classifier's
    log(f"step {it}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}{acc} "
        f"({time.time() - START:.1f} s since start)")
    if not math.isfinite(losses["val"]):
        log(f"the val loss is not finite: no checkpoint written ({holds(ckpt_path, saved_at)})")
    elif not cfg.eval_only:
        if losses["val"] < progress["best_val_loss"]:
            progress["best_val_loss"] = losses["val"]
            save(run, best_path, it, **progress)
        if cfg.always_save_checkpoint and save(run, ckpt_path, it, **progress):
            saved_at = it
    if report:  # after the checkpoints, which matter more
        report.evaluation(it, losses)
    return saved_at


def loop(run, it, progress, dtype):
    """Train from iteration it to max_iters, evaluating and saving every eval_interval. progress:
    the best val loss so far and the iteration of the last evaluation, which checkpoints keep."""
    cfg, device = run.cfg, run.device
    writes = not cfg.eval_only
    ckpt_path, _ = checkpoint_paths(cfg.out_dir)
    tokens_per_iter, mfu = start_line(run, dtype)
    report = Report(run, it, tokens_per_iter, dtype) if writes and MASTER else None  # metrics, wandb, the page
    saved_at = it if cfg.init_from == "resume" else None  # what ckpt.pt holds
    skips = Skips(device, log)
    t_start, started = time.time(), it
    t0, t0_iter = t_start, it  # the start of the timing that the next log line reports
    # a resumed --max_time run keeps the length it chose, unless the rest would not fit
    budget = Budget(budget_seconds(cfg.max_time), it, START, fitted=bool(progress["fitted_iters"]))
    while True:
        factor = lr_factor(it, cfg)  # each group runs at its own peak times the schedule
        for group in run.optimizer.param_groups:
            group["lr"] = group["base_lr"] * factor
        lr = cfg.learning_rate * factor  # AdamW's, as logged
        # every eval_interval, and at the end, so that best.pt and ckpt.pt both know the last weights
        due = cfg.eval_only or (it % cfg.eval_interval == 0 or it == cfg.max_iters) and it != progress["evaluated_at"]
        t_eval = time.time()
        losses = evaluate(run, it) if due else None  # None also when a signal cut it short
        if losses is not None:
            saved_at = record_evaluation(run, it, losses, progress, saved_at, report)
            budget.evaluated(it, time.time() - t_eval)
            t0, t0_iter = time.time(), it  # evaluation is not training time
        if stopping(device, agree=it % cfg.log_interval == 0 or due):
            if writes and it != saved_at and save(run, ckpt_path, it, **progress):
                saved_at = it
            name = signal.Signals(STOP[0]).name if STOP else "a signal to another rank"
            log(f"stopped by {name} at iteration {it}: {holds(ckpt_path, saved_at)}; resume with --init_from=resume")
            return 128 + (STOP[0] if STOP else signal.SIGTERM)
        if cfg.eval_only or it >= cfg.max_iters:
            break

        step_loss = forward_backward(run, it, progress["mems"])
        # a non-finite loss (a spike, an overflow) would poison the weights: the step is skipped and
        # counted on the device, and the host stops the run at a log line if too many came in a row
        bad = all_ranks((~torch.isfinite(step_loss)).float(), dist.ReduceOp.MAX)
        skips.add(bad)
        optimizer_step(run.model, run.optimizer, run.scaler, cfg.grad_clip, bad)
        it += 1
        run.raw_model.redraw_features(it, cfg.seed)  # Performer: new random features every feature_redraw steps
        if (n := budget.fit(cfg, it, device)) is not None:  # --max_time: the length that fits, one for all ranks
            n = int(all_ranks(torch.tensor(float(n), device=device), dist.ReduceOp.MIN).item())
            run.cfg = cfg = replace(cfg, max_iters=n, lr_decay_iters=n)
            progress["fitted_iters"] = n
            log(f"max_time={cfg.max_time}: {n} iterations fit ({budget.dt * 1000:.1f} ms each, {budget.eval_s:.1f} s "
                "an evaluation with its checkpoints); the learning rate decays until then")

        looking = it % cfg.log_interval == 0 or it == started + 1  # the host waits for the device only here
        if (looking or it == cfg.max_iters) and (in_row := skips.read(it)) >= cfg.max_bad_steps:
            if MASTER:
                print(f"train.py: stopping: the loss was not finite for {in_row} steps in a row; "
                      f"{holds(ckpt_path, saved_at)}: lower learning_rate, raise warmup_iters or set grad_clip",
                      file=sys.stderr)
            return 1
        if looking and run.world > 1:  # the whole batch's: every data-parallel rank's share and shard (pp: the last)
            step_loss = all_ranks(step_loss) / (run.world // run.cfg.pipeline_parallel)
        if looking and MASTER:  # the first as soon as it is timed
            sync(device)
            dt = (time.time() - t0) / (it - t0_iter)  # fewer than log_interval after a resume or an eval
            t0, t0_iter, loss, util = time.time(), it, step_loss.item(), mfu(dt)
            log(log_line(it, loss, lr, dt, util, tokens_per_iter, cfg.max_iters))
            if report:
                report.add(it, loss=loss, lr=lr, ms_per_iter=dt * 1000, tokens_per_s=tokens_per_iter / dt, mfu=util)

    if writes and it != saved_at:
        save(run, ckpt_path, it, **progress)  # the final state, unless just saved
    if isinstance(run.model, DDP):  # DDP keeps the replicas equal; check it: a silent divergence would be costly
        flat = torch.cat([p.detach().float().flatten() for p in run.raw_model.parameters()])
        spread = all_ranks(torch.stack((flat, -flat)), dist.ReduceOp.MAX)
        log(f"ranks agree: max parameter difference {(spread[0] + spread[1]).max().item():.3g}")
    log(f"done: {it} iterations ({skips.seen} skipped), best val loss {progress['best_val_loss']:.4f}, "
        f"{time.time() - t_start:.1f} s" + (f", peak GPU memory {torch.cuda.max_memory_allocated(device) / 2**30:.1f} "
                                             "GiB" if device.type == "cuda" else ""))
    return 0


if __name__ == "__main__":
    try:
        status = main(sys.argv[1:])
    except UsageError as e:
        connected = dist.is_initialized()
        if not MASTER and not connected:
            # under torchrun every rank meets a bad setting and rank 0 reports it. torchrun stops
            # all ranks as soon as one exits, maybe before rank 0 has printed: so the others wait
            # to be stopped, and speak only if they are not (an error of their own)
            time.sleep(10)
        if MASTER or not connected:
            print(f"train.py: error: {e}", file=sys.stderr)
        status = 2
    if dist.is_initialized():
        # release DDP and wait for every rank before tearing down: gloo threads that still hold
        # Python objects at interpreter exit abort the process (SIGABRT) now and then
        gc.collect()
        if status == 0:
            dist.barrier()
        dist.destroy_process_group()
    leave(status)
