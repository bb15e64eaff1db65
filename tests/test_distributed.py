"""train.py --fsdp=True under torchrun (two processes on the CPU, gloo): it trains as DDP does, each
rank holding half of the weights and optimizer state; Muon on sliced matrices computes what it does
on whole ones; a signal saves and the run resumes exactly; the checkpoints are whole and plain, so
one process resumes them and sample.py samples them; what FSDP cannot run is refused in one line."""

import io
import os
import re
import shutil
import signal
import sys
from concurrent.futures import ThreadPoolExecutor
from contextlib import redirect_stdout

import pytest
import torch

import sample
import train
from model import ModelConfig, Transformer
from optim import learning_rate

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")
ITERS = 20


def args(tiny_args, *more):
    # two micro-steps, one per rank; evaluations (and checkpoints) at 0, 10 and 20
    return ["--dataset=verse", f"--max_iters={ITERS}", "--eval_interval=10", "--gradient_accumulation_steps=2",
            *tiny_args, *more]


def torchrun(run, d, *argv):
    code, log, err = run(TORCHRUN, "--standalone", "--nproc_per_node=2", os.path.join(HERE, "train.py"), *argv, cwd=d)
    assert code == 0, err
    return log


def weights(path):
    return torch.load(path, weights_only=True)["model"]


def rounding(path):
    """(atol, travel) for comparing a run's weights with the same run's in another order of sums.
    travel: the sum of AdamW's learning rate over the iterations, as far as AdamW moves a weight
    whatever its gradient (m / sqrt(v) is scale-free). Each step's gradient sums one term a token of
    the batch; in another order it differs by up to (tokens * eps) relative, and so does AdamW's step:
    atol = tokens * eps * travel (128 tokens, 2e-7 here; a gradient summed instead of averaged moves
    weights by 3e-5, one rank's half-batch alone by 2e-2)."""
    ckpt = torch.load(path, weights_only=True)
    cfg = train.TrainConfig(**ckpt["train_config"])
    travel = sum(learning_rate(it, cfg) for it in range(ckpt["iter_num"]))
    tokens = cfg.batch_size * cfg.gradient_accumulation_steps * ckpt["model_config"]["block_size"]
    return tokens * torch.finfo(torch.float32).eps * travel, travel


