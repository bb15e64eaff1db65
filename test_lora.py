"""LoRA (lora.py): the update starts at zero, only the adapters train, the base weights stay as they
were, a run resumes exactly, and a LoRA run samples (merged) what its adapted model computes."""

import pytest
import torch

import checkpoint
import hf
import train
from lora import LoRALinear, add_lora, merged_state


@pytest.mark.parametrize("arch", ["decoder", "encoder", "encoder-decoder", "prefix-lm"])
def test_a_new_lora_model_is_the_base_model_and_only_b_gets_a_first_gradient(arch, tiny_model):
    base, model = tiny_model(arch=arch, pos="rope"), tiny_model(arch=arch, pos="rope")
    names = add_lora(model, rank=4, alpha=8)
    assert names and all(isinstance(model.get_submodule(n), LoRALinear) for n in names)
    idx = torch.randint(0, 61, (2, 10))
    src = idx if arch == "encoder-decoder" else None
    torch.testing.assert_close(model(idx, src=src)[0], base(idx, src=src)[0], rtol=0, atol=0)  # B = 0: exactly
    model(idx, idx, src=src)[1].backward()
    layer = model.get_submodule(names[0])
    assert layer.lora_A.grad.abs().max() == 0 and layer.lora_B.grad.abs().max() > 0  # dL/dA = Bᵀ(...) = 0 at first
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable == [f"{n}.{ab}" for n in names for ab in ("lora_A", "lora_B")]


def test_merging_adds_the_update_into_the_weight(tiny_model):
    model = tiny_model(pos="rope")
    add_lora(model, rank=2, alpha=4)
    for m in model.modules():
        if isinstance(m, LoRALinear):
            torch.nn.init.normal_(m.lora_B)  # a trained update
    plain = tiny_model(pos="rope")
    plain.load_state_dict(merged_state(model.state_dict(), scaling=4 / 2))
    idx = torch.randint(0, 61, (2, 10))
    torch.testing.assert_close(plain(idx)[0], model(idx)[0], rtol=1e-5, atol=1e-5)  # fp32, one product reordered


def test_a_lora_run_trains_only_its_adapters_resumes_exactly_and_samples_merged(workdir, in_process, tiny_args,
                                                                                capsys):
    d, _ = workdir
    args = ["--dataset=verse", "--lora_rank=4", "--lora_targets=c_attn,c_fc", "--eval_interval=4", *tiny_args]
    ckpt = lambda out: torch.load(d / out / "ckpt.pt", weights_only=True)  # noqa: E731
    assert in_process(train.main, ["--out_dir=out-lora-8", "--max_iters=8", *args], cwd=d) == 0
    assert "lora: 4 layers adapted" in capsys.readouterr().out
    assert in_process(train.main, ["--out_dir=out-lora", "--max_iters=4", *args], cwd=d) == 0
    assert in_process(train.main, ["--out_dir=out-lora", "--max_iters=8", "--init_from=resume", *args], cwd=d) == 0
    one, resumed = ckpt("out-lora-8")["model"], ckpt("out-lora")["model"]
    assert all(torch.equal(one[k], resumed[k]) for k in one)  # an exact resume: the adapters' moments too
    assert len(ckpt("out-lora-8")["optimizer"]["state"]) == 2 * 4  # AdamW holds A and B of 4 layers, nothing else
    torch.manual_seed(1337)  # the run's seed: the base weights it drew, which no step moved
    fresh = train.Transformer(train.ModelConfig(**ckpt("out-lora-8")["model_config"]))
    assert all(torch.equal(p, one[k]) for k, p in fresh.state_dict().items())
    assert any(one[k].abs().max() > 0 for k in one if k.endswith("lora_B"))  # the updates did train
    model, _ = checkpoint.load_run(str(d / "out-lora-8"), "latest")  # as sample.py and hf.py export load it
    assert not any(isinstance(m, LoRALinear) for m in model.modules())
    adapted = train.Transformer(model.config)
    add_lora(adapted, 4, 16.0, targets=("c_attn", "c_fc"))
    adapted.load_state_dict(one)
    idx = torch.randint(0, 40, (1, 8))
    torch.testing.assert_close(model.eval()(idx)[0], adapted.eval()(idx)[0], rtol=1e-5, atol=1e-5)
    # hf.py export writes the merged model, which transformers computes alike
    assert in_process(hf.main, ["export", "out-lora-8", "hf-lora", "--ckpt=latest"], cwd=d) == 0
    transformers = pytest.importorskip("transformers")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(d / "hf-lora").eval()
    with torch.no_grad():
        torch.testing.assert_close(theirs(idx).logits, model(idx)[0][..., :theirs.config.vocab_size], rtol=1e-4,
                                   atol=1e-4)


def test_lora_targets_that_name_no_layer_are_refused_in_one_line(workdir, refusal, tiny_args):
    d, _ = workdir
    refusal(train.main, ["--dataset=verse", "--out_dir=out-lora-bad", "--lora_rank=2", "--lora_targets=qkv",
                         *tiny_args], "--lora_targets=qkv: no Linear layer is named qkv", "c_attn", cwd=d)
