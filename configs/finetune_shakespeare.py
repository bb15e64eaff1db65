# Finetune OpenAI's GPT-2 (124M) on Shakespeare in GPT-2's own BPE, as nanoGPT's finetune config does.
# python prepare.py shakespeare && python train.py configs/finetune_shakespeare.py
# init_from: a hub name downloads through huggingface_hub; a local model directory works offline.
init_from = "gpt2"
out_dir = "out-shakespeare-gpt2"
dataset = "shakespeare"
eval_interval = 5
eval_iters = 40
always_save_checkpoint = False  # ckpt.pt at the end, best.pt when val improves: GPT-2 overfits it quickly
batch_size = 1
gradient_accumulation_steps = 32  # 32 sequences of 1024 tokens per step
max_iters = 20
learning_rate = 3e-5  # a small, constant rate: the weights start trained
decay_lr = False
