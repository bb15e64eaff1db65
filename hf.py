"""
Hugging Face checkpoints in and out.

    from hf import from_pretrained, save_pretrained
    model = from_pretrained("path/to/hf-dir")   # config.json + safetensors (or pytorch_model.bin)
    save_pretrained(model, "path/to/out")        # transformers' Auto* classes load it: same logits

    python hf.py export OUT_DIR HF_DIR           # a run's best.pt (--ckpt=latest: ckpt.pt) -> a Hugging Face directory
    python hf.py export OUT_DIR HF_DIR --adapter=ADAPTER_DIR   # a LoRA run: the base model, and peft's adapters

Each family is a name map, read once: our parameter -> the Hugging Face tensors it is made of (several are
concatenated along their first dim: q, k, v into c_attn). The few transformations that names cannot say are exact,
and noted at each map: GPT-2's transposed Conv1D weights, BERT's token type 0 folded into the position table, T5's
unscaled attention and v1.0's scaled decoder output folded into weights. Anything else is refused with a one-line
HFError that names the feature and the way out. transformers is never imported here.
"""

import difflib
import json
import math
import os
import re
from collections import namedtuple
from functools import partial
from dataclasses import asdict, dataclass, fields, replace

import torch
import torch.nn as nn
from safetensors.torch import load_file, save_file

from checkpoint import describe, load_plain, load_run
from common import UsageError, check_ranges, parse_settings, usage
from device import run_script
from data import special_tokens
from lora import save_peft
from tokenizer import GPT2_EOT, Tokenizer, hf_files, token_names, tokenizer_meta
from model import ATTENTIONS, ModelConfig, Transformer
import hf_vit
from quantize import QUANTIZED


class HFError(ValueError):
    """A checkpoint this module cannot read or write: one line, the problem and the way out."""


# ----------------------------------------------------------------------------------------------
# The name maps: ours -> Hugging Face's. {i} is the layer. A key names a module whose weight and
# bias map alike, or one parameter; a list is concatenated along the first dim.

GPT2 = {  # GPT2LMHeadModel. Its Conv1D layers store weights transposed: (in, out)
    "wte": "transformer.wte", "decoder.wpe": "transformer.wpe", "decoder.h.{i}.ln_1": "transformer.h.{i}.ln_1",
    "decoder.h.{i}.attn.c_attn": "transformer.h.{i}.attn.c_attn",
    "decoder.h.{i}.attn.c_proj": "transformer.h.{i}.attn.c_proj",
    "decoder.h.{i}.ln_2": "transformer.h.{i}.ln_2",
    "decoder.h.{i}.mlp.c_fc": "transformer.h.{i}.mlp.c_fc",
    "decoder.h.{i}.mlp.c_proj": "transformer.h.{i}.mlp.c_proj",
    "decoder.ln_f": "transformer.ln_f", "lm_head": "lm_head"}
CONV1D = (".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight")

BERT = {  # BertForMaskedLM. Token type 0's embedding is folded into the position table
    "wte": "bert.embeddings.word_embeddings", "encoder.wpe": "bert.embeddings.position_embeddings",
    "encoder.ln_f": "bert.embeddings.LayerNorm",  # a post-norm stack normalises its input
    "encoder.h.{i}.attn.c_attn": [f"bert.encoder.layer.{{i}}.attention.self.{x}" for x in ("query", "key", "value")],
    "encoder.h.{i}.attn.c_proj": "bert.encoder.layer.{i}.attention.output.dense",
    "encoder.h.{i}.ln_1": "bert.encoder.layer.{i}.attention.output.LayerNorm",
    "encoder.h.{i}.mlp.c_fc": "bert.encoder.layer.{i}.intermediate.dense",
    "encoder.h.{i}.mlp.c_proj": "bert.encoder.layer.{i}.output.dense",
    "encoder.h.{i}.ln_2": "bert.encoder.layer.{i}.output.LayerNorm",
    "mlm_head.0": "cls.predictions.transform.dense", "mlm_head.2": "cls.predictions.transform.LayerNorm",
    "lm_head.weight": "cls.predictions.decoder.weight", "lm_head.bias": "cls.predictions.bias"}

LLAMA = {  # LlamaForCausalLM and MistralForCausalLM. HF's q and k are already in RoPE's half-split order
    "wte": "model.embed_tokens", "decoder.h.{i}.ln_1": "model.layers.{i}.input_layernorm",
    "decoder.h.{i}.attn.c_attn": [f"model.layers.{{i}}.self_attn.{x}_proj" for x in "qkv"],
    "decoder.h.{i}.attn.c_proj": "model.layers.{i}.self_attn.o_proj",
    "decoder.h.{i}.ln_2": "model.layers.{i}.post_attention_layernorm",
    "decoder.h.{i}.mlp.c_fc": ["model.layers.{i}.mlp.up_proj", "model.layers.{i}.mlp.gate_proj"],  # up * silu(gate)
    "decoder.h.{i}.mlp.c_proj": "model.layers.{i}.mlp.down_proj", "decoder.ln_f": "model.norm", "lm_head": "lm_head"}


