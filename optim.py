"""
The optimizers and the learning-rate schedule that train.py steps.

- AdamW, with weight decay on matrices only (nanoGPT's recipe).
- Muon (Jordan et al. 2024) on the blocks' 2-D weight matrices, AdamW on everything else
  (embeddings, the head, norms, biases), as nanochat and modded-nanogpt split them: one optimizer,
  `MuonAdamW`, whose state_dict holds plain tensors, so checkpoints load with weights_only=True and
  a resume continues exactly.

Every parameter group keeps its own peak learning rate in "base_lr"; the schedule is a factor of it:
linear warmup, then a decay to min_lr / learning_rate at lr_decay_iters, by cosine, by a straight
line, or (WSD) flat at the peak and then a straight line over the last decay_frac.
"""

import math
import re
import time

import torch
from torch.optim.adamw import adamw

from common import UsageError
from device import sync
from distributed import slice_like, whole
from parallel import clip_grad_norm

# Newton-Schulz quintic coefficients of Muon's orthogonalisation (Keller Jordan's, tuned for the
# steepest slope at zero: the singular values land near 1, between about 0.7 and 1.2)
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def decay_start(cfg):
    """The iteration where the decay begins: the warmup's end, or under WSD the start of the last
    decay_frac of lr_decay_iters (not before the warmup's end)."""
    if cfg.schedule == "wsd":
        return max(cfg.warmup_iters, cfg.lr_decay_iters * (1 - cfg.decay_frac))
    return cfg.warmup_iters


def lr_factor(it, cfg):
    """The schedule at iteration it, a factor of each group's peak rate: linear warmup, then a decay
    from 1 at decay_start to min_lr / learning_rate at lr_decay_iters, flat after; the decay is a
    cosine (schedule="cosine"), or a straight line ("linear"; "wsd", which is flat at 1 until its
    later start). A pure function of it and cfg: a resume continues the same rates."""
    if not cfg.decay_lr:
        return 1.0
    if it < cfg.warmup_iters:
        return (it + 1) / (cfg.warmup_iters + 1)
    low = cfg.min_lr / cfg.learning_rate if cfg.learning_rate else 1.0
    if it > cfg.lr_decay_iters:
        return low
    start = decay_start(cfg)
    if cfg.schedule == "cosine":
        ratio = (it - start) / max(1, cfg.lr_decay_iters - start)
        return low + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (1.0 - low)
    if it < start:  # WSD's stable phase
        return 1.0
    span = cfg.lr_decay_iters - start  # > 0 unless it == start == lr_decay_iters
    return low + (cfg.lr_decay_iters - it) / span * (1.0 - low) if span > 0 else low


def budget_seconds(text):
    """--max_time's text in seconds ("90s", "45m", "8h", or a bare number of seconds); None for ""."""
    m = re.fullmatch(r"(\d+(?:\.\d*)?)([smh]?)", text.strip())
    if text and (not m or float(m[1]) <= 0):
        raise UsageError(f"max_time={text!r} is not a duration: write --max_time=90s, 45m or 8h")
    return float(m[1]) * {"": 1, "s": 1, "m": 60, "h": 3600}[m[2]] if text else None


