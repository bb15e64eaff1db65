# A BERT-style encoder on Shakespeare characters, trained as a masked LM (15% of tokens chosen;
# 80% masked, 10% random, 10% kept). Post-norm, GELU, as in BERT. CPU-sized.
# Positions are RoPE (as in RoFormer and ModernBERT), not BERT's learned table: a masked position
# holds no information of its own, so the model must first learn where its neighbours are, and
# with learned positions this small model stayed near the unigram loss (val 3.04 after 2000
# iterations, unigram entropy 3.33); with RoPE it reached 2.02 after 600.
# python train.py configs/shakespeare_char_bert.py
# python sample.py --out_dir=out-shakespeare-char-bert --start="To be, or not to be, that is the qu[MASK][MASK][MASK][MASK][MASK]"
out_dir = "out-shakespeare-char-bert"
dataset = "shakespeare_char"
device = "cpu"
arch = "encoder"
norm_first = False  # BERT normalises after each residual addition
pos = "rope"
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
