#!/usr/bin/env bash
# The GPU figures of docs/performance.md and docs/kernels.md, measured in one go on one CUDA GPU:
#
#   python prepare.py shakespeare && python prepare.py shakespeare_char   # first, where there is a network
#   bash tools/gpu.sh [STEP ...]      # all steps: about 11 minutes on one H100; the log goes to $LOG
#
# Steps, in this order: env tests attention auto train decode real; and, named only, profile (where
# gpt2_124m's training time goes), products (int8 and int4 layers at batch 1) and tiles (the kernel's
# tiles against cuDNN). Each runs under a time limit of
# its own (seconds, below), so that one that hangs leaves time to the others. The training and
# decoding steps use random or fresh weights, the real runs Shakespeare's characters.
set -u
LOG=${LOG:-gpu.log}
export PYTHONUNBUFFERED=1
GPT2="configs/gpt2_124m.py --dataset=shakespeare --compile=True --eval_interval=1000 --eval_iters=5"
SPEEDRUN_MODEL="--optimizer=muon --mlp=relu2 --qk_norm=True --zero_init=True --logit_softcap=15"

run() {  # run LIMIT COMMAND...: the command under its limit, into the log with its time
    local limit=$1 t0=$SECONDS
    shift
    echo "\$ $*" | tee -a "$LOG"
    timeout "$limit" "$@" 2>&1 | tee -a "$LOG"
    echo "# exit ${PIPESTATUS[0]} after $((SECONDS - t0)) s" | tee -a "$LOG"
}

env() {
    run 30 nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
    run 60 python -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', \
triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
}

tests() {  # the kernel's tests on the GPU: bf16, and every autotuning config (12 processes share the GPU);
            # int4 and int8 layers on CUDA
    run 120 python -m pytest -q -x -n 12 tests/test_kernels.py
    run 60 python -m pytest -q -x tests/test_quantize.py -k cuda
}

attention() {  # the kernel against SDPA, forward and backward, at the lengths of docs/kernels.md's table
    run 120 python bench.py attention --seqs=1024,4096 --dims=64,128
}

auto() {  # `auto` takes the kernel for ALiBi and windows at a context of 4096 or more: is it faster there?
    run 90 python bench.py train configs/gpt2_124m.py --dataset=shakespeare --block_size=4096 --batch_size=4 \
        --gradient_accumulation_steps=1 --pos=alibi
    run 90 python bench.py train configs/gpt2_124m.py --dataset=shakespeare --block_size=4096 --batch_size=4 \
        --gradient_accumulation_steps=1 --window=1024
}

train() {  # gpt2_124m compiled: 50 iterations of 4 x 16 x 1024 tokens; then Muon with the speedrun's model options
    rm -rf /tmp/out-adamw /tmp/out-muon  # a rerun on the same machine starts afresh
    run 200 python train.py $GPT2 --max_iters=50 --gradient_accumulation_steps=4 --out_dir=/tmp/out-adamw
    run 200 python train.py $GPT2 --max_iters=50 --gradient_accumulation_steps=4 --out_dir=/tmp/out-muon \
        $SPEEDRUN_MODEL
}

decode() {  # bf16 decoding, eager and compiled (CUDA graphs), against transformers' generate
    run 150 python bench.py sample --dtype=bfloat16 --compile=True --batch=1
    run 150 python bench.py sample --dtype=bfloat16 --compile=True --batch=8
}

real() {  # the same 45 seconds for the speedrun recipe (a CPU config: on the GPU here) and nanoGPT's Shakespeare
    rm -rf /tmp/out-speedrun /tmp/out-nanogpt  # config, val loss at the end
    run 120 python train.py configs/shakespeare_char_speedrun.py --device=cuda --max_time=45s --out_dir=/tmp/out-speedrun
    run 120 python train.py configs/shakespeare_char.py --max_time=45s --out_dir=/tmp/out-nanogpt
    for c in speedrun:_speedrun nanogpt:; do  # each on 200 validation batches of 64
        run 60 python train.py configs/shakespeare_char${c#*:}.py --init_from=resume --eval_only=True --device=auto \
            --eval_iters=200 --batch_size=64 --out_dir=/tmp/out-${c%:*}
    done
}

profile() {  # gpt2_124m's iteration (512k tokens) as the config has it, with Muon, and at larger micro-batches;
             # the first profiled kernel by kernel
    run 240 env PYTHONPATH=. python tools/train_profile.py configs/gpt2_124m.py --dataset=shakespeare --compile=True \
        -- "" "optimizer=muon" "batch_size=32 gradient_accumulation_steps=16" "batch_size=64 gradient_accumulation_steps=8"
}

products() {  # one token's weight-only products at batch 1 and 8, each form as one CUDA graph
    run 75 env PYTHONPATH=. python tools/cuda_products.py
}

tiles() {  # causal attention at 4096: the kernel with larger tiles too, against cuDNN and FlashAttention-2
    run 120 env PYTHONPATH=. python tools/kernel_tiles.py 4096 64,128
}

for step in "${@:-env tests attention auto train decode real}"; do
    for s in $step; do
        echo "=== $s" | tee -a "$LOG"
        "$s"
    done
done
