"""optim.py: Muon's orthogonalisation lands every singular value near 1, batched as one at a time;
MuonAdamW puts the blocks' matrices on Muon and every other parameter on AdamW, once each; its
momentum warms up; a run with --optimizer=muon learns and resumes exactly, its checkpoints loading
with weights_only=True. (The schedule and AdamW's runs: test_train.py.)"""

import shutil

import pytest
import torch

import optim
import train


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
