# The modern recipe on the CPU (docs/training.md, measured in docs/performance.md): the Llama-style
# model with ReLU², QK-norm, a zero-initialised untied head and projections, soft-capped logits,
# Muon on the blocks' matrices, 2048 tokens a step. Give it a time budget, such as the time
# nanoGPT's CPU recipe takes on the same machine:
# python train.py configs/shakespeare_char_speedrun.py --max_time=133s
from configs.shakespeare_char_llama import *  # the Llama-style CPU config; what differs follows

out_dir = "out-shakespeare-char-speedrun"
mlp = "relu2"
qk_norm = True
zero_init = True
logit_softcap = 15.0
optimizer = "muon"
learning_rate = 3e-3  # AdamW's peak: embeddings, head, norms
muon_lr = 0.02
batch_size = 16  # 16 x 128 = 2048 tokens an iteration: Muon's fixed cost per step spread over more tokens
block_size = 128
warmup_iters = 50
max_iters = 100000  # --max_time sets the length; this only caps it
eval_interval = 250
