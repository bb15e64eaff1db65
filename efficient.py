"""
Attention other than exact softmax over every key, one function per method, each on (B, heads, T,
hs) tensors and callable alone, with its paper's formula; model.py chooses and calls them (its
ATTENTIONS table), as it calls kernels.py.

  linear_attention     phi(q) phi(k)ᵀ with phi = elu + 1, O(T)        (Katharopoulos et al. 2020)
  performer_attention  random features estimate exp(q·k), O(T m)     (Choromanski et al. 2021, FAVOR+)
  linformer_attention  keys and values projected to k rows, O(T k)    (Wang et al. 2020)
  lsh_attention        shared-QK attention within LSH buckets, O(T b)  (Kitaev et al. 2020, Reformer)
  random_blocks        BigBird's random key blocks beside a window     (Zaheer et al. 2020)

A kind that draws anything at init (random features, projections, rotations) has a *_draws(config,
generator) here that draws them, named as model.py's Attention holds them (and checkpoints keep them).
Exact softmax attention split across ranks (ring attention) is ring.py's.
"""

import functools
import math

import torch
import torch.nn as nn
from torch.nn.functional import elu, normalize, pad, scaled_dot_product_attention


def in_fp32(attend):
    """attend(q, ...) with autocast off: its sums, exponents and states are meant in fp32, and autocast
    would run its products in bf16 even on fp32 tensors."""
    @functools.wraps(attend)
    def wrapper(q, *args, **kwargs):
        with torch.autocast(q.device.type, enabled=False):
            return attend(q, *args, **kwargs)
    return wrapper


@in_fp32
def linear_attention(q, k, v, causal, valid=None, state=None, chunk=64):
    """Linear attention (Katharopoulos et al. 2020): exp(q·k) becomes phi(q)·phi(k), phi = elu + 1 > 0,
    so the sum over keys regroups: y_i = phi(q_i) S / phi(q_i)·z with S = Σ_j phi(k_j) v_jᵀ (hs x hs)
    and z = Σ_j phi(k_j) over the keys j that query i sees. Bidirectional: one S and z for all.
    Causal, in chunks of `chunk` positions: within a chunk the masked products, as softmax attention
    takes them; from the chunks before, their summed states. Memory is O(T), never T x T. q (B, nh,
    T, hs), k, v (B, n_kv_head, T, hs); valid (B, T): False for padding keys, which add nothing.
    state (a LinearState, generating): the sums of the tokens before, which the keys continue; this
    call adds its keys' sums to it in place, so the next call continues after these tokens."""
    dtype = q.dtype
    q = (elu(q.float()) + 1).unflatten(1, (k.size(1), -1))  # (B, nkv, g, T, hs): g heads share a key head
    k, v = (elu(k.float()) + 1)[:, :, None], v.float()[:, :, None]  # (B, nkv, 1, T, hs)
    if valid is not None:
        k, v = (torch.where(valid[:, None, None, :, None], t, 0) for t in (k, v))
    if not causal:
        y = (q @ (k.mT @ v)) / (q @ k.sum(-2)[..., None] + 1e-6)
        return y.flatten(1, 2).to(dtype)
    T = q.size(-2)
    C = min(chunk, T)
    q, k, v = (pad(t, (0, 0, 0, -T % C)).unflatten(3, (-1, C)) for t in (q, k, v))  # (..., n, C, hs)
    kv, kz = k.mT @ v, k.sum(-2)  # each chunk's sums: (B, nkv, 1, n, hs, hs) and (B, nkv, 1, n, hs)
    S0, z0 = (0, 0) if state is None else (state.S[:, :, None, None], state.z[:, :, None, None])
    S, z = S0 + kv.cumsum(3) - kv, z0 + kz.cumsum(3) - kz  # the sums of the chunks before each
    att = (q @ k.mT).tril()  # (B, nkv, g, n, C, C): within a chunk, each query up to itself
    y = (att @ v + q @ S) / (att.sum(-1, keepdim=True) + q @ z[..., None] + 1e-6)
    if state is not None:
        state.S += kv.sum(3)[:, :, 0]
        state.z += kz.sum(3)[:, :, 0]
    return y.flatten(3, 4)[..., :T, :].flatten(1, 2).to(dtype)  # (B, nh, T, hs)


