"""
Decoding, beside the model as in gpt-fast: a prompt goes into the caches that model.py keeps
(prefill), then one token at a time (decode, compiled where it pays), sampled without waiting for the
device (generate, generate_tokens); speculative decoding, where a small draft proposes tokens
and the target keeps those it agrees with; and decode_layout, the weights laid out for a CPU's
matrix-vector products, which sample.py and bench.py apply.

    from generate import generate
    out = generate(model, idx, max_new_tokens=100, temperature=0.8, top_k=200)
"""

import contextlib
import hashlib
import math
import os
import shutil
import types
import weakref

import torch
import torch.nn as nn
import torch.nn.functional as F

from common import CACHE
from model import ATTENTIONS, autocast_dtype, reach
from quantize import plain_linear, replace_linears
from sampling import draw, sample, sampling_probs

COMPILE_PAYS_FROM = 5_000  # new tokens from which the compiled step makes up for its compile (compile_pays)
COMPILED_CACHE_STEP = 256  # a compiled step's least cache size, and on a GPU the step between sizes (compiled_size)
SLOTS_IN_USE_ON = ("cpu",)  # devices whose passes read only the cache's slots in use: a GPU reads every slot, so
# that each step has one shape, replayed as a CUDA graph; a CPU skips reading the empty ones


def absolute_positions(config):
    """Whether positions are absolute (added to the embeddings, or a location score's row per position):
    then the context of a sequence longer than block_size must be recomputed from its new first token."""
    return config.pos in ("learned", "sinusoidal") or config.score == "location"


def cache_size(model, prompt, new):
    """Slots of a cache for a prompt and new tokens: every position, or the last that a query sees
    (reach), with room for a prompt longer than that to go in by pieces (see prefill), and for the
    global tokens, which the ring keeps beside it."""
    r = reach(model.config)
    return model.config.n_global + min(prompt + new, r) + (r if prompt > r else 0)


def compiled_size(size, device):
    """The slots of a compiled step's cache that holds `size`: rounded up so that other lengths reuse its
    graph, since each size is a graph of its own (dynamo keeps a module buffer's size static), and a
    step stops compiling after torch._dynamo.config.recompile_limit of them. On a GPU, which reads
    every slot, to a multiple of COMPILED_CACHE_STEP; on a CPU, which reads the slots in use only (so
    empty ones cost memory, no time), to a power of two, at least COMPILED_CACHE_STEP. generate_tokens
    caps it at the full ring's size: a ring that wraps reads every slot."""
    if device.type in SLOTS_IN_USE_ON:
        return max(COMPILED_CACHE_STEP, 1 << (size - 1).bit_length())
    return COMPILED_CACHE_STEP * math.ceil(size / COMPILED_CACHE_STEP)


def piece_size(model, T, first=False):
    """Tokens of a prompt of T that the next piece takes: all of them into a recurrent state; into an
    empty ring as many as it has slots; into a full one its slots beside the global tokens less the
    keys a query sees before its own, so that it overwrites no key its queries see."""
    slots = model.decoder.cache_pos.size(1) if model.decoder.cache_pos is not None else None
    if slots is None or first:
        return slots or T
    return max(1, slots - model.config.n_global - reach(model.config) + 1)


def slots_used(model, fed):
    """The argument slots_used of a pass once the cache holds `fed` tokens from position 0 on (at most
    position fed - 1, as left padding counts later): the first fed slots, or all once the ring is full.
    None (every slot) on a device not in SLOTS_IN_USE_ON. Counted here on the host: no pass waits."""
    pos = model.decoder.cache_pos
    return None if pos is None or pos.device.type not in SLOTS_IN_USE_ON else min(fed, pos.size(1))


