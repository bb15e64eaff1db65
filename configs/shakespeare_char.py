# A baby GPT on Shakespeare, one character per token: the GPU default (nanoGPT's settings).
# python prepare.py shakespeare_char && python train.py configs/shakespeare_char.py
out_dir = "out-shakespeare-char"
dataset = "shakespeare_char"
eval_interval = 250  # it overfits: evaluate often, keep best.pt
eval_iters = 200
log_interval = 10
batch_size = 64
block_size = 256  # characters of context
n_layer = 6
n_head = 6
n_embd = 384
dropout = 0.2
learning_rate = 1e-3  # a small model can take a large step
max_iters = 5000
lr_decay_iters = 5000
min_lr = 1e-4
beta2 = 0.99  # more tokens per step would allow 0.95
warmup_iters = 100
