# A Llama-style decoder on Shakespeare characters: RoPE, RMSNorm, SwiGLU, grouped-query
# attention (4 query heads share 2 key/value heads), no biases, untied output. CPU-sized.
# python train.py configs/shakespeare_char_llama.py
out_dir = "out-shakespeare-char-llama"
dataset = "shakespeare_char"
device = "cpu"
pos = "rope"
norm = "rmsnorm"
mlp = "swiglu"
n_kv_head = 2
bias = False
tie_embeddings = False
eval_interval = 250
eval_iters = 20
log_interval = 50
batch_size = 12
block_size = 64
n_layer = 4
n_head = 4
n_embd = 128
learning_rate = 1e-3
max_iters = 2000
lr_decay_iters = 2000
min_lr = 1e-4
beta2 = 0.99
