# A Vision Transformer (Dosovitskiy et al. 2020) on scikit-learn's 8x8 digits, on the CPU in about a minute:
# 2x2 patches (16, and [CLS]), 4 pre-norm layers, the exact GELU, as google/vit-base-patch16-224 is.
# python prepare.py digits && python train.py configs/vit_digits.py
# then: python sample.py --out_dir=out-vit-digits --image=FILE.png
out_dir = "out-vit-digits"
dataset = "digits"
device = "cpu"
arch = "encoder"
image_size = 8  # the data's (train.py checks them against meta.json)
channels = 1
n_classes = 10
patch_size = 2
block_size = 17  # 16 patches and [CLS]
n_layer = 4
n_head = 4
n_embd = 64
gelu_approximate = "none"
norm_eps = 1e-12
dropout = 0.1
batch_size = 64
learning_rate = 2e-3
weight_decay = 0.05
max_iters = 1500
lr_decay_iters = 1500
warmup_iters = 50
min_lr = 1e-4
beta2 = 0.99
eval_interval = 500
eval_iters = 20  # 20 batches of 64 val images: the 364 of the split, drawn with replacement
log_interval = 50
