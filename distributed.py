"""
Training on many processes under torchrun: the collectives the loop waits on, and what FSDP2
(--fsdp=True, --zero=2|3; parallel.shard) needs, which shards the model and its optimizer over the ranks.
The mesh and the other schemes (tensor, pipeline, ZeRO-1) are in parallel.py.

Under DDP every rank holds every parameter, its gradient and AdamW's two moments: 16 bytes per
parameter in fp32. FSDP2's `fully_shard` leaves each rank a 1/world slice of each (a DTensor
sharded along dim 0). A block's weights are gathered just before it runs and freed after it; the
rest (embeddings, final norms, heads) stay gathered from the forward pass to the backward; the
gradients are reduce-scattered to their slices. The optimizer steps on the slices as they are;
Muon, which needs whole matrices, gathers each (`whole`) and keeps its slice of the update
(`slice_like`).

Checkpoints stay whole and plain: `state_dicts` gathers them to rank 0 in the form one process
writes, so sample.py, a one-process run and DDP read them as they read any other.
"""

import os
import sys
from dataclasses import dataclass, replace
from datetime import timedelta

import torch
import torch.distributed as dist

from common import UsageError, check_ranges, parse_settings
from model import ModelConfig, Transformer

# FSDP2 and DTensor, public since torch 2.6, are imported where a run uses them: they take over a second to
# import, which a run on one process, sample.py and eval.py need not pay. Until they are, nothing is sharded.
FSDP2 = torch.__version__ >= "2.6"


def loaded(module, name):
    """module.name if something imported module, else () (an isinstance against () is always False)."""
    return getattr(sys.modules.get(module), name, ())


def all_ranks(x, op=dist.ReduceOp.SUM, group=None):
    """x (a tensor) reduced over the ranks (of group) in place; x itself in one process."""
    if dist.is_initialized():
        dist.all_reduce(x, op=op, group=group)
    return x


