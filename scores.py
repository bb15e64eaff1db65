"""
The score functions of attention (the survey's §2.4): how much a query q attends to a key k,
before the softmax. ModelConfig.score picks one for every softmax attention of a model.

    scaled_dot  qᵀk / sqrt(hs)            Vaswani et al. 2017: the default, the only one with a kernel
    dot         qᵀk                       Luong et al. 2015's dot, unscaled: to show why the scale is there
    general     qᵀ W k                    Luong et al. 2015; W (nh, hs, hs), starting at the identity
    additive    vᵀ tanh(W_q q + W_k k)    Bahdanau et al. 2015; W_q, W_k (nh, hs, hs), v (nh, hs)
    location    (W q)_j                   Luong et al. 2015; W (nh, block_size, hs): key j's score from the
                                          query alone, for positions up to block_size

All but scaled_dot run on attention's math path (model.attention), on heads (B, nh, T, hs). general
and additive take no 1/sqrt(hs): they are the forms as the survey writes them. additive builds a
(B, nh, Tq, Tk, hs) tensor on the way, which is what it costs (docs/model.md).
"""

import torch
import torch.nn as nn

SCORES = ("scaled_dot", "dot", "general", "additive", "location")


def score_weights(config):
    """The weights of config.score for one attention layer, under the names the layer holds them by:
    {} for scaled_dot and dot, which have none."""
    nh, hs = config.n_head, config.head_size
    eye = torch.eye(hs).expand(nh, hs, hs)
    if config.score == "general":  # W = I: general starts as dot
        return dict(score_w=nn.Parameter(eye.clone()))
    if config.score == "additive":  # W_q = W_k = I, v random: each head starts as a sum of tanh(q_d + k_d)
        return dict(score_wq=nn.Parameter(eye.clone()), score_wk=nn.Parameter(eye.clone()),
                    score_v=nn.Parameter(torch.randn(nh, hs) * hs**-0.5))
    if config.score == "location":  # a row per key position: GPT-2's 0.02 as for every other matrix
        return dict(score_w=nn.Parameter(0.02 * torch.randn(nh, config.block_size, hs)))
    return {}


def score(layer, positions, q, k):
    """The scores (B, nh, Tq, Tk) of layer.config.score, with the layer's weights (score_weights), of
    queries q (B, nh, Tq, hs) for keys k (B, nh, Tk, hs) at positions (B|1, Tk) (-1: padding or an empty
    slot, which the mask hides; None: key j at position j). A location score has a row per position up
    to block_size, which Transformer.check_length and generate keep them below."""
    name = layer.config.score
    if name == "scaled_dot":
        return (q * q.size(-1) ** -0.5) @ k.transpose(-2, -1)  # scaling q costs less than scaling the scores
    if name == "dot":
        return q @ k.transpose(-2, -1)
    if name == "general":  # (B, nh, Tq, hs) @ (nh, hs, hs) @ (B, nh, hs, Tk)
        return q @ layer.score_w @ k.transpose(-2, -1)
    if name == "location":  # (B, nh, Tq, hs) @ (nh, hs, block_size): every position's score, the keys' taken
        every = q @ layer.score_w.transpose(-2, -1)
        if positions is None:
            return every[..., : k.size(2)]
        return torch.take_along_dim(every, positions.clamp(min=0)[:, None, None, :], dim=-1)
    wq, wk = (q @ layer.score_wq.transpose(-2, -1)), (k @ layer.score_wk.transpose(-2, -1))  # W_q q, W_k k
    hidden = torch.tanh(wq[:, :, :, None] + wk[:, :, None])  # (B, nh, Tq, Tk, hs): additive's cost
    return (hidden @ layer.score_v[:, None, :, None]).squeeze(-1)  # vᵀ tanh(...), each head its v
