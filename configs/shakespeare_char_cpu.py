# The CPU run of nanoGPT's README, as a config: a few minutes on a laptop's cores. The model is
# nanoGPT's: no biases (its train.py default) and the exact erf GELU (its nn.GELU()).
# python prepare.py shakespeare_char && python train.py configs/shakespeare_char_cpu.py
out_dir = "out-shakespeare-char-cpu"
dataset = "shakespeare_char"
device = "cpu"
eval_interval = 250
eval_iters = 20
log_interval = 50
batch_size = 12
block_size = 64
n_layer = 4
n_head = 4
n_embd = 128
dropout = 0.0
bias = False
gelu_approximate = "none"
learning_rate = 1e-3
max_iters = 2000
lr_decay_iters = 2000
min_lr = 1e-4
beta2 = 0.99
warmup_iters = 100
