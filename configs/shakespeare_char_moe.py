# A mixture-of-experts decoder: each block's MLP is 4 experts, each token routed to 2 of them,
# with Switch Transformer's load-balancing loss added. About 2x the MLP parameters of the
# dense model at the same compute per token. CPU-sized.
# python train.py configs/shakespeare_char_moe.py
out_dir = "out-shakespeare-char-moe"
dataset = "shakespeare_char"
device = "cpu"
n_expert = 4
expert_top_k = 2
moe_aux_weight = 0.01
eval_interval = 250
eval_iters = 20
log_interval = 50
batch_size = 12
block_size = 64
n_layer = 4
n_head = 4
n_embd = 128
learning_rate = 1e-3
max_iters = 2000
lr_decay_iters = 2000
min_lr = 1e-4
beta2 = 0.99
