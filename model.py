"""
nanoformer: the transformer family in one file, to be read top to bottom.

One config expresses GPT-2, BERT, T5, Llama and the original Transformer:
  GPT-2     arch="decoder", pos="learned", norm="layernorm", mlp="gelu"
  nanoGPT   GPT-2 with bias=False, gelu_approximate="none"
  BERT      arch="encoder", pos="learned", norm_first=False, lm_head_bias=True
  prefix LM arch="prefix-lm": a decoder whose prompt (prefix) is read both ways (T5's paper)
  T5        arch="encoder-decoder", pos="relative", norm="rmsnorm", mlp="relu" or "geglu", bias=False
  Llama     arch="decoder", pos="rope", norm="rmsnorm", mlp="swiglu", n_kv_head < n_head, bias=False
  Vaswani   arch="encoder-decoder", pos="sinusoidal", norm_first=False, mlp="relu" (plus BERT's
            norm of the embeddings, which post-norm stacks here share)
"""

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

import efficient
import kernels
import ring
import scores

ARCHS = ("decoder", "encoder", "encoder-decoder", "prefix-lm")
POSITIONS = ("learned", "sinusoidal", "rope", "alibi", "relative", "none")
NORMS = ("layernorm", "rmsnorm")
MLPS = ("gelu", "relu", "relu2", "swiglu", "geglu")
GELUS = ("tanh", "none")
ATTN_IMPLS = ("auto", "triton", "sdpa", "math")


class Kind(NamedTuple):
    """What an attention kind is, as ModelConfig's checks, Attention, and sample.py's and hf.py's refusals
    read it. A new kind is four places: its row of ATTENTIONS (these facts, the call of its function), that
    function in efficient.py (with its draws and state), its config fields, and its ModelConfig.conflicts."""
    causal: bool  # serves a decoder (else an encoder-decoder's decoder keeps softmax attention)
    bidirectional: bool  # serves an encoder
    keeps: str  # while decoding: "kv" (a KV cache, which can forget tokens), "state" (a recurrent state),
    # "none" (each step recomputes the context)
    bias: bool  # takes a bias on its scores: ALiBi, T5's relative positions
    window: bool  # takes a window of keys, and global tokens beside it
    weights: bool  # has weights to draw (sample.py's attention page)
    kernel: bool  # kernels.py's Triton kernel computes it
    export: bool  # Hugging Face's models have it (hf.py export)
    attend: Callable | None = None  # (layer, q, k, v, mask, dropout) -> (B, nh, T, hs); None: Attention's softmax
    draws: Callable = lambda config, generator=None: {}  # -> {name: a Parameter to learn, or a fixed buffer}
    redraws: bool = False  # feature_redraw draws its draws again while training (Transformer.redraw_features)
    state: Callable | None = None  # (config, batch_size, device) -> its empty recurrent state (keeps="state")
    shared_qk: bool = False  # its keys are made from its queries: c_attn projects queries and values only
    fixed_length: bool = False  # its draws have a column per position: no sequence longer than block_size
    scores: bool = False  # takes ModelConfig.score's other score functions (scores.py), on the math path


ATTENTIONS = {
    "softmax": Kind(causal=True, bidirectional=True, keeps="kv", bias=True, window=True, weights=True, kernel=True,
                    export=True, scores=True),
    # phi(q) phi(k)ᵀ, phi = elu + 1, O(T) (Katharopoulos et al. 2020)
    "linear": Kind(causal=True, bidirectional=True, keeps="state", bias=False, window=False, weights=False,
                   kernel=False, export=False,
                   attend=lambda layer, q, k, v, mask, dropout: efficient.linear_attention(
                       q, k, v, mask.causal, mask.valid, layer.cache),
                   state=lambda c, B, dev: efficient.LinearState(B, c.n_kv_head, c.head_size, dev)),
    # FAVOR+: positive orthogonal random features estimate exp(q·k / sqrt(hs)), O(T m) (Choromanski et al. 2021)
    "performer": Kind(causal=True, bidirectional=True, keeps="state", bias=False, window=False, weights=False,
                      kernel=False, export=False, draws=efficient.performer_draws, redraws=True,
                      attend=lambda layer, q, k, v, mask, dropout: efficient.performer_attention(
                          q, k, v, layer.proj, mask.causal, mask.valid, layer.cache),
                      state=lambda c, B, dev: efficient.PerformerState(B, c.n_kv_head, c.n_features, c.head_size, dev)),
    # keys and values projected along the sequence to proj_len rows, O(T k) (Wang et al. 2020)
    "linformer": Kind(causal=False, bidirectional=True, keeps="none", bias=False, window=False, weights=False,
                      kernel=False, export=False, draws=efficient.linformer_draws, fixed_length=True,
                      attend=lambda layer, q, k, v, mask, dropout: efficient.linformer_attention(
                          q, k, v, layer.proj_k, layer.proj_v, mask.valid, dropout)),
    # shared-QK attention within buckets of angular LSH, O(T bucket_size) (Kitaev et al. 2020, Reformer)
    "lsh": Kind(causal=True, bidirectional=True, keeps="none", bias=False, window=False, weights=False,
                kernel=False, export=False, draws=efficient.lsh_draws, shared_qk=True,
                attend=lambda layer, q, k, v, mask, dropout: efficient.lsh_attention(
                    q, v, layer.rotations, layer.config.bucket_size, mask.causal, mask.valid)),
}


