"""Hugging Face checkpoints (hf.py): tiny random models of each family read with HF's logits and
greedy outputs, written so that transformers loads them with ours, and each refusal in one line.
Nothing is downloaded: every model is built from a config here."""

import dataclasses
import json
import os
import re

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing can be downloaded here; nothing should try

import numpy as np
import pytest
import torch

import checkpoint
import common
import data
import hf
import prepare
import sample
import tokenizer
import train
from generate import generate
from model import ModelConfig, Transformer

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

V = 96  # vocabulary of every tiny model


def randomize(model, seed=0):
    """Every tensor random, norm scales and biases included, so a swapped or missed one shows."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    return model.eval()


def hf_model(family, **kw):
    """A tiny random transformers model of family (width 64, 2 layers), in eval mode."""
    T = transformers
    if family == "gpt2":
        m = T.GPT2LMHeadModel(T.GPT2Config(vocab_size=V, n_positions=64, n_embd=64, n_layer=2, n_head=4, **kw))
    elif family == "bert":
        m = T.BertForMaskedLM(T.BertConfig(vocab_size=V, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                           intermediate_size=128, max_position_embeddings=64, **kw))
    elif family in ("t5", "t5v1.1"):
        gated = family == "t5v1.1"
        m = T.T5ForConditionalGeneration(T.T5Config(vocab_size=V, d_model=64, d_kv=16, d_ff=128, num_layers=2,
                                                    num_heads=4, feed_forward_proj="gated-gelu" if gated else "relu",
                                                    tie_word_embeddings=not gated, decoder_start_token_id=0, **kw))
        if gated:  # flan-t5's layout: its own output matrix
            m.lm_head.weight = torch.nn.Parameter(torch.empty(V, 64))
    else:
        cls = {"llama": (T.LlamaConfig, T.LlamaForCausalLM), "mistral": (T.MistralConfig, T.MistralForCausalLM)}[family]
        m = cls[1](cls[0](vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, **kw))
    m = randomize(m)
    if family != "bert":
        m.generation_config.eos_token_id = None  # generate all 20 tokens, as ours does
        m.generation_config.pad_token_id = 0
    return m


def saved(m, path, **kw):
    m.save_pretrained(path, **kw)
    return path


def tokens(B, T, seed=1):
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


def padded(B, T):
    """Tokens and a mask with the second row's last 3 positions padding."""
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, -3:] = 0
    return tokens(B, T) * mask, mask


DECODERS = {  # name: (family, HF config, what our config reads from it)
    "gpt2": ("gpt2", {}, dict(n_head=4, n_kv_head=4, window=0, tie_embeddings=True)),
    "gpt2-untied": ("gpt2", dict(tie_word_embeddings=False), dict(tie_embeddings=False)),
    "llama-gqa-untied": ("llama", dict(rope_theta=50000.0),
                         dict(n_head=4, n_kv_head=2, rope_theta=50000.0, window=0, tie_embeddings=False)),
    "llama-gqa-tied": ("llama", dict(rope_theta=50000.0, tie_word_embeddings=True),
                       dict(n_kv_head=2, rope_theta=50000.0, tie_embeddings=True)),
    "llama-linear-rope-scaling": ("llama", dict(rope_parameters=dict(rope_type="linear", factor=2.0, rope_theta=5e4)),
                                  dict(rope_theta=5e4, rope_scaling=2.0)),
    "mistral-window-8": ("mistral", dict(sliding_window=8), dict(n_kv_head=2, window=8)),
}


# ----------------------------------------------------------------------------------------------
# Reading

@pytest.mark.parametrize("name", DECODERS)
def test_decoder_config_reads_heads_rope_window_and_tying_and_the_logits_equal_hfs(name, tmp_path):
    family, kw, read = DECODERS[name]
    theirs = hf_model(family, **kw)
    ours = hf.from_pretrained(saved(theirs, tmp_path))
    assert ours.config.tie_embeddings == theirs.config.tie_word_embeddings
    assert {k: getattr(ours.config, k) for k in read} == read  # Llama's grouped heads and rope_theta; Mistral's window
    idx = tokens(2, 24)  # longer than Mistral's window of 8
    with torch.no_grad():
        torch.testing.assert_close(ours(idx)[0], theirs(idx).logits, atol=1e-4, rtol=0)


def test_bert_masked_lm_logits_equal_hfs_with_padding(tmp_path):
    theirs = hf_model("bert")
    ours = hf.from_pretrained(saved(theirs, tmp_path))
    assert ours.config.lm_head_bias and ours.config.tie_embeddings
    idx, mask = padded(2, 20)
    with torch.no_grad():
        want = theirs(input_ids=idx, attention_mask=mask).logits
        got = ours(idx, mask=mask.bool())[0]
    real = mask.bool()  # padding positions' outputs mean nothing
    torch.testing.assert_close(got[real], want[real], atol=1e-4, rtol=0)


