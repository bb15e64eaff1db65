"""LoRA (lora.py): the update starts at zero, only the adapters train, the base weights stay as they
were, a run resumes exactly, and a LoRA run samples (merged) what its adapted model computes."""

import copy
import json

import pytest
import torch

import checkpoint
import hf
import train
from generate import decode_layout
from lora import LoRALinear, add_lora, merge_lora, merged_state
from quantize import quantize_int4, quantize_int8


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


@pytest.mark.parametrize("quantize", [quantize_int8, quantize_int4])
def test_quantizing_refuses_live_adapters_and_keeps_them_merged(quantize, tiny_model):
    """LoRALinear is an nn.Linear, but not a plain one (quantize.plain_linear): quantizing it would keep
    its weight and drop its update. So quantizing refuses it in one line, and after merge_lora the
    quantized model computes the adapted model's logits, not the base's."""
    base = tiny_model(pos="rope", n_embd=128, n_head=4)
    model = copy.deepcopy(base)
    add_lora(model, rank=2, alpha=4, targets=("c_attn", "c_fc", "c_proj"))
    for m in model.modules():
        if isinstance(m, LoRALinear):
            torch.nn.init.normal_(m.lora_B, std=0.5)  # a trained update, large beside the rounding
    with pytest.raises(ValueError, match=r"^decoder\.h\.0\.attn\.c_attn is a LoRALinear, whose update quantizing "
                                         r"would drop: merge it first \(lora\.merge_lora\(model\)\)$"):
        quantize(copy.deepcopy(model))
    idx = torch.randint(0, 61, (2, 10))
    with torch.no_grad():
        adapted = model(idx)[0]
        merged = merge_lora(copy.deepcopy(model))
        assert not any(isinstance(m, LoRALinear) for m in merged.modules())
        torch.testing.assert_close(merged(idx)[0], adapted, rtol=1e-5, atol=1e-5)  # fp32, one product reordered
        laid_out = decode_layout(copy.deepcopy(merged))  # its layers plain again: laid out too
        torch.testing.assert_close(laid_out(idx[:1, :1])[0], adapted[:1, :1], rtol=1e-5, atol=1e-5)
        quantized, quantized_base = quantize(merged)(idx)[0], quantize(base)(idx)[0]
    # the quantized model is the adapted one within its rounding: nearer to it than the base, quantized alike
    assert (quantized - adapted).abs().mean() < 0.5 * (quantized_base - adapted).abs().mean()


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


LLAMA = ["--pos=rope", "--norm=rmsnorm", "--mlp=swiglu", "--bias=False", "--tie_embeddings=False", "--n_kv_head=1"]
BERT = ["--arch=encoder", "--norm_first=False"]
T5 = ["--arch=encoder-decoder", "--pos=relative", "--norm=rmsnorm", "--mlp=relu", "--bias=False"]
AUTO = dict(gpt2="AutoModelForCausalLM", llama="AutoModelForCausalLM", bert="AutoModelForMaskedLM",
            t5="AutoModelForSeq2SeqLM")


@pytest.mark.parametrize("family, arch, targets, modules", [
    ("gpt2", [], "c_attn,c_proj", ["attn.c_attn", "attn.c_proj", "mlp.c_proj"]),  # GPT-2's Conv1D layers
    ("llama", LLAMA, "c_attn,c_fc", ["mlp.gate_proj", "mlp.up_proj", "self_attn.k_proj", "self_attn.q_proj",
                                     "self_attn.v_proj"]),  # our fused q, k, v and up, gate: B's rows split
    ("bert", BERT, "c_attn,c_fc", ["attention.self.key", "attention.self.query", "attention.self.value",
                                   "intermediate.dense"]),
    # T5's queries carry 1/sqrt(head size) and its cross-attention's k, v are our one c_kv: B's rows scaled, split
    ("t5", T5, "c_attn,c_kv,c_proj", ["layer.0.SelfAttention.k", "layer.0.SelfAttention.o", "layer.0.SelfAttention.q",
                                      "layer.0.SelfAttention.v", "layer.1.DenseReluDense.wo",
                                      "layer.1.EncDecAttention.k", "layer.1.EncDecAttention.o",
                                      "layer.1.EncDecAttention.v", "layer.2.DenseReluDense.wo"]),
], ids=["gpt2", "llama", "bert", "t5"])
def test_an_exported_adapter_on_the_exported_base_computes_the_runs_logits_in_peft(family, arch, targets, modules,
                                                                                   workdir, in_process, tiny_args):
    d, _ = workdir
    out = f"out-lora-{family}"
    args = ["--dataset=verse", f"--out_dir={out}", "--lora_rank=4", "--lora_alpha=8", f"--lora_targets={targets}",
            "--max_iters=4", "--eval_interval=4", *arch, *tiny_args]
    assert in_process(train.main, args, cwd=d) == 0
    argv = ["export", out, f"hf-{family}", f"--adapter=adapter-{family}", "--ckpt=latest"]
    assert in_process(hf.main, argv, cwd=d) == 0
    config = json.loads((d / f"adapter-{family}" / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"], config["target_modules"]) == ("LORA", 4, 8, modules)
    assert config["fan_in_fan_out"] == (family == "gpt2")
    assert config["task_type"] == dict(bert=None, t5="SEQ_2_SEQ_LM").get(family, "CAUSAL_LM")
    merged, ckpt = checkpoint.load_run(str(d / out), "latest")
    base = hf.from_pretrained(d / f"hf-{family}")  # the run's start: the weights no step moved
    for k, t in base.state_dict().items():  # BERT always has biases: a run without reads back zeros
        want = ckpt["model"][k][:len(t)] if k in ckpt["model"] else torch.zeros_like(t)
        # exact but for T5 v1.0's decoder norm, divided by sqrt(n_embd) on the way out: two fp32 roundings
        torch.testing.assert_close(t, want, rtol=2.5e-7, atol=0, msg=k)
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    theirs = getattr(transformers, AUTO[family]).from_pretrained(d / f"hf-{family}")
    theirs = peft.PeftModel.from_pretrained(theirs, d / f"adapter-{family}").eval()
    idx, tgt = torch.randint(0, 40, (1, 8)), torch.randint(0, 40, (1, 5))
    with torch.no_grad():
        if family == "t5":
            got, (ours, plain) = theirs(input_ids=idx, decoder_input_ids=tgt).logits, (
                m.eval()(tgt, src=idx)[0] for m in (merged, base))
        else:
            got, (ours, plain) = theirs(input_ids=idx).logits, (m.eval()(idx)[0] for m in (merged, base))
        n = theirs.config.vocab_size
        torch.testing.assert_close(got, ours[..., :n], rtol=1e-4, atol=1e-4)
        assert (plain[..., :n] - ours[..., :n]).abs().max() > 1e-3  # the adapters matter


def test_an_adapter_export_of_a_run_without_lora_is_refused(trained_once, refusal, tmp_path):
    refusal(hf.main, ["export", str(trained_once), str(tmp_path / "hf"), f"--adapter={tmp_path / 'a'}"],
            "is not a LoRA run", "without --adapter")


def test_lora_targets_that_name_no_layer_are_refused_in_one_line(workdir, refusal, tiny_args):
    d, _ = workdir
    refusal(train.main, ["--dataset=verse", "--out_dir=out-lora-bad", "--lora_rank=2", "--lora_targets=qkv",
                         *tiny_args], "--lora_targets=qkv: no Linear layer is named qkv", "c_attn", cwd=d)
