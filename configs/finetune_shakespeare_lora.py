# The LoRA twin of finetune_shakespeare.py: GPT-2 (124M) on Shakespeare, training only rank-8 updates of
# the attention's q, k, v (c_attn) while every GPT-2 weight stays frozen (docs/training.md, LoRA).
# python prepare.py shakespeare && python train.py configs/finetune_shakespeare_lora.py
# python hf.py export out-shakespeare-gpt2-lora gpt2-base --adapter=gpt2-shakespeare-lora   # peft's layout
init_from = "gpt2"
out_dir = "out-shakespeare-gpt2-lora"
dataset = "shakespeare"
eval_interval = 5
eval_iters = 40
always_save_checkpoint = False  # ckpt.pt at the end, best.pt when val improves
batch_size = 1
gradient_accumulation_steps = 32  # 32 sequences of 1024 tokens per step, as the full finetune
max_iters = 20
lora_rank = 8
lora_alpha = 16.0  # the update is scaled by alpha / r = 2
lora_targets = "c_attn"
learning_rate = 1e-3  # LoRA's usual rate: the update starts at zero and only A and B train
decay_lr = False