def join_ranks(backend):
    """Connect this process to the others that torchrun started. Under torchrun --max_restarts, with
    one torchrun for all ranks (one machine), each start of the ranks gets a namespace of its own in
    torchrun's store: torchrun keeps one store for every start since torch 2.5, and the addresses
    that the last start's ranks left there sent a rank started again to a dead one's port, or to a
    wait with no end (pytorch#135712). Several machines count their starts apart, so there
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 gives each start a store of its own (docs/training.md)."""
    env = os.environ
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or env.get("LOCAL_WORLD_SIZE") != env["WORLD_SIZE"]:
        return dist.init_process_group(backend=backend)
    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), int(env["WORLD_SIZE"]), is_master=False,
                          timeout=timedelta(minutes=30))  # torch's default for the process group, as it sets
    store = dist.PrefixStore(f"nanoformer/start_{env.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
    dist.init_process_group(backend=backend, store=store, rank=int(env["RANK"]), world_size=int(env["WORLD_SIZE"]))


def context_shard(b, rank, n, group):
    """Rank's shard of each sequence of batch b (its inputs and targets), the (rank % n)-th of n, with the
    positions it holds and the group whose ranks hold the others."""
    T, index = b["idx"].size(1) // n, rank % n
    part = slice(index * T, (index + 1) * T)
    return {k: v[:, part] for k, v in b.items()} | dict(group=group, input_pos=torch.arange(
        index * T, (index + 1) * T, device=b["idx"].device))


def context_line(config, n, batch_size, dtype):
    """The start line's account of context parallel: the positions each rank holds, and the activations
    it keeps for the backward pass as Korthikanti et al. (2022) count them, 34 x n_embd bytes a position
    and layer in 16-bit (here in dtype), with no T x T scores (ring attention keeps none)."""
    T = config.block_size // n
    per_rank = batch_size * T * config.n_layer * 34 * config.n_embd * torch.finfo(dtype).bits / 16
    return (f"context parallel: {n} ranks a sequence of {config.block_size}, {T} positions each; activations about "
            f"{per_rank / 1e6:,.1f} MB a rank ({n * per_rank / 1e6:,.1f} MB in one)")


def sharded(model):
    return isinstance(model, loaded("torch.distributed.fsdp", "FSDPModule"))


def local(t):
    """This rank's part of t: its slice of a sharded tensor, or t itself."""
    return t.to_local() if isinstance(t, loaded("torch.distributed.tensor", "DTensor")) else t


def whole(t):
    """t whole on every rank: a sharded tensor gathered (every rank must ask), or t itself."""
    return t.full_tensor() if isinstance(t, loaded("torch.distributed.tensor", "DTensor")) else t


def slice_like(t, like):
    """The slice of t (whole, the same on every rank) that this rank holds of like; t itself if
    like is not sharded. No communication: each rank cuts out its own."""
    if not isinstance(like, loaded("torch.distributed.tensor", "DTensor")):
        return t
    from torch.distributed.tensor import DTensor, Replicate
    mesh = like.device_mesh
    return DTensor.from_local(t, mesh, [Replicate()] * mesh.ndim, run_check=False).redistribute(mesh, like.placements)


def finite(model):
    """Whether every parameter is finite, as all ranks agree (under FSDP each checks its slices)."""
    ok = torch.stack([torch.isfinite(local(p)).all() for p in model.parameters()]).all().float()
    return all_ranks(ok, dist.ReduceOp.MIN).item() > 0


def state_dicts(model, optimizer):
    """The model's and the optimizer's state dicts, whole and in the form one process writes (the
    optimizer's keyed by each parameter's index). Under FSDP every rank must call this: the slices
    are gathered one tensor at a time into rank 0's host memory, and the other ranks get (None, None)."""
    if hasattr(model, "whole_states"):  # split by tensor or pipeline parallel (parallel.py)
        return model.whole_states(optimizer)
    if hasattr(optimizer, "consolidate_state_dict"):  # ZeRO-1: each rank's share of the state to rank 0
        optimizer.consolidate_state_dict(0)
        return (model.state_dict(), optimizer.state_dict()) if dist.get_rank() == 0 else (None, None)
    if not sharded(model):
        return model.state_dict(), optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state = get_model_state_dict(model, options=options)
    # before the first step the state holds no tensors; DCP would create them by a step with zero
    # gradients, which counts as a step (AdamW's bias correction would then start at step 2)
    named = get_optimizer_state_dict(model, optimizer, options=options) if optimizer.state else None
    if dist.get_rank():
        return None, None
    if named is None:
        return model_state, optimizer.state_dict()
    # DCP keys the optimizer's state by parameter name; one process's load_state_dict wants indices
    index = {name: i for i, name in enumerate(n for g in named["param_groups"] for n in g["params"])}
    return model_state, dict(state={index[n]: s for n, s in named["state"].items()},
                             param_groups=[g | dict(params=[index[n] for n in g["params"]])
                                           for g in named["param_groups"]])


def load_optimizer_state(model, optimizer, state):
    """Load a state dict in the form state_dicts writes (whole, keyed by index), which every rank
    has read; under FSDP each rank keeps its slices of it."""
    if hasattr(model, "load_part_state"):  # split by tensor or pipeline parallel: its parts of it
        return model.load_part_state(optimizer, state)
    if not sharded(model) or not state["state"]:  # (no state yet: nothing to slice, and see state_dicts)
        return optimizer.load_state_dict(state)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
    name = {p: n for n, p in model.named_parameters()}
    names = [name[p] for g in optimizer.param_groups for p in g["params"]]
    named = dict(state={names[i]: s for i, s in state["state"].items()},
                 param_groups=[g | dict(params=[names[i] for i in g["params"]]) for g in state["param_groups"]])
    set_optimizer_state_dict(model, optimizer, named, options=StateDictOptions(full_state_dict=True))


def held_bytes(optimizer, replica=False):
    """Bytes of parameters and optimizer state that this rank holds once the optimizer has stepped:
    each parameter's slice (the whole of it for a replica, as DDP keeps) and as much again for each
    of its moments, AdamW's two or Muon's one. Not counted: the gradients (as large as the
    parameters, from the backward pass to the step) and the gathered block a rank is running."""
    return sum((p.numel() if replica else local(p).numel()) * p.element_size() * (2 if group.get("muon") else 3)
               for group in optimizer.param_groups for p in group["params"])


def memory_line(optimizer, world):
    """The start line's account of what FSDP saves. Rank 0's figure is the largest: when a dim 0
    does not divide evenly, the first ranks get the longer slices."""
    mb = lambda n: f"{n / 1e9:.3g} GB" if n >= 1e9 else f"{n / 1e6:.3g} MB"  # noqa: E731
    return (f"fsdp: {world} rank{'s hold' if world > 1 else ' holds'} {mb(held_bytes(optimizer))} of parameters and "
            f"optimizer state each (DDP: {mb(held_bytes(optimizer, replica=True))})")


# ----------------------------------------------------------------------------------------------
# Planning memory: what each rank of a mesh holds, computed (bench.py memory). parallel.held counts
# the same from the parts a rank holds, and tests/test_parallel.py checks the two against real ranks.

ACCOUNTING = {"project": (4, 4, 8), "paper": (2, 2, 12)}  # bytes a parameter: weights, gradients, optimizer state
TP_SPLIT = ("attn.c_attn.weight", "attn.c_attn.bias", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_fc.bias",
            "mlp.c_proj.weight", "wte.weight", "wpe.weight", "lm_head.weight", "lm_head.bias")  # parallel.py's plan


def split_layers(n_layer, stages):
    """[lo, hi) of each pipeline stage's blocks: as even as can be, the first stages one more."""
    sizes = [n_layer // stages + (s < n_layer % stages) for s in range(stages)]
    return [(sum(sizes[:s]), sum(sizes[:s + 1])) for s in range(stages)]


def stage_parameters(config, pp, tp, v=1, optimizer="adamw"):
    """Per pipeline stage of a rank (v stages a rank: interleaved), (elements a rank holds, of them under
    Muon's single moment, blocks), as parallel.py splits them; a tied matrix is on the first and last."""
    with torch.device("meta"):
        model = Transformer(config)
    spans, stages = split_layers(config.n_layer, pp * v), pp * v
    out = [[0, 0, 0] for _ in range(stages)]
    for name, p in model.named_parameters(remove_duplicate=False):
        n = p.numel() // tp if tp > 1 and name.endswith(TP_SPLIT) else p.numel()
        if ".h." in name:
            i = int(name.split(".h.")[1].split(".")[0])
            where = [next(s for s, (lo, hi) in enumerate(spans) if lo <= i < hi)]
        elif name.startswith(("wte", "encoder.wpe", "decoder.wpe", "encoder.rel", "decoder.rel")):
            where = [0]
        else:  # final norms, heads; a tied head is a second copy only when it is on another stage
            where = [stages - 1] if not (name == "lm_head.weight" and config.tie_embeddings and stages == 1) else []
        for s in where:
            out[s][0] += n
            out[s][1] += n if optimizer == "muon" and ".h." in name and p.dim() == 2 else 0
    for s, (lo, hi) in enumerate(spans):
        out[s][2] = hi - lo
    return [tuple(o) for o in out]


def activation_bytes(config, batch, T, dtype):
    """(a block's, the rest's) bytes that one forward pass of `batch` sequences of T saves for the backward
    pass, read off torch's saved-tensor hooks on the meta device (no memory spent): this model's own count."""
    def saved(n_layer):
        with torch.device("meta"):
            model = Transformer(replace(config, n_layer=n_layer, block_size=max(T, config.block_size))).to(dtype)
            idx = torch.zeros(batch, T, dtype=torch.long)
        params, seen = {id(p) for p in model.parameters()}, {}

        def pack(t):  # not the weights, nor the T x T attention weights of the math path that meta runs:
            # the fused kernels (flash attention, and SDPA's on a CPU) keep none
            if id(t) not in params and id(t._base) not in params and not (t.dim() > 1 and t.shape[-2:] == (T, T)):
                seen[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(idx, idx, **({"src": idx} if config.arch == "encoder-decoder" else {}))
        return sum(seen.values())
    one, two = saved(1), saved(2)
    return two - one, 2 * one - two


def zero_stage(cfg, world):
    """The ZeRO stage that runs: the one asked for; under tp or pp with data parallel, FSDP2's 3 or 2."""
    rest = cfg.pipeline_parallel * cfg.context_parallel * cfg.tensor_parallel
    pp, dp, tp = cfg.pipeline_parallel, max(1, world // rest), cfg.tensor_parallel
    zero = 3 if cfg.fsdp else cfg.zero
    return zero or (0 if dp == 1 or (tp == 1 and pp == 1) else 3 if pp == 1 else 2)


def plan(config, world, pp=1, cp=1, tp=1, batch=1, accum=1, schedule="1F1B", optimizer="adamw",
         accounting="project", dtype=torch.bfloat16, checkpointing=False, params=0.0):
    """Bytes a rank holds (the most loaded one) for each ZeRO stage 0-3: {zero: (weights, gradients, optimizer
    state, activations)}. Weights are counted whole while a step runs under stages 0-2 (FSDP2's ZeRO-2
    gathers them for the step); params > 0: a model of that many parameters, its states only."""
    dp, (w, g, o) = world // (pp * cp * tp), ACCOUNTING[accounting]
    v = 2 if schedule == "Interleaved1F1B" else 1
    stages = [(params / (pp * tp), 0, 0)] if params else stage_parameters(config, pp, tp, v, optimizer)
    per_rank = [[sum(x) for x in zip(*stages[r::pp])] for r in range(pp)]  # a rank's stages: r, r + pp...
    acts = [0.0] * pp
    if not params:
        layer, rest = activation_bytes(config, batch, config.block_size // cp, dtype)
        kept = batch * config.block_size // cp * config.n_embd * torch.finfo(dtype).bits // 8  # a block's input
        flight = 1 if pp == 1 else accum if schedule == "GPipe" else min(accum, pp) * (1 + (v - 1) * (pp - 1) / (pp * v))
        for r, (_, _, blocks) in enumerate(per_rank):
            each = (kept * blocks + layer / tp) if checkpointing else layer * blocks / tp
            acts[r] = flight * each + rest * (r in (0, pp - 1))
    out = {}
    for zero in range(4):
        out[zero] = max(((n * w / (dp if zero == 3 else 1), n * g / (dp if zero >= 2 else 1),
                          (n * o - m * o / 2) / (dp if zero >= 1 else 1), a)
                         for (n, m, _), a in zip(per_rank, acts)), key=sum)
    return out


@dataclass
class MemoryConfig:
    gpus: int = 8  # the world: the ranks of the mesh (pp x dp x cp x tp; dp takes what the others leave)
    gpu_memory: float = 80.0  # GB a device holds: what fits, and the deepest model of this width that does
    accounting: str = "project"  # "project": fp32 weights and gradients, AdamW's 8 bytes; "paper": ZeRO's 2 + 2 + 12
    params: float = 0.0  # > 0: a model of this many parameters, its states alone (ZeRO's check: 7.5e9 on 64)
    checkpointing: bool = False  # activations: each block keeps its input only and recomputes the rest


def plan_memory(argv, train_config, train_ranges):
    """bench.py memory: the plan of a config on a mesh (train_config: train.py's TrainConfig), printed."""
    mem_args, train_args, model_args = parse_settings(argv, MemoryConfig, train_config, ModelConfig)
    m, cfg, config = MemoryConfig(**mem_args), train_config(**train_args), ModelConfig(**model_args)
    check_ranges(cfg, train_ranges)
    check_ranges(m, dict(gpus="[1, inf)", gpu_memory="(0, inf)", accounting=tuple(ACCOUNTING), params="[0, inf)"))
    pp, cp, tp = cfg.pipeline_parallel, cfg.context_parallel, cfg.tensor_parallel
    if m.gpus % (pp * cp * tp):
        raise UsageError(f"--gpus={m.gpus} is not a mesh of pipeline_parallel={pp} x context_parallel={cp} x "
                         f"tensor_parallel={tp} x data parallel: make it a multiple of {pp * cp * tp}")
    dp, dtype = m.gpus // (pp * cp * tp), torch.float32 if cfg.dtype == "float32" else torch.bfloat16
    kw = dict(pp=pp, cp=cp, tp=tp, batch=cfg.batch_size, accum=max(1, cfg.gradient_accumulation_steps // dp),
              schedule=cfg.pipeline_schedule, optimizer=cfg.optimizer, accounting=m.accounting, dtype=dtype,
              checkpointing=m.checkpointing, params=m.params)
    rows, gb, ran = plan(config, m.gpus, **kw), lambda n: f"{n / 1e9:9.3g}", zero_stage(cfg, m.gpus)  # noqa: E731
    n = m.params or sum(p for p, _, _ in stage_parameters(config, 1, 1))
    print(f"{n / 1e9:.3g}B parameters on {m.gpus} GPUs of {m.gpu_memory:g} GB: mesh (pp, dp, cp, tp) = "
          f"{(pp, dp, cp, tp)}, {m.accounting} accounting" + ("" if m.params else
          f", micro-batch {cfg.batch_size} x {config.block_size}, activations in {str(dtype)[6:]}"
          + ", checkpointed" * m.checkpointing) + "; GB a rank (the most loaded):")
    print(f"{'':8}{'weights':>9}{'grads':>9}{'optim':>9}{'activ.':>9}{'total':>9}  fits")
    for zero, row in rows.items():
        print(f"{'ZeRO-' + str(zero) if zero else 'DDP':8}" + "".join(gb(x) for x in row) + gb(sum(row))
              + f"  {'yes' if sum(row) <= m.gpu_memory * 1e9 else 'no'}" + "  <- runs" * (zero == ran))
    if not m.params:  # a rank's total grows by a block's share with each block a stage: the deepest that fits
        v = 2 if cfg.pipeline_schedule == "Interleaved1F1B" else 1
        more = plan(replace(config, n_layer=config.n_layer + pp * v), m.gpus, **kw)
        zero, per = ran, (sum(more[ran]) - sum(rows[ran]))
        deepest = config.n_layer + int((m.gpu_memory * 1e9 - sum(rows[zero])) // per) * pp * v if per > 0 else 0
        print(f"the deepest of this width that fits under --zero={zero}: n_layer={deepest}" if deepest >= pp * v
              else f"no depth of this width fits under --zero={zero}")
    return 0
