"""
Hugging Face's ViTForImageClassification in and out, in google/vit-base-patch16-224's layout; hf.py's
from_pretrained, load_source and export come here for a model with patch_size.

Names: ours -> theirs, a layer's q, k and v concatenated into c_attn as for BERT. Two shapes differ:
the patch embedding is their Conv2d of stride P (hidden, C, P, P), ours the same weight flattened to
a Linear (hidden, C * P * P) over patches that F.unfold flattens in that order; their position table
(1, N + 1, hidden) is our wpe's first N + 1 rows (block_size = N + 1 on import).

Images are normalised the same way both ways: pixels in [0, 1] (rescaled by 1/255), then
(x - mean) / std with mean = std = 0.5 per channel, as the processor of google/vit-base-patch16-224
does and media.py's datasets are. An import reads mean and std from preprocessor_config.json (0.5 when
there is none); an export writes the run's (its dataset's meta.json) there.
"""

import json
import os
from dataclasses import asdict

import torch
from safetensors.torch import save_file

from common import UsageError
from model import ModelConfig, Transformer

GELUS = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}  # their hidden_act -> our gelu_approximate


def names(n_layer):
    """Our parameter -> the Hugging Face tensors it is made of (several: concatenated along dim 0)."""
    out = {"cls": ["vit.embeddings.cls_token"], "encoder.wpe.weight": ["vit.embeddings.position_embeddings"],
           "wte.weight": ["vit.embeddings.patch_embeddings.projection.weight"],
           "wte.bias": ["vit.embeddings.patch_embeddings.projection.bias"],
           "encoder.ln_f.weight": ["vit.layernorm.weight"], "encoder.ln_f.bias": ["vit.layernorm.bias"],
           "lm_head.weight": ["classifier.weight"], "lm_head.bias": ["classifier.bias"]}
    for i in range(n_layer):
        theirs = f"vit.encoder.layer.{i}."
        for w in ("weight", "bias"):
            out[f"encoder.h.{i}.attn.c_attn.{w}"] = [theirs + f"attention.attention.{x}.{w}" for x in ("query", "key",
                                                                                                     "value")]
            for ours, name in (("ln_1", "layernorm_before"), ("attn.c_proj", "attention.output.dense"),
                               ("ln_2", "layernorm_after"), ("mlp.c_fc", "intermediate.dense"),
                               ("mlp.c_proj", "output.dense")):
                out[f"encoder.h.{i}.{ours}.{w}"] = [theirs + f"{name}.{w}"]
    return out