def t5_names(gated):
    """T5ForConditionalGeneration. T5 does not scale attention scores, so sqrt(d_kv) is folded into
    the query weights; v1.0 scales the decoder's output by d_model^-0.5 before its tied lm_head,
    which is folded into the decoder's final norm. v1.1's gated MLP is gelu(wi_0 x) * wi_1 x."""
    names = {"wte": "shared", "lm_head": "lm_head"}
    wi = ("wi_1", "wi_0") if gated else ("wi",)  # ours: the product, then the gate
    for s, ff in (("encoder", 1), ("decoder", 2)):  # the decoder's layer 1 is cross-attention
        layer = s + ".block.{i}.layer."
        names |= {
            f"{s}.rel": f"{s}.block.0.layer.0.SelfAttention.relative_attention_bias",  # block 0's serves all
            f"{s}.h.{{i}}.ln_1": layer + "0.layer_norm",
            f"{s}.h.{{i}}.attn.c_attn": [layer + f"0.SelfAttention.{x}" for x in "qkv"],
            f"{s}.h.{{i}}.attn.c_proj": layer + "0.SelfAttention.o",
            f"{s}.h.{{i}}.ln_2": layer + f"{ff}.layer_norm",
            f"{s}.h.{{i}}.mlp.c_fc": [layer + f"{ff}.DenseReluDense.{w}" for w in wi],
            f"{s}.h.{{i}}.mlp.c_proj": layer + f"{ff}.DenseReluDense.wo",
            f"{s}.ln_f": f"{s}.final_layer_norm",
        }
    return names | {
        "decoder.h.{i}.ln_cross": "decoder.block.{i}.layer.1.layer_norm",
        "decoder.h.{i}.cross_attn.c_q": "decoder.block.{i}.layer.1.EncDecAttention.q",
        "decoder.h.{i}.cross_attn.c_kv": [f"decoder.block.{{i}}.layer.1.EncDecAttention.{x}" for x in "kv"],
        "decoder.h.{i}.cross_attn.c_proj": "decoder.block.{i}.layer.1.EncDecAttention.o",
    }


# family: (its Hugging Face class, tensors a checkpoint may hold that no parameter needs)
FAMILIES = {
    "gpt2": ("GPT2LMHeadModel", r"\.attn\.(masked_)?bias$"),  # causal-mask buffers of older files
    "bert": ("BertForMaskedLM", r"^bert\.pooler\.|^cls\.seq_relationship\.|position_ids$"  # pretraining's other heads
                                r"|^cls\.predictions\.decoder\.bias$"),  # a copy of cls.predictions.bias
    "t5": ("T5ForConditionalGeneration", r"\.embed_tokens\.weight$"),  # copies of `shared`
    "llama": ("LlamaForCausalLM", r"rotary_emb\.inv_freq$"),
    "mistral": ("MistralForCausalLM", r"rotary_emb\.inv_freq$"),
}


def name_map(family, config):
    return {"gpt2": GPT2, "bert": BERT, "t5": t5_names(config.mlp == "geglu")}.get(family, LLAMA)


def hf_names(names, name):
    """Our parameter `name` -> the list of Hugging Face tensors it is made of."""
    layer = re.search(r"\.h\.(\d+)\.", name)
    key = re.sub(r"\.h\.\d+\.", ".h.{i}.", name)
    module, leaf = key.rsplit(".", 1)
    found, suffix = (names[key], "") if key in names else (names[module], "." + leaf)
    found = [found] if isinstance(found, str) else found
    return [n.format(i=layer[1] if layer else None) + suffix for n in found]


