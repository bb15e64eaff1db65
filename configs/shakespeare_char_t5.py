# A T5-style encoder-decoder on Shakespeare characters, trained by span corruption (15% of the
# characters in spans of mean length 3, each replaced by a sentinel). Relative position bias,
# RMSNorm, no biases, gated GELU (T5 v1.1). CPU-sized: each stack has n_layer blocks.
# python train.py configs/shakespeare_char_t5.py
# python sample.py --out_dir=out-shakespeare-char-t5 --start="To be, or not to be, [MASK] is the question"
from configs.shakespeare_char_cpu import *  # the CPU baseline; what differs follows

out_dir = "out-shakespeare-char-t5"
arch = "encoder-decoder"
pos = "relative"
norm = "rmsnorm"
mlp = "geglu"
gelu_approximate = "tanh"  # T5 v1.1's gated GELU is the tanh form
bias = False
tie_embeddings = False  # T5 v1.1 unties the output layer
