"""The attention kernel's tiles on a Hopper GPU: causal training attention (forward, and forward and
backward) of the kernel autotuned over its own configs, then over those plus larger tiles and deeper
pipelines, against SDPA's cuDNN and FlashAttention-2 backends; the configs each autotuning kept.

    PYTHONPATH=. python tools/kernel_tiles.py [SEQS] [DIMS]   # e.g. 4096 64,128 (the defaults)

B * T = 16k tokens and H * D = 2048, as bench.py attention. TFLOP/s: forward 2·B·H·T²·D (causal),
forward and backward 3.5 times that.
"""
import sys

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

import kernels

# (BLOCK_M, BLOCK_N, num_warps, num_stages) beyond each kernel's own list
EXTRA = {"_fwd": [(128, 128, 8, 2), (128, 128, 8, 4), (128, 64, 4, 4), (128, 64, 8, 5), (64, 128, 4, 3),
                  (128, 128, 4, 3)],
         "_bwd_dkdv": [(64, 128, 8, 2), (64, 128, 8, 3), (64, 64, 4, 3), (32, 128, 8, 4), (64, 128, 4, 2)],
         "_bwd_dq": [(128, 64, 8, 2), (128, 128, 8, 2), (128, 32, 8, 4), (64, 128, 8, 3)]}
ORIGINAL = {name: getattr(kernels, name) for name in EXTRA}


def extended(name):
    """The kernel autotuned over its own bf16 configs and EXTRA's."""
    tuned = ORIGINAL[name][torch.bfloat16]
    configs = list(tuned.configs) + [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s)
                                     for m, n, w, s in EXTRA[name]]
    new = triton.autotune(configs, key=kernels._TUNING_KEY)(tuned.fn)
    return {torch.bfloat16: new, torch.float16: new, torch.float32: ORIGINAL[name][torch.float32]}


def kept(tables):
    return "; ".join(f"{name[1:]} {c.kwargs['BLOCK_M']}x{c.kwargs['BLOCK_N']} w{c.num_warps} s{c.num_stages}"
                     for name, t in tables.items() for c in [t[torch.bfloat16].best_config])


def sdpa(backend):
    def attend(q, k, v):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return attend


def timings(attend, q, k, v, dout):
    def forward():
        with torch.no_grad():
            attend(q, k, v)
    fwd = do_bench(forward, return_mode="median")
    both = do_bench(lambda: torch.autograd.grad(attend(q, k, v), (q, k, v), dout), return_mode="median")
    return fwd, both


def main(seqs, dims):
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__} | bf16, causal")
    print(f"{'D':>4} {'T':>6} {'B x H':>8} | {'method':<24} | {'fwd TFLOP/s':>11} | {'fwd+bwd':>8} | {'grad err':>8}"
          f" | configs kept")
    for D in dims:
        for T in seqs:
            B, H = max(1, 16384 // T), 2048 // D
            flops = 2 * B * H * T * T * D
            q, k, v = (torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                       for _ in range(3))
            dout = torch.randn_like(q)
            ref = torch.autograd.grad(sdpa(SDPBackend.FLASH_ATTENTION)(q, k, v), (q, k, v), dout)
            kernel = lambda q, k, v: kernels.flash_attention(q, k, v, causal=True)  # noqa: E731
            for method, attend in [("SDPA, cuDNN", sdpa(SDPBackend.CUDNN_ATTENTION)),
                                   ("SDPA, FlashAttention-2", sdpa(SDPBackend.FLASH_ATTENTION)),
                                   ("kernel, its configs", kernel), ("kernel, larger tiles too", kernel)]:
                if method.endswith("too"):
                    for name in EXTRA:
                        setattr(kernels, name, extended(name))
                try:
                    fwd, both = timings(attend, q, k, v, dout)
                    grads = torch.autograd.grad(attend(q, k, v), (q, k, v), dout)
                    err = max(((g - r).float().norm() / r.float().norm()).item() for g, r in zip(grads, ref))
                    tables = {n: getattr(kernels, n) for n in EXTRA} if method.startswith("kernel") else {}
                    print(f"{D:>4} {T:>6} {f'{B} x {H}':>8} | {method:<24} | {flops / fwd / 1e9:11.0f} | "
                          f"{3.5 * flops / both / 1e9:8.0f} | {err:8.1e} | {kept(tables)}", flush=True)
                except RuntimeError as e:  # a backend torch lacks for this GPU or shape
                    print(f"{D:>4} {T:>6} | {method}: {str(e).splitlines()[0][:100]}", flush=True)
            for name in EXTRA:
                setattr(kernels, name, ORIGINAL[name])


if __name__ == "__main__":
    main([int(s) for s in (sys.argv[1] if len(sys.argv) > 1 else "4096").split(",")],
         [int(d) for d in (sys.argv[2] if len(sys.argv) > 2 else "64,128").split(",")])