class Budget:
    """--max_time: the run's length, fitted to its own speed so that it ends, final evaluation and
    checkpoint included, within the time given from the process's start. It times the iterations
    after the first (which warms up), at least TIMED of them and 2% of the budget, and train.py
    tells it each evaluation's time with its checkpoints; then max_iters and lr_decay_iters become
    the iterations that fit, so the schedule's decay ends with the run. Before each later
    evaluation it times the iterations since the last one and fits again: shorter if the run
    would end late, longer only in the run's first half; under WSD, either way until its decay
    starts, and never after. EXIT_S is left for the process to end.
    The checkpoints keep the number: a resume continues with it."""
    TIMED, EXIT_S = 5, 1.0

    def __init__(self, seconds, started, start, fitted=False):
        self.seconds, self.started, self.start, self.end = seconds, started, start, start + (seconds or 0)
        self.eval_s = self.dt = self.t0 = 0.0  # the longest evaluation with its checkpoints, an iteration's time
        self.fitted, self.mark = fitted, (time.time(), started)  # when the last evaluation ended, and where

    def evaluated(self, it, seconds):
        self.eval_s, self.mark = max(self.eval_s, seconds), (time.time(), it)

    def fit(self, cfg, it, device):
        """The iterations that fit, when timed at iteration it (first after the timing, then before
        each evaluation, if fewer than max_iters); else None."""
        if self.seconds is None:
            return None
        wsd = cfg.schedule == "wsd"
        if self.fitted:  # the iterations since the last evaluation, before the next
            if it % cfg.eval_interval or it == cfg.max_iters or it <= self.mark[1]:
                return None
            if wsd and it >= decay_start(cfg):  # WSD's decay has begun: the length stays (see below)
                return None
            t0, timed = self.mark[0], it - self.mark[1]
        else:
            t0, timed = self.t0, it - self.started - 1  # iterations since the first
            if timed < 0 or 0 < timed < self.TIMED or timed and time.time() - t0 < 0.02 * self.seconds:
                return None
        sync(device)
        if not timed:
            self.t0 = time.time()
            return None
        self.dt = 1.03 * (time.time() - t0) / timed  # 3% to spare
        left = self.end - time.time() - self.EXIT_S
        n = it + math.floor((left - self.eval_s) / (self.dt + self.eval_s / cfg.eval_interval))
        if n <= it and not self.fitted:
            raise UsageError(f"max_time={cfg.max_time} is too short: {time.time() - self.start:.1f} s went to setting "
                             f"up, {it} iterations and an evaluation ({self.eval_s:.1f} s): give it more time")
        # later, cosine and linear (a new length moves every rate still to come): a run that would end
        # late gets shorter; in its first half, one that would end early by more than 2% gets longer
        # (the decay has barely begun); else the length stays.
        # WSD's rates before its decay are the peak whatever the length, so a refit changes no rate
        # while the decay has not begun under the old length nor under the new one: until the decay
        # starts the length follows the pace both ways (by more than 2%), but never so short that its
        # decay would have begun before now; once it has begun (above), the length stays and the decay
        # runs whole to the end (a machine that slows down then makes the run end late)
        if self.fitted and wsd and it > cfg.warmup_iters:  # (so decay_frac < 1: the decay starts after the warmup)
            n = max(n, math.ceil(it / (1 - cfg.decay_frac)))
            n += n * (1 - cfg.decay_frac) < it  # where the division rounded down: decay_start's own product
        second_half = 2 * it > cfg.max_iters and not wsd
        if self.fitted and (n >= cfg.max_iters if second_half else abs(n - cfg.max_iters) <= 0.02 * n):
            return None
        self.fitted = True
        return max(n, it)


def learning_rate(it, cfg):
    """The learning rate of AdamW's groups at iteration it (a Muon group's is muon_lr times the factor)."""
    return cfg.learning_rate * lr_factor(it, cfg)


def make_optimizer(model, cfg, fused):
    """AdamW that decays matrices (weights of Linear and Embedding) but not biases and norm gains;
    or with cfg.optimizer="muon", MuonAdamW: Muon on the blocks' 2-D matrices, AdamW on the rest.
    fused: AdamW in one kernel for the whole update instead of ~10 small operations per tensor."""
    groups = [g | dict(base_lr=cfg.learning_rate) for g in model.optimizer_groups(cfg.weight_decay)]
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2), fused=fused)
    blocks = {id(p) for name, p in model.named_parameters() if ".h." in name and p.dim() == 2 and p.requires_grad}
    groups = [g | dict(params=[p for p in g["params"] if id(p) not in blocks]) for g in groups]
    groups.append(dict(params=[p for p in model.parameters() if id(p) in blocks], muon=True, base_lr=cfg.muon_lr,
                       lr=cfg.muon_lr, weight_decay=cfg.weight_decay))
    return MuonAdamW([g for g in groups if g["params"]], lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2),
                     momentum=cfg.muon_momentum, fused=fused)


def optimizer_step(model, optimizer, scaler, grad_clip, skip=None):
    """Clip the gradients (unscaled first, under fp16), step, and clear them for the next batch.
    skip: a 0-dim float tensor on the device, 1 to leave the weights and the optimizer's state as
    they were (after a non-finite loss). Fused AdamW (its found_inf) and MuonAdamW read it on the
    device, so the host never waits for it; an unfused AdamW must ask the device."""
    on_device = skip is not None and optimizer.defaults.get("fused")
    if skip is not None and not on_device and skip.item():
        optimizer.zero_grad(set_to_none=True)
        return
    if grad_clip:
        scaler.unscale_(optimizer)
        clip_grad_norm(model, grad_clip)  # torch's, with the norm summed over tensor and pipeline parts
    if on_device:
        optimizer.found_inf = skip  # under fp16 the scaler puts its own (a non-finite loss has non-finite gradients)
    scaler.step(optimizer)
    optimizer.__dict__.pop("found_inf", None)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)


class Skips:
    """The steps skipped for a non-finite loss, counted on the device: the host reads the counts at
    log lines only, so that it never waits for the device in between. Every rank counts the same."""

    def __init__(self, device, log=print):
        self.log = log
        self.row = self.longest = self.total = torch.zeros((), device=device)
        self.seen = 0  # the total at the last reading

    def add(self, bad):
        """One step, skipped if bad (a 0-dim tensor) is 1."""
        self.row = (self.row + 1) * bad
        self.longest, self.total = torch.maximum(self.longest, self.row), self.total + bad

    def read(self, it):
        """Log the steps skipped since the last reading; return the most skipped in a row so far."""
        total, longest = (int(x) for x in torch.stack((self.total, self.longest)).tolist())
        if total > self.seen:
            self.log(f"iter {it}: {total - self.seen} steps skipped since the last log line, the loss not finite "
                     f"({longest} in a row at most)")
        self.seen = total
        return longest