def read_config(hf):
    """A ViT config.json -> our ModelConfig, or a ValueError naming what we cannot express."""
    size, patch = hf.get("image_size", 224), hf.get("patch_size", 16)
    size, patch = (size if isinstance(size, int) else size[0]), (patch if isinstance(patch, int) else patch[0])
    for wrong, problem in [(not hf.get("qkv_bias", True), "qkv_bias=False: nanoformer's `bias` covers every layer"),
                           (hf.get("hidden_act", "gelu") not in GELUS, f"hidden_act={hf.get('hidden_act')!r} is not a "
                            "GELU nanoformer has"),
                           (isinstance(hf.get("image_size"), list) and len(set(hf["image_size"])) > 1,
                            "a rectangular image_size: nanoformer's images are square")]:
        if wrong:
            raise ValueError(f"this ViT has {problem}: no import for it")
    n_classes = hf.get("num_labels") or len(hf.get("id2label") or {}) or 2  # transformers' default: 2 labels
    return ModelConfig(arch="encoder", vocab_size=1, tie_embeddings=False, patch_size=patch, image_size=size,
                       channels=hf.get("num_channels", 3), n_classes=n_classes, block_size=(size // patch) ** 2 + 1,
                       n_layer=hf["num_hidden_layers"], n_head=hf["num_attention_heads"], n_embd=hf["hidden_size"],
                       mlp_hidden=hf["intermediate_size"], norm_eps=hf.get("layer_norm_eps", 1e-12),
                       gelu_approximate=GELUS[hf.get("hidden_act", "gelu")])


def from_hf(hf, tensors, dtype=None):
    """Our Transformer of a ViT's config.json (hf) and its tensors."""
    config = read_config(hf)
    with torch.device("meta"):  # every parameter comes from the file
        model = Transformer(config)
    state = {}
    for ours, want in model.state_dict().items():
        theirs = names(config.n_layer)[ours]
        missing = [n for n in theirs if n not in tensors]
        if missing:
            raise ValueError(f"the checkpoint lacks {missing[0]}, which ViTForImageClassification with this config has")
        t = torch.cat([tensors.pop(n) for n in theirs]).reshape(want.shape)  # (1, N+1, C) and (C, ch, P, P) flat
        state[ours] = t.to(dtype or t.dtype)
    extra = [k for k in tensors if not k.startswith("vit.pooler.")]  # ViTModel's pooler: no classifier reads it
    if extra:
        raise ValueError(f"the checkpoint holds tensors nanoformer's ViT has no place for ({extra[0]}): no import")
    model.load_state_dict(state, assign=True)
    return model


def normalisation(path, channels):
    """The mean and std (one per channel) that preprocessor_config.json in path names; 0.5 without one."""
    p = os.path.join(path, "preprocessor_config.json")
    processor = json.load(open(p)) if os.path.exists(p) else {}
    return {k: processor.get(f"image_{k}", [0.5] * channels) for k in ("mean", "std")}


def source(model, path, hf):
    """What load_source returns beside a ViT: its meta (the images it reads, its classes, their normalisation)."""
    c, labels = model.config, hf.get("id2label") or {}
    meta = dict(kind="images", shape=[c.channels, c.image_size, c.image_size], n_classes=c.n_classes,
                classes=[labels.get(str(i), str(i)) for i in range(c.n_classes)],
                normalize=normalisation(path, c.channels))
    return dict(meta=meta, tokens={}, model_config=asdict(c), path=str(path))


def check_exportable(c):
    """A UsageError naming what ViTForImageClassification has no place for."""
    for wrong, problem in [
            ((c.pos, c.norm, c.norm_first, c.mlp) != ("learned", "layernorm", True, "gelu"), "pos='learned', "
             "norm='layernorm', norm_first=True and mlp='gelu'"),
            (not c.bias or c.head_size * c.n_head != c.n_embd or c.n_kv_head != c.n_head, "biases, head_size = "
             "n_embd / n_head and n_kv_head = n_head"),
            ((c.attention, c.score, c.window, c.n_expert, c.qk_norm) != ("softmax", "scaled_dot", 0, 0, False),
             "softmax attention (the scaled dot product, no window), a dense MLP and no qk_norm")]:
        if wrong:
            raise UsageError(f"ViTForImageClassification has {problem} only: no export for this model")


def save(model, path, meta):
    """Write a ViT's model.safetensors, config.json and preprocessor_config.json (meta: its dataset's, for
    the classes and the normalisation) to path, which transformers' ViTForImageClassification loads."""
    c = model.config
    check_exportable(c)
    n = (c.image_size // c.patch_size) ** 2 + 1
    tensors = {}
    for ours, t in model.state_dict().items():
        theirs = names(c.n_layer)[ours]
        if ours == "encoder.wpe.weight":
            t = t[:n][None]  # the positions a ViT of this image_size reads: (1, N + 1, C)
        elif ours == "wte.weight":
            t = t.view(c.n_embd, c.channels, c.patch_size, c.patch_size)
        for name, piece in zip(theirs, t.detach().cpu().chunk(len(theirs))):
            tensors[name] = piece.contiguous().clone()
    classes = meta.get("classes") or [str(i) for i in range(c.n_classes)]
    hf = dict(model_type="vit", architectures=["ViTForImageClassification"], hidden_size=c.n_embd,
              num_hidden_layers=c.n_layer, num_attention_heads=c.n_head, intermediate_size=c.mlp_hidden,
              hidden_act={"none": "gelu", "tanh": "gelu_pytorch_tanh"}[c.gelu_approximate], layer_norm_eps=c.norm_eps,
              image_size=c.image_size, patch_size=c.patch_size, num_channels=c.channels, qkv_bias=True,
              encoder_stride=c.patch_size, hidden_dropout_prob=c.dropout, attention_probs_dropout_prob=c.dropout,
              id2label=dict(enumerate(classes)), label2id={name: i for i, name in enumerate(classes)},
              dtype=str(model.wte.weight.dtype).removeprefix("torch."))
    norm = meta.get("normalize", dict(mean=0.5, std=0.5))
    per_channel = {k: v if isinstance(v, list) else [v] * c.channels for k, v in norm.items()}
    processor = dict(image_processor_type="ViTImageProcessor", do_resize=True, resample=2,
                     size=dict(height=c.image_size, width=c.image_size), do_rescale=meta.get("kind") != "audio",
                     rescale_factor=1 / 255, do_normalize=True, image_mean=per_channel["mean"],
                     image_std=per_channel["std"])
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    for name, obj in (("config.json", hf), ("preprocessor_config.json", processor)):
        with open(os.path.join(path, name), "w") as f:
            json.dump(obj, f, indent=2)
    return "vit"


def export(model, meta, path):
    """python hf.py export of a ViT run: save, in one line what went wrong or what was written; 0."""
    try:
        save(model, path, meta)
    except OSError as e:  # path cannot be written
        raise UsageError(f"could not write {path} ({e.strerror or e}): choose another directory") from None
    print(f"hf.py: ViTForImageClassification ({len(meta.get('classes', []))} classes) and preprocessor_config.json "
          f"written to {path}")
    return 0