@pytest.mark.parametrize("version", ["t5", "t5v1.1"])
def test_t5_logits_and_greedy_generation_from_a_padded_source_equal_hfs(version, tmp_path):
    theirs = hf_model(version)
    ours = hf.from_pretrained(saved(theirs, tmp_path))
    assert ours.config.mlp == ("geglu" if version == "t5v1.1" else "relu")
    assert ours.config.tie_embeddings == (version == "t5")
    src, mask = padded(2, 12)
    tgt = tokens(2, 9, seed=2)
    with torch.no_grad():
        want = theirs(input_ids=src, attention_mask=mask, decoder_input_ids=tgt).logits
        got = ours(tgt, src=src, src_mask=mask.bool())[0]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    want = theirs.generate(input_ids=src, attention_mask=mask, do_sample=False, max_new_tokens=20)
    start = torch.zeros(2, 1, dtype=torch.long)  # T5 starts decoding from its pad token, 0
    assert torch.equal(generate(ours, start, 20, temperature=0, src=src, src_mask=mask.bool()), want)


@pytest.mark.parametrize("name", ["gpt2", "llama-gqa-untied", "llama-gqa-tied", "mistral-window-8"])
def test_greedy_generation_through_our_kv_cache_equals_hfs(name, tmp_path):
    family, kw, _ = DECODERS[name]
    theirs = hf_model(family, **kw)
    ours = hf.from_pretrained(saved(theirs, tmp_path))
    idx = tokens(2, 6)  # 6 + 20 tokens: past Mistral's window of 8
    want = theirs.generate(idx, attention_mask=torch.ones_like(idx), do_sample=False, max_new_tokens=20)
    assert torch.equal(generate(ours, idx, 20, temperature=0), want)


def test_sharded_safetensors_load(tmp_path):
    theirs = hf_model("llama")
    saved(theirs, tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").exists() and not (tmp_path / "model.safetensors").exists()
    ours = hf.from_pretrained(tmp_path)
    idx = tokens(1, 10)
    with torch.no_grad():
        torch.testing.assert_close(ours(idx)[0], theirs(idx).logits, atol=1e-4, rtol=0)


def test_a_pytorch_model_bin_loads_through_weights_only(tmp_path):
    # as GPT2Model saved it: no "transformer." prefix, tied output matrix absent, causal-mask buffers
    theirs = hf_model("gpt2")
    saved(theirs, tmp_path)
    os.remove(tmp_path / "model.safetensors")
    state = {k.removeprefix("transformer."): v for k, v in theirs.state_dict().items() if k != "lm_head.weight"}
    state |= {f"h.{i}.attn.bias": torch.ones(1, 1, 64, 64).tril() for i in range(2)}
    torch.save(state, tmp_path / "pytorch_model.bin")
    ours = hf.from_pretrained(tmp_path)
    idx = tokens(1, 10)
    with torch.no_grad():
        torch.testing.assert_close(ours(idx)[0], theirs(idx).logits, atol=1e-4, rtol=0)


class NotATensor:
    pass


def test_a_pytorch_model_bin_that_would_run_code_is_refused(tmp_path):
    saved(hf_model("gpt2"), tmp_path)
    os.remove(tmp_path / "model.safetensors")
    torch.save({"x": NotATensor()}, tmp_path / "pytorch_model.bin")
    with pytest.raises(hf.HFError, match="run code"):
        hf.from_pretrained(tmp_path)


def test_dtype_casts_the_weights(tmp_path):
    ours = hf.from_pretrained(saved(hf_model("llama"), tmp_path), dtype=torch.bfloat16)
    assert {p.dtype for p in ours.parameters()} == {torch.bfloat16}


# ----------------------------------------------------------------------------------------------
# Writing

EXPORTS = {  # name: (our config, the Auto class that loads it)
    "gpt2": (dict(pos="learned"), "AutoModelForCausalLM"),
    "nanogpt-no-bias-untied": (dict(bias=False, gelu_approximate="none", tie_embeddings=False), "AutoModelForCausalLM"),
    "llama-gqa-untied": (dict(pos="rope", norm="rmsnorm", mlp="swiglu", bias=False, n_kv_head=2, tie_embeddings=False,
                              rope_theta=50000.0), "AutoModelForCausalLM"),
    "llama-tied-rope-scaling": (dict(pos="rope", norm="rmsnorm", mlp="swiglu", bias=False, rope_scaling=2.0),
                                "AutoModelForCausalLM"),
    "mistral-window-8": (dict(pos="rope", norm="rmsnorm", mlp="swiglu", bias=False, n_kv_head=2, window=8,
                              tie_embeddings=False), "AutoModelForCausalLM"),
    "bert": (dict(arch="encoder", norm_first=False, lm_head_bias=True, norm_eps=1e-12), "AutoModelForMaskedLM"),
    "bert-no-biases": (dict(arch="encoder", norm_first=False, bias=False), "AutoModelForMaskedLM"),
    "t5-v1.0": (dict(arch="encoder-decoder", pos="relative", norm="rmsnorm", mlp="relu", bias=False, norm_eps=1e-6),
                "AutoModelForSeq2SeqLM"),
    "t5-v1.1": (dict(arch="encoder-decoder", pos="relative", norm="rmsnorm", mlp="geglu", bias=False,
                     tie_embeddings=False, norm_eps=1e-6), "AutoModelForSeq2SeqLM"),
}


def logits_of_both(ours, theirs):
    """Our logits and transformers' on the same padded batch (an encoder-decoder's: a source and targets)."""
    idx, mask = padded(2, 20)
    with torch.no_grad():
        if ours.config.arch == "encoder-decoder":
            tgt = tokens(2, 9, seed=2)
            return ours(tgt, src=idx, src_mask=mask.bool())[0], theirs(idx, attention_mask=mask,
                                                                       decoder_input_ids=tgt).logits
        return ours(idx)[0], theirs(idx).logits


@pytest.mark.parametrize("name", EXPORTS)
def test_export_loads_in_transformers_with_our_logits_and_reads_back_exactly(name, tmp_path, tiny_model):
    kw, auto = EXPORTS[name]
    # heads of 16: T5 folds 1/sqrt(head_size) into its queries' weights, exactly only for a power of 4
    ours = randomize(tiny_model(vocab_size=V, n_embd=64, **kw))
    hf.save_pretrained(ours, tmp_path)
    theirs = getattr(transformers, auto).from_pretrained(tmp_path).eval()
    got, want = logits_of_both(ours, theirs)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    back = hf.from_pretrained(tmp_path)
    ours_params, back_params = dict(ours.named_parameters()), dict(back.named_parameters())
    assert back.config.tie_embeddings == ours.config.tie_embeddings
    for n, p in ours_params.items():
        assert torch.equal(back_params[n], p), n
    for n in back_params.keys() - ours_params.keys():  # GPT-2 and BERT always have biases: ours were none
        assert not ours.config.bias and not back_params[n].any(), n


def test_export_command_writes_a_runs_model_and_its_tokenizer(tmp_path, capsys, tiny_model):
    from tokenizers import Tokenizer, models

    from checkpoint import CKPT_KEYS

    tokenizer_json = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]")).to_str()
    for kind, kw in (("hf", {}), ("char", dict(arch="encoder-decoder", pos="relative", norm="rmsnorm", mlp="relu",
                                               bias=False, vocab_size=128))):
        model = randomize(tiny_model(**dict(vocab_size=V) | kw))
        meta = dict(tokenizer=kind, vocab_size=3) | (dict(tokenizer_json=tokenizer_json) if kind == "hf"
                                                     else dict(vocab=["a", "b", "c"]))
        ckpt = {k: None for k in CKPT_KEYS} | dict(model=model.state_dict(), model_config=vars(model.config),
                                                   tokens=data.special_tokens(3), meta=meta, iter_num=0,
                                                   best_val_loss=1.0, evaluated_at=0, val_loss=1.0)
        (tmp_path / kind).mkdir()
        torch.save(ckpt, tmp_path / kind / "ckpt.pt")
        assert hf.main(["export", str(tmp_path / kind), str(tmp_path / f"{kind}-hf")]) == 0
        assert f"{tmp_path / kind / 'ckpt.pt'}: iteration 0, val loss 1.0000" in capsys.readouterr().out
    assert (tmp_path / "hf-hf" / "tokenizer.json").read_text() == tokenizer_json  # a model's own, as it came
    assert tokenizer.tokenizer_meta(tmp_path / "hf-hf") == dict(tokenizer="hf", tokenizer_json=tokenizer_json)
    # characters, then the mask (unused by span corruption), the start token and 100 sentinels: 105 of 128 ids
    assert json.loads((tmp_path / "char-hf" / "config.json").read_text())["vocab_size"] == 105
    assert tokenizer.tokenizer_meta(tmp_path / "char-hf") == dict(tokenizer="char", vocab=["a", "b", "c"])
    loaded = transformers.AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "char-hf")
    assert loaded.config.decoder_start_token_id == 4
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "char-hf")
    assert hf_tok("ab<extra_id_0>c").input_ids == [0, 1, 5, 2] and hf_tok.decode([4, 0, 104]) == "<|start|>a<extra_id_99>"