class LinearState(nn.Module):
    """Linear attention's memory while generating, in place of a KV cache: S = Σ phi(k) vᵀ (B,
    n_kv_head, hs, hs) and z = Σ phi(k) (B, n_kv_head, hs) over the tokens so far, in fp32 (sums of
    many terms). Its size stays the same however long the sequence grows."""

    def __init__(self, batch_size, n_kv_head, head_size, device):
        super().__init__()
        shape = (batch_size, n_kv_head, head_size)
        self.register_buffer("S", torch.zeros(*shape, head_size, device=device), persistent=False)
        self.register_buffer("z", torch.zeros(shape, device=device), persistent=False)


# ----------------------------------------------------------------------------------------------
# Performer (FAVOR+)

# the running max starts here, not at -inf: M - M must be 0 (1 after exp), where -inf - -inf is nan
LOWEST = torch.finfo(torch.float32).min


def random_features(m, hs, generator=None):
    """FAVOR+'s projection W (m, hs): rows w_r = s_r u_r (Choromanski et al. 2021, orthogonal random features): u_r the
    rows of ceil(m / hs) independent, uniformly random hs x hs orthogonal matrices stacked (the first m kept)
    and s_r ~ chi(hs), the norm of an hs-dim standard gaussian, drawn apart, so each w_r ~ N(0, I_hs) alone
    and E[φ(q)·φ(k)] = exp(q·k/√hs) stays exact, while orthogonal rows lower its variance. Uniform needs
    care: Q from a plain QR has its signs tied to R's diagonal, which biases the rows' directions;
    orthogonal_ multiplies Q's columns by sign(diag(R)) (Mezzadri 2007). Returns (m, hs) float32."""
    blocks = [nn.init.orthogonal_(torch.empty(hs, hs), generator=generator) for _ in range(-(-m // hs))]
    directions = torch.cat(blocks)[:m]  # (m, hs): unit rows, orthogonal within each block of hs
    norms = torch.randn(m, hs, generator=generator).norm(dim=1, keepdim=True)  # (m, 1) ~ chi(hs)
    return directions * norms


def performer_draws(config, generator=None):
    """A Performer layer's draws: its features `proj` (n_features, head_size), a buffer (not learned),
    which feature_redraw draws again while training."""
    return {"proj": random_features(config.n_features, config.head_size, generator)}


def feature_exponents(x, proj):
    """log φ(x) for FAVOR+'s positive random features (Choromanski et al. 2021, Lemma 1):
    φ(x)_r = exp(w_r·x̂ - ‖x̂‖²/2) / √m with x̂ = x hs^-¼, so E_w[φ(q)·φ(k)] = exp(q̂·k̂) = exp(q·k/√hs),
    softmax's unnormalised weight, and every feature is positive (no cancellation, unlike sin/cos ones).
    Kept as exponents so the caller subtracts a max before exp(): they are at most ‖w_r‖²/2 but fall
    without bound as ‖x‖ grows, and would underflow. x (..., hs), proj (m, hs) -> (..., m) in fp32."""
    x = x.float() * x.size(-1) ** -0.25
    return x @ proj.mT - x.square().sum(-1, keepdim=True) / 2 - math.log(proj.size(0)) / 2


def divide_or_zero(num, den):
    """y_i = Σ_j a_ij v_j / Σ_j a_ij. The sum is 0 only when every weight is (no valid key yet, or all
    underflowed): then so is the numerator, and 0 / 1 gives 0 and a finite gradient, where 0 / 0 gives nan."""
    return num / torch.where(den > 0, den, 1)


@in_fp32
def performer_attention(q, k, v, proj, causal, valid=None, state=None, chunk=64):
    """Performer attention (Choromanski et al. 2021, FAVOR+): softmax attention's weights
    exp(q_i·k_j/√hs) replaced by their unbiased estimate φ(q_i)·φ(k_j) (see feature_exponents), so
    y_i = φ(q_i) S / φ(q_i)·z with S = Σ_j φ(k_j) v_jᵀ (m x hs) and z = Σ_j φ(k_j) over the keys j that
    query i sees. Bidirectional: one S and z for all. Causal: in chunks, as linear_attention, see
    causal_performer. Each query's features and the keys' are scaled by a constant of their own before
    exp(), which cancels between numerator and denominator, so nothing overflows or underflows needlessly.
    q (B, nh, T, hs); k, v (B, n_kv_head, T, hs), each key head shared by nh / n_kv_head query heads;
    proj (m, hs) from random_features; valid (B, T): False for padding keys, which get no weight whatever
    they hold. state (a PerformerState, causal only): the sums of the tokens before, which these continue
    and then join, in place (see causal_performer). Computed in fp32; returns (B, nh, T, hs) in q's dtype."""
    dtype = q.dtype
    if valid is not None:  # zeroed first, so a nan at the padding reaches neither the sums nor the gradients
        k, v = (torch.where(valid[:, None, :, None], t, 0) for t in (k, v))
    eq, ek, v = feature_exponents(q, proj), feature_exponents(k, proj), v.float()  # (B, nh|nkv, T, m)
    if valid is not None:  # exp(-inf) = 0: no weight, and no say in the keys' max
        ek = ek.masked_fill(~valid[:, None, :, None], float("-inf"))
    # the query's own max over features is a per-query factor, which cancels: its largest feature becomes 1
    fq = (eq - eq.amax(-1, keepdim=True).detach()).exp().unflatten(1, (k.size(1), -1))  # (B, nkv, g, T, m)
    if causal:
        y = causal_performer(fq, ek, v, state, chunk)
    else:  # every query sees every key, so their common max is a common factor and cancels too
        top = ek.amax((-2, -1), keepdim=True).clamp_min(LOWEST).detach()  # (B, nkv, 1, 1); LOWEST if all padding
        fk, v = (ek - top).exp()[:, :, None], v[:, :, None]  # (B, nkv, 1, T, m), (B, nkv, 1, T, hs)
        y = divide_or_zero(fq @ (fk.mT @ v), fq @ fk.sum(-2)[..., None])  # (B, nkv, g, T, hs)
    return y.flatten(1, 2).to(dtype)  # (B, nh, T, hs)


def causal_performer(fq, ek, v, state=None, chunk=64):
    """Causal FAVOR+ (Choromanski et al. 2021, unidirectional by prefix sums), in chunks of C positions:
    y_i = Σ_{j<=i} (φ(q_i)·φ(k_j)) v_j / Σ_{j<=i} φ(q_i)·φ(k_j), within a chunk by the masked C x C products,
    from the chunks before by their summed state. Stabilised without looking ahead: M_j = max over keys
    j' <= j and features r of log φ(k_j')_r, a running max; query i scales all its keys by exp(-M_i), a
    common factor that cancels, and exp(log φ(k_j) - M_i) <= 1 for j <= i (a max over the whole sequence
    would let a later key change, by underflow, what an earlier query sees). The state carried between
    chunks is kept at the scale of the running max at its chunk's end and multiplied by exp(M_old - M_new)
    <= 1 as the max grows (online softmax's rescaling). fq (B, nkv, g, T, m): query features, each at its
    own scale; ek (B, nkv, T, m): key exponents, -inf for padding; v (B, nkv, T, hs) -> (B, nkv, g, T, hs).
    state (a PerformerState, generating): S, z and M of the tokens before, which this call overwrites in place
    with those after its own tokens, so the next call continues from them."""
    B, nkv, T, m = ek.shape
    C = min(chunk, T)
    M0 = ek.new_full((B, nkv), LOWEST) if state is None else state.M  # the max of the keys before
    # no gradient through the stabiliser: it cancels, so the output does not depend on it
    M = torch.maximum(ek.amax(-1).cummax(-1).values, M0[..., None]).detach()  # (B, nkv, T): M_j
    n_pad = -T % C  # T padded to n chunks of C; the padding keys weigh nothing, their queries are cut off
    fq = pad(fq, (0, 0, 0, n_pad)).unflatten(3, (-1, C))  # (B, nkv, g, n, C, m)
    ek = pad(ek, (0, 0, 0, n_pad), value=float("-inf")).unflatten(2, (-1, C))  # (B, nkv, n, C, m)
    v = pad(v, (0, 0, 0, n_pad)).unflatten(2, (-1, C))  # (B, nkv, n, C, hs)
    M = torch.cat([M, M[..., -1:].expand(B, nkv, n_pad)], -1).unflatten(2, (-1, C))  # (B, nkv, n, C)
    fk = (ek - M[..., None]).exp()  # (B, nkv, n, C, m): each <= 1, as M_j bounds key j's exponents
    # key j at query i's scale: exp(M_j - M_i) <= 1 for j <= i; j > i masked before exp(), where it could overflow
    later = torch.ones(C, C, dtype=torch.bool, device=ek.device).triu(1)
    rescale = (M[..., None, :] - M[..., :, None]).masked_fill(later, float("-inf")).exp()  # (B, nkv, n, C, C)
    att = (fq @ fk[:, :, None].mT) * rescale[:, :, None]  # (B, nkv, g, n, C, C): φ(q_i)·φ(k_j) e^-M_i
    num, den = att @ v[:, :, None], att.sum(-1, keepdim=True)  # (B, nkv, g, n, C, hs), (..., C, 1)
    # each chunk's own sums, at the scale of the running max at its end
    M_end = M[..., -1]  # (B, nkv, n)
    w = fk * (M - M_end[..., None]).exp()[..., None]  # (B, nkv, n, C, m): φ(k_j) e^-M_end
    kv, kz = w.mT @ v, w.sum(-2)  # (B, nkv, n, m, hs), (B, nkv, n, m)
    # the state before each chunk: recurrent over chunks (its scale changes as the max grows), parallel within
    S = ek.new_zeros(B, nkv, m, v.size(-1)) if state is None else state.S  # (B, nkv, m, hs)
    z = ek.new_zeros(B, nkv, m) if state is None else state.z  # (B, nkv, m)
    M_old, before = M0, []
    for c in range(M.size(2)):
        before.append((S, z, M_old))
        decay = (M_old - M_end[:, :, c]).exp()  # (B, nkv), <= 1: the max only grows
        S, z, M_old = S * decay[..., None, None] + kv[:, :, c], z * decay[..., None] + kz[:, :, c], M_end[:, :, c]
    # stacked (so copied) before the state, which the first chunk's entry may be, is overwritten
    S_before, z_before, M_before = (torch.stack(t, 2) for t in zip(*before))  # (B, nkv, n, m, hs|), (B, nkv, n)
    if state is not None:
        state.S.copy_(S)
        state.z.copy_(z)
        state.M.copy_(M_old)
    scale = (M_before[..., None] - M).exp()[:, :, None, ..., None]  # (B, nkv, 1, n, C, 1): e^(M_before - M_i) <= 1
    num = num + (fq @ S_before[:, :, None]) * scale
    den = den + (fq @ z_before[:, :, None, ..., None]) * scale
    return divide_or_zero(num, den).flatten(3, 4)[..., :T, :]  # (B, nkv, g, T, hs)


class PerformerState(nn.Module):
    """Performer attention's memory while generating, in place of a KV cache: S = Σ φ(k) vᵀ (B, n_kv_head,
    m, hs) and z = Σ φ(k) (B, n_kv_head, m) over the tokens so far, both multiplied by exp(-M), with M
    (B, n_kv_head) the largest feature exponent of those keys (the running max of causal_performer), so
    the sums neither overflow nor underflow. fp32: sums of many terms. Its size stays the same however
    long the sequence grows."""

    def __init__(self, batch_size, n_kv_head, n_features, head_size, device):
        super().__init__()
        shape = (batch_size, n_kv_head)
        self.register_buffer("S", torch.zeros(*shape, n_features, head_size, device=device), persistent=False)
        self.register_buffer("z", torch.zeros(*shape, n_features, device=device), persistent=False)
        self.register_buffer("M", torch.full(shape, LOWEST, device=device), persistent=False)


# ----------------------------------------------------------------------------------------------
# Linformer

def linformer_attention(q, k, v, E, F, valid=None, dropout=0.0):
    """Linformer (Wang et al. 2020): the keys and values are projected along the sequence to k rows,
    K' = E K and V' = F V with E, F (k, block_size) cut to the T positions there are, then
    softmax(q K'ᵀ / sqrt(hs)) V': O(T k) time and memory, never T x T. Every projected key mixes
    all positions, later ones too, so it serves encoders only. q (B, nh, T, hs), k, v (B, n_kv_head,
    T, hs); valid (B, T): False for padding keys, set to zero before the projection, so padding
    changes no real token's output."""
    T = k.size(2)
    if valid is not None:
        k, v = (t.masked_fill(~valid[:, None, :, None], 0.0) for t in (k, v))
    k, v = E[:, :T].to(k.dtype) @ k, F[:, :T].to(v.dtype) @ v  # (B, n_kv_head, k, hs)
    return scaled_dot_product_attention(q, k, v, dropout_p=dropout, enable_gqa=True)


def linformer_draws(config, generator=None):
    """A Linformer layer's projections E and F, `proj_k` and `proj_v` (proj_len, block_size), learned:
    at first a random average of the positions, so that K' = E K keeps the scale of K."""
    c = config
    return {name: nn.Parameter(torch.randn(c.proj_len, c.block_size, generator=generator) * c.block_size ** -0.5)
            for name in ("proj_k", "proj_v")}


# ----------------------------------------------------------------------------------------------
# Reformer's LSH attention

def lsh_rotations(n_hashes, hs, n_buckets, generator=None):
    """Angular LSH's random rotations (Kitaev et al. 2020, after Andoni et al. 2015): one R of shape
    (hs, n_buckets / 2) per hashing round, entries drawn from N(0, 1), so that h(x) = argmax([xR; −xR])
    picks one of n_buckets. -> (n_hashes, hs, n_buckets // 2) float32."""
    return torch.randn(n_hashes, hs, n_buckets // 2, generator=generator)


def lsh_draws(config, generator=None):
    """An LSH layer's `rotations`, a buffer: one per round, into block_size // bucket_size buckets."""
    c = config
    return {"rotations": lsh_rotations(c.n_hashes, c.head_size, c.block_size // c.bucket_size, generator)}


def lsh_buckets(q, rotations):
    """Each token's bucket in each round, h(x) = argmax([xR; −xR]), from its own query only: q (B, nh,
    T, hs) -> (B, nh, n_hashes, T). A query and its unit vector (the shared key) hash alike."""
    xR = torch.einsum("bntd,hdr->bnhtr", q.float(), rotations.float())  # (B, nh, n_hashes, T, n_buckets / 2)
    return torch.cat([xR, -xR], dim=-1).argmax(dim=-1)


def lsh_windows(x, bucket_size, causal, value=0.0):
    """The sorted places each chunk of bucket_size places may look at, as a view: x (..., n·bs, d) ->
    (..., n, d, W): chunk c's window is chunks c-2 .. c+2 (W = 5 bs), or c-2 .. c when causal (W = 3 bs),
    so that it holds every place within 2 bs of any of its queries. Places past either end hold `value`."""
    before, after = 2 * bucket_size, 0 if causal else 2 * bucket_size
    x = pad(x, (0, 0, before, after), value=value)
    return x.unfold(-2, before + bucket_size + after, bucket_size)


@in_fp32
def lsh_attention(q, v, rotations, bucket_size, causal, valid=None):
    """LSH attention (Kitaev et al. 2020) with shared QK: the keys are the queries' unit vectors,
    k_j = q_j / ‖q_j‖, and s_ij = q_i·k_j / sqrt(hs). In round r, h_r(x) = argmax([xR_r; −xR_r]), the
    positions are sorted by (h_r, position), and query i sees P_r(i): the 2·bucket_size keys of its own
    bucket nearest to it in the sorted order (causal: the 2·bucket_size before it, which are earlier
    tokens, the sort being by position within a bucket), and itself only when P_r(i) is empty. Per round
        o_r(i) = Σ_{j ∈ P_r(i)} exp(s_ij − z_r(i)) v_j,   z_r(i) = log Σ_{j ∈ P_r(i)} exp(s_ij),
    and the rounds combine by their log-sum-exp: o(i) = Σ_r exp(z_r(i) − log Σ_r' exp z_r'(i)) o_r(i).
    O(T·bucket_size) per round, never T x T. Causal is strict: no token after i, nor its hash, reaches
    i. q, v (B, nh, T, hs) (no grouped-query form: the keys are q); rotations (n_hashes, hs, n_buckets
    / 2); valid (B, T): False for padding, which sorts last in a bucket of its own and gets no weight."""
    B, nh, T, hs = q.size()
    H, bs, dtype = rotations.size(0), bucket_size, q.dtype
    q, v = q.float(), v.float()  # scores, softmax and the rounds' merge in fp32
    if valid is not None:  # zeros at padding: nan there would reach real tokens even as 0 · nan
        q, v = (torch.where(valid[:, None, :, None], t, 0) for t in (q, v))
    bucket = lsh_buckets(q, rotations)  # (B, nh, H, T)
    if valid is not None:
        bucket = torch.where(valid[:, None, None], bucket, 2 * rotations.size(-1))
    perm = (bucket * T + torch.arange(T, device=q.device)).argsort(dim=-1)  # sort by (bucket, position)
    sb = bucket.gather(3, perm)  # the sorted places' buckets, ascending
    place = torch.arange(T, device=q.device)
    # a bidirectional query's 2 bs nearest: the band [lo, lo + 2 bs] around it, shifted inside its bucket's run
    run = torch.searchsorted(sb, sb), torch.searchsorted(sb, sb, right=True)  # each place's run [start, end)
    lo = torch.minimum((place - bs).clamp(min=run[0]), (run[1] - 1 - 2 * bs).clamp(min=run[0])) - place
    n = -(-T // bs)  # chunks of bs sorted places; the places past the end are in bucket -1
    idx = perm[..., None].expand(-1, -1, -1, -1, hs)
    qs, vs = (pad(t[:, :, None].expand(-1, -1, H, -1, -1).gather(3, idx), (0, 0, 0, n * bs - T)) for t in (q, v))
    sb, lo = pad(sb, (0, n * bs - T), value=-1), pad(lo, (0, n * bs - T))  # (B, nh, H, n·bs)
    kw, vw = lsh_windows(normalize(qs, dim=-1), bs, causal), lsh_windows(vs, bs, causal)  # (..., n, hs, W)
    bw = lsh_windows(sb[..., None], bs, causal, value=-1).squeeze(-2)  # (..., n, W)
    att = qs.unflatten(3, (n, bs)) @ kw * hs ** -0.5  # (B, nh, H, n, bs, W)
    d = torch.arange(kw.size(-1), device=q.device) - 2 * bs - torch.arange(bs, device=q.device)[:, None]  # key - query
    lo = lo.unflatten(3, (n, bs))[..., None]
    band = (d >= -2 * bs) & (d < 0) if causal else (d >= lo) & (d <= lo + 2 * bs) & (d != 0)
    others = band & (sb.unflatten(3, (n, bs))[..., None] == bw[..., None, :])
    see = others | ((d == 0) & ~others.any(dim=-1, keepdim=True))  # itself only when it sees no other key
    att = att.masked_fill(~see, float("-inf"))
    lse = att.logsumexp(dim=-1)  # (B, nh, H, n, bs): finite, every query sees at least itself
    y = torch.exp(att - lse[..., None]) @ vw.mT  # (B, nh, H, n, bs, hs)
    y = torch.empty_like(y.flatten(3, 4)[..., :T, :]).scatter_(3, idx, y.flatten(3, 4)[..., :T, :])  # unsorted
    lse = torch.empty_like(lse.flatten(3, 4)[..., :T]).scatter_(3, perm, lse.flatten(3, 4)[..., :T])
    return (lse.softmax(dim=2)[..., None] * y).sum(dim=2).to(dtype)  # (B, nh, T, hs)


# ----------------------------------------------------------------------------------------------
# BigBird

def free_blocks(block_size, block, window, n_global):
    """BigBird's candidates: (n, n) bool, for each block of `block` queries the blocks of keys that
    none of its queries sees through its window (keys fewer than `window` positions away) or as
    global tokens (the first n_global), n = block_size // block."""
    start = torch.arange(block_size // block) * block  # each block's first position
    # key block kb is near query block qb when some key of kb lies within the window of some query of qb
    q, k = start[:, None], start[None, :]  # (n, 1) query blocks, (1, n) key blocks
    near = (k < q + block + window - 1) & (k + block > q - window + 1)
    return ~(near | (start < n_global)[None, :])


def random_blocks(free, n_random, n_head, generator=None):
    """BigBird's random attention (Zaheer et al. 2020): for each head and each block of queries,
    n_random blocks of keys drawn without replacement among its free ones (free_blocks), so that
    none repeats a key the block already sees. -> (n_head, n, n_random) key-block indices."""
    draw = torch.rand(n_head, *free.shape, generator=generator).masked_fill(~free, -1.0)  # the drawn: the largest
    return draw.topk(n_random, dim=-1).indices.sort(dim=-1).values


def random_mask(blocks, T, block):
    """The keys each query sees through its random blocks: blocks (nh, n, r) -> (nh, T, T) bool."""
    n = blocks.size(1)
    see = torch.zeros(blocks.size(0), n, n, dtype=torch.bool, device=blocks.device)
    see.scatter_(2, blocks, True)  # (nh, query block, key block)
    return see.repeat_interleave(block, 1).repeat_interleave(block, 2)[:, :T, :T]
