"""optim.py: Muon's orthogonalisation lands every singular value near 1, batched as one at a time;
MuonAdamW puts the blocks' matrices on Muon and every other parameter on AdamW, once each; its
momentum warms up; a run with --optimizer=muon learns and resumes exactly, its checkpoints loading
with weights_only=True; --max_time fits a run's length to its budget, which a resume keeps; the
schedules (cosine as before, linear, WSD) end at min_lr, WSD's rates do not depend on the length
before its decay, whose start freezes a --max_time run's length, and a resume continues the same
rates. (AdamW's runs and the schedule in a run: test_train.py.)"""

import copy
import math
import dataclasses
import re
import shutil

import pytest
import torch

import optim
import train
from common import UsageError


@pytest.mark.parametrize("shape", [(3, 96, 32), (2, 32, 128), (2, 48, 48)])
def test_orthogonalize_sets_every_singular_value_near_one(shape):
    G = torch.randn(*shape, generator=torch.Generator().manual_seed(0)) * 5
    O = optim.orthogonalize(G)
    s = torch.linalg.svdvals(O)
    assert O.shape == G.shape and s.min() > 0.3 and s.max() < 1.25  # the quintic's band, not exactly 1
    torch.testing.assert_close(O[1], optim.orthogonalize(G[1:2])[0])  # a batch: each matrix on its own
    # the same directions: O is G's polar factor U Vᵀ with the singular values moved toward 1
    U, _, Vh = torch.linalg.svd(G, full_matrices=False)
    assert (torch.linalg.matrix_norm(O - U @ Vh) / torch.linalg.matrix_norm(U @ Vh)).max() < 0.6


def test_muon_takes_the_blocks_matrices_and_adamw_everything_else_once(tiny_model):
    model = tiny_model(tie_embeddings=False)
    cfg = train.TrainConfig(optimizer="muon", muon_lr=0.05)
    opt = optim.make_optimizer(model, cfg, fused=False)
    by_group = {(g["muon"], g["weight_decay"]): {id(p) for p in g["params"]} for g in opt.param_groups}
    names = {id(p): n for n, p in model.named_parameters()}
    muon = {names[i] for i in by_group[(True, cfg.weight_decay)]}
    assert muon == {n for n, p in model.named_parameters() if ".h." in n and p.dim() == 2}
    assert {"wte.weight", "lm_head.weight", "decoder.wpe.weight"} <= {names[i] for i in by_group[(False, cfg.weight_decay)]}
    assert sum(len(ids) for ids in by_group.values()) == len(list(model.parameters()))  # each once
    assert [g["base_lr"] for g in opt.param_groups] == [cfg.learning_rate, cfg.learning_rate, 0.05]


def test_muon_momentum_warms_up_and_its_step_is_the_orthogonalised_nesterov_momentum():
    p = torch.nn.Parameter(torch.zeros(8, 4))
    opt = optim.MuonAdamW([dict(params=[p], muon=True)], lr=0.1, momentum=0.95, momentum_start=0.85,
                          momentum_warmup=10)
    g = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    p.grad = g.clone()
    opt.step()
    beta = 0.85 + 0.1 * 1 / 10  # the first of 10 warm-up steps
    buf = (1 - beta) * g
    torch.testing.assert_close(opt.state[p]["momentum_buffer"], buf)
    want = -0.1 * (8 / 4) ** 0.5 * optim.orthogonalize(g.lerp(buf, beta)[None])[0]  # tall: scaled by sqrt(rows/cols)
    torch.testing.assert_close(p.detach(), want)


