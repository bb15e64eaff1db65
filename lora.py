"""
LoRA (Hu et al. 2021): finetune a model through a low-rank update beside each adapted Linear layer,
W x + (alpha / r) B A x, with A (r, in) and B (out, r) the only weights that train. B starts at zero,
so the first step's model is the base model exactly; the optimizer holds r (in + out) numbers a
layer instead of in x out. The adapted layers keep their weight's and bias's names, so a checkpoint
holds the base weights as they were, beside lora_A and lora_B; merged, it is a plain model again.
"""

import json
import math
import os
import re

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import save_file

from quantize import plain_linear


class LoRALinear(nn.Linear):
    """A Linear layer with a LoRA update: y = x Wᵀ + b + (alpha / r) dropout(x) Aᵀ Bᵀ, W and b frozen."""

    def __init__(self, base, rank, alpha, dropout=0.0):
        super().__init__(base.in_features, base.out_features, bias=base.bias is not None, device="meta")
        self.weight, self.bias = base.weight, base.bias  # the base's own tensors: their names stay
        self.scaling = alpha / rank
        self.lora_A = nn.Parameter(torch.empty(rank, base.in_features, device=base.weight.device))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, rank, device=base.weight.device))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))  # as nn.Linear (and peft) draw their weights
        self.lora_dropout = nn.Dropout(dropout)

    def forward(self, x):
        update = self.lora_dropout(x) @ self.lora_A.mT.to(x.dtype) @ self.lora_B.mT.to(x.dtype)
        return F.linear(x, self.weight, self.bias) + self.scaling * update

    def delta(self):
        """ΔW = (alpha / r) B A, (out, in): what merging adds to the weight."""
        return self.scaling * (self.lora_B @ self.lora_A)


def add_lora(model, rank, alpha, dropout=0.0, targets=("c_attn",)):
    """Adapt every Linear layer of model whose name ends in one of targets (GPT-2's c_attn: the
    attention's q, k and v, peft's default for GPT-2) with a LoRA update of this rank, and freeze
    every other parameter. Returns the adapted layers' names."""
    linears = [(name, m) for name, m in model.named_modules() if plain_linear(m)]
    named = [(name, m) for name, m in linears if name.rsplit(".", 1)[-1] in targets]
    if not named:
        have = sorted({name.rsplit(".", 1)[-1] for name, _ in linears})
        raise ValueError(f"no Linear layer is named {', '.join(targets)}: choose lora_targets among {', '.join(have)}")
    for p in model.parameters():
        p.requires_grad_(False)
    for name, m in named:
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, LoRALinear(m, rank, alpha, dropout))
    return [name for name, _ in named]


@torch.no_grad()
def merge_lora(model):
    """Fold each LoRALinear's update into its weight, in place: W + (alpha / r) B A in a plain Linear,
    which quantizing (quantize.py) and decode_layout may then replace. Returns the model."""
    for name, m in [(n, m) for n, m in model.named_modules() if isinstance(m, LoRALinear)]:
        linear = nn.Linear(m.in_features, m.out_features, bias=False, device="meta")
        linear.weight, linear.bias = nn.Parameter(m.weight + m.delta().to(m.weight.dtype)), m.bias
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, linear)
    return model


@torch.no_grad()
def merged_state(state, scaling):
    """A checkpoint's state dict with each LoRA update added into its weight, W + scaling B A, and
    lora_A, lora_B dropped: the plain model's state."""
    out = {k: v for k, v in state.items() if not k.endswith((".lora_A", ".lora_B"))}
    for k in [k for k in state if k.endswith(".lora_A")]:
        layer = k.removesuffix(".lora_A")
        w = out[f"{layer}.weight"]
        update = state[f"{layer}.lora_B"].float() @ state[k].float()  # (out, r) @ (r, in)
        out[f"{layer}.weight"] = (w.float() + scaling * update).to(w.dtype)
    return out


def save_peft(path, model, state, train_config, pieces, **config):
    """Write the adapters of a LoRA checkpoint's state, for the plain `model` exported from it (its vocabulary
    perhaps cut), as peft's adapter_config.json (with config's entries) and adapter_model.safetensors.
    pieces(name, t) -> {a Hugging Face tensor: its rows of t}: each adapted Linear of ours becomes each module
    Hugging Face has for it (q, k and v for c_attn) with A and its rows of B, so that ΔW is the trained one, and
    peft adds (alpha / r) B A x to each module's output as LoRALinear does. A (r, in) and B (out, r) keep these
    shapes for GPT-2's Conv1D too, whose (in, out) weight config's fan_in_fan_out announces."""
    tensors = {}
    for layer in [k.removesuffix(".lora_A") for k in state if k.endswith(".lora_A")]:
        B = state[layer + ".lora_B"][:model.get_submodule(layer).weight.size(0)]  # the exported vocabulary
        for n, b in pieces(layer + ".weight", B).items():
            for ab, t in zip("AB", (state[layer + ".lora_A"], b)):
                tensors[f"base_model.model.{n.removesuffix('.weight')}.lora_{ab}.weight"] = t.contiguous().clone()
    targets = {re.sub(r"^.*?\.\d+\.(.*)\.lora_A\.weight$", r"\1", n) for n in tensors if "lora_A" in n}
    config = dict(peft_type="LORA", r=train_config["lora_rank"], lora_alpha=train_config["lora_alpha"],
                  lora_dropout=train_config["lora_dropout"], target_modules=sorted(targets),  # peft matches the end
                  bias="none", inference_mode=True) | config
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"), metadata={"format": "pt"})
    os.umask(umask := os.umask(0o22))  # reading the umask sets it: set it back
    os.chmod(os.path.join(path, "adapter_model.safetensors"), 0o666 & ~umask)  # safetensors writes 0600
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2)


def lora_line(model):
    """The start line's account of a LoRA run: what trains, and AdamW's state (two moments in fp32)
    against a full finetune's."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    layers = sum(isinstance(m, LoRALinear) for m in model.modules())
    size = lambda n: f"{n / 1e6:.3g} MB" if n >= 1e6 else f"{n / 1e3:.3g} kB"  # noqa: E731
    return (f"lora: {layers} layers adapted, {trainable:,} of {total:,} parameters train; optimizer state "
            f"{size(8 * trainable)} (a full finetune's: {size(8 * total)})")
