"""
The five score functions (scores.py) on shakespeare_char's CPU config for the same time: the table
of docs/model.md ("Score functions").

    python prepare.py shakespeare_char && python tools/scores_equal_time.py --seconds=30

First each score's training iteration (forward, backward, AdamW's step on a batch of the config's
shape) is timed on one thread in the process's CPU time, the scores interleaved, and the fastest of
--rounds rounds kept: the CPU time of a thread moves far less than the wall clock when other jobs
share the cores. Each score then trains (train.py, out_dir ROOT/score-<name>) for the iterations that
fit in --seconds of that time at its cost, evaluated at the start and at the end, so that every
score gets the same compute whatever else the machine runs meanwhile. The table: val loss, ms/iter, and the memory an iteration keeps for its backward
pass (every tensor autograd saves, counted once), where additive's (B, nh, T, T, hs) tanh shows.
"""

import argparse
import json
import os
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, HERE)

from common import parse_settings  # noqa: E402
from model import ModelConfig, Transformer  # noqa: E402
from scores import SCORES  # noqa: E402
from train import TrainConfig  # noqa: E402

CONFIG = os.path.join(HERE, "configs", "shakespeare_char_cpu.py")


def saved_bytes(model, idx):
    """Bytes of the tensors that a forward pass of idx keeps for its backward pass, each counted once."""
    seen = {}

    def pack(t):
        seen[(t.data_ptr(), t.shape, t.dtype)] = t.numel() * t.element_size()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(idx, targets=idx)[1].backward()
    model.zero_grad(set_to_none=True)
    return sum(seen.values())


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=30.0, help="compute per score, at its timed cost")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--out", default="out-scores", help="ROOT: each run's out_dir is ROOT/score-<name>")
    args = ap.parse_args()
    torch.set_num_threads(1)  # process_time counts every thread: one thread's time is the iteration's cost
    train_args, model_args = parse_settings([CONFIG], TrainConfig, ModelConfig, skip=("vocab_size",))
    B, T = train_args["batch_size"], model_args["block_size"]
    idx = torch.randint(0, 84, (B, T), generator=torch.Generator().manual_seed(0))
    models, best, memory = {}, {s: float("inf") for s in SCORES}, {}
    for s in SCORES:
        torch.manual_seed(0)
        models[s] = Transformer(ModelConfig(vocab_size=128, score=s, **model_args))
        memory[s] = saved_bytes(models[s], idx)
    optims = {s: torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True) for s, m in models.items()}
    for _ in range(args.rounds):
        for s in SCORES:  # interleaved: a busy spell of the machine falls on every score alike
            t0 = time.process_time()
            for _ in range(5):
                models[s](idx, targets=idx)[1].backward()
                optims[s].step()
                optims[s].zero_grad(set_to_none=True)
            best[s] = min(best[s], (time.process_time() - t0) / 5)
    print("| score | iterations in %g s | val loss | ms/iter (one thread) | kept for backward |" % args.seconds,
          flush=True)
    print("|---|---|---|---|---|")
    for s in SCORES:
        n = max(1, round(args.seconds / best[s]))
        out_dir = os.path.join(args.out, f"score-{s}")
        cmd = [sys.executable, os.path.join(HERE, "train.py"), CONFIG, f"--score={s}", f"--max_iters={n}",
               f"--lr_decay_iters={n}", f"--warmup_iters={min(100, n // 10)}", f"--eval_interval={n}",
               f"--out_dir={out_dir}"]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "1"})
        evals = [r for r in map(json.loads, open(os.path.join(out_dir, "metrics.jsonl"))) if "val_loss" in r]
        print(f"| `{s}` | {n:,} | {evals[-1]['val_loss']:.4f} | {1000 * best[s]:.1f} | "
              f"{memory[s] / 2**20:.1f} MiB |", flush=True)


if __name__ == "__main__":
    main()
