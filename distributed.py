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
from datetime import timedelta

import torch
import torch.distributed as dist

try:  # FSDP2 and DTensor, public since torch 2.6
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict, set_optimizer_state_dict)
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from torch.distributed.tensor import DTensor, Replicate
except ImportError:
    fully_shard = None
    FSDPModule = DTensor = ()  # an isinstance() against () is always False: nothing is sharded


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
    return isinstance(model, FSDPModule)


def local(t):
    """This rank's part of t: its slice of a sharded tensor, or t itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def whole(t):
    """t whole on every rank: a sharded tensor gathered (every rank must ask), or t itself."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def slice_like(t, like):
    """The slice of t (whole, the same on every rank) that this rank holds of like; t itself if
    like is not sharded. No communication: each rank cuts out its own."""
    if not isinstance(like, DTensor):
        return t
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