def prefill(model, idx, input_pos, mask=None, src_mask=None, prefix_len=None):
    """Logits (B, V) for the token after idx (B, T) at positions input_pos (B|1, T), idx going into
    caches that model.setup_kv_cache made. A prompt longer than the cache goes in by pieces: the
    first fills the ring, each next one overwrites only keys that none of its queries sees.
    Attention's memory is then O(size^2), not O(T^2). A recurrent state takes the prompt in one piece,
    and so does a prefix LM's prefix (prefix_len (B,)), which its positions read both ways. input_pos
    counts from 0 (at most one a token: slots_used)."""
    s, n = 0, piece_size(model, idx.size(1), first=True)
    while s < idx.size(1):
        piece = slice(s, s + n)
        logits = model(idx[:, piece], mask=None if mask is None else mask[:, piece], src_mask=src_mask,
                       input_pos=input_pos[..., piece], prefix_len=prefix_len,
                       slots_used=slots_used(model, min(s + n, idx.size(1))))[0]
        s, n = s + n, piece_size(model, idx.size(1))
    return logits[:, -1]


def decode(model, idx, input_pos, src_mask=None, slots_used=None):
    """As prefill, in one piece: with T = 1 every shape is fixed, so torch.compile captures it once."""
    return model(idx, src_mask=src_mask, input_pos=input_pos, slots_used=slots_used)[0][:, -1]