def hf_pieces(family, c, name, t):
    """Our tensor `name`, t -> {each Hugging Face tensor it is made of: its rows of t (q, k, v, with k and v smaller
    under GQA, or equal halves), divided by its factor}."""
    parts, q = hf_names(name_map(family, c), name), c.n_head * c.head_size
    rows = t.split([q, (len(t) - q) // 2, (len(t) - q) // 2]) if len(parts) == 3 else t.chunk(len(parts))
    return {n: p if (f := factor(family, n, c, c.tie_embeddings)) == 1 else (p.float() / f).to(p.dtype)
            for n, p in zip(parts, rows)}


def factor(family, hf_name, config, scaled):
    """What a Hugging Face tensor is multiplied by on the way in (divided by on the way out)."""
    if family == "t5" and hf_name.endswith((".SelfAttention.q.weight", ".EncDecAttention.q.weight")):
        return math.sqrt(config.head_size)  # our attention divides scores by it; T5's does not
    if family == "t5" and scaled and hf_name == "decoder.final_layer_norm.weight":
        return config.n_embd ** -0.5  # v1.0's scaling of the decoder's output
    return 1.0


# ----------------------------------------------------------------------------------------------
# Configs: Hugging Face's config.json <-> ModelConfig

GELUS = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu": "none"}  # HF's name -> gelu_approximate
T5_MLPS = {"relu": "relu", "gated-gelu": "geglu"}  # v1.0, v1.1 (its gelu is gelu_new: tanh)


def gelu(hf, key, default):
    if hf.get(key, default) not in GELUS:
        raise HFError(f"{key}={hf[key]!r} is not a GELU nanoformer has (it has {', '.join(GELUS)})")
    return GELUS[hf.get(key, default)]


def read_config(hf):
    """config.json -> (family, the ModelConfig fields it sets but tie_embeddings, whether T5 scales
    its decoder output), or an HFError naming what nanoformer cannot express."""
    kind = hf.get("model_type")
    if kind == "qwen2":
        raise HFError("Qwen2 has a bias on q, k and v only, which nanoformer's `bias` (on every layer or none) "
                      "cannot express: no import for it")
    if kind not in FAMILIES:
        raise HFError(f"model_type={kind!r} is not a family nanoformer reads: it reads {', '.join(FAMILIES)}")
    if kind == "gpt2":
        if hf.get("scale_attn_by_inverse_layer_idx") or not hf.get("scale_attn_weights", True):
            raise HFError("this GPT-2 scales attention other than by 1/sqrt(head size) (scale_attn_*): "
                          "no import for it")
        return kind, dict(vocab_size=hf["vocab_size"], block_size=hf["n_positions"], n_layer=hf["n_layer"],
                          n_head=hf["n_head"], n_embd=hf["n_embd"], mlp_hidden=hf.get("n_inner"),
                          norm_eps=hf.get("layer_norm_epsilon", 1e-5),
                          gelu_approximate=gelu(hf, "activation_function", "gelu_new")), False
    if kind == "bert":
        if hf.get("position_embedding_type", "absolute") != "absolute":
            raise HFError(f"BERT's position_embedding_type={hf['position_embedding_type']!r} is not nanoformer's "
                          "learned table ('absolute'): no import for it")
        return kind, dict(arch="encoder", norm_first=False, lm_head_bias=True, vocab_size=hf["vocab_size"],
                          block_size=hf["max_position_embeddings"], n_layer=hf["num_hidden_layers"],
                          n_head=hf["num_attention_heads"], n_embd=hf["hidden_size"],
                          mlp_hidden=hf["intermediate_size"], norm_eps=hf.get("layer_norm_eps", 1e-12),
                          gelu_approximate=gelu(hf, "hidden_act", "gelu")), False
    if kind == "t5":
        ffp = hf.get("feed_forward_proj", "relu")
        if ffp not in T5_MLPS:
            raise HFError(f"T5's feed_forward_proj={ffp!r} is not one nanoformer has ({', '.join(T5_MLPS)})")
        if hf.get("num_decoder_layers") not in (None, hf["num_layers"]):
            raise HFError("this T5's decoder has another number of layers than its encoder; nanoformer's stacks "
                          "share n_layer: no import for it")
        # a config that transformers 5 wrote says whether to scale; an older one ties iff it scales
        scaled = hf.get("scale_decoder_outputs", hf.get("tie_word_embeddings", True) is not False)
        return kind, dict(arch="encoder-decoder", pos="relative", norm="rmsnorm", mlp=T5_MLPS[ffp], bias=False,
                          vocab_size=hf["vocab_size"], block_size=hf.get("n_positions", 512),
                          n_layer=hf["num_layers"], n_head=hf["num_heads"], n_embd=hf["d_model"],
                          head_size=hf["d_kv"], mlp_hidden=hf["d_ff"], norm_eps=hf.get("layer_norm_epsilon", 1e-6),
                          rel_buckets=hf.get("relative_attention_num_buckets", 32),
                          rel_max_distance=hf.get("relative_attention_max_distance", 128)), scaled
    # Llama, Mistral
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            raise HFError(f"{key}=True: nanoformer's Llama has no biases (its `bias` covers every layer): "
                          "no import for it")
    if hf.get("hidden_act", "silu") != "silu":
        raise HFError(f"hidden_act={hf['hidden_act']!r}: nanoformer's SwiGLU gates with silu only")
    rope = hf.get("rope_parameters") or {"rope_theta": hf.get("rope_theta", 10000.0), **(hf.get("rope_scaling") or {})}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "linear"):
        raise HFError(f"rope_scaling of rope_type {rope_type!r} is not nanoformer's rope_scaling, which is linear "
                      "position interpolation only: no import for it")
    return kind, dict(pos="rope", norm="rmsnorm", mlp="swiglu", bias=False, vocab_size=hf["vocab_size"],
                      block_size=hf.get("max_position_embeddings", 2048), n_layer=hf["num_hidden_layers"],
                      n_head=hf["num_attention_heads"], n_kv_head=hf.get("num_key_value_heads"),
                      n_embd=hf["hidden_size"], head_size=hf.get("head_dim"), mlp_hidden=hf["intermediate_size"],
                      norm_eps=hf.get("rms_norm_eps", 1e-6), rope_theta=rope.get("rope_theta", 10000.0),
                      rope_scaling=rope.get("factor", 1.0) if rope_type == "linear" else 1.0,
                      window=(hf.get("sliding_window") or 0) if kind == "mistral" else 0), False


# Each family's rows, one per ModelConfig field: CARRIED (config.json or the weights hold it), HARMLESS (no logit
# depends on it; transformers needs nothing for it), the value its class has, or a Rule. No row: the default only.
CARRIED, HARMLESS, Rule = "carried", "harmless", namedtuple("Rule", "test has")  # test(config) or the class has `has`
SHARED = dict(  # every family's rows, but where FIELDS says otherwise
    vocab_size=CARRIED, block_size=CARRIED, n_layer=CARRIED, n_head=CARRIED, n_embd=CARRIED, head_size=CARRIED,
    mlp_hidden=CARRIED, norm_eps=CARRIED, tie_embeddings=CARRIED, dropout=CARRIED,  # eval mode drops nothing
    attn_impl=HARMLESS, zero_init=HARMLESS,  # a kernel for the same attention; where training started
    score="scaled_dot", patch_size=0, n_classes=0, image_size=HARMLESS, channels=HARMLESS,  # read by images only
    # read only by experts, RoPE, T5's positions, and by the attention kinds and BigBird blocks that rows refuse
    **dict.fromkeys("expert_top_k moe_aux_weight rope_theta rope_scaling rel_buckets rel_max_distance n_features "
                    "feature_redraw proj_len bucket_size n_hashes sparse_block".split(), HARMLESS),
    n_expert=Rule(lambda c: not c.n_expert, "no mixture of experts"), n_global=0, mem_len=0, qk_norm=False,
    logit_softcap=0.0, attention=Rule(lambda c: ATTENTIONS[c.attention].export, "softmax"), norm_first=True, bias=False,
    lm_head_bias=False, window=0, n_random=0, n_kv_head=Rule(lambda c: c.n_kv_head == c.n_head, "n_kv_head=n_head"))
GPT2_ROWS = SHARED | dict(arch="decoder", pos="learned", norm="layernorm", mlp="gelu", gelu_approximate=CARRIED,
                          bias=CARRIED, head_size=Rule(lambda c: c.head_size * c.n_head == c.n_embd, "n_embd / n_head"))
T5_MLP = Rule(lambda c: c.mlp == "relu" or (c.mlp, c.gelu_approximate) == ("geglu", "tanh"), "relu or geglu (tanh)")
LLAMA_ROWS = SHARED | dict(arch="decoder", pos="rope", norm="rmsnorm", mlp="swiglu", n_kv_head=CARRIED,
                           rope_theta=CARRIED, rope_scaling=CARRIED, gelu_approximate=HARMLESS)  # its gate is silu
FIELDS = {"gpt2": GPT2_ROWS, "bert": GPT2_ROWS | dict(arch="encoder", norm_first=False, lm_head_bias=CARRIED),
          "t5": SHARED | dict(arch="encoder-decoder", pos="relative", norm="rmsnorm", mlp=T5_MLP,
                              gelu_approximate=T5_MLP, rel_buckets=CARRIED, rel_max_distance=CARRIED),
          "llama": LLAMA_ROWS, "mistral": LLAMA_ROWS | dict(window=CARRIED)}  # GPT-2, BERT: zero biases if none


def family_of(c):
    """The Hugging Face family a ModelConfig goes to, or an HFError naming a field it has no place for."""
    family = {("decoder", "learned"): "gpt2", ("encoder", "learned"): "bert", ("encoder-decoder", "relative"): "t5",
              ("decoder", "rope"): "mistral" if c.window else "llama"}.get((c.arch, c.pos))
    if family is None:
        raise HFError(f"arch={c.arch!r} with pos={c.pos!r} has no Hugging Face class (GPT-2, BERT, T5, Llama, Mistral)")
    for f in fields(c):  # a field that no row names must keep its default
        value, row = getattr(c, f.name), FIELDS[family].get(f.name, f.default)
        if row not in (CARRIED, HARMLESS) and not (row.test(c) if isinstance(row, Rule) else value == row):
            raise HFError(f"{f.name}={value!r}: {FAMILIES[family][0]} (arch={c.arch!r}, pos={c.pos!r}) has "
                          f"{row.has if isinstance(row, Rule) else f'{f.name}={row!r}'}: no export for it")
    return family


def write_config(c, family, dtype):
    """ModelConfig -> the config.json of its Hugging Face class."""
    hf = dict(model_type=family, architectures=[FAMILIES[family][0]], vocab_size=c.vocab_size,
              tie_word_embeddings=c.tie_embeddings, dtype=str(dtype).removeprefix("torch."))
    approx = {"tanh": "gelu_new", "none": "gelu"}[c.gelu_approximate]
    if family == "gpt2":
        return hf | dict(n_positions=c.block_size, n_layer=c.n_layer, n_head=c.n_head, n_embd=c.n_embd,
                         n_inner=c.mlp_hidden, activation_function=approx, layer_norm_epsilon=c.norm_eps,
                         resid_pdrop=c.dropout, embd_pdrop=c.dropout, attn_pdrop=c.dropout, n_ctx=c.block_size)
    if family == "bert":  # two token types, both zero: the position table holds what token type 0 added
        return hf | dict(max_position_embeddings=c.block_size, num_hidden_layers=c.n_layer,
                         num_attention_heads=c.n_head, hidden_size=c.n_embd, intermediate_size=c.mlp_hidden,
                         hidden_act=approx, layer_norm_eps=c.norm_eps, type_vocab_size=2,
                         position_embedding_type="absolute", hidden_dropout_prob=c.dropout,
                         attention_probs_dropout_prob=c.dropout)
    if family == "t5":  # tied: v1.0, which scales the decoder output; untied: v1.1, which does not
        return hf | dict(n_positions=c.block_size, num_layers=c.n_layer, num_decoder_layers=c.n_layer,
                         num_heads=c.n_head, d_model=c.n_embd, d_kv=c.head_size, d_ff=c.mlp_hidden,
                         feed_forward_proj={"relu": "relu", "geglu": "gated-gelu"}[c.mlp],
                         layer_norm_epsilon=c.norm_eps, relative_attention_num_buckets=c.rel_buckets,
                         relative_attention_max_distance=c.rel_max_distance, dropout_rate=c.dropout,
                         is_encoder_decoder=True, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    rope = dict(rope_type="linear", factor=c.rope_scaling) if c.rope_scaling != 1 else dict(rope_type="default")
    hf |= dict(max_position_embeddings=c.block_size, num_hidden_layers=c.n_layer, num_attention_heads=c.n_head,
               num_key_value_heads=c.n_kv_head, hidden_size=c.n_embd, head_dim=c.head_size,
               intermediate_size=c.mlp_hidden, hidden_act="silu", rms_norm_eps=c.norm_eps, attention_dropout=c.dropout,
               rope_parameters=rope | dict(rope_theta=c.rope_theta),  # transformers 5; and 4's keys:
               rope_theta=c.rope_theta, rope_scaling=rope if c.rope_scaling != 1 else None)
    return hf | (dict(sliding_window=c.window) if family == "mistral" else dict(attention_bias=False, mlp_bias=False))


# ----------------------------------------------------------------------------------------------
# Reading

def local_dir(path_or_name):
    """A model directory: path_or_name itself, or the hub's snapshot of the model of that name."""
    if os.path.isdir(path_or_name):
        return path_or_name
    if os.path.exists(path_or_name):
        raise HFError(f"{path_or_name} is a file: give the model's directory (config.json and its weights)")
    if close := difflib.get_close_matches(str(path_or_name), ["scratch", "resume"], n=1, cutoff=0.7):
        raise HFError(f"{path_or_name!r} is no model directory: did you mean {close[0]}?")
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise HFError(f"{path_or_name!r} is not a directory; to download it from the Hugging Face hub: "
                      "pip install huggingface_hub") from None
    try:
        path = snapshot_download(path_or_name, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"])
        if not any(f.endswith(".safetensors") for f in os.listdir(path)):  # an older repository
            path = snapshot_download(path_or_name, allow_patterns=["*.json", "pytorch_model*.bin"])
        return path
    except Exception as e:
        cause = (str(e).strip().splitlines() or [""])[0]
        raise HFError(f"could not download {path_or_name!r} from the Hugging Face hub ({type(e).__name__}: "
                      f"{cause}): check the name and the network, or give a local directory") from None


def read_json(path, what):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:  # missing, or not JSON
        raise HFError(f"{path} is missing: {what}" if isinstance(e, OSError) else
                      f"{path} is not valid JSON ({e}): download the model again") from None


def read_tensors(path):
    """Every tensor of the directory's weights: model.safetensors, the shards its index lists, or
    pytorch_model.bin (or its shards), which holds plain tensors or is refused."""
    read_bin = partial(load_plain, way_out="download it again")  # a file it refuses: a UsageError
    for file, read in (("model.safetensors", load_file), ("pytorch_model.bin", read_bin)):
        if os.path.exists(os.path.join(path, file)):
            return read(os.path.join(path, file))
        index = os.path.join(path, file + ".index.json")
        if os.path.exists(index):
            shards = sorted(set(read_json(index, "")["weight_map"].values()))
            return {k: v for shard in shards for k, v in read(os.path.join(path, shard)).items()}
    raise HFError(f"{path} holds no model.safetensors, pytorch_model.bin or an index of their shards: "
                  "give a directory that save_pretrained wrote")


def from_pretrained(path_or_name, device="cpu", dtype=None):
    """The Transformer of a Hugging Face model directory (or hub name), in eval mode, its weights
    in dtype (None: the checkpoint's)."""
    path = local_dir(path_or_name)
    hf = read_json(os.path.join(path, "config.json"), "a Hugging Face model directory holds config.json")
    if hf.get("model_type") == "vit":  # ViTForImageClassification: hf_vit.py
        return hf_vit.from_hf(hf, read_tensors(path), dtype).to(device).eval()
    try:
        family, given, scaled = read_config(hf)
    except KeyError as e:
        raise HFError(f"{path}/config.json lacks {e.args[0]!r}, which a {hf.get('model_type')} config holds: "
                      "download it again") from None
    try:
        tensors = read_tensors(path)
    except UsageError as e:  # a pytorch_model.bin that load_plain refuses
        raise HFError(str(e)) from None
    if family == "gpt2" and "wte.weight" in tensors:  # saved from GPT2Model: no "transformer." prefix
        tensors = {("" if k.startswith("lm_head") else "transformer.") + k: v for k, v in tensors.items()}
    if family == "bert":  # older files name LayerNorm's parameters as TensorFlow did
        tensors = {re.sub(r"\.gamma$", ".weight", re.sub(r"\.beta$", ".bias", k)): v for k, v in tensors.items()}
    names = name_map(family, ModelConfig(**given))
    emb, head = (hf_names(names, m + ".weight")[0] for m in ("wte", "lm_head"))
    if emb not in tensors:
        raise HFError(f"{path} lacks {emb}: it is not a {FAMILIES[family][0]} checkpoint")
    if head not in tensors and hf.get("tie_word_embeddings") is False:
        raise HFError(f"{path} lacks {head}, the output matrix of a model with untied embeddings: download it again")
    # tied where the file holds no output matrix of its own (or an equal one), as transformers 5 decides
    tied = head not in tensors or torch.equal(tensors[head], tensors[emb])
    config = ModelConfig(**given, tie_embeddings=tied)
    dtype = dtype or tensors[emb].dtype
    if family == "bert":  # single-segment inputs add token type 0's embedding at every position: fold it in
        tt = tensors.pop("bert.embeddings.token_type_embeddings.weight", None)
        pos = "bert.embeddings.position_embeddings.weight"
        if tt is not None and pos in tensors:
            tensors[pos] = tensors[pos].float() + tt[0].float()
    with torch.device("meta"):  # no memory, no initialisation: every parameter comes from the file
        model = Transformer(config)
    state = {}
    for name, want in model.state_dict().items():
        if name == "lm_head.weight" and tied:
            tensors.pop(head, None)
            continue
        parts = []
        for n in hf_names(names, name):
            if n not in tensors:
                raise HFError(f"{path} lacks {n}, which {FAMILIES[family][0]} with this config.json has")
            t = tensors.pop(n)
            t = t.t() if family == "gpt2" and n.endswith(CONV1D) else t
            f = factor(family, n, config, scaled)
            parts.append(t if f == 1 else t.float() * f)
        t = torch.cat(parts) if len(parts) > 1 else parts[0]
        if t.shape != want.shape:
            raise HFError(f"{path}: {', '.join(hf_names(names, name))} has shape {tuple(t.shape)} where config.json "
                          f"implies {tuple(want.shape)}: the weights and config.json disagree")
        state[name] = t.to(dtype)
    extra = [k for k in tensors if not re.search(FAMILIES[family][1], k)]
    if extra:
        raise HFError(f"{path} holds tensors that nanoformer's {family} has no place for ({extra[0]}"
                      f"{f' and {len(extra) - 1} more' if len(extra) > 1 else ''}): no import for this model")
    model.load_state_dict(state, assign=True, strict=not tied)  # every name but a tied lm_head's was filled
    if tied:
        model.lm_head.weight = model.wte.weight
    return model.to(device).eval()


def load_source(init_from, out_dir="", which="best"):
    """The one place where sample.py, eval.py, the export and train.py's pretrained start get a model (fp32, CPU) and
    what a checkpoint carries beside it: meta (the tokenizer), tokens (special), model_config, path. init_from "resume":
    out_dir's run (best.pt, or which="latest": ckpt.pt), a LoRA run merged (train.py's resume reads ckpt.pt whole,
    through checkpoint.load_checkpoint); else a Hugging Face directory, or a hub name to download."""
    if init_from == "resume":
        return load_run(out_dir, which)
    try:
        model = from_pretrained(path := local_dir(init_from), "cpu", torch.float32)
    except Exception as e:  # HFError, or a file that cannot be read: one line either way
        why = str(e) if isinstance(e, HFError) else f"{init_from} could not be read ({type(e).__name__}: {e})"
        raise UsageError(why.splitlines()[0]) from None
    if model.config.patch_size:  # a ViT: its classes and its images' normalisation, no tokenizer
        return model, hf_vit.source(model, path, read_json(os.path.join(path, "config.json"), ""))
    meta = tokenizer_meta(path)
    if meta["tokenizer"] != "hf":  # GPT-2's BPE (tiktoken) or characters, with tokens of ours after them
        meta["vocab_size"] = 50257 if meta["tokenizer"] == "gpt2" else len(meta["vocab"])
        tokens = special_tokens(meta["vocab_size"])  # as train.py numbers them (a decoder uses none)
    else:
        tokens, tok = special_tokens(model.config.vocab_size), Tokenizer(meta)
        meta["vocab_size"] = tok.vocab_size
        ids = {t: tok.enc.token_to_id(t) for t in ("[MASK]", "<extra_id_0>", "<extra_id_1>")}
        if ids["[MASK]"] is not None:  # BERT's
            tokens["mask"] = ids["[MASK]"]
        if ids["<extra_id_0>"] is not None:  # T5's sentinels, counting down, and its decoder's start (pad)
            tokens.update(start=read_json(os.path.join(path, "config.json"), "").get("decoder_start_token_id", 0),
                          sentinel=ids["<extra_id_0>"], sentinel_step=ids["<extra_id_1>"] - ids["<extra_id_0>"],
                          n_sentinel=sum(t.startswith("<extra_id_") for t in tok.enc.get_vocab()))
    return model, dict(meta=meta, tokens=tokens, model_config=asdict(model.config), path=str(path))


# ----------------------------------------------------------------------------------------------
# Writing

def save_pretrained(model, path, **hf_config):
    """Write config.json and model.safetensors to path such that transformers' AutoModelForCausalLM (GPT-2, Llama,
    Mistral), AutoModelForMaskedLM (BERT) or AutoModelForSeq2SeqLM (T5) loads the model with the same logits.
    hf_config: further config.json entries (decoder_start_token_id; a ViT's: meta, hf_vit.save). Returns the family."""
    c = model.config
    if c.patch_size:  # ViTForImageClassification: hf_vit.py
        return hf_vit.save(model, path, hf_config.get("meta", {}))
    family = family_of(c)
    if any(isinstance(m, QUANTIZED) for m in model.modules()):
        raise HFError("a quantized model (int8, int4, *-dynamic) has no Hugging Face layout here: export its float weights")
    state = model.state_dict()
    if c.tie_embeddings:
        del state["lm_head.weight"]
    if family in ("gpt2", "bert"):  # these classes always have biases: a model without gets zeros (exact)
        for name, m in model.named_modules():
            if isinstance(m, (nn.Linear, nn.LayerNorm)) and m.bias is None and (family == "bert" or name != "lm_head"):
                state[name + ".bias"] = torch.zeros(m.weight.size(0), dtype=m.weight.dtype)
    dtype, tensors = model.wte.weight.dtype, {}
    for name, t in state.items():
        for n, piece in hf_pieces(family, c, name, t.detach().cpu()).items():
            tensors[n] = (piece.t() if family == "gpt2" and n.endswith(CONV1D) else piece).contiguous().clone()
    if family == "bert":
        tensors["bert.embeddings.token_type_embeddings.weight"] = torch.zeros(2, c.n_embd, dtype=dtype)
        tensors["cls.predictions.decoder.bias"] = tensors["cls.predictions.bias"].clone()  # its own when untied
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    os.umask(umask := os.umask(0o22))  # reading the umask sets it: set it back
    os.chmod(os.path.join(path, "model.safetensors"), 0o666 & ~umask)  # safetensors writes 0600: share as umask says
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(write_config(c, family, dtype) | hf_config, f, indent=2)
    return family


# ----------------------------------------------------------------------------------------------
# The command line

@dataclass
class ExportConfig:
    command: str = ""  # "export": the first word
    out_dir: str = ""  # the run to export; the second word
    hf_dir: str = ""  # a new directory for transformers; the third word
    ckpt: str = "best"  # "best" (lowest val loss, best.pt) or "latest" (ckpt.pt)
    adapter: str = ""  # a LoRA run: a new directory for peft's adapters; HF_DIR then gets the base model, unmerged


def main(argv):
    if {"-h", "--help"} & set(argv):
        print(usage(__doc__, ExportConfig, files=False))
        return 0
    cfg = ExportConfig(**parse_settings(argv, ExportConfig, positional=("command", "out_dir", "hf_dir"), files=False)[0])
    check_ranges(cfg, dict(command=("export",), ckpt=("best", "latest")))
    if not cfg.out_dir or not cfg.hf_dir:
        raise UsageError("name the run and a new directory: python hf.py export OUT_DIR HF_DIR")
    for d in [d for d in (cfg.hf_dir, cfg.adapter) if os.path.isdir(d) and os.listdir(d)]:
        raise UsageError(f"{d} is not empty: give a new directory (nothing is overwritten)")
    model, ckpt = load_source("resume", cfg.out_dir, cfg.ckpt)
    print(f"hf.py: {describe(ckpt)}")
    if model.config.patch_size:  # a ViT: no tokenizer; the classes and normalisation of its data (hf_vit.py)
        return hf_vit.export(model, ckpt["meta"], cfg.hf_dir)
    if cfg.adapter and not (ckpt["train_config"] or {}).get("lora_rank"):
        raise UsageError(f"{cfg.out_dir} is not a LoRA run (lora_rank=0): export it without --adapter")
    if cfg.adapter:  # the weights the adapters apply to: the run's start, which no step moved
        model.load_state_dict({k: v for k, v in ckpt["model"].items() if not k.endswith((".lora_A", ".lora_B"))})
    model, specials, extra = in_use(model, ckpt)
    try:
        family = save_pretrained(model, cfg.hf_dir, **extra)
        for name, text in zip(("tokenizer.json", "tokenizer_config.json"),
                              hf_files(ckpt["meta"], specials, model.config.block_size)):
            with open(os.path.join(cfg.hf_dir, name), "w", encoding="utf-8") as f:
                f.write(text)
        if cfg.adapter:  # GPT-2's Linear layers but lm_head are Conv1D, which store their weights transposed
            conv1d = family == "gpt2" and set(ckpt["train_config"]["lora_targets"].split(",")) != {"lm_head"}
            save_peft(cfg.adapter, model, ckpt["model"], ckpt["train_config"], partial(hf_pieces, family, model.config),
                      base_model_name_or_path=cfg.hf_dir, fan_in_fan_out=conv1d,
                      task_type="SEQ_2_SEQ_LM" if family == "t5" else None if family == "bert" else "CAUSAL_LM")
    except HFError as e:
        raise UsageError(str(e)) from None
    except OSError as e:  # HF_DIR cannot be written
        raise UsageError(f"could not write {cfg.hf_dir} ({e.strerror or e}): choose another directory") from None
    print(f"hf.py: {FAMILIES[family][0]} and its tokenizer written to {cfg.hf_dir} (vocabulary "
          f"{model.config.vocab_size:,}){f'; its LoRA adapters to {cfg.adapter}' if cfg.adapter else ''}")
    return 0


def in_use(model, ckpt):
    """The model with only the token ids a run trained from scratch uses (vocab_size rounds them up to a multiple of
    64), its objective's token names and config.json's entries for our tokens (a document's end, an encoder-decoder's
    first): transformers' tokenizer and config then agree on the vocabulary. A pretrained model's is kept as it came."""
    c, meta = model.config, ckpt["meta"]
    extra = dict(decoder_start_token_id=ckpt["tokens"]["start"]) if c.arch == "encoder-decoder" else {}
    if meta["tokenizer"] == "hf":
        return model, {}, extra
    eot = meta.get("eot", GPT2_EOT if meta["tokenizer"] == "gpt2" else None)
    extra |= dict(bos_token_id=eot, eos_token_id=eot)
    specials = token_names(c.arch, ckpt["tokens"])
    n = max([ckpt["meta"]["vocab_size"] - 1, *specials]) + 1
    if n < c.vocab_size:
        state = {k: v[:n] if k in ("wte.weight", "lm_head.weight", "lm_head.bias") else v
                 for k, v in model.state_dict().items()}
        model = Transformer(replace(c, vocab_size=n))
        model.load_state_dict(state)
    return model.eval(), specials, extra


if __name__ == "__main__":
    run_script(main, "hf.py")