def test_export_command_errors_are_one_line_with_exit_2(tmp_path, capsys):
    with pytest.raises(common.UsageError, match="^no checkpoint at .*nothing"):
        hf.main(["export", str(tmp_path / "nothing"), str(tmp_path / "out")])
    with pytest.raises(common.UsageError, match="command='import' is not known: choose 'export'"):
        hf.main(["import"])
    with pytest.raises(common.UsageError, match="did you mean --ckpt"):
        hf.main(["export", "a", "b", "--ckp=latest"])
    assert hf.main(["--help"]) == 0 and 'ckpt: str = "best"' in capsys.readouterr().out


def test_the_tokenizer_of_a_directory(tmp_path):
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=64, n_layer=1, n_head=4))  # GPT-2's vocabulary
    assert tokenizer.tokenizer_meta(saved(gpt2, tmp_path / "gpt2")) == dict(tokenizer="gpt2")
    with pytest.raises(common.UsageError, match="tokenizer.json"):  # a GPT-2 of another vocabulary
        tokenizer.tokenizer_meta(saved(hf_model("gpt2"), tmp_path / "gpt2-char"))
    tmp_path = saved(hf_model("llama"), tmp_path / "llama")
    with pytest.raises(common.UsageError, match="tokenizer.json"):
        tokenizer.tokenizer_meta(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{}")
    assert tokenizer.tokenizer_meta(tmp_path) == dict(tokenizer="hf", tokenizer_json="{}")


# ----------------------------------------------------------------------------------------------
# Refusals: one line, naming the feature

def config_dir(tmp_path, **config):
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


LLAMA = dict(model_type="llama", vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4)


@pytest.mark.parametrize("config, feature", [
    (LLAMA | dict(rope_scaling=dict(rope_type="llama3", factor=8.0)), "'llama3'"),
    (LLAMA | dict(rope_parameters=dict(rope_type="yarn", factor=4.0, rope_theta=1e4)), "'yarn'"),
    (LLAMA | dict(attention_bias=True), "attention_bias"),
    (LLAMA | dict(mlp_bias=True), "mlp_bias"),
    (LLAMA | dict(hidden_act="gelu"), "hidden_act"),
    (LLAMA | dict(model_type="qwen2"), "bias on q, k and v only"),
    (LLAMA | dict(model_type="gpt_neox"), "model_type='gpt_neox'"),
    (dict(model_type="gpt2", scale_attn_by_inverse_layer_idx=True), "scale_attn"),
    (dict(model_type="bert", position_embedding_type="relative_key"), "position_embedding_type"),
    (dict(model_type="t5", feed_forward_proj="gated-silu"), "feed_forward_proj"),
    (dict(model_type="t5", num_layers=2, num_decoder_layers=3), "number of layers"),
])
def test_import_refusals_name_the_feature(config, feature, tmp_path):
    with pytest.raises(hf.HFError, match=feature.replace("(", r"\(")) as e:
        hf.from_pretrained(config_dir(tmp_path, **config))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("config, feature", [
    (dict(pos="alibi"), "pos='alibi'"),
    (dict(pos="sinusoidal", arch="encoder-decoder", norm_first=False, mlp="relu"), "pos='sinusoidal'"),
    (dict(n_expert=4), "mixture of experts"),
    (dict(arch="encoder", pos="rope", norm_first=False), "arch='encoder' with pos='rope'"),
    (dict(pos="rope", norm="rmsnorm", mlp="swiglu"), "bias=True"),
    (dict(n_kv_head=2), "n_kv_head=2"),
    (dict(norm="rmsnorm"), "norm='rmsnorm'"),
    (dict(arch="encoder-decoder", pos="relative", norm="rmsnorm", mlp="geglu", gelu_approximate="none", bias=False),
     "mlp='geglu'"),
    (dict(arch="encoder-decoder", pos="relative", norm="rmsnorm", mlp="swiglu", bias=False), "mlp='swiglu'"),
    (dict(mlp="relu2"), "mlp='relu2'"),
    (dict(qk_norm=True), "qk_norm=True"),
    (dict(pos="rope", norm="rmsnorm", mlp="swiglu", bias=False, logit_softcap=15.0), "logit_softcap=15.0"),
    (dict(attention="linear"), "attention='linear'"),
    (dict(pos="rope", norm="rmsnorm", mlp="swiglu", bias=False, window=8, n_global=2), "n_global=2"),
])
def test_export_refusals_name_the_feature(config, feature, tmp_path, tiny_model):
    with pytest.raises(hf.HFError, match=feature) as e:
        hf.save_pretrained(tiny_model(vocab_size=V, **config), tmp_path)
    assert "\n" not in str(e.value) and not os.listdir(tmp_path)


def test_every_family_has_a_row_for_every_config_field():
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    for family, rows in hf.FIELDS.items():  # a new field needs a row (and a value in OTHER); a renamed one, both
        assert set(rows) == names, (family, names ^ set(rows))


OTHER = {  # for each ModelConfig field, values other than the families' own (the first that differs is tried)
    "arch": ("encoder", "decoder"), "pos": ("rope", "learned"), "vocab_size": (128,), "block_size": (48,),
    "n_layer": (3,), "n_head": (2,), "n_kv_head": (1,), "n_embd": (96,), "head_size": (32,), "mlp_hidden": (96,),
    "rope_theta": (5e5,), "rope_scaling": (2.0,), "rel_buckets": (16,), "rel_max_distance": (20,),
    "norm": ("rmsnorm", "layernorm"), "norm_first": (False, True), "norm_eps": (1e-3,), "mlp": ("geglu", "gelu"),
    "gelu_approximate": ("none", "tanh"), "n_expert": (2,), "expert_top_k": (1,), "moe_aux_weight": (0.5,),
    "attention": ("linear",), "n_features": (16,), "feature_redraw": (10,), "proj_len": (16,), "bucket_size": (8,),
    "n_hashes": (1,), "window": (8, 4), "n_global": (2,), "n_random": (1,), "sparse_block": (8,), "mem_len": (8,),
    "bias": (False, True),
    "dropout": (0.1,), "tie_embeddings": (False, True), "lm_head_bias": (True, False), "qk_norm": (True,),
    "logit_softcap": (15.0,), "zero_init": (True,), "attn_impl": ("math", "sdpa"),
    "score": ("dot", "scaled_dot"), "patch_size": (4,), "image_size": (16,), "channels": (1,), "n_classes": (5,),
}
BASES = {"gpt2": "gpt2", "bert": "bert", "t5": "t5-v1.0", "llama": "llama-gqa-untied", "mistral": "mistral-window-8"}


@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(ModelConfig)])
def test_each_config_field_exports_with_hfs_logits_or_is_refused_by_name(field, tmp_path, tiny_model):
    for family, name in BASES.items():  # each family's EXPORTS case
        kw, auto = EXPORTS[name]
        config = tiny_model(vocab_size=V, n_embd=64, **kw).config
        value = next(v for v in OTHER[field] if v != getattr(config, field))
        try:
            ours = randomize(tiny_model(**dict(vocab_size=V, n_embd=64, **kw) | {field: value}))
        except ValueError:  # a value this family's configs cannot take (n_global without a window): its row alone
            ours = None
            setattr(config, field, value)
        try:
            written = hf.save_pretrained(ours, tmp_path / family) if ours else hf.family_of(config)
        except hf.HFError as e:  # arch and pos choose the family, whose other rows may refuse it first
            assert "\n" not in str(e) and (field in ("arch", "pos") or str(e).startswith(f"{field}=")), str(e)
            continue
        assert hf.FIELDS[written][field] in (hf.CARRIED, hf.HARMLESS) or isinstance(hf.FIELDS[written][field], hf.Rule)
        if ours is None:
            continue
        theirs = getattr(transformers, auto).from_pretrained(tmp_path / family).eval()
        got, want = logits_of_both(ours, theirs)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0, msg=f"{field}={value!r} in {family}")


