# The T5-style encoder-decoder of shakespeare_char_t5.py trained by BART's denoising (Lewis et al.
# 2020): spans of Poisson(3) lengths cover 30% of the characters, one mask token each (a zero-length
# span inserts one); sentences are permuted where the run's special tokens name the sentence ends
# (tokens["sentence_end"]); the decoder writes the whole text again (docs/training.md).
# python train.py configs/shakespeare_char_bart.py
# python sample.py --out_dir=out-shakespeare-char-bart --start="To be, or not to be, [MASK] is the question"
from configs.shakespeare_char_t5 import *  # the T5 model; what differs follows

out_dir = "out-shakespeare-char-bart"
objective = "bart"
