# GPT-2 124M on your own corpus, for one GPU overnight.
# python prepare.py text --input='my/corpus/*.txt' --name=mydata --tokenizer=gpt2
# python train.py configs/gpt2_124m.py --compile=True
# torchrun --standalone --nproc_per_node=8 train.py configs/gpt2_124m.py --compile=True
out_dir = "out-gpt2-124m"
dataset = "mydata"
# the GPT-2 small shape; vocab_size comes from the data (50257 BPE tokens + specials, rounded up)
n_layer = 12
n_head = 12
n_embd = 768
block_size = 1024
bias = True
dropout = 0.0
# about 0.5M tokens per step: 64 sequences x 1024 tokens x 8 micro-steps (split over the ranks). 64 a
# micro-step take about 41 GiB and train fastest (docs/performance.md); on a GPU of less memory
# halve batch_size and double gradient_accumulation_steps, which keeps the tokens per step
batch_size = 64
gradient_accumulation_steps = 8
# 10,000 steps is 5.2B tokens, about twice the compute-optimal 2.5B for 124M parameters (20 per
# weight). At 6 * 124M + attention = 0.86 GFLOP per token that is 4.5e18 FLOPs: 2.9 hours on one
# H200 or H100 at the 508,000 tokens/s (MFU 43.9%) measured on an H200 (docs/performance.md), about
# three times as long on an A100 (a third of the peak; not measured). Lower max_iters for a
# smaller budget.
max_iters = 10000
lr_decay_iters = 10000
warmup_iters = 700
learning_rate = 6e-4
min_lr = 6e-5
weight_decay = 0.1
beta2 = 0.95
eval_interval = 500
eval_iters = 100
log_interval = 10