@pytest.mark.parametrize("optimizer, fused", [("adamw", True), ("adamw", False), ("muon", True), ("muon", False)])
def test_a_step_flagged_on_the_device_leaves_weights_and_state_as_they_were(tiny_model, optimizer, fused):
    """optimizer_step's skip (a tensor, never read by the host where the optimizer takes it): a
    flagged step, its gradients nan, changes nothing, and the next step is the one it would have been."""
    model, cfg = tiny_model(tie_embeddings=False), train.TrainConfig(optimizer=optimizer)
    twin = copy.deepcopy(model)
    opts = [optim.make_optimizer(m, cfg, fused=fused) for m in (model, twin)]
    loss = lambda m: m(torch.arange(8)[None], targets=torch.arange(1, 9)[None])[1]  # noqa: E731
    for m, opt in zip((model, twin), opts):
        loss(m).backward()
        optim.optimizer_step(m, opt, torch.amp.GradScaler(enabled=False), 1.0, torch.tensor(0.0))
    before = copy.deepcopy((model.state_dict(), opts[0].state_dict()))
    (loss(model) * float("nan")).backward()
    optim.optimizer_step(model, opts[0], torch.amp.GradScaler(enabled=False), 1.0, torch.tensor(1.0))
    after = (model.state_dict(), opts[0].state_dict())
    assert all(torch.equal(before[0][k], after[0][k]) for k in before[0])
    flat = lambda sd: [t for s in sd["state"].values() for t in s.values()]  # noqa: E731
    assert all(torch.equal(a, b) for a, b in zip(flat(before[1]), flat(after[1])))
    for m, opt in zip((model, twin), opts):  # one more real step on each: still twins
        loss(m).backward()
        optim.optimizer_step(m, opt, torch.amp.GradScaler(enabled=False), 1.0, torch.tensor(0.0))
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), twin.state_dict().values()))


def test_a_muon_run_learns_and_resumes_exactly(workdir, in_process, tiny_args):
    d, _ = workdir
    args = ["--dataset=verse", "--optimizer=muon", "--eval_interval=3", *tiny_args]
    assert in_process(train.main, [*args, "--out_dir=out-m", "--max_iters=6"], cwd=d) == 0
    assert in_process(train.main, [*args, "--out_dir=out-m2", "--max_iters=3"], cwd=d) == 0
    shutil.copy(d / "out-m2" / "ckpt.pt", d / "ckpt-m3.pt")
    assert in_process(train.main, [*args, "--out_dir=out-m2", "--max_iters=6", "--init_from=resume"], cwd=d) == 0
    straight, resumed = (torch.load(d / o / "ckpt.pt", weights_only=True) for o in ("out-m", "out-m2"))
    for k, v in straight["model"].items():
        assert torch.equal(v, resumed["model"][k]), k
    assert straight["optimizer"]["state"].keys() == resumed["optimizer"]["state"].keys()
    first = torch.load(d / "ckpt-m3.pt", weights_only=True)  # a Muon checkpoint loads as plain tensors
    assert any(g.get("muon") for g in first["optimizer"]["param_groups"])
    assert straight["val_loss"] < 0.95 * torch.log(torch.tensor(61.0)).item()  # it learned (a uniform guess: ln 61)


# ----------------------------------------------------------------------------------------------
# --max_time: a run that fits a time budget

def test_max_time_reads_seconds_minutes_and_hours():
    assert [optim.budget_seconds(t) for t in ("90s", "45m", "8h", "12", "1.5h", "")] == [90, 2700, 28800, 12, 5400, None]
    for bad in ("soon", "-5s", "5d", "0", "1h30m"):
        with pytest.raises(UsageError, match=r"is not a duration: write --max_time=90s, 45m or 8h"):
            optim.budget_seconds(bad)


