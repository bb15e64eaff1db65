# The BERT-style encoder of shakespeare_char_bert.py with Linformer attention (Wang et al. 2020): keys
# and values projected along the sequence from 64 positions to 16 rows. The same training, so the
# val losses stand side by side (docs/model.md).
# python train.py configs/shakespeare_char_bert_linformer.py
from configs.shakespeare_char_bert import *  # the masked-LM encoder; what differs follows

out_dir = "out-shakespeare-char-bert-linformer"
attention = "linformer"
proj_len = 16