def test_a_field_added_to_modelconfig_without_a_row_exports_at_its_default_only():
    @dataclasses.dataclass
    class Newer(ModelConfig):
        new_option: int = 0  # what transformers does with it, nobody has said

    for name in BASES.values():
        kw = dict(vocab_size=V, n_layer=2, n_head=4, n_embd=64) | EXPORTS[name][0]
        assert hf.family_of(Newer(**kw)) == hf.family_of(ModelConfig(**kw))
        with pytest.raises(hf.HFError, match=r"^new_option=1: \w+ \(arch=") as e:
            hf.family_of(Newer(**kw, new_option=1))
        assert "\n" not in str(e.value)


def test_a_quantized_model_is_refused(tmp_path, tiny_model):
    from quantize import quantize_int4, quantize_int4_dynamic, quantize_int8, quantize_int8_dynamic, runs_here
    quantizers = [quantize_int8, lambda m: quantize_int4(m, 32), quantize_int8_dynamic]
    w4a8 = runs_here("int4-dynamic", torch.device("cpu"))  # where w4a8.cpp builds
    for quantize in quantizers + [lambda m: quantize_int4_dynamic(m, 32)] * w4a8:
        with pytest.raises(hf.HFError, match="quantized model"):
            hf.save_pretrained(quantize(tiny_model(vocab_size=V)), tmp_path)


