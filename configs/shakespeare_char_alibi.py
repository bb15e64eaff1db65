# A decoder with ALiBi: no position embedding at all, a per-head linear penalty on distance in
# the attention scores instead, so it can read past the context it was trained on. CPU-sized.
# python train.py configs/shakespeare_char_alibi.py
from configs.shakespeare_char_cpu import *  # the CPU baseline; what differs follows

out_dir = "out-shakespeare-char-alibi"
pos = "alibi"
