"""
Ring attention (Liu et al. 2023): exact softmax attention over a sequence split across the ranks of a
process group, each rank holding one contiguous shard of T_shard positions (rank r: positions
[r T_shard, (r+1) T_shard)), never the whole. The key/value shards travel round the ring, one hop a
step; each rank attends its queries to the block it holds and merges the partial results by their
log-sum-exp, so after world steps every query has seen every key, and no rank ever holds more than
two key/value shards. The backward pass sends the key/value gradients round the ring with the blocks.

Exact attention, so not efficient.py's: model.py calls ring_attention when a sequence is split over a
context-parallel group (the mesh's cp ranks, parallel.py; train.py's --context_parallel).
"""

import torch
import torch.distributed as dist
from torch.nn.functional import logsigmoid


def merge_attention(out, lse, block_out, block_lse):
    """Two partial attentions of the same queries over disjoint sets of keys, merged into the attention
    over their union. With lse = log Σ_j exp(s_ij) over the first set and out its softmax-weighted
    values (block_* the second set's), the union's weights renormalise each part by its share:
        lse' = log(e^lse + e^block_lse) = lse - logsigmoid(lse - block_lse)
        out' = (e^lse out + e^block_lse block_out) / e^lse' = out - sigmoid(block_lse - lse) (out - block_out)
    written so that no exp() of an lse is ever taken (it overflows fp32 past 88). out, block_out
    (..., T, hs) and lse, block_lse (..., T) in fp32; out None for the first block, taken as is (its lse
    would start at -inf, and -inf - -inf is nan). A query may not see any key of a block, but each must
    see some key of the first one (the ring starts at the rank's own block, which holds the query's own
    key). Returns (out', lse')."""
    if out is None:
        return block_out, block_lse
    out = out - torch.sigmoid(block_lse - lse)[..., None] * (out - block_out)
    lse = lse - logsigmoid(lse - block_lse)
    return out, lse


def block_scores(q, k, diagonal, scale):
    """s = q kᵀ / sqrt(hs) for the queries of one shard against the keys of one block: q (B, nkv, g, T,
    hs), k (B, nkv, 1, T, hs) (the g query heads of a group share a key head, broadcast) -> (B, nkv, g,
    T, T). diagonal: the rank's own block under causal attention, where query i sees keys j <= i only
    (every other block is seen whole or skipped whole, as it lies wholly before or after the shard)."""
    s = (q @ k.mT) * scale
    if diagonal:
        later = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(later, float("-inf"))
    return s


def block_attention(q, k, v, diagonal, scale):
    """One block's partial attention, in fp32: lse_i = log Σ_j exp(s_ij) (B, nkv, g, T) and out_i =
    Σ_j exp(s_ij - lse_i) v_j (B, nkv, g, T, hs), for merge_attention. q (B, nkv, g, T, hs), k, v
    (B, nkv, 1, T, hs)."""
    s = block_scores(q, k, diagonal, scale)
    lse = s.logsumexp(-1)
    return (s - lse[..., None]).exp() @ v, lse


def block_grads(q, k, v, dout, delta, lse, diagonal, scale):
    """One block's share of the gradients, flash-attention style: the probabilities are recomputed from
    the scores and the final lse (P_ij = exp(s_ij - lse_i), the weights of the whole attention, not of
    this block alone), then dV = Pᵀ dO, dP = dO Vᵀ, dS = P (dP - delta) with delta_i = Σ_d dO_id O_id
    (= Σ_j P_ij dP_ij, softmax's Jacobian), dQ = dS K / sqrt(hs), dK = dSᵀ Q / sqrt(hs). The g query
    heads sharing a key head add their dK and dV. q, dout (B, nkv, g, T, hs), k, v (B, nkv, 1, T, hs),
    delta (B, nkv, g, T, 1), lse (B, nkv, g, T), all fp32 -> dq (B, nkv, g, T, hs), dk, dv (B, nkv, T, hs)."""
    p = (block_scores(q, k, diagonal, scale) - lse[..., None]).exp()  # (B, nkv, g, T, T); 0 where masked
    dv = (p.mT @ dout).sum(2)
    ds = p * (dout @ v.mT - delta)
    return ds @ k * scale, (ds.mT @ q).sum(2) * scale, dv


def ring_pass(x, group, tag):
    """Start sending x to the next rank of group and receiving the previous rank's into a new tensor of
    x's shape. Returns (buffer, requests): the buffer may be read, and x written, once every request is
    waited on. P2POp wants global ranks, so the group's neighbours are translated. Alone in its group, a
    rank is its own neighbour: x comes back as it is. tag keeps the key/value blocks and the gradients,
    both in flight at once in the backward pass, apart (gloo matches messages by peer and tag)."""
    world = dist.get_world_size(group)
    if world == 1:
        return x, []
    rank = dist.get_rank(group)
    nxt = dist.get_global_rank(group, (rank + 1) % world)
    prev = dist.get_global_rank(group, (rank - 1) % world)
    buf = torch.empty_like(x)
    ops = [dist.P2POp(dist.isend, x, nxt, group, tag), dist.P2POp(dist.irecv, buf, prev, group, tag)]
    return buf, dist.batch_isend_irecv(ops)


def wait(requests):
    for req in requests:
        req.wait()


def visible(causal, source, rank):
    """Whether queries of `rank` see any key of the shard from `source`: all of them if it lies before
    (or without causal masking), some if it is the rank's own (the diagonal block), none if after."""
    return not causal or source <= rank


