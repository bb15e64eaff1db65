"""
Beyond data parallel: one DeviceMesh of the ranks, (pp, dp, cp, tp) outermost first as torchtitan
orders it, and the plans that split a model over it, all through torch's own engine.

- tp (--tensor_parallel): Megatron's split of each block through torch.distributed.tensor.parallel.
  Attention's q, k and v by heads (ColwiseParallel), its output projection by rows (RowwiseParallel);
  the MLP's up projection (both halves of a gated one) by columns, the down projection by rows. The
  norms and the residual stream run sequence-parallel (SequenceParallel: each rank 1/tp of the
  positions); the embedding, the position table and the head are vocabulary-parallel (rows of the
  tied matrix). A fused layer (c_attn's [q; k; v], a gated c_fc's [up; gate]) is reordered so that
  rank r's contiguous rows are the r-th part of each; checkpoints hold the plain order (`unfuse`).
- pp (--pipeline_parallel): the blocks in P stages of whole blocks (torch.distributed.pipelining),
  the embedding with the first, the final norm, head and loss with the last. A stage is a copy of
  the model keeping only its blocks (`Blocks`), run by `Stage`. Microbatches are the gradient
  accumulation's micro-steps; the schedule is torch's 1F1B, GPipe or interleaved 1F1B (two stages
  a rank). Tied embeddings live on the first and the last stage; their gradients are summed there.
- dp: DDP, or ZeRO: --zero=1 torch's ZeroRedundancyOptimizer (the optimizer state, by parameter),
  --zero=2 FSDP2 keeping the weights whole from forward to backward, --zero=3 FSDP2 (--fsdp=True).
  Under tp or pp, the data-parallel ranks shard with FSDP2 (DDP takes no DTensor parameters, and its
  reducer did not take a pipeline's micro-batches): ZeRO-3 under tp, ZeRO-2 under pp (zero_stage).
- cp (--context_parallel): ring attention (ring.py) over the mesh's cp ranks.

Checkpoints stay whole: `whole_states` gathers every rank's part into the state one process writes.
"""

import contextlib
import copy
import functools

import torch
import torch.distributed as dist
import torch.nn as nn

from common import UsageError
from distributed import FSDP2, all_ranks, local, slice_like, split_layers, whole, zero_stage
from model import ATTENTIONS, Transformer

from torch.distributed.device_mesh import init_device_mesh

# torch's FSDP2, tensor parallel and pipelining are imported in the functions that use them, not here:
# they take over a second to import, which a run on one process (and sample.py) need not pay.

DIMS = ("pp", "dp", "cp", "tp")