def assert_same_weights(a, b, tolerances, atol=None):
    """Equal to rounding (tolerances: rounding() of the run; atol, where given, overrides its atol).
    The key bias is the exception: softmax ignores a shift common to every key (learned positions, no
    QK-norm), so its gradient is 0 but for rounding, which AdamW normalises into steps: each run's
    key bias is its own noise, equal only to within travel. FSDP can get nothing wrong that it alone shows."""
    atol, travel = tolerances[0] if atol is None else atol, tolerances[1]
    assert a.keys() == b.keys()
    for k in a:
        tol = torch.full_like(a[k], atol)
        if k.endswith(".attn.c_attn.bias"):  # q, k, v one after another; q as wide as c_proj's input
            q = a[k.replace("c_attn.bias", "c_proj.weight")].size(1)
            tol[q:(q + a[k].numel()) // 2] = travel
        excess = (a[k] - b[k]).abs() - (tol + 1e-5 * b[k].abs())  # assert_close's rule, atol per element
        assert (excess <= 0).all(), f"{k}: {(a[k] - b[k]).abs().max():.3g} apart, {excess.max():.3g} past the tolerance"


@pytest.fixture(scope="module")
def runs(workdir, run, tiny_args):
    """The same 20 iterations under DDP (out-ddp) and under FSDP (out-fsdp), and under FSDP with Muon
    (out-fsdp-muon), all at once (most of each run is starting Python and torch); their logs."""
    d, _ = workdir
    argvs = dict(ddp=["--out_dir=out-ddp", *args(tiny_args)],
                 fsdp=["--out_dir=out-fsdp", *args(tiny_args, "--fsdp=True")],
                 muon=["--out_dir=out-fsdp-muon", *args(tiny_args, "--optimizer=muon", "--fsdp=True")])
    with ThreadPoolExecutor(max_workers=len(argvs)) as pool:
        return dict(zip(argvs, pool.map(lambda argv: torchrun(run, d, *argv), argvs.values())))


@pytest.mark.slow
def test_fsdp_trains_as_ddp_does(workdir, runs, losses):
    d, _ = workdir
    ddp, fsdp = losses(runs["ddp"]), losses(runs["fsdp"])
    assert len(ddp) == len(fsdp) == ITERS
    assert max(abs(a - b) for a, b in zip(ddp, fsdp)) < 2e-3
    assert "on 2 x cpu" in runs["fsdp"] and "ranks agree" not in runs["fsdp"]  # no replicas to compare
    assert_same_weights(weights(d / "out-ddp" / "ckpt.pt"), weights(d / "out-fsdp" / "ckpt.pt"),
                        rounding(d / "out-fsdp" / "ckpt.pt"))


@pytest.mark.slow
def test_each_rank_holds_half_the_parameters_and_optimizer_state(workdir, runs):
    d, _ = workdir
    # the figure printed is read from each rank's slices of the weights (DTensor.to_local())
    line = re.search(r"^fsdp: 2 ranks hold ([\d.]+) MB of parameters and optimizer state each \(DDP: ([\d.]+) MB\)$",
                     runs["fsdp"], re.M)
    assert line, runs["fsdp"]
    ckpt = torch.load(d / "out-fsdp" / "ckpt.pt", weights_only=True)
    n = sum(p.numel() for p in Transformer(ModelConfig(**ckpt["model_config"])).parameters())
    assert float(line[2]) == pytest.approx(12 * n / 1e6, rel=5e-3)  # fp32 weights and AdamW's two moments
    assert float(line[1]) == pytest.approx(float(line[2]) / 2, rel=5e-3)


@pytest.mark.slow
def test_an_fsdp_checkpoint_is_plain_as_one_process_writes_it_and_samples(workdir, runs, in_process, capsys):
    d, _ = workdir
    ddp, fsdp = (torch.load(d / out / "ckpt.pt", weights_only=True) for out in ("out-ddp", "out-fsdp"))
    assert fsdp["iter_num"] == ITERS
    # the optimizer's state keyed by parameter index, as one process keys it (not by name), and whole
    assert fsdp["optimizer"]["param_groups"] == ddp["optimizer"]["param_groups"]
    state, ddp_state = fsdp["optimizer"]["state"], ddp["optimizer"]["state"]
    assert list(state) == list(ddp_state) == list(range(len(ddp_state)))
    for i in state:
        assert state[i].keys() == ddp_state[i].keys()
        for k in state[i]:
            torch.testing.assert_close(state[i][k], ddp_state[i][k], rtol=1e-5, atol=1e-6)
    capsys.readouterr()
    assert in_process(sample.main, ["--out_dir=out-fsdp", "--max_new_tokens=5", "--start=LEAR:"], cwd=d) == 0
    assert capsys.readouterr().out.startswith("LEAR:")


@pytest.mark.slow
def test_a_signal_saves_and_the_run_resumes_exactly_under_fsdp_and_in_one_process(workdir, runs, run, start, wait_for,
                                                                                  in_process, losses, tiny_args):
    d, _ = workdir
    # SIGTERM to torchrun, as a scheduler sends it: torchrun passes it on to each rank, which saves
    stopped = args(tiny_args, "--out_dir=out-stop", "--fsdp=True")
    p = start(TORCHRUN, "--standalone", "--nproc_per_node=2", os.path.join(HERE, "train.py"), *stopped,
              "--max_iters=1000", cwd=d)  # (the learning rate's schedule does not depend on max_iters)
    wait_for(p.stdout, "iter 3:")
    p.send_signal(signal.SIGTERM)
    log, err = p.communicate(timeout=300)
    at = torch.load(d / "out-stop" / "ckpt.pt", weights_only=True)["iter_num"]
    assert 3 <= at < ITERS and f"stopped by SIGTERM at iteration {at}" in log, err
    shutil.copytree(d / "out-stop", d / "out-stop-one")
    # the rest under FSDP: the last loss and the weights of the run that never stopped, bit for bit
    resumed = torchrun(run, d, *stopped, "--init_from=resume")
    assert losses(resumed)[-1] == losses(runs["fsdp"])[-1]
    straight = weights(d / "out-fsdp" / "ckpt.pt")
    resumed = weights(d / "out-stop" / "ckpt.pt")
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)
    # ...and in one process, which steps with the whole batch: the same weights to rounding
    assert in_process(train.main, args(tiny_args, "--out_dir=out-stop-one", "--init_from=resume"), cwd=d) == 0
    assert_same_weights(straight, weights(d / "out-stop-one" / "ckpt.pt"), rounding(d / "out-fsdp" / "ckpt.pt"))


