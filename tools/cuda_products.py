"""Weight-only int8 / int4 products on a CUDA GPU at batch 1 (and 8): one decoded token's Linear layers
of GPT-2 124M (12 x c_attn, attn.c_proj, c_fc, mlp.c_proj, then lm_head: 124M weights, twice the L2 in
bf16), captured as one CUDA graph so that launches cost nothing, each form's replay timed. Forms: bf16
F.linear; quantize.Int8Linear (as it runs on CUDA); torch's _weight_int8pack_mm on CUDA, where this
torch has it; quantize.Int4Linear (_weight_int4pack_mm); Int8Linear's forward compiled (Inductor may
fold the int8 -> bf16 conversion into the product). The error: max |y - the dequantized product| /
max |y| over the layers.

    PYTHONPATH=. python tools/cuda_products.py
"""
import torch
import torch.nn as nn
import torch.nn.functional as F
from triton.testing import do_bench

from quantize import Int4Linear, Int8Linear

torch.manual_seed(0)
SHAPES = [(2304, 768), (768, 768), (3072, 768), (768, 3072)] * 12 + [(50304, 768)]  # (out, in)


def int8pack(layer):
    scale = layer.scale.view(torch.bfloat16)
    return lambda x: torch._weight_int8pack_mm(x.reshape(-1, x.size(-1)), layer.weight, scale)


def int8_product(x, weight, scale):
    """Int8Linear's product on CUDA, as a function of tensors for torch.compile."""
    return F.linear(x, weight.to(x.dtype)) * scale


def graphed(fns, x):
    """All the layers' products as one CUDA graph; returns its replay and the outputs it writes."""
    for fn in fns:  # warm up (and compile) before the capture
        fn(x)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [fn(x) for fn in fns]
    return graph.replay, outs


def main():
    linears = [nn.Linear(i, o, bias=False, device="cuda") for o, i in SHAPES]
    q8 = [Int8Linear(m) for m in linears]
    q4 = [Int4Linear(m, 128) for m in linears]
    w8 = [q.weight.to(torch.bfloat16) * q.scale.view(torch.bfloat16)[:, None] for q in q8]
    w4 = [q(torch.eye(m.in_features, device="cuda", dtype=torch.bfloat16)).t() for q, m in zip(q4, linears)]
    bf16 = [m.weight.detach().to(torch.bfloat16) for m in linears]
    compiled_int8 = torch.compile(int8_product, dynamic=False)  # one graph a shape: 5
    forms = {"bf16 F.linear": ([lambda x, w=w: F.linear(x, w) for w in bf16], bf16, 2),
             "Int8Linear (as it runs)": (q8, w8, 1),
             "_weight_int8pack_mm": ([int8pack(q) for q in q8], w8, 1),
             "Int4Linear (g=128)": (q4, w4, 0.5 + 4 / 128),
             "Int8Linear's product, compiled": ([lambda x, q=q: compiled_int8(x, q.weight, q.scale.view(torch.bfloat16))
                                                 for q in q8], w8, 1)}
    n = sum(o * i for o, i in SHAPES)
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | {n / 1e6:.1f}M weights a token")
    for batch in (1, 8):
        x = torch.randn(batch, 768, device="cuda", dtype=torch.bfloat16)
        xs = {768: x, 3072: torch.randn(batch, 3072, device="cuda", dtype=torch.bfloat16)}
        print(f"batch {batch}: {'form':<26} | {'us a token':>10} | {'GB/s of weights':>15} | {'vs bf16':>7} | error")
        base = None
        for name, (fns, ref_weights, bytes_per_weight) in forms.items():
            try:
                calls = [lambda _, f=f, k=w.size(1): f(xs[k]) for f, w in zip(fns, ref_weights)]
                with torch.no_grad():
                    replay, outs = graphed(calls, x)
                    t = do_bench(replay, return_mode="median") / 1e3
                    err = max(((y.float() - F.linear(xs[w.size(1)], w).float()).abs().max() / y.float().abs().max())
                              .item() for y, w in zip(outs, ref_weights))
                base = base or t
                print(f"{'':9}{name:<26} | {t * 1e6:10.1f} | {n * bytes_per_weight / t / 1e9:15.0f} | "
                      f"{base / t:6.2f}x | {err:.1e}", flush=True)
            except Exception as e:  # noqa: BLE001 - a form this torch lacks on CUDA: say so, go on
                print(f"{'':9}{name:<26} | failed: {type(e).__name__}: {str(e).splitlines()[0][:90]}", flush=True)


if __name__ == "__main__":
    main()