def mesh_shape(cfg, world):
    """(pp, dp, cp, tp): dp takes the ranks the others leave."""
    rest = cfg.pipeline_parallel * cfg.context_parallel * cfg.tensor_parallel
    return cfg.pipeline_parallel, max(1, world // rest), cfg.context_parallel, cfg.tensor_parallel


def coordinates(cfg, rank, world):
    """This rank's index along each of DIMS (rank = ((pp * dp + d) * cp + c) * tp + t)."""
    shape, out = mesh_shape(cfg, world), []
    for n in reversed(shape):
        out.append(rank % n)
        rank //= n
    return dict(zip(DIMS, reversed(out)))


def check_mesh(cfg, world):
    """A world that is not the product of the mesh's sizes, or micro-steps that its data-parallel groups
    cannot share out, refused in one line."""
    pp, dp, cp, tp = mesh_shape(cfg, world)
    if world % (pp * cp * tp):
        raise UsageError(f"{world} processes do not make a mesh of pipeline_parallel={pp} x context_parallel={cp} x "
                         f"tensor_parallel={tp} x data parallel: the world size must be a multiple of {pp * cp * tp}")
    if cfg.gradient_accumulation_steps % dp:
        raise UsageError(f"gradient_accumulation_steps={cfg.gradient_accumulation_steps} is not divisible by "
                         f"the {world} processes' {dp} data-parallel groups: make it a multiple of {dp}")


def problems(config, cfg, world, ddp):
    """What the schemes cannot run: (whether so, the problem and the way out), for train.check_fits."""
    pp, dp, cp, tp = mesh_shape(cfg, world)
    accum, kind, stages = cfg.gradient_accumulation_steps // dp, ATTENTIONS[config.attention], pp * (
        2 if cfg.pipeline_schedule == "Interleaved1F1B" else 1)
    zero = 3 if cfg.fsdp else cfg.zero
    return [
        ((tp > 1 or pp > 1 or zero) and not ddp, "--tensor_parallel, --pipeline_parallel and --zero split the work "
         "over the processes that torchrun starts: run torchrun --standalone --nproc_per_node=N train.py ..."),
        ((tp > 1 or pp > 1 or zero) and not FSDP2, f"this torch ({torch.__version__}) has no DeviceMesh, "
         "DTensor or pipelining: upgrade torch (2.6 or later)"),
        (cfg.fsdp and cfg.zero not in (0, 3), f"--fsdp=True is --zero=3; it cannot also be --zero={cfg.zero}"),
        (tp > 1 and (config.n_head % tp or config.n_kv_head % tp), f"--tensor_parallel={tp} splits attention by "
         f"heads: it must divide n_head={config.n_head} and n_kv_head={config.n_kv_head}"),
        (tp > 1 and (config.block_size % tp or config.mlp_hidden % tp), f"--tensor_parallel={tp} must divide "
         f"block_size={config.block_size} (sequence parallel) and mlp_hidden={config.mlp_hidden}"),
        (tp > 1 and (config.arch != "decoder" or config.n_expert or config.attention != "softmax" or config.window
                     or config.pos in ("alibi", "relative") or not config.norm_first or cfg.lora_rank),
         "--tensor_parallel splits a pre-norm decoder's softmax attention and dense MLP: not mixtures of experts, "
         "efficient or windowed attention, ALiBi or relative positions, post-norm, other architectures or LoRA"),
        (pp > 1 and stages > config.n_layer, f"--pipeline_parallel={pp} makes {stages} stages of whole blocks, more "
         f"than n_layer={config.n_layer}: lower it"),
        (pp > 1 and (config.arch in ("encoder-decoder", "prefix-lm") or config.n_expert or kind.redraws
                     or not config.norm_first or cfg.lora_rank or config.patch_size), "--pipeline_parallel runs a "
         "pre-norm decoder or encoder of tokens: not an encoder-decoder or a prefix LM, mixtures of experts (their "
         "balance loss), redrawn features, post-norm, LoRA or an image model (patch_size)"),
        (pp > 1 and cfg.pipeline_schedule not in ("GPipe",) and accum < pp, f"--pipeline_schedule="
         f"{cfg.pipeline_schedule} needs at least --pipeline_parallel={pp} micro-steps a data-parallel rank, not "
         f"{accum}: raise gradient_accumulation_steps to {pp * dp}, or use --pipeline_schedule=GPipe"),
        (pp > 1 and cfg.pipeline_schedule == "Interleaved1F1B" and accum % pp, f"--pipeline_schedule=Interleaved1F1B "
         f"runs micro-steps in rounds of {pp}: make gradient_accumulation_steps / {dp} a multiple of it"),
        (zero == 1 and (tp > 1 or pp > 1 or cp > 1 or cfg.optimizer != "adamw"), "--zero=1 (ZeroRedundancyOptimizer) "
         "shards AdamW's state over data-parallel ranks alone: not with tp, pp, cp or Muon; --zero=2 or 3 may"),
        (pp > 1 and tp > 1 and dp > 1, "--pipeline_parallel with --tensor_parallel and data parallel: not built; "
         "use two of the three"),
        (cp > 1 and (tp > 1 or pp > 1), "--context_parallel joins data parallel only: not tp or pp"),
        ((tp > 1 or pp > 1) and cfg.compile, "--compile with --tensor_parallel or --pipeline_parallel: not tested; "
         "leave out --compile")]


def make_mesh(device, cfg, world):
    return init_device_mesh(device.type, mesh_shape(cfg, world), mesh_dim_names=DIMS)


# ----------------------------------------------------------------------------------------------
# Tensor parallel

def fused_parts(config, name):
    """The parts of a fused layer's rows, (q, k, v) or (up, gate), that each split apart; None if not fused."""
    if name.endswith("attn.c_attn.weight") or name.endswith("attn.c_attn.bias"):
        return (config.n_head * config.head_size,) + (config.n_kv_head * config.head_size,) * 2
    if config.mlp in ("swiglu", "geglu") and (name.endswith("mlp.c_fc.weight") or name.endswith("mlp.c_fc.bias")):
        return (config.mlp_hidden,) * 2
    return None


