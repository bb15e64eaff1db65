# The BERT-style encoder of shakespeare_char_bert.py with BigBird's sparse attention (Zaheer et al.
# 2020): a window of 8 positions each way, 2 global tokens, and per block of 8 queries 2 random blocks
# of 8 keys. The same training, so the val losses stand side by side (docs/model.md).
# python train.py configs/shakespeare_char_bert_bigbird.py
from configs.shakespeare_char_bert import *  # the masked-LM encoder; what differs follows

out_dir = "out-shakespeare-char-bert-bigbird"
window = 8
n_global = 2
n_random = 2
sparse_block = 8
