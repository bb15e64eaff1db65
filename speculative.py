"""
Speculative decoding (Leviathan et al. 2023; Chen et al. 2023): a small draft decoder proposes
tokens, the target scores them all in one forward pass and keeps those it agrees with, so that
the output follows the target's own distribution, faster. Both models decode through model.py's
KV cache, which rolls back what the target rejects.
"""

import torch

from model import autocast_dtype
from sampling import draw, sampling_probs


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
    """Continue idx (1, T) as `target` would, faster (Leviathan et al. 2023; Chen et al. 2023): a
    small `draft` decoder proposes k tokens one by one, the target scores them all in one forward
    pass, and accept_or_resample keeps what the target agrees with. With temperature=0 the output
    is exactly the target's greedy decoding. Returns (1, T + max_new_tokens) and the numbers of
    draft tokens accepted and proposed."""
    if target.config.arch != "decoder" or draft.config.arch != "decoder":
        raise ValueError("speculative decoding takes a decoder as target and as draft")
    if idx.size(0) != 1:
        raise ValueError("speculative decoding takes one sequence at a time (batch size 1)")

    def feed(model, tokens, start):  # tokens (1, n) at positions start.. -> probabilities (n, V)
        logits = model(tokens, input_pos=torch.arange(start, start + tokens.size(1), device=tokens.device))[0]
        return sampling_probs(logits[0, :, :vocab_limit], temperature, top_k, top_p)

    out, total = idx[0].tolist(), idx.size(1) + max_new_tokens
    # drafting stops where absolute positions would have to shift; the target alone finishes
    end = min([m.config.block_size - k for m in (target, draft) if m.absolute_positions] + [total])
    accepted = proposed = 0
    for m in (target, draft):  # room for the k + 1 positions that a rollback may take back
        m.setup_kv_cache(1, m.cache_size(len(out), max_new_tokens) + k + 1, dtype=autocast_dtype(idx.device))
    try:
        # invariant: the target has seen all of out but its last token; the draft all but `pending`
        if 1 < len(out) < end:
            for m in (target, draft):
                m.prefill(idx[:, :-1], torch.arange(len(out) - 1, device=idx.device))
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
        out = target.generate(out, total - out.size(1), temperature, top_k, top_p, vocab_limit=vocab_limit)
    return out, accepted, proposed
