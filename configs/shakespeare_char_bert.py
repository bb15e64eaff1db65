# A BERT-style encoder on Shakespeare characters, trained as a masked LM (15% of tokens chosen;
# 80% masked, 10% random, 10% kept). Post-norm, GELU, as in BERT. CPU-sized.
# Positions are RoPE (as in RoFormer and ModernBERT), not BERT's learned table: a masked position
# holds no information of its own, so the model must first learn where its neighbours are, and
# with learned positions this small model stayed near the unigram loss (val 3.04 after 2000
# iterations, unigram entropy 3.33); with RoPE it reached 2.02 after 600.
# python train.py configs/shakespeare_char_bert.py
# python sample.py --out_dir=out-shakespeare-char-bert --start="To be, or not to be, that is the qu[MASK][MASK][MASK][MASK][MASK]"
from configs.shakespeare_char_cpu import *  # the CPU baseline; what differs follows

out_dir = "out-shakespeare-char-bert"
arch = "encoder"
norm_first = False  # BERT normalises after each residual addition
bias = True  # BERT's biases and its GELU, the tanh form (the CPU baseline has nanoGPT's instead)
gelu_approximate = "tanh"
pos = "rope"
warmup_iters = 200  # post-norm wants a gentler start than pre-norm
