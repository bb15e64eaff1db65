# A mixture-of-experts decoder: each block's MLP is 4 experts, each token routed to 2 of them,
# with Switch Transformer's load-balancing loss added. 4x the MLP parameters of the dense
# model (2.39M parameters in all against 0.81M) for 2x its MLP compute per token. CPU-sized.
# python train.py configs/shakespeare_char_moe.py
from configs.shakespeare_char_cpu import *  # the CPU baseline; what differs follows

out_dir = "out-shakespeare-char-moe"
n_expert = 4
expert_top_k = 2
moe_aux_weight = 0.01