def test_a_directory_without_weights_is_refused(tmp_path):
    with pytest.raises(hf.HFError, match="no model.safetensors"):
        hf.from_pretrained(config_dir(tmp_path, model_type="gpt2", vocab_size=V, n_positions=64, n_embd=64,
                                      n_layer=2, n_head=4))


def test_tensors_nanoformer_has_no_place_for_are_refused(tmp_path):
    theirs = hf_model("gpt2")
    state = dict(theirs.state_dict()) | {"transformer.h.0.crossattention.q_attn.weight": torch.zeros(64, 64)}
    saved(theirs, tmp_path, state_dict=state)
    with pytest.raises(hf.HFError, match="crossattention"):
        hf.from_pretrained(tmp_path)


def test_a_name_that_is_not_a_directory_is_downloaded_or_refused_in_one_line(monkeypatch):
    with pytest.raises(hf.HFError, match="could not download 'no-such/model'") as e:
        hf.from_pretrained("no-such/model")  # offline: the hub's error is the cause
    assert "\n" not in str(e.value)
    monkeypatch.setitem(__import__("sys").modules, "huggingface_hub", None)  # as if not installed
    with pytest.raises(hf.HFError, match="pip install huggingface_hub"):
        hf.from_pretrained("gpt2")


# ----------------------------------------------------------------------------------------------
# Hugging Face models on the command line: sample, finetune, export


SEP = "\n---------------\n"  # after each sample sample.py shows


@pytest.fixture(scope="module")
def tiny_gpt2(tmp_path_factory):
    """A random GPT-2 of transformers' (GPT-2's own vocabulary, 64 positions), saved as the hub holds it."""
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_positions=64, n_embd=32, n_layer=2, n_head=2))
    with torch.no_grad():
        for p in model.parameters():  # every tensor random, norms and biases too: a swapped one shows
            p.normal_(0, 0.3)
    path = tmp_path_factory.mktemp("hf") / "tiny-gpt2"
    model.save_pretrained(path)
    return path, model.eval()


def test_sample_continues_a_pretrained_gpt2_as_transformers_greedy_generate_does(workdir, tiny_gpt2, gpt2_bpe,
                                                                                in_process, capsys):
    d, _ = workdir
    path, model = tiny_gpt2
    enc = tokenizer.gpt2_encoding()
    prompt = "ROMEO: what light"
    with torch.no_grad():
        want = model.generate(torch.tensor([enc.encode_ordinary(prompt)]), do_sample=False, max_new_tokens=20,
                              pad_token_id=0)[0, -20:].tolist()
    capsys.readouterr()
    assert in_process(sample.main, [f"--init_from={path}", f"--start={prompt}", "--max_new_tokens=20",
                                    "--temperature=0"], cwd=d) == 0
    assert capsys.readouterr().out.split(SEP)[0] == prompt + enc.decode(want)


