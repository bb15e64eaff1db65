"""Hugging Face checkpoints (hf.py): tiny random models of each family read with HF's logits and
greedy outputs, written so that transformers loads them with ours, and each refusal in one line.
Nothing is downloaded: every model is built from a config here."""

import json
import os

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing can be downloaded here; nothing should try

import pytest
import torch

import common
import tokenizer
import hf
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


DECODERS = {  # name: (family, HF config)
    "gpt2": ("gpt2", {}),
    "gpt2-untied": ("gpt2", dict(tie_word_embeddings=False)),
    "llama-gqa-untied": ("llama", dict(rope_theta=50000.0)),
    "llama-gqa-tied": ("llama", dict(rope_theta=50000.0, tie_word_embeddings=True)),
    "llama-linear-rope-scaling": ("llama", dict(rope_parameters=dict(rope_type="linear", factor=2.0, rope_theta=5e4))),
    "mistral-window-8": ("mistral", dict(sliding_window=8)),
}


# ----------------------------------------------------------------------------------------------
# Reading

@pytest.mark.parametrize("name", DECODERS)
def test_decoder_logits_equal_hfs(name, tmp_path):
    family, kw = DECODERS[name]
    theirs = hf_model(family, **kw)
    ours = hf.from_pretrained(saved(theirs, tmp_path))
    assert ours.config.tie_embeddings == theirs.config.tie_word_embeddings
    idx = tokens(2, 24)  # longer than Mistral's window of 8
    with torch.no_grad():
        torch.testing.assert_close(ours(idx)[0], theirs(idx).logits, atol=1e-4, rtol=0)


def test_llama_reads_grouped_query_heads_and_rope_theta(tmp_path):
    c = hf.from_pretrained(saved(hf_model("llama", rope_theta=50000.0), tmp_path)).config
    assert (c.n_head, c.n_kv_head, c.rope_theta, c.window, c.tie_embeddings) == (4, 2, 50000.0, 0, False)


def test_mistral_sliding_window_is_our_window(tmp_path):
    assert hf.from_pretrained(saved(hf_model("mistral", sliding_window=8), tmp_path)).config.window == 8


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
def test_t5_logits_equal_hfs_with_a_padded_source(version, tmp_path):
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


@pytest.mark.parametrize("name", ["gpt2", "llama-gqa-untied", "llama-gqa-tied", "mistral-window-8"])
def test_greedy_generation_through_our_kv_cache_equals_hfs(name, tmp_path):
    family, kw = DECODERS[name]
    theirs = hf_model(family, **kw)
    ours = hf.from_pretrained(saved(theirs, tmp_path))
    idx = tokens(2, 6)  # 6 + 20 tokens: past Mistral's window of 8
    want = theirs.generate(idx, attention_mask=torch.ones_like(idx), do_sample=False, max_new_tokens=20)
    assert torch.equal(ours.generate(idx, 20, temperature=0), want)


@pytest.mark.parametrize("version", ["t5", "t5v1.1"])
def test_t5_greedy_generation_from_a_padded_source_equals_hfs(version, tmp_path):
    theirs = hf_model(version)
    ours = hf.from_pretrained(saved(theirs, tmp_path))
    src, mask = padded(2, 12)
    want = theirs.generate(input_ids=src, attention_mask=mask, do_sample=False, max_new_tokens=20)
    start = torch.zeros(2, 1, dtype=torch.long)  # T5 starts decoding from its pad token, 0
    assert torch.equal(ours.generate(start, 20, temperature=0, src=src, src_mask=mask.bool()), want)


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


def our_model(**kw):
    kw = dict(vocab_size=V, block_size=64, n_layer=2, n_head=4, n_embd=64) | kw
    return randomize(Transformer(ModelConfig(**kw)))


@pytest.mark.parametrize("name", EXPORTS)
def test_export_loads_in_transformers_with_our_logits_and_reads_back_exactly(name, tmp_path):
    kw, auto = EXPORTS[name]
    ours = our_model(**kw)
    hf.save_pretrained(ours, tmp_path)
    theirs = getattr(transformers, auto).from_pretrained(tmp_path).eval()
    idx, mask = padded(2, 20)
    with torch.no_grad():
        if ours.config.arch == "encoder-decoder":
            tgt = tokens(2, 9, seed=2)
            got, want = ours(tgt, src=idx, src_mask=mask.bool())[0], theirs(idx, attention_mask=mask,
                                                                             decoder_input_ids=tgt).logits
        else:
            got, want = ours(idx)[0], theirs(idx).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    back = hf.from_pretrained(tmp_path)
    ours_params, back_params = dict(ours.named_parameters()), dict(back.named_parameters())
    assert back.config.tie_embeddings == ours.config.tie_embeddings
    for n, p in ours_params.items():
        assert torch.equal(back_params[n], p), n
    for n in back_params.keys() - ours_params.keys():  # GPT-2 and BERT always have biases: ours were none
        assert not ours.config.bias and not back_params[n].any(), n


def test_export_command_writes_a_runs_model_and_its_tokenizer(tmp_path, capsys):
    from tokenizers import Tokenizer, models

    from checkpoint import CKPT_KEYS

    tokenizer_json = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]")).to_str()
    for kind, kw in (("hf", {}), ("char", dict(arch="encoder-decoder", pos="relative", norm="rmsnorm", mlp="relu",
                                               bias=False))):
        model = our_model(**kw)
        meta = dict(tokenizer=kind, vocab_size=3) | (dict(tokenizer_json=tokenizer_json) if kind == "hf"
                                                     else dict(vocab=["a", "b", "c"]))
        ckpt = {k: None for k in CKPT_KEYS} | dict(model=model.state_dict(), model_config=vars(model.config),
                                                   tokens=dict(start=V - 1), meta=meta)
        (tmp_path / kind).mkdir()
        torch.save(ckpt, tmp_path / kind / "ckpt.pt")
        assert hf.main(["export", str(tmp_path / kind), str(tmp_path / f"{kind}-hf")]) == 0
        out = capsys.readouterr().out
        assert ("character-level" in out) == (kind == "char")
    assert (tmp_path / "hf-hf" / "tokenizer.json").read_text() == tokenizer_json
    assert tokenizer.tokenizer_meta(tmp_path / "hf-hf") == dict(tokenizer="hf", tokenizer_json=tokenizer_json)
    assert json.loads((tmp_path / "char-hf" / "config.json").read_text())["decoder_start_token_id"] == V - 1
    loaded = transformers.AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "char-hf")
    assert loaded.config.decoder_start_token_id == V - 1


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
])
def test_export_refusals_name_the_feature(config, feature, tmp_path):
    with pytest.raises(hf.HFError, match=feature) as e:
        hf.save_pretrained(our_model(**config), tmp_path)
    assert "\n" not in str(e.value) and not os.listdir(tmp_path)


def test_an_int8_model_is_refused(tmp_path):
    from quantize import quantize_int8

    with pytest.raises(hf.HFError, match="int8"):
        hf.save_pretrained(quantize_int8(our_model()), tmp_path)


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
