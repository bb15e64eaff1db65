# Transformer-XL's segment recurrence (Dai et al. 2019) on nanoGPT's CPU model: segments of 32
# characters, each layer seeing the 32 positions before as memory (no gradient flows into it), with
# RoPE. Twice the rows of shakespeare_char_cpu.py, so an iteration reads as many tokens; its val loss
# stands beside that config with --pos=rope (context 64, no memory) in docs/model.md.
# python train.py configs/shakespeare_char_xl.py
from configs.shakespeare_char_cpu import *  # the CPU baseline; what differs follows

out_dir = "out-shakespeare-char-xl"
pos = "rope"  # the memory's keys come before each segment: positions must be relative
block_size = 32
mem_len = 32
batch_size = 24  # 24 x 32 = 12 x 64 tokens an iteration
