# A ViT on sounds: log-mel spectrograms (32 mel bands x 32 frames of 10 ms) cut into 8x8 patches, one channel.
# tests/test_media.py synthesizes its data, four pitches in noise (tones()); your own, a folder per class:
# python prepare.py audio --input='sounds/*/*.wav' --name=tones --image_size=32 && python train.py configs/vit_tones.py
out_dir = "out-vit-tones"
dataset = "tones"
device = "cpu"
arch = "encoder"
image_size = 32  # the data's: 32 mel bands x 32 frames (train.py checks them)
channels = 1
n_classes = 4
patch_size = 8
block_size = 17  # 16 patches and [CLS]
n_layer = 2
n_head = 2
n_embd = 32
gelu_approximate = "none"
batch_size = 16
learning_rate = 3e-3
max_iters = 150
lr_decay_iters = 150
warmup_iters = 10
min_lr = 3e-4
eval_interval = 50
eval_iters = 4
log_interval = 25