def test_the_budget_fits_the_iterations_that_end_in_time(monkeypatch):
    """With a clock of its own: 100 s from the start, set up by 10 s, evaluations of 2 s every 50
    iterations, iterations of 0.125 s. It times at least 5 iterations and 2% of the budget (2 s: 16
    iterations), then fits the most iterations whose time, the evaluations' and a second to exit
    stay within the budget, each iteration counted 3% slower."""
    clock = [10.0]
    monkeypatch.setattr(optim.time, "time", lambda: clock[0])
    budget, cfg = optim.Budget(100, 0, 0.0), train.TrainConfig(eval_interval=50, max_time="100s")
    budget.eval_s = 2.0
    fits = []
    for it in range(1, 50):
        fits.append(budget.fit(cfg, it, torch.device("cpu")))
        cfg = dataclasses.replace(cfg, max_iters=fits[-1] or cfg.max_iters)
        clock[0] += 0.125
    n = next(f for f in fits if f is not None)
    assert fits.index(n) + 1 == 17 and fits.count(None) == len(fits) - 1  # after 16 timed iterations, once
    dt, now = 1.03 * 0.125, 10.0 + 2.0
    end = lambda n: now + (n - 17) * dt + ((n - 17) / 50 + 1) * 2.0 + 1.0  # noqa: E731  (when n iterations end)
    assert end(n) <= 100 < end(n + 1)
    for pace, shorter in ((0.125, False), (0.25, True)):  # as fast: the length stays; twice as slow: shorter
        # (a run that would end early gets longer only in its first half: the second test below)
        clock[0] += 2.0
        budget.evaluated(it, 2.0)  # an evaluation at iteration it ends now
        for it in range(it + 1, it + 51):
            clock[0] += pace
            if (got := budget.fit(cfg, it, torch.device("cpu"))) is not None:
                break
        assert (got is not None) == shorter and (got is None or it % 50 == 0)  # before an evaluation
        if shorter:  # what fits at the new pace
            left = 100 - clock[0] - 1.0
            assert got == it + int((left - 2.0) // (1.03 * pace + 2.0 / 50)) < cfg.max_iters


def test_a_run_that_would_end_early_gets_longer_only_in_its_first_half(monkeypatch):
    clock = [10.0]
    monkeypatch.setattr(optim.time, "time", lambda: clock[0])
    budget, cfg = optim.Budget(100, 0, 0.0), train.TrainConfig(eval_interval=50, max_time="100s", max_iters=400)
    budget.fitted = True
    for it, longer in ((50, True), (250, False)):  # at 50 of 400 iterations: longer; at 250: past half, it stays
        budget.evaluated(it - 50, 1.0)
        clock[0] += 50 * 0.05  # 50 iterations at 0.05 s: 400 would end far too early
        n = budget.fit(cfg, it, torch.device("cpu"))
        assert (n is not None and n > 400) == longer and (n is None) != longer


def test_a_run_with_max_time_keeps_its_length_and_a_resume_goes_on_with_it(workdir, in_process, tiny_args,
                                                                          capsys, monkeypatch):
    d, _ = workdir  # in this process train.py's clock started at its import: the budget counts from now
    monkeypatch.setattr(train, "START", __import__("time").time())
    args = ["--dataset=verse", "--out_dir=out-budget", "--eval_interval=100", *tiny_args]
    assert in_process(train.main, [*args, "--max_time=8s"], cwd=d) == 0
    n = int(re.findall(r"^max_time=8s: (\d+) iterations fit \(", capsys.readouterr().out, re.M)[-1])  # the last fit
    ckpt = torch.load(d / "out-budget" / "ckpt.pt", weights_only=True)
    assert ckpt["iter_num"] == ckpt["fitted_iters"] == n > optim.Budget.TIMED + 1
    assert ckpt["train_config"]["max_iters"] == ckpt["train_config"]["lr_decay_iters"] == n  # the decay ends with it
    # a resume goes on with the length chosen, not max_iters' default of 5000
    assert in_process(train.main, [*args, "--max_time=8s", "--init_from=resume"], cwd=d) == 0
    assert f"is at iteration {n} of max_iters={n}: nothing to do" in capsys.readouterr().out


def test_a_budget_too_short_for_the_first_iterations_is_one_line(workdir, refusal, tiny_args):
    d, _ = workdir  # in this process the clock started when train.py was imported: any second is past
    refusal(train.main, ["--dataset=verse", "--out_dir=out-short", "--max_time=1s", *tiny_args],
            "max_time=1s is too short", "give it more time", cwd=d)
    refusal(train.main, ["--dataset=verse", "--out_dir=out-short2", "--max_time=soon", *tiny_args],
            "max_time='soon' is not a duration", cwd=d)


# ----------------------------------------------------------------------------------------------
# The schedules: --schedule=cosine|linear|wsd

def schedule(kind, **kw):
    """A config of the schedule kind: a peak of 1 (the factor is the rate), min_lr 0.1, warmup 10."""
    return train.TrainConfig(schedule=kind, learning_rate=1.0, min_lr=0.1, warmup_iters=10, **kw)


def cosine_as_it_was(it, cfg):  # lr_factor before the schedules had a choice
    if not cfg.decay_lr:
        return 1.0
    if it < cfg.warmup_iters:
        return (it + 1) / (cfg.warmup_iters + 1)
    low = cfg.min_lr / cfg.learning_rate if cfg.learning_rate else 1.0
    if it > cfg.lr_decay_iters:
        return low
    ratio = (it - cfg.warmup_iters) / max(1, cfg.lr_decay_iters - cfg.warmup_iters)
    return low + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (1.0 - low)


def test_cosine_stays_the_default_and_is_unchanged_bit_for_bit():
    assert train.TrainConfig().schedule == "cosine"
    for kw in (dict(), dict(warmup_iters=0, lr_decay_iters=7), dict(warmup_iters=50, lr_decay_iters=50),
               dict(min_lr=0.0, learning_rate=3e-4), dict(learning_rate=0.0), dict(decay_lr=False)):
        cfg = train.TrainConfig(**dict(dict(warmup_iters=10, lr_decay_iters=110), **kw))
        assert [optim.lr_factor(i, cfg) for i in range(200)] == [cosine_as_it_was(i, cfg) for i in range(200)]


@pytest.mark.parametrize("kind, decay_frac", [("cosine", 0.2), ("linear", 0.2), ("wsd", 0.2), ("wsd", 1.0),
                                              ("wsd", 0.001)])
def test_every_schedule_ends_at_min_lr_at_lr_decay_iters_and_after(kind, decay_frac):
    cfg = schedule(kind, lr_decay_iters=110, decay_frac=decay_frac)  # wsd 0.001: a decay of 0.11 iterations
    assert [optim.lr_factor(i, cfg) for i in range(110, 160)] == [0.1] * 50
    assert optim.lr_factor(10, cfg) == 1.0 and optim.lr_factor(109, cfg) > 0.1  # the peak after the warmup


def test_linear_falls_by_equal_steps_from_the_peak_and_never_rises():
    cfg = schedule("linear", lr_decay_iters=110)
    f = [optim.lr_factor(i, cfg) for i in range(200)]
    assert f[:10] == [(i + 1) / 11 for i in range(10)]  # the same warmup
    assert [a - b for a, b in zip(f[10:110], f[11:111])] == pytest.approx([0.9 / 100] * 100)
    assert all(a >= b for a, b in zip(f[10:], f[11:])) and f[60] == pytest.approx(0.55)


def test_wsd_is_flat_at_the_peak_then_linear_over_the_last_decay_frac():
    cfg = schedule("wsd", lr_decay_iters=1000, decay_frac=0.2)
    f = [optim.lr_factor(i, cfg) for i in range(1100)]
    assert optim.decay_start(cfg) == 800 and f[:10] == [(i + 1) / 11 for i in range(10)]
    assert f[10:801] == [1.0] * 791  # flat at the peak until the last 20%
    assert [a - b for a, b in zip(f[800:1000], f[801:1001])] == pytest.approx([0.9 / 200] * 200)
    assert f[900] == pytest.approx(0.55) and f[1000] == 0.1
    # the whole run's decay: WSD is the linear schedule
    whole, line = schedule("wsd", lr_decay_iters=1000, decay_frac=1.0), schedule("linear", lr_decay_iters=1000)
    assert [optim.lr_factor(i, whole) for i in range(1100)] == [optim.lr_factor(i, line) for i in range(1100)]


def test_wsd_rates_do_not_depend_on_the_length_before_the_shorter_runs_decay():
    short, long = (schedule("wsd", lr_decay_iters=n, max_iters=n, decay_frac=0.2) for n in (1000, 1500))
    assert [optim.lr_factor(i, short) for i in range(801)] == [optim.lr_factor(i, long) for i in range(801)]
    assert optim.lr_factor(801, short) < optim.lr_factor(801, long) == 1.0
    for kind in ("cosine", "linear"):  # theirs move as soon as the warmup ends
        short, long = (schedule(kind, lr_decay_iters=n) for n in (1000, 1500))
        assert optim.lr_factor(11, short) < optim.lr_factor(11, long)


# --max_time under WSD: a fake clock drives Budget as train.py's loop does

def run_on_a_clock(cfg, budget, clock, pace, it=0, until=None):
    """train.py's loop without the training: each iteration takes pace(it) seconds of clock, an
    evaluation (every eval_interval) 1 s; the Budget's fits set max_iters and lr_decay_iters. The
    factor of every step, the fits as (iteration, length before, length after), and the last cfg."""
    factors, fits = {}, []
    while True:
        factors[it] = optim.lr_factor(it, cfg)
        if it % cfg.eval_interval == 0 or it == cfg.max_iters:
            clock[0] += 1.0
            budget.evaluated(it, 1.0)
        if it >= cfg.max_iters or it == until:
            return factors, fits, cfg
        clock[0] += pace(it)
        it += 1
        if (n := budget.fit(cfg, it, torch.device("cpu"))) is not None:
            fits.append((it, cfg.lr_decay_iters, n))
            cfg = dataclasses.replace(cfg, max_iters=n, lr_decay_iters=n)


def slowing(it):  # faster after 300 iterations (the run gets longer), twice as slow after 1400 (in the decay)
    return 0.05 if it < 300 else 0.04 if it < 1400 else 0.08


@pytest.mark.parametrize("kind", ["wsd", "cosine"])
def test_under_wsd_the_budget_refits_the_length_only_before_the_decay_starts(monkeypatch, kind):
    clock = [10.0]
    monkeypatch.setattr(optim.time, "time", lambda: clock[0])
    cfg = schedule(kind, eval_interval=100, max_time="100s", decay_frac=0.2)
    factors, fits, cfg = run_on_a_clock(cfg, optim.Budget(100, 0, 0.0), clock, slowing)
    first, *refits = fits
    assert refits and refits[0][2] > first[2]  # longer once it runs faster
    if kind == "cosine":  # today's rule: shorter when it slows down, late in the run too
        assert refits[-1][0] > 1400 and refits[-1][2] < refits[-1][1]
        return
    start = optim.decay_start(cfg)
    assert start < 1400 and all(it < optim.decay_start(schedule(kind, lr_decay_iters=old, decay_frac=0.2))
                                for it, old, _ in refits)
    assert clock[0] > 100  # it slowed down in the decay, which ran whole: the run ended late
    assert [factors[i] for i in range(10, int(start) + 1)] == [1.0] * (int(start) - 9)  # no refit moved a rate


def test_under_wsd_a_refit_never_starts_the_decay_before_now(monkeypatch):
    """At 300 of 400 iterations (the decay starts at 320), an iteration taking 20 times longer would
    fit 336 iterations, whose decay would have begun at 268.8: the length becomes 375, whose decay
    starts now. Once the decay has begun (at 350), neither a faster nor a slower pace moves it."""
    clock = [10.0]
    monkeypatch.setattr(optim.time, "time", lambda: clock[0])
    cfg = schedule("wsd", eval_interval=50, max_time="100s", max_iters=400, lr_decay_iters=400, decay_frac=0.2)
    for it, pace, want in ((300, 1.0, 375), (350, 1.0, None), (350, 0.01, None)):
        clock[0] = 10.0
        budget = optim.Budget(100, 0, 0.0, fitted=True)
        budget.evaluated(it - 50, 1.0)
        clock[0] += 50 * pace
        assert budget.fit(cfg, it, torch.device("cpu")) == want
    fitted = dataclasses.replace(cfg, max_iters=375, lr_decay_iters=375)
    assert [optim.lr_factor(i, fitted) for i in range(301)] == [optim.lr_factor(i, cfg) for i in range(301)]


@pytest.mark.parametrize("kind", ["cosine", "linear", "wsd"])
def test_a_resume_continues_the_same_sequence_of_rates(kind):
    cfg = schedule(kind, lr_decay_iters=500)
    straight = [optim.lr_factor(i, cfg) for i in range(600)]
    resumed = train.TrainConfig(**dataclasses.asdict(cfg))  # as a checkpoint keeps it
    assert [optim.lr_factor(i, resumed) for i in range(250, 600)] == straight[250:]


def test_a_resumed_wsd_run_whose_length_was_fitted_continues_the_same_rates(monkeypatch):
    """A --max_time run under WSD stopped at an evaluation in its decay and resumed, as train.py
    resumes it (max_iters and lr_decay_iters from the checkpoint's fitted_iters), by a process whose
    iterations run twice as slow: every rate from there on is the straight run's."""
    clock = [10.0]
    monkeypatch.setattr(optim.time, "time", lambda: clock[0])
    cfg = schedule("wsd", eval_interval=100, max_time="100s", decay_frac=0.2)
    straight, fits, fitted = run_on_a_clock(cfg, optim.Budget(100, 0, 0.0), clock, slowing)
    k = math.ceil(optim.decay_start(fitted) / 100) * 100  # the first evaluation in the decay
    clock[0] = 10.0
    resumed_cfg = dataclasses.replace(cfg, max_iters=fitted.max_iters, lr_decay_iters=fitted.lr_decay_iters)
    resumed, refits, last = run_on_a_clock(resumed_cfg, optim.Budget(100, k, 0.0, fitted=True), clock,
                                           lambda it: 0.1, it=k)
    assert len(fits) > 1 and not refits and last.max_iters == fitted.max_iters
    assert resumed == {i: straight[i] for i in range(k, fitted.max_iters + 1)}
