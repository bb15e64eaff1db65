# nanoGPT's CPU model with linear attention (Katharopoulos et al. 2020) in place of softmax: the
# same shapes and training, so its val loss stands beside shakespeare_char_cpu.py's (docs/model.md).
# python train.py configs/shakespeare_char_linear.py
from configs.shakespeare_char_cpu import *  # the CPU baseline; what differs follows

out_dir = "out-shakespeare-char-linear"
attention = "linear"