@dataclass
class ModelConfig:
    arch: str = "decoder"  # "decoder" (GPT), "encoder" (BERT), "encoder-decoder" (T5, Vaswani et al.), "prefix-lm"
    vocab_size: int = 50304  # GPT-2's 50257 rounded up to a multiple of 64, which matmuls like
    block_size: int = 1024  # the context trained on; the length of a learned position table
    n_layer: int = 12  # blocks per stack (an encoder-decoder has two stacks)
    n_head: int = 12  # query heads
    n_kv_head: int | None = None  # key/value heads: None = n_head, 1 = multi-query, else grouped-query
    n_embd: int = 768  # width of the residual stream
    head_size: int | None = None  # None = n_embd // n_head
    mlp_hidden: int | None = None  # None = 4 * n_embd; gated MLPs 8/3 * n_embd (same parameter count)
    pos: str = "learned"  # "learned", "sinusoidal", "rope", "alibi", "relative" (T5) or "none"
    rope_theta: float = 10000.0  # RoPE base; Llama 3 uses 500000
    rope_scaling: float = 1.0  # RoPE position interpolation: positions are divided by this factor
    rel_buckets: int = 32  # T5 relative bias: number of buckets...
    rel_max_distance: int = 128  # ...and the offset from which all longer offsets share a bucket
    norm: str = "layernorm"  # "layernorm" or "rmsnorm"
    norm_first: bool = True  # True: pre-norm (GPT-2, Llama, T5); False: post-norm (Vaswani, BERT)
    norm_eps: float = 1e-5
    mlp: str = "gelu"  # "gelu", "relu", "relu2" (relu squared: Primer), "swiglu" (Llama) or "geglu" (T5 v1.1)
    gelu_approximate: str = "tanh"  # "tanh" (GPT-2's approximation) or "none" (exact erf GELU, as nanoGPT)
    n_expert: int = 0  # 0 = dense MLP; > 0 = mixture of this many expert MLPs
    expert_top_k: int = 2  # experts each token is routed to
    moe_aux_weight: float = 0.01  # weight of the load-balancing loss in the training loss
    attention: str = "softmax"  # the kind: "softmax", "linear", "performer", "linformer" or "lsh" (ATTENTIONS)
    n_features: int = 256  # performer: random features per head
    feature_redraw: int = 0  # performer: draw new features every this many optimizer steps; 0 = never
    proj_len: int = 256  # linformer: the rows keys and values are projected to
    bucket_size: int = 64  # lsh: positions per bucket; block_size // bucket_size buckets
    n_hashes: int = 2  # lsh: hashing rounds
    window: int = 0  # sliding-window attention: keys fewer than `window` positions away; 0 = all
    n_global: int = 0  # with a window: the first n_global positions are seen by all (Longformer), sinks when decoding
    n_random: int = 0  # with a window, in an encoder: each block of queries sees this many random blocks (BigBird)
    sparse_block: int = 64  # BigBird's block: positions per block of queries and of keys
    mem_len: int = 0  # a decoder's memory (Transformer-XL): each layer's input of this many positions before
    bias: bool = True  # biases in Linear and LayerNorm (GPT-2, BERT: True; Llama, T5: False)
    dropout: float = 0.0
    tie_embeddings: bool = True  # the output layer reuses the token embedding matrix
    lm_head_bias: bool = False  # a bias on the output logits (BERT's)
    qk_norm: bool = False  # RMS-normalise each head's queries and keys (no gain), before RoPE
    logit_softcap: float = 0.0  # logits -> c * tanh(logits / c), bounded by c (Gemma 2; nanochat 15); 0 = off
    zero_init: bool = False  # output projections, and an untied lm_head, start at zero (modded-nanogpt)
    attn_impl: str = "auto"  # "auto" (fastest here), "triton" (kernels.py), "sdpa" (torch's), "math"
    score: str = "scaled_dot"  # q·k/sqrt(hs); or "dot", "general", "additive", "location" (scores.py: math path)
    patch_size: int = 0  # > 0: an encoder of images (B, C, H, W) cut into P x P patches (ViT); 0: of token ids
    image_size: int = 224  # with patch_size: the images' height and width...
    channels: int = 3  # ...and channels (1: a spectrogram)
    n_classes: int = 0  # with patch_size: the classes the head scores from [CLS]'s final state

    def __post_init__(self):
        for name, choices in [("arch", ARCHS), ("pos", POSITIONS), ("norm", NORMS), ("mlp", MLPS),
                              ("gelu_approximate", GELUS), ("attn_impl", ATTN_IMPLS), ("attention", tuple(ATTENTIONS)),
                              ("score", scores.SCORES)]:
            if getattr(self, name) not in choices:
                raise ValueError(f"{name}={getattr(self, name)!r} is not known: choose one of "
                                 + ", ".join(map(repr, choices)))
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "head_size", "mlp_hidden", "n_features",
                     "proj_len", "bucket_size", "n_hashes", "sparse_block", "image_size", "channels"):
            if getattr(self, name) is not None and getattr(self, name) < 1:  # None: derived below
                raise ValueError(f"{name}={getattr(self, name)} must be a positive integer")
        self.n_kv_head = self.n_head if self.n_kv_head is None else self.n_kv_head
        if self.n_kv_head < 1 or self.n_head % self.n_kv_head:
            raise ValueError(f"n_head={self.n_head} is not divisible by n_kv_head={self.n_kv_head}: "
                             f"choose n_kv_head among {[d for d in range(1, self.n_head + 1) if self.n_head % d == 0]}")
        if self.head_size is None:
            if self.n_embd % self.n_head:
                raise ValueError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}: "
                                 "make n_embd a multiple of n_head, or set head_size")
            self.head_size = self.n_embd // self.n_head
        if self.pos == "rope" and self.head_size % 2:
            raise ValueError(f"RoPE rotates pairs of channels, so head_size={self.head_size} must be even: "
                             "change n_embd or n_head")
        if self.pos == "sinusoidal" and self.n_embd % 2:
            raise ValueError(f"sinusoidal positions pair sin and cos, so n_embd={self.n_embd} must be even")
        if self.mlp_hidden is None:
            # Llama's rule (see the field), rounded up to a multiple of 64 for the matmuls
            gated = self.mlp in ("swiglu", "geglu")
            self.mlp_hidden = 64 * math.ceil(8 * self.n_embd / 3 / 64) if gated else 4 * self.n_embd
        if self.n_expert < 0 or (self.n_expert and not 1 <= self.expert_top_k <= self.n_expert):
            raise ValueError(f"expert_top_k={self.expert_top_k} must lie between 1 and n_expert={self.n_expert} "
                             "(and n_expert must be 0 for a dense MLP, or positive)")
        for wrong, problem in self.conflicts():
            if wrong:
                raise ValueError(problem)

    def conflicts(self):
        """Settings out of range or that cannot go together: (whether so, the problem and the way out).
        What an attention kind takes is read from its row in ATTENTIONS."""
        a, kind, triton = self.attention, ATTENTIONS[self.attention], self.attn_impl == "triton"
        free = efficient.free_blocks(self.block_size, self.sparse_block, self.window, self.n_global) \
            if self.n_random and not self.block_size % self.sparse_block else None
        return [
            (self.window < 0, f"window={self.window} must be 0 (full attention) or a positive span"),
            (self.logit_softcap < 0, f"logit_softcap={self.logit_softcap} must be 0 (off) or a positive bound "
             "such as 15"),
            (not 0.0 <= self.dropout < 1.0, f"dropout={self.dropout} must lie in [0, 1)"),
            (self.rope_scaling <= 0 or self.rope_theta <= 0, "rope_theta and rope_scaling must be positive "
             "(rope_scaling=1 means no scaling)"),
            # each stack needs its exact buckets (rel_buckets / 2 offsets in a decoder, half as many per
            # direction in an encoder) to end below max_distance, where the log-spaced ones stop
            (self.pos == "relative" and not 4 <= self.rel_buckets < 2 * self.rel_max_distance,
             f"rel_buckets={self.rel_buckets}, rel_max_distance={self.rel_max_distance}: need at least 4 buckets "
             "and rel_max_distance above rel_buckets / 2 (T5: 32 and 128)"),
            (triton and self.pos == "relative", "the Triton kernel has no T5 relative bias: use attn_impl='auto' "
             "or 'sdpa' with it"),
            (triton and self.head_size > kernels.MAX_HEAD_SIZE, f"the Triton kernel takes heads of at most "
             f"{kernels.MAX_HEAD_SIZE}, not head_size={self.head_size}: use attn_impl='auto' or 'sdpa'"),
            (triton and self.dropout, "the Triton kernel does not drop attention weights: set dropout=0, or use "
             "attn_impl='auto', which trains with dropout through SDPA"),
            (triton and not kind.kernel, f"the Triton kernel computes softmax attention, not {a} attention: use "
             "attn_impl='auto' or 'sdpa'"),
            (self.score != "scaled_dot" and (triton or not kind.scores), f"score={self.score!r} runs on the math path "
             f"of softmax attention, not {a} attention nor Triton's: use attention='softmax', attn_impl='auto'"),
            (triton and (self.n_global or self.n_random), "the Triton kernel has neither global tokens nor sinks, "
             "nor random blocks: use attn_impl='auto' (SDPA) or 'sdpa'"),
            (self.pos in ("alibi", "relative") and not kind.bias, f"pos={self.pos!r} adds a bias to attention "
             f"scores, which {a} attention has none of: choose pos='rope', 'learned', 'sinusoidal' or 'none'"),
            ((self.window or self.n_global) and not kind.window, f"{a} attention weighs every key it sees: it has "
             "no window (set window=0), nor global tokens beside one (set n_global=0)"),
            (self.arch == "prefix-lm" and (a != "softmax" or self.window), "a prefix LM reads its prefix both "
             "ways and the rest causally, in one mask over whole sequences: with softmax attention and no window"),
            (self.feature_redraw and not kind.redraws, "feature_redraw draws a performer's random features: set "
             "attention='performer', or feature_redraw=0"),
            (self.arch == "decoder" and not kind.causal, f"{a} attention mixes later keys into earlier ones, so a "
             "decoder cannot have it: use it in an encoder (or an encoder-decoder's encoder)"),
            (self.arch == "encoder" and not kind.bidirectional, f"{a} attention is causal only: an encoder "
             "cannot have it, choose arch='decoder' or attention='softmax'"),
            (self.n_global < 0 or self.n_global and not self.window, f"n_global={self.n_global}: global tokens "
             "are seen from a window's queries (Longformer): set window, or n_global=0"),
            (min(self.feature_redraw, self.n_random, self.mem_len, self.patch_size, self.n_classes) < 0,
             "feature_redraw, n_random, mem_len, patch_size and n_classes must be 0 (off) or positive"),
            ((self.patch_size or self.n_classes) and not (self.arch == "encoder" and self.patch_size and self.n_classes
             and not self.image_size % self.patch_size and (self.image_size // self.patch_size) ** 2 < self.block_size),
             f"a ViT (patch_size={self.patch_size}, n_classes={self.n_classes}) is an encoder (arch='encoder') of "
             "images whose image_size is a multiple of patch_size, in fewer patches than block_size (one more: [CLS])"),
            (self.mem_len and self.arch != "decoder", "mem_len: a memory of segments before (Transformer-XL) is for "
             "decoders: set arch='decoder', or mem_len=0"),
            (self.mem_len and (self.pos in ("learned", "sinusoidal") or a != "softmax" or self.n_global
                               or self.score == "location"), f"mem_len: the memory's keys come before every segment, "
             f"where pos={self.pos!r} (or a location score) would restart at 0: choose pos='rope', 'alibi', 'relative' "
             "or 'none', with softmax attention, no global tokens and no location score"),
            (a == "lsh" and (self.block_size % self.bucket_size or self.block_size // self.bucket_size % 2),
             f"lsh hashes into block_size // bucket_size buckets, an even number: block_size={self.block_size} "
             f"and bucket_size={self.bucket_size} do not make one; choose bucket_size to divide block_size / 2"),
            (kind.shared_qk and self.n_kv_head != self.n_head, f"{a} attention shares queries and keys (its keys "
             "are made from the queries), so it has no key/value head groups: set n_kv_head=None"),
            (self.n_random and (self.arch in ("decoder", "prefix-lm") or not self.window or a != "softmax"),
             "BigBird's random "
             "blocks (n_random) join an encoder's window: set arch='encoder' or 'encoder-decoder', a window, and "
             "attention='softmax' (a causal BigBird, as Hugging Face's, is refused)"),
            (self.n_random and (self.pos in ("alibi", "relative") or self.block_size % self.sparse_block),
             f"n_random: block_size={self.block_size} must be a multiple of sparse_block={self.sparse_block}, and "
             "the positions not a bias on the scores (pos='learned', 'sinusoidal', 'rope' or 'none')"),
            (free is not None and (free.sum(1) < self.n_random).any(), f"n_random={self.n_random}: some block of "
             f"{self.sparse_block} queries has fewer blocks of keys outside its window and the global tokens: "
             "lower n_random or sparse_block, or raise block_size")]


# ----------------------------------------------------------------------------------------------
# Positions. Learned and sinusoidal positions are added to the token embeddings; RoPE rotates
# queries and keys; ALiBi and the relative bias are added to the attention scores.

def angles(pos, dim, base):
    """pos * base^(-2i/dim) for i < dim/2: the angles of sinusoidal positions and of RoPE.
    (*pos.shape) -> (*pos.shape, dim/2); low channels turn fast, high channels slowly."""
    freq = base ** (-torch.arange(0, dim, 2, device=pos.device, dtype=torch.float32) / dim)
    return pos[..., None].float() * freq


def sinusoidal(pos, dim, base=10000.0):
    """Vaswani et al.: PE(pos, 2i) = sin(pos / base^(2i/dim)), PE(pos, 2i+1) = cos(...).
    Each sin/cos pair turns by a fixed angle per step, so PE(pos + k) is a rotation of PE(pos)."""
    a = angles(pos, dim, base)
    return torch.stack((a.sin(), a.cos()), -1).flatten(-2)  # (..., dim), sin and cos interleaved


def rope(pos, head_size, theta=10000.0, scaling=1.0):
    """RoPE (Su et al.): cos and sin of each position's angles, (B|1, 1, T, hs/2) for apply_rope.
    Dividing positions by `scaling` squeezes a longer context into the trained angle range."""
    a = angles(pos / scaling, head_size, theta)[:, None]
    return a.cos(), a.sin()


def apply_rope(x, cos, sin):
    """Rotate channel pairs (i, i + hs/2) of x (B, nh, T, hs) by their angles. The dot product of a
    rotated query and key then depends only on how far apart their positions are."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).type_as(x)


def alibi_slopes(n_head):
    """ALiBi (Press et al.): head h adds -slope_h * distance to its scores. The slopes are the
    geometric sequence 2^(-8/n), 2^(-16/n), ...; a head count that is not a power of two takes the
    closest power's slopes plus every other slope of the next power."""
    def geometric(n):
        return [2 ** (-8 * (i + 1) / n) for i in range(n)]
    p = 2 ** math.floor(math.log2(n_head))
    return geometric(p) + geometric(2 * p)[0::2][: n_head - p]


def relative_bucket(offset, bidirectional, num_buckets, max_distance):
    """T5's buckets for key position - query position: exact for small offsets, logarithmically
    wider up to max_distance, one bucket beyond. A bidirectional stack gives each sign half."""
    if bidirectional:  # keys ahead (offset > 0) take the second half
        num_buckets //= 2
        bucket, n = (offset > 0).long() * num_buckets, offset.abs()
    else:  # a decoder never sees the future: only offsets <= 0 matter
        bucket, n = 0, (-offset).clamp(min=0)
    exact = num_buckets // 2
    log_ratio = torch.log(n.float().clamp(min=exact) / exact) / math.log(max_distance / exact)
    far = (exact + (log_ratio * (num_buckets - exact)).long()).clamp(max=num_buckets - 1)
    return bucket + torch.where(n < exact, n, far)


# ----------------------------------------------------------------------------------------------
# Attention

class Mask(NamedTuple):
    """Which keys each query may see, and the softmax backend that takes it, in that backend's form
    (Stack.mask picks both once per forward). The Triton kernel takes the pieces, the keys being the
    queries themselves (Tq = Tk, in order); SDPA and the math path one dense additive `bias` (B|1,
    nh|1, Tq, Tk): the position bias where a query may look, -inf where not (see Stack.attn_bias)."""
    causal: bool = False
    window: int = 0  # see only keys fewer than `window` positions away
    alibi: torch.Tensor | None = None  # (nh,) ALiBi slopes
    valid: torch.Tensor | None = None  # (B, Tk) False for padding keys
    bias: torch.Tensor | None = None  # the dense form; None when nothing or `causal` alone applies
    backend: str = "sdpa"  # "triton" (takes the pieces), "sdpa" or "math" (take causal and bias)
    slots: torch.Tensor | None = None  # (Tq,) while generating: the KV cache slots the queries' keys go to
    weights: list | None = None  # where each layer appends its weights (B, nh, Tq, Tk), on the math path
    ring: object = None  # a process group whose ranks hold the sequence in order, a shard each (ring attention)
    keys: torch.Tensor | None = None  # (B|1, Tk) the keys' positions, -1 for none (a location score reads them)


# "auto" takes the Triton kernel only where it was measured faster than SDPA (docs/kernels.md):
# for masks that SDPA takes as a dense bias (ALiBi, windows, padding, queries after a KV cache),
# in models of this context or longer, over whole sequences of queries. SDPA's own fused kernels
# (cuDNN's on an H100) win at plain causal attention, and at a decode step: the kernel gives each
# head one program per block of 64-128 queries, so a few queries leave the GPU idle.
KERNEL_MIN_CONTEXT = 4096
KERNEL_MIN_QUERIES = 64


def attn_impl(config, device, training, mask, Tq):
    """The one place the attention path is chosen: for Tq queries under this mask (in pieces), the
    config's, or for "auto" the Triton kernel where it is the faster and applies (a CUDA GPU of
    compute capability 8.0, Ampere, or later; no relative bias, no attention dropout, heads of at
    most 128), else torch's SDPA. Stack.mask asks it once per forward and mask, not every layer. A
    model trained through the kernel on a GPU runs the same attention through SDPA on a CPU."""
    if config.attn_impl == "triton" and device.type != "cuda" and not kernels.INTERPRET:
        return "sdpa"
    if config.attn_impl != "auto" or config.score != "scaled_dot":  # other scores (scores.py) are written out
        return config.attn_impl if config.score == "scaled_dot" else "math"
    plain = mask.bias is None and not mask.window and mask.alibi is None and mask.valid is None
    faster = not plain and config.block_size >= KERNEL_MIN_CONTEXT and Tq >= KERNEL_MIN_QUERIES
    applies = (config.pos != "relative" and not (training and config.dropout) and not config.n_global
               and not config.n_random
               and config.head_size <= kernels.MAX_HEAD_SIZE)
    on_gpu = device.type == "cuda" and kernels.available and faster and applies
    return "triton" if on_gpu and torch.cuda.get_device_capability(device) >= (8, 0) else "sdpa"


def autocast_dtype(device, default=None):
    """The dtype autocast runs matrix products in on device, or default where it is off."""
    return torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else default


def attention(q, k, v, mask, dropout=0.0, score=None):
    """softmax(q kᵀ / sqrt(hs) + mask) v for q (B, nh, Tq, hs) and k, v (B, n_kv_head, Tk, hs) (on the math
    path, score(q, k) in place of q kᵀ / sqrt(hs): scores.py), on the backend mask.backend. Each group of
    nh / n_kv_head query heads shares one key/value head (grouped-query attention). Returns the output
    (B, nh, Tq, hs) and, on the math path, the weights (B, nh, Tq, Tk). mask.ring: the keys of the other
    shards come round the ring."""
    if mask.ring is not None:  # context parallel: exact attention over the whole sequence, a shard here
        return ring.ring_attention(q, k, v, mask.causal, mask.ring), None
    if mask.backend == "triton":  # exact attention in O(T) memory; GQA read in place, masks built per block
        dtype = autocast_dtype(q.device, q.dtype)  # autocast casts SDPA's inputs, not a custom op's
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        return kernels.flash_attention(q, k, v, causal=mask.causal, window=mask.window,
                                       alibi_slopes=mask.alibi, key_padding_mask=mask.valid), None
    bias = None if mask.bias is None else mask.bias.to(q.dtype)
    causal = mask.causal and bias is None  # Tq == Tk: a KV cache always comes with a bias
    if mask.backend == "sdpa":
        # fused kernels (flash attention when causal and unbiased) never build the Tq x Tk matrix
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=dropout,
                                              is_causal=causal, enable_gqa=True), None
    if q.size(1) != k.size(1):  # each key/value head serves a group of query heads
        group = q.size(1) // k.size(1)
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # (B, nh, Tk, hs)
    att = (score(q, k) if score else (q * q.size(-1) ** -0.5) @ k.transpose(-2, -1)).float()  # (B, nh, Tq, Tk)
    if causal:  # in place: the product's backward needs q and k, not att
        att.masked_fill_(torch.ones(att.shape[-2:], dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    att = att if bias is None else att + bias
    att = att.softmax(dim=-1).type_as(q)
    return F.dropout(att, dropout) @ v, att


def reach(config):
    """How far back a query looks while generating: its window, never past block_size, the span
    trained on (and a memory's mem_len before it). Past it a model with relative positions is a
    sliding-window model (absolute ones recompute their context, see generate_tokens)."""
    return min(config.window or config.block_size, config.block_size) + config.mem_len


def padding_bias(valid):
    """(B, S) key validity -> (B, 1, 1, S) additive bias: 0 for real keys, -inf for padding."""
    return torch.zeros(valid.shape, device=valid.device).masked_fill(~valid, float("-inf"))[:, None, None, :]


class KVCache(nn.Module):
    """Keys and values of one layer in `size` slots, written in place (gpt-fast's static cache) as a
    ring: the token at position p (of a batch's longest row) goes to slot p % size, overwriting the
    oldest. The buffers keep their shape, so torch.compile replays one graph, and a sliding-window
    cache never grows past its size. Stack.cache_pos says which position each slot holds."""

    def __init__(self, batch_size, n_kv_head, size, head_size, dtype, device):
        super().__init__()
        shape = (batch_size, n_kv_head, size, head_size)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def forward(self, k, v, slots):
        # new k, v (B, n_kv_head, T, hs) written at slots (T,) -> the cache (B, n_kv_head, size, hs)
        self.k.index_copy_(2, slots, k.to(self.k.dtype))
        self.v.index_copy_(2, slots, v.to(self.v.dtype))
        return self.k, self.v


class Attention(nn.Module):
    """Multi-head attention: self-attention over x, or cross-attention from x to an encoder's output.
    Only n_kv_head key/value heads are projected and cached (GQA/MQA). kind: the self-attention's
    kind (ATTENTIONS), whose draws (Kind.draws: random features, projections, rotations), as BigBird's
    blocks, are drawn at init from torch's seed and saved with the weights."""

    def __init__(self, config, cross=False, kind="softmax", bigbird=False):
        super().__init__()
        self.config, self.cross, self.kind = config, cross, kind
        c, hs, shared_qk = config, config.head_size, ATTENTIONS[kind].shared_qk
        q_size, kv_size = config.n_head * hs, config.n_kv_head * hs
        if cross:  # queries from x, keys and values from the encoder's output
            self.c_q = nn.Linear(config.n_embd, q_size, bias=config.bias)
            self.c_kv = nn.Linear(config.n_embd, 2 * kv_size, bias=config.bias)
        else:  # all three from x: one product, not two (GPT-2's c_attn, gpt-fast's wqkv); shared QK: no keys
            self.c_attn = nn.Linear(config.n_embd, q_size + (1 if shared_qk else 2) * kv_size, bias=config.bias)
        self.c_proj = nn.Linear(q_size, config.n_embd, bias=config.bias)
        for name, t in (ATTENTIONS[kind].draws(c) | scores.score_weights(c)).items():  # its kind's draws, its score's
            # weights, then BigBird's: saved with the weights
            register = self.register_parameter if isinstance(t, nn.Parameter) else self.register_buffer
            register(name, t)
        free = efficient.free_blocks(c.block_size, c.sparse_block, c.window, c.n_global) if bigbird else None
        # BigBird's, in an encoder: (nh, blocks, n_random) the key blocks each block of queries sees
        self.register_buffer("random_blocks", None if free is None else efficient.random_blocks(free, c.n_random,
                                                                                                 c.n_head))
        self.resid_dropout = nn.Dropout(config.dropout)
        # what the layer keeps while generating (Transformer.setup_kv_cache): self-attention what its
        # kind keeps (empty_cache), cross-attention the encoder's keys and values (k, v)
        self.cache = None

    def empty_cache(self, batch_size, size, dtype):
        """What this self-attention keeps while generating (ATTENTIONS[kind].keeps), empty: a KV cache
        of `size` slots, a recurrent state (in fp32: sums of many terms), or nothing."""
        c, dev, kind = self.config, self.c_proj.weight.device, ATTENTIONS[self.kind]
        if kind.state is not None:
            return kind.state(c, batch_size, dev)
        return KVCache(batch_size, c.n_kv_head, size, c.head_size, dtype, dev) if kind.keeps == "kv" else None

    def heads(self, x):
        return x.unflatten(-1, (-1, self.config.head_size)).transpose(1, 2)  # (B, T, n * hs) -> (B, n, T, hs)

    def kv(self, memory):
        k, v = self.heads(self.c_kv(memory)).chunk(2, dim=1)  # (B, n_kv_head, S, hs)
        return self.norm(k), v

    def norm(self, t):  # QK-norm: each head's vector at unit RMS, so logits cannot grow without bound
        return F.rms_norm(t, (t.size(-1),), eps=self.config.norm_eps) if self.config.qk_norm else t

    def forward(self, x, mask=Mask(), rope=None, memory=None, mem=None):
        # mem (B, M, C): Transformer-XL's memory, the layer's (normed) input of the positions before x
        c = self.config
        if self.cross:  # keys and values of the encoder's output: computed once when generating
            q = self.norm(self.heads(self.c_q(x)))
            k, v = self.cache if self.cache is not None else self.kv(memory)
        elif ATTENTIONS[self.kind].shared_qk:  # q and v heads: the kind's function makes the keys from q
            q, v = self.heads(self.c_attn(x)).chunk(2, dim=1)
            q, k = self.norm(q), None
            q = q if rope is None else apply_rope(q, *rope)
        else:  # q, k, v heads one after another: (B, n_head + 2 * n_kv_head, T, hs), the memory's keys first
            src = x if mem is None else torch.cat((mem, x), dim=1)
            qkv = self.heads(self.c_attn(src))  # under tensor parallel (parallel.py) 1/tp of each kind of head
            n = (c.n_head + 2 * c.n_kv_head) // qkv.size(1)
            q, k, v = qkv.split((c.n_head // n, c.n_kv_head // n, c.n_kv_head // n), dim=1)
            q, k = self.norm(q[:, :, -x.size(1):]), self.norm(k)
            if rope is not None:  # the keys' angles; the queries are the last of them
                q, k = apply_rope(q, *(t[..., -x.size(1):, :] for t in rope)), apply_rope(k, *rope)
        y = self.attend(q, k, v, mask)
        y = y.transpose(1, 2).flatten(2)  # (B, nh, T, hs) -> (B, T, nh * hs): heads side by side
        return self.resid_dropout(self.c_proj(y))

    def attend(self, q, k, v, mask):
        """The output (B, nh, T, hs) of this layer's kind of attention (ATTENTIONS) under mask."""
        c, dropout = self.config, self.config.dropout if self.training else 0.0
        if ATTENTIONS[self.kind].attend is not None:  # its own function, with this layer's draws and state
            return ATTENTIONS[self.kind].attend(self, q, k, v, mask, dropout)
        if isinstance(self.cache, KVCache):
            k, v = (t[:, :, :mask.bias.size(-1)] for t in self.cache(k, v, mask.slots))  # the slots the bias has
        if self.random_blocks is not None:  # BigBird: the random blocks' keys too, unless they are padding
            see = efficient.random_mask(self.random_blocks, q.size(2), c.sparse_block)  # (nh, T, T)
            see = see if mask.valid is None else see & mask.valid[:, None, None, :]
            mask = mask._replace(bias=torch.where(see, 0.0, mask.bias))
        score = None if c.score == "scaled_dot" else lambda q, k: scores.score(self, mask.keys, q, k)
        y, att = attention(q, k, v, mask, dropout, score)
        if mask.weights is not None:  # on the math path, which computes them
            mask.weights.append(att.detach())
        return y


# ----------------------------------------------------------------------------------------------
# Feed-forward: a dense MLP, or a mixture of experts

class MLP(nn.Module):
    """Two layers with a nonlinearity between. Gated variants (Shazeer 2020) multiply act(x W) by a
    second projection x V; W and V are one matrix here, split in two."""

    def __init__(self, config):
        super().__init__()
        self.kind, self.approximate = config.mlp, config.gelu_approximate
        gated = config.mlp in ("swiglu", "geglu")
        self.c_fc = nn.Linear(config.n_embd, (1 + gated) * config.mlp_hidden, bias=config.bias)
        self.c_proj = nn.Linear(config.mlp_hidden, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        h = self.c_fc(x)
        if self.kind in ("relu", "relu2"):
            h = F.relu(h) if self.kind == "relu" else F.relu(h).square()
        elif self.kind == "gelu":
            h = F.gelu(h, approximate=self.approximate)
        else:
            h, gate = h.chunk(2, dim=-1)
            h = h * (F.silu(gate) if self.kind == "swiglu" else F.gelu(gate, approximate=self.approximate))
        return self.dropout(self.c_proj(h))


class MoE(nn.Module):
    """Mixture of experts (Shazeer 2017; Switch; Mixtral): a router sends each token to its top-k
    expert MLPs and mixes their outputs by the router's probabilities. n_expert times the MLP's
    parameters for top_k times its compute per token: capacity grows faster than cost."""

    def __init__(self, config):
        super().__init__()
        self.top_k = config.expert_top_k
        self.router = nn.Linear(config.n_embd, config.n_expert, bias=False)
        self.experts = nn.ModuleList(MLP(config) for _ in range(config.n_expert))
        self.aux_loss = None  # the load-balancing loss of the last forward pass

    def forward(self, x):
        B, T, C = x.shape
        x = x.reshape(B * T, C)
        probs = self.router(x).float().softmax(dim=-1)  # (N, E)
        weight, expert = probs.topk(self.top_k, dim=-1)  # (N, k)
        if self.top_k > 1:  # Mixtral renormalises over the chosen experts; Switch (k=1) keeps the gate
            weight = weight / weight.sum(dim=-1, keepdim=True)
        # Switch Transformer's balance loss: E * sum_e (share of tokens sent to e) * (mean prob of e).
        # It is 1 when the routing is uniform and grows as the router favours a few experts.
        E = probs.size(-1)
        share = F.one_hot(expert, E).sum(1).float().mean(0) / self.top_k
        self.aux_loss = E * (share * probs.mean(0)).sum()
        y = torch.zeros_like(x)
        for e, mlp in enumerate(self.experts):
            token, slot = torch.where(expert == e)
            y.index_add_(0, token, mlp(x[token]) * weight[token, slot, None].to(x.dtype))
        return y.view(B, T, C)


# ----------------------------------------------------------------------------------------------
# The block and the stacks

def make_norm(config):
    if config.norm == "rmsnorm":  # Zhang & Sennrich: rescale only, no centring, no bias
        return nn.RMSNorm(config.n_embd, eps=config.norm_eps)
    return nn.LayerNorm(config.n_embd, eps=config.norm_eps, bias=config.bias)


class Block(nn.Module):
    """Self-attention, cross-attention (decoder of an encoder-decoder), feed-forward: each a
    residual branch with its norm."""

    def __init__(self, config, cross=False, kind="softmax", bigbird=False):
        super().__init__()
        self.norm_first = config.norm_first
        self.ln_1 = make_norm(config)
        self.attn = Attention(config, kind=kind, bigbird=bigbird)
        self.ln_cross = make_norm(config) if cross else None
        self.cross_attn = Attention(config, cross=True) if cross else None
        self.ln_2 = make_norm(config)
        self.mlp = MoE(config) if config.n_expert else MLP(config)

    def forward(self, x, mask=Mask(), rope=None, memory=None, memory_mask=Mask(), mem=None):
        mem = self.ln_1(mem) if mem is not None and self.norm_first else mem  # normed as the input is
        x = self.residual(x, self.ln_1, lambda h: self.attn(h, mask, rope, mem=mem))
        if self.cross_attn is not None:
            x = self.residual(x, self.ln_cross, lambda h: self.cross_attn(h, memory_mask, memory=memory))
        return self.residual(x, self.ln_2, self.mlp)

    def residual(self, x, norm, f):
        # Pre-norm leaves a clean identity path from input to output, which is why deep pre-norm
        # stacks train without warmup tricks; post-norm, as first published, normalises the sum.
        return x + f(norm(x)) if self.norm_first else norm(x + f(x))


class Stack(nn.Module):
    """The encoder (bidirectional) or the decoder (causal): positions, n_layer blocks, a final norm."""

    def __init__(self, config, causal, cross=False):
        super().__init__()
        self.config, self.causal, self.cross = config, causal, cross
        kind = ATTENTIONS[config.attention]  # a kind that serves encoders only (Linformer) leaves a decoder softmax
        self.kind = config.attention if (kind.causal if causal else kind.bidirectional) else "softmax"
        if config.pos == "learned":
            self.wpe = nn.Embedding(config.block_size, config.n_embd)
        if config.pos == "relative":  # one table per stack, shared by its layers (as in T5)
            self.rel = nn.Embedding(config.rel_buckets, config.n_head)
        if config.pos == "alibi":
            self.register_buffer("slopes", torch.tensor(alibi_slopes(config.n_head)), persistent=False)
        self.drop = nn.Dropout(config.dropout)
        bigbird = bool(config.n_random) and not causal
        self.h = nn.ModuleList(Block(config, cross, self.kind, bigbird) for _ in range(config.n_layer))
        self.ln_f = make_norm(config)
        self.cache_pos = None  # (B, size) while generating: the position each cache slot holds, -1: none
        self.ends = (True, True)  # a pipeline stage (parallel.py) holds some blocks: with the stack's entry, its exit?

    def forward(self, x, pos, valid=None, memory=None, memory_valid=None, weights=None, mems=None, group=None,
                prefix=None, slots_used=None):
        # x (B, T, C): token embeddings at positions pos (B|1, T); valid (B, T): False for padding;
        # weights: a dict that each attention's weights go to, by name (see Transformer.forward);
        # mems: Transformer-XL's memory, one (B, M, C) per layer ([] at the start of a stream), or None;
        # group: context parallel, x is this rank's shard of sequences split over the group's ranks;
        # prefix (B,): a prefix LM's, the positions below it see each other both ways; slots_used (an int):
        # the cache's first slots that hold keys, the only ones read (None: every slot)
        c, (first, last) = self.config, self.ends
        if c.pos == "learned" and first:
            x = x + self.wpe(pos)
        elif c.pos == "sinusoidal" and first:  # Vaswani et al. scale the embeddings so the sines do not drown them
            x = x * math.sqrt(c.n_embd) + sinusoidal(pos, c.n_embd).to(x.dtype)
        x = x if c.norm_first else self.ln_f(x)  # post-norm ends each block with a norm; BERT normalises the input
        x = self.drop(x) if first else x
        T, M = x.size(1), mems[0].size(1) if mems else 0
        before = torch.arange(M, device=x.device).expand(pos.size(0), M)  # the memory's positions, first
        pos = pos + M
        keys = pos if valid is None else torch.where(valid, pos, -1)  # the keys' positions; padding: -1
        keys = torch.cat((before.expand(keys.size(0), M), keys), dim=1)
        own, slots = M + torch.arange(T, device=x.device), None  # the index of each query's own key
        if self.cache_pos is not None:  # generating: the keys go into the cache's ring, where the
            if T > self.cache_pos.size(1):  # queries see every slot, by the position it holds
                raise ValueError(f"{T} tokens overflow a KV cache of {self.cache_pos.size(1)} slots: use prefill")
            p, g = pos.amax(0), c.n_global  # global tokens keep the first slots: attention sinks
            slots = own = torch.where(p < g, p, g + (p - g) % (self.cache_pos.size(1) - g))
            self.cache_pos.index_copy_(1, slots, keys.expand(x.size(0), T))
            keys = self.cache_pos[:, :slots_used]
        window = c.window if slots is None else reach(c)
        name = "decoder" if self.causal else "encoder"
        record = (lambda what: weights.setdefault(f"{name} {what}", [])) if weights is not None else lambda what: None
        if group is not None and (valid is not None or prefix is not None or self.kind != "softmax" or M
                                  or c.score != "scaled_dot"):
            raise ValueError("ring attention (group) takes whole sequences of softmax attention: no padding, "
                             "prefix, memory or other kind (and no attention dropout)")
        mask = Mask(self.causal, ring=group) if group is not None else \
            self.mask(pos, keys, own, window, valid, slots, record("self-attention"), prefix)
        memory_mask = self.memory_mask(T, memory_valid, x.device, record("cross-attention (to the encoder)")) \
            if self.cross else None
        cos_sin = rope(torch.cat((before, pos), 1), c.head_size, c.rope_theta, c.rope_scaling) \
            if c.pos == "rope" else None
        kept = []  # each layer's input, the next segment's memory: no gradient flows back into it
        for i, block in enumerate(self.h):
            if mems is not None:
                kept.append((torch.cat((mems[i], x), 1) if mems else x)[:, -c.mem_len:].detach())
            x = block(x, mask, cos_sin, memory, memory_mask, mems[i] if mems else None)
        x = self.ln_f(x) if c.norm_first and last else x
        return x if mems is None else (x, kept)

    def pieces(self, window, valid=None):
        """What each query may see, in pieces: the form the kernel takes, and what attn_impl reads."""
        return Mask(self.causal, window, self.slopes if self.config.pos == "alibi" else None, valid)

    def mask(self, pos, keys, own, window, valid, slots, weights=None, prefix=None):
        """The self-attention mask of the queries at pos (B|1, Tq) over the keys at keys (B|1, Tk)
        (valid (B, Tq): False for padding; slots: where a KV cache keeps the keys) with its backend,
        chosen once here for every layer (the math path when weights are kept), and built once in
        that backend's form."""
        if self.kind != "softmax":  # its own function: causal or not, and the padding
            return Mask(self.causal, valid=valid)
        pieces = self.pieces(window, valid)
        backend = "math" if weights is not None else attn_impl(self.config, pos.device, self.training, pieces,
                                                              pos.size(1))
        if backend == "triton" and slots is None and keys.size(1) == pos.size(1) and prefix is None:  # the kernel
            # reads keys in order, the queries' own, not from a ring nor after a memory
            return pieces._replace(backend=backend)
        dense = slots is not None or valid is not None or window or keys.size(1) != pos.size(1) or prefix is not None
        bias = self.attn_bias(pos, keys, own, window, prefix) if dense or self.config.pos in ("alibi", "relative") \
            else None  # else plain causal (or nothing): SDPA's own
        return Mask(self.causal, valid=valid, bias=bias, backend="sdpa" if backend == "triton" else backend,
                    slots=slots, weights=weights, keys=keys)

    def memory_mask(self, Tq, valid, device, weights=None):
        """The same for cross-attention to the encoder's output, whose padding is valid (B, S)."""
        pieces = Mask(valid=valid)
        backend = "math" if weights is not None else attn_impl(self.config, device, self.training, pieces, Tq)
        if backend == "triton":
            return Mask(valid=valid, backend=backend)
        return Mask(bias=None if valid is None else padding_bias(valid), backend=backend, weights=weights)

    def attn_bias(self, pos, keys, own, window, prefix=None):
        """What each query at pos (B|1, Tq) may see of the keys at keys (B|1, Tk), as Mask's dense
        `bias` (B|1, nh|1, Tq, Tk). A key at -1 (padding, an empty cache slot) is seen only by its
        own query (own (Tq,): the index of each query's key), so that no row is empty. prefix (B,):
        the positions below it see each other both ways (a prefix LM; t5x's make_decoder_mask)."""
        c = self.config
        dist = pos[:, :, None] - keys[:, None, :]  # (B|1, Tq, Tk) query position - key position
        see = (keys >= 0)[:, None, :] & ((dist >= 0) if self.causal else True)
        if prefix is not None:  # (B, Tq, Tk) query and key both in the prefix
            both = ((keys >= 0) & (keys < prefix[:, None]))[:, None, :] & (pos < prefix[:, None])[:, :, None]
            see = see | both
        if window:  # global tokens are seen by every query, and in an encoder see every key (Longformer)
            glob = (keys < c.n_global)[:, None, :] | ((pos < c.n_global)[:, :, None] & (not self.causal))
            see = see & ((dist.abs() < window) | glob)
        see = see | (torch.arange(keys.size(1), device=keys.device) == own[:, None])
        bias = 0.0
        if c.pos == "alibi":
            bias = -self.slopes[:, None, None] * dist.abs()[:, None]  # (B|1, nh, Tq, Tk)
        elif c.pos == "relative":
            bucket = relative_bucket(-dist, not self.causal, c.rel_buckets, c.rel_max_distance)
            if prefix is not None:  # the prefix reads both ways, so its keys ahead need an encoder's buckets
                bucket = torch.where(both, relative_bucket(-dist, True, c.rel_buckets, c.rel_max_distance), bucket)
            bias = self.rel(bucket).permute(0, 3, 1, 2)  # (B|1, nh, Tq, Tk)
        return torch.where(see[:, None], bias, float("-inf"))


# ----------------------------------------------------------------------------------------------
# The model

class Transformer(nn.Module):
    """A decoder (GPT), an encoder (BERT) or an encoder-decoder (T5), sharing one token embedding."""

    def __init__(self, config):
        super().__init__()
        self.config, C, P = config, config.n_embd, config.patch_size
        self.wte = nn.Linear(config.channels * P * P, C) if P else nn.Embedding(config.vocab_size, C)  # ViT: patches
        self.cls = nn.Parameter(torch.zeros(1, 1, C)) if P else None  # ViT's [CLS], whose final state is classified
        self.encoder = Stack(config, causal=False) if config.arch in ("encoder", "encoder-decoder") else None
        cross = config.arch == "encoder-decoder"
        self.decoder = Stack(config, causal=True, cross=cross) if config.arch != "encoder" else None
        # BERT transforms the hidden state once more before predicting
        self.mlm_head = nn.Sequential(nn.Linear(C, C, bias=config.bias), nn.GELU(config.gelu_approximate),
                                      make_norm(config)) if config.arch == "encoder" and not P else None
        self.lm_head = nn.Linear(C, config.n_classes or config.vocab_size, bias=config.lm_head_bias or P > 0)
        if config.tie_embeddings and not P:  # one matrix reads and writes tokens (Press & Wolf 2017)
            self.lm_head.weight = self.wte.weight
        for m in self.modules():  # GPT-2's initialisation
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                # GPT-2: each residual branch adds to the stream, so its output starts smaller, by the
                # root of the number of branches: attention and MLP, and cross-attention in a T5 decoder
                branches = (3 if cross and name.startswith("decoder.") else 2) * config.n_layer
                nn.init.normal_(p, mean=0.0, std=0.0 if config.zero_init else 0.02 / math.sqrt(branches))
        if config.zero_init and not config.tie_embeddings:  # an untied head too (a tied one is the embedding)
            nn.init.zeros_(self.lm_head.weight)

    def forward(self, idx, targets=None, *, mask=None, src=None, src_mask=None, input_pos=None, weights=None,
                mems=None, return_mems=False, group=None, prefix_len=None, slots_used=None):
        """idx (B, T) token ids -> logits (B, T, vocab_size), and the loss against targets (B, T),
        where -100 marks positions without a loss. mask (B, T) is False at padding in idx. An
        encoder-decoder reads src (B, S) (padding: src_mask) and predicts idx. input_pos (T,) or
        (B, T) gives the positions of idx; generate.py passes it while the caches are set up, and
        slots_used, the cache's first slots that hold keys, which the queries then read alone (None: all).
        weights: a dict that receives every attention's weights, computed on the math path:
        {"decoder self-attention": [(B, nh, T, T) per layer], ...} (sample.py's attention page).
        With mem_len (Transformer-XL), return_mems=True also returns the memory for the next segment,
        one (B, mem_len, C) per layer, detached; mems: the one the segment before returned (None at
        the start of a stream), whose positions come before idx's. group (context parallel): idx is
        this rank's shard, at input_pos, of sequences split in order over the group's ranks. prefix_len
        (B,): a prefix LM's prefix in each row, its first positions, which see each other both ways; the
        targets before P - 1 take no loss."""
        c = self.config
        if c.patch_size:  # ViT: idx holds images, targets labels
            return self.classify(idx, targets, weights)
        B, T = idx.shape
        if input_pos is None:
            self.check_length(T)
        for wrong, problem in [(prefix_len is not None and c.arch != "prefix-lm", "prefix_len is a prefix LM's"),
                               (mems is not None and not c.mem_len, "mems need a model with mem_len"),
                               (mems is not None and mask is not None, "a memory takes no padding (mask)")]:
            if wrong:
                raise ValueError(problem)
        pos = torch.arange(T, device=idx.device) if input_pos is None else input_pos
        pos = pos.view(-1, T)  # (B|1, T)
        if c.arch == "encoder":
            x = self.mlm_head(self.encoder(self.wte(idx), pos, mask, weights=weights, group=group))
        else:
            if src is None and c.arch == "encoder-decoder" and self.decoder.h[0].cross_attn.cache is None:
                raise ValueError("an encoder-decoder needs src: model(idx, targets, src=src)")
            memory = None if src is None else self.encode(src, src_mask, weights)
            mems = (mems or []) if c.mem_len and (return_mems or mems) else None  # [] at a stream's start
            x = self.decoder(self.wte(idx), pos, mask, memory, src_mask, weights, mems, group, prefix_len, slots_used)
            x, mems = x if mems is not None else (x, None)
        logits = self.lm_head(x)  # (B, T, vocab_size)
        logits = c.logit_softcap * torch.tanh(logits / c.logit_softcap) if c.logit_softcap else logits
        loss = None
        if targets is not None:
            if prefix_len is not None:  # a prefix position before P - 1 sees its own target (the next token)
                targets = targets.masked_fill(pos < prefix_len[:, None] - 1, -100)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-100)
            if c.n_expert:
                loss = loss + c.moe_aux_weight * sum(m.aux_loss for m in self.modules() if isinstance(m, MoE))
        return (logits, loss, mems) if return_mems else (logits, loss)

    def classify(self, images, labels=None, weights=None):
        """ViT (Dosovitskiy et al. 2020): images (B, C, H, W) -> logits (B, n_classes) from [CLS]; loss: labels (B,)"""
        P, S, C = self.config.patch_size, self.config.image_size, self.config.channels
        if images.dim() != 4 or images.shape[1:] != (C, S, S):
            raise ValueError(f"images of shape {tuple(images.shape)}, not (B, channels={C}, {S}, {S}): resize them")
        x = self.wte(F.unfold(images, P, stride=P).transpose(1, 2))  # (B, C*P*P, N) -> (B, N, n_embd)
        x = torch.cat((self.cls.expand(len(x), -1, -1), x), 1)  # [CLS] first: (B, 1 + N, n_embd)
        logits = self.lm_head(self.encoder(x, torch.arange(x.size(1), device=x.device)[None], weights=weights)[:, 0])
        return logits, None if labels is None else F.cross_entropy(logits, labels)

    def encode(self, src, src_mask=None, weights=None):
        """The encoder's output (B, S, C) for src (B, S): the memory the decoder attends to."""
        self.check_length(src.size(1))
        pos = torch.arange(src.size(1), device=src.device)[None]
        return self.encoder(self.wte(src), pos, src_mask, weights=weights)

    def check_length(self, T):
        c = self.config  # a table as long as block_size: learned positions, Linformer's projections, BigBird's blocks
        if (c.pos == "learned" or ATTENTIONS[c.attention].fixed_length or c.n_random or c.score == "location") \
                and T > c.block_size:
            raise ValueError(f"sequence of {T} tokens is longer than block_size={c.block_size}, the end of the learned "
                             "position table (or Linformer's projections, BigBird's blocks, location scores): crop it")

    def optimizer_groups(self, weight_decay):
        """AdamW's two parameter groups: matrices (weights of Linear and Embedding) decay; biases and
        norm gains do not (decay would pull a gain toward 0, not toward its neutral 1)."""
        params = [p for p in self.parameters() if p.requires_grad]
        return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
                {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]

    def flops_per_token(self, T):
        """Training FLOPs per token at context T (PaLM appendix B): 6 per weight, plus attention's
        12 * layers * heads * head_size * T, per stack. Position tables count no weight FLOPs."""
        c = self.config
        skip = ("wpe", "wte", "lm_head")  # lookups cost nothing; the output layer is added once below
        n = sum(p.numel() * (c.expert_top_k / c.n_expert if ".experts." in name else 1)  # a token uses k experts
                for name, p in self.named_parameters() if not any(s in name.split(".") for s in skip))
        n += c.vocab_size * c.n_embd  # the output layer, whether it shares the embedding's matrix or not
        return 6 * n + (1 + (c.arch == "encoder-decoder")) * 12 * c.n_layer * c.n_head * c.head_size * T

    @torch.no_grad()
    def redraw_features(self, step, seed):
        """A kind that redraws (Performer's features): after optimizer step `step`, every feature_redraw
        steps, each layer draws anew, from (seed, step), so that a resumed run draws what it would have
        drawn. Evaluation and sampling never call it: they use the draws trained with, saved with them."""
        n = self.config.feature_redraw
        if not n or step % n:
            return
        generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
        for m in self.modules():
            if isinstance(m, Attention) and ATTENTIONS[m.kind].redraws:
                for name, t in ATTENTIONS[m.kind].draws(self.config, generator).items():
                    getattr(m, name).copy_(t)

    # ------------------------------------------------------------------------------------------
    # The caches that generation reads and writes (generate.py drives them)

    def setup_kv_cache(self, batch_size, size, memory=None, dtype=None):
        """Give every decoder self-attention what its kind keeps (ATTENTIONS): an empty KV cache of
        `size` slots (n_kv_head heads each), a recurrent state, or nothing; and every cross-attention
        the keys and values of the encoder's output `memory`, computed once."""
        dev, dtype = self.wte.weight.device, dtype or self.wte.weight.dtype
        kv = ATTENTIONS[self.decoder.kind].keeps == "kv"
        for block in self.decoder.h:
            block.attn.cache = block.attn.empty_cache(batch_size, size, dtype)
            if memory is not None:
                block.cross_attn.cache = block.cross_attn.kv(memory)
        self.decoder.cache_pos = torch.full((batch_size, size), -1, device=dev) if kv else None

    def clear_kv_cache(self):
        for attn in (m for m in self.decoder.modules() if isinstance(m, Attention)):
            attn.cache = None
        self.decoder.cache_pos = None

    def rollback_kv_cache(self, n):
        """Forget the newest n positions of the cache (draft tokens that the target rejected): their
        slots are marked empty, and the next tokens, at the same positions, overwrite them."""
        pos = self.decoder.cache_pos
        if pos is None:
            raise ValueError(f"{self.config.attention} attention's state cannot forget tokens: no speculative "
                             "decoding with it")
        pos.masked_fill_(pos > pos.amax(dim=1, keepdim=True) - n, -1)
