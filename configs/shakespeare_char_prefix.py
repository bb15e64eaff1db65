# A prefix LM (T5's paper, Raffel et al. 2020) on nanoGPT's CPU model: each row's first P characters,
# P drawn uniform in [1, 63], are read both ways, the rest causally, and the loss counts the rest.
# Sampling reads the prompt as the prefix.
# python train.py configs/shakespeare_char_prefix.py
# python sample.py --out_dir=out-shakespeare-char-prefix --start="ROMEO:"
from configs.shakespeare_char_cpu import *  # the CPU baseline; what differs follows

out_dir = "out-shakespeare-char-prefix"
arch = "prefix-lm"
