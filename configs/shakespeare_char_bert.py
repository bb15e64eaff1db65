# A BERT-style encoder on Shakespeare characters, trained as a masked LM (15% of tokens chosen;
# 80% masked, 10% random, 10% kept). Post-norm and learned positions, as in BERT. CPU-sized.
# python train.py configs/shakespeare_char_bert.py
# python sample.py --out_dir=out-shakespeare-char-bert --start="To be, or not to be, that is the qu[MASK][MASK][MASK][MASK][MASK]"
out_dir = "out-shakespeare-char-bert"
dataset = "shakespeare_char"
device = "cpu"
arch = "encoder"
norm_first = False  # BERT normalises after each residual addition
eval_interval = 250
eval_iters = 20
log_interval = 50
batch_size = 12
block_size = 64
n_layer = 4
n_head = 4
n_embd = 128
learning_rate = 1e-3
warmup_iters = 200  # post-norm wants a gentler start than pre-norm
max_iters = 2000
lr_decay_iters = 2000
min_lr = 1e-4
beta2 = 0.99
