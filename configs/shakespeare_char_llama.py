# A Llama-style decoder on Shakespeare characters: RoPE, RMSNorm, SwiGLU, grouped-query
# attention (4 query heads share 2 key/value heads), no biases, untied output. CPU-sized.
# python train.py configs/shakespeare_char_llama.py
from configs.shakespeare_char_cpu import *  # the CPU baseline; what differs follows

out_dir = "out-shakespeare-char-llama"
pos = "rope"
norm = "rmsnorm"
mlp = "swiglu"
n_kv_head = 2
bias = False
tie_embeddings = False