@pytest.mark.slow
def test_muon_on_sliced_matrices_updates_as_on_whole_ones(workdir, runs, in_process, tiny_args):
    d, _ = workdir
    assert in_process(train.main, ["--out_dir=out-one-muon", *args(tiny_args, "--optimizer=muon")], cwd=d) == 0
    # Newton-Schulz amplifies rounding; a rank that orthogonalised its slices alone would be 7e-3 off here
    assert_same_weights(weights(d / "out-one-muon" / "ckpt.pt"), weights(d / "out-fsdp-muon" / "ckpt.pt"),
                        rounding(d / "out-fsdp-muon" / "ckpt.pt"), atol=1e-5)


def test_fsdp_is_refused_in_one_line_where_it_cannot_run(workdir, run, one_line_error, refusal, monkeypatch,
                                                         tiny_args):
    d, _ = workdir
    one_line_error(run("train.py", *args(tiny_args, "--out_dir=out-no-torchrun", "--fsdp=True"), cwd=d),
                   "--fsdp=True shards the model over the processes that torchrun starts")
    for k, v in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="2").items():  # as torchrun starts rank 0 of 2
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(train, "FSDP2", False)  # a torch without FSDP2
    refusal(train.main, args(tiny_args, "--out_dir=out-old-torch", "--fsdp=True"), "--fsdp=True needs FSDP2",
            "upgrade torch, or train under DDP without --fsdp", cwd=d)
    assert not list(d.glob("out-no-torchrun")) and not list(d.glob("out-old-torch"))


# ----------------------------------------------------------------------------------------------
# Context parallel: each sequence split over the ranks of a group, ring attention between them

@pytest.mark.slow
def test_context_parallel_trains_as_one_process_does(workdir, run, in_process, tiny_args, losses):
    """--context_parallel=2 on 2 ranks (one group), and on 4 (two groups, data parallel): the logged
    losses (the mean of every rank's shards) equal a one-process run's on the same batches, to the 4
    decimals printed, and one group's evaluations too; the checkpoint is whole and holds the same model."""
    d, _ = workdir
    common = ["--dataset=verse", "--max_iters=6", "--eval_interval=3", "--gradient_accumulation_steps=2", *tiny_args]
    with ThreadPoolExecutor(max_workers=2) as pool:
        two = pool.submit(torchrun, run, d, "--out_dir=out-cp-2", "--context_parallel=2", *common)
        four = pool.submit(run, TORCHRUN, "--standalone", "--nproc_per_node=4", os.path.join(HERE, "train.py"),
                           "--out_dir=out-cp-4", "--context_parallel=2", *common, cwd=d)
        with redirect_stdout(io.StringIO()) as one:  # meanwhile in this process, whose main thread train.py needs
            assert in_process(train.main, ["--out_dir=out-cp-one", *common], cwd=d) == 0, one.getvalue()
        logs = dict(one=one.getvalue(), two=two.result(), four=four.result()[1])
    evals = lambda log: [float(v) for v in re.findall(r"val loss ([\d.]+) \(", log)]  # noqa: E731
    for name in ("two", "four"):
        assert "context parallel: 2 ranks a sequence of 16, 8 positions each" in logs[name], logs[name]
        # the printed figures, to their last decimal: the training losses, and the evaluations of one group
        # (two groups evaluate twice the batches, each its own, as data-parallel ranks do)
        for read, n in ((losses, 6), (evals, 3)) if name == "two" else ((losses, 6),):
            assert len(read(logs[name])) == n
            assert max(abs(a - b) for a, b in zip(read(logs["one"]), read(logs[name]))) <= 1e-4
    one, four = weights(d / "out-cp-one" / "ckpt.pt"), weights(d / "out-cp-4" / "ckpt.pt")
    assert one.keys() == four.keys() and all(one[k].shape == four[k].shape for k in one)
    assert max((one[k] - four[k]).abs().max().item() for k in one) < 1e-4  # fp32 sums in another order, 6 steps


def test_context_parallel_is_refused_in_one_line_where_it_cannot_run(workdir, run, one_line_error, refusal,
                                                                    monkeypatch, tiny_args):
    d, _ = workdir
    one_line_error(run("train.py", *args(tiny_args, "--out_dir=out-cp-alone", "--context_parallel=2"), cwd=d),
                   "--context_parallel=2 splits each sequence over n of the processes torchrun starts")
    for k, v in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="2").items():  # as torchrun starts rank 0 of 2
        monkeypatch.setenv(k, v)
    refusal(train.main, args(tiny_args, "--out_dir=out-cp-alibi", "--context_parallel=2", "--pos=alibi"),
            "ring attention is exact softmax attention", cwd=d)
    refusal(train.main, args(tiny_args, "--out_dir=out-cp-3", "--context_parallel=3", "--block_size=15"),
            "the world size must be a multiple of 3", cwd=d)  # (the mesh: pp x cp x tp)