def test_train_finetunes_a_pretrained_gpt2_from_its_own_loss_then_resumes_samples_and_exports(
        workdir, tiny_gpt2, gpt2_bpe, run, in_process, refusal, capsys, files_under, losses, tiny_args):
    d, _ = workdir
    path, model = tiny_gpt2
    assert run("prepare.py", "text", "--input=texts/*.txt", "--name=verse_gpt2", f"--tokenizer={path}",
               cwd=d)[0] == 0  # GPT-2's own directory: tiktoken's gpt2 encoding
    args = ["--dataset=verse_gpt2", "--out_dir=out-finetune", f"--init_from={path}", *tiny_args, "--eval_interval=6",
            "--dropout=0.1"]
    code, log, err = run("train.py", *args, "--max_iters=6", cwd=d)  # TINY's block_size=16: 16 of 64 positions
    assert code == 0, err
    # the first evaluation is the pretrained model's own loss on the same batches, through transformers
    val = np.memmap(d / "data" / "verse_gpt2" / "val.bin", dtype=np.uint16, mode="r")
    special = data.special_tokens(50257)
    with torch.no_grad():
        hf_loss = np.mean([torch.nn.functional.cross_entropy(model(b["idx"]).logits.flatten(0, 1),
                                                             b["targets"].flatten())
                           for k in range(2) for b in [data.get_batch(val, "decoder", 4, 16,
                                                                        data.eval_rng(1337, True, 0, k), special,
                                                                        50257)]])
    first, last = (float(v) for v in re.findall(r"step \d+: train loss \S+, val loss ([\d.]+)", log))
    assert first == pytest.approx(hf_loss, abs=1e-4) and last < first
    saved = torch.load(d / "out-finetune" / "ckpt.pt", weights_only=True)
    assert saved["model_config"]["block_size"] == 16 and saved["model_config"]["dropout"] == 0.1
    assert saved["model"]["decoder.wpe.weight"].shape == (16, 32)  # the position table, cropped
    capsys.readouterr()
    assert in_process(train.main, [*args[:2], *tiny_args, "--eval_interval=6", "--dropout=0.1", "--init_from=resume",
                                   "--max_iters=8"], cwd=d) == 0
    assert len(losses(capsys.readouterr().out)) == 2
    assert in_process(sample.main, ["--out_dir=out-finetune", "--start=LEAR:", "--max_new_tokens=5"], cwd=d) == 0
    assert capsys.readouterr().out.startswith("LEAR:")
    # export: transformers reads the finetuned model with our logits
    assert in_process(hf.main, ["export", "out-finetune", "hf-finetune"], cwd=d) == 0
    written = files_under(d / "hf-finetune")
    refusal(hf.main, ["export", "out-finetune", "hf-finetune"], "hf-finetune is not empty", cwd=d)
    assert files_under(d / "hf-finetune") == written  # nothing overwritten
    mine, _, _ = checkpoint.load_model(str(d / "out-finetune"), torch.device("cpu"))  # best.pt, as exported
    theirs = transformers.AutoModelForCausalLM.from_pretrained(d / "hf-finetune").eval()
    idx = torch.randint(0, 50257, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(theirs(idx).logits, mine(idx)[0], atol=1e-4, rtol=1e-4)


def test_finetuning_refuses_what_the_pretrained_model_does_not_fit_in_one_line(workdir, tiny_gpt2, refusal,
                                                                               tiny_args):
    d, _ = workdir
    path, _ = tiny_gpt2
    cases = [(("--dataset=verse", "--n_layer=3"), [f"--n_layer=3 does not match {path}'s n_layer=2"]),
             (("--dataset=verse", "--block_size=128"), [f"--block_size=128 does not match {path}'s block_size=64"]),
             (("--dataset=verse",), ["dataset 'verse' was not prepared with", "--tokenizer"])]
    for i, (args, fragments) in enumerate(cases):
        refusal(train.main, [f"--out_dir=out-refused-{i}", f"--init_from={path}", *tiny_args, *args], *fragments,
                cwd=d)
    refusal(sample.main, ["--init_from=no/such/model"], "'no/such/model'", cwd=d)
    assert not list(d.glob("out-refused*"))


def test_a_mistyped_init_from_is_not_taken_for_a_model_to_download(workdir, refusal, tiny_args):
    d, _ = workdir
    for main, argv in ((train.main, ["--init_from=resum", "--dataset=verse", *tiny_args]),
                       (sample.main, ["--init_from=resum"])):
        refusal(main, argv, "'resum' is no model directory: did you mean resume?", cwd=d)


def test_prepare_takes_a_hugging_face_tokenizer_and_sample_streams_its_text(tmp_path, corpus, in_process, capsys):
    tokenizers = pytest.importorskip("tokenizers")
    text = corpus(600)
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.train_from_iterator(text.splitlines(), tokenizers.trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()))
    torch.manual_seed(0)
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    model_dir = tmp_path / "tiny-llama"
    llama.save_pretrained(model_dir)
    tok.save(str(model_dir / "tokenizer.json"))
    (tmp_path / "t.txt").write_text(text, encoding="utf-8")
    in_process(prepare.main, ["text", "--input=t.txt", "--name=t", f"--tokenizer={model_dir}"], cwd=tmp_path)
    meta = json.loads((tmp_path / "data" / "t" / "meta.json").read_text())
    train_ids, val_ids = (np.fromfile(tmp_path / "data" / "t" / f"{s}.bin", dtype=meta["dtype"])
                          for s in ("train", "val"))
    assert meta["tokenizer"] == "hf" and meta["vocab_size"] == tok.get_vocab_size()
    assert tok.decode(train_ids.tolist()) + tok.decode(val_ids.tolist()) == text
    capsys.readouterr()
    assert in_process(sample.main, [f"--init_from={model_dir}", "--start=LEAR:", "--max_new_tokens=12",
                                    "--temperature=0"], cwd=tmp_path) == 0
    with torch.no_grad():
        ids = llama.generate(torch.tensor([tok.encode("LEAR:").ids]), do_sample=False, max_new_tokens=12,
                             pad_token_id=0)[0].tolist()
    assert capsys.readouterr().out.split(SEP)[0] == tok.decode(ids)  # streamed piece by piece, the same text


