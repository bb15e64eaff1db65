# nanoGPT's CPU model with Performer attention (Choromanski et al. 2021, FAVOR+) in place of softmax:
# positive orthogonal random features estimate exp(q·k / sqrt(hs)); the same shapes and training, so
# its val loss stands beside shakespeare_char_cpu.py's (docs/model.md).
# python train.py configs/shakespeare_char_performer.py
from configs.shakespeare_char_cpu import *  # the CPU baseline; what differs follows

out_dir = "out-shakespeare-char-performer"
attention = "performer"
n_features = 64  # twice the head size (32)
feature_redraw = 0  # the projection drawn at init stays: sampling uses the one trained with
