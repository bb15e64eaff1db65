# The most learning per second on a CPU: the Llama-style decoder (RoPE, RMSNorm, SwiGLU, GQA) of
# nanoGPT's CPU size, with a twice larger learning rate on a schedule that ends at 1200 iterations.
# It is meant to pass val loss 1.87 in well under the minutes nanoGPT's CPU run needs
# (docs/performance.md: Learning per second).
# python train.py configs/shakespeare_char_fast.py
from configs.shakespeare_char_llama import *  # the Llama-style CPU config; what differs follows

out_dir = "out-shakespeare-char-fast"
eval_interval = 100  # see the crossing sooner: an evaluation is short next to 100 iterations
learning_rate = 2e-3
warmup_iters = 50
max_iters = 1200
lr_decay_iters = 1200
