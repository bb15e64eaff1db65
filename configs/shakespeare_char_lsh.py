# nanoGPT's CPU model with Reformer's LSH attention (Kitaev et al. 2020): shared QK, each query seeing
# the 16 keys of its bucket nearest to it (earlier ones: it is a decoder), over 2 hashing rounds.
# The same shapes and training as shakespeare_char_cpu.py, so the val losses stand side by side.
# python train.py configs/shakespeare_char_lsh.py
from configs.shakespeare_char_cpu import *  # the CPU baseline; what differs follows

out_dir = "out-shakespeare-char-lsh"
attention = "lsh"
bucket_size = 8  # 64 / 8 = 8 buckets
n_hashes = 2
