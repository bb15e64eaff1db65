# GPT-2 124M on FineWeb-Edu, for one GPU overnight: the run of llm.c, nanochat and modded-nanogpt.
# python prepare.py fineweb-edu --tokens=10B                   # about 20 GB of tokens (huggingface_hub, pyarrow)
# python train.py configs/gpt2_124m_fineweb.py --compile=True  # 8 hours; docs/training.md says what to expect
# torchrun --standalone --nproc_per_node=1 --max_restarts=3 train.py configs/gpt2_124m_fineweb.py --compile=True
#   ...the same, restarted from its last checkpoint if it dies in the night (init_from below)
# python eval.py --out_dir=out-gpt2-124m-fineweb --tasks=hellaswag   # then HellaSwag (fetched once)
# A GPU only: on a CPU the same tokens would take years (docs/training.md).
from configs.gpt2_124m import *  # noqa: F401,F403 (the shape, the ~0.5M-token batch, AdamW's settings)

out_dir = "out-gpt2-124m-fineweb"
dataset = "fineweb-edu"
init_from = "auto"  # resume from out_dir's checkpoint where there is one, else start: a restart goes on
keep_checkpoints = 3  # the last three checkpoints besides ckpt.pt, as ckpt-<iter>.pt
# 8 hours, evaluation and checkpoints included: train.py fits the number of steps (and the learning
# rate's decay) to the time after its first steps, and evaluates val loss at the end
max_time = "8h"
eval_interval = 1000  # val loss on 100 batches a split (eval_iters), and a checkpoint to resume from