# ----------------------------------------------------------------------------------------------
# An export is complete: the tokenizer transformers loads, the vocabulary the run uses, and it
# comes back into nanoformer

def exported(d, run_dir, in_process, capsys, *extra):
    out = d / f"hf-{run_dir}{''.join(extra)}"
    assert in_process(hf.main, ["export", run_dir, str(out), *extra], cwd=d) == 0
    return out, capsys.readouterr().out


def greedy(model_dir, prompt, n):
    """transformers' own tokenizer and greedy generate on an export: the text it writes."""
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ids = tok(prompt, return_tensors="pt").input_ids
    return tok.decode(model.generate(ids, max_new_tokens=n, do_sample=False)[0])


@pytest.mark.parametrize("kind", ["char", "gpt2"])
def test_an_export_carries_its_tokenizer_and_generates_in_transformers_and_in_sample_py_as_the_run_does(
        workdir, kind, in_process, run, capsys, tiny_args, request):
    d, text = workdir
    if kind == "gpt2":
        request.getfixturevalue("gpt2_bpe")  # skipped without GPT-2's BPE files
        assert run("prepare.py", "text", "--input=texts/*.txt", "--name=verse-bpe", cwd=d)[0] == 0
    name = "verse" if kind == "char" else "verse-bpe"
    assert in_process(train.main, [f"--dataset={name}", f"--out_dir=out-export-{kind}", *tiny_args,
                                   "--max_iters=2"], cwd=d) == 0
    capsys.readouterr()
    path, said = exported(d, f"out-export-{kind}", in_process, capsys)
    assert f"out-export-{kind}/best.pt: iteration 2, val loss" in said
    meta = json.loads((d / "data" / name / "meta.json").read_text())
    assert json.loads((path / "config.json").read_text())["vocab_size"] == meta["vocab_size"]  # not the padded size
    hf_tok = transformers.AutoTokenizer.from_pretrained(path)
    ours = tokenizer.Tokenizer(meta)
    assert hf_tok("LEAR: sweet sorrow").input_ids == ours.encode("LEAR: sweet sorrow")
    args = ["--start=LEAR:", "--temperature=0", "--max_new_tokens=12"]
    assert in_process(sample.main, [f"--out_dir=out-export-{kind}", *args], cwd=d) == 0
    from_run = capsys.readouterr().out
    assert "<|endoftext|>" not in from_run  # transformers would stop there, sample.py goes on
    assert in_process(sample.main, [f"--init_from={path}", *args], cwd=d) == 0
    assert capsys.readouterr().out == from_run  # read back: the same greedy text
    assert greedy(path, "LEAR:", 12) == from_run.split("\n---------------\n")[0]  # and in transformers


def test_an_encoders_export_names_its_mask_and_reads_back(workdir, in_process, capsys, tiny_args):
    d, _ = workdir
    assert in_process(train.main, ["--dataset=verse", "--out_dir=out-export-bert", "--arch=encoder",
                                   "--norm_first=False", *tiny_args, "--max_iters=2"], cwd=d) == 0
    capsys.readouterr()
    path, _ = exported(d, "out-export-bert", in_process, capsys)
    ckpt = torch.load(d / "out-export-bert" / "best.pt", weights_only=True)
    hf_tok = transformers.AutoTokenizer.from_pretrained(path)
    assert hf_tok.mask_token == "[MASK]" and hf_tok.convert_tokens_to_ids("[MASK]") == ckpt["tokens"]["mask"]
    args = ["--start=LEAR: [MASK]ear[MASK] day", "--temperature=0"]
    assert in_process(sample.main, ["--out_dir=out-export-bert", *args], cwd=d) == 0
    from_run = capsys.readouterr().out
    assert in_process(sample.main, [f"--init_from={path}", *args], cwd=d) == 0
    assert capsys.readouterr().out == from_run


def test_exported_files_follow_the_users_umask(workdir, in_process, capsys, tiny_args):
    d, _ = workdir
    assert in_process(train.main, ["--dataset=verse", "--out_dir=out-umask", *tiny_args, "--max_iters=1"], cwd=d) == 0
    path, _ = exported(d, "out-umask", in_process, capsys)
    umask = os.umask(0o22)
    os.umask(umask)
    files = [*path.iterdir(), d / "out-umask" / "ckpt.pt", d / "out-umask" / "best.pt"]
    assert len(files) == 6 and all(f.stat().st_mode & 0o777 == 0o666 & ~umask for f in files), files


def test_export_takes_the_latest_checkpoint_when_asked(workdir, in_process, capsys, tiny_args):
    d, _ = workdir
    assert in_process(train.main, ["--dataset=verse", "--out_dir=out-latest", *tiny_args, "--max_iters=1"], cwd=d) == 0
    capsys.readouterr()
    _, said = exported(d, "out-latest", in_process, capsys, "--ckpt=latest")
    assert "out-latest/ckpt.pt: iteration 1, val loss" in said


