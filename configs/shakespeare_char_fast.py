# The most learning per second on a CPU: the Llama-style decoder (RoPE, RMSNorm, SwiGLU, GQA) of
# nanoGPT's CPU size, with a twice larger learning rate on a schedule that ends at 1200 iterations.
# It passes val loss 1.87 in 42-65 s on 2 cores (README: Training speed), where nanoGPT's CPU run
# needs 3 min 27 s.
# python train.py configs/shakespeare_char_fast.py
from configs.shakespeare_char_llama import *  # the Llama-style CPU config; what differs follows

out_dir = "out-shakespeare-char-fast"
eval_interval = 100  # see the crossing sooner: an eval costs about 0.5 s
learning_rate = 2e-3
warmup_iters = 50
max_iters = 1200
lr_decay_iters = 1200