def orthogonalize(G, steps=5):
    """The nearest semi-orthogonal matrix to each of G (n, rows, cols), approximately: steps of the
    Newton-Schulz quintic on G / |G|, in G's dtype (fp32 here: on CPUs without native bf16, bf16
    products run about 30x slower; on a GPU bf16 is the faster choice)."""
    a, b, c = NS_COEFFICIENTS
    X = G / (G.norm(dim=(-2, -1), keepdim=True) + 1e-7)  # spectral norm <= Frobenius norm <= 1
    tall = X.size(-2) > X.size(-1)
    if tall:  # the products below are cheaper on the wide side
        X = X.mT
    for _ in range(steps):
        A = X @ X.mT
        X = a * X + (b * A + c * A @ A) @ X
    return X.mT if tall else X


class MuonAdamW(torch.optim.Optimizer):
    """Muon on the groups marked "muon", AdamW on the others, in one optimizer.

    Muon keeps a momentum of the gradient (Nesterov's), orthogonalises it, and steps by it scaled by
    sqrt(max(1, rows / cols)), so that every matrix moves by about the same RMS; weight decay is
    decoupled, as AdamW's. Matrices of one shape are orthogonalised together, in one batched product.
    Its momentum warms up from momentum_start to momentum over momentum_warmup steps
    (modded-nanogpt's). fused: AdamW's part in one kernel, which, as Muon's part, skips the step on
    the device when optimizer_step's found_inf says so."""

    def __init__(self, groups, lr, betas=(0.9, 0.95), eps=1e-8, momentum=0.95, momentum_start=0.85,
                 momentum_warmup=300, ns_steps=5, fused=False):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=0.0, muon=False, momentum=momentum,
                        momentum_start=momentum_start, momentum_warmup=momentum_warmup, ns_steps=ns_steps,
                        fused=fused)
        super().__init__(groups, defaults)

    @torch.no_grad()
    def step(self, closure=None):  # closure: unused (torch.distributed.checkpoint passes None)
        found_inf = getattr(self, "found_inf", None)
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if params:
                (self.muon_step if group["muon"] else self.adamw_step)(group, params, found_inf)

    def adamw_step(self, group, params, found_inf):
        grads = [p.grad for p in params]
        for p in params:
            if not self.state[p]:
                self.state[p] = dict(step=torch.tensor(0.0, device=p.device if group["fused"] else "cpu"),
                                     exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
        states = [self.state[p] for p in params]
        beta1, beta2 = group["betas"]
        adamw(params, grads, [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states], [],
              [s["step"] for s in states], amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"],
              weight_decay=group["weight_decay"], eps=group["eps"], maximize=False,
              foreach=not group["fused"], fused=group["fused"] or None, found_inf=found_inf)

    def muon_step(self, group, params, found_inf):
        # every number stays on the device: a skipped step (keep = 0) leaves weights, momentum and
        # step count as they were, without the host asking whether it was skipped
        keep = 1 - found_inf if found_inf is not None else torch.ones((), device=params[0].device)
        for p in params:
            if not self.state[p]:
                self.state[p] = dict(step=torch.zeros((), device=p.device), momentum_buffer=torch.zeros_like(p))
        step = self.state[params[0]]["step"] + keep
        warm = (step / max(1, group["momentum_warmup"])).clamp(max=1.0)
        beta = (1 - warm) * group["momentum_start"] + warm * group["momentum"]
        by_shape = {}
        for p in params:
            state = self.state[p]
            state["step"].add_(keep)
            grad = torch.where(keep > 0, p.grad, 0)  # a skipped step's gradient may be nan
            buf = state["momentum_buffer"].lerp_(grad, (1 - beta) * keep)
            by_shape.setdefault(p.shape, []).append((p, grad.lerp(buf, beta)))  # Nesterov
        for shape, pairs in by_shape.items():
            # under FSDP a rank holds a slice of each matrix (shape is the whole one's): every rank
            # gathers the whole matrices, orthogonalises them alike and keeps its slice of the update
            update = orthogonalize(torch.stack([whole(u) for _, u in pairs]).float(), group["ns_steps"])
            scale = max(1.0, shape[-2] / shape[-1]) ** 0.5
            for (p, _), u in zip(pairs, update):
                p.mul_(1 - group["lr"] * group["weight_decay"] * keep)
                p.addcmul_(slice_like(u.to(p.dtype), p), keep, value=-group["lr"] * scale)
