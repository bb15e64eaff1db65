"""
Turning logits into tokens: temperature, top-k, top-p (nucleus), and a draw that never waits for
the device. generate.py and sample.py share them.
"""

import torch
import torch.nn.functional as F


def sampling_probs(logits, temperature=1.0, top_k=None, top_p=None):
    """The distribution to draw from, (B, V) -> (B, V): logits / temperature, cut to the top_k
    tokens and to the smallest set whose probability reaches top_p. temperature=0 is the argmax."""
    if temperature == 0:
        return F.one_hot(logits.argmax(dim=-1), logits.size(-1)).float()
    logits = logits.float() / temperature
    if top_k is not None:  # keep the k most likely tokens
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]  # a slice: no index tensor to copy
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1:  # nucleus: the most likely tokens whose probabilities reach top_p
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        outside = probs.cumsum(dim=-1) - probs >= top_p  # the mass before this token already reaches p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(outside, float("-inf")))
    return logits.softmax(dim=-1)


def draw(probs):
    """One token per row of probs (B, V) -> (B, 1). argmax of p_i / e_i with e_i ~ Exp(1) picks token
    i with probability p_i (the Gumbel-max trick) and, unlike torch.multinomial, never waits for
    the device."""
    return (probs / torch.empty_like(probs).exponential_(1)).argmax(dim=-1, keepdim=True)


def sample(logits, temperature=1.0, top_k=None, top_p=None):
    """Draw one token per row of logits (B, V) -> (B, 1), with no device-to-host sync."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    return draw(sampling_probs(logits, temperature, top_k, top_p))