def interleave(t, sizes, n, undo=False):
    """t's rows [a; b; c] (of sizes) reordered so that n equal slices hold [a_r; b_r; c_r] each
    (rank r's share of every part); undo: the reverse."""
    if not undo:
        chunks = [p.chunk(n) for p in t.split(sizes)]
        return torch.cat([c[r] for r in range(n) for c in chunks])
    ranks = [r.split([s // n for s in sizes]) for r in t.chunk(n)]
    return torch.cat([ranks[r][i] for i in range(len(sizes)) for r in range(n)])


def tensor_parallel(model, mesh):
    """Split model (a decoder, or a pipeline stage's copy of one) over the 1-D mesh, in place: Megatron's
    plan with sequence parallel. The fused layers are reordered first (interleave)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module
    n = mesh.size()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if (sizes := fused_parts(model.config, name)) is not None:
                p.copy_(interleave(p, sizes, n))
    vocab = dict(input_layouts=Replicate(), output_layouts=Shard(1))
    plan = {"wte": RowwiseParallel(**vocab), "decoder.wpe": RowwiseParallel(**vocab),
            "decoder.ln_f": SequenceParallel(),
            "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())}
    for i, _ in model.decoder.h.named_children():
        b = f"decoder.h.{i}."
        plan |= {b + "ln_1": SequenceParallel(), b + "ln_2": SequenceParallel(),
                 b + "attn.c_attn": ColwiseParallel(input_layouts=Shard(1)),
                 b + "attn.c_proj": RowwiseParallel(output_layouts=Shard(1)),
                 b + "mlp.c_fc": ColwiseParallel(input_layouts=Shard(1)),
                 b + "mlp.c_proj": RowwiseParallel(output_layouts=Shard(1))}
    present = {name for name, _ in model.named_modules()}
    parallelize_module(model, mesh, {k: v for k, v in plan.items() if k in present})
    if model.config.tie_embeddings and "wte" in present and "lm_head" in present:  # tied again: both vocab rows
        model.lm_head.weight = model.wte.weight
    return model


def unfuse(config, name, t, n):
    """A whole tensor of a fused layer in the plain order, as one process holds it."""
    sizes = fused_parts(config, name)
    return interleave(t, sizes, n, undo=True) if sizes is not None and n > 1 and t.dim() else t


# ----------------------------------------------------------------------------------------------
# Pipeline parallel

class Blocks(nn.ModuleDict):
    """A stage's blocks under their own indices (so that names stay the whole model's), iterated as a list."""

    def __iter__(self):
        return iter(self.values())


class Stage(nn.Module):
    """One pipeline stage: a copy of the model with only blocks [lo, hi) of its stack; the first takes
    token ids, the others the hidden states (B, T, C) before them; the last returns the logits."""

    def __init__(self, model, lo, hi, first, last):
        super().__init__()
        self.model, self.first, self.last = copy.deepcopy(model), first, last
        m, c = self.model, model.config
        stack = m.decoder if m.decoder is not None else m.encoder
        stack.h = Blocks({str(i): stack.h[i] for i in range(lo, hi)})
        stack.ends = (first, last)
        if not first:
            del m.wte
            for name in ("wpe", "rel"):
                stack._modules.pop(name, None)
        if not last:
            del m.lm_head, stack.ln_f
            m.mlm_head = None
        self.stack, self.config, self.tp = stack, c, 1  # tp: sequence parallel passes 1/tp of the positions on

    def forward(self, h):
        m, c = self.model, self.config
        x = m.wte(h) if self.first else h
        T = h.size(1) if self.first else h.size(1) * self.tp
        x = self.stack(x, torch.arange(T, device=x.device)[None])
        if not self.last:
            return x
        logits = m.lm_head(m.mlm_head(x) if m.mlm_head is not None else x)
        return c.logit_softcap * torch.tanh(logits / c.logit_softcap) if c.logit_softcap else logits


def loss_fn(logits, targets):
    return nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100)


class Pipeline(nn.Module):
    """This rank's stages of the pipeline (one, or two interleaved) and the schedules that run them:
    `step` trains on a list of micro-batches, a call evaluates one batch."""

    def __init__(self, model, mesh, cfg, device, dtype, accum):
        from torch.distributed import pipelining
        super().__init__()
        pp, rank, self.config = mesh["pp"].size(), mesh["pp"].get_local_rank(), model.config
        v = 2 if cfg.pipeline_schedule == "Interleaved1F1B" else 1
        spans, group = split_layers(model.config.n_layer, pp * v), mesh["pp"].get_group()
        ids = [rank + k * pp for k in range(v)]  # interleaved: rank r holds stages r and r + pp
        self.stages = nn.ModuleList(Stage(model, *spans[s], s == 0, s == pp * v - 1) for s in ids)
        for s in self.stages if mesh["tp"].size() > 1 else ():
            tensor_parallel(s.model, mesh["tp"])
            s.tp = mesh["tp"].size()
        self.first, self.last = ids[0] == 0, ids[-1] == pp * v - 1
        self.whole_params = sum(p.numel() for p in model.parameters())  # the whole model's, for the start line
        self.mesh, self.group = mesh, group
        # the schedule runs forward and backward together: autocast (bf16/fp16) around both, as train.py's
        self.autocast = torch.autocast(device.type, dtype=dtype) if dtype != torch.float32 else contextlib.nullcontext()
        for s in self.stages if mesh["dp"].size() > 1 else ():  # each stage's data parallel: FSDP2, ZeRO-2 unless 3
            shard(s, mesh["dp"], dtype, reshard=cfg.zero == 3 or cfg.fsdp)  # (the stage the root: PipelineStage
            # then syncs the gradients on the last micro-step only)
        train, evals = ([pipelining.PipelineStage(m, s, pp * v, device, group=group) for m, s in zip(self.stages, ids)]
                        for _ in range(2))
        kind = getattr(pipelining, "Schedule" + cfg.pipeline_schedule)
        self.schedule = kind(train if v > 1 else train[0], n_microbatches=accum, loss_fn=loss_fn)
        self.evaluator = pipelining.schedules.ScheduleLoopedBFS(evals, 1, loss_fn=loss_fn) if v > 1 else \
            pipelining.ScheduleGPipe(evals[0], 1, loss_fn=loss_fn)
        tied = model.config.tie_embeddings
        self.tied = [s.model.wte.weight if s.first else s.model.lm_head.weight for s in self.stages
                     if tied and (s.first or s.last)]
        # names as one process's model has them; the last stage's copy of a tied matrix is the embedding
        self.names = {p: ("wte.weight" if tied and n == "lm_head.weight" else n)
                      for s in self.stages for n, p in s.model.named_parameters()}
        self.skip_norm = {id(p) for p in self.tied if not self.first}  # counted once, on the first stage

    def optimizer_groups(self, weight_decay):
        params = [p for p in self.parameters() if p.requires_grad]
        return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
                {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]

    def flops_per_token(self, T):
        with torch.device("meta"):
            return Transformer(self.config).flops_per_token(T)

    def redraw_features(self, step, seed):
        pass  # no kind that redraws runs here (problems)

    def run(self, schedule, idx, targets):
        """The mean loss of the micro-batches on the last stage's ranks, 0 on the others."""
        losses, run = [], schedule.step if schedule is self.schedule else schedule.eval
        with self.autocast:
            run(*([idx] if self.first else []), target=targets if self.last else None, losses=losses)
        return torch.stack(losses).float().mean().detach() if losses else torch.zeros((), device=idx.device)

    def step(self, batches):
        """Forward and backward of the micro-batches (each a dict of idx, targets), in the schedule's order."""
        loss = self.run(self.schedule, *(torch.cat([b[k] for b in batches]) for k in ("idx", "targets")))
        if self.tied:  # the first and the last stage each hold the matrix: both step with the sum of the two
            grad = sum(p.grad for p in self.tied if p.grad is not None)
            all_ranks(local(grad), group=self.group)
            for p in self.tied:
                p.grad = grad.clone()
        elif self.config.tie_embeddings:  # a middle stage: nothing to add, but every pp rank must take part
            t = self.mesh["tp"]
            all_ranks(torch.zeros(self.config.vocab_size, self.config.n_embd, device=loss.device).chunk(t.size())[
                t.get_local_rank()].contiguous(), group=self.group)
        return loss

    def forward(self, idx, targets, **kwargs):
        return None, self.run(self.evaluator, idx, targets)


# ----------------------------------------------------------------------------------------------
# Putting it together

def shard(model, mesh, dtype, reshard=True):
    """FSDP2 over mesh in place (ZeRO-3; reshard=False: ZeRO-2, the weights gathered once a step and kept
    from the forward pass to the backward): each block of each stack is a unit, the rest the root's."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    # in bf16/fp16 the weights are gathered in that dtype (half the bytes) and the gradients reduced in fp32;
    # autocast stays on around the model (train.py), keeping norms, softmax and the loss in fp32 as in one process
    mixed = MixedPrecisionPolicy(**(dict(param_dtype=dtype, reduce_dtype=torch.float32)
                                    if dtype != torch.float32 else {}))
    inner = getattr(model, "model", model)  # a pipeline's Stage holds its copy of the model
    for stack in (inner.encoder, inner.decoder):
        for block in stack.h if stack is not None else ():
            fully_shard(block, mesh=mesh, mp_policy=mixed, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, mp_policy=mixed, reshard_after_forward=reshard)
    return model


def parallelize(model, mesh, cfg, device, dtype, make_optimizer):
    """model (whole, its weights loaded) split over mesh as cfg asks: in place, or a Pipeline. It keeps
    the one-process optimizer's order of parameter names (`order`), which whole_states writes."""
    if mesh is None:
        return model
    ref = make_optimizer(model, cfg, fused=False)  # no state yet: only the order of the parameters
    name = {p: n for n, p in model.named_parameters()}
    order, groups = [name[p] for g in ref.param_groups for p in g["params"]], ref.state_dict()["param_groups"]
    keys = list(model.state_dict())
    pp, dp, _, tp = (mesh[d].size() for d in ("pp", "dp", "cp", "tp"))
    zero = 3 if cfg.fsdp else cfg.zero
    if tp > 1 and pp == 1:  # (a pipeline splits each stage's copy)
        tensor_parallel(model, mesh["tp"])
    if pp > 1:
        model = Pipeline(model, mesh, cfg, device, dtype, cfg.gradient_accumulation_steps // dp)
    elif zero >= 2 or (tp > 1 and dp > 1):  # under tp, data parallel through FSDP2 (see the docstring)
        shard(model, mesh["dp"], dtype, reshard=zero != 2)
    model.one_process, model.mesh_ = (order, groups, keys), mesh
    if isinstance(model, Pipeline) or tp > 1:  # distributed.state_dicts and load_optimizer_state call these
        model.whole_states = functools.partial(whole_states, model)
        model.load_part_state = functools.partial(load_part_state, model)
    return model


def zero_one(optimizer, cfg, mesh):
    """--zero=1: AdamW whose state each data-parallel rank keeps for its share of the parameters."""
    if cfg.zero != 1:
        return optimizer
    from torch.distributed.optim import ZeroRedundancyOptimizer
    groups = [{k: v for k, v in g.items() if k in ("params", "weight_decay", "base_lr", "lr")}
              for g in optimizer.param_groups]
    return ZeroRedundancyOptimizer(groups, optimizer_class=torch.optim.AdamW, process_group=mesh["dp"].get_group(),
                                   lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2),
                                   fused=optimizer.defaults.get("fused"))  # as one process: its checkpoint's too


def clip_grad_norm(model, max_norm):
    """Clip the gradients by their norm over the whole model: DTensors' norms over their ranks, the
    pipeline's stages summed (a tied matrix counted once). Plain or FSDP: torch's clip_grad_norm_."""
    raw = getattr(model, "module", model)
    if not hasattr(raw, "whole_states"):
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    params = [p for p in raw.parameters() if p.grad is not None]
    skip = getattr(raw, "skip_norm", set())
    norm = torch.nn.utils.get_total_norm([p.grad for p in params if id(p) not in skip])
    norm = whole(norm)
    if isinstance(raw, Pipeline):
        norm = all_ranks(norm ** 2, group=raw.group) ** 0.5
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm


# ----------------------------------------------------------------------------------------------
# Whole checkpoints from the parts

def part_names(model):
    """Each parameter this rank holds, by its name in one process's model."""
    if isinstance(model, Pipeline):
        return model.names
    tied = model.config.tie_embeddings
    return {p: n for n, p in model.named_parameters(remove_duplicate=not tied) if not (tied and n == "lm_head.weight")}


def whole_states(model, optimizer):
    """The model's and the optimizer's state dicts, whole, as one process writes them (the optimizer's
    keyed by index). Every rank must call this; rank 0 gets them, the others (None, None)."""
    mesh, n = model.mesh_, model.mesh_["tp"].size()
    order, groups, keys = model.one_process
    sources = [s.model for s in model.stages] if isinstance(model, Pipeline) else [model]
    weights = {k: unfuse(model.config, k, whole(v), n).cpu() for m in sources for k, v in m.state_dict().items()}
    names = part_names(model)
    state = {}
    for g in optimizer.param_groups:
        for p in g["params"]:
            if p in optimizer.state:
                state[names[p]] = {k: unfuse(model.config, names[p], whole(v), n).cpu()
                                   if torch.is_tensor(v) and v.dim() else v for k, v in optimizer.state[p].items()}
    here = coordinates_of(mesh)
    if mesh["pp"].size() > 1:  # the stages' parts to rank 0, from the ranks at dp = cp = tp = 0
        if here["dp"] == here["cp"] == here["tp"] == 0:
            parts = [None] * mesh["pp"].size()
            dist.all_gather_object(parts, (weights, state), group=mesh["pp"].get_group())
            for w, s in parts:
                weights, state = weights | w, s | state
    if dist.get_rank():
        return None, None
    index = {name: i for i, name in enumerate(order)}
    ours = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]  # this run's settings
    return ({k: weights[k] for k in keys},
            dict(state={index[k]: v for k, v in sorted(state.items(), key=lambda kv: index[kv[0]])},
                 param_groups=[g | dict(params=ref["params"]) for g, ref in zip(ours, groups)]))


def coordinates_of(mesh):
    return {d: mesh[d].get_local_rank() for d in DIMS}


def load_part_state(model, optimizer, state):
    """Load a whole optimizer state (as whole_states writes it): each rank keeps its parts."""
    order, _, _ = model.one_process
    index, names, n = {name: i for i, name in enumerate(order)}, part_names(model), model.mesh_["tp"].size()
    params = [p for g in optimizer.param_groups for p in g["params"]]
    mine = {}
    for i, p in enumerate(params):
        s = state["state"].get(index[names[p]])
        if s is not None:
            mine[i] = {k: slice_like(interleave(v, fused_parts(model.config, names[p]), n)
                                     if fused_parts(model.config, names[p]) and n > 1 else v, p)
                       if torch.is_tensor(v) and v.shape == p.shape else v for k, v in s.items()}
    ids, out = iter(range(len(params))), []
    for g in optimizer.param_groups:
        out.append({k: v for k, v in g.items() if k != "params"} | dict(params=[next(ids) for _ in g["params"]]))
    optimizer.load_state_dict(dict(state=mine, param_groups=out))


# ----------------------------------------------------------------------------------------------
# What each rank holds: the start line's figures, and what the ranks measure

def optimizer_params(optimizer):
    """The parameters whose state this rank keeps: ZeRO-1's share, else all of them, with bytes per byte
    of weight (AdamW's two moments, Muon's one)."""
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer's local optimizer
    return [(p, 1 if g.get("muon") else 2) for g in inner.param_groups for p in g["params"]]


def held(model, optimizer):
    """(weights, gradients, optimizer state) in bytes that this rank holds while it steps, from its
    parts of the parameters: as the figures of the start line, before any exist."""
    params = {id(p): p for p in model.parameters()}.values()
    weights = sum(local(p).numel() * p.element_size() for p in params)
    grads = sum(local(p).numel() * p.element_size() for p in params if p.requires_grad)
    state = sum(local(p).numel() * p.element_size() * k for p, k in optimizer_params(optimizer))
    return weights, grads, state


def measured(model, optimizer):
    """The same, read from the tensors this rank holds now (after a backward, before zero_grad)."""
    params = {id(p): p for p in model.parameters()}.values()
    nbytes = lambda t: local(t).numel() * t.element_size()  # noqa: E731
    inner = getattr(optimizer, "optim", optimizer)
    return (sum(nbytes(p) for p in params), sum(nbytes(p.grad) for p in params if p.grad is not None),
            sum(nbytes(t) for s in inner.state.values() for t in s.values() if torch.is_tensor(t) and t.dim()))


def size(n):
    return f"{n / 1e9:.3g} GB" if n >= 1e9 else f"{n / 1e6:.3g} MB"


def mesh_line(run):
    """The start line's account of the mesh, and what each rank holds (every rank must call this)."""
    shape = mesh_shape(run.cfg, run.world)
    figures = [None] * run.world
    dist.all_gather_object(figures, held(run.raw_model, run.optimizer))
    ranks = {}
    for r, f in enumerate(figures):
        ranks.setdefault(f, []).append(str(r))
    zero = zero_stage(run.cfg, run.world)
    return (f"mesh (pp, dp, cp, tp) = {shape}, zero={zero}; weights / gradients / optimizer state a rank: "
            + "; ".join(f"rank{'s' * (len(r) > 1)} {','.join(r)}: " + " / ".join(map(size, f))
                        for f, r in ranks.items()))
