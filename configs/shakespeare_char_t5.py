# A T5-style encoder-decoder on Shakespeare characters, trained by span corruption (15% of the
# characters in spans of mean length 3, each replaced by a sentinel). Relative position bias,
# RMSNorm, no biases, gated GELU (T5 v1.1). CPU-sized: each stack has n_layer blocks.
# python train.py configs/shakespeare_char_t5.py
# python sample.py --out_dir=out-shakespeare-char-t5 --start="To be, or not to be, [MASK] is the question"
out_dir = "out-shakespeare-char-t5"
dataset = "shakespeare_char"
device = "cpu"
arch = "encoder-decoder"
pos = "relative"
norm = "rmsnorm"
mlp = "geglu"
bias = False
tie_embeddings = False  # T5 v1.1 unties the output layer
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