def compiled(device, step=decode, freeze=None, **options):
    """The decode step (or a copy of it: own_step) compiled (options: torch.compile's); on a CPU, with the
    weights frozen into it where freeze names them (weights_digest: own_step). On a GPU: one
    static graph per cache size, replayed as a CUDA graph. On a CPU, inductor code called from C++,
    where slots_used grows by one a step: dynamo compiles the first count as a constant, and at the
    second makes it a size (its automatic dynamic shapes), so one more graph serves every count (and
    one once a ring is full). torch.compile keeps what it compiled with the step's code, so a second
    call reuses it; inductor keeps its code on disk under the cache directory (common.CACHE, unless
    TORCHINDUCTOR_CACHE_DIR names another), where a later process finds it."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(CACHE, "inductor"))
    if device.type == "cuda":
        return torch.compile(step, dynamic=False, mode="reduce-overhead", **options)
    if device.type != "cpu" or "backend" in options:
        return torch.compile(step, **options)  # not dynamic=True: every shape a size, slower (docs/model.md)
    step = torch.compile(step, options={**CPU_INDUCTOR, **options.pop("options", {})}, **options)
    return frozen(step, freeze) if freeze else step


# On a CPU: inductor's kernels called from C++, not Python, and its C++ GEMM templates (max-autotune's),
# which pack the frozen weights and write the products: 2x torch's in fp32 (docs/performance.md)
CPU_INDUCTOR = dict(cpp_wrapper=True, max_autotune_gemm=True, max_autotune_gemm_backends="CPP,ATEN")


def frozen(step, digest):
    """step run with inductor's freezing on, which dynamo reads as it traces (then the weights are constants
    of the graph, guarded by identity: see reuse_caches) and inductor as it compiles, and with the
    weights' digest in the key of each graph inductor keeps on disk: that key holds the frozen weights'
    shapes, not their values, yet the step read back holds weights packed from them (its GEMM
    templates'), so another model of the same shapes would read back this one's. Set, not patched,
    around each call: torch's config.patch costs 20 us."""
    import torch._inductor.config as config

    def run(*args, **kwargs):
        before = config.freezing, torch.compiler.config.cache_key_tag
        config.freezing, torch.compiler.config.cache_key_tag, FROZEN[0] = True, digest, True
        try:
            return step(*args, **kwargs)
        finally:
            (config.freezing, torch.compiler.config.cache_key_tag), FROZEN[0] = before, False
    return run


def weights_digest(model):
    """SHA-256 of the model's parameters and buffers, bytes and shapes (0.5 s for GPT-2 124M in fp32)."""
    digest = hashlib.sha256()
    for t in (*model.parameters(), *model.buffers()):
        digest.update(repr((t.dtype, tuple(t.shape))).encode())
        digest.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


FROZEN = [False]  # inside a frozen step (SplitLinear reads it as it is traced)


def freezes(model, device):
    """Whether the model's compiled step freezes its weights: on a CPU, but for an encoder-decoder, whose
    cross-attention keys and values (new for each source, never written by the step) freezing would
    fold into the graph as constants."""
    return device.type == "cpu" and model.config.arch != "encoder-decoder"


STEPS = weakref.WeakKeyDictionary()  # model -> ((device type, weight versions), its own compiled step): own_step


def own_step(model, device):
    """The model's compiled step: decode's code copied for it alone. dynamo keeps what it compiled with
    the code, and the graphs of several models on one code slowed each other's steps (docs/performance.md).
    Compiled again once a weight or buffer changed in place (trained further, requantized): a frozen step
    holds their values. (Called between generations, when the model holds no cache.)"""
    key = device.type, sum(t._version for t in (*model.parameters(), *model.buffers()))
    if STEPS.get(model, (None,))[0] != key:
        step = types.FunctionType(decode.__code__.replace(), decode.__globals__)
        STEPS[model] = key, compiled(device, step, freeze=weights_digest(model) if freezes(model, device) else None)
    return STEPS[model][1]


KEPT = weakref.WeakKeyDictionary()  # model -> {the caches' shapes: where they were, and the caches}: reuse_caches


def cache_tensors(cache):
    """A cache's tensors: a KV ring's or a recurrent state's buffers, a cross-attention's (k, v), a tensor."""
    if isinstance(cache, nn.Module):
        return list(cache.buffers())
    return [cache] if torch.is_tensor(cache) else list(cache or ())


def reuse_caches(model):
    """Put back, emptied, the caches of the model's last frozen generation of the same shapes in place of
    those that setup_kv_cache just made (the first of a shape is kept as it is): a frozen step guards each
    tensor it reads by identity, and new caches would compile it again at every generation. They stay
    allocated while the model lives, as gpt-fast's caches do."""
    holders = [model.decoder] + [m for m in model.modules() if hasattr(m, "cache")]  # the attentions
    fresh = [(m, name, getattr(m, name)) for m in holders for name in ("cache", "cache_pos") if hasattr(m, name)]
    shapes = tuple((t.shape, t.dtype, t.device) for _, _, c in fresh for t in cache_tensors(c))
    kept = KEPT.setdefault(model, {}).setdefault(shapes, fresh)
    for (holder, name, new), (_, _, old) in zip(fresh, kept):
        if new is not old:
            for t, o in zip(cache_tensors(new), cache_tensors(old)):
                o.copy_(t)  # a new cache's empty values: zeros, positions -1
            setattr(holder, name, old)


def compile_pays(model, device, new, samples=1, prompt=1):
    """Whether decoding `new` tokens after a prompt of `prompt`, `samples` times, takes less time
    through the compiled step, its compile counted: generate's choice where it is not told
    (compile=None). Only the tokens decoded through the cache count: with absolute positions (or a
    prefix LM's) those before block_size (past it the context is recomputed at every token, as nanoGPT
    does). On a CPU, GPT-2 124M's compile read back from inductor's cache on disk paid for itself
    within 900-3,800 tokens in fp32, int8 and int4 (docs/performance.md); on CUDA the same count is
    taken unmeasured. Only for a decoder (or
    encoder-decoder) on a CUDA GPU or a CPU with a C++ compiler (inductor's); not for an attention
    that keeps nothing or a mixture of experts (not measured)."""
    c = model.config
    if (device.type not in ("cpu", "cuda") or device.type == "cpu" and not cxx() or c.arch == "encoder"
            or c.n_expert or ATTENTIONS[model.decoder.kind].keeps == "none"):
        return False
    tokens = min(new, c.block_size - prompt) if absolute_positions(c) or c.arch == "prefix-lm" else new
    return tokens * samples >= COMPILE_PAYS_FROM


def cxx():
    """Whether a C++ compiler, which inductor builds a CPU's kernels with, is on the PATH (once a generation)."""
    return any(map(shutil.which, (os.environ.get("CXX", "g++"), "g++", "clang++")))


STOP_AFTER = [None]  # tokens after which a generation stops (stopping_after); None: as many as asked for


@contextlib.contextmanager
def stopping_after(n):
    """Inside (process-wide), a generation of generate_tokens that starts there stops after n >= 1
    tokens, its cache sized for all it was asked for: a run of a few steps compiles the step in the
    shapes of the run to come (each cache size is a graph of its own), as sample.py does before its
    timing. Speculative decoding takes no compiled step and ignores it."""
    STOP_AFTER[0], before = n, STOP_AFTER[0]
    try:
        yield
    finally:
        STOP_AFTER[0] = before


def unguarded(skip):
    """Where skip, the compiled step's guards unchecked, but those that tell its graphs apart: checking
    them all cost about a millisecond a token on a CPU. torch warns that a call the guards would have
    sent to a new graph then runs a stale one; generate_tokens skips them only from its third step
    (the first two compile, then check the model and cache sizes with full guards) until the cache
    is full, and not for a mixture of experts (whose experts' batches change size): in between a step
    differs from the one before only in its tokens' and positions' values and in the slots in use,
    which the graph takes as a size. A stance the caller set (torch.compiler.set_stance) is kept."""
    if skip:  # (dynamo is imported by then: the step compiled)
        stance = torch._dynamo.eval_frame._stance  # the caller's: skipping would reset it to the default
        if stance.stance == "default" and stance.backend is None:
            return torch.compiler.set_stance(skip_guard_eval_unsafe=True)
    return contextlib.nullcontext()


def generate(model, idx, max_new_tokens, temperature=1.0, top_k=None, top_p=None, src=None, src_mask=None,
             vocab_limit=None, mask=None, compile=None):
    """Continue idx (B, T) by max_new_tokens sampled tokens -> (B, T + max_new_tokens).
    temperature=0 is greedy. An encoder-decoder encodes src (B, S) once and decodes from idx
    (its start token). Only ids below vocab_limit are drawn (vocab_size is often padded).
    mask (B, T) is False at the left padding of prompts of different lengths. compile: decode
    through the compiled step (True), eager (False), or the one that takes less time (None: compile_pays).
    Inside stopping_after(n), n new tokens at most."""
    new = generate_tokens(model, idx, max_new_tokens, temperature, top_k, top_p, src, src_mask, vocab_limit, mask,
                          compile)
    return torch.cat([idx, *new], dim=1)


@torch.no_grad()
def generate_tokens(model, idx, max_new_tokens, temperature=1.0, top_k=None, top_p=None, src=None, src_mask=None,
                    vocab_limit=None, mask=None, compile=None):
    """Yield each new token (B, 1) as soon as it is sampled. After a prefill of idx, each step
    feeds only the newest token through the caches, and nothing waits for the device (but a
    mixture of experts, whose routing sizes each expert's batch on the host). A left-padded row
    counts its positions from its first real token, so it decodes as it would alone."""
    c = model.config
    if c.arch == "encoder":
        raise ValueError("an encoder does not generate: fill masked tokens with one forward pass")
    if c.arch == "encoder-decoder" and src is None:
        raise ValueError("an encoder-decoder generates from src: generate(model, idx, n, src=src)")
    compile = compile_pays(model, idx.device, max_new_tokens, prompt=idx.size(1)) if compile is None else compile
    step = own_step(model, idx.device) if compile else decode
    reuse = compile and freezes(model, idx.device)
    # its guards skipped from the third step while the cache has room (see unguarded): not for experts
    unguardable = compile and not c.n_expert and idx.device.type in SLOTS_IN_USE_ON
    dtype = autocast_dtype(idx.device)  # the cache in autocast's dtype, not the weights'
    memory = None if src is None else model.encode(src, src_mask)
    # a kind that keeps nothing (LSH) runs the model over its context at every step, as nanoGPT does
    recompute = ATTENTIONS[model.decoder.kind].keeps == "none"
    # the model sees at most block_size tokens: with absolute positions (or recomputing, or a prefix
    # LM's prefix) the last block_size of the prompt; with relative ones all of it, each query through
    # a window of block_size
    restart = absolute_positions(c) or c.arch == "prefix-lm"
    crop = slice(-c.block_size, None) if restart or recompute else slice(None)
    prompt, fits = idx.size(1), idx[:, crop].size(1)  # a prefix LM's prefix: the prompt, read both ways
    size = cache_size(model, fits, max_new_tokens)
    if compile:  # in few sizes, but none past the full ring's, all of whose slots a wrapped ring reads
        size = min(compiled_size(size, idx.device), cache_size(model, fits, reach(c)))
    stop = max_new_tokens if STOP_AFTER[0] is None else min(max_new_tokens, STOP_AFTER[0])

    def start(idx, mask, first=False):  # the prompt (cropped) into fresh caches: the logits after it, its
        # last position, and the tokens in the cache (a restart, past block_size, takes no step)
        tokens, valid = idx[:, crop], None if mask is None else mask[:, crop]
        model.setup_kv_cache(tokens.size(0), size, memory, dtype)
        if reuse and first:
            reuse_caches(model)
        pos = torch.arange(tokens.size(1), device=tokens.device)[None]
        if valid is not None:
            pos = (valid.cumsum(dim=1) - 1).clamp(min=0)  # (B, T)
        prefix = None
        if c.arch == "prefix-lm":  # the prompt's tokens in view: their positions are the first
            n = max(0, prompt - (idx.size(1) - tokens.size(1)))
            prefix = valid[:, :n].sum(1) if valid is not None else torch.full((tokens.size(0),), n, device=idx.device)
        return prefill(model, tokens, pos, valid, src_mask, prefix), pos[:, -1:], tokens.size(1)

    try:
        logits, pos, fed = start(idx, mask, first=True)
        for i in range(stop):
            idx_next = sample(logits[:, :vocab_limit], temperature, top_k, top_p)  # (B, 1)
            yield idx_next
            if i == stop - 1:
                break
            idx = torch.cat((idx, idx_next), dim=1)
            mask = None if mask is None else F.pad(mask, (0, 1), value=True)
            if recompute or restart and idx.size(1) > c.block_size:
                # absolute positions must shift: recompute the last block_size tokens as
                # nanoGPT does (no cache saving from here on)
                logits, pos, fed = start(idx, mask)
            else:
                pos, fed = pos + 1, fed + 1  # pos on the device, so the loop never waits for it
                with unguarded(unguardable and i >= 2 and fed < size):
                    logits = step(model, idx_next, pos, src_mask, slots_used(model, fed))
    finally:
        model.clear_kv_cache()


# ----------------------------------------------------------------------------------------------
# Speculative decoding (Leviathan et al. 2023; Chen et al. 2023): a small draft decoder proposes
# tokens, the target scores them all in one forward pass and keeps those it agrees with, so that
# the output follows the target's own distribution, faster. The target's KV cache rolls back what
# it rejects.

def accept_or_resample(p, q, drafted):
    """The rule of speculative sampling. p (k+1, V): the target's probabilities at each drafted
    position and one past; q (k, V): the draft's; drafted (k,). Draft i is kept with probability
    min(1, p_i(x) / q_i(x)); the first rejected one is replaced by a draw from max(0, p_i - q_i),
    renormalised, and if all k are kept a token from p_k+1 follows. The tokens returned (a list)
    are distributed exactly as the target's own samples would be."""
    k = drafted.numel()
    i = torch.arange(k, device=p.device)
    keep = torch.rand(k, device=p.device) < p[i, drafted] / q[i, drafted]
    n = int(keep.logical_not().nonzero()[0]) if not keep.all() else k  # drafts accepted
    rest = p[k] if n == k else (p[n] - q[n]).clamp(min=0)
    return drafted[:n].tolist() + [int(draw(rest[None] / rest.sum()))]


@torch.no_grad()
def speculative_generate(target, draft, idx, max_new_tokens, k=4, temperature=1.0, top_k=None, top_p=None,
                         vocab_limit=None):
    """Continue idx (1, T) as `target` would, faster: the `draft` decoder proposes k tokens one by
    one, the target scores them all in one forward pass, and accept_or_resample keeps what the
    target agrees with. With temperature=0 the output is exactly the target's greedy decoding.
    Returns (1, T + max_new_tokens) and the numbers of draft tokens accepted and proposed."""
    if target.config.arch != "decoder" or draft.config.arch != "decoder":
        raise ValueError("speculative decoding takes a decoder as target and as draft")
    if idx.size(0) != 1:
        raise ValueError("speculative decoding takes one sequence at a time (batch size 1)")
    for m in (target, draft):
        if ATTENTIONS[m.config.attention].keeps != "kv":
            raise ValueError(f"{m.config.attention} attention's state cannot forget tokens: no speculative "
                             "decoding with it")

    def feed(model, tokens, start):  # tokens (1, n) at positions start.. -> probabilities (n, V)
        end = start + tokens.size(1)
        logits = model(tokens, input_pos=torch.arange(start, end, device=tokens.device),
                       slots_used=slots_used(model, end))[0]
        return sampling_probs(logits[0, :, :vocab_limit], temperature, top_k, top_p)

    out, total = idx[0].tolist(), idx.size(1) + max_new_tokens
    # drafting stops where absolute positions would have to shift; the target alone finishes
    end = min([m.config.block_size - k for m in (target, draft) if absolute_positions(m.config)] + [total])
    accepted = proposed = 0
    for m in (target, draft):  # room for the k + 1 positions that a rollback may take back
        m.setup_kv_cache(1, cache_size(m, len(out), max_new_tokens) + k + 1, dtype=autocast_dtype(idx.device))
    try:
        # invariant: the target has seen all of out but its last token; the draft all but `pending`
        if 1 < len(out) < end:
            for m in (target, draft):
                prefill(m, idx[:, :-1], torch.arange(len(out) - 1, device=idx.device))
        pending = idx[:, -1:]
        while len(out) < end:
            q, drafted, x, start = [], [], pending, len(out) - pending.size(1)
            for _ in range(k):  # the draft proposes, one forward pass per token
                q.append(feed(draft, x, start)[-1:])
                start += x.size(1)
                x = draw(q[-1])
                drafted.append(x)
            drafted = torch.cat(drafted, dim=1)  # (1, k)
            last = idx.new_tensor([out[-1:]])
            p = feed(target, torch.cat((last, drafted), dim=1), len(out) - 1)  # (k + 1, V): one pass
            new = accept_or_resample(p, torch.cat(q), drafted[0])
            n = len(new) - 1  # drafts accepted
            accepted, proposed = accepted + n, proposed + k
            # each cache keeps the accepted drafts and forgets the rest (the draft saw k - 1 drafts, not the last)
            target.rollback_kv_cache(k - n)
            draft.rollback_kv_cache(k - 1 - min(n, k - 1))
            pending = torch.cat((drafted[:, k - 1:] if n == k else drafted[:, :0], idx.new_tensor([new[-1:]])), dim=1)
            out += new
    finally:
        target.clear_kv_cache()
        draft.clear_kv_cache()
    out = idx.new_tensor([out[:total]])
    if out.size(1) < total:
        out = generate(target, out, total - out.size(1), temperature, top_k, top_p, vocab_limit=vocab_limit)
    return out, accepted, proposed


# ----------------------------------------------------------------------------------------------
# A CPU's layout of the weights for decoding, where each token is a matrix-vector product per layer

def decode_layout(model):
    """Lay each Linear layer out for decoding on a CPU, in place; values, shapes and names stay (sample.py
    and bench.py call it; a model on another device comes back as it is).
    Its weight W (out, in) is stored as the transpose of a contiguous (in, out) matrix, so F.linear
    computes x @ Wᵀ as a plain product, which streams a matrix-vector product's weights faster (bench.py
    sample times both layouts); and each plain fp32 nn.Linear becomes a SplitLinear, in blocks of
    SPLIT_BYTES or more, one a thread at most: a layer below two blocks is not split, but its product
    in a frozen compiled step is frozen_product's too. A tied embedding then reads its rows strided:
    one row per token."""
    if next(model.parameters()).device.type != "cpu":
        return model
    for m in model.modules():
        if isinstance(m, nn.Linear):
            m.weight.data = m.weight.data.t().contiguous().t()
    parts = lambda m: min(torch.get_num_threads(), m.weight.nbytes // SPLIT_BYTES)  # noqa: E731
    fp32 = lambda m: plain_linear(m) and m.weight.dtype == torch.float32  # noqa: E731
    return replace_linears(model, lambda m: SplitLinear(m, max(1, parts(m))) if fp32(m) else m)


SPLIT_BYTES = 2 ** 21  # below about 2 MB a block, splitting costs more than it saves


class SplitLinear(nn.Linear):
    """A Linear layer whose product with one row of input runs on `parts` cores. torch's fp32
    matrix-vector product on a CPU runs on one core, which reads the weights at about half the rate
    that two do (docs/performance.md). A batched product runs its batch on all of torch's threads:
    so the (in, out) weight's columns are viewed, without a copy, as `parts` blocks (parts, in,
    out / parts), and the row multiplies each block at once. Several rows (a prompt) take torch's
    own multi-threaded product, as do other dtypes (torch's bf16 bmm would copy the blocks at every
    call), autocast and autograd; so does a layer of one part. A frozen compiled step takes
    frozen_product, for one row or several."""

    def __init__(self, linear, parts):
        super().__init__(linear.in_features, linear.out_features, bias=False, device="meta")  # no weight of its own
        self.weight, self.bias, self.parts = linear.weight, linear.bias, parts  # the same tensors: ties hold

    def forward(self, x):
        if torch.is_grad_enabled() or self.weight.dtype != torch.float32 or torch.is_autocast_enabled(x.device.type):
            return F.linear(x, self.weight, self.bias)
        if torch.compiler.is_compiling() and FROZEN[0]:  # traced into a frozen step: every row
            y = frozen_product(x.reshape(-1, self.in_features), self.weight.t())
        elif x.numel() == x.size(-1) and self.parts > 1:  # one row, eager
            y = split_product(x.reshape(1, -1), self.weight.t(), self.parts)
        else:  # a prompt's rows, or a layer of one part
            return F.linear(x, self.weight, self.bias)
        return (y if self.bias is None else y + self.bias).view(*x.shape[:-1], self.out_features)


def split_product(x: torch.Tensor, w: torch.Tensor, parts: int) -> torch.Tensor:
    """x (1, in) @ w (in, out), contiguous, as one batched product of `parts` column blocks."""
    q = w.size(1) // parts  # a block's columns; the last out % parts take a plain product
    blocks = w[:, :parts * q].reshape(w.size(0), parts, q).transpose(0, 1)  # (parts, in, q): a view
    y = torch.bmm(x.reshape(1, 1, -1).expand(parts, 1, -1), blocks).view(1, parts * q)
    return y if parts * q == w.size(1) else torch.cat([y, x @ w[:, parts * q:]], dim=1)


def frozen_product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x (n, in) @ w (in, out) in a frozen compiled step, as one batched product (bmm) of a batch of one.
    inductor writes it with its C++ GEMM template (CPU_INDUCTOR), from w packed at compile time into
    tensors its cache on disk keeps. A plain product (F.linear's mm) its MKL pass would pack first
    (fx_passes/mkldnn_fusion.py matches mm and addmm), into tensors it cannot keep: every process compiled
    the step again. A bmm of one row inductor writes as a sum per output (kernel/bmm.py), slower than its
    template: so one row goes in twice (docs/performance.md)."""
    rows = x if x.size(0) > 1 else torch.cat([x, x])
    return torch.bmm(rows.unsqueeze(0), w.unsqueeze(0))[0, :x.size(0)]