def ring_forward(q, k, v, causal, group):
    """The forward round: q (B, nh, T, hs), k, v (B, nkv, T, hs), this rank's shards. At step s the rank
    holds the key/value shard of rank r - s (mod world); the next one is already on its way while this
    one is attended to. -> out (B, nkv, g, T, hs), lse (B, nkv, g, T), in fp32."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    scale = q.size(-1) ** -0.5
    q = q.float().unflatten(1, (k.size(1), -1))  # (B, nkv, g, T, hs): g query heads share a key head
    kv = torch.stack([k, v])  # (2, B, nkv, T, hs): one message a step, in the inputs' dtype
    out = lse = None
    for step in range(world):
        if step + 1 < world:  # the last block need not travel on
            kv_next, requests = ring_pass(kv, group, tag=0)
        source = (rank - step) % world
        if visible(causal, source, rank):  # step 0 is the rank's own block: merge starts from it
            k_blk, v_blk = kv.float()[:, :, :, None]  # (B, nkv, 1, T, hs) each
            out, lse = merge_attention(out, lse, *block_attention(q, k_blk, v_blk, causal and source == rank, scale))
        if step + 1 < world:
            wait(requests)
            kv = kv_next
    return out, lse


def ring_backward(q, k, v, out, lse, dout, causal, group):
    """The backward round. The key/value shards travel as in the forward pass, and beside them, one step
    behind, the accumulators of their gradients: each rank adds its queries' share to the accumulator of
    the block it holds and passes it on, so after world steps and one last hop every accumulator is back
    at its shard's own rank, holding every rank's share. Memory stays per shard, and dK is summed over
    the ranks, not gathered. q, dout (B, nh, T, hs), k, v (B, nkv, T, hs), out (B, nkv, g, T, hs), lse
    (B, nkv, g, T) fp32 -> dq (B, nh, T, hs), dk, dv (B, nkv, T, hs) in the inputs' dtypes."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    scale = q.size(-1) ** -0.5
    qf = q.float().unflatten(1, (k.size(1), -1))  # (B, nkv, g, T, hs)
    dout = dout.float().unflatten(1, (k.size(1), -1))
    delta = (dout * out).sum(-1, keepdim=True)  # (B, nkv, g, T, 1): rowsum(dO * O)
    dq = torch.zeros_like(qf)
    kv, grads, grad_requests = torch.stack([k, v]), None, []
    for step in range(world):
        if step + 1 < world:
            kv_next, kv_requests = ring_pass(kv, group, tag=0)
        source = (rank - step) % world
        share = None
        if visible(causal, source, rank):
            k_blk, v_blk = kv.float()[:, :, :, None]  # (B, nkv, 1, T, hs) each
            dq_blk, dk_blk, dv_blk = block_grads(qf, k_blk, v_blk, dout, delta, lse, causal and source == rank, scale)
            dq += dq_blk
            share = torch.stack([dk_blk, dv_blk])  # (2, B, nkv, T, hs), fp32: a sum over ranks and heads
        if step == 0:
            acc = share  # the own block is always visible: the accumulator of the own shard starts here
        else:  # the accumulator of the block now held, from the previous rank, which held it a step ago
            wait(grad_requests)
            acc = grads if share is None else grads + share
        grads, grad_requests = ring_pass(acc, group, tag=1)
        if step + 1 < world:
            wait(kv_requests)
            kv = kv_next
    wait(grad_requests)  # the last hop brings each rank its own shard's accumulator, now complete
    dk, dv = grads
    return dq.flatten(1, 2).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class RingAttention(torch.autograd.Function):
    """Ring attention as one autograd node, so that the backward pass is the ring's own (gradients
    summed round the ring), not autograd's through the communication."""

    @staticmethod
    def forward(ctx, q, k, v, causal, group):
        with torch.autocast(q.device.type, enabled=False):  # scores and log-sum-exps in fp32, as the backward's
            out, lse = ring_forward(q, k, v, causal, group)
        ctx.save_for_backward(q, k, v, out, lse)  # all per shard: lse (B, nkv, g, T), no T x T
        ctx.causal, ctx.group = causal, group
        return out.flatten(1, 2).to(q.dtype)  # (B, nh, T, hs)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        with torch.autocast(q.device.type, enabled=False):
            return *ring_backward(q, k, v, out, lse, dout, ctx.causal, ctx.group), None, None


def ring_attention(q, k, v, causal, group=None):
    """Softmax attention softmax(q kᵀ / sqrt(hs)) v over a sequence sharded across the ranks of group
    (None: the default group), rank r holding positions [r T, (r+1) T), every rank the same T. The key/
    value shards go round the ring (rank r sends to r+1 and receives from r-1), and each rank merges its
    queries' partial attention over each block by the blocks' log-sum-exp (see merge_attention), in fp32.
    causal: query i sees keys j <= i; blocks of later ranks are skipped (with contiguous shards the last
    rank works the most: a zigzag layout would even that out, at the cost of a different sharding).
    q (B, nh, T, hs); k, v (B, n_kv_head, T, hs), each key/value head shared by nh / n_kv_head query
    heads. Every rank of group must call it, with the same shapes. Returns (B, nh, T, hs) in q's dtype:
    the attention output of this rank's queries. Differentiable: the backward pass sends the key/value
    gradients round the ring too, so each rank gets the gradients of its own shards."""
    group = dist.group.WORLD if group is None else group  # get_global_rank wants a group, not None
    assert q.size(1) % k.size(1) == 0, f"{q.size(1)} query heads do not share {k.size(1)} key heads evenly"
    assert q.size(2) == k.size(2) == v.size(2), "queries, keys and values must cover the same positions"
    return RingAttention.apply(q, k, v, causal, group)