def test_a_gpt2_export_has_the_keys_llama_cpps_converter_reads(tmp_path):
    """llama.cpp's convert_hf_to_gguf.py (GPT2Model.set_gguf_parameters) reads n_layer, n_ctx, n_embd, n_head and
    layer_norm_epsilon from config.json, and takes the MLP to be 4 x n_embd wide."""
    model = Transformer(ModelConfig(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=16))
    assert hf.save_pretrained(model, tmp_path) == "gpt2"
    config = json.loads((tmp_path / "config.json").read_text())
    assert {k: config[k] for k in ("n_layer", "n_ctx", "n_embd", "n_head", "layer_norm_epsilon")} == dict(
        n_layer=2, n_ctx=32, n_embd=16, n_head=2, layer_norm_epsilon=model.config.norm_eps)
    assert config["n_inner"] in (None, 4 * 16)


# ----------------------------------------------------------------------------------------------
# ViTForImageClassification (hf_vit.py)

def hf_vit(hidden_act="gelu"):
    """A tiny random ViTForImageClassification: 8x8 RGB images in 4x4 patches, 5 labels, 2 layers of width 64."""
    config = transformers.ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                                    image_size=8, patch_size=4, num_channels=3, num_labels=5, hidden_act=hidden_act,
                                    id2label={i: f"class{i}" for i in range(5)})
    m = transformers.ViTForImageClassification(config)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0.0, 0.2, generator=torch.Generator().manual_seed(p.numel()))
    return m.eval()


@pytest.mark.parametrize("act", ["gelu", "gelu_pytorch_tanh"])
def test_a_vit_reads_with_transformers_logits(act, tmp_path):
    theirs = hf_vit(act)
    theirs.save_pretrained(tmp_path)
    ours = hf.from_pretrained(tmp_path)
    c = ours.config
    assert (c.arch, c.patch_size, c.image_size, c.channels, c.n_classes, c.block_size) == ("encoder", 4, 8, 3, 5, 5)
    images = torch.randn(3, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours(images)[0], theirs(pixel_values=images).logits, atol=1e-4, rtol=0)
    model, source = hf.load_source(str(tmp_path))
    assert source["meta"]["classes"] == [f"class{i}" for i in range(5)]
    assert source["meta"]["normalize"] == dict(mean=[0.5] * 3, std=[0.5] * 3)  # no preprocessor_config.json: ViT's


def test_a_vit_export_loads_in_transformers_with_our_logits_normalises_as_its_processor_and_reads_back(
        tmp_path, tiny_model, in_process, capsys):
    from PIL import Image
    from media import example
    ours = randomize(tiny_model(arch="encoder", patch_size=4, image_size=8, channels=3, n_classes=3, block_size=12,
                                gelu_approximate="none"))
    meta = dict(kind="images", classes=["cat", "dog", "owl"], normalize=dict(mean=0.5, std=0.5), shape=[3, 8, 8])
    assert hf.save_pretrained(ours, tmp_path / "vit", meta=meta) == "vit"
    theirs = transformers.ViTForImageClassification.from_pretrained(tmp_path / "vit").eval()
    assert theirs.config.id2label == {0: "cat", 1: "dog", 2: "owl"}
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (11, 9, 3), dtype=np.uint8)).save(tmp_path / "x.png")
    processor = transformers.ViTImageProcessor.from_pretrained(tmp_path / "vit")
    pixels = processor(Image.open(tmp_path / "x.png"), return_tensors="pt").pixel_values  # resized, rescaled, normalised
    mine = torch.from_numpy(example(str(tmp_path / "x.png"), meta))[None]
    torch.testing.assert_close(mine, pixels, atol=2 / 255 / 0.5, rtol=0)  # the same up to a rounding of the resize
    with torch.no_grad():
        torch.testing.assert_close(ours(pixels)[0], theirs(pixel_values=pixels).logits, atol=1e-4, rtol=0)
    back = hf.from_pretrained(tmp_path / "vit")
    assert all(torch.equal(v, ours.state_dict()[k][: len(v)]) for k, v in back.state_dict().items())
    capsys.readouterr()
    assert in_process(sample.main, [f"--init_from={tmp_path / 'vit'}", f"--image={tmp_path / 'x.png'}"]) == 0
    lines = capsys.readouterr().out.splitlines()
    probs = ours(mine)[0].softmax(-1)[0]
    assert lines[0].split() == [f"{probs.max():.4f}", meta["classes"][probs.argmax()]] and len(lines) == 3


def test_a_vit_with_what_transformers_has_no_place_for_is_refused_in_one_line(tmp_path, tiny_model):
    vit = dict(arch="encoder", patch_size=4, image_size=8, channels=3, n_classes=3, block_size=12)
    for kw, words in [(dict(pos="rope"), "pos='learned'"), (dict(bias=False), "biases"), (dict(score="dot"), "softmax")]:
        with pytest.raises(common.UsageError, match=words) as e:
            hf.save_pretrained(tiny_model(**vit, **kw), tmp_path / "no")
        assert "\n" not in str(e.value) and not os.path.exists(tmp_path / "no")
    theirs = hf_vit()
    theirs.config.qkv_bias = False
    theirs.save_pretrained(tmp_path / "nobias")
    with pytest.raises(ValueError, match="qkv_bias=False"):
        hf.from_pretrained(tmp_path / "nobias")
