# A decoder with ALiBi: no position embedding at all, a per-head linear penalty on distance in
# the attention scores instead, so it can read past the context it was trained on. CPU-sized.
# python train.py configs/shakespeare_char_alibi.py
out_dir = "out-shakespeare-char-alibi"
dataset = "shakespeare_char"
device = "cpu"
pos = "alibi"
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
